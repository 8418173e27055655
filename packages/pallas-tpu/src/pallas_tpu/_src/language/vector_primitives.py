"""Value-level TPU primitives: ``roll``, ``bitcast``, ``pack_elementwise``,
``unpack_elementwise``, ``stochastic_round``, ``reciprocal``, and the ops with
no value semantics (``trace_value``, ``touch``, ``annotate``,
``with_memory_space_constraint``).

Conventions (one block per primitive, in this order): ``foo_p``, the public
``foo()`` that validates its arguments at trace time, the abstract eval, then
the batching (and, where the op is differentiable, AD) rules, then the
*interpret semantics*: a plain-``jnp`` function registered as the primitive's
MLIR lowering for every platform (``mlir.lower_fun``). In TPU interpret mode
the kernel body becomes plain JAX, so this is what the op computes there; the
Mosaic lowering registers its own rule for platform ``tpu``.

Bad arguments raise at trace time through ``pallas.backend.kernel_error``, so
an error raised inside a kernel names the kernel and the user's line.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Effect, Primitive
from jax.interpreters import ad, batching, mlir

from pallas.backend import constrain_memory_space, kernel_error, register_internal_dir
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import rules as interpret_rules

register_internal_dir(__file__)


def _error(cls: type[Exception], op: str, msg: str) -> Exception:
    return kernel_error(cls, f"pltpu.{op}: {msg}")


def _bits(dtype) -> int:
    return jax.dtypes.itemsize_bits(jnp.dtype(dtype))


def _uint(bits: int):
    return {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[bits]


def _register_interpret(prim: Primitive, impl, multiple_results: bool = False) -> None:
    """``impl`` (plain jnp) is the op's meaning off the TPU: eagerly and in jit."""
    prim.def_impl(impl)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=multiple_results))


def _move_to_front(x, bdim):
    return x if bdim == 0 else jnp.moveaxis(x, bdim, 0)


# --------------------------------------------------------------------------- roll

roll_p = Primitive("roll")


def roll(
    x: jax.Array,
    shift: jax.Array | int,
    axis: int,
    *,
    stride: int | None = None,
    stride_axis: int | None = None,
) -> jax.Array:
    """Rotates ``x`` along ``axis``, like ``jnp.roll``: ``out[i] = x[i - shift]``.

    With ``stride``, slice ``k`` of ``x`` along ``stride_axis`` is rotated by
    ``shift + k * stride`` instead (the TPU's strided rotate).

    Args:
      x: the array to rotate (rank >= 1).
      shift: a non-negative Python int, or an int32 scalar array (a traced
        shift is taken modulo the axis size).
      axis: the dimension to rotate, in ``[0, x.ndim)`` (negative axes are
        rejected, as by JAX's ``pltpu.roll``).
      stride: extra shift per slice along ``stride_axis`` (non-negative).
      stride_axis: the dimension whose index scales ``stride``; must differ
        from ``axis``. Give both ``stride`` and ``stride_axis`` or neither.

    Returns:
      An array with the shape and dtype of ``x``.
    """
    x = jnp.asarray(x)
    if isinstance(shift, (int, np.integer)):
        if shift < 0:
            raise _error(ValueError, "roll", f"shift must be non-negative, got {shift}")
    shift = jnp.asarray(shift)
    if shift.shape != () or not jnp.issubdtype(shift.dtype, jnp.integer):
        raise _error(
            TypeError, "roll", f"shift must be an integer scalar, got {shift.dtype}{list(shift.shape)}"
        )
    shift = shift.astype(jnp.int32)
    if not isinstance(axis, (int, np.integer)) or not 0 <= axis < x.ndim:
        raise _error(ValueError, "roll", f"axis {axis} is out of range for an array of rank {x.ndim}")
    if (stride is None) != (stride_axis is None):
        raise _error(ValueError, "roll", "give both stride and stride_axis, or neither")
    if stride is not None:
        if stride < 0:
            raise _error(ValueError, "roll", f"stride must be non-negative, got {stride}")
        if not 0 <= stride_axis < x.ndim:
            raise _error(ValueError, "roll", f"stride_axis {stride_axis} is out of range for rank {x.ndim}")
        if stride_axis == axis:
            raise _error(ValueError, "roll", f"axis and stride_axis must differ, both are {axis}")
        stride, stride_axis = int(stride), int(stride_axis)
    return roll_p.bind(x, shift, axis=int(axis), stride=stride, stride_axis=stride_axis)


@roll_p.def_abstract_eval
def _roll_abstract_eval(x, shift, *, axis, stride, stride_axis):
    del shift, axis, stride, stride_axis
    return compat.ShapedArray(x.shape, x.dtype)


def _roll_impl(x, shift, *, axis, stride, stride_axis):
    if stride is None:
        return jnp.roll(x, shift, axis)
    n = x.shape[axis]
    shape = [1] * x.ndim
    shape[axis] = n
    pos = lax.broadcasted_iota(jnp.int32, shape, axis)
    shape = [1] * x.ndim
    shape[stride_axis] = x.shape[stride_axis]
    slice_index = lax.broadcasted_iota(jnp.int32, shape, stride_axis)
    # Slice k rotates by shift + k * stride: out[i] = x[(i - shift - k*stride) mod n].
    src = jnp.mod(pos - shift - slice_index * stride, n)
    src = jnp.broadcast_to(src, x.shape)
    return jnp.take_along_axis(x, src, axis=axis)


def _roll_batch(args, dims, *, axis, stride, stride_axis):
    (x, shift), (xd, sd) = args, dims
    if sd is None:
        x = _move_to_front(x, xd)
        sa = None if stride_axis is None else stride_axis + 1
        return roll_p.bind(x, shift, axis=axis + 1, stride=stride, stride_axis=sa), 0
    # A shift per batch element is not one TPU rotate: fall back to the semantics.
    impl = lambda x, s: _roll_impl(x, s, axis=axis, stride=stride, stride_axis=stride_axis)  # noqa: E731
    xd = None if xd is None else xd
    return jax.vmap(impl, in_axes=(xd, sd))(x, shift), 0


def _roll_transpose(ct, x, shift, *, axis, stride, stride_axis):
    assert ad.is_undefined_primal(x) and not ad.is_undefined_primal(shift)
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval), None]
    n = x.aval.shape[axis]
    if stride is None:
        return [roll_p.bind(ct, jnp.mod(-shift, n), axis=axis, stride=None, stride_axis=None), None]
    back = lambda c: _roll_impl(c, -shift, axis=axis, stride=-stride, stride_axis=stride_axis)  # noqa: E731
    return [back(ct), None]


batching.primitive_batchers[roll_p] = _roll_batch
ad.primitive_transposes[roll_p] = _roll_transpose
ad.primitive_jvps[roll_p] = lambda primals, tangents, **p: (
    roll_p.bind(*primals, **p),
    ad.Zero.from_primal_value(primals[0])
    if type(tangents[0]) is ad.Zero
    else roll_p.bind(ad.instantiate_zeros(tangents[0]), primals[1], **p),
)
_register_interpret(roll_p, _roll_impl)


# ------------------------------------------------------------------------ bitcast

bitcast_p = Primitive("bitcast")


def bitcast(x: jax.Array, ty: Any) -> jax.Array:
    """Reinterprets the bits of ``x`` as dtype ``ty``, TPU-style.

    Unlike ``lax.bitcast_convert_type``, a change of bit width is absorbed by
    the second-to-last dimension: bitcasting ``(m, n)`` int32 to int8 gives
    ``(4 * m, n)``, where row ``4 * i + b`` holds byte ``b`` (least significant
    first) of row ``i``; bitcasting to a wider type is the inverse.

    Args:
      x: an array of rank >= 2.
      ty: the new dtype; ``x.shape[-2] * bits(x.dtype)`` must be a multiple of
        ``bits(ty)``.

    Returns:
      An array of dtype ``ty`` whose second-to-last dimension is
      ``x.shape[-2] * bits(x.dtype) // bits(ty)``.
    """
    x = jnp.asarray(x)
    ty = jnp.dtype(ty)
    if x.ndim < 2:
        raise _error(ValueError, "bitcast", f"needs an array of rank >= 2, got shape {x.shape}")
    for d in (x.dtype, ty):
        if d == jnp.bool_ or d.kind == "c":
            raise _error(TypeError, "bitcast", f"{d} cannot be bitcast on a TPU")
    src, dst = _bits(x.dtype), _bits(ty)
    if (x.shape[-2] * src) % dst:
        raise _error(
            ValueError,
            "bitcast",
            f"the second-to-last dimension ({x.shape[-2]}) of {x.dtype} cannot be packed into "
            f"{ty}: {x.shape[-2]} * {src} bits is not a multiple of {dst}",
        )
    return bitcast_p.bind(x, ty=ty)


@bitcast_p.def_abstract_eval
def _bitcast_abstract_eval(x, *, ty):
    shape = (*x.shape[:-2], x.shape[-2] * _bits(x.dtype) // _bits(ty), x.shape[-1])
    return compat.ShapedArray(shape, ty)


def _bitcast_impl(x, *, ty):
    src, dst = _bits(x.dtype), _bits(ty)
    *lead, m, n = x.shape
    if src < dst:  # rows (k*i .. k*i+k-1) become the k parts of row i, lowest first
        k = dst // src
        parts = jnp.swapaxes(x.reshape(*lead, m // k, k, n), -1, -2)
        return lax.bitcast_convert_type(parts, ty)
    if src > dst:
        parts = lax.bitcast_convert_type(x, ty)  # (..., m, n, k)
        return jnp.swapaxes(parts, -1, -2).reshape(*lead, m * (src // dst), n)
    return lax.bitcast_convert_type(x, ty)


def _bitcast_batch(args, dims, *, ty):
    # The batch dimension must not be one of the last two, which bitcast reshapes.
    return bitcast_p.bind(_move_to_front(args[0], dims[0]), ty=ty), 0


batching.primitive_batchers[bitcast_p] = _bitcast_batch
_register_interpret(bitcast_p, _bitcast_impl)


# ---------------------------------------------------------- pack / unpack elementwise


def _packing_factor(op: str, unpacked_dtype, packed_dtype) -> int:
    u, p = _bits(unpacked_dtype), _bits(packed_dtype)
    if u % p:
        raise _error(
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
        raise _error(ValueError, "pack_elementwise", "needs at least one source")
    first = xs[0]
    for i, x in enumerate(xs):
        if x.shape != first.shape or x.dtype != first.dtype:
            raise _error(
                ValueError,
                "pack_elementwise",
                f"all sources must have one shape and dtype: xs[0] is {first.dtype}{list(first.shape)}, "
                f"xs[{i}] is {x.dtype}{list(x.shape)}",
            )
    ok_float = first.dtype == jnp.float32 and packed_dtype == jnp.bfloat16
    ok_int = _is_int(first.dtype) and _is_int(packed_dtype)
    if not (ok_float or ok_int):
        raise _error(
            TypeError,
            "pack_elementwise",
            f"only float32 -> bfloat16 and integer -> integer are supported, got {first.dtype} -> {packed_dtype}",
        )
    factor = _packing_factor("pack_elementwise", first.dtype, packed_dtype)
    if len(xs) != factor:
        raise _error(
            ValueError,
            "pack_elementwise",
            f"{first.dtype} holds {factor} {packed_dtype} values, but {len(xs)} sources were given",
        )
    return pack_elementwise_p.bind(*xs, packed_dtype=packed_dtype)


@pack_elementwise_p.def_abstract_eval
def _pack_abstract_eval(*xs, packed_dtype):
    return compat.ShapedArray(xs[0].shape, _uint(_bits(xs[0].dtype)))


def _pack_impl(*xs, packed_dtype):
    width = _bits(xs[0].dtype)
    p = _bits(packed_dtype)
    out_t = _uint(width)
    mask = np.array((1 << p) - 1, out_t)
    out = jnp.zeros(xs[0].shape, out_t)
    for i, x in enumerate(xs):
        if _is_float(x.dtype):
            field = lax.bitcast_convert_type(x.astype(packed_dtype), _uint(p)).astype(out_t)
        else:
            field = lax.bitcast_convert_type(x, out_t) & mask
        out = out | (field << np.array(i * p, out_t))
    return out


def _pack_batch(args, dims, *, packed_dtype):
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    xs = [
        jnp.broadcast_to(x, (size, *x.shape)) if d is None else _move_to_front(x, d)
        for x, d in zip(args, dims, strict=True)
    ]
    return pack_elementwise_p.bind(*xs, packed_dtype=packed_dtype), 0


batching.primitive_batchers[pack_elementwise_p] = _pack_batch
_register_interpret(pack_elementwise_p, _pack_impl)


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
    if _bits(x.dtype) != _bits(unpacked_dtype):
        raise _error(
            TypeError,
            "unpack_elementwise",
            f"x ({x.dtype}) must have the bit width of unpacked_dtype ({unpacked_dtype})",
        )
    if not (
        (_is_float(packed_dtype) and _is_float(unpacked_dtype))
        or (_is_int(packed_dtype) and _is_int(unpacked_dtype))
    ):
        raise _error(
            TypeError,
            "unpack_elementwise",
            f"packed and unpacked dtypes must both be floats or both integers, got {packed_dtype} and {unpacked_dtype}",
        )
    factor = _packing_factor("unpack_elementwise", unpacked_dtype, packed_dtype)
    if not isinstance(index, (int, np.integer)) or not 0 <= index < factor:
        raise _error(
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
    width, p = _bits(x.dtype), _bits(packed_dtype)
    word = lax.bitcast_convert_type(x, _uint(width))
    field = (word >> np.array(index * p, word.dtype)) & np.array((1 << p) - 1, word.dtype)
    value = lax.bitcast_convert_type(field.astype(_uint(p)), packed_dtype)
    return value.astype(unpacked_dtype)


batching.defvectorized(unpack_elementwise_p)
_register_interpret(unpack_elementwise_p, _unpack_impl)


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

    Interpret-mode semantics: with ``u = random_bits / 2**32``, ``x`` rounds
    away from zero when ``u < (|x| - |lo|) / (|hi| - |lo|)``; for bfloat16
    this is the usual "add 16 random bits below the kept mantissa, then
    truncate" rule. Values beyond the target's largest finite value saturate
    to it (bfloat16 rounds to inf as IEEE rounding would); NaN and inf are
    kept. Integer targets (int4) round ``floor(x)`` or ``floor(x) + 1`` and
    saturate to [-8, 7]. The TPU's own rounding of ties between draws may
    differ in the last random bit.

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
        raise _error(TypeError, "stochastic_round", f"x must be float32, got {x.dtype}")
    if random_bits.dtype != jnp.uint32:
        raise _error(
            TypeError,
            "stochastic_round",
            f"random_bits must be uint32, got {random_bits.dtype} (bitcast prng_random_bits' int32 first)",
        )
    if random_bits.shape != x.shape:
        raise _error(
            ValueError,
            "stochastic_round",
            f"random_bits has shape {random_bits.shape} but x has shape {x.shape}",
        )
    if target_dtype not in _STOCHASTIC_TARGETS:
        raise _error(
            TypeError,
            "stochastic_round",
            f"unsupported target_dtype {target_dtype}; supported: {', '.join(map(str, _STOCHASTIC_TARGETS))}",
        )
    return stochastic_round_p.bind(x, random_bits, target_dtype=target_dtype)


@stochastic_round_p.def_abstract_eval
def _stochastic_round_abstract_eval(x, random_bits, *, target_dtype):
    del random_bits
    return compat.ShapedArray(x.shape, target_dtype)


def _stochastic_round_impl(x, random_bits, *, target_dtype):
    if target_dtype == jnp.bfloat16:
        word = lax.bitcast_convert_type(x, jnp.uint32) + (random_bits >> 16)
        rounded = lax.bitcast_convert_type(word & np.uint32(0xFFFF0000), jnp.float32).astype(jnp.bfloat16)
        return jnp.where(jnp.isfinite(x), rounded, x.astype(jnp.bfloat16))
    # A uniform draw in [0, 1), exact in float32.
    u = (random_bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
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
    nbits = _uint(_bits(target_dtype))
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
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else _move_to_front(a, d)
        for a, d in zip(args, dims, strict=True)
    )
    return stochastic_round_p.bind(x, bits, target_dtype=target_dtype), 0


batching.primitive_batchers[stochastic_round_p] = _stochastic_round_batch
_register_interpret(stochastic_round_p, _stochastic_round_impl)


# --------------------------------------------------------------------- reciprocal

reciprocal_p = Primitive("reciprocal")


def reciprocal(x, *, approx: bool = False, full_range: bool = True) -> jax.Array:
    """Computes ``1 / x``, optionally with the TPU's fast approximation.

    Args:
      x: a float32 or bfloat16 array.
      approx: use the approximate reciprocal. Interpret mode models it by
        computing in bfloat16 (about 3 significant digits), as JAX does.
      full_range: if False the TPU may return non-IEEE results for inf, NaN,
        zero and values near the float range's ends; no effect in interpret
        mode.

    Returns:
      ``1 / x`` with the dtype and shape of ``x``.
    """
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise _error(TypeError, "reciprocal", f"x must be float32 or bfloat16, got {x.dtype}")
    return reciprocal_p.bind(x, approx=bool(approx), full_range=bool(full_range))


@reciprocal_p.def_abstract_eval
def _reciprocal_abstract_eval(x, *, approx, full_range):
    del approx, full_range
    return compat.ShapedArray(x.shape, x.dtype)


def _reciprocal_impl(x, *, approx, full_range):
    del full_range
    if approx:
        return jnp.reciprocal(x.astype(jnp.bfloat16)).astype(x.dtype)
    return jnp.reciprocal(x)


def _reciprocal_jvp(primals, tangents, *, approx, full_range):
    (x,), (t,) = primals, tangents
    y = reciprocal_p.bind(x, approx=approx, full_range=full_range)
    if type(t) is ad.Zero:
        return y, ad.Zero.from_primal_value(y)
    return y, -t * y * y


batching.defvectorized(reciprocal_p)
ad.primitive_jvps[reciprocal_p] = _reciprocal_jvp
_register_interpret(reciprocal_p, _reciprocal_impl)


# -------------------------------------------------------------------- trace_value


class TraceEffect(Effect):
    """``trace_value`` writes to the profiler trace: keep it, in order."""

    __str__ = lambda self: "TpuTrace"  # noqa: E731


trace_effect = TraceEffect()
compat.allow_effect_in_kernels(TraceEffect)

trace_value_p = Primitive("trace_value")
trace_value_p.multiple_results = True


def trace_value(label: str, value: jax.Array) -> None:
    """Attaches a scalar to the enclosing xprof trace region (TPU profiler).

    Interpret mode has no profiler: the value is checked and dropped.

    Args:
      label: the name the value gets in the trace viewer.
      value: an int32 or float32 scalar.
    """
    value = jnp.asarray(value)
    if not isinstance(label, str):
        raise _error(TypeError, "trace_value", f"label must be a str, got {type(label).__name__}")
    if value.shape != ():
        raise _error(ValueError, "trace_value", f"value must be a scalar, got shape {value.shape}")
    if value.dtype not in (jnp.int32, jnp.float32):
        raise _error(TypeError, "trace_value", f"value must be int32 or float32, got {value.dtype}")
    trace_value_p.bind(value, label=label)


@trace_value_p.def_effectful_abstract_eval
def _trace_value_abstract_eval(value, *, label):
    del value, label
    return [], {trace_effect}


def _trace_value_batch(args, dims, *, label):
    del dims
    # One trace entry per element would flood the trace; log the first lane.
    (value,) = args
    trace_value_p.bind(jnp.reshape(value, (-1,))[0], label=label)
    return [], []


batching.primitive_batchers[trace_value_p] = _trace_value_batch
_register_interpret(trace_value_p, lambda value, *, label: [], multiple_results=True)


# -------------------------------------------------------------------------- touch

touch_p = Primitive("touch")
touch_p.multiple_results = True


def touch(ref) -> None:
    """Adds a fake read and write of ``ref``, so the compiler keeps
    operations on it ordered around this point (no value effect).

    Args:
      ref: a Ref, a sliced/transformed Ref, or a pytree of them.
    """
    for leaf in jax.tree.leaves(ref):
        if isinstance(leaf, compat.TransformedRef):
            leaf = leaf.ref
        if not isinstance(compat.typeof(leaf), compat.AbstractRef):
            raise _error(TypeError, "touch", f"expects Refs, got {compat.typeof(leaf)}")
        touch_p.bind(leaf)


@touch_p.def_effectful_abstract_eval
def _touch_abstract_eval(ref):
    del ref
    return [], {compat.ReadEffect(0), compat.WriteEffect(0)}


def _touch_batch(args, dims):
    del dims
    touch_p.bind(*args)
    return [], []


def _touch_discharge(*args, **params):
    # (ctx, ref) in JAX 0.11+, (in_avals, out_avals, ref) before: nothing to do.
    del args, params
    return [None], []


batching.primitive_batchers[touch_p] = _touch_batch
interpret_rules.STATE_RULES[touch_p] = lambda ctx, eqn, ref: []  # orders nothing in an interpreter
compat.register_discharge_rule(touch_p)(_touch_discharge)
_register_interpret(touch_p, lambda ref: [], multiple_results=True)


# ----------------------------------------------------------------------- annotate


def _memory_space_name(memory_space) -> str | None:
    if memory_space is None:
        return None
    inner = getattr(memory_space, "memory_space", memory_space)  # a per-core space
    return str(getattr(inner, "value", inner)).lower()


def annotate(
    ref: Any,
    *,
    no_store: bool = False,
    no_bank_conflict: bool = False,
    no_hazard: bool = False,
    no_hazard_no_deps: bool = False,
):
    """Declares access assumptions about a Ref for the TPU compiler.

    ``no_store``: nothing stores to the buffer (the compiler may reload
    instead of spilling); ``no_bank_conflict``: accesses never conflict;
    ``no_hazard``: read-after-write latency of 1 cycle (VMEM only);
    ``no_hazard_no_deps``: drop memory dependencies between loads and stores
    (VMEM only). ``no_bank_conflict`` combines with at most one other.

    The assumptions change scheduling, never values: interpret mode checks
    them and returns ``ref`` unchanged.

    Args:
      ref: a Ref or a sliced/transformed Ref.
      no_store, no_bank_conflict, no_hazard, no_hazard_no_deps: the
        assumptions.

    Returns:
      The Ref to use for the annotated accesses.
    """
    base = ref.ref if isinstance(ref, compat.TransformedRef) else ref
    aval = compat.typeof(base)
    if not isinstance(aval, compat.AbstractRef):
        raise _error(TypeError, "annotate", f"ref must be a Ref, got {aval}")
    if sum((no_store, no_hazard, no_hazard_no_deps)) > 1:
        raise _error(
            ValueError,
            "annotate",
            "no_store, no_hazard and no_hazard_no_deps exclude each other "
            "(only no_bank_conflict combines with one of them)",
        )
    space = _memory_space_name(getattr(aval, "memory_space", None))
    if (no_hazard or no_hazard_no_deps) and space not in (None, "vmem"):
        raise _error(
            ValueError,
            "annotate",
            f"no_hazard and no_hazard_no_deps are only valid for VMEM Refs, this Ref is in {space}",
        )
    return ref


# --------------------------------------------------- with_memory_space_constraint

_CONSTRAINABLE_SPACES = ("hbm", "vmem", "smem", "host")

with_memory_space_constraint_p = Primitive("with_memory_space_constraint")


def with_memory_space_constraint(x: jax.Array, memory_space: Any) -> jax.Array:
    """Asks that array ``x`` be placed in ``memory_space`` when it is passed to
    ``pl.kernel``, which gives the body a Ref in that space (e.g. SMEM for scalars
    read with dynamic indices). The value is unchanged; other ops, ``pallas_call``
    and jit outputs ignore the request.

    Args:
      x: an array.
      memory_space: ``pl.ANY`` (no constraint), or HBM, VMEM, SMEM or HOST.

    Returns:
      ``x``, carrying the constraint.
    """
    name = _memory_space_name(memory_space)
    if name == "any":
        return x
    if name not in _CONSTRAINABLE_SPACES:
        raise _error(
            NotImplementedError,
            "with_memory_space_constraint",
            f"only HBM, VMEM, SMEM and HOST are supported, got memory_space={memory_space}",
        )
    x = jnp.asarray(x)
    # The result's type stays a plain array; pl.kernel reads the request from this record.
    return constrain_memory_space(
        with_memory_space_constraint_p.bind(x, memory_space=memory_space), memory_space
    )


@with_memory_space_constraint_p.def_abstract_eval
def _wmsc_abstract_eval(x, *, memory_space):
    del memory_space
    return compat.ShapedArray(x.shape, x.dtype)


batching.defvectorized(with_memory_space_constraint_p)
ad.deflinear2(
    with_memory_space_constraint_p, lambda ct, x, **p: [with_memory_space_constraint_p.bind(ct, **p)]
)
_register_interpret(with_memory_space_constraint_p, lambda x, *, memory_space: x)
