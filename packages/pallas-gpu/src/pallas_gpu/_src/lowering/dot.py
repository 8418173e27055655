"""The lowering rule of ``dot_general``: Triton's ``tl.dot`` (K widened to its minimum,
bf16 operands as Triton's interpreter needs them, float32 precisions split into bf16
parts, integers other than int8 split into int8 digits), the padding filled first
(``lowering.py``: values are held padded to powers of two)."""

from __future__ import annotations

import numpy as np
from jax import lax

from pallas_gpu._src.lowering.lowering import (
    RuleContext,
    Val,
    cast,
    fill_padding,
    is_bool,
    is_float,
    next_pow2,
    pad_shape,
    register_lowering,
    tl_dtype,
)
from pallas_gpu._src.lowering.math import BF16

# Triton's tl.dot on NVIDIA GPUs (its min_dot_size) takes any M and N (it pads them for
# the tensor cores) but needs K of at least 16, 32 for 8-bit operands. A dot with a
# smaller K is widened to that minimum first (``_widen_k``).
MIN_DOT_K = {1: 32, 2: 16, 4: 16, 8: 16}


def _input_precision(rc: RuleContext, precision, dtype) -> str | None:
    if np.dtype(dtype) != np.float32:
        return None
    if precision is None:
        return "tf32"
    if isinstance(precision, tuple):
        p = {lax.Precision(q) if q is not None else lax.Precision.DEFAULT for q in precision}
        return "ieee" if lax.Precision.HIGHEST in p else "tf32"
    preset = lax.DotAlgorithmPreset
    if isinstance(precision, preset):
        if precision == preset.DEFAULT or precision == preset.TF32_TF32_F32:
            return "tf32"
        if precision == preset.F32_F32_F32:
            return "ieee"
        if precision == preset.TF32_TF32_F32_X3:
            return "tf32x3"
    raise rc.error(
        f"dot precision {precision!r} is not supported on f32 operands; the Triton backend takes "
        "lax.Precision values and the DotAlgorithmPresets DEFAULT, F32_F32_F32, TF32_TF32_F32(_X3), "
        "F16_F16_F32 and BF16_BF16_F32(_X3, _X6)"
    )


# f32 operands rounded to 16 bits, products accumulated in f32; the _X3/_X6
# presets add the products of the bf16 parts of the rounding errors (as XLA).
_SPLIT_PRESETS = {
    "F16_F16_F32": (np.float16, ((0, 0),)),
    "BF16_BF16_F32": (BF16, ((0, 0),)),
    "BF16_BF16_F32_X3": (BF16, ((1, 0), (0, 1), (0, 0))),
    "BF16_BF16_F32_X6": (BF16, ((1, 1), (2, 0), (0, 2), (1, 0), (0, 1), (0, 0))),
}


def _split_preset(precision, dtype):
    if np.dtype(dtype) != np.float32 or not isinstance(precision, lax.DotAlgorithmPreset):
        return None
    return _SPLIT_PRESETS.get(precision.name)


def _parts(em, x: Val, dtype, n: int) -> list[Val]:
    """``x`` as ``n`` 16-bit parts whose sum approximates it: x0 = round(x),
    x1 = round(x - x0), ..."""
    parts, rest = [], x
    for i in range(n):
        p = cast(em, rest, dtype)
        parts.append(em.assign(f"_dot_operand({p.expr})", p.shape, p.dtype) if p.dtype == BF16 else p)
        if i + 1 < n:
            rest = em.assign(f"{rest.expr} - {cast(em, p, np.float32).expr}", x.shape, np.float32)
    return parts


def _widen_k(em, a: Val, b: Val, min_k: int) -> tuple[Val, Val]:
    """``a`` (..., M, K) and ``b`` (..., K, N) with K below what tl.dot takes, as
    operands with K' = ``min_k`` whose product is the same: each k repeated
    r = K'/K times (broadcast and reshape), all but the first copy of ``a``'s zeroed.
    No reduction of our own: a tl.sum over a K of 4 doubled on the H200."""
    *lead, m, k = pad_shape(a.shape)
    n = pad_shape(b.shape)[-1]
    r = min_k // k
    nl = len(lead)
    pre = ":, " * nl
    keep = f"(tl.arange(0, {min_k}) % {r} == 0)[{'None, ' * (nl + 1)}:]"
    zero = "0" if np.dtype(a.dtype).kind in "iub" else "0.0"
    ar = f"tl.reshape(tl.broadcast_to({a.expr}[{pre}:, :, None], {[*lead, m, k, r]}), {[*lead, m, min_k]})"
    a2 = em.assign(
        f"tl.where({keep}, {ar}, tl.zeros([1], {a.expr}.dtype) + {zero})", (*a.shape[:-1], min_k), a.dtype
    )
    br = f"tl.reshape(tl.broadcast_to({b.expr}[{pre}:, None, :], {[*lead, k, r, n]}), {[*lead, min_k, n]})"
    b2 = em.assign(br, (*b.shape[:-2], min_k, b.shape[-1]), b.dtype)
    return a2, b2


def _digit_dot(em, a: Val, b: Val, out_shape) -> Val:
    """The integer dot of ``a`` and ``b`` (any integer or bool dtype) modulo 2**32, as int32,
    from int8 ``tl.dot``s (Triton's only integer dot: int8 operands, int32 accumulation).
    Each operand, as int32, is a sum of 7-bit digits ``d_i * 2**(7 i)``, the top one signed
    (an arithmetic shift), so every digit fits an int8; then
    ``a @ b = sum over i, j of (da_i @ db_j) << 7 (i + j)``, and the terms shifted by 32 or
    more vanish modulo 2**32. XLA's integer dots wrap the same way, so the result, cast to
    the output dtype, is exact."""
    bits = max(1 if is_bool(x.dtype) else 8 * np.dtype(x.dtype).itemsize for x in (a, b))
    n = -(-bits // 7)

    def digits(x: Val) -> list[Val]:
        x32 = (
            cast(em, x, np.int32)
            if not is_bool(x.dtype)
            else em.assign(f"{x.expr}.to(tl.int32)", x.shape, np.int32)
        )
        out = []
        for i in range(n):
            d = f"({x32.expr} >> {7 * i})" if i else x32.expr
            d = d if i == n - 1 else f"({d} & 127)"
            out.append(em.assign(f"{d}.to(tl.int8)", x.shape, np.int8))
        return out

    da, db = digits(a), digits(b)
    acc = None
    for i in range(n):
        for j in range(n):
            shift = 7 * (i + j)
            if shift >= 32:
                continue
            d = f"tl.dot({da[i].expr}, {db[j].expr}, out_dtype=tl.int32)"
            d = f"({d} << {shift})" if shift else d
            acc = em.assign(d if acc is None else f"{acc.expr} + {d}", out_shape, np.int32)
    assert acc is not None
    return acc


def _split_dot(em, a: Val, b: Val, split, out_shape) -> Val:
    dtype, pairs = split
    n = 1 + max(max(p) for p in pairs)
    pa, pb = _parts(em, a, dtype, n), _parts(em, b, dtype, n)
    acc: Val | None = None
    for i, j in pairs:
        d = f"tl.dot({pa[i].expr}, {pb[j].expr}, out_dtype=tl.float32)"
        acc = em.assign(d if acc is None else f"{acc.expr} + {d}", out_shape, np.float32)
    assert acc is not None  # a split has at least one pair
    return acc


def _matmul_operands(rc: RuleContext, a: Val, b: Val, dimension_numbers) -> tuple[Val, Val]:
    """``a`` as (..., M, K) and ``b`` as (..., K, N), with zeros in their padding along K (it
    would add garbage products); the dimension numbers checked (one contracting dimension, at
    most one leading batch dimension)."""
    em = rc.em
    (lc, rc_), (lb, rb) = dimension_numbers
    if len(lc) != 1 or len(rc_) != 1:
        raise rc.error("dot_general must contract exactly one dimension")
    nb = len(lb)
    if tuple(lb) != tuple(range(nb)) or tuple(rb) != tuple(range(nb)) or nb > 1:
        raise rc.error("dot_general batch dimensions must be one leading dimension of both operands")
    if len(a.shape) != nb + 2 or len(b.shape) != nb + 2:
        raise rc.error(
            f"dot_general operands must be 2D (3-D with a batch dimension), got {a.shape} and "
            f"{b.shape}; reshape vectors to matrices (e.g. y[:, None])"
        )
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
    return fill_padding(em, a, 0, [nb + 1]), fill_padding(em, b, 0, [nb])


def _acc_dtype(a_dtype, out_dtype, preferred_element_type) -> np.dtype:
    """The dot's accumulator: f32 (f64 for f64, f16 where f16 is asked for and returned), int32
    for integers."""
    if not is_float(a_dtype):
        return np.dtype(np.int32)
    if (
        out_dtype == np.float16
        and preferred_element_type is not None
        and np.dtype(preferred_element_type) == np.float16
    ):
        return np.dtype(np.float16)
    return np.dtype(np.float64) if a_dtype == np.float64 else np.dtype(np.float32)


@register_lowering(lax.dot_general_p)
def _dot_general_rule(
    rc: RuleContext,
    a,
    b,
    *,
    dimension_numbers,
    precision,
    preferred_element_type,
    acc: Val | None = None,
    **_,
):
    """``acc`` (an f32 Val shaped like the result) is added in the dot: the kernel frame passes
    it for ``acc + dot(a, b)`` (see ``_dot_accumulations``)."""
    em = rc.em
    a, b = _matmul_operands(rc, a, b, dimension_numbers)
    k = a.shape[-1]
    out = rc.avals_out[0]
    acc_dtype = _acc_dtype(a.dtype, out.dtype, preferred_element_type)
    if a.dtype != b.dtype:
        raise rc.error(f"dot operands must have the same dtype, got {a.dtype} and {b.dtype}")
    if not is_float(a.dtype) and np.dtype(a.dtype) != np.int8:
        # Triton's tl.dot takes int8 as its only integer operands: other integers (and
        # bools) are split into int8 digits.
        if next_pow2(k) < MIN_DOT_K[1]:
            a, b = _widen_k(em, a, b, MIN_DOT_K[1])
        return cast(em, _digit_dot(em, a, b, out.shape), out.dtype)
    min_k = MIN_DOT_K.get(np.dtype(a.dtype).itemsize, 16)
    if next_pow2(k) < min_k:
        a, b = _widen_k(em, a, b, min_k)
    split = _split_preset(precision, a.dtype)
    if split is not None:
        v = _split_dot(em, a, b, split, out.shape)
        return (
            cast(em, v, out.dtype)
            if acc is None
            else em.assign(f"{acc.expr} + {v.expr}", out.shape, acc.dtype)
        )
    if a.dtype == BF16:  # Triton's interpreter multiplies raw uint16 bf16 bits
        a = em.assign(f"_dot_operand({a.expr})", a.shape, a.dtype)
        b = em.assign(f"_dot_operand({b.expr})", b.shape, b.dtype)
    prec = _input_precision(rc, precision, a.dtype)
    kw = f", input_precision={prec!r}" if prec else ""
    if acc is not None:
        return em.assign(
            f"tl.dot({a.expr}, {b.expr}, {acc.expr}{kw}, out_dtype=tl.float32)", out.shape, acc.dtype
        )
    v = em.assign(f"tl.dot({a.expr}, {b.expr}{kw}, out_dtype={tl_dtype(acc_dtype)})", out.shape, acc_dtype)
    return cast(em, v, out.dtype)
