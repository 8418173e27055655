"""Value-level TPU primitives: ``roll``, ``bitcast`` and ``reciprocal`` here;
``pack_elementwise``, ``unpack_elementwise`` and ``stochastic_round`` in
``vector_packing.py``; the ops with no value semantics (``trace_value``,
``touch``, ``annotate``, ``with_memory_space_constraint``) in
``vector_annotations.py``. This module re-exports those, so the public API, the
Mosaic lowering and ``run_mosaic`` find every one as ``vector_primitives.X``.
The conventions all of them follow (one block per primitive, its interpret
semantics registered as its lowering off the TPU) are in ``vector_common.py``.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from pallas_tpu._src import compat

# The primitives of the sibling modules (see the module docstring).
from pallas_tpu._src.language.vector_annotations import annotate as annotate
from pallas_tpu._src.language.vector_annotations import touch as touch
from pallas_tpu._src.language.vector_annotations import touch_p as touch_p
from pallas_tpu._src.language.vector_annotations import trace_value as trace_value
from pallas_tpu._src.language.vector_annotations import trace_value_p as trace_value_p
from pallas_tpu._src.language.vector_annotations import (
    with_memory_space_constraint as with_memory_space_constraint,
)
from pallas_tpu._src.language.vector_annotations import (
    with_memory_space_constraint_p as with_memory_space_constraint_p,
)
from pallas_tpu._src.language.vector_common import bit_width, move_to_front, op_error, register_interpret
from pallas_tpu._src.language.vector_packing import pack_elementwise as pack_elementwise
from pallas_tpu._src.language.vector_packing import pack_elementwise_p as pack_elementwise_p
from pallas_tpu._src.language.vector_packing import stochastic_round as stochastic_round
from pallas_tpu._src.language.vector_packing import stochastic_round_impl as stochastic_round_impl
from pallas_tpu._src.language.vector_packing import stochastic_round_p as stochastic_round_p
from pallas_tpu._src.language.vector_packing import unpack_elementwise as unpack_elementwise
from pallas_tpu._src.language.vector_packing import unpack_elementwise_p as unpack_elementwise_p

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
            raise op_error(ValueError, "roll", f"shift must be non-negative, got {shift}")
    shift = jnp.asarray(shift)
    if shift.shape != () or not jnp.issubdtype(shift.dtype, jnp.integer):
        raise op_error(
            TypeError, "roll", f"shift must be an integer scalar, got {shift.dtype}{list(shift.shape)}"
        )
    shift = shift.astype(jnp.int32)
    if not isinstance(axis, (int, np.integer)) or not 0 <= axis < x.ndim:
        raise op_error(ValueError, "roll", f"axis {axis} is out of range for an array of rank {x.ndim}")
    if (stride is None) != (stride_axis is None):
        raise op_error(ValueError, "roll", "give both stride and stride_axis, or neither")
    if stride is not None:
        stride_axis = cast(int, stride_axis)  # given with stride (checked above)
        if stride < 0:
            raise op_error(ValueError, "roll", f"stride must be non-negative, got {stride}")
        if not 0 <= stride_axis < x.ndim:
            raise op_error(ValueError, "roll", f"stride_axis {stride_axis} is out of range for rank {x.ndim}")
        if stride_axis == axis:
            raise op_error(ValueError, "roll", f"axis and stride_axis must differ, both are {axis}")
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
        x = move_to_front(x, xd)
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
    compat.zero_tangent(primals[0])
    if type(tangents[0]) is ad.Zero
    else roll_p.bind(ad.instantiate_zeros(tangents[0]), primals[1], **p),
)
register_interpret(roll_p, _roll_impl)


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
        raise op_error(ValueError, "bitcast", f"needs an array of rank >= 2, got shape {x.shape}")
    for d in (x.dtype, ty):
        if d == jnp.bool_ or d.kind == "c":
            raise op_error(TypeError, "bitcast", f"{d} cannot be bitcast on a TPU")
    src, dst = bit_width(x.dtype), bit_width(ty)
    if (x.shape[-2] * src) % dst:
        raise op_error(
            ValueError,
            "bitcast",
            f"the second-to-last dimension ({x.shape[-2]}) of {x.dtype} cannot be packed into "
            f"{ty}: {x.shape[-2]} * {src} bits is not a multiple of {dst}",
        )
    return bitcast_p.bind(x, ty=ty)


@bitcast_p.def_abstract_eval
def _bitcast_abstract_eval(x, *, ty):
    shape = (*x.shape[:-2], x.shape[-2] * bit_width(x.dtype) // bit_width(ty), x.shape[-1])
    return compat.ShapedArray(shape, ty)


def bitcast_impl(x, *, ty):
    src, dst = bit_width(x.dtype), bit_width(ty)
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
    return bitcast_p.bind(move_to_front(args[0], dims[0]), ty=ty), 0


batching.primitive_batchers[bitcast_p] = _bitcast_batch
register_interpret(bitcast_p, bitcast_impl)

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
        raise op_error(TypeError, "reciprocal", f"x must be float32 or bfloat16, got {x.dtype}")
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
        return y, compat.zero_tangent(y)
    return y, -t * y * y


batching.defvectorized(reciprocal_p)
ad.primitive_jvps[reciprocal_p] = _reciprocal_jvp
register_interpret(reciprocal_p, _reciprocal_impl)
