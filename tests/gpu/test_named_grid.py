"""Named grids (``grid=(("i", 4),)`` with ``lax.axis_index("i")``) on
pallas-gpu: the generated Triton kernel under Triton's interpreter on the
CPU, and (``gpu`` marker) compiled and launched on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import random
from jax import lax

import pallas as pl
import pallas_gpu as plgpu
from pallas import backend as pallas_backend

MODES = [
    pytest.param(plgpu.InterpretParams(), id="triton_interpreter"),
    pytest.param(False, id="gpu", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("interpret", MODES)
def test_two_named_axes(interpret):
    x = random((4 * 32, 3 * 16), jnp.float32)

    def kernel(x_ref, o_ref):
        i, j = lax.axis_index("i"), lax.axis_index("j")
        o_ref[...] = x_ref[...] * 2.0 + (i * 10 + j).astype(jnp.float32)

    spec = pl.BlockSpec((32, 16), lambda i, j: (i, j))
    out = pl.pallas_call(
        kernel, out_shape=x, grid=(("i", 4), ("j", 3)), in_specs=[spec], out_specs=spec, interpret=interpret
    )(x)
    rows = np.repeat(np.arange(4), 32)[:, None]
    cols = np.repeat(np.arange(3), 16)[None, :]
    np.testing.assert_allclose(out, np.asarray(x) * 2.0 + rows * 10 + cols, rtol=1e-6)


@pytest.mark.parametrize("interpret", MODES)
def test_named_reduction_axis_runs_in_order(interpret):
    # The output block is revisited along "k" (a loop inside one program):
    # axis_index("k") must be the loop's step, as pl.program_id(1) would be.
    x = random((64, 4 * 32), jnp.float32)

    def kernel(x_ref, o_ref):
        k = lax.axis_index("k")

        @pl.when(k == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True) * (k + 1).astype(jnp.float32)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((64, 1), jnp.float32),
        grid=(("i", 2), ("k", 4)),
        in_specs=[pl.BlockSpec((32, 32), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((32, 1), lambda i, k: (i, 0)),
        interpret=interpret,
    )(x)
    weights = np.repeat(np.arange(1, 5), 32)
    want = (np.asarray(x) * weights[None, :]).sum(1, keepdims=True)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("interpret", MODES)
def test_named_and_unnamed_axes_mixed(interpret):
    x = random((3 * 8, 128), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + lax.axis_index("rows").astype(jnp.float32) * 100.0 + pl.program_id(1)

    spec = pl.BlockSpec((8, 64), lambda r, c: (r, c))
    out = pl.pallas_call(
        kernel, out_shape=x, grid=(("rows", 3), 2), in_specs=[spec], out_specs=spec, interpret=interpret
    )(x)
    want = np.asarray(x) + np.repeat(np.arange(3), 8)[:, None] * 100.0 + np.repeat(np.arange(2), 64)[None, :]
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_named_grid_lowers_to_program_ids():
    from gpu_test_base import all_lowered

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + lax.axis_index("i").astype(jnp.float32)

    spec = pl.BlockSpec((128,), lambda i: (i,))

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=x,
            grid=(("i", 2),),
            in_specs=[spec],
            out_specs=spec,
            interpret=plgpu.InterpretParams(),
        )(x)

    (lk,) = all_lowered(f, jax.ShapeDtypeStruct((256,), jnp.float32))
    source = lk.module_source(interpret=False)
    assert "tl.program_id(0)" in source and "axis_index" not in source


def test_axis_name_that_is_not_a_grid_axis_is_a_lowering_error():
    x = random((256,), jnp.float32)

    def kernel(x_ref, o_ref):  # what lax.axis_index("j") becomes, for an axis the grid lacks
        o_ref[...] = x_ref[...] + pallas_backend.grid_axis_index_p.bind(axis_name="j").astype(jnp.float32)

    spec = pl.BlockSpec((128,), lambda i: (i,))
    call = pl.pallas_call(
        kernel,
        out_shape=x,
        grid=(("i", 2),),
        in_specs=[spec],
        out_specs=spec,
        interpret=plgpu.InterpretParams(),
    )
    with pytest.raises(
        NotImplementedError, match=r"axis 'j' is not a grid axis of the kernel \(grid names \('i',\)\)"
    ):
        call(x)
