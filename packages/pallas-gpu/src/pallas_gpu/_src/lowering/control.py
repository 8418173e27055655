"""Lowering rules for control flow and the kernel language's structural
primitives: ``scan`` (fori loops), ``while``, ``cond``/``switch``, inlined
calls (nested ``jit``, ``custom_jvp``/``custom_vjp``), ``run_scoped``,
``multiple_of`` and ``debug_print``.

Loop-carried values are Python variables reassigned at the end of each
iteration; Refs pass through loops unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
from jax import lax

from pallas import backend as pallas_backend
from pallas_gpu._src import compat
from pallas_gpu._src.language import primitives as gpu_primitives
from pallas_gpu._src.lowering.lowering import (
    BlockRef,
    Emitter,
    RuleContext,
    ScratchRef,
    Val,
    cast,
    const,
    expand_to_axis,
    is_bool,
    is_float,
    next_pow2,
    register_lowering,
    tl_dtype,
    uninitialized,
)


def _carry_vars(em: Emitter, vals: Sequence[Val], hint: str) -> list[Val]:
    """Fresh variables initialized to ``vals`` (loop-carried values)."""
    out: list[Val] = []
    for v in vals:
        if isinstance(v, (BlockRef, ScratchRef)):
            out.append(v)
        else:
            out.append(em.assign(v.expr, v.shape, v.dtype, hint))
    return out


def _reassign(em: Emitter, targets: Sequence[Val], values: Sequence[Val]) -> None:
    tmps = []
    for t, v in zip(targets, values):
        if isinstance(t, (BlockRef, ScratchRef)):
            continue
        tmp = em.fresh("t")
        em.emit(f"{tmp} = {v.expr}")
        tmps.append((t, tmp))
    for t, tmp in tmps:
        em.emit(f"{t.expr} = {tmp}")


@register_lowering(compat.scan_p)
def _scan_rule(rc: RuleContext, *args, jaxpr, length, reverse=False, **params):
    num_consts, num_carry = compat.scan_counts(params)
    consts, init = args[:num_consts], args[num_consts : num_consts + num_carry]
    xs = args[num_consts + num_carry :]
    em = rc.em
    carry = _carry_vars(em, init, "carry")
    ys_avals = rc.avals_out[num_carry:]
    ys = [const(em, 0, a.dtype, a.shape) for a in ys_avals]
    ys = _carry_vars(em, ys, "ys")
    it = em.fresh("it")
    with em.block(f"for {it} in {_loop_range(rc.lowering, f'0, {length}')}:"), _nested(rc.lowering):
        i = f"({length - 1} - {it})" if reverse else it
        rows = [_row(em, x, i) for x in xs]
        outs = rc.lowering.lower_jaxpr(jaxpr, [*consts, *carry, *rows])
        new_ys = [_set_row(em, y, i, o) for y, o in zip(ys, outs[num_carry:])]
        _reassign(em, [*carry, *ys], [*outs[:num_carry], *new_ys])
    return [*carry, *ys]


def _loop_range(kl, bounds: str) -> str:
    """The iterator of a lowered loop: with ``warp_specialize``, the outermost
    loops are ``tl.range(..., warp_specialize=True)`` (Triton specializes one
    loop level)."""
    if kl.warp_specialize and not kl.loop_depth:
        return f"tl.range({bounds}, warp_specialize=True)"
    return f"range({bounds})"


@contextlib.contextmanager
def _nested(kl):
    kl.loop_depth += 1
    try:
        yield
    finally:
        kl.loop_depth -= 1


def _row_selector(x: Val, i: str) -> str:
    """True on row ``i`` of ``x`` (broadcastable to its padded shape)."""
    return f"({expand_to_axis(f'tl.arange(0, {next_pow2(x.shape[0])})', 0, len(x.shape))} == {i})"


def _row(em: Emitter, x: Val, i: str) -> Val:
    """``x[i]`` for a run-time ``i``: Triton cannot index registers, so the row
    is selected and summed over (exact: every other term is zero)."""
    w = x
    if is_bool(x.dtype):
        w = em.assign(f"{x.expr}.to(tl.int8)", x.shape, np.int8)
    elif np.dtype(x.dtype).itemsize < 4 and is_float(x.dtype):
        w = cast(em, x, np.float32)
    zero = const(em, 0, w.dtype)
    r = em.assign(
        f"tl.sum(tl.where({_row_selector(x, i)}, {w.expr}, {zero.expr}), axis=0)", x.shape[1:], w.dtype
    )
    return (
        em.assign(f"{r.expr}.to({tl_dtype(w.dtype)})", r.shape, w.dtype) if w is x else cast(em, r, x.dtype)
    )


def _set_row(em: Emitter, ys: Val, i: str, y: Val) -> Val:
    """``ys`` with row ``i`` replaced by ``y``."""
    row = y.expr if y.shape == () else f"{y.expr}[None, {', '.join(':' for _ in y.shape)}]"
    return em.assign(f"tl.where({_row_selector(ys, i)}, {row}, {ys.expr})", ys.shape, ys.dtype)


def _is_fori_loop(cond_jaxpr, body_jaxpr, cond_nconsts: int, body_nconsts: int) -> bool:
    """Whether a while loop is ``lax.fori_loop`` with bounds known only at run
    time: carry ``(i, upper, ...)``, condition ``i < upper``, body ``i + 1``
    with ``upper`` passed through."""
    cj, _ = compat.unwrap_jaxpr(cond_jaxpr)
    bj, _ = compat.unwrap_jaxpr(body_jaxpr)
    if cond_nconsts or len(cj.eqns) != 1 or len(cj.invars) < 2:
        return False
    (lt,) = cj.eqns
    if lt.primitive is not lax.lt_p or list(lt.invars) != list(cj.invars[:2]) or cj.outvars != lt.outvars:
        return False
    i, upper = bj.invars[body_nconsts], bj.invars[body_nconsts + 1]
    if bj.outvars[1] is not upper or np.dtype(i.aval.dtype).kind not in "iu" or i.aval.shape != ():
        return False
    inc = next((e for e in bj.eqns if bj.outvars[0] in e.outvars), None)
    return (
        inc is not None
        and inc.primitive is lax.add_p
        and inc.invars[0] is i
        and isinstance(inc.invars[1], compat.Literal)
        and int(inc.invars[1].val) == 1
    )


@register_lowering(compat.while_p)
def _while_rule(rc: RuleContext, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    cconsts = args[:cond_nconsts]
    bconsts = args[cond_nconsts : cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts :]
    em, kl = rc.em, rc.lowering
    carry = _carry_vars(em, init, "carry")
    if _is_fori_loop(cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
        # A Triton `for` over run-time bounds (scf.for) is software-pipelined
        # (num_stages); a `while` loop is not.
        it = em.fresh("it")
        bounds = f"_loop_bound({carry[0].expr}), _loop_bound({carry[1].expr})"
        with em.block(f"for {it} in {_loop_range(kl, bounds)}:"), _nested(kl):
            outs = kl.lower_jaxpr(body_jaxpr, [*bconsts, *carry])
            _reassign(em, carry, outs)
        return carry
    (pred,) = kl.lower_jaxpr(cond_jaxpr, [*cconsts, *carry])
    p = em.assign(pred.expr, (), np.bool_, "pred")
    with em.block(f"while {p.expr}:"):
        outs = kl.lower_jaxpr(body_jaxpr, [*bconsts, *carry])
        _reassign(em, carry, outs)
        (pred,) = kl.lower_jaxpr(cond_jaxpr, [*cconsts, *carry])
        em.emit(f"{p.expr} = {pred.expr}")
    return carry


@register_lowering(compat.cond_p)
def _cond_rule(rc: RuleContext, index, *ops, branches, **_):
    em, kl = rc.em, rc.lowering
    if index.shape != ():
        raise rc.error("the predicate of lax.cond must be a scalar")
    outs = [em.fresh("r") for _ in rc.avals_out]
    results = [Val(o, a.shape, a.dtype) for o, a in zip(outs, rc.avals_out)]
    n = len(branches)
    for b, br in enumerate(branches):
        if n == 1:
            header = None
        elif b == 0:
            header = f"if {index.expr} <= 0:" if n > 2 else f"if {index.expr} == 0:"
        elif b == n - 1:
            header = "else:"
        else:
            header = f"elif {index.expr} == {b}:"
        with em.block(header) if header else _nullctx():
            vals = kl.lower_jaxpr(br, list(ops))
            for o, v in zip(outs, vals):
                em.emit(f"{o} = {v.expr}")
    return results


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _inline_rule(param: str):
    def rule(rc: RuleContext, *args, **params):
        return rc.lowering.lower_jaxpr(params[param], list(args))

    return rule


register_lowering(compat.jit_p)(_inline_rule("jaxpr"))
register_lowering(compat.custom_jvp_call_p)(_inline_rule("call_jaxpr"))
register_lowering(compat.custom_vjp_call_p)(_inline_rule("call_jaxpr"))


@register_lowering(pallas_backend.run_scoped_p)
def _run_scoped_rule(rc: RuleContext, *consts, jaxpr, num_consts):
    em = rc.em
    scratch = []
    for a in jaxpr.in_avals[num_consts:]:
        inner = a.inner_aval if hasattr(a, "inner_aval") else a
        v = uninitialized(em, inner.shape, inner.dtype)
        scratch.append(ScratchRef(v.expr, tuple(inner.shape), np.dtype(inner.dtype)))
    return rc.lowering.lower_jaxpr(jaxpr, [*consts, *scratch])


@register_lowering(pallas_backend.grid_axis_index_p)
def _grid_axis_index_rule(rc: RuleContext, *, axis_name):
    """``lax.axis_index(name)`` of a named grid (``grid=(("i", 4),)``): the
    index along that grid axis, as ``pl.program_id`` gives it."""
    names = tuple(rc.lowering.gm.grid_names)
    if axis_name not in names:
        raise rc.error(f"axis {axis_name!r} is not a grid axis of the kernel (grid names {names})")
    return rc.lowering.grid_ids[names.index(axis_name)]


@register_lowering(pallas_backend.multiple_of_p)
def _multiple_of_rule(rc: RuleContext, x, *, values):
    if x.shape == ():
        return rc.out(f"tl.multiple_of({x.expr}, {values[0]})")
    vals = list(values) if len(values) == len(x.shape) else [values[0]] * len(x.shape)
    return rc.out(f"tl.multiple_of({x.expr}, {vals})")


@register_lowering(pallas_backend.debug_print_p)
def _debug_print_rule(rc: RuleContext, *args, fmt):
    if fmt.count("{}") != len(args):
        raise rc.error("pl.debug_print in Triton kernels needs one '{}' per argument")
    pieces = fmt.split("{}")
    em = rc.em
    if not args:
        em.emit(f"tl.device_print({fmt!r})")
    for i, a in enumerate(args):
        prefix = pieces[i] if i else pieces[0]
        em.emit(f"tl.device_print({prefix!r}, {a.expr})")
    return []


@register_lowering(gpu_primitives.debug_barrier_p)
def _debug_barrier_rule(rc: RuleContext):
    rc.em.emit("tl.debug_barrier()")
    return []
