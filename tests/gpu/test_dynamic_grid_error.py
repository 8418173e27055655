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
        r"\(traced\) sizes, which pallas_gpu's interpreter does not run",
    ):
        f(x, jnp.int32(3))


def test_symbolic_shapes_exported_for_cuda_are_a_clear_error():
    # jax.export shape polymorphism: the grid follows a symbolic dimension, a size the GPU
    # lowering cannot know when it compiles (pallas-core's interpret mode and the TPU lowering take it).
    spec = pl.BlockSpec((8,), lambda i: (i,))

    def f(x):
        return pl.pallas_call(
            copy_kernel, out_shape=x, grid=(x.shape[0] // 8,), in_specs=[spec], out_specs=spec
        )(x)

    (n,) = jax.export.symbolic_shape("8*n")
    with pytest.raises(
        NotImplementedError,
        match=r"pallas_call 'copy_kernel' at test_dynamic_grid_error.py:\d+: grid \(dynamic,\) has dynamic "
        r"\(traced\) sizes, which the cuda backend does not lower",
    ):
        jax.export.export(jax.jit(f), platforms=["cuda"])(jax.ShapeDtypeStruct((n,), jnp.float32))
