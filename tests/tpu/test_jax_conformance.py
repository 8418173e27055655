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


def two_core_call(impl, x, rows_per_step, on_race="raise"):
    """grid=(2,), "parallel", one step per core; blocks of ``rows_per_step`` rows
    (the whole array: both cores write the one output block). ``on_race``: ours only
    (JAX 0.11 has no such parameter)."""
    pl_, pltpu_ = IMPLS[impl]
    race_kw = {} if impl == "jax" else {"on_race": on_race}
    n_blocks = x.shape[0] // rows_per_step
    spec = pl_.BlockSpec((rows_per_step, x.shape[1]), lambda i: (i % n_blocks, 0))
    return pl_.pallas_call(
        _copy_and_double,
        grid=(2,),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[spec],
        out_specs=spec,
        scratch_shapes=[pltpu_.VMEM((rows_per_step, x.shape[1]), x.dtype)],
        interpret=pltpu_.InterpretParams(num_cores_or_threads=2, detect_races=True, **race_kw),
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


def test_two_cores_one_output_block_race_warned(capfd):
    """``on_race="warn"`` (JAX 0.11's only behaviour): the race is printed, JAX's words
    first, ``races.races_found`` is set, and the kernel finishes."""
    x = jax.random.normal(jax.random.key(1), (8, 128), jnp.float32)
    y = jax.block_until_ready(two_core_call("ours", x, 8, on_race="warn"))
    jax.effects_barrier()
    np.testing.assert_allclose(y, 2 * x, rtol=1e-6)
    assert interpret_multi.races.races_found
    err = capfd.readouterr().err
    assert "RACE DETECTED" in err and "data race" in err and "write-back of out_specs[0]" in err, err
    assert "write-back of out_specs[0]" in interpret_multi.races.messages[0]
    # The next call starts afresh, as JAX's interpreter does.
    jax.block_until_ready(two_core_call("ours", jnp.ones((16, 128), jnp.float32), 8, on_race="warn"))
    jax.effects_barrier()
    assert not interpret_multi.races.races_found


def test_on_race_default_follows_the_installed_jax():
    p = pltpu.InterpretParams(detect_races=True)
    assert p.races_raise == (jax.__version_info__ >= (0, 12))
    assert pltpu.InterpretParams(on_race="warn").races_raise is False
    with pytest.raises(ValueError, match="on_race must be 'raise' or 'warn'"):
        pltpu.InterpretParams(on_race="ignore")


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


def test_an_error_on_one_core_of_a_core_map_does_not_hang_the_other():
    """Core 0 reads past its array and never signals core 1, which waits for it: the
    kernel fails at once with core 0's error (JAX's words first), not after a deadlock
    timeout."""
    import time

    mesh = pltpu.TensorCoreMesh(axis_name="x", num_cores=2)

    @jax.jit
    def f(x):
        def inner(refs):
            x_ref, _ = refs

            @pl.core_map(mesh, interpret=pltpu.InterpretParams())
            def _():
                def body(sem, buf):
                    c = jax.lax.axis_index("x")

                    @pl.when(c == 0)
                    def _():
                        pltpu.sync_copy(x_ref.at[pl.ds(c * 8 + 12, 8)], buf)  # rows 12..20 of 16
                        pl.semaphore_signal(sem, 1, core_index=1)

                    @pl.when(c == 1)
                    def _():
                        pl.semaphore_wait(sem, 1)

                pl.run_scoped(body, pltpu.SemaphoreType.REGULAR, pltpu.VMEM((8, 128), jnp.float32))

        return pl.run_state(inner)((x, jnp.zeros_like(x)))[1]

    start = time.monotonic()
    with pytest.raises(Exception, match=r"Out-of-bounds read \(DMA read\)"):
        jax.block_until_ready(f(jnp.zeros((16, 128), jnp.float32)))
    assert time.monotonic() - start < 30  # the deadlock timeout is 60 s
    pltpu.reset_tpu_interpret_mode_state()


def _num_programs_in_index_map(interpret):
    """JAX's ``test_num_programs_block_spec``: the index map reads the traced grid size."""

    @jax.jit
    def dynamic_kernel(steps, x):
        return pl.pallas_call(
            lambda x_ref, y_ref: y_ref.__setitem__(..., x_ref[...]),
            grid=(steps * 2,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (1 + 8 - pl.num_programs(0), 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.int32),
            interpret=interpret,
        )(x)

    return dynamic_kernel


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams()], ids=["core", "tpu"])
def test_num_programs_of_a_dynamic_grid_in_an_index_map(interpret):
    x = np.arange(4 * 8 * 128, dtype=np.int32).reshape((4 * 8, 128))
    f = _num_programs_in_index_map(interpret)
    np.testing.assert_array_equal(f(np.int32(4), x), x[8:16])  # 2 * 4 steps: block 1
    np.testing.assert_array_equal(f(np.int32(3), x), x[24:32])  # 6 steps: block 9 - 6 = 3
    xs = np.stack([x, x + 1])  # vmap adds a grid axis in front: the index map still reads its own axis
    np.testing.assert_array_equal(jax.vmap(lambda x: f(np.int32(4), x))(xs), xs[:, 8:16])


def test_num_programs_of_a_dynamic_grid_in_an_index_map_lowers_to_iteration_bound():
    x = np.arange(4 * 8 * 128, dtype=np.int32).reshape((4 * 8, 128))
    [module] = pltpu.mosaic_modules(_num_programs_in_index_map(False), np.int32(4), x)
    transform = module[module.index("func.func @transform_0") :]
    assert "tpu.iteration_bound 0" in transform[: transform.index("return")], module
