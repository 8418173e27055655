"""Mosaic rules for reductions and ``dot_general``: sums, max and min
(``vector.multi_reduction``), argmax and argmin (``tpu.reduce_index``), any and
all, cumulative scans, top_k, and ``dot_general`` (``tpu.matmul``)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func, vector
from jaxlib.mosaic.python import tpu

from pallas_tpu._src.mosaic.lowering import (
    Aval,
    aval_type,
    constant,
    is_bool,
    is_float,
    is_unsigned,
    lower_fun,
    register_lowering,
    shape_cast,
)
from pallas_tpu._src.mosaic.lowering_jax012 import needs_jax
from pallas_tpu._src.mosaic.lowering_math import convert

# ---------------------------------------------------------------------------
# Reductions and dot


def _neutral(kind: str, dtype):
    if kind == "add":
        return 0
    big = np.inf if is_float(dtype) else np.iinfo(dtype).max
    small = -np.inf if is_float(dtype) else np.iinfo(dtype).min
    return small if kind == "max" else big


@register_lowering(lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p)
def _reduce(ctx, x, axes, **_):
    aval, out = ctx.avals_in[0], ctx.avals_out[0]
    kind = {lax.reduce_sum_p: "add", lax.reduce_max_p: "max", lax.reduce_min_p: "min"}[ctx.eqn.primitive]
    if is_bool(aval.dtype):
        raise NotImplementedError("reductions of bool are not supported; cast to int32 first")
    if kind == "add":
        name = "add"
    elif is_float(aval.dtype):
        name = f"{kind}imumf"
    else:
        name = f"{kind}{'ui' if is_unsigned(aval.dtype) else 'si'}"
    combining = getattr(vector.CombiningKind, name.upper())
    if not aval.shape:
        return x
    if not out.shape:
        # To a scalar through a 1-element vector, as JAX's lowering: a leading unit dim kept
        # (libtpu 0.0.42.1's Mosaic reduces only to vectors), its element extracted.
        x = shape_cast(x, (1, *aval.shape), aval.dtype)
        acc = constant(_neutral(kind, aval.dtype), (1,), aval.dtype)
        r = vector.multi_reduction(combining, x, acc, [a + 1 for a in axes])
        return shape_cast(r, (), aval.dtype)
    acc = constant(_neutral(kind, aval.dtype), out.shape, aval.dtype)
    return vector.multi_reduction(combining, x, acc, list(axes))


_PRECISION = {"HIGH": "bf16x3", "HIGHEST": "fp32"}


@register_lowering(lax.argmax_p, lax.argmin_p)
def _arg_reduce(ctx, x, axes, index_dtype):
    """``tpu.reduce_index`` along one axis (float32/bfloat16 values)."""
    aval, out = ctx.avals_in[0], ctx.avals_out[0]
    if np.dtype(aval.dtype).name not in ("float32", "bfloat16") or len(axes) != 1:
        raise NotImplementedError(f"{ctx.eqn.primitive.name} of one axis of float32 or bfloat16 values only")
    axis, shape, out_shape = axes[0], aval.shape, out.shape
    if len(shape) == 1:  # Mosaic reduces 2-D and up
        x, axis, shape, out_shape = shape_cast(x, (1, *shape), aval.dtype), 1, (1, *shape), (1, *out_shape)
    kind = "arg_max" if ctx.eqn.primitive is lax.argmax_p else "arg_min"
    kind_attr = ir.Attribute.parse(f"#tpu.reduction_kind<{kind}>")
    if reduce_index_keeps_dim():
        out_shape = (*shape[:axis], 1, *shape[axis + 1 :])
    r = tpu.reduce_index(aval_type(Aval(out_shape, index_dtype)), x, axis, kind_attr)
    return shape_cast(r, out.shape, index_dtype)


@functools.cache
def reduce_index_keeps_dim() -> bool:
    """Whether this jaxlib's ``tpu.reduce_index`` keeps the reduced dim (as size 1: the
    result has the operand's rank, which jaxlib 0.12.1's verifier requires) rather than
    dropping it (what the verifiers of jaxlib 0.12.0 and older require). Asked of the
    dialect itself, once: the kept form is verified on a module of one such op."""
    context = mlir.make_ir_context()
    tpu.register_dialect(context)
    with context, ir.Location.unknown(context):
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("probe", ([ir.Type.parse("vector<8x128xf32>")], []))
            block = fn.add_entry_block()
            with ir.InsertionPoint(block):
                kind = ir.Attribute.parse("#tpu.reduction_kind<arg_max>")
                tpu.reduce_index(ir.Type.parse("vector<8x1xi32>"), block.arguments[0], 1, kind)
                func.ReturnOp([])
        try:
            return bool(module.operation.verify())
        except ir.MLIRError:
            return False


def _any(x, axes):
    return jnp.max(jnp.where(x, 1.0, 0.0), axis=axes) > 0.0


def _all(x, axes):
    return jnp.min(jnp.where(x, 1.0, 0.0), axis=axes) > 0.0


@register_lowering(lax.reduce_or_p, lax.reduce_and_p)
def _reduce_bool(ctx, x, axes, **_):
    # Mosaic reduces floats and ints, not i1: reduce 0/1 floats instead.
    return lower_fun(_any if ctx.eqn.primitive is lax.reduce_or_p else _all, ctx, x, axes=tuple(axes))


@register_lowering(lax.dot_general_p)
def _dot_general(ctx, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
    """``tpu.matmul``; the result is ordered batch, lhs free, rhs free dims (as lax's).
    Mosaic's matmul accumulates in 32 bits: a narrower result (a 16-bit dot without
    ``preferred_element_type``) is accumulated in float32 (int32) and converted."""
    (lc, rc), (lb, rb) = dimension_numbers
    la, ra = ctx.avals_in
    out = ctx.avals_out[0]
    if any(is_unsigned(a.dtype) for a in (la, ra)):
        raise NotImplementedError(
            "dot_general of unsigned integers: Mosaic's matmul is signed; cast to int32"
        )
    lfree = [d for d in range(len(la.shape)) if d not in (*lc, *lb)]
    rfree = [d for d in range(len(ra.shape)) if d not in (*rc, *rb)]
    order = [x for d in (*lb, *lfree) for x in (0, d)] + [x for d in rfree for x in (1, d)]
    parts = ", ".join(str(list(p)) for p in (lc, rc, lfree, rfree, order, lb, rb))
    dims = ir.Attribute.parse(f"#tpu.dot_dimension_numbers<{parts}>")
    prec = precision[0] if isinstance(precision, tuple) else precision
    name = getattr(prec, "name", None)
    if name == "HIGH" and not hasattr(getattr(tpu, "ContractPrecision", None), "kBF16x3"):
        raise needs_jax("a dot of precision HIGH (Mosaic's contract precision bf16x3)", "0.11.2")
    prec_attr = (
        ir.Attribute.parse(f"#tpu.contract_precision<{_PRECISION[name]}>") if name in _PRECISION else None
    )
    acc_dtype = out.dtype
    if np.dtype(out.dtype).itemsize < 4:
        acc_dtype = np.dtype(np.float32 if is_float(out.dtype) else np.int32)
    acc = constant(0, out.shape, acc_dtype)
    res = tpu.matmul(
        aval_type(Aval(out.shape, acc_dtype)),
        lhs,
        rhs,
        acc,
        False,
        dimension_numbers=dims,
        precision=prec_attr,
    )
    return convert(res, acc_dtype, out.dtype, out.shape)


# ---------------------------------------------------------------------------
# Cumulative reductions. JAX's TensorCore lowering has no rule for them; ours
# is a log-step (Hillis-Steele) scan written in jnp and lowered through the
# slice, concatenate and elementwise rules: ceil(log2(n)) shifted combines.

_CUMULATIVE = {
    lax.cumsum_p: (jnp.add, lambda dt: 0),
    lax.cumprod_p: (jnp.multiply, lambda dt: 1),
    lax.cummax_p: (jnp.maximum, lambda dt: -np.inf if is_float(dt) else np.iinfo(dt).min),
    lax.cummin_p: (jnp.minimum, lambda dt: np.inf if is_float(dt) else np.iinfo(dt).max),
    lax.cumlogsumexp_p: (jnp.logaddexp, lambda dt: -np.inf),
}


def _scan(x, *, combine, identity, axis, reverse):
    n = x.shape[axis]
    k = 1
    while k < n:
        pad_shape = list(x.shape)
        pad_shape[axis] = k
        pad = lax.full(pad_shape, identity, x.dtype)
        if reverse:  # element i combines element i + k
            shifted = lax.concatenate([lax.slice_in_dim(x, k, n, axis=axis), pad], axis)
        else:
            shifted = lax.concatenate([pad, lax.slice_in_dim(x, 0, n - k, axis=axis)], axis)
        x = combine(x, shifted)
        k *= 2
    return x


@register_lowering(*_CUMULATIVE)
def _cumulative(ctx, x, *, axis, reverse):
    aval = ctx.avals_in[0]
    if is_bool(aval.dtype):
        raise NotImplementedError(f"{ctx.eqn.primitive.name} of bool; cast to int32 first")
    if not aval.shape:
        return x
    combine, identity = _CUMULATIVE[ctx.eqn.primitive]
    return lower_fun(
        _scan, ctx, x, combine=combine, identity=identity(aval.dtype), axis=axis, reverse=reverse
    )


def _top_k(x, *, k, axis):
    # k rounds of: the max, the lowest index holding it among the untaken, taken.
    # Only max/min reductions and selects (JAX's rule uses argmax, whose tie
    # order is the hardware's); ours is stable by construction.
    n = x.shape[axis]
    low = -np.inf if is_float(x.dtype) else np.iinfo(x.dtype).min
    iota = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    taken = jnp.zeros(x.shape, jnp.bool_)
    vals, idxs = [], []
    for _ in range(k):
        curr = jnp.where(taken, jnp.array(low, x.dtype), x)
        val = jnp.max(curr, axis=axis, keepdims=True)
        idx = jnp.min(jnp.where((curr == val) & ~taken, iota, n), axis=axis, keepdims=True)
        taken = taken | (iota == idx)
        vals.append(val)
        idxs.append(idx)
    return lax.concatenate(vals, axis), lax.concatenate(idxs, axis)


@register_lowering(lax.top_k_p)
def _top_k_rule(ctx, x, *, k, axis=-1, **_):
    """The ``k`` largest along ``axis`` and their indices (ties: lowest index
    first, so ``is_stable`` either way), from ``k`` max/min reductions."""
    aval = ctx.avals_in[0]
    if np.dtype(aval.dtype).name not in ("float32", "bfloat16", "int32") or len(aval.shape) < 2:
        raise NotImplementedError("top_k of float32, bfloat16 or int32 arrays of rank >= 2 only")
    return lower_fun(_top_k, ctx, x, multiple_results=True, k=int(k), axis=axis % len(aval.shape))
