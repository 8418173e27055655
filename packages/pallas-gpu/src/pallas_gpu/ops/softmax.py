"""Softmax over the last axis with the API of JAX's
Pallas GPU op ``softmax`` (forward only, as there)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas as pl
from pallas_gpu.ops._common import call_params, next_power_of_2


def _kernel(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=["axis", "num_warps", "interpret", "debug"])
def softmax(
    x: jax.Array, *, axis: int = -1, num_warps: int = 4, interpret=False, debug: bool = False
) -> jax.Array:
    """Softmax of ``x`` along ``axis``, which must be the last one; rows of
    up to 2**16 elements, each program takes about 4096 elements' worth of
    rows. ``interpret`` takes ``True`` or ``pallas_gpu.InterpretParams()``."""
    axis = axis if axis >= 0 else x.ndim + axis
    if axis != x.ndim - 1:
        raise NotImplementedError(
            f"softmax: only the last axis is supported (got axis={axis} of a {x.ndim}-d array)"
        )
    n = x.shape[-1]
    if n > 1 << 16:
        raise ValueError(f"softmax: rows of {n} elements do not fit in one program (at most {1 << 16})")
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    block_rows = max(1, min(16, 4096 // next_power_of_2(n), next_power_of_2(rows)))
    spec = pl.BlockSpec((block_rows, n), lambda i: (i, 0))
    out = pl.pallas_call(
        _kernel,
        out_shape=x2,
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[spec],
        out_specs=spec,
        name="softmax",
        debug=debug,
        **call_params(interpret, num_warps, None),
    )(x2)
    return out.reshape(x.shape)
