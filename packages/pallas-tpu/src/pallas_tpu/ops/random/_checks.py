"""The argument checks ``threefry`` and ``philox`` share, each raising with the op's name."""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_tpu.ops.random.prng_utils import Shape

_UINT32_MAX = (1 << 32) - 1


def check_block_size(op: str, shape: Shape, block_size, *, divide: bool) -> tuple[int, int]:
    """``block_size`` as ``(bh, bw)``, checked against ``shape``'s last two
    dimensions: a multiple of (8, 128) or the whole dimension; with ``divide``,
    dividing them (as JAX's op asks of the shapes it is given)."""
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise ValueError(f"{op}: block_size must be a pair (rows, lanes), got {block_size!r}")
    if not all(isinstance(b, (int, np.integer)) and b > 0 for b in block_size):
        raise ValueError(f"{op}: block_size must be positive ints, got {block_size!r}")
    bh, bw = (int(b) for b in block_size)
    h, w = shape[-2], shape[-1]
    if divide and (h % bh or w % bw):
        raise ValueError(
            f"{op}: shape dimensions {tuple(shape[-2:])} must be divisible by block_size {(bh, bw)}"
        )
    if bh % 8 and bh != h:
        raise ValueError(f"{op}: block_size[0]={bh} must be a multiple of 8 or all of shape[-2]={h}")
    if bw % 128 and bw != w:
        raise ValueError(f"{op}: block_size[1]={bw} must be a multiple of 128 or all of shape[-1]={w}")
    return bh, bw


def check_shape(op: str, shape, *, min_ndim: int = 0) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints with at most 2**32 - 1 elements
    (the counters are 32 bits)."""
    try:
        shape = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"{op}: shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"{op}: shape must have non-negative dimensions, got {shape}")
    if len(shape) < min_ndim:
        raise ValueError(f"{op}: shape must have at least {min_ndim} dimensions, got {shape}")
    if math.prod(shape) > _UINT32_MAX:
        raise ValueError(
            f"{op}: shape {shape} has {math.prod(shape)} elements, more than the 2**32 - 1 that 32-bit "
            "counters number"
        )
    return shape


def check_counter_args(op: str, key, shape, unpadded_shape, block_size):
    """``(key data, shape, unpadded_shape, block)`` of a counter kernel's call, checked: ``shape``
    at least 2-d, ``unpadded_shape`` fitting in it, the block dividing its last two dims."""
    shape = check_shape(op, shape, min_ndim=2)
    unpadded_shape = check_shape(op, unpadded_shape)
    if len(unpadded_shape) != len(shape) or any(u > s for u, s in zip(unpadded_shape, shape)):
        raise ValueError(
            f"{op}: unpadded_shape {unpadded_shape} must fit in shape {shape} (as many dims, none longer)"
        )
    block = check_block_size(op, shape, block_size, divide=True)
    return key_data(op, key), shape, unpadded_shape, block


def key_data(op: str, key) -> jax.Array:
    """A key's ``uint32[2]`` data: a raw key (``jax.random.PRNGKey``, or any
    two 32-bit integers) or a typed key of a two-word implementation."""
    if hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = jnp.asarray(key)
    if key.size != 2:
        raise ValueError(f"{op}: key must hold two 32-bit words (shape (2,)), got shape {key.shape}")
    if key.dtype not in (jnp.uint32, jnp.int32):
        raise TypeError(f"{op}: key must be uint32 (a raw threefry key), got {key.dtype}")
    return lax.bitcast_convert_type(key.reshape(2), jnp.uint32)


def check_bit_width(op: str, bit_width) -> int:
    """``bit_width``, one of the widths ``jax.random.bits`` takes."""
    if bit_width not in (8, 16, 32, 64):
        raise ValueError(f"{op}: bit_width must be 8, 16, 32 or 64, got {bit_width!r}")
    return int(bit_width)
