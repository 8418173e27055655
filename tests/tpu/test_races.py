"""Race detection of TPU interpret mode (``InterpretParams(detect_races=True)``).

Each race kind is raised (``on_race="raise"``) with both conflicting accesses
named (what, which Ref and region, the kernel line, device and core): (a) a kernel access of a
DMA's destination, or a write of its source, while the DMA is in flight;
(b) two DMAs in flight writing overlapping memory; (c) cores or devices
touching the same memory with no synchronization. The race-free version of
each kernel runs clean, gives the ``jnp`` result, and leaves
``interpret_multi.races.races_found`` false. JAX's own detector (which prints
and sets a flag instead of raising) is run on the same kernels as a check.
"""

from __future__ import annotations

import os
import re

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from jax.sharding import PartitionSpec as P
from ways import chip as chip_way

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.interpret import multi as interpret_multi

N = 4
IMPLS = {"ours": (pl, pltpu), "jax": (jpl, jpltpu)}
HERE = "test_races.py"


pytestmark = pytest.mark.interpret_only(reason="race detection")


@pytest.fixture(autouse=True)
def _fresh_state(fresh_sessions):
    yield


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def jax_races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as jax_interp

    return bool(jax_interp.races is not None and jax_interp.races.races_found)


def jax_detects_race(fn, *args) -> bool:
    """JAX's detector on the same kernel: JAX 0.11 sets a flag, 0.12 raises."""
    try:
        run("jax", fn, *args)
    except Exception as e:  # JAX 0.12: "RACE DETECTED" from its interpreter
        if "RACE DETECTED" in str(e):
            return True
        raise
    return jax_races_found()


def race_params(pltpu, **kw):
    """Race detection on: ours raises on a race (``on_race="raise"``, JAX 0.12's default),
    JAX's does what its version does."""
    if pltpu is jpltpu:
        return jpltpu.InterpretParams(detect_races=True, **kw)
    return pltpu.InterpretParams(detect_races=True, on_race="raise", **kw)


def run(impl, fn, *args):
    """Runs ``fn`` with JAX's or our modules; ours raises on a race, JAX's sets a flag."""
    pl_, pltpu_ = IMPLS[impl]
    if impl == "jax":
        jpltpu.reset_tpu_interpret_mode_state()
    out = jax.block_until_ready(fn(pl_, pltpu_, *args))
    jax.effects_barrier()
    return out


# ---------------------------------------------------------------------------
# (a) and (b): DMAs in flight on one device.


def local_dma(pl, pltpu, x, variant):
    def kernel(x_hbm, o_ref, buf, sems):
        if variant == "read_dst_in_flight":
            c = pltpu.make_async_copy(x_hbm, buf, sems.at[0])
            c.start()
            o_ref[...] = buf[...]  # the DMA may not have landed yet
            c.wait()
        elif variant == "write_src_in_flight":
            buf[...] = x_hbm[...] if False else jnp.zeros_like(buf)
            c = pltpu.make_async_copy(buf, o_ref, sems.at[0])
            c.start()
            buf[...] = jnp.ones_like(buf)  # the DMA may still be reading it
            c.wait()
        elif variant == "overlapping_dmas":
            c1 = pltpu.make_async_copy(x_hbm.at[0:16], buf.at[0:16], sems.at[0])
            c2 = pltpu.make_async_copy(x_hbm.at[8:24], buf.at[8:24], sems.at[1])
            c1.start()
            c2.start()
            c1.wait()
            c2.wait()
            o_ref[...] = buf[...]
        else:  # race free: disjoint DMAs, read after both waits
            c1 = pltpu.make_async_copy(x_hbm.at[0:16], buf.at[0:16], sems.at[0])
            c2 = pltpu.make_async_copy(x_hbm.at[16:32], buf.at[16:32], sems.at[1])
            c1.start()
            c2.start()
            c1.wait()
            c2.wait()
            o_ref[...] = buf[...] * 2.0

    params = race_params(pltpu)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=params,
    )(x)


def test_race_free_dmas():
    x = rand((32, 128), 0)
    out = run("ours", local_dma, x, "race_free")
    np.testing.assert_allclose(np.asarray(out), 2.0 * np.asarray(x))
    assert not interpret_multi.races.races_found
    run("jax", local_dma, x, "race_free")
    assert not jax_races_found()


def test_kernel_reads_dma_destination_in_flight():
    x = rand((32, 128), 1)
    with pytest.raises(Exception, match="data race") as e:
        run("ours", local_dma, x, "read_dst_in_flight")
    msg = str(e.value)
    assert f"read of scratch_shapes[0][0:32, 0:128] by the kernel at {HERE}:" in msg
    assert f"write of scratch_shapes[0][0:32, 0:128] by the DMA started at {HERE}:" in msg
    assert interpret_multi.races.races_found
    assert jax_detects_race(local_dma, x, "read_dst_in_flight")


def test_kernel_writes_dma_source_in_flight():
    x = rand((32, 128), 2)
    with pytest.raises(Exception, match="data race") as e:
        run("ours", local_dma, x, "write_src_in_flight")
    msg = str(e.value)
    assert f"write of scratch_shapes[0][0:32, 0:128] by the kernel at {HERE}:" in msg
    assert f"read of scratch_shapes[0][0:32, 0:128] by the DMA started at {HERE}:" in msg


def test_two_dmas_write_overlapping_memory():
    x = rand((32, 128), 3)
    with pytest.raises(Exception, match="data race") as e:
        run("ours", local_dma, x, "overlapping_dmas")
    msg = str(e.value)
    assert f"write of scratch_shapes[0][8:24, 0:128] by the DMA started at {HERE}:" in msg
    assert f"write of scratch_shapes[0][0:16, 0:128] by the DMA started at {HERE}:" in msg
    # JAX's detector (0.11.2) does not report two in-flight DMAs into one buffer.


# ---------------------------------------------------------------------------
# (c) cores of one device writing the same HBM region.


def two_cores(pl, pltpu, x, same_region):
    def kernel(x_ref, o_hbm, sem):
        c = pl.program_id(0)
        row = 0 if same_region else c * 8
        copy = pltpu.make_async_copy(x_ref, o_hbm.at[pl.ds(row, 8)], sem)
        copy.start()
        copy.wait()

    params = race_params(pltpu, num_cores_or_threads=2)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda c: (c, 0))],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("core_parallel",)),
        interpret=params,
    )(x)


def test_cores_write_disjoint_hbm():
    x = rand((16, 128), 4)
    out = run("ours", two_cores, x, False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert not interpret_multi.races.races_found


def test_cores_write_same_hbm_region():
    x = rand((16, 128), 5)
    with pytest.raises(Exception, match="data race") as e:
        run("ours", two_cores, x, True)
    msg = str(e.value)
    assert "write of out_specs[0] (HBM)[0:8, 0:128] by the DMA started at" in msg
    assert "(core 0)" in msg and "(core 1)" in msg


# ---------------------------------------------------------------------------
# (c) devices: a remote DMA into a neighbour's output while the neighbour writes it.


def neighbour_copy(pl, pltpu, x, synchronized):
    def kernel(x_ref, o_ref, send_sem, recv_sem):
        me = lax.axis_index("x")
        right, left = lax.rem(me + 1, N), lax.rem(me - 1 + N, N)
        if synchronized:
            o_ref[...] = jnp.zeros_like(o_ref)  # before the barrier: ordered before the DMA
        sem = pltpu.get_barrier_semaphore()
        pl.semaphore_signal(sem, 1, device_id=(left,), device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_signal(sem, 1, device_id=(right,), device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(sem, 2)
        copy = pltpu.make_async_remote_copy(x_ref, o_ref.at[1], send_sem, recv_sem, device_id=(right,))
        copy.start()
        if not synchronized:
            o_ref[...] = jnp.zeros_like(o_ref)  # the left neighbour's DMA may be landing here
        copy.wait_send()
        copy.wait_recv()

    params = race_params(pltpu)

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((2, *x.shape), x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=params,
        )(x)

    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:N]), ("x",))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)


needs_devices = chip_way.needs_devices(N)


@needs_devices
def test_devices_synchronized_by_barrier():
    x = rand((N * 8, 128), 6)
    out = np.asarray(run("ours", neighbour_copy, x, True)).reshape(N, 2, 8, 128)
    xs = np.asarray(x).reshape(N, 8, 128)
    np.testing.assert_array_equal(out[:, 1], np.roll(xs, 1, axis=0))
    assert not interpret_multi.races.races_found


@needs_devices
def test_devices_race_on_remote_dma_destination():
    x = rand((N * 8, 128), 7)
    with pytest.raises(Exception, match="data race") as e:
        run("ours", neighbour_copy, x, False)
    msg = str(e.value)
    assert "by the remote DMA started at" in msg and "by the kernel at" in msg
    # Both accesses are to one device's buffer and come from two devices.
    (target,) = set(re.findall(r"out_specs\[0\] block\[[^]]*\] on device (\d)", msg))
    devices = set(re.findall(r"\(device (\d), core 0\)", msg))
    assert len(devices) == 2 and target in devices, msg
    assert jax_detects_race(neighbour_copy, x, False)


# ---------------------------------------------------------------------------
# Long grids: the detector forgets what can no longer race (accesses every core
# has synchronized past, DMAs waited for) without losing what still can.


def long_grid(pl, pltpu, x, race_at):
    """A DMA of one row block a step; at grid step ``race_at`` the kernel reads
    the scratch before waiting for the DMA."""

    def kernel(x_hbm, o_ref, buf, sem):
        i = pl.program_id(0)
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], buf, sem)
        copy.start()

        @pl.when(i == race_at)
        def _():
            o_ref[...] = buf[...]  # the DMA may not have landed yet

        copy.wait()
        o_ref[...] = buf[...] + 1.0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 8,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        interpret=race_params(pltpu),
    )(x)


def test_long_grid_race_free():
    x = rand((300 * 8, 128), 8)
    out = run("ours", long_grid, x, -1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) + 1.0)
    assert not interpret_multi.races.races_found


def test_long_grid_race_late_is_found():
    x = rand((300 * 8, 128), 9)
    with pytest.raises(Exception, match="data race") as e:
        run("ours", long_grid, x, 250)
    msg = str(e.value)
    assert f"read of scratch_shapes[0][0:8, 0:128] by the kernel at {HERE}:" in msg
    assert f"write of scratch_shapes[0][0:8, 0:128] by the DMA started at {HERE}:" in msg


def cores_many_steps(pl, pltpu, x, race):
    """Two cores, one after the other, ``K`` steps each, each step a DMA of its
    input block to its own rows of the output; with ``race``, core 1's last
    step writes the rows core 0's first step wrote."""
    K = x.shape[0] // 16

    def kernel(x_ref, o_hbm, sem):
        c, k = pl.program_id(0), pl.program_id(1)
        row = c * K + k
        if race:
            row = jnp.where(jnp.logical_and(c == 1, k == K - 1), 0, row)
        copy = pltpu.make_async_copy(x_ref, o_hbm.at[pl.ds(row * 8, 8)], sem)
        copy.start()
        copy.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2, K),
        in_specs=[pl.BlockSpec((8, 128), lambda c, k: (c * K + k, 0))],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("core_parallel", "arbitrary")),
        interpret=race_params(pltpu, num_cores_or_threads=2),
    )(x)


def test_cores_many_steps_disjoint():
    x = rand((2 * 100 * 8, 128), 10)
    out = run("ours", cores_many_steps, x, False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert not interpret_multi.races.races_found


def test_cores_race_across_many_steps():
    """Core 0's first access is kept through 200 steps: core 1 never synchronizes with it."""
    x = rand((2 * 100 * 8, 128), 11)
    with pytest.raises(Exception, match="data race") as e:
        run("ours", cores_many_steps, x, True)
    msg = str(e.value)
    assert "write of out_specs[0] (HBM)[0:8, 0:128] by the DMA started at" in msg
    assert "(core 0)" in msg and "(core 1)" in msg


def test_progress_line(monkeypatch, capfd):
    """A long race-detecting run says how far it got on stderr (here at once)."""
    monkeypatch.setenv("PALLAS_TPU_PROGRESS_S", "0")
    x = rand((20 * 8, 128), 12)
    run("ours", long_grid, x, -1)
    err = capfd.readouterr().err
    assert "pallas_tpu: detecting races in TPU kernel 'kernel'" in err, err
    assert re.search(r"grid step \d+ of 20 after", err), err
