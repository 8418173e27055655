"""A grid axis marked "parallel" with a traced (dynamic) size, as JAX's own tests use it: TPU
interpret mode refuses it as JAX's does (``jax.errors.ConcretizationTypeError``,
JAX's words beside ours); "arbitrary" runs it; the Mosaic lowering takes it, as
JAX's lowering does."""

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
