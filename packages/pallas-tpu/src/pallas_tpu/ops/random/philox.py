"""Philox-4x32-10 as a Pallas TPU kernel, with the names and call signatures of
JAX's ``ops.tpu.random.philox``; its bits equal JAX's op's.

Philox-4x32 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy
as 1, 2, 3", SC 2011) hashes a 128-bit counter ``(c0, c1, c2, c3)`` under a
64-bit key ``(k0, k1)`` in 10 rounds: each multiplies ``c0`` and ``c2`` by
constants into 64-bit products and mixes their halves with the other words and
the key, the key growing by the golden-ratio Weyl constants between rounds.
A TPU's vector unit multiplies 32 x 32 -> 32 bits only, so the high half of a
product is built from 16-bit halves (``mul32_hi_lo``).

As JAX's op: element ``i`` of a shape (row-major) hashes the counter
``(0, i + offset, 0, 0)``; random bits are the xor of the first two output words,
a split key is those two words, ``fold_in(key, d)`` the two words of counter
``(0, d, 0, 0)``. ``plphilox_prng_impl`` is a ``jax.random`` implementation made
of these kernels (seeded as threefry seeds): ``jax.random.key(s, impl=plphilox_prng_impl)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

from pallas_tpu.ops.random import _checks, _kernel, prng_utils
from pallas_tpu.ops.random.threefry import threefry_seed

Shape = Sequence[int]

# The block JAX's module uses; ``philox_4x32_kernel`` takes any, and
# ``philox_4x32_count`` chooses its own (``_blocks.choose_block``).
BLOCK_SIZE = (256, 256)

# The key's Weyl increments (SC 2011, section 5): the golden ratio, in 32 bits, added to
# the key's first word between rounds;
K_HI_32 = 0x9E3779B9
# sqrt(3) - 1, in 32 bits, added to its second.
K_LO_32 = 0xBB67AE85
# The round multiplier of the third counter word.
MUL_A = 0xCD9E8D57
# The round multiplier of the first counter word.
MUL_B = 0xD2511F53
# Philox-4x32-10's rounds.
ROUNDS = 10

_LOW16 = 0xFFFF


def mul32_hi_lo(x, y):
    """The high and low 32 bits of the 64-bit product of uint32 ``x`` and ``y``.

    The low word is the wrapping product; the high word is long multiplication in
    16-bit digits (Hacker's Delight, section 8-2), each partial sum below 2**32."""
    x, y = jnp.asarray(x, jnp.uint32), jnp.asarray(y, jnp.uint32)
    sixteen = jnp.uint32(16)
    x_hi, x_lo = lax.shift_right_logical(x, sixteen), x & jnp.uint32(_LOW16)
    y_hi, y_lo = lax.shift_right_logical(y, sixteen), y & jnp.uint32(_LOW16)
    low_product = x_lo * y_lo
    carry = x_hi * y_lo + lax.shift_right_logical(low_product, sixteen)
    middle = x_lo * y_hi + (carry & jnp.uint32(_LOW16))
    high = x_hi * y_hi + lax.shift_right_logical(carry, sixteen) + lax.shift_right_logical(middle, sixteen)
    return high, x * y


def philox_4x32(hi0, lo0, hi1, lo1, k_hi, k_lo, rounds: int = ROUNDS):
    """The Philox-4x32 hash of the counter ``(hi0, lo0, hi1, lo1)`` under the key
    ``(k_hi, k_lo)`` (uint32 arrays, broadcast together), ``rounds`` rounds: the
    four output words in the same order."""
    c0, c1, c2, c3 = hi0, lo0, hi1, lo1
    for r in range(rounds):
        if r:
            k_hi = k_hi + jnp.uint32(K_HI_32)
            k_lo = k_lo + jnp.uint32(K_LO_32)
        b_hi, b_lo = mul32_hi_lo(jnp.uint32(MUL_B), c0)
        a_hi, a_lo = mul32_hi_lo(jnp.uint32(MUL_A), c2)
        c0, c1, c2, c3 = a_hi ^ c1 ^ k_hi, a_lo, b_hi ^ c3 ^ k_lo, b_lo
    return c0, c1, c2, c3


def _hash_counter(k0, k1, counter):
    # The other counter words are 0 (scalars: the first round's products of them
    # are scalar work, not vector work).
    zero = jnp.uint32(0)
    w0, w1, _, _ = philox_4x32(zero, counter, zero, zero, k0, k1)
    return w0, w1


def _check_offset(op: str, offset):
    offset = jnp.asarray(offset)
    if offset.ndim != 0:
        raise ValueError(f"{op}: offset must be a scalar, got shape {offset.shape}")
    if not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(f"{op}: offset must be an integer, got {offset.dtype}")
    return offset.astype(jnp.uint32)


def philox_4x32_kernel(
    key,
    shape: Shape,
    unpadded_shape: Shape,
    block_size: tuple[int, int],
    offset=0,
    fuse_output: bool = True,
):
    """Random bits of Philox-4x32-10: the hash of each element's row-major
    position in ``unpadded_shape`` plus ``offset``.

    Args:
      key: a key of two uint32 words (``uint32[2]``, or a typed key of that data).
      shape, unpadded_shape, block_size: as ``threefry.threefry_2x32_count`` takes them (the
        output's shape, at least 2-d; the shape whose positions count; the kernel's block of
        the last two dimensions, which must divide them).
      offset: a scalar added to every counter (uint32, wrapping).
      fuse_output: return the xor of the first two words; otherwise both.

    Returns:
      ``uint32[shape]`` (``fuse_output``) or ``uint32[2, *shape]``.
    """
    op = "philox_4x32_kernel"
    key, shape, unpadded_shape, block = _checks.check_counter_args(op, key, shape, unpadded_shape, block_size)
    return _kernel.counter_bits(
        _hash_counter,
        key,
        shape,
        unpadded_shape,
        block,
        offset=_check_offset(op, offset),
        fuse_output=fuse_output,
        name="philox_4x32",
    )


def philox_4x32_count(key, shape: Shape, offset=0, fuse_output: bool = True):
    """``philox_4x32_kernel`` of any shape (0-d and 1-d too), the blocks chosen
    (``_blocks.choose_block``)."""
    op = "philox_4x32_count"
    shape = _checks.check_shape(op, shape)
    key = _checks.key_data(op, key)
    return _kernel.flat_bits(
        _hash_counter,
        key,
        shape,
        offset=_check_offset(op, offset),
        fuse_output=fuse_output,
        name="philox_4x32",
    )


def philox_split(key, shape: Shape):
    """``jax.random.split`` for Philox keys: the two words of each position's hash."""
    words = philox_4x32_count(key, shape, fuse_output=False)
    return jnp.stack([words[0], words[1]], axis=-1)


def philox_random_bits(key, bit_width: int, shape: Shape):
    """``jax.random.bits`` for Philox keys: 32 bits are the xor of the first two
    words (JAX's op); 8 and 16 their low bits, 64 the first word over the second."""
    op = "philox_random_bits"
    bit_width = _checks.check_bit_width(op, bit_width)
    return _kernel.bits_of_width(
        lambda fuse: philox_4x32_count(key, shape, fuse_output=fuse), bit_width, shape
    )


def philox_fold_in(key, data):
    """``jax.random.fold_in`` for Philox keys: the two words of counter ``data``."""
    data = jnp.asarray(data)
    if data.ndim != 0:
        raise ValueError(f"philox_fold_in: data must be a scalar, got shape {data.shape}")
    return philox_4x32_count(key, (), offset=data, fuse_output=False)


# A ``jax.random`` implementation made of these kernels (seeded as threefry seeds):
# ``jax.random.key(seed, impl=plphilox_prng_impl)``.
plphilox_prng_impl = prng_utils.two_word_prng_impl(
    "pallas_philox4x32", "pllox", threefry_seed, philox_split, philox_random_bits, philox_fold_in
)
