"""What the counter-based PRNG kernels share, with the helpers of JAX's
``ops.tpu.random.prng_utils`` (``round_up``, ``blocked_iota``,
``compute_scalar_offset``).

A counter-based generator hashes each element's counter under the key: the
counter of the element at multi-index ``i`` of a (possibly padded) output is
its row-major position in the *unpadded* shape, plus an offset (Philox's
``fold_in``). ``counter_bits`` is the one Pallas kernel both generators use:
the grid walks ``(bh, bw)`` blocks of the last two dimensions (one index per
leading dimension); a block is hashed in strips of a few vregs (``strip_rows``
rows, a loop), so the hash's temporaries stay in registers however large the
block, and each strip is stored as it is done.

Blocks (``choose_block``) are a rule from the chip's facts: rows as wide as
``MAX_LANES``, about ``TARGET_BLOCK_BYTES`` a block (the ~0.35 us a grid step
costs is then a few percent of a block's hashing on any generation), and at
least ``MIN_STEPS`` steps per TensorCore when there are
rows for them, so the write-back of one block overlaps the hashing of the next.
No measured table exists yet, for the v5e or any chip.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu

Shape = Sequence[int]

MAX_LANES = 1024
TARGET_BLOCK_BYTES = 2 << 20
MIN_STEPS = 4
# A strip of this many 32-bit elements is 8 vregs per live value: the hashes keep
# about four values live, half of the 64 vregs.
STRIP_ELEMS = 8 * 8 * 128
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


def _u32(value: int) -> np.uint32:
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
        positions = positions + (along * _u32(stride) if stride != 1 else along)
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
        total = total + jnp.asarray(index).astype(jnp.uint32) * _u32(block * stride)
    return total


# ---------------------------------------------------------------- the kernel


HashFn = Callable[[jax.Array, jax.Array, jax.Array], "tuple[jax.Array, jax.Array]"]


def strip_rows(block_rows: int, block_lanes: int, sublanes: int = 8) -> int:
    """Rows a strip of a ``(block_rows, block_lanes)`` block hashes at a time:
    a multiple of ``sublanes`` that divides ``block_rows``, about
    ``STRIP_ELEMS`` elements; the whole block when its rows are not a multiple
    of ``sublanes``."""
    if block_rows % sublanes:
        return block_rows
    lanes = round_up(block_lanes, 128)
    want = max(sublanes, STRIP_ELEMS // lanes // sublanes * sublanes)
    rows = min(want, block_rows)
    while block_rows % rows:
        rows -= sublanes
    return rows


def choose_block(rows: int, width: int, info=None) -> tuple[int, int]:
    """``(bh, bw)`` for a ``(rows, width)`` uint32 output on the chip ``info``
    (default ``pltpu.get_tpu_info()``); blocks need not divide the output (the
    last block of each axis is cut off)."""
    info = info or pltpu.get_tpu_info()
    sub = info.num_sublanes
    if width <= MAX_LANES:
        bw = width
    else:  # a divisor of at least half of MAX_LANES, else MAX_LANES with the last block cut
        bw = next((b for b in range(MAX_LANES, MAX_LANES // 2 - 1, -128) if width % b == 0), MAX_LANES)
    strip = strip_rows(round_up(rows, sub), bw, sub)
    budget = min(TARGET_BLOCK_BYTES, info.vmem_capacity_bytes // 32)
    bh = max(strip, budget // (4 * round_up(bw, 128)) // strip * strip)
    steps = MIN_STEPS * max(info.num_cores, 1)
    bh = min(bh, max(strip, round_up(-(-rows // steps), strip)))
    if bh >= rows:
        return rows, bw
    return bh, bw


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


def counter_bits(
    hash_fn: HashFn,
    key: jax.Array,
    shape: Shape,
    unpadded_shape: Shape,
    block_size: tuple[int, int],
    *,
    offset=0,
    fuse_output: bool = True,
    name: str,
) -> jax.Array:
    """The two words ``hash_fn(k0, k1, counter)`` of every element of
    ``shape`` (N >= 2 dims), the counter being its row-major position in
    ``unpadded_shape`` plus ``offset`` (uint32, wrapping): their xor
    (``fuse_output``, ``uint32[shape]``) or both (``uint32[2, *shape]``).

    ``block_size`` is checked by the caller; it need not divide ``shape``."""
    shape, unpadded_shape = tuple(shape), tuple(unpadded_shape)
    bh, bw = block_size
    lead, (h, w) = shape[:-2], shape[-2:]
    grid = (*lead, pl.cdiv(h, bh), pl.cdiv(w, bw))
    unpadded_strides = strides(unpadded_shape)
    row_stride = _u32(unpadded_strides[-2])
    sh = strip_rows(bh, bw)
    words = 1 if fuse_output else 2
    # One (1, 3) SMEM operand: under jax.vmap of the keys it becomes (n, 1, 3) in
    # blocks of (1, 3), whose last two dimensions are the whole array's, as a TPU asks.
    scalars = jnp.concatenate([key, jnp.asarray(offset, jnp.uint32).reshape(1)]).reshape(1, 3)

    def kernel(scalar_ref, out_ref):
        k0, k1, first = scalar_ref[0, 0], scalar_ref[0, 1], scalar_ref[0, 2]
        ids = [pl.program_id(d) for d in range(len(grid))]
        # The block's first element: leading dims step by one, the last two by a block.
        block_at = (*([1] * len(lead)), bh, bw)
        base = first + compute_scalar_offset(ids, unpadded_shape, block_at)
        rows = lax.broadcasted_iota(jnp.uint32, (sh, bw), 0)
        in_strip = rows * row_stride + lax.broadcasted_iota(jnp.uint32, (sh, bw), 1)

        def strip(r0):
            w0, w1 = hash_fn(k0, k1, in_strip + (base + r0.astype(jnp.uint32) * row_stride))
            if fuse_output:
                out_ref[pl.ds(r0, sh), :] = jnp.broadcast_to(w0 ^ w1, (sh, bw))
            else:
                out_ref[0, pl.ds(r0, sh), :] = jnp.broadcast_to(w0, (sh, bw))
                out_ref[1, pl.ds(r0, sh), :] = jnp.broadcast_to(w1, (sh, bw))

        if bh == sh:
            strip(jnp.int32(0))
        else:

            @pl.loop(0, bh, step=sh)
            def _(r0):
                strip(pl.multiple_of(r0, sh))

    block = (*([None] * len(lead)), bh, bw)
    if fuse_output:
        out_shape = jax.ShapeDtypeStruct(shape, jnp.uint32)
        out_spec = pl.BlockSpec(block, lambda *ids: ids)
    else:
        out_shape = jax.ShapeDtypeStruct((words, *shape), jnp.uint32)
        out_spec = pl.BlockSpec((words, *block), lambda *ids: (0, *ids))
    n = math.prod(shape)
    parallel: tuple[Literal["parallel"]] = ("parallel",)
    semantics = parallel * len(grid)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=out_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=4 * words * n),
        name=name,
    )(scalars)


def flat_bits(
    hash_fn: HashFn, key: jax.Array, shape: Shape, *, offset=0, fuse_output: bool = True, name: str
) -> jax.Array:
    """``counter_bits`` of any ``shape`` (0-d and 1-d too) in the layout the
    chip likes: ``(rows, shape[-1])`` when the last dimension is a multiple of
    128 lanes (a reshape away), else the flat counters in rows of up to
    ``MAX_LANES`` (cut to size afterwards); blocks from ``choose_block``."""
    shape = tuple(shape)
    n = math.prod(shape)
    lead = () if fuse_output else (2,)
    if n == 0:
        return jnp.zeros((*lead, *shape), jnp.uint32)
    if len(shape) >= 2 and shape[-1] % 128 == 0:
        view = (n // shape[-1], shape[-1])
    else:
        lanes = min(MAX_LANES, round_up(n, 128))
        view = (-(-n // lanes), lanes)
    bits = counter_bits(
        hash_fn, key, view, view, choose_block(*view), offset=offset, fuse_output=fuse_output, name=name
    )
    if view[0] * view[1] != n:
        bits = bits.reshape(*lead, -1)[..., :n]
    return bits.reshape(*lead, *shape)


def check_bit_width(op: str, bit_width) -> int:
    if bit_width not in (8, 16, 32, 64):
        raise ValueError(f"{op}: bit_width must be 8, 16, 32 or 64, got {bit_width!r}")
    return int(bit_width)


def bits_of_width(words_fn, bit_width: int, shape: Shape) -> jax.Array:
    """``bit_width``-bit values from 32-bit hash words, as ``jax.random``'s
    threefry does (``jax_threefry_partitionable``): narrower widths are the low
    bits of the xor of the two words; 64 bits are the first word over the second.
    ``words_fn(fuse_output)`` gives the words."""
    if bit_width == 64:
        if not jax.config.jax_enable_x64:
            raise ValueError(
                "64-bit random bits need jax_enable_x64 (jax.config.update('jax_enable_x64', True))"
            )
        w0, w1 = words_fn(False)
        return (w0.astype(jnp.uint64) << jnp.uint64(32)) | w1.astype(jnp.uint64)
    bits = words_fn(True)
    if bit_width == 32:
        return bits
    return bits.astype(jnp.uint8 if bit_width == 8 else jnp.uint16)
