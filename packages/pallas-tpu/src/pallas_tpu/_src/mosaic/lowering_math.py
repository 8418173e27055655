"""Mosaic rules for elementwise math: the op tables (``BINARY``,
``UNARY_FLOAT``, ``UNARY_INT``, ``COMPARE``) and the rules built on them,
comparisons, select and clamp, casts (``convert``), bitcasts, packing and
stochastic rounding, and the special functions (lgamma, digamma, erf_inv,
nextafter, mulhi, reduce_precision, reciprocal). Shapes are
``lowering_shapes.py``, reductions and ``dot_general`` ``lowering_reductions.py``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad
from jaxlib import version as jaxlib_version
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, math
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src.language import vector_primitives as vp
from pallas_tpu._src.mosaic.lowering import (
    Aval,
    aval_type,
    broadcast_to,
    constant,
    is_bool,
    is_float,
    is_unsigned,
    lower_fun,
    register_lowering,
)

# primitive -> (float op, signed int op, unsigned int / bool op); None: not defined.
BINARY = {
    lax.add_p: (arith.addf, arith.addi, arith.addi),
    lax.sub_p: (arith.subf, arith.subi, arith.subi),
    lax.mul_p: (arith.mulf, arith.muli, arith.muli),
    lax.div_p: (arith.divf, arith.divsi, arith.divui),
    lax.rem_p: (arith.remf, arith.remsi, arith.remui),
    lax.max_p: (arith.maximumf, arith.maxsi, arith.maxui),
    lax.min_p: (arith.minimumf, arith.minsi, arith.minui),
    lax.and_p: (None, arith.andi, arith.andi),
    lax.or_p: (None, arith.ori, arith.ori),
    lax.xor_p: (None, arith.xori, arith.xori),
    lax.shift_left_p: (None, arith.shli, arith.shli),
    lax.shift_right_arithmetic_p: (None, arith.shrsi, arith.shrsi),
    lax.shift_right_logical_p: (None, arith.shrui, arith.shrui),
    lax.pow_p: (math.powf, None, None),
    lax.atan2_p: (math.atan2, None, None),
}

UNARY_FLOAT = {
    lax.exp_p: math.exp,
    lax.exp2_p: math.exp2,
    lax.log_p: math.log,
    lax.log1p_p: math.log1p,
    lax.expm1_p: math.expm1,
    lax.sqrt_p: math.sqrt,
    lax.rsqrt_p: math.rsqrt,
    lax.cbrt_p: math.cbrt,
    lax.tanh_p: math.tanh,
    lax.sin_p: math.sin,
    lax.cos_p: math.cos,
    lax.tan_p: math.tan,
    lax.asin_p: math.asin,
    lax.acos_p: math.acos,
    lax.atan_p: math.atan,
    lax.sinh_p: math.sinh,
    lax.cosh_p: math.cosh,
    lax.asinh_p: math.asinh,
    lax.acosh_p: math.acosh,
    lax.atanh_p: math.atanh,
    lax.erf_p: math.erf,
    lax.floor_p: math.floor,
    lax.ceil_p: math.ceil,
    lax.neg_p: arith.negf,
    lax.abs_p: math.absf,
}

UNARY_INT = {
    lax.abs_p: math.absi,
    lax.population_count_p: math.ctpop,
    lax.clz_p: math.ctlz,
}

# comparison -> (float predicate, signed predicate, unsigned predicate)
COMPARE = {
    lax.eq_p: ("oeq", "eq", "eq"),
    lax.ne_p: ("une", "ne", "ne"),
    lax.lt_p: ("olt", "slt", "ult"),
    lax.le_p: ("ole", "sle", "ule"),
    lax.gt_p: ("ogt", "sgt", "ugt"),
    lax.ge_p: ("oge", "sge", "uge"),
}


def _pick(ops: tuple, dtype):
    return ops[0] if is_float(dtype) else ops[2] if is_unsigned(dtype) else ops[1]


def _operands(ctx, *args):
    """The operands broadcast to the output shape (lax allows scalars)."""
    shape = ctx.avals_out[0].shape
    return [broadcast_to(a, shape) for a in args]


# Bools are i1, which Mosaic's max/min do not take: or and and are the same.
_BOOL_BINARY = {lax.max_p: arith.ori, lax.min_p: arith.andi}


def _binary_op(prim, ctx, x, y):
    dtype = ctx.avals_in[0].dtype
    op = _BOOL_BINARY.get(prim) if is_bool(dtype) else None
    op = op or _pick(BINARY[prim], dtype)
    if op is None:
        raise NotImplementedError(f"'{prim.name}' of {np.dtype(dtype).name} is not supported")
    return op(*_operands(ctx, x, y))


# How a shift of 8- or 16-bit vectors extends its operand to 32 bits where jaxlib < 0.11's Mosaic
# (libtpu 0.0.42.1, JAX 0.10.2's) legalizes none ("failed to legalize operation 'arith.shrui'",
# JAX's own lowering too); the shift amount zero-extends (XLA reads it as unsigned).
_WIDENED_SHIFTS = {
    lax.shift_left_p: arith.extui,
    lax.shift_right_logical_p: arith.extui,
    lax.shift_right_arithmetic_p: arith.extsi,
}
_NARROW_VECTOR_SHIFTS = jaxlib_version.__version_info__ >= (0, 11)


@register_lowering(*BINARY)
def _binary(ctx, x, y, **_):
    prim, out = ctx.eqn.primitive, ctx.avals_out[0]
    if prim in _WIDENED_SHIFTS and not _NARROW_VECTOR_SHIFTS and out.shape and _bits(out.dtype) < 32:
        x, y = _operands(ctx, x, y)
        wide = aval_type(Aval(out.shape, np.int32))
        shifted = _pick(BINARY[prim], np.int32)(_WIDENED_SHIFTS[prim](wide, x), arith.extui(wide, y))
        return arith.trunci(aval_type(out), shifted)
    return _binary_op(prim, ctx, x, y)


@register_lowering(*(set(UNARY_FLOAT) | set(UNARY_INT)))
def _unary(ctx, x, **_):
    dtype = ctx.avals_in[0].dtype
    p = ctx.eqn.primitive
    table = UNARY_FLOAT if is_float(dtype) else UNARY_INT
    if p in table:
        return table[p](x)
    if p is lax.neg_p:
        return arith.subi(constant(0, ctx.avals_in[0].shape, dtype), x)
    raise NotImplementedError(f"'{p.name}' of {np.dtype(dtype).name} is not supported")


@register_lowering(lax.not_p)
def _not(ctx, x, **_):
    aval = ctx.avals_in[0]
    return arith.xori(x, constant(-1 if not is_bool(aval.dtype) else 1, aval.shape, aval.dtype))


def _sign_float(x):
    # 1.0 with x's sign bit (Mosaic has no copysign); +-0 and NaN are themselves.
    u = lax.bitcast_convert_type(x, np.dtype(f"uint{_bits(x.dtype)}"))
    sign_bit = u & np.array(1 << (_bits(x.dtype) - 1), u.dtype)
    one = lax.bitcast_convert_type(np.array(1, x.dtype), u.dtype)
    return jnp.where(jnp.abs(x) > 0, lax.bitcast_convert_type(sign_bit | one, x.dtype), x)


@register_lowering(lax.sign_p)
def _sign(ctx, x, **_):
    aval = ctx.avals_in[0]
    if is_float(aval.dtype):
        return lower_fun(_sign_float, ctx, x)
    zero, one = constant(0, aval.shape, aval.dtype), constant(1, aval.shape, aval.dtype)
    pos = arith.select(_cmp(x, zero, "ugt" if is_unsigned(aval.dtype) else "sgt", aval), one, zero)
    if is_unsigned(aval.dtype):
        return pos
    return arith.select(_cmp(x, zero, "slt", aval), constant(-1, aval.shape, aval.dtype), pos)


@register_lowering(lax.round_p)
def _round(ctx, x, rounding_method):
    return math.roundeven(x) if int(rounding_method) == 1 else math.round(x)


@register_lowering(lax.is_finite_p)
def _is_finite(ctx, x, **_):
    aval = ctx.avals_in[0]
    inf = constant(np.inf, aval.shape, aval.dtype)
    # |x| < inf, false for NaN: libtpu lowers cmpf one to the hardware's not-equal
    # compare, whose NaN result an ordered predicate need not rely on.
    return _cmp(math.absf(x), inf, "olt", aval)


@register_lowering(lax.logistic_p)
def _logistic(ctx, x, **_):
    aval = ctx.avals_in[0]
    one = constant(1, aval.shape, aval.dtype)
    return arith.divf(one, arith.addf(one, math.exp(arith.negf(x))))


@register_lowering(lax.integer_pow_p)
def _integer_pow(ctx, x, y):
    aval = ctx.avals_in[0]
    mul = arith.mulf if is_float(aval.dtype) else arith.muli
    out, base, n = None, x, abs(int(y))
    while n:  # square and multiply
        if n & 1:
            out = base if out is None else mul(out, base)
        n >>= 1
        if n:
            base = mul(base, base)
    if out is None:
        out = constant(1, aval.shape, aval.dtype)
    if y < 0:
        out = arith.divf(constant(1, aval.shape, aval.dtype), out)
    return out


@register_lowering(lax.square_p)
def _square(ctx, x, **_):
    return (arith.mulf if is_float(ctx.avals_in[0].dtype) else arith.muli)(x, x)


def _true_like(x) -> ir.Value:
    """An all-true i1 of the shape of ``x`` (a scalar or a vector)."""
    shape = ir.VectorType(x.type).shape if isinstance(x.type, ir.VectorType) else ()
    return constant(True, shape, np.bool_)


def _cmp(x, y, pred: str, aval):
    if is_float(aval.dtype):
        if pred == "une":  # Mosaic refuses une: x != y (true for NaN) is not x == y
            return arith.xori(arith.cmpf(arith.CmpFPredicate.OEQ, x, y), _true_like(x))
        return arith.cmpf(getattr(arith.CmpFPredicate, pred.upper()), x, y)
    return arith.cmpi(getattr(arith.CmpIPredicate, pred), x, y)


def _bool_compare(prim, x, y):
    """A comparison of bools (False < True) in boolean algebra: Mosaic's ``cmpi``
    widens i1 vectors, which it cannot lay out (as JAX's lowering)."""
    if prim in (lax.eq_p, lax.ne_p):
        ne = arith.xori(x, y)
        return ne if prim is lax.ne_p else arith.xori(ne, _true_like(ne))
    if prim in (lax.gt_p, lax.ge_p):
        x, y = y, x  # x > y is y < x
    not_x = arith.xori(x, _true_like(x))
    return arith.andi(not_x, y) if prim in (lax.lt_p, lax.gt_p) else arith.ori(not_x, y)


@register_lowering(*COMPARE)
def _compare(ctx, x, y):
    aval = ctx.avals_in[0]
    x, y = _operands(ctx, x, y)
    if is_bool(aval.dtype):
        return _bool_compare(ctx.eqn.primitive, x, y)
    return _cmp(x, y, _pick(COMPARE[ctx.eqn.primitive], aval.dtype), aval)


@register_lowering(lax.select_n_p)
def _select_n(ctx, pred, *cases):
    paval, out = ctx.avals_in[0], ctx.avals_out[0]
    cases = _operands(ctx, *cases)
    if len(cases) == 1:
        return cases[0]
    if is_bool(paval.dtype):  # a scalar predicate selects whole vectors (as JAX)
        return arith.select(pred, cases[1], cases[0])
    pred = broadcast_to(pred, out.shape)
    result = cases[-1]  # an integer predicate picks case `pred`
    for i in range(len(cases) - 2, -1, -1):
        k = constant(i, out.shape, paval.dtype)
        result = arith.select(arith.cmpi(arith.CmpIPredicate.eq, pred, k), cases[i], result)
    return result


@register_lowering(lax.clamp_p)
def _clamp(ctx, lo, x, hi):
    aval = ctx.avals_out[0]
    lo, x, hi = _operands(ctx, lo, x, hi)
    mx, mn = _pick(BINARY[lax.max_p], aval.dtype), _pick(BINARY[lax.min_p], aval.dtype)
    return mn(mx(x, lo), hi)


# ---------------------------------------------------------------------------
# Casts


def convert(x, src, dst, shape):
    """``x`` of dtype ``src`` converted to ``dst`` (as ``lax.convert_element_type``)."""
    src, dst = np.dtype(src), np.dtype(dst)
    out_t = aval_type(Aval(shape, dst))
    if src == dst:
        return x
    if is_bool(dst):
        if _bits(src) < 32:  # compared in 32 bits (a float32, an (u)int32), as JAX's lowering compares
            wide = np.dtype(np.float32 if is_float(src) else np.uint32 if is_unsigned(src) else np.int32)
            x, src = convert(x, src, wide, shape), wide
        return _cmp(x, constant(0, shape, src), "une" if is_float(src) else "ne", Aval(shape, src))
    if is_float(src) and is_float(dst):
        return (arith.extf if src.itemsize < dst.itemsize else arith.truncf)(out_t, x)
    if is_float(src):
        return (arith.fptoui if is_unsigned(dst) else arith.fptosi)(out_t, x)
    if is_float(dst):
        return (arith.uitofp if is_unsigned(src) else arith.sitofp)(out_t, x)
    if _bits(src) == _bits(dst) and not is_bool(src):
        return x  # signedness lives in the avals
    if is_bool(src) or _bits(src) < _bits(dst):  # in bits: int4 and int2 are narrower than int8
        return (arith.extui if is_unsigned(src) else arith.extsi)(out_t, x)
    return arith.trunci(out_t, x)


@register_lowering(lax.convert_element_type_p)
def _convert_element_type(ctx, x, new_dtype, **_):
    aval = ctx.avals_in[0]
    return convert(x, aval.dtype, new_dtype, aval.shape)


# ---------------------------------------------------------------------------
# Bitcasts, packing and stochastic rounding (the Mosaic ops JAX emits).


def _bits(dtype) -> int:
    import jax

    return jax.dtypes.itemsize_bits(np.dtype(dtype))


def _bitcast_narrow(x, *, new_dtype):
    # (...) of S bits -> (..., S // D) of D bits, least significant part first.
    src, dst = _bits(x.dtype), _bits(new_dtype)
    u = lax.bitcast_convert_type(x, np.dtype(f"uint{src}"))
    mask = np.array((1 << dst) - 1, u.dtype)
    parts = [(u >> np.array(j * dst, u.dtype)) & mask for j in range(src // dst)]
    return lax.bitcast_convert_type(jnp.stack(parts, axis=-1).astype(f"uint{dst}"), new_dtype)


def _bitcast_widen(x, *, new_dtype):
    # (..., D // S) of S bits -> (...) of D bits.
    src, dst = _bits(x.dtype), _bits(new_dtype)
    if src == 8:
        # Each byte widened, masked, shifted into place by a vector of shifts and the parts summed
        # (they are disjoint). The same bytes taken one by one, `(b & 0xff) << 16` and or-ed, came
        # out 0 on a TPU v5e wherever the byte was 0x01-0x7f, from JAX's lowering too (Mosaic,
        # 2026-12-06); this form ran right there.
        n = dst // 8
        u = lax.bitcast_convert_type(x, np.dtype("int8")).astype(np.int32) & np.int32(0xFF)
        word = (u << jnp.arange(0, 8 * n, 8, dtype=np.int32)).sum(axis=-1)
        return lax.bitcast_convert_type(word.astype(f"int{dst}"), new_dtype)
    u = lax.bitcast_convert_type(x, np.dtype(f"uint{src}")).astype(f"uint{dst}")
    word = u[..., 0]
    for j in range(1, dst // src):
        word = word | (u[..., j] << np.array(j * src, word.dtype))
    return lax.bitcast_convert_type(word, new_dtype)


@register_lowering(lax.bitcast_convert_type_p)
def _bitcast_convert_type(ctx, x, new_dtype):
    """Same width: ``tpu.bitcast`` of vectors, ``arith.bitcast`` of scalars (as
    JAX). A change of width (JAX's TPU lowering has none) is shifts and masks
    of same-width bitcasts, through ``lower_fun``."""
    aval, out = ctx.avals_in[0], ctx.avals_out[0]
    src, dst = _bits(aval.dtype), _bits(new_dtype)
    if is_bool(aval.dtype) or is_bool(new_dtype):
        raise NotImplementedError("bitcasts of bool are not supported")
    if src > dst:
        return lower_fun(_bitcast_narrow, ctx, x, new_dtype=np.dtype(new_dtype))
    if src < dst:
        return lower_fun(_bitcast_widen, ctx, x, new_dtype=np.dtype(new_dtype))
    if out.shape:
        return tpu.bitcast(aval_type(out), x)
    return arith.bitcast(aval_type(out), x)


def _element(dtype) -> ir.Type:
    """The MLIR element type of ``dtype``, sub-byte integers (int4) included."""
    if jnp.issubdtype(dtype, jnp.integer):
        return ir.IntegerType.get_signless(_bits(dtype))
    return aval_type(Aval((), dtype))


@register_lowering(vp.pack_elementwise_p)
def _pack_elementwise(ctx, *xs, packed_dtype):
    return tpu.pack_elementwise(aval_type(ctx.avals_out[0]), list(xs), _element(packed_dtype))


@register_lowering(vp.unpack_elementwise_p)
def _unpack_elementwise(ctx, x, *, index, packed_dtype, unpacked_dtype):
    aval, out = ctx.avals_in[0], ctx.avals_out[0]
    bits = _bits(packed_dtype)
    if jnp.issubdtype(packed_dtype, jnp.unsignedinteger) and not is_float(aval.dtype):
        # Mosaic's unpack sign-extends (its integers are signless); an unsigned field
        # zero-extends: a logical shift and a mask, no more instructions than its unpack.
        shift = bits * index
        r = arith.shrui(x, constant(shift, aval.shape, aval.dtype)) if shift else x
        if shift + bits < _bits(aval.dtype):
            r = arith.andi(r, constant((1 << bits) - 1, aval.shape, aval.dtype))
        return r
    if is_float(aval.dtype):  # Mosaic unpacks integer words
        x = tpu.bitcast(aval_type(Aval(aval.shape, f"uint{_bits(aval.dtype)}")), x)
    return tpu.unpack_elementwise(aval_type(out), x, _element(packed_dtype), index)


@register_lowering(vp.stochastic_round_p)
def _stochastic_round(ctx, x, random_bits, *, target_dtype):
    return tpu.stochastic_convert(aval_type(ctx.avals_out[0]), x, random_bits)


# ---------------------------------------------------------------------------
# More math: log2, erf_inv, lgamma, digamma, nextafter, one_minus_square, mulhi, reduce_precision,
# reciprocal


@register_lowering(plb.lax_primitive("log2_p"))
def _log2(ctx, x, **_):
    return math.log2(x)


@register_lowering(lax.stop_gradient_p)
def _stop_gradient(ctx, x):
    return x


@register_lowering(plb.lax_primitive("one_minus_square_p"))
def _one_minus_square(ctx, x, **_):
    return lower_fun(lambda v: (1 + v) * (1 - v), ctx, x)


@register_lowering(lax.erf_inv_p)
def _erf_inv(ctx, x, **_):
    if np.dtype(ctx.avals_in[0].dtype) != np.float32:
        raise NotImplementedError("erf_inv of float32 only")
    return lower_fun(plb.erf_inv_f32, ctx, x)


# lgamma and digamma: XLA's Lanczos approximation, in float32 (pallas-core's jnp definitions).
@register_lowering(lax.lgamma_p)
def _lgamma(ctx, x, **_):
    return lower_fun(plb.in_float32(plb.lgamma_f32), ctx, x)


@register_lowering(lax.digamma_p)
def _digamma(ctx, x, **_):
    return lower_fun(plb.in_float32(plb.digamma_f32), ctx, x)


def _nextafter_f32(x, y):
    # Step the bit pattern of x one unit toward y (IEEE nextafter).
    xi = lax.bitcast_convert_type(x, jnp.int32)
    mag = xi & np.int32(0x7FFFFFFF)
    toward_zero = (x > y) == (x > 0)
    step = jnp.where(toward_zero, np.int32(-1), np.int32(1))
    moved = lax.bitcast_convert_type(xi + step, jnp.float32)
    # From +-0 the next value is the smallest subnormal with y's sign.
    tiny = lax.bitcast_convert_type(
        (lax.bitcast_convert_type(y, jnp.int32) & np.int32(-(2**31))) | np.int32(1), jnp.float32
    )
    out = jnp.where(mag == 0, tiny, moved)
    out = jnp.where(x == y, y, out)
    return jnp.where(jnp.isnan(x) | jnp.isnan(y), np.float32(np.nan), out)


@register_lowering(lax.nextafter_p)
def _nextafter(ctx, x, y):
    if np.dtype(ctx.avals_in[0].dtype) != np.float32:
        raise NotImplementedError("nextafter of float32 only")
    return lower_fun(_nextafter_f32, ctx, x, y)


def _mulhi_32(x, y):
    # The high word of the 64-bit product from 16-bit halves, in uint32 arithmetic
    # (every partial product and sum fits in 32 bits).
    signed = x.dtype == np.int32
    a, b = (lax.bitcast_convert_type(v, jnp.uint32) for v in (x, y))
    lo16, s16 = np.uint32(0xFFFF), np.uint32(16)
    al, ah, bl, bh = a & lo16, a >> s16, b & lo16, b >> s16
    lh, hl = al * bh, ah * bl
    mid = ((al * bl) >> s16) + (lh & lo16) + (hl & lo16)
    hi = ah * bh + (lh >> s16) + (hl >> s16) + (mid >> s16)
    if signed:  # two's complement: subtract b where a < 0 and a where b < 0
        hi = hi - jnp.where(x < 0, b, np.uint32(0)) - jnp.where(y < 0, a, np.uint32(0))
        return lax.bitcast_convert_type(hi, jnp.int32)
    return hi


@register_lowering(lax.mulhi_p)
def _mulhi(ctx, x, y):
    """The high half of the double-width product (int32/uint32). Mosaic takes
    ``arith.mul{s,u}i_extended`` only with one result: 32-bit halves of 16-bit
    products instead."""
    dtype = np.dtype(ctx.avals_out[0].dtype)
    if dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise NotImplementedError(f"mulhi of {dtype.name}; int32 and uint32 are supported")
    x, y = _operands(ctx, x, y)
    out = ctx.avals_out[0]
    return lower_fun(_mulhi_32, ctx, x, y, avals_in=[out, out])


def _reduce_precision_f32(x, *, exponent_bits, mantissa_bits):
    """XLA's ``reduce_precision`` of float32 ``x`` in int32 bit operations: the mantissa
    rounded to nearest, ties to even; beyond the new exponent range, +-inf; at or
    below its smallest exponent (its subnormals), +-0; NaNs kept as they are."""
    xi = lax.bitcast_convert_type(x, jnp.int32)
    is_nan = (xi & np.int32(0x7FFFFFFF)) > np.int32(0x7F800000)
    if mantissa_bits < 23:
        drop = 23 - mantissa_bits
        last_kept = lax.shift_right_logical(xi & np.int32(1 << drop), np.int32(drop))
        xi = (xi + last_kept + np.int32((1 << (drop - 1)) - 1)) & np.int32(-(1 << drop))
    if exponent_bits < 8:
        bias = (1 << (exponent_bits - 1)) - 1
        exponent = xi & np.int32(0x7F800000)
        signed_zero = xi & np.int32(-(2**31))
        xi = jnp.where(exponent > np.int32((127 + bias) << 23), signed_zero | np.int32(0x7F800000), xi)
        xi = jnp.where(exponent <= np.int32((127 - bias) << 23), signed_zero, xi)
    return jnp.where(is_nan, x, lax.bitcast_convert_type(xi, jnp.float32))


# jaxlib < 0.11.2's Mosaic bindings have no tpu.reduce_precision.
_TPU_REDUCE_PRECISION = getattr(tpu, "reduce_precision", None)


@register_lowering(lax.reduce_precision_p)
def _reduce_precision(ctx, x, *, exponent_bits, mantissa_bits):
    if not ctx.avals_in[0].shape:
        raise NotImplementedError("reduce_precision of a scalar; Mosaic's op takes vectors")
    if _TPU_REDUCE_PRECISION is not None:
        return _TPU_REDUCE_PRECISION(x, exponent_bits, mantissa_bits)
    dtype = np.dtype(ctx.avals_in[0].dtype)
    if dtype != np.float32:
        raise NotImplementedError(
            f"reduce_precision of {dtype.name} needs Mosaic's tpu.reduce_precision, which jaxlib "
            f"{jaxlib_version.__version__} lacks: it needs JAX/jaxlib >= 0.11.2 (float32 is lowered with "
            "integer operations)"
        )
    return lower_fun(_reduce_precision_f32, ctx, x, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits)


# jaxlib < 0.11's tpu.reciprocal verifies float32 only ("Reciprocal op for non-f32 dtypes").
_RECIPROCAL_OF_BF16 = jaxlib_version.__version_info__ >= (0, 11)


@register_lowering(vp.reciprocal_p)
def _reciprocal(ctx, x, *, approx, full_range):
    aval = ctx.avals_in[0]
    dtype = np.dtype(aval.dtype)
    if dtype.name not in ("float32", "bfloat16"):
        raise NotImplementedError("pltpu.reciprocal takes float32 or bfloat16")
    if dtype == np.float32 or _RECIPROCAL_OF_BF16:
        return tpu.reciprocal(x, approx=approx, full_range=full_range)
    wide = tpu.reciprocal(convert(x, dtype, np.float32, aval.shape), approx=approx, full_range=full_range)
    return convert(wide, np.float32, dtype, aval.shape)


@register_lowering(ad.add_jaxvals_p)
def _add_any(ctx, x, y):
    # The sum of two cotangents (jax.grad inside a kernel).
    return _binary_op(lax.add_p, ctx, x, y)
