"""Value-level TPU primitives that change how values are packed into bits:
``pack_elementwise``, ``unpack_elementwise`` and ``stochastic_round``
(conventions in ``vector_common.py``; ``pltpu`` imports them through
``vector_primitives.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching

from pallas_tpu._src import compat
from pallas_tpu._src.language.vector_common import (
    bit_width,
    move_to_front,
    op_error,
    register_interpret,
    uint_dtype,
)

# ---------------------------------------------------------- pack / unpack elementwise


def _packing_factor(op: str, unpacked_dtype, packed_dtype) -> int:
    u, p = bit_width(unpacked_dtype), bit_width(packed_dtype)
    if u % p:
        raise op_error(
            ValueError, op, f"{unpacked_dtype} ({u} bits) is not a whole number of {packed_dtype} ({p} bits)"
        )
    return u // p


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


pack_elementwise_p = Primitive("pack_elementwise")


def pack_elementwise(xs, *, packed_dtype) -> jax.Array:
    """Packs several arrays, element by element, into one array of words.

    Element ``i`` of every output word holds ``xs[i]`` converted to
    ``packed_dtype``, ordered from the lowest bits to the highest. Floats are
    rounded to the nearest (f32 -> bf16); integers are truncated to their low
    bits (int8 ``xxxx1001`` and ``yyyy0011`` pack to int4 pair ``00111001``).

    Args:
      xs: a sequence of arrays of one shape and one dtype (float32, or an
        integer type), as many as ``packed_dtype`` fits in that dtype's width.
      packed_dtype: bfloat16 for float32 sources, a narrower integer type for
        integer sources.

    Returns:
      An unsigned-integer array of the sources' bit width and shape.
    """
    xs = [jnp.asarray(x) for x in xs]
    packed_dtype = jnp.dtype(packed_dtype)
    if not xs:
        raise op_error(ValueError, "pack_elementwise", "needs at least one source")
    first = xs[0]
    for i, x in enumerate(xs):
        if x.shape != first.shape or x.dtype != first.dtype:
            raise op_error(
                ValueError,
                "pack_elementwise",
                f"all sources must have one shape and dtype: xs[0] is {first.dtype}{list(first.shape)}, "
                f"xs[{i}] is {x.dtype}{list(x.shape)}",
            )
    ok_float = first.dtype == jnp.float32 and packed_dtype == jnp.bfloat16
    ok_int = _is_int(first.dtype) and _is_int(packed_dtype)
    if not (ok_float or ok_int):
        raise op_error(
            TypeError,
            "pack_elementwise",
            f"only float32 -> bfloat16 and integer -> integer are supported, got {first.dtype} -> {packed_dtype}",
        )
    factor = _packing_factor("pack_elementwise", first.dtype, packed_dtype)
    if len(xs) != factor:
        raise op_error(
            ValueError,
            "pack_elementwise",
            f"{first.dtype} holds {factor} {packed_dtype} values, but {len(xs)} sources were given",
        )
    return pack_elementwise_p.bind(*xs, packed_dtype=packed_dtype)


@pack_elementwise_p.def_abstract_eval
def _pack_abstract_eval(*xs, packed_dtype):
    return compat.ShapedArray(xs[0].shape, uint_dtype(bit_width(xs[0].dtype)))


def _pack_impl(*xs, packed_dtype):
    width = bit_width(xs[0].dtype)
    p = bit_width(packed_dtype)
    out_t = uint_dtype(width)
    mask = np.array((1 << p) - 1, out_t)
    out = jnp.zeros(xs[0].shape, out_t)
    for i, x in enumerate(xs):
        if _is_float(x.dtype):
            field = lax.bitcast_convert_type(x.astype(packed_dtype), uint_dtype(p)).astype(out_t)
        else:
            field = lax.bitcast_convert_type(x, out_t) & mask
        out = out | (field << np.array(i * p, out_t))
    return out


def _pack_batch(args, dims, *, packed_dtype):
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    xs = [
        jnp.broadcast_to(x, (size, *x.shape)) if d is None else move_to_front(x, d)
        for x, d in zip(args, dims, strict=True)
    ]
    return pack_elementwise_p.bind(*xs, packed_dtype=packed_dtype), 0


batching.primitive_batchers[pack_elementwise_p] = _pack_batch
register_interpret(pack_elementwise_p, _pack_impl)


unpack_elementwise_p = Primitive("unpack_elementwise")


def unpack_elementwise(x, *, index, packed_dtype, unpacked_dtype) -> jax.Array:
    """Unpacks element ``index`` of every word of ``x``: the inverse of
    ``pack_elementwise``.

    Element ``index`` (0 = lowest bits) of each word is read as
    ``packed_dtype`` and converted to ``unpacked_dtype`` (signed integers are
    sign-extended, unsigned ones zero-extended, floats converted exactly).

    Args:
      x: the packed array; its dtype has the bit width of ``unpacked_dtype``.
      index: which packed element to extract, in ``[0, packing factor)``.
      packed_dtype: the dtype of the packed elements.
      unpacked_dtype: the dtype of the result.

    Returns:
      An array of ``unpacked_dtype`` with the shape of ``x``.
    """
    x = jnp.asarray(x)
    packed_dtype, unpacked_dtype = jnp.dtype(packed_dtype), jnp.dtype(unpacked_dtype)
    if bit_width(x.dtype) != bit_width(unpacked_dtype):
        raise op_error(
            TypeError,
            "unpack_elementwise",
            f"x ({x.dtype}) must have the bit width of unpacked_dtype ({unpacked_dtype})",
        )
    if not (
        (_is_float(packed_dtype) and _is_float(unpacked_dtype))
        or (_is_int(packed_dtype) and _is_int(unpacked_dtype))
    ):
        raise op_error(
            TypeError,
            "unpack_elementwise",
            f"packed and unpacked dtypes must both be floats or both integers, got {packed_dtype} and {unpacked_dtype}",
        )
    factor = _packing_factor("unpack_elementwise", unpacked_dtype, packed_dtype)
    if not isinstance(index, (int, np.integer)) or not 0 <= index < factor:
        raise op_error(
            ValueError,
            "unpack_elementwise",
            f"index {index} is out of range [0, {factor}) for {packed_dtype}",
        )
    return unpack_elementwise_p.bind(
        x, index=int(index), packed_dtype=packed_dtype, unpacked_dtype=unpacked_dtype
    )


@unpack_elementwise_p.def_abstract_eval
def _unpack_abstract_eval(x, *, index, packed_dtype, unpacked_dtype):
    del index, packed_dtype
    return compat.ShapedArray(x.shape, unpacked_dtype)


def _unpack_impl(x, *, index, packed_dtype, unpacked_dtype):
    width, p = bit_width(x.dtype), bit_width(packed_dtype)
    word = lax.bitcast_convert_type(x, uint_dtype(width))
    field = (word >> np.array(index * p, word.dtype)) & np.array((1 << p) - 1, word.dtype)
    value = lax.bitcast_convert_type(field.astype(uint_dtype(p)), packed_dtype)
    return value.astype(unpacked_dtype)


batching.defvectorized(unpack_elementwise_p)
register_interpret(unpack_elementwise_p, _unpack_impl)


# --------------------------------------------------------------- stochastic_round

_STOCHASTIC_TARGETS = tuple(
    jnp.dtype(t)
    for t in (
        jnp.bfloat16,
        jnp.float8_e5m2,
        jnp.float8_e4m3fn,
        jnp.float8_e4m3b11fnuz,
        jnp.float4_e2m1fn,
        jnp.int4,
    )
)

stochastic_round_p = Primitive("stochastic_round")


def stochastic_round(x, random_bits, *, target_dtype) -> jax.Array:
    """Rounds float32 ``x`` to a narrower type, up or down at random.

    ``x`` becomes one of the two ``target_dtype`` values around it, the
    farther one with probability proportional to its distance, so the result
    is unbiased on average. Element ``i`` uses ``random_bits[i]`` (e.g. from
    ``prng_random_bits`` bitcast to uint32) as its uniform draw.

    Semantics (those of the TPU v5e, measured on 8192 draws per target
    type in 2026-12): with ``u`` the low 23 bits of ``random_bits`` over
    ``2**23``, ``x`` rounds away from zero when
    ``u < (|x| - |lo|) / (|hi| - |lo|)``; for bfloat16 that is: up when the
    low 23 random bits are below the 16 bits of ``x`` cut off, shifted up 7.
    Values beyond the target's largest finite value saturate to it (bfloat16
    rounds to inf as IEEE rounding would); NaN and inf are kept. Integer
    targets (int4) round ``floor(x)`` or ``floor(x) + 1`` and saturate to
    [-8, 7] (not measured on a chip).

    Args:
      x: a float32 array.
      random_bits: a uint32 array of the shape of ``x``.
      target_dtype: bfloat16, float8_e5m2, float8_e4m3fn,
        float8_e4m3b11fnuz, float4_e2m1fn or int4.

    Returns:
      An array of ``target_dtype`` with the shape of ``x``.
    """
    x, random_bits = jnp.asarray(x), jnp.asarray(random_bits)
    target_dtype = jnp.dtype(target_dtype)
    if x.dtype != jnp.float32:
        raise op_error(TypeError, "stochastic_round", f"x must be float32, got {x.dtype}")
    if random_bits.dtype != jnp.uint32:
        raise op_error(
            TypeError,
            "stochastic_round",
            f"random_bits must be uint32, got {random_bits.dtype} (bitcast prng_random_bits' int32 first)",
        )
    if random_bits.shape != x.shape:
        raise op_error(
            ValueError,
            "stochastic_round",
            f"random_bits has shape {random_bits.shape} but x has shape {x.shape}",
        )
    if target_dtype not in _STOCHASTIC_TARGETS:
        raise op_error(
            TypeError,
            "stochastic_round",
            f"unsupported target_dtype {target_dtype}; supported: {', '.join(map(str, _STOCHASTIC_TARGETS))}",
        )
    return stochastic_round_p.bind(x, random_bits, target_dtype=target_dtype)


@stochastic_round_p.def_abstract_eval
def _stochastic_round_abstract_eval(x, random_bits, *, target_dtype):
    del random_bits
    return compat.ShapedArray(x.shape, target_dtype)


def stochastic_round_impl(x, random_bits, *, target_dtype):
    # The draw is the low 23 bits of the random word, as the TPU v5e takes it (2026-12-06:
    # pltpu.stochastic_round on the chip, 8192 elements per target type, every one fit).
    draw = random_bits & np.uint32(0x7FFFFF)
    if target_dtype == jnp.bfloat16:
        # Up when the draw is below the 16 bits cut off (as a 23-bit fraction).
        xbits = lax.bitcast_convert_type(x, jnp.uint32)
        up = draw < ((xbits & np.uint32(0xFFFF)) << np.uint32(7))
        word = xbits + jnp.where(up, np.uint32(0x10000), np.uint32(0))
        rounded = lax.bitcast_convert_type(word & np.uint32(0xFFFF0000), jnp.float32).astype(jnp.bfloat16)
        return jnp.where(jnp.isfinite(x), rounded, x.astype(jnp.bfloat16))
    # A uniform draw in [0, 1), exact in float32.
    u = draw.astype(jnp.float32) * np.float32(2.0**-23)
    if target_dtype == jnp.int4:
        lo = jnp.floor(x)
        up = u < (x - lo)
        return jnp.clip(jnp.where(up, lo + 1, lo), -8, 7).astype(jnp.int4)
    finfo = jnp.finfo(target_dtype)
    big = np.float32(finfo.max)
    mag = jnp.minimum(jnp.abs(x), big)
    # lo = |x| rounded toward zero, hi = the next target value away from zero:
    # target magnitudes are ordered like their bit patterns (sign bit clear).
    nearest = mag.astype(target_dtype)
    nbits = uint_dtype(bit_width(target_dtype))
    nearest_bits = lax.bitcast_convert_type(nearest, nbits)
    went_up = nearest.astype(jnp.float32) > mag
    lo_bits = jnp.where(went_up, nearest_bits - np.array(1, nbits), nearest_bits)
    lo = lax.bitcast_convert_type(lo_bits, target_dtype).astype(jnp.float32)
    hi_bits = jnp.where(lo < big, lo_bits + np.array(1, nbits), lo_bits)
    hi = lax.bitcast_convert_type(hi_bits, target_dtype).astype(jnp.float32)
    gap = hi - lo
    frac = jnp.where(gap > 0, (mag - lo) / jnp.where(gap > 0, gap, 1), 0)
    out = jnp.where(u < frac, hi, lo)
    out = jnp.where(x < 0, -out, out).astype(target_dtype)
    return jnp.where(jnp.isfinite(x), out, x.astype(target_dtype))


def _stochastic_round_batch(args, dims, *, target_dtype):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    x, bits = (
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else move_to_front(a, d)
        for a, d in zip(args, dims, strict=True)
    )
    return stochastic_round_p.bind(x, bits, target_dtype=target_dtype), 0


batching.primitive_batchers[stochastic_round_p] = _stochastic_round_batch
register_interpret(stochastic_round_p, stochastic_round_impl)
