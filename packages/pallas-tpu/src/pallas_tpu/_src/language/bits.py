"""Sub-byte fields of 8-bit words (JAX 0.12's ``pltpu.split_bits``,
``join_bits``, ``pack_fp6`` and ``unpack_fp6``): the int2 / int4 pieces a
6-bit float (fp6) is stored as, split from and joined into bytes.

A byte ``b7 b6 b5 b4 b3 b2 b1 b0`` read as fields from the least significant
bit: ``split_bits(x, (4, 2))`` gives ``b3..b0`` as int4 and ``b5 b4`` as
int2. An fp6 value kept in the low six bits of a byte (``fp6_in_8b``) is
stored split, as a 2-bit array of its high bits and a 4-bit array of its low
bits (``pack_fp6``), and joined back into bytes (``unpack_fp6``).

These are compositions of plain ``jnp`` ops (no primitive of their own): the
work is done in int32, whose shifts and masks every TPU generation's vector
unit has (v4 has no 8-bit vector ALU), and each field is narrowed to its
sub-byte type last. They run in every interpret mode and lower to Mosaic on
every supported JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp

from pallas_tpu._src.language.vector_common import bit_width, op_error

_FIELD_TYPES = {2: jnp.int2, 4: jnp.int4}


def _as_array(x, op: str, arg: str) -> jax.Array:
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise op_error(TypeError, op, f"{arg} must be an array, got {type(x).__name__}") from e


def split_bits(x: jax.Array, bitwidths: Sequence[int]) -> tuple[jax.Array, ...]:
    """Splits each byte of ``x`` into bit fields, the lowest field first.

    Args:
      x: an 8-bit integer array (``int8`` or ``uint8``).
      bitwidths: the fields' widths, each 2 or 4, from the least significant
        bit up (``(4, 2)``: bits 3..0, then bits 5..4); at most 8 bits in all.

    Returns:
      One array per width, of ``x``'s shape: ``int4`` for a 4-bit field,
      ``int2`` for a 2-bit one (the field's bits, read as a signed number).
    """
    op = "split_bits"
    x = _as_array(x, op, "x")
    if not jnp.issubdtype(x.dtype, jnp.integer) or bit_width(x.dtype) != 8:
        raise op_error(ValueError, op, f"x must be an 8-bit integer array (int8 or uint8), got {x.dtype}")
    try:
        widths = tuple(bitwidths)
    except TypeError:
        raise op_error(
            TypeError, op, f"bitwidths must be a tuple of ints (2 or 4), got {bitwidths!r}"
        ) from None
    for w in widths:
        if isinstance(w, bool) or w not in _FIELD_TYPES:
            raise op_error(ValueError, op, f"bitwidths may hold only 2 and 4, got {w!r} in {widths}")
    if sum(widths) > 8:
        raise op_error(
            ValueError, op, f"bitwidths {widths} add up to {sum(widths)} bits, more than a byte's 8"
        )
    word = x.astype(jnp.uint8).astype(jnp.int32)  # the byte's bits, zero-extended
    fields, offset = [], 0
    for w in widths:
        field = word if offset == 0 else jax.lax.shift_right_logical(word, jnp.int32(offset))
        fields.append(field.astype(_FIELD_TYPES[w]))  # keeps the field's low w bits
        offset += w
    return tuple(fields)


def _field(x, width: int, op: str, arg: str) -> jax.Array:
    x = _as_array(x, op, arg)
    if not jnp.issubdtype(x.dtype, jnp.integer) or bit_width(x.dtype) != width:
        names = {2: "int2 or uint2", 4: "int4 or uint4"}[width]
        raise op_error(ValueError, op, f"{arg} must be a {width}-bit integer array ({names}), got {x.dtype}")
    return x.astype(jnp.int32) & ((1 << width) - 1)  # the field's bits, zero-extended


def join_bits(*, two_bits: jax.Array | None = None, four_bits: jax.Array | None = None) -> jax.Array:
    """Joins 4-bit and 2-bit fields into bytes (the inverse of ``split_bits``).

    ``four_bits`` fills bits 3..0 and ``two_bits`` bits 5..4 of each byte;
    the bits above are zero. Given one field alone, it fills the lowest bits.

    Args:
      two_bits: a 2-bit array (``int2`` or ``uint2``), or None.
      four_bits: a 4-bit array (``int4`` or ``uint4``) of the same shape, or None.

    Returns:
      An ``int8`` array of the fields' shape.
    """
    op = "join_bits"
    if two_bits is None and four_bits is None:
        raise op_error(ValueError, op, "give two_bits, four_bits or both; got neither")
    low = None if four_bits is None else _field(four_bits, 4, op, "four_bits")
    high = None if two_bits is None else _field(two_bits, 2, op, "two_bits")
    if low is None:
        word = cast(jax.Array, high)  # not both None (checked above)
    elif high is None:
        word = low
    else:
        if low.shape != high.shape:
            raise op_error(
                ValueError,
                op,
                f"two_bits and four_bits must have one shape, got {tuple(high.shape)} and {tuple(low.shape)}",
            )
        word = low | (high << 4)
    return word.astype(jnp.int8)


def pack_fp6(fp6_in_8b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits 6-bit values kept in the low bits of bytes into their stored form.

    Args:
      fp6_in_8b: an 8-bit integer array whose bits 5..0 hold the values.

    Returns:
      ``(two_bits, four_bits)``: bits 5..4 as ``int2`` and bits 3..0 as ``int4``.
    """
    four_bits, two_bits = split_bits(fp6_in_8b, (4, 2))
    return two_bits, four_bits


def unpack_fp6(two_bits: jax.Array, four_bits: jax.Array) -> jax.Array:
    """Joins the stored form of 6-bit values back into bytes (``pack_fp6``'s inverse).

    Args:
      two_bits: bits 5..4 of each value (``int2`` or ``uint2``).
      four_bits: bits 3..0 of each value (``int4`` or ``uint4``), same shape.

    Returns:
      An ``int8`` array with the values in bits 5..0 and zeros above.
    """
    return join_bits(two_bits=two_bits, four_bits=four_bits)
