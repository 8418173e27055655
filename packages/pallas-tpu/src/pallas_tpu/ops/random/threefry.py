"""Threefry-2x32 as a Pallas TPU kernel, with the names and call signatures of
JAX's ``ops.tpu.random.threefry``; its bits equal ``jax.random``'s.

Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror and Shaw, "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) hashes a 64-bit counter under a 64-bit
key with 32-bit adds, rotations and xors, which the TPU's vector unit does
natively. ``jax.random`` (``jax_threefry_partitionable``, the default since JAX
0.5) gives the element at row-major position ``i`` of the requested shape the
two words of the hash of counter ``(0, i)``: their xor as 32 bits, their low
bits for 8 and 16, the first word over the second for 64. This module hashes the
same counters inside a kernel (``_kernel.counter_bits``), so its bits,
``split`` and ``fold_in`` equal ``jax.random``'s for the same key.

``plthreefry_prng_impl`` is a ``jax.random`` implementation whose bits, splits
and folds are these kernels: ``jax.random.key(seed, impl=plthreefry_prng_impl)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_tpu.ops.random import _checks, _kernel, prng_utils

Shape = Sequence[int]

# The block JAX's module uses; ``threefry_2x32_count`` takes any, and
# ``plthreefry_random_bits`` chooses its own (``_blocks.choose_block``).
BLOCK_SIZE = (256, 256)

# Rotation amounts of Threefry-2x32, rounds 0-7 (then again) (SC 2011, table 4).
ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
# The key schedule's parity constant (Skein's C240).
KEY_PARITY = 0x1BD11BDA
# Threefry-2x32's rounds (``jax.random``'s).
ROUNDS = 20


def _rotate_left(x, r: int):
    return lax.shift_left(x, jnp.uint32(r)) | lax.shift_right_logical(x, jnp.uint32(32 - r))


def threefry_2x32(k0, k1, x0, x1, rounds: int = ROUNDS):
    """The Threefry-2x32 hash of the counter ``(x0, x1)`` under the key
    ``(k0, k1)`` (uint32 arrays, broadcast together): the two output words.
    The key is injected every four rounds, with the round-group number added to
    the second word."""
    schedule = (k0, k1, k0 ^ k1 ^ jnp.uint32(KEY_PARITY))
    x0, x1 = x0 + schedule[0], x1 + schedule[1]
    for r in range(rounds):
        x0 = x0 + x1
        x1 = _rotate_left(x1, ROTATIONS[r % 8]) ^ x0
        if r % 4 == 3:
            group = r // 4 + 1
            x0 = x0 + schedule[group % 3]
            x1 = x1 + schedule[(group + 1) % 3] + jnp.uint32(group)
    return x0, x1


def _hash_counter(k0, k1, counter):
    # The counter's high word is 0: shapes have fewer than 2**32 elements.
    return threefry_2x32(k0, k1, jnp.uint32(0), counter)


def threefry_2x32_count(key, shape: Shape, unpadded_shape: Shape, block_size: tuple[int, int]):
    """Random bits of Threefry-2x32: the hash of each element's row-major
    position in ``unpadded_shape``, the xor of its two words.

    Args:
      key: a threefry key (``uint32[2]``, or a typed key of that data).
      shape: the output's shape (at least 2-d); its last two dimensions must be
        divisible by ``block_size``.
      unpadded_shape: the shape whose positions count (``shape`` when it is not
        padded); elements beyond it have unspecified bits.
      block_size: ``(rows, lanes)``, the kernel's block of the last two
        dimensions: multiples of (8, 128) or whole dimensions.

    Returns:
      ``uint32[shape]``.
    """
    op = "threefry_2x32_count"
    key, shape, unpadded_shape, block = _checks.check_counter_args(op, key, shape, unpadded_shape, block_size)
    return _kernel.counter_bits(_hash_counter, key, shape, unpadded_shape, block, name="threefry_2x32")


def _words(key, shape, *, offset=0, fuse_output=True):
    return _kernel.flat_bits(
        _hash_counter, key, shape, offset=offset, fuse_output=fuse_output, name="threefry_2x32"
    )


def plthreefry_random_bits(key, bit_width: int, shape: Shape):
    """``jax.random.bits`` of a threefry key, hashed by a Pallas kernel.

    Args:
      key: a threefry key (``uint32[2]``, or a typed key of that data).
      bit_width: 8, 16, 32 or 64 (64 needs ``jax_enable_x64``).
      shape: the output's shape (any rank, fewer than 2**32 elements).

    Returns:
      ``uint{bit_width}[shape]``, equal to ``jax.random.bits`` of the same key.
    """
    op = "plthreefry_random_bits"
    bit_width = _checks.check_bit_width(op, bit_width)
    shape = _checks.check_shape(op, shape)
    key = _checks.key_data(op, key)
    return _kernel.bits_of_width(lambda fuse: _words(key, shape, fuse_output=fuse), bit_width, shape)


def threefry_split(key, shape: Shape):
    """``jax.random.split``: the keys ``shape`` of them, hashed by a Pallas kernel
    (each key the two words of its position's hash)."""
    shape = _checks.check_shape("threefry_split", shape)
    words = _words(_checks.key_data("threefry_split", key), shape, fuse_output=False)
    return jnp.stack([words[0], words[1]], axis=-1)


def threefry_fold_in(key, data):
    """``jax.random.fold_in``: the two words of the hash of counter ``data``."""
    data = jnp.asarray(data)
    if data.ndim != 0:
        raise ValueError(f"threefry_fold_in: data must be a scalar, got shape {data.shape}")
    words = _words(_checks.key_data("threefry_fold_in", key), (), offset=data, fuse_output=False)
    return words.reshape(2)


def threefry_seed(seed):
    """The threefry key of an integer seed, as ``jax.random.key`` makes it."""
    return jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))


# A ``jax.random`` implementation made of these kernels: ``jax.random.key(seed, impl=plthreefry_prng_impl)``.
plthreefry_prng_impl = prng_utils.two_word_prng_impl(
    "pallas_threefry2x32", "plfry", threefry_seed, threefry_split, plthreefry_random_bits, threefry_fold_in
)
