"""Mosaic rules for control flow: ``cond``/``pl.when`` (``scf.if``),
``fori_loop`` (its ``scan`` without xs: ``scf.for``), ``while_loop``
(``scf.while``), inlined calls, and the grid's named axes."""

from __future__ import annotations

from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, scf

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.lowering import (
    aval_type,
    constant,
    lower_jaxpr,
    register_lowering,
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
def _scan(ctx, *args, jaxpr, length, reverse, **params):
    consts, carry, xs = compat.scan_split(params, args)
    if xs or len(ctx.avals_out) != len(carry):
        raise NotImplementedError(
            "lax.scan over arrays (xs or stacked ys) is not supported in TPU kernels; use "
            "lax.fori_loop and index Refs with the loop counter"
        )
    if reverse:
        raise NotImplementedError("lax.scan(reverse=True) is not supported")
    step = constant(1, (), "int32")
    if _fori_counter(jaxpr, len(consts), carry):
        lo = carry[0]
        hi = arith.addi(lo, constant(length, (), "int32"))
        op = scf.ForOp(lo, hi, step, list(carry[1:]))
        with ir.InsertionPoint(op.body):
            outs = lower_jaxpr(ctx.kernel, jaxpr, [*consts, op.induction_variable, *op.inner_iter_args])
            scf.YieldOp(outs[1:])
        return [hi, *op.results]
    op = scf.ForOp(constant(0, (), "int32"), constant(length, (), "int32"), step, list(carry))
    with ir.InsertionPoint(op.body):
        outs = lower_jaxpr(ctx.kernel, jaxpr, [*consts, *op.inner_iter_args])
        scf.YieldOp(outs)
    return list(op.results)


@register_lowering(compat.while_p)
def _while(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
    cconsts, bconsts = args[:cond_nconsts], args[cond_nconsts : cond_nconsts + body_nconsts]
    init = args[cond_nconsts + body_nconsts :]
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


@register_lowering(*compat.identity_primitives())
def _identity(ctx, *args, **_):
    return list(args) if ctx.eqn.primitive.multiple_results else args[0]


@register_lowering(plb.grid_axis_index_p)
def _grid_axis_index(ctx, *, axis_name):
    names = ctx.kernel.grid_names
    if axis_name not in names:
        raise NotImplementedError(f"axis '{axis_name}' is not a grid axis of the kernel (grid names {names})")
    return ctx.kernel.grid_indices[names.index(axis_name)]
