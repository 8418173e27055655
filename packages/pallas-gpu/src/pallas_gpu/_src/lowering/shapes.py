"""Lowering rules for shapes, reductions and scans (dots: ``dot.py``).

Values are held padded to powers of two (see ``lowering.py``): rules that
move elements between positions (slices, reversals, concatenation, padding)
gather with clamped index vectors and mask with ``tl.where``; rules that
combine elements (reductions, scans) first fill the padding with a
neutral value.
"""

from __future__ import annotations

import numpy as np
from jax import lax

from pallas_gpu._src import compat
from pallas_gpu._src.lowering.lowering import (
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
)
from pallas_gpu._src.lowering.math import upcast

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


# JAX's pl.broadcast_to (a state primitive with numpy broadcasting), for
# kernels that bind it; pallas-core's namespace does not export it yet.
@register_lowering(compat.state_primitives.broadcast_to_p)
def _state_broadcast_to_rule(rc: RuleContext, x, *, shape):
    return broadcast_to(rc, x, tuple(shape), list(range(len(shape) - len(x.shape), len(shape))))


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
    src, src_len = x.expr, x.padded[axis]
    if phys[axis] > src_len:
        # Triton's GPU gather asserts (OptimizeThreadLocality) when the index
        # is longer than the source along the axis: repeat each source element
        # f times (position i * f holds x[i]) so that the lengths match.
        f = phys[axis] // src_len
        wide = list(x.padded)
        sub = ", ".join([":"] * (axis + 1) + ["None"] + [":"] * (rank - axis - 1))
        rep = [*wide[: axis + 1], f, *wide[axis + 1 :]]
        wide[axis] *= f
        src = rc.em.assign(f"tl.reshape(tl.broadcast_to({src}[{sub}], {rep}), {wide})", (), x.dtype).expr
        index_1d = f"(({index_1d}) * {f})"
    idx = expand_to_axis(index_1d, axis, rank)
    if rank > 1:
        idx = f"tl.broadcast_to({idx}, {phys})"
    return rc.em.assign(f"tl.gather({src}, {idx}, {axis})", tuple(shape), x.dtype)


def _clamped_arange(size: int) -> str:
    """``0..size-1`` over the padded length (padding lanes repeat the last)."""
    return f"tl.minimum(tl.arange(0, {next_pow2(size)}), {max(size - 1, 0)})"


def _take(rc: RuleContext, x: Val, axis: int, start, size: int, stride: int = 1) -> Val:
    """Elements ``start, start + stride, ...`` (``size`` of them) along ``axis``;
    ``start`` is an int or a scalar int32 expression inside the array."""
    if start == 0 and stride == 1 and size == x.shape[axis]:
        return x
    if size == 0:
        shape = list(x.shape)
        shape[axis] = 0
        return const(rc.em, 0, x.dtype, tuple(shape))
    step = f" * {stride}" if stride != 1 else ""
    return _gather_axis(rc, x, axis, f"({start} + {_clamped_arange(size)}{step})", size)


@register_lowering(lax.slice_p)
def _slice_rule(rc: RuleContext, x, *, start_indices, limit_indices, strides, **_):
    strides = strides or (1,) * len(x.shape)
    for ax, (lo, hi, st) in enumerate(zip(start_indices, limit_indices, strides)):
        x = _take(rc, x, ax, lo, max(0, -(-(hi - lo) // st)), st)
    return x


@register_lowering(lax.split_p)
def _split_rule(rc: RuleContext, x, *, sizes, axis):
    outs, start = [], 0
    for size in sizes:
        outs.append(_take(rc, x, axis, start, int(size)))
        start += int(size)
    return outs


@register_lowering(lax.rev_p)
def _rev_rule(rc: RuleContext, x, *, dimensions, **_):
    for ax in dimensions:
        n = x.shape[ax]
        x = _gather_axis(rc, x, ax, f"({n - 1} - {_clamped_arange(n)})", n)
    return x


@register_lowering(lax.dynamic_slice_p)
def _dynamic_slice_rule(rc: RuleContext, x, *starts, slice_sizes, **_):
    for ax, (st, size) in enumerate(zip(starts, slice_sizes)):
        n = x.shape[ax]
        if size == n:
            continue
        # lax clamps the start so that the slice fits.
        if st.static is not None:
            start = min(max(int(st.static), 0), n - size)
        else:
            start = rc.em.assign(
                f"tl.minimum(tl.maximum({st.expr}.to(tl.int32), 0), {n - size})", (), np.int32
            ).expr
        x = _take(rc, x, ax, start, size)
    return x


@register_lowering(lax.concatenate_p)
def _concatenate_rule(rc: RuleContext, *xs, dimension):
    # Output position j takes operand k's element j - offset_k: gather each
    # operand over the whole output length and keep it where j >= offset_k.
    em, out = rc.em, rc.avals_out[0]
    n_out, rank = out.shape[dimension], len(out.shape)
    j = em.assign(f"tl.arange(0, {next_pow2(n_out)})", (n_out,), np.int32, "j")
    result, offset = None, 0
    for x in xs:
        n = x.shape[dimension]
        if n == 0:
            continue
        idx = (
            f"tl.minimum(tl.maximum({j.expr} - {offset}, 0), {n - 1})"
            if offset
            else f"tl.minimum({j.expr}, {n - 1})"
        )
        g = _gather_axis(rc, x, dimension, idx, n_out)
        if result is None:
            result = g
        else:
            keep = expand_to_axis(f"({j.expr} >= {offset})", dimension, rank)
            result = em.assign(f"tl.where({keep}, {g.expr}, {result.expr})", out.shape, out.dtype)
        offset += n
    return result if result is not None else const(em, 0, out.dtype, out.shape)


@register_lowering(lax.pad_p)
def _pad_rule(rc: RuleContext, x, padding_value, *, padding_config):
    # Output position j along an axis holds x[t // (interior + 1)] where
    # t = j - lo is a non-negative multiple of interior + 1 inside x, else the
    # padding value; negative lo/hi crop.
    em = rc.em
    for ax, (lo, hi, interior) in enumerate(padding_config):
        lo, hi, interior = int(lo), int(hi), int(interior)
        if (lo, hi, interior) == (0, 0, 0):
            continue
        n, rank = x.shape[ax], len(x.shape)
        n_out = max(0, lo + hi + n + max(n - 1, 0) * interior)
        shape = list(x.shape)
        shape[ax] = n_out
        if n == 0 or n_out == 0:
            x = em.assign(
                f"tl.broadcast_to({padding_value.expr}, {list(pad_shape(shape))})", tuple(shape), x.dtype
            )
            continue
        t = em.assign(f"tl.arange(0, {next_pow2(n_out)}) - {lo}", (n_out,), np.int32, "t")
        step = interior + 1
        src = f"{t.expr} // {step}" if step > 1 else t.expr
        valid = f"({t.expr} >= 0) & ({src} < {n})"
        if step > 1:
            valid += f" & ({t.expr} % {step} == 0)"
        g = _gather_axis(rc, x, ax, f"tl.minimum(tl.maximum({src}, 0), {n - 1})", n_out)
        keep = expand_to_axis(f"({valid})", ax, rank)
        x = em.assign(f"tl.where({keep}, {g.expr}, {padding_value.expr})", tuple(shape), x.dtype)
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


def _neutral(kind: str, dtype):
    """The neutral element of a ``"max"`` (``dtype``'s lowest value) or ``"min"`` (its highest)
    reduction."""
    highest = kind == "min"
    if is_float(dtype):
        return float("inf") if highest else float("-inf")
    if is_bool(dtype):
        return highest
    info = np.iinfo(dtype)
    return int(info.max if highest else info.min)


def _reduce(kind: str):
    def rule(rc: RuleContext, x, *, axes, **_):
        x = upcast(rc, x)
        em, dtype = rc.em, x.dtype
        if kind == "sum":
            # tl.sum is a @triton.jit library function, which Triton's
            # interpreter cannot call from our kernels; tl.reduce is a builtin.
            fn = _combine(rc, "add")
            neutral, call = 0, lambda v, ax: f"tl.reduce({v}, {ax}, {fn})"  # noqa: E731
        elif kind in ("max", "min"):
            neutral = _neutral(kind, dtype)
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


_REDUCTIONS = {
    lax.reduce_sum_p: "sum",
    lax.reduce_max_p: "max",
    lax.reduce_min_p: "min",
    lax.reduce_prod_p: "prod",
    lax.reduce_and_p: "and",
    lax.reduce_or_p: "or",
    lax.reduce_xor_p: "xor",
}
for _p, _kind in _REDUCTIONS.items():
    register_lowering(_p)(_reduce(_kind))


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
        neutral = _neutral(kind, x.dtype)
        x = upcast(rc, fill_padding(em, x, neutral, [ax]))
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
        x = upcast(rc, x)
        neutral = {"add": 0, "prod": 1}.get(kind)
        if kind in ("max", "min"):
            neutral = _neutral(kind, x.dtype)
            fn = _combine(rc, ("f" if is_float(x.dtype) else "i") + kind)
        else:
            fn = _combine(rc, kind)
        if reverse:  # the padding comes first in a reverse scan
            x = fill_padding(em, x, neutral, [axis])
        a = rc.avals_out[0]
        v = em.assign(f"tl.associative_scan({x.expr}, {axis}, {fn}, reverse={reverse})", a.shape, x.dtype)
        return cast(em, v, a.dtype)

    return rule


_CUMULATIVE = {
    compat.cumsum_p: "add",
    compat.cumprod_p: "prod",
    compat.cummax_p: "max",
    compat.cummin_p: "min",
}
for _p, _kind in _CUMULATIVE.items():
    register_lowering(_p)(_cumulative(_kind))
