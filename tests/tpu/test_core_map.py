"""``pl.core_map`` over a TensorCore mesh (as JAX's own tests use it): a function of
no arguments run once per TensorCore on the Refs of ``pl.run_state`` it closes over,
against jnp on fresh random data, the TPU ways of tests/ways: TPU interpret
mode; our Mosaic lowering and JAX's, each exported for TPU and run by ``run_mosaic``
(the closed-over Refs are the module's operands, the written one aliased to its result); our
lowering compiled by libtpu."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ways import every_way
from ways.jax_mosaic import tensorcore_mesh

import pallas as pl
import pallas_tpu as pltpu

ROWS = 16


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def build(pl, pltpu, num_cores, interpret=False):
    """``f(x, y) -> (x, y')``: each core adds ``2 * x`` plus its index to its rows of ``y``."""
    mesh = tensorcore_mesh(pltpu, "x", num_cores)
    with warnings.catch_warnings():  # JAX deprecates core_map (in favour of pl.kernel)
        warnings.simplefilter("ignore", DeprecationWarning)
        core_map = pl.core_map

    def f(x, y):
        def inner(refs):
            x_ref, y_ref = refs

            @core_map(mesh, interpret=interpret)
            def _():
                rows = ROWS // lax.psum(1, "x")

                def scoped(x_vmem, y_vmem, sem):
                    part = pl.ds(lax.axis_index("x") * rows, rows)
                    pltpu.async_copy(x_ref.at[part], x_vmem, sem).wait()
                    pltpu.async_copy(y_ref.at[part], y_vmem, sem).wait()
                    y_vmem[...] += 2.0 * x_vmem[...] + lax.axis_index("x").astype(jnp.float32)
                    pltpu.async_copy(y_vmem, y_ref.at[part], sem).wait()

                pl.run_scoped(
                    scoped,
                    pltpu.VMEM((rows, 128), x_ref.dtype),
                    pltpu.VMEM((rows, 128), y_ref.dtype),
                    pltpu.SemaphoreType.DMA,
                )

        return pl.run_state(inner)((x, y))

    return f


def expected(x, y, num_cores):
    core = (jnp.arange(ROWS) // (ROWS // num_cores)).astype(jnp.float32)[:, None]
    return y + 2.0 * x + core


@pytest.mark.parametrize("num_cores", [1, 2])
@every_way(tpu=True)
def test_core_map_over_tensorcores(way, num_cores):
    """In the Mosaic ways the core_map's one module takes both Refs as operands and returns
    the one it writes (y), aliased, as JAX's core_map passes them; the compiled way compiles
    it for a megacore chip too over two cores."""
    way = way.with_params(num_cores=num_cores)
    x, y = rand(0, (ROWS, 128)), rand(1, (ROWS, 128))
    x_out, y_out = way.jit(build(*way.modules(), num_cores, interpret=way.interpret() or False))(x, y)
    np.testing.assert_array_equal(np.asarray(x_out), np.asarray(x))
    np.testing.assert_allclose(np.asarray(y_out), np.asarray(expected(x, y, num_cores)), rtol=1e-6, atol=1e-6)


def test_core_map_scratch_shapes_and_captured_values():
    """``scratch_shapes`` come as the function's arguments; a captured array (not a
    Ref) is read as a value."""
    x, bias = rand(2, (8, 128)), rand(3, (8, 128))
    mesh = pltpu.TensorCoreMesh(axis_name="x", num_cores=1)

    def inner(x_ref):
        @pl.core_map(
            mesh, interpret=pltpu.InterpretParams(), scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)]
        )
        def _(tmp):
            pltpu.sync_copy(x_ref, tmp)
            tmp[...] = jnp.sin(tmp[...]) * bias
            pltpu.sync_copy(tmp, x_ref)

    out = jax.jit(pl.run_state(inner))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.sin(x) * bias), rtol=1e-6, atol=1e-6)


def test_core_map_errors():
    mesh = pltpu.TensorCoreMesh(axis_name="x", num_cores=1)
    with pytest.raises(TypeError, match=r"pl.core_map: mesh must be a pl.Mesh"):
        pl.core_map(("x", 2))
    with pytest.raises(TypeError, match=r"pl.core_map: the function returns_a_value must return None"):

        def inner(x_ref):
            @pl.core_map(mesh, interpret=pltpu.InterpretParams())
            def returns_a_value():
                return x_ref[...]

        pl.run_state(inner)(rand(4, (8, 128)))
