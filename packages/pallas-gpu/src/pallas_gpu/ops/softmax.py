"""Softmax over the last axis with the API of JAX's
Pallas GPU op ``softmax`` (forward only, as there).

One pass over ``x``: each program holds whole rows in registers, reads them
once and writes the result once. ``forward`` exposes the launch choices
(rows per program, warps, the cache hint of the streamed loads and stores);
``softmax`` has JAX's signature, with ``num_warps=None`` (picked from the
row length) for JAX's 4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas as pl
from pallas_gpu._src.language.primitives import load as _gpu_load
from pallas_gpu._src.language.primitives import store as _gpu_store
from pallas_gpu.ops._common import call_params, next_power_of_2

_EVICT = (None, "evict_first", "evict_last")


def launch(rows: int, n: int, block_rows: int | None = None, num_warps: int | None = None) -> tuple[int, int]:
    """(rows per program, warps), for those left at None: whole rows of
    about 4096 elements a program (up to 16 rows); a warp per 512 elements
    of the block (4 to 16) for rows of up to 8192 elements, JAX's 4 for
    wider ones. Measured on the H200 (2**27 elements): at 16384 x 8192,
    16 warps ran bf16 at 4.03 TB/s, f32 at 4.07 (4 warps: 3.94-4.00 and
    4.01-4.06); at 8192 x 16384, bf16 ran 3.94 at 4 warps and 3.79 at 16."""
    width = next_power_of_2(n)
    block_rows = block_rows or max(1, min(16, 4096 // width, next_power_of_2(rows)))
    warps = 4 if width > 8192 else min(16, max(4, block_rows * width // 512))
    return block_rows, num_warps or warps


def _kernel(x_ref, o_ref, *, evict: str | None):
    x = _gpu_load(x_ref, eviction_policy=evict).astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    _gpu_store(o_ref, (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype), eviction_policy=evict)


def _check(x, axis: int) -> int:
    axis = axis if axis >= 0 else x.ndim + axis
    if axis != x.ndim - 1:
        raise NotImplementedError(
            f"softmax: only the last axis is supported (got axis={axis} of a {x.ndim}-d array)"
        )
    n = x.shape[-1]
    if n > 1 << 16:
        raise ValueError(f"softmax: rows of {n} elements do not fit in one program (at most {1 << 16})")
    return n


def forward(x, *, block_rows=None, num_warps=None, evict="evict_first", interpret=False, debug=False):
    """Softmax of ``x`` over its last axis with every launch choice exposed:
    ``block_rows`` and ``num_warps`` (None: ``launch``'s choice) and ``evict``,
    the cache hint of the loads of ``x`` and the stores of the result
    (``"evict_first"``, ``"evict_last"`` or None)."""
    n = _check(x, -1)
    if evict not in _EVICT:
        raise ValueError(f"softmax forward: evict must be 'evict_first', 'evict_last' or None; got {evict!r}")
    if block_rows is not None and (not isinstance(block_rows, int) or block_rows < 1):
        raise ValueError(f"softmax forward: block_rows must be a positive int or None; got {block_rows!r}")
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    block_rows, num_warps = launch(rows, n, block_rows, num_warps)
    spec = pl.BlockSpec((block_rows, n), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, evict=evict),
        out_shape=x2,
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[spec],
        out_specs=spec,
        name="softmax",
        debug=debug,
        **call_params(interpret, num_warps, None),
    )(x2)
    return out.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=["axis", "num_warps", "interpret", "debug"])
def softmax(
    x: jax.Array, *, axis: int = -1, num_warps: int | None = None, interpret=False, debug: bool = False
) -> jax.Array:
    """Softmax of ``x`` along ``axis``, which must be the last one; rows of
    up to 2**16 elements, each program takes about 4096 elements of whole
    rows and ``num_warps`` (None, unlike JAX's 4: a warp per 512 elements
    of the block, 4 to 16; see ``launch``), loaded and stored with the ``evict_first``
    hint (on the H200 at 16384 x 8192: f32 4.03 TB/s with it, 4.01 without;
    bf16 3.94 and 3.93). ``interpret`` takes ``True`` or
    ``pallas_gpu.InterpretParams()``."""
    _check(x, axis)
    return forward(x, num_warps=num_warps, interpret=interpret, debug=debug)
