"""Lowering rules for values: elementwise math, casts, shapes, reductions,
scans and dots. Each rule returns the generated expression for its result."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from jax import lax

from pallas_gpu._src import compat
from pallas_gpu._src.lowering import (
    RuleContext,
    Val,
    cast,
    const,
    expand_to_axis,
    fill_padding,
    is_bool,
    is_float,
    is_unsigned_int,
    next_pow2,
    pad_shape,
    register_lowering,
    tl_dtype,
    valid_mask,
)

_HALF = {np.dtype("float16"), np.dtype(ml_dtypes.bfloat16)}


def _upcast(rc: RuleContext, x: Val) -> Val:
    """16-bit floats are computed in f32 (Triton's math functions take f32/f64)."""
    return cast(rc.em, x, np.float32) if x.dtype in _HALF else x


def _finish(rc: RuleContext, expr: str, dtype) -> Val:
    """Assigns ``expr`` (computed in ``dtype``) and casts it to the output dtype."""
    a = rc.avals_out[0]
    v = rc.em.assign(expr, a.shape, dtype)
    return cast(rc.em, v, a.dtype)


# ---------------------------------------------------------------------------
# Elementwise

_INFIX = {
    lax.add_p: "+",
    lax.sub_p: "-",
    lax.mul_p: "*",
    lax.and_p: "&",
    lax.or_p: "|",
    lax.xor_p: "^",
    lax.eq_p: "==",
    lax.ne_p: "!=",
    lax.lt_p: "<",
    lax.le_p: "<=",
    lax.gt_p: ">",
    lax.ge_p: ">=",
    lax.shift_left_p: "<<",
}


_BF16 = np.dtype(ml_dtypes.bfloat16)


def _wide(rc: RuleContext, fmt: str, *xs: Val) -> Val:
    """``fmt.format(*exprs)`` computed in f32 when the operands are bf16.

    f32 carries more than twice bf16's precision, so one f32 operation
    rounded to bf16 is exactly the bf16 operation; it also keeps Triton's
    interpreter, which holds bf16 as raw uint16, correct.
    """
    if xs and xs[0].dtype == _BF16:
        ws = [cast(rc.em, x, np.float32) for x in xs]
        a = rc.avals_out[0]
        v = rc.em.assign(
            fmt.format(*[w.expr for w in ws]), a.shape, np.float32 if a.dtype == _BF16 else a.dtype
        )
        return cast(rc.em, v, a.dtype)
    return rc.out(fmt.format(*[x.expr for x in xs]))


def _infix_rule(op: str):
    def rule(rc: RuleContext, x, y, **_):
        return _wide(rc, "{} " + op + " {}", x, y)

    return rule


for _p, _op in _INFIX.items():
    register_lowering(_p)(_infix_rule(_op))


@register_lowering(lax.div_p)
def _div_rule(rc: RuleContext, x, y, **_):
    if is_float(x.dtype):
        return _wide(rc, "{} / {}", x, y)
    return rc.out(f"{x.expr} // {y.expr}")  # Triton's // truncates, like lax.div


@register_lowering(lax.rem_p)
def _rem_rule(rc: RuleContext, x, y, **_):
    return _wide(rc, "{} % {}", x, y)  # C fmod/srem semantics, like lax.rem


def _minmax(fn: str, bool_op: str):
    def rule(rc: RuleContext, x, y, **_):
        if is_bool(x.dtype):
            return rc.out(f"{x.expr} {bool_op} {y.expr}")
        if is_float(x.dtype):
            return _wide(rc, f"tl.{fn}({{}}, {{}}, propagate_nan=tl.PropagateNan.ALL)", x, y)
        return rc.out(f"tl.{fn}({x.expr}, {y.expr})")

    return rule


register_lowering(lax.max_p)(_minmax("maximum", "|"))
register_lowering(lax.min_p)(_minmax("minimum", "&"))


@register_lowering(lax.shift_right_arithmetic_p)
def _sra_rule(rc: RuleContext, x, y, **_):
    if is_unsigned_int(x.dtype):
        s = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}[x.dtype.itemsize]
        return rc.out(
            f"({x.expr}.to(tl.{s}, bitcast=True) >> {y.expr}.to(tl.{s}, bitcast=True)).to({tl_dtype(x.dtype)}, bitcast=True)"
        )
    return rc.out(f"{x.expr} >> {y.expr}")


@register_lowering(lax.shift_right_logical_p)
def _srl_rule(rc: RuleContext, x, y, **_):
    if is_unsigned_int(x.dtype):
        return rc.out(f"{x.expr} >> {y.expr}")
    u = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}[x.dtype.itemsize]
    return rc.out(
        f"({x.expr}.to(tl.{u}, bitcast=True) >> {y.expr}.to(tl.{u}, bitcast=True)).to({tl_dtype(x.dtype)}, bitcast=True)"
    )


# Unary float functions: primitive -> call (computed in f32 for 16-bit floats).
_FLOAT_UNARY = {
    lax.exp_p: "tl.exp",
    lax.exp2_p: "tl.exp2",
    lax.log_p: "tl.log",
    lax.log1p_p: "libdevice.log1p",
    lax.expm1_p: "libdevice.expm1",
    lax.sqrt_p: "tl.sqrt",
    lax.rsqrt_p: "tl.rsqrt",
    lax.cbrt_p: "libdevice.cbrt",
    lax.sin_p: "tl.sin",
    lax.cos_p: "tl.cos",
    lax.tan_p: "libdevice.tan",
    lax.tanh_p: "libdevice.tanh",
    lax.asin_p: "libdevice.asin",
    lax.acos_p: "libdevice.acos",
    lax.atan_p: "libdevice.atan",
    lax.sinh_p: "libdevice.sinh",
    lax.cosh_p: "libdevice.cosh",
    lax.asinh_p: "libdevice.asinh",
    lax.acosh_p: "libdevice.acosh",
    lax.atanh_p: "libdevice.atanh",
    lax.erf_p: "tl.erf",
    lax.erf_inv_p: "libdevice.erfinv",
    lax.floor_p: "tl.floor",
    lax.ceil_p: "tl.ceil",
}


def _float_unary(fn: str):
    def rule(rc: RuleContext, x, **_):
        if not is_float(x.dtype):
            raise rc.error(f"{fn} needs a floating-point operand, got {x.dtype}")
        u = _upcast(rc, x)
        return _finish(rc, f"{fn}({u.expr})", u.dtype)

    return rule


for _p, _fn in _FLOAT_UNARY.items():
    register_lowering(_p)(_float_unary(_fn))


@register_lowering(lax.logistic_p)
def _logistic_rule(rc: RuleContext, x, **_):
    u = _upcast(rc, x)
    return _finish(rc, f"1.0 / (1.0 + tl.exp(-{u.expr}))", u.dtype)


@register_lowering(lax.round_p)
def _round_rule(rc: RuleContext, x, *, rounding_method, **_):
    u = _upcast(rc, x)
    fn = (
        "libdevice.rint"
        if int(rounding_method) == int(lax.RoundingMethod.TO_NEAREST_EVEN)
        else "libdevice.round"
    )
    return _finish(rc, f"{fn}({u.expr})", u.dtype)


@register_lowering(lax.is_finite_p)
def _is_finite_rule(rc: RuleContext, x, **_):
    u = _upcast(rc, x)
    return rc.out(f"tl.abs({u.expr}) < float('inf')")


@register_lowering(lax.abs_p)
def _abs_rule(rc: RuleContext, x, **_):
    return _wide(rc, "tl.abs({})", x)


@register_lowering(lax.neg_p)
def _neg_rule(rc: RuleContext, x, **_):
    return _wide(rc, "-{}", x)


@register_lowering(lax.not_p)
def _not_rule(rc: RuleContext, x, **_):
    return rc.out(f"~{x.expr}")


@register_lowering(lax.sign_p)
def _sign_rule(rc: RuleContext, x, **_):
    if x.dtype == _BF16:
        return cast(rc.em, _sign_rule(_f32_ctx(rc), cast(rc.em, x, np.float32)), x.dtype)
    one, zero = const(rc.em, 1, x.dtype), const(rc.em, 0, x.dtype)
    if is_unsigned_int(x.dtype):
        return rc.out(f"tl.where({x.expr} > {zero.expr}, {one.expr}, {zero.expr})")
    return rc.out(
        f"tl.where({x.expr} > {zero.expr}, {one.expr}, tl.where({x.expr} < {zero.expr}, -{one.expr}, {x.expr}))"
    )


@register_lowering(lax.square_p)
def _square_rule(rc: RuleContext, x, **_):
    return _wide(rc, "{0} * {0}", x)


@register_lowering(lax.integer_pow_p)
def _integer_pow_rule(rc: RuleContext, x, *, y, **_):
    em = rc.em
    if x.dtype == _BF16:
        return cast(em, _integer_pow_rule(_f32_ctx(rc), cast(em, x, np.float32), y=y), x.dtype)
    if y == 0:
        return const(em, 1, x.dtype, x.shape)
    acc, base, n = None, x, abs(y)
    while n:  # square-and-multiply
        if n & 1:
            acc = base if acc is None else em.assign(f"{acc.expr} * {base.expr}", x.shape, x.dtype)
        n >>= 1
        if n:
            base = em.assign(f"{base.expr} * {base.expr}", x.shape, x.dtype)
    if y < 0:
        one = const(em, 1, x.dtype)
        return rc.out(f"{one.expr} / {acc.expr}")
    return acc


def _f32_ctx(rc: RuleContext) -> RuleContext:
    """``rc`` with f32 in place of bf16 output avals."""
    import dataclasses

    avals = [a.update(dtype=np.dtype(np.float32)) if a.dtype == _BF16 else a for a in rc.avals_out]
    return dataclasses.replace(rc, avals_out=avals)


def _float_binary(fn: str):
    def rule(rc: RuleContext, x, y, **_):
        u, v = _upcast(rc, x), _upcast(rc, y)
        return _finish(rc, f"{fn}({u.expr}, {v.expr})", u.dtype)

    return rule


register_lowering(lax.pow_p)(_float_binary("libdevice.pow"))
register_lowering(lax.atan2_p)(_float_binary("libdevice.atan2"))
register_lowering(lax.nextafter_p)(_float_binary("libdevice.nextafter"))


@register_lowering(lax.clamp_p)
def _clamp_rule(rc: RuleContext, lo, x, hi, **_):
    if x.dtype == _BF16:
        lo, x, hi = (cast(rc.em, v, np.float32) for v in (lo, x, hi))
        return cast(rc.em, _clamp_rule(_f32_ctx(rc), lo, x, hi), _BF16)
    if is_float(x.dtype):
        nan = "propagate_nan=tl.PropagateNan.ALL"
        return rc.out(f"tl.minimum(tl.maximum({x.expr}, {lo.expr}, {nan}), {hi.expr}, {nan})")
    return rc.out(f"tl.minimum(tl.maximum({x.expr}, {lo.expr}), {hi.expr})")


@register_lowering(lax.select_n_p)
def _select_n_rule(rc: RuleContext, pred, *cases, **_):
    if len(cases) == 1:
        return cases[0]
    if is_bool(pred.dtype):
        return rc.out(f"tl.where({pred.expr}, {cases[1].expr}, {cases[0].expr})")
    expr = cases[-1].expr
    for i in range(len(cases) - 2, -1, -1):
        expr = f"tl.where({pred.expr} == {i}, {cases[i].expr}, {expr})"
    return rc.out(expr)


@register_lowering(lax.convert_element_type_p)
def _convert_rule(rc: RuleContext, x, *, new_dtype, **_):
    return cast(rc.em, x, new_dtype)


@register_lowering(lax.bitcast_convert_type_p)
def _bitcast_rule(rc: RuleContext, x, *, new_dtype, **_):
    if np.dtype(new_dtype).itemsize != x.dtype.itemsize:
        raise rc.error("bitcast_convert_type between dtypes of different widths is not supported")
    return rc.out(f"{x.expr}.to({tl_dtype(new_dtype)}, bitcast=True)")


@register_lowering(lax.copy_p)
def _copy_rule(rc: RuleContext, x, **_):
    return x


# ---------------------------------------------------------------------------
# Shapes


@register_lowering(lax.iota_p)
def _iota_rule(rc: RuleContext, *, dtype, shape, dimension, **_):
    rank = len(shape)
    ar = expand_to_axis(f"tl.arange(0, {next_pow2(shape[dimension])})", dimension, rank)
    v = rc.em.assign(f"tl.broadcast_to({ar}, {list(pad_shape(shape))})" if rank > 1 else ar, shape, np.int32)
    return cast(rc.em, v, dtype)


def broadcast_to(rc: RuleContext, x: Val, shape, dims) -> Val:
    em = rc.em
    if x.shape == ():
        return em.assign(f"tl.broadcast_to({x.expr}, {list(pad_shape(shape))})", shape, x.dtype)
    if list(dims) != sorted(dims):
        raise rc.error("broadcast_in_dim with permuted dimensions is not supported; transpose first")
    rank = len(shape)
    expr = x.expr
    if len(dims) != rank:
        idx = ", ".join(":" if i in dims else "None" for i in range(rank))
        expr = f"{expr}[{idx}]"
    if tuple(shape) != tuple(x.shape[dims.index(i)] if i in dims else 1 for i in range(rank)):
        expr = f"tl.broadcast_to({expr}, {list(pad_shape(shape))})"
    return em.assign(expr, shape, x.dtype)


@register_lowering(lax.broadcast_in_dim_p)
def _broadcast_in_dim_rule(rc: RuleContext, x, *dyn, shape, broadcast_dimensions, **_):
    return broadcast_to(rc, x, shape, list(broadcast_dimensions))


def _reshape(rc: RuleContext, x: Val, new_shape) -> Val:
    new_shape = tuple(new_shape)
    if x.shape == new_shape:
        return x
    em = rc.em
    if new_shape == ():
        return em.assign(f"tl.reshape({x.expr}, [])" if x.shape else x.expr, (), x.dtype)
    if x.shape == ():
        return em.assign(f"tl.broadcast_to({x.expr}, {list(pad_shape(new_shape))})", new_shape, x.dtype)
    squeeze_only = [d for d in x.shape if d != 1] == [d for d in new_shape if d != 1]
    if not squeeze_only and (x.is_padded or pad_shape(new_shape) != new_shape):
        raise rc.error(
            f"reshape {x.shape} -> {new_shape} moves elements across dims that are not powers of "
            "two, which Triton tensors cannot hold; use power-of-two block shapes"
        )
    return em.assign(f"tl.reshape({x.expr}, {list(pad_shape(new_shape))})", new_shape, x.dtype)


@register_lowering(lax.reshape_p)
def _reshape_rule(rc: RuleContext, x, *dyn, new_sizes, dimensions, **_):
    if dimensions is not None and tuple(dimensions) != tuple(range(len(x.shape))):
        raise rc.error("reshape with a dimension permutation is not supported")
    return _reshape(rc, x, new_sizes)


@register_lowering(lax.squeeze_p)
def _squeeze_rule(rc: RuleContext, x, *, dimensions, **_):
    return _reshape(rc, x, rc.avals_out[0].shape)


@register_lowering(lax.transpose_p)
def _transpose_rule(rc: RuleContext, x, *, permutation, **_):
    if tuple(permutation) == tuple(range(len(permutation))):
        return x
    return rc.out(f"tl.permute({x.expr}, {list(permutation)})")


def _gather_axis(rc: RuleContext, x: Val, axis: int, index_1d: str, size: int) -> Val:
    """``x`` indexed along ``axis`` by the 1-d int32 expression ``index_1d``
    (of padded length ``next_pow2(size)``; entries must be valid indices)."""
    rank = len(x.shape)
    shape = list(x.shape)
    shape[axis] = size
    phys = list(pad_shape(shape))
    idx = expand_to_axis(index_1d, axis, rank)
    if rank > 1:
        idx = f"tl.broadcast_to({idx}, {phys})"
    return rc.em.assign(f"tl.gather({x.expr}, {idx}, {axis})", tuple(shape), x.dtype)


@register_lowering(lax.slice_p)
def _slice_rule(rc: RuleContext, x, *, start_indices, limit_indices, strides, **_):
    strides = strides or (1,) * len(x.shape)
    for ax, (lo, hi, st) in enumerate(zip(start_indices, limit_indices, strides)):
        size = max(0, -(-(hi - lo) // st))
        if lo == 0 and st == 1 and size == x.shape[ax]:
            continue
        ar = f"tl.minimum(tl.arange(0, {next_pow2(size)}), {size - 1})"
        x = _gather_axis(rc, x, ax, f"({lo} + {ar} * {st})", size)
    return x


@register_lowering(lax.rev_p)
def _rev_rule(rc: RuleContext, x, *, dimensions, **_):
    for ax in dimensions:
        n = x.shape[ax]
        x = _gather_axis(rc, x, ax, f"({n - 1} - tl.minimum(tl.arange(0, {next_pow2(n)}), {n - 1}))", n)
    return x


@register_lowering(lax.dynamic_slice_p)
def _dynamic_slice_rule(rc: RuleContext, x, *starts, slice_sizes, **_):
    for ax, (st, size) in enumerate(zip(starts, slice_sizes)):
        n = x.shape[ax]
        if size == n:
            continue
        # lax clamps the start so that the slice fits.
        s0 = rc.em.assign(f"tl.minimum(tl.maximum({st.expr}.to(tl.int32), 0), {n - size})", (), np.int32)
        ar = f"tl.minimum(tl.arange(0, {next_pow2(size)}), {size - 1})"
        x = _gather_axis(rc, x, ax, f"({s0.expr} + {ar})", size)
    return x


# ---------------------------------------------------------------------------
# Reductions

_COMBINE = {
    "and": "def _combine_and(a, b):\n    return a & b\n",
    "or": "def _combine_or(a, b):\n    return a | b\n",
    "xor": "def _combine_xor(a, b):\n    return a ^ b\n",
    "prod": "def _combine_prod(a, b):\n    return a * b\n",
    "fmax": "def _combine_fmax(a, b):\n    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)\n",
    "fmin": "def _combine_fmin(a, b):\n    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)\n",
    "imax": "def _combine_imax(a, b):\n    return tl.maximum(a, b)\n",
    "imin": "def _combine_imin(a, b):\n    return tl.minimum(a, b)\n",
    "add": "def _combine_add(a, b):\n    return a + b\n",
}


def _combine(rc: RuleContext, kind: str) -> str:
    return rc.em.helper(f"_combine_{kind}", _COMBINE[kind])


def _lowest(dtype):
    if is_float(dtype):
        return float("-inf")
    if is_bool(dtype):
        return False
    return int(np.iinfo(dtype).min)


def _highest(dtype):
    if is_float(dtype):
        return float("inf")
    if is_bool(dtype):
        return True
    return int(np.iinfo(dtype).max)


def _reduce(kind: str):
    def rule(rc: RuleContext, x, *, axes, **_):
        x = _upcast(rc, x)
        em, dtype = rc.em, x.dtype
        if kind == "sum":
            # tl.sum is a @triton.jit library function, which Triton's
            # interpreter cannot call from our kernels; tl.reduce is a builtin.
            fn = _combine(rc, "add")
            neutral, call = 0, lambda v, ax: f"tl.reduce({v}, {ax}, {fn})"  # noqa: E731
        elif kind in ("max", "min"):
            neutral = _lowest(dtype) if kind == "max" else _highest(dtype)
            name = ("f" if is_float(dtype) else "i") + kind
            if is_bool(dtype):
                name = "or" if kind == "max" else "and"
            fn = _combine(rc, name)
            call = lambda v, ax: f"tl.reduce({v}, {ax}, {fn})"  # noqa: E731
        else:
            neutral = {"prod": 1, "and": True, "or": False, "xor": False}[kind]
            if kind == "and" and not is_bool(dtype):
                neutral = -1 if not is_unsigned_int(dtype) else int(np.iinfo(dtype).max)
            fn = _combine(rc, kind)
            call = lambda v, ax: f"tl.reduce({v}, {ax}, {fn})"  # noqa: E731
        x = fill_padding(em, x, neutral, axes)
        shape = list(x.shape)
        cur = x
        for ax in sorted(axes, reverse=True):
            shape.pop(ax)
            cur = em.assign(
                call(cur.expr, ax), tuple(shape), dtype if kind != "sum" or is_float(dtype) else dtype
            )
        a = rc.avals_out[0]
        return cast(em, cur, a.dtype)

    return rule


register_lowering(lax.reduce_sum_p)(_reduce("sum"))
register_lowering(lax.reduce_max_p)(_reduce("max"))
register_lowering(lax.reduce_min_p)(_reduce("min"))
register_lowering(lax.reduce_prod_p)(_reduce("prod"))
register_lowering(lax.reduce_and_p)(_reduce("and"))
register_lowering(lax.reduce_or_p)(_reduce("or"))
register_lowering(lax.reduce_xor_p)(_reduce("xor"))


_ARG_COMBINE = """def _combine_arg{kind}(v1, i1, v2, i2):
    n1 = v1 != v1
    n2 = v2 != v2
    pick1 = (v1 {op} v2) | (n1 & ~n2) | (((v1 == v2) | (n1 & n2)) & (i1 < i2))
    return tl.where(pick1, v1, v2), tl.where(pick1, i1, i2)
"""


def _arg_reduce(kind: str):
    # tl.argmax/argmin are @triton.jit library functions, which Triton's
    # interpreter cannot call; a (value, index) tl.reduce with our own combine
    # works in both, and gives lax's NaN semantics (first NaN wins).
    def rule(rc: RuleContext, x, *, axes, index_dtype, **_):
        (ax,) = axes
        em = rc.em
        neutral = _lowest(x.dtype) if kind == "max" else _highest(x.dtype)
        x = _upcast(rc, fill_padding(em, x, neutral, [ax]))
        if is_bool(x.dtype):
            x = cast(em, x, np.int32)
        fn = em.helper(
            f"_combine_arg{kind}", _ARG_COMBINE.format(kind=kind, op=">" if kind == "max" else "<")
        )
        rank = len(x.shape)
        ar = expand_to_axis(f"tl.arange(0, {next_pow2(x.shape[ax])})", ax, rank)
        idx = em.assign(f"tl.broadcast_to({ar}, {list(x.padded)})" if rank > 1 else ar, x.shape, np.int32)
        vals, res = em.fresh("v"), em.fresh("i")
        em.emit(f"{vals}, {res} = tl.reduce(({x.expr}, {idx.expr}), {ax}, {fn})")
        a = rc.avals_out[0]
        return cast(em, Val(res, a.shape, np.dtype(np.int32)), a.dtype)

    return rule


register_lowering(lax.argmax_p)(_arg_reduce("max"))
register_lowering(lax.argmin_p)(_arg_reduce("min"))


def _cumulative(kind: str):
    def rule(rc: RuleContext, x, *, axis, reverse, **_):
        em = rc.em
        x = _upcast(rc, x)
        neutral = {"add": 0, "prod": 1}.get(kind)
        if kind in ("max", "min"):
            neutral = _lowest(x.dtype) if kind == "max" else _highest(x.dtype)
            fn = _combine(rc, ("f" if is_float(x.dtype) else "i") + kind)
        else:
            fn = _combine(rc, kind)
        if reverse:  # the padding comes first in a reverse scan
            x = fill_padding(em, x, neutral, [axis])
        a = rc.avals_out[0]
        v = em.assign(f"tl.associative_scan({x.expr}, {axis}, {fn}, reverse={reverse})", a.shape, x.dtype)
        return cast(em, v, a.dtype)

    return rule


register_lowering(compat.cumsum_p)(_cumulative("add"))
register_lowering(compat.cumprod_p)(_cumulative("prod"))
register_lowering(compat.cummax_p)(_cumulative("max"))
register_lowering(compat.cummin_p)(_cumulative("min"))


# ---------------------------------------------------------------------------
# Dot

# Triton's tl.dot needs every dim of its operands to be at least 16.
MIN_DOT_DIM = 16


def _input_precision(rc: RuleContext, precision, dtype) -> str | None:
    if np.dtype(dtype) != np.float32:
        return None
    if precision is None:
        return "tf32"
    if isinstance(precision, tuple):
        p = {lax.Precision(q) if q is not None else lax.Precision.DEFAULT for q in precision}
        return "ieee" if lax.Precision.HIGHEST in p else "tf32"
    preset = getattr(lax, "DotAlgorithmPreset", None)
    if preset is not None and isinstance(precision, preset):
        if precision == preset.DEFAULT or precision == preset.TF32_TF32_F32:
            return "tf32"
        if precision == preset.F32_F32_F32:
            return "ieee"
        if precision == preset.TF32_TF32_F32_X3:
            return "tf32x3"
    raise rc.error(f"dot precision {precision!r} is not supported")


@register_lowering(lax.dot_general_p)
def _dot_general_rule(rc: RuleContext, a, b, *, dimension_numbers, precision, preferred_element_type, **_):
    em = rc.em
    (lc, rc_), (lb, rb) = dimension_numbers
    if len(lc) != 1 or len(rc_) != 1:
        raise rc.error("dot_general must contract exactly one dimension")
    nb = len(lb)
    if tuple(lb) != tuple(range(nb)) or tuple(rb) != tuple(range(nb)) or nb > 1:
        raise rc.error("dot_general batch dimensions must be one leading dimension of both operands")
    if len(a.shape) != nb + 2 or len(b.shape) != nb + 2:
        raise rc.error(
            f"dot_general needs 2-d operands (3-d with a batch dim), got {a.shape} and {b.shape}; "
            "reshape vectors to matrices"
        )
    # Bring a to (..., M, K) and b to (..., K, N).
    if lc[0] == nb:
        a = em.assign(
            f"tl.permute({a.expr}, {list(range(nb)) + [nb + 1, nb]})",
            (*a.shape[:nb], a.shape[nb + 1], a.shape[nb]),
            a.dtype,
        )
    if rc_[0] == nb + 1:
        b = em.assign(
            f"tl.permute({b.expr}, {list(range(nb)) + [nb + 1, nb]})",
            (*b.shape[:nb], b.shape[nb + 1], b.shape[nb]),
            b.dtype,
        )
    m, k = a.shape[-2:]
    n = b.shape[-1]
    small = [f"{name}={v}" for name, v in (("M", m), ("N", n), ("K", k)) if next_pow2(v) < MIN_DOT_DIM]
    if small:
        raise rc.error(
            f"dot of {a.shape} x {b.shape}: Triton's tl.dot needs M, N and K of at least "
            f"{MIN_DOT_DIM} (got {', '.join(small)}); use block shapes of at least {MIN_DOT_DIM}, or "
            "compute small products with broadcasting and jnp.sum"
        )
    out = rc.avals_out[0]
    # Padding along K would add garbage products: zero it.
    a = fill_padding(em, a, 0, [nb + 1])
    b = fill_padding(em, b, 0, [nb])
    if is_float(a.dtype):
        acc = np.dtype(np.float64) if a.dtype == np.float64 else np.dtype(np.float32)
        if (
            out.dtype == np.float16
            and preferred_element_type is not None
            and np.dtype(preferred_element_type) == np.float16
        ):
            acc = np.dtype(np.float16)
    else:
        acc = np.dtype(np.int32)
    if a.dtype != b.dtype:
        raise rc.error(f"dot operands must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.dtype == _BF16:  # Triton's interpreter multiplies raw uint16 bf16 bits
        a = em.assign(f"_dot_operand({a.expr})", a.shape, a.dtype)
        b = em.assign(f"_dot_operand({b.expr})", b.shape, b.dtype)
    prec = _input_precision(rc, precision, a.dtype)
    kw = f", input_precision={prec!r}" if prec else ""
    v = em.assign(f"tl.dot({a.expr}, {b.expr}{kw}, out_dtype={tl_dtype(acc)})", out.shape, acc)
    return cast(em, v, out.dtype)


__all__ = ["valid_mask"]
