"""pallas-gpu does not lower grids with dynamic (traced) sizes: a clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas as pl

plgpu = pytest.importorskip("pallas_gpu")


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def test_dynamic_grid_is_a_clear_error():
    x = jax.random.normal(jax.random.key(0), (64,))
    spec = pl.BlockSpec((8,), lambda i: (i,))

    @jax.jit
    def f(x, n):
        return pl.pallas_call(
            copy_kernel,
            out_shape=x,
            grid=(n,),
            in_specs=[spec],
            out_specs=spec,
            interpret=plgpu.InterpretParams(),
        )(x)

    with pytest.raises(
        NotImplementedError,
        match=r"pallas_call 'copy_kernel' at test_dynamic_grid_error.py:\d+: grid \(dynamic,\) has dynamic "
        r"\(traced\) sizes, which the GPU backend does not lower",
    ):
        f(x, jnp.int32(3))
