"""The smallest kernel, as JAX's ``ops/tpu/example_kernel`` offers it for testing ``pallas_call``:
``double(x)`` is ``2 * x`` computed by one kernel over the whole array."""

from __future__ import annotations

import jax

import pallas as pl


def double_kernel(x_ref, y_ref):
    """Writes twice the input block into the output block."""
    y_ref[:] = x_ref[:] * 2


def double(x: jax.Array) -> jax.Array:
    """``2 * x`` by one ``pallas_call`` whose output has ``x``'s shape and dtype."""
    return pl.pallas_call(double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
