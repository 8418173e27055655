"""``pltpu.sync_copy``, ``run_on_first_core`` and ``core_barrier`` against
plain jnp on fresh random data: ``sync_copy`` kernels run every TPU way
(tests/ways), the two-core kernels too (``way.with_params(num_cores=2)``: a
megacore chip), but for the deadlock report, which only interpret mode gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.compiled
from jax import lax
from ways import Way, every_way
from ways.jax_mosaic import tensorcore_mesh

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.mosaic.compile_check import MosaicCompileError

jax.config.update("jax_enable_checks", True)


def rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


HBM = pl.BlockSpec(memory_space=pl.ANY)


def sync_copy_round_trip(pl, pltpu, x, *, interpret):
    hbm = pl.BlockSpec(memory_space=pl.ANY)

    def kernel(x_hbm, o_hbm, buf):
        pltpu.sync_copy(x_hbm.at[pl.ds(8, 8)], buf)
        buf[...] = buf[...] * 2.0 + 1.0
        pltpu.sync_copy(buf, o_hbm.at[pl.ds(0, 8)])
        pltpu.sync_copy(x_hbm.at[pl.ds(0, 8)], o_hbm.at[pl.ds(8, 8)])  # HBM to HBM

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[hbm],
        out_specs=hbm,
        scratch_shapes=[pltpu.VMEM((8, 256), jnp.float32)],
        interpret=interpret,
    )(x)


@every_way(tpu=True, dma=True)
def test_sync_copy_round_trip_through_vmem(way):
    x = rand(0, (16, 256))
    close(way.call(sync_copy_round_trip, x), jnp.concatenate([x[8:] * 2.0 + 1.0, x[:8]]))


def sync_copy_pytrees(pl, pltpu, x, y, *, interpret):
    hbm = pl.BlockSpec(memory_space=pl.ANY)

    def kernel(x_hbm, y_hbm, a_hbm, b_hbm):
        def body(bufs):
            pltpu.sync_copy({"x": x_hbm, "y": y_hbm}, bufs)
            bufs["x"][...] += 1.0
            pltpu.sync_copy(bufs, {"x": a_hbm, "y": b_hbm})

        pl.run_scoped(body, {"x": pltpu.VMEM(x.shape, jnp.float32), "y": pltpu.VMEM(y.shape, jnp.float32)})

    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
    return pl.pallas_call(
        kernel, out_shape=out_shape, in_specs=[hbm, hbm], out_specs=(hbm, hbm), interpret=interpret
    )(x, y)


@every_way(tpu=True)
def test_sync_copy_pytrees(way):
    x, y = rand(1, (8, 128)), rand(2, (16, 128))
    a, b = way.call(sync_copy_pytrees, x, y)
    close(a, x + 1.0)
    close(b, y)


@pytest.mark.interpret_only(reason="error message")
def test_sync_copy_errors():
    x = rand(3, (8, 128))

    def run(kernel):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[HBM],
            out_specs=HBM,
            interpret=pltpu.InterpretParams(),
        )(x)

    with pytest.raises(ValueError, match="same shape and dtype"):
        run(lambda x_hbm, o_hbm: pltpu.sync_copy(x_hbm.at[pl.ds(0, 4)], o_hbm))
    with pytest.raises(ValueError, match="different structures"):
        run(lambda x_hbm, o_hbm: pltpu.sync_copy([x_hbm], [o_hbm, o_hbm]))


def _two_core_kernel(body, x, scratch=()):
    mesh = tensorcore_mesh(pltpu)
    return pl.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        mesh=mesh,
        scratch_types=scratch,
        interpret=pltpu.InterpretParams(num_cores_or_threads=2),
    )(x)


def _two_cores(make_body, x, way, scratch=lambda pltpu: ()):
    """``make_body(pl, pltpu)``'s kernel over the two TensorCores of a chip, run
    the ``way`` way."""

    def build(pl, pltpu):
        return pl.kernel(
            make_body(pl, pltpu),
            out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
            mesh=tensorcore_mesh(pltpu),
            scratch_types=scratch(pltpu),
        )

    return way.with_params(num_cores=2).jit(build(*way.modules()))(x)


@every_way(tpu=True)
def test_run_on_first_core(way):
    x = rand(4, (16, 128))

    def make_body(pl, pltpu):
        def body(x_hbm, o_hbm):
            c = lax.axis_index("core")
            pltpu.sync_copy(x_hbm.at[pl.ds(c * 8, 8)], o_hbm.at[pl.ds(c * 8, 8)])

            @pltpu.run_on_first_core("core")
            def _():
                pltpu.sync_copy(x_hbm.at[pl.ds(8, 8)], o_hbm.at[pl.ds(0, 8)])

        return body

    close(_two_cores(make_body, x, way), jnp.concatenate([x[8:], x[8:]]))


@every_way(tpu=True)
def test_core_barrier_orders_the_cores(way):
    """Core 1 writes its half only after core 0 has written the whole output:
    without the barrier the result would depend on the order of the cores."""
    x = rand(5, (16, 128))

    def make_body(pl, pltpu):
        def body(x_hbm, o_hbm, sem):
            c = lax.axis_index("core")

            @pl.when(c == 0)
            def _():
                pltpu.sync_copy(x_hbm, o_hbm)

            pltpu.core_barrier(sem, core_axis_name="core")

            @pl.when(c == 1)
            def _():
                pltpu.sync_copy(x_hbm.at[pl.ds(0, 8)], o_hbm.at[pl.ds(8, 8)])

        return body

    out = _two_cores(make_body, x, way, scratch=lambda pltpu: [pltpu.SemaphoreType.REGULAR])
    close(out, jnp.concatenate([x[:8], x[:8]]))


@every_way(tpu=True)
def test_core_barrier_each_grid_step_of_a_core_parallel_grid(way):
    """Two cores, four grid points each: at every step each core adds its
    block into a shared HBM accumulator row, then, after a barrier, reads the
    other core's row. The barrier makes every step's read see the other
    core's write of the same step."""
    x = rand(6, (2, 4, 8, 128))

    def build(pl, pltpu):
        def kernel(x_ref, acc_hbm, o_ref, sem, buf):
            c = pl.program_id(0)
            s = pl.program_id(1)

            @pl.when(s == 0)
            def _():
                buf[...] = jnp.zeros_like(buf)
                pltpu.sync_copy(buf, acc_hbm.at[c])

            pltpu.core_barrier(sem, core_axis_name="core")
            pltpu.sync_copy(acc_hbm.at[c], buf)
            buf[...] += x_ref[...]
            pltpu.sync_copy(buf, acc_hbm.at[c])
            pltpu.core_barrier(sem, core_axis_name="core")
            pltpu.sync_copy(acc_hbm.at[1 - c], buf)
            o_ref[...] = buf[...]
            pltpu.core_barrier(sem, core_axis_name="core")

        return pl.pallas_call(
            kernel,
            grid=(("core", 2), ("s", 4)),
            in_specs=[pl.BlockSpec((None, None, 8, 128), lambda c, s: (c, s, 0, 0))],
            out_specs=[
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec((None, None, 8, 128), lambda c, s: (c, s, 0, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((2, 8, 128), jnp.float32),
                jax.ShapeDtypeStruct(x.shape, x.dtype),
            ],
            scratch_shapes=[pltpu.SemaphoreType.REGULAR, pltpu.VMEM((8, 128), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("core_parallel", "arbitrary")),
        )

    if way.name == "compiled":
        if way.beside:
            pytest.skip("compile_both below compiles JAX's lowering beside ours")
        # A core_parallel axis of 2 steps needs a chip with two TensorCores: Mosaic refuses it
        # for the one-core chips (v5e, v6e; libtpu's v4 device), JAX's module as ours.
        one_core = [c for c in ways.compiled.COMPILE_CHIPS if c not in ways.compiled.MEGACORE_CHIPS]
        for chip in one_core:
            with pytest.raises(MosaicCompileError, match="Core-parallel dimension 0 has iteration bound: 2"):
                ways.compiled.compile_both(build, (x,), (chip,))
        ways.compiled.compile_both(build, (x,), ways.compiled.MEGACORE_CHIPS)
        way = Way("mosaic")
    acc, out = way.with_params(num_cores=2).jit(build(*way.modules()))(x)
    prefix = jnp.cumsum(x, axis=1)  # per core, the running sum after each step
    close(acc, prefix[:, -1], 1e-5)
    close(out, prefix[::-1], 1e-5)


@pytest.mark.interpret_only(
    reason="interpret mode's order of cores (run_mosaic's is tested in test_run_mosaic)"
)
def test_wait_for_a_later_core_inside_control_flow_completes():
    """A wait inside lax.cond for a later core's signal: core 0 waits, core 1 signals, and
    the copy after the wait lands, as on a chip and in JAX's TPU interpret mode (a
    core_map runs its cores' branches, not one core to its end before the next)."""
    x = rand(7, (16, 128))

    def body(x_hbm, o_hbm, sem):
        c = lax.axis_index("core")

        @pl.when(c == 0)
        def _():
            pl.semaphore_wait(sem, 1)
            pltpu.sync_copy(x_hbm, o_hbm)

        @pl.when(c == 1)
        def _():
            pl.semaphore_signal(sem, 1, core_index=0)

    out = jax.block_until_ready(_two_core_kernel(body, x, scratch=[pltpu.SemaphoreType.REGULAR]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
