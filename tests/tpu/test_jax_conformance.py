"""What JAX's own Pallas test files found in TPU interpret mode
(``scripts/jax_pallas_tests.py``), each fixed case checked against ``jnp`` and
against JAX's TPU interpret mode on the same kernel.

Two cores along a "parallel" grid axis (``InterpretParams(num_cores_or_threads=2)``):
each core has its own VMEM, so its block buffers and scratch are its own and a
kernel that writes them is race-free (ours reported a race there: the cores run
one after the other here, in the same cells); two cores whose output blocks are
the same block of HBM do race, through the pipeline's write-back of that block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.interpret import multi as interpret_multi

pytestmark = pytest.mark.interpret_only(reason="race detection over two cores of TPU interpret mode")
IMPLS = {"ours": (pl, pltpu), "jax": (jpl, jpltpu)}


@pytest.fixture(autouse=True)
def _fresh_state(fresh_sessions):
    yield


def _copy_and_double(x_ref, o_ref, vmem_ref):
    vmem_ref[...] = x_ref[...]
    o_ref[...] = x_ref[...] + vmem_ref[...]


def two_core_call(impl, x, rows_per_step):
    """grid=(2,), "parallel", one step per core; blocks of ``rows_per_step`` rows
    (the whole array: both cores write the one output block)."""
    pl_, pltpu_ = IMPLS[impl]
    n_blocks = x.shape[0] // rows_per_step
    spec = pl_.BlockSpec((rows_per_step, x.shape[1]), lambda i: (i % n_blocks, 0))
    return pl_.pallas_call(
        _copy_and_double,
        grid=(2,),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[spec],
        out_specs=spec,
        scratch_shapes=[pltpu_.VMEM((rows_per_step, x.shape[1]), x.dtype)],
        interpret=pltpu_.InterpretParams(num_cores_or_threads=2, detect_races=True),
        compiler_params=pltpu_.CompilerParams(dimension_semantics=("parallel",)),
    )(x)


def _jax_races(x, rows_per_step) -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as jax_interp

    jpltpu.reset_tpu_interpret_mode_state()
    try:
        jax.block_until_ready(two_core_call("jax", x, rows_per_step))
    except Exception as e:  # newer JAX raises "RACE DETECTED"
        if "RACE DETECTED" in str(e):
            return True
        raise
    jax.effects_barrier()
    return bool(jax_interp.races is not None and jax_interp.races.races_found)


def test_two_cores_own_blocks_and_scratch_race_free():
    x = jax.random.normal(jax.random.key(0), (16, 128), jnp.float32)
    y = jax.block_until_ready(two_core_call("ours", x, 8))
    jax.effects_barrier()
    assert not interpret_multi.races.races_found
    np.testing.assert_allclose(y, 2 * x, rtol=1e-6)
    assert not _jax_races(x, 8)  # JAX says the same


def test_two_cores_one_output_block_race():
    x = jax.random.normal(jax.random.key(1), (8, 128), jnp.float32)
    with pytest.raises(Exception, match="data race") as e:
        jax.block_until_ready(two_core_call("ours", x, 8))
    msg = str(e.value)
    assert "write-back of out_specs[0]" in msg and "core 0" in msg and "core 1" in msg, msg
    assert interpret_multi.races.races_found
    assert _jax_races(x, 8)  # JAX finds it too


# ---------------------------------------------------------------------------
# jax.vmap over a scalar-prefetch operand: each batch element has its own block
# indices (ours refused it; now one call per element, as for batched grid sizes).


def gather_rows_call(impl, idx, x, interpret):
    """Output block i is the input block ``idx[i]`` plus ``idx[i]``."""
    pl_, pltpu_ = IMPLS[impl]

    def kernel(idx_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] + idx_ref[pl_.program_id(0)].astype(x_ref.dtype)

    n = idx.shape[0]
    grid_spec = pltpu_.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n,),
        in_specs=[pl_.BlockSpec((8, 128), lambda i, idx_ref: (idx_ref[i], 0))],
        out_specs=pl_.BlockSpec((8, 128), lambda i, idx_ref: (i, 0)),
    )
    return pl_.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((8 * n, 128), x.dtype),
        interpret=interpret(pltpu_),
    )(idx, x)


def gather_rows_ref(idx, x):
    blocks = x.reshape(-1, 8, 128)[idx] + idx[:, None, None].astype(x.dtype)
    return blocks.reshape(-1, 128)


@pytest.mark.parametrize(
    "mode", ["interpret", "tpu_interpret"], ids=["interpret=True", "pltpu.InterpretParams"]
)
@pytest.mark.parametrize("x_batched", [True, False], ids=["x_batched", "x_shared"])
def test_vmap_over_scalar_prefetch(mode, x_batched):
    interpret = (lambda m: True) if mode == "interpret" else (lambda m: m.InterpretParams())
    B, n = 3, 4
    idx = jax.random.randint(jax.random.key(2), (B, n), 0, 4, jnp.int32)
    x = jax.random.normal(jax.random.key(3), (B, 32, 128) if x_batched else (32, 128), jnp.float32)
    in_axes = (0, 0 if x_batched else None)
    f = {
        impl: jax.vmap(lambda i, a, impl=impl: gather_rows_call(impl, i, a, interpret), in_axes)
        for impl in IMPLS
    }
    got = jax.jit(f["ours"])(idx, x)
    want = jax.vmap(gather_rows_ref, in_axes)(idx, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if mode == "interpret":  # JAX's interpret=True runs it too (its TPU interpret mode: not on every JAX)
        np.testing.assert_allclose(got, jax.jit(f["jax"])(idx, x), rtol=1e-6)
