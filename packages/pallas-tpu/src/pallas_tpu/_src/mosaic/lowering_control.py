"""Mosaic rules for control flow: ``cond``/``pl.when`` (``scf.if``),
``fori_loop`` and ``scan`` (``scf.for``; xs and ys through VMEM scratch), ``while_loop``
(``scf.while``), inlined calls, and the grid's named axes."""

from __future__ import annotations

from jax import lax
from jaxlib import version as jaxlib_version
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, scf, vector
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.mosaic.lowering import (
    BOOL_MEMORY_DTYPE,
    aval_type,
    constant,
    index,
    is_bool,
    lower_jaxpr,
    memref_type,
    physical,
    register_lowering,
    shape_cast,
    value_type,
)


def _branch(ctx, block, jaxpr, args) -> None:
    with ir.InsertionPoint(block):
        scf.YieldOp(lower_jaxpr(ctx.kernel, jaxpr, args))


@register_lowering(compat.cond_p)
def _cond(ctx, idx, *args, branches, **_):
    types = [aval_type(a) for a in ctx.avals_out]
    return _cond_chain(ctx, idx, list(branches), args, types, first=0)


def _cond_chain(ctx, idx, branches, args, types, first):
    """Branch ``first`` if ``idx == first``, else the rest (the last branch
    takes every index above: ``lax.switch`` clamps)."""
    if len(branches) == 1:
        return lower_jaxpr(ctx.kernel, branches[0], args)
    if len(branches) == 2 and first == 0:
        pred = arith.cmpi(arith.CmpIPredicate.ne, idx, constant(0, (), "int32"))
        op = scf.IfOp(pred, types, has_else=True)
        _branch(ctx, op.then_block, branches[1], args)
        _branch(ctx, op.else_block, branches[0], args)
        return list(op.results)
    pred = arith.cmpi(arith.CmpIPredicate.sle, idx, constant(first, (), "int32"))
    op = scf.IfOp(pred, types, has_else=True)
    _branch(ctx, op.then_block, branches[0], args)
    with ir.InsertionPoint(op.else_block):
        scf.YieldOp(_cond_chain(ctx, idx, branches[1:], args, types, first + 1))
    return list(op.results)


def _fori_counter(jaxpr, n_consts: int, carry) -> bool:
    """Whether the scan is ``fori_loop``'s: its first carry is an int32
    counter the body increments by one (it then becomes the loop's
    induction variable, as in JAX's lowering)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if not carry or len(jaxpr.invars) <= n_consts or len(jaxpr.outvars) < 1:
        return False
    i, out = jaxpr.invars[n_consts], jaxpr.outvars[0]
    if str(i.aval.dtype) != "int32" or i.aval.shape:
        return False
    for eqn in jaxpr.eqns:
        if eqn.outvars[0] is out and eqn.primitive is lax.add_p:
            a, b = eqn.invars
            one = [x for x in (a, b) if x is not i]
            return len(one) == 1 and isinstance(one[0], compat.Literal) and one[0].val == 1
    return False


@register_lowering(compat.scan_p)
def _scan(ctx, *args, jaxpr, length, reverse, unroll=1, **params):
    """``scf.for`` (a fully unrolled ``unroll`` emits the body ``length``
    times; a partial one is Mosaic's ``tpu.late_unroll``), as JAX lowers it.
    A scan over arrays (xs, stacked ys) goes through VMEM scratch."""
    consts, carry, xs = compat.scan_split(params, args)
    unroll = length if unroll is True or unroll == 0 else int(unroll)
    if xs or len(ctx.avals_out) != len(carry):
        return _scan_arrays(ctx, consts, carry, xs, jaxpr, length, reverse, unroll)
    # Without xs and ys the order of the steps is not observable: reverse is moot.
    counter = _fori_counter(jaxpr, len(consts), carry)
    body_carry = list(carry[1:]) if counter else list(carry)

    def body(i, values):
        outs = lower_jaxpr(ctx.kernel, jaxpr, [*consts, *([i] if counter else []), *values])
        return outs[1:] if counter else outs

    start = carry[0] if counter else constant(0, (), "int32")
    if length and unroll >= length:
        for k in range(length):
            body_carry = body(arith.addi(start, constant(k, (), "int32")) if counter else None, body_carry)
        end = arith.addi(start, constant(length, (), "int32"))
        return [end, *body_carry] if counter else body_carry
    end = arith.addi(start, constant(length, (), "int32")) if counter else constant(length, (), "int32")
    return _for(0, length, body_carry, body, unroll, start=start, end=end, counter=counter)


def _carried(values) -> list:
    """``scf.for``-carried ``values`` with each 1-D vector as a ``(1, n)`` one:
    Mosaic infers the carry's layout of a 1-D vector taken from row ``r > 0`` of a
    2-D one (a PRNG key of a split) without its implicit dim, and refuses its own
    ``tpu.assume_layout`` ("Invalid input layout"); ``scf.while`` takes it."""
    return [_with_shape(v, [1, *_vector_shape(v)]) if len(_vector_shape(v)) == 1 else v for v in values]


def _uncarried(values, like) -> list:
    """``values`` (from ``_carried``) back in the types of ``like``."""
    return [
        _with_shape(v, _vector_shape(t)) if v.type != t.type else v for v, t in zip(values, like, strict=True)
    ]


def _vector_shape(v) -> list:
    return list(ir.VectorType(v.type).shape) if isinstance(v.type, ir.VectorType) else []


def _with_shape(v, shape) -> ir.Value:
    return vector.shape_cast(ir.VectorType.get(shape, ir.VectorType(v.type).element_type), v)


# libtpu 0.0.42.1 (jaxlib 0.10's, the TPU v5e's) aborts the whole process on a loop marked
# ``tpu.late_unroll`` (a failed check in its LLO emitter: "Failed to translate operation
# arith.constant"), where 0.0.48.1 (jaxlib 0.11's) unrolls it: on older jaxlibs the lowering
# unrolls by hand, as JAX 0.10's own lowering does.
_LATE_UNROLL = jaxlib_version.__version_info__ >= (0, 11)


def _for(lo, hi, carry, body, unroll, *, start=None, end=None, counter=False):
    """``scf.for`` from ``start`` (or ``lo``) to ``end`` (or ``hi``) of ``body(i, carry)``."""
    start = constant(lo, (), "int32") if start is None else start
    end = constant(hi, (), "int32") if end is None else end
    if unroll > 1 and not _LATE_UNROLL:
        results = _for_unrolled_by_hand(hi - lo, carry, body, unroll, start)
        return [end, *results] if counter else results
    op = scf.ForOp(start, end, constant(1, (), "int32"), _carried(carry))
    if unroll > 1:
        op.attributes["tpu.late_unroll"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), unroll)
    with ir.InsertionPoint(op.body):
        scf.YieldOp(_carried(body(op.induction_variable, _uncarried(op.inner_iter_args, carry))))
    results = _uncarried(op.results, carry)
    return [end, *results] if counter else results


def _for_unrolled_by_hand(n, carry, body, unroll, start):
    """``n`` steps of ``body(i, carry)`` from ``i = start``: an ``scf.for`` whose step runs
    ``unroll`` bodies, then the ``n % unroll`` left over one by one."""
    full, rest = divmod(n, unroll)
    results = carry
    if full:

        def steps(j, values):
            base = arith.addi(start, arith.muli(j, constant(unroll, (), "int32")))
            for k in range(unroll):
                values = body(arith.addi(base, constant(k, (), "int32")), values)
            return values

        op = scf.ForOp(
            constant(0, (), "int32"), constant(full, (), "int32"), constant(1, (), "int32"), _carried(results)
        )
        with ir.InsertionPoint(op.body):
            scf.YieldOp(_carried(steps(op.induction_variable, _uncarried(op.inner_iter_args, results))))
        results = _uncarried(op.results, results)
    if rest:
        rest_start = arith.addi(start, constant(full * unroll, (), "int32"))
        rest_end = arith.addi(rest_start, constant(rest, (), "int32"))
        results = _for(0, rest, results, body, 1, start=rest_start, end=rest_end)
    return results


def _scan_arrays(ctx, consts, carry, xs, jaxpr, length, reverse, unroll):
    """A scan with xs or ys: in a ``tpu.region``, each xs is stored into a VMEM
    buffer and step ``i`` loads row ``i`` (``length - 1 - i`` when ``reverse``);
    each y is stored into row ``i`` of a buffer read whole after the loop."""
    nc = len(carry)
    x_avals = [physical(a) for a in ctx.avals_in[len(ctx.avals_in) - len(xs) :]]
    y_avals = [physical(a) for a in ctx.avals_out[nc:]]
    region = tpu.RegionOp([aval_type(a) for a in ctx.avals_out])
    with ir.InsertionPoint(region.body):
        x_bufs = [_scratch(a) for a in x_avals]
        for buf, x, a in zip(x_bufs, xs, x_avals, strict=True):
            _store(buf, x, a, None)
        y_bufs = [_scratch(a) for a in y_avals]

        def body(i, values):
            row = i if not reverse else arith.subi(constant(length - 1, (), "int32"), i)
            x_rows = [_load(buf, a, row) for buf, a in zip(x_bufs, x_avals)]
            outs = lower_jaxpr(ctx.kernel, jaxpr, [*consts, *values, *x_rows])
            for buf, y, a in zip(y_bufs, outs[nc:], y_avals, strict=True):
                _store(buf, y, a, row)
            return outs[:nc]

        if length and unroll >= length:
            carry = list(carry)
            for k in range(length):
                carry = body(constant(k, (), "int32"), carry)
        else:
            carry = _for(0, length, carry, body, unroll)
        tpu.yield_([*carry, *(_load(buf, a, None) for buf, a in zip(y_bufs, y_avals))])
    return list(region.results)


def _scratch(aval) -> ir.Value:
    return memref.alloca(memref_type(aval.shape, aval.dtype, None), [], [])


def _load(buf, aval, row) -> ir.Value:
    """All of ``buf`` (``row`` None) or its row ``row``, as a value of ``aval``'s dtype."""
    shape = list(aval.shape) if row is None else [1, *aval.shape[1:]]
    starts = [index(0 if row is None else row)] + [index(0)] * (len(aval.shape) - 1)
    mem = BOOL_MEMORY_DTYPE if is_bool(aval.dtype) else aval.dtype
    v = vector.load(value_type(shape, mem), buf, starts)
    out_shape = aval.shape if row is None else aval.shape[1:]
    v = shape_cast(v, out_shape, mem)
    if is_bool(aval.dtype):
        v = arith.cmpi(arith.CmpIPredicate.ne, v, constant(0, out_shape, mem))
    return v


def _store(buf, v, aval, row) -> None:
    shape = list(aval.shape) if row is None else [1, *aval.shape[1:]]
    starts = [index(0 if row is None else row)] + [index(0)] * (len(aval.shape) - 1)
    mem = BOOL_MEMORY_DTYPE if is_bool(aval.dtype) else aval.dtype
    if is_bool(aval.dtype):
        v = arith.extui(value_type(aval.shape if row is None else aval.shape[1:], mem), v)
    tpu.vector_store(shape_cast(v, shape, mem), buf, starts, strides=[])


def _fori_while(cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    """Where ``cond`` is ``i < ub`` and ``body`` adds one to ``i`` (the first
    carry), ``(True, where ub is)``: ("const", k) or ("carry", k) for a
    carry the body passes through. ``fori_loop`` with traced bounds is such a
    while loop; it becomes ``scf.for`` (as JAX lowers it)."""
    cj, bj = getattr(cond_jaxpr, "jaxpr", cond_jaxpr), getattr(body_jaxpr, "jaxpr", body_jaxpr)
    carry_c, carry_b = cj.invars[cond_nconsts:], bj.invars[body_nconsts:]
    if not carry_c or len(cj.eqns) != 1 or cj.eqns[0].primitive is not lax.lt_p:
        return None
    i, ub = cj.eqns[0].invars
    if (
        i is not carry_c[0]
        or cj.eqns[0].outvars[0] is not cj.outvars[0]
        or not _fori_counter(bj, body_nconsts, [0])
    ):
        return None
    if ub in cj.invars[:cond_nconsts]:
        return ("const", cj.invars.index(ub))
    if ub in carry_c[1:]:
        k = carry_c.index(ub)
        if bj.outvars[k] is carry_b[k]:
            return ("carry", k)
    return None


@register_lowering(compat.while_p)
def _while(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    cconsts, bconsts = args[:cond_nconsts], args[cond_nconsts : cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts :]
    fori = _fori_while(cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts)
    if fori is not None:
        where, k = fori
        hi = cconsts[k] if where == "const" else init[k]
        carry = init[1:]
        op = scf.ForOp(init[0], hi, constant(1, (), "int32"), _carried(carry))
        with ir.InsertionPoint(op.body):
            args = [*bconsts, op.induction_variable, *_uncarried(op.inner_iter_args, carry)]
            scf.YieldOp(_carried(lower_jaxpr(ctx.kernel, body_jaxpr, args)[1:]))
        return [arith.maxsi(init[0], hi), *_uncarried(op.results, carry)]
    types = [aval_type(a) for a in ctx.avals_out]
    op = scf.WhileOp(types, list(init))
    before = op.before.blocks.append(*types)
    with ir.InsertionPoint(before):
        [pred] = lower_jaxpr(ctx.kernel, cond_jaxpr, [*cconsts, *before.arguments])
        scf.ConditionOp(pred, list(before.arguments))
    after = op.after.blocks.append(*types)
    with ir.InsertionPoint(after):
        scf.YieldOp(lower_jaxpr(ctx.kernel, body_jaxpr, [*bconsts, *after.arguments]))
    return list(op.results)


def _inline(param: str):
    def rule(ctx, *args, **params):
        return lower_jaxpr(ctx.kernel, params[param], args)

    return rule


for _prim, _param in compat.call_primitives():
    register_lowering(_prim)(_inline(_param))


@register_lowering(*compat.identity_primitives(), *compat.sharding_identity_primitives())
def _identity(ctx, *args, **_):
    return list(args) if ctx.eqn.primitive.multiple_results else args[0]


@register_lowering(plb.dynamic_grid_size_p)
def _dynamic_grid_size(ctx, *, axis):
    """``pl.num_programs`` of a grid axis of traced size in an index map: the grid's
    ``tpu.iteration_bound`` there, as in JAX's lowering (and in the kernel body)."""
    return tpu.iteration_bound(axis)


@register_lowering(plb.grid_axis_index_p)
def _grid_axis_index(ctx, *, axis_name):
    names = ctx.kernel.grid_names
    if axis_name not in names:
        raise NotImplementedError(f"axis '{axis_name}' is not a grid axis of the kernel (grid names {names})")
    return ctx.kernel.grid_indices[names.index(axis_name)]
