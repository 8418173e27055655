"""What the counter-based PRNG kernels share, with the helpers of JAX's
``ops.tpu.random.prng_utils`` (``round_up``, ``blocked_iota``,
``compute_scalar_offset``).

A counter-based generator hashes each element's counter under the key: the
counter of the element at multi-index ``i`` of a (possibly padded) output is
its row-major position in the *unpadded* shape, plus an offset (Philox's
``fold_in``). ``_kernel.counter_bits`` is the one Pallas kernel both generators
use: the grid walks ``(bh, bw)`` blocks of the last two dimensions (one index
per leading dimension); a block is hashed in strips of a few vregs
(``_blocks.strip_rows`` rows, a loop), so the hash's temporaries stay in
registers however large the block, and each strip is stored as it is done.
Blocks come from ``_blocks.choose_block``: the chip's measured rows (none yet,
for the v5e or any chip), else a rule from its facts.

The family's modules (the skeleton of every family, ``pallas_tpu.ops``' docstring):
``threefry``, ``philox`` and this one, the API with JAX's names; ``_kernel`` the
kernel and its ``pallas_call``; ``_blocks`` the block choice; ``_checks`` the
argument checks; the reference is ``jax.random`` (threefry) and Random123's known
answers (the tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import define_prng_impl

# A shape: one int per dimension.
Shape = Sequence[int]
_UINT32_MAX = (1 << 32) - 1


def round_up(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y``."""
    return -(-x // y) * y


def strides(shape: Shape) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, step = [], 1
    for d in reversed(tuple(shape)):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def u32(value: int) -> np.uint32:
    """``value`` as a uint32 (wrapping)."""
    return np.uint32(value & _UINT32_MAX)


def blocked_iota(block_shape: Shape, total_shape: Shape) -> jax.Array:
    """The row-major positions in ``total_shape`` of a ``block_shape`` block at
    the origin (uint32, wrapping past 2**32): add the block's own position
    (``compute_scalar_offset``) to place it anywhere.

    Args:
      block_shape: the shape of the result; its dimensions are the last ones of
        ``total_shape`` (it may have fewer).
      total_shape: the shape whose strides count the positions.

    Returns:
      ``uint32[block_shape]``.
    """
    block_shape = tuple(block_shape)
    total_strides = strides(total_shape)[len(total_shape) - len(block_shape) :]
    positions = jnp.zeros(block_shape, jnp.uint32)
    for dim, stride in enumerate(total_strides):
        along = lax.broadcasted_iota(jnp.uint32, block_shape, dim)
        positions = positions + (along * u32(stride) if stride != 1 else along)
    return positions


def compute_scalar_offset(iteration_index, total_size: Shape, block_size: Shape):
    """The row-major position in ``total_size`` of the first element of the
    block at ``iteration_index`` (blocks of ``block_size``), in uint32
    (wrapping past 2**32).

    Args:
      iteration_index: the block's index per dimension (ints or traced ints,
        e.g. ``pl.program_id``).
      total_size: the shape whose strides count the positions.
      block_size: the block shape, as long as ``total_size``.

    Returns:
      A uint32 scalar.
    """
    total = jnp.uint32(0)
    for index, block, stride in zip(iteration_index, block_size, strides(total_size)):
        total = total + jnp.asarray(index).astype(jnp.uint32) * u32(block * stride)
    return total


def two_word_prng_impl(name: str, tag: str, seed, split, random_bits, fold_in):
    """A ``jax.random`` implementation of keys of two uint32 words (``define_prng_impl``) made of
    these functions, for ``jax.random.key(seed, impl=...)`` (not registered by name)."""
    return define_prng_impl(
        key_shape=(2,), seed=seed, split=split, random_bits=random_bits, fold_in=fold_in, name=name, tag=tag
    )
