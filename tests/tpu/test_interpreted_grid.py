"""A grid axis marked "parallel" with a traced (dynamic) size, as JAX's own tests use it: TPU
interpret mode refuses it as JAX's does (``jax.errors.ConcretizationTypeError``,
JAX's words beside ours); "arbitrary" runs it; the Mosaic lowering takes it, as
JAX's lowering does. A "parallel" axis after an "arbitrary" one: TPU interpret mode
refuses it with a ValueError, as JAX's does (it splits the leading parallel axes
over cores); parallel axes first run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_tpu as pltpu


def rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def scaled_rows(n, x, semantics, interpret):
    """Each of the first ``n`` blocks of 8 rows of ``x`` times 3, plus its block index."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 3.0 + pl.program_id(0).astype(jnp.float32)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(n,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=(semantics,)),
        interpret=interpret,
        name="scaled_rows",
    )(x)


def test_traced_parallel_axis_is_refused_in_interpret_mode():
    x = rand(0, (32, 128))
    f = jax.jit(lambda n, x: scaled_rows(n, x, "parallel", pltpu.InterpretParams()))
    with pytest.raises(jax.errors.ConcretizationTypeError) as e:
        f(jnp.int32(4), x)
    first = str(e.value).splitlines()[0]
    assert "pallas_call 'scaled_rows' at " in first and "grid[0]" in first
    assert "Abstract tracer value encountered where concrete value is expected" in first
    assert "'parallel'" in first and "mark it 'arbitrary'" in first


def test_traced_arbitrary_axis_runs_in_interpret_mode():
    x = rand(1, (32, 128))
    out = jax.jit(lambda n, x: scaled_rows(n, x, "arbitrary", pltpu.InterpretParams()))(jnp.int32(3), x)
    want = x * 3.0 + (jnp.arange(32) // 8).astype(jnp.float32)[:, None]
    # Blocks past the dynamic grid's 3 steps are not written: compare the first 24 rows.
    np.testing.assert_allclose(np.asarray(out[:24]), np.asarray(want[:24]), rtol=1e-6, atol=1e-6)


def test_traced_parallel_axis_lowers_to_mosaic():
    x = rand(2, (32, 128))
    exported = jax.export.export(
        jax.jit(lambda n, x: scaled_rows(n, x, "parallel", False)), platforms=["tpu"]
    )(jnp.int32(4), x)
    assert "tpu_custom_call" in exported.mlir_module()


def _fill_with_step(semantics, interpret):
    """A (16, 256) output of (8, 128) blocks over a (2, 2) grid, each block filled with
    the number of the grid step that wrote it (a count in SMEM scratch)."""

    def kernel(o_ref, count_ref):
        @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
        def _():
            count_ref[0] = 0

        o_ref[...] = jnp.full(o_ref.shape, count_ref[0], jnp.int32)
        count_ref[0] += 1

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((16, 256), jnp.int32),
        grid=(2, 2),
        out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
        scratch_shapes=[pltpu.SMEM((1,), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=interpret,
        name="fill_with_step",
    )()


@pytest.mark.parametrize("semantics", [("arbitrary", "parallel"), ("core_parallel", "parallel")])
def test_parallel_axis_after_another_kind_is_refused_in_interpret_mode(semantics):
    with pytest.raises(ValueError) as e:
        jax.jit(lambda: _fill_with_step(semantics, pltpu.InterpretParams()))()
    message = str(e.value)
    assert message.startswith("pallas_call 'fill_with_step' at ")
    assert f"grid axis 1 is 'parallel' after axis 0, {semantics[0]!r}" in message
    assert message.endswith("Dimensions with parallel semantics must form a prefix of the grid.")


@pytest.mark.parametrize(
    "semantics", [("parallel", "arbitrary"), ("parallel", "parallel"), ("arbitrary", "arbitrary")]
)
def test_parallel_axes_first_run_in_interpret_mode(semantics):
    out = np.asarray(_fill_with_step(semantics, pltpu.InterpretParams()))
    # Run in order on one core (no random_seed): step i * 2 + j wrote block (i, j).
    want = np.arange(4, dtype=np.int32).reshape(2, 2).repeat(8, 0).repeat(128, 1)
    np.testing.assert_array_equal(out, want)


def test_jax_refuses_a_parallel_axis_after_an_arbitrary_one_too():
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu

    def kernel(o_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.int32)

    with pytest.raises(ValueError, match="Dimensions with parallel semantics must form a prefix of the grid"):
        jpl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16, 256), jnp.int32),
            grid=(2, 2),
            out_specs=jpl.BlockSpec((8, 128), lambda i, j: (i, j)),
            compiler_params=jpltpu.CompilerParams(dimension_semantics=("arbitrary", "parallel")),
            interpret=jpltpu.InterpretParams(),
        )()
