"""A kernel's name in messages: a ``functools.partial`` of a kernel function is named
by the function, as JAX's Pallas names it (ejkernel passes its kernels as partials)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from ways import every_way

import pallas as pl


def _scaled_copy(x_ref, o_ref, *, scale):
    o_ref[...] = x_ref[...] * scale


def test_partial_kernel_is_named_by_its_function():
    x = jax.random.normal(jax.random.key(0), (8, 128), jnp.float32)
    call = pl.pallas_call(
        functools.partial(functools.partial(_scaled_copy), scale=2.0),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec((8, 128, 1), lambda: (0, 0, 0))],
        interpret=True,
    )
    with pytest.raises(ValueError, match="pallas_call '_scaled_copy'"):
        call(x)


@every_way()
def test_partial_kernel_runs(way):
    x = jax.random.normal(jax.random.key(1), (8, 128), jnp.float32)
    out = way.pallas_call(
        functools.partial(_scaled_copy, scale=3.0),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)
    assert jnp.allclose(out, x * 3.0)
