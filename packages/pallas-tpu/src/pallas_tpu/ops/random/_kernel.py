"""The Pallas kernel both generators hash their counters with (``prng_utils``' docstring says
how it walks the output), and the words' layouts around it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops.random._blocks import MAX_LANES, choose_block, strip_rows
from pallas_tpu.ops.random.prng_utils import Shape, compute_scalar_offset, round_up, strides, u32

HashFn = Callable[[jax.Array, jax.Array, jax.Array], "tuple[jax.Array, jax.Array]"]


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
    row_stride = u32(unpadded_strides[-2])
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
