"""Multi-device TPU interpret mode: kernels inside ``jax.shard_map`` over four
CPU devices with remote DMAs, remote semaphore signals and barrier semaphores.

Every kernel is written once against a ``(pl, pltpu)`` pair and run with ours
(``pallas``/``pallas_tpu``) and with JAX's (``jax.experimental.pallas``), each
compared with a plain ``jnp`` reference on fresh random data. JAX's interpret
mode runs with ``dma_execution_mode="eager"``: in its default mode a remote
DMA's data may land after the receiver's ``wait_recv`` returns.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.chip
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from jax.sharding import PartitionSpec as P
from ways import Way
from ways.mosaic import tpu_modules

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.interpret import multi as interpret_multi

pytestmark = ways.chip.needs_devices(4)

N = 4
IMPLS = {
    "ours": (pl, pltpu, lambda **kw: pltpu.InterpretParams(**kw)),
    "jax": (jpl, jpltpu, lambda **kw: jpltpu.InterpretParams(dma_execution_mode="eager", **kw)),
}


@pytest.fixture(autouse=True)
def _fresh_state(fresh_sessions):
    yield


IMPL_WAYS = [
    pytest.param("ours", "interpret", id="interpret-ours"),
    pytest.param("jax", "interpret", id="interpret-jax"),
    pytest.param(None, Way("mosaic"), id="ours"),
    pytest.param(None, Way("jax_mosaic"), id="jax"),
    pytest.param(None, Way("compiled"), id="compiled"),
]
"""Our and JAX's TPU interpret mode, then the Mosaic ways of tests/ways
(compiled: by libtpu for a mesh of four compile-only chips), ``way.run_sharded``."""


def run_sharded(build, x, way, mesh_shape):
    """``build(pl, pltpu)``'s kernel run the ``way`` way over ``mesh_shape`` devices."""
    return way.run_sharded(build(*way.modules()), x, mesh_shape)


def mesh1d():
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:N]), ("x",))


def mesh2d():
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:N]).reshape(2, 2), ("x", "y"))


def smap(f, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def barrier(pl, pltpu, neighbours):
    """Signal every neighbour's barrier semaphore, then wait for all of theirs."""
    sem = pltpu.get_barrier_semaphore()
    for d in neighbours:
        pl.semaphore_signal(sem, 1, device_id=d, device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(sem, len(neighbours))


# ---------------------------------------------------------------------------
# Kernels (written once, for either implementation).


def allgather_kernel(pl, pltpu, logical):
    def kernel(x_ref, o_ref, send_sem, recv_sem):
        me = lax.axis_index("x")
        right, left = lax.rem(me + 1, N), lax.rem(me - 1 + N, N)
        barrier(pl, pltpu, [(left,), (right,)])
        o_ref[me] = x_ref[...]

        def body(i, carry):
            slot = lax.rem(me - i + N, N)
            if logical:
                dev, kind = right, pl.DeviceIdType.LOGICAL
            else:
                dev, kind = (right,), pl.DeviceIdType.MESH
            copy = pltpu.make_async_remote_copy(
                o_ref.at[slot], o_ref.at[slot], send_sem, recv_sem, device_id=dev, device_id_type=kind
            )
            copy.start()
            copy.wait_send()
            copy.wait_recv()
            return carry

        lax.fori_loop(0, N - 1, body, 0)

    return kernel


def allgather(impl, x, logical=False, way="interpret", **params):

    def build(pl, pltpu, interpret=False):
        return lambda x: pl.pallas_call(
            allgather_kernel(pl, pltpu, logical),
            out_shape=jax.ShapeDtypeStruct((N, *x.shape), x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=interpret,
        )(x)

    if way != "interpret":  # the Mosaic ways (tests/ways): lowered by ours or JAX's, run by run_mosaic
        return run_sharded(build, x, way, N)
    pl, pltpu, make_params = IMPLS[impl]
    return smap(build(pl, pltpu, make_params(**params)), mesh1d(), P("x"), P("x"))(x)


def allreduce_kernel(pl, pltpu, flow_control=True):
    """Ring all-reduce (sum): N-1 steps, each sending the last received block to
    the right neighbour; a REGULAR semaphore signalled on the left neighbour
    says "my receive buffer is free again" before it is overwritten."""

    def kernel(x_ref, o_ref, buf_ref, send_sem, recv_sem, cap_sem):
        me = lax.axis_index("x")
        right, left = lax.rem(me + 1, N), lax.rem(me - 1 + N, N)
        barrier(pl, pltpu, [(left,), (right,)])
        o_ref[...] = x_ref[...]
        buf_ref[0] = x_ref[...]

        def body(i, carry):
            src, dst = lax.rem(i, 2), 1 - lax.rem(i, 2)
            if flow_control:

                @pl.when(i > 0)
                def _():
                    pl.semaphore_wait(cap_sem, 1)

            copy = pltpu.make_async_remote_copy(
                buf_ref.at[src], buf_ref.at[dst], send_sem, recv_sem, device_id=(right,)
            )
            copy.start()
            copy.wait_send()
            copy.wait_recv()
            o_ref[...] += buf_ref[dst]
            if flow_control:

                @pl.when(i < N - 2)
                def _():
                    pl.semaphore_signal(cap_sem, 1, device_id=(left,), device_id_type=pl.DeviceIdType.MESH)

            return carry

        lax.fori_loop(0, N - 1, body, 0)

    return kernel


def allreduce(impl, x, flow_control=True, way="interpret", **params):

    def build(pl, pltpu, interpret=False):
        return lambda x: pl.pallas_call(
            allreduce_kernel(pl, pltpu, flow_control),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[
                pltpu.VMEM((2, *x.shape), x.dtype),
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.REGULAR,
            ],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=interpret,
        )(x)

    if way != "interpret":  # the Mosaic ways (tests/ways): lowered by ours or JAX's, run by run_mosaic
        return run_sharded(build, x, way, N)
    pl, pltpu, make_params = IMPLS[impl]
    return smap(build(pl, pltpu, make_params(**params)), mesh1d(), P("x"), P("x"))(x)


def exchange2d_kernel(pl, pltpu, logical):
    """On a (2, 2) mesh: o[0] = x of the device across 'y', o[1] = x of the
    device across 'x' (remote DMAs into HBM, a barrier with all partners)."""

    def kernel(x_ref, o_ref, send_sem, recv_sem):
        i, j = lax.axis_index("x"), lax.axis_index("y")
        partners = [(i, 1 - j), (1 - i, j)]
        barrier(pl, pltpu, partners)
        for slot, (pi, pj) in enumerate(partners):
            if logical:
                dev, kind = pi * 2 + pj, pl.DeviceIdType.LOGICAL
            else:
                dev, kind = (pi, pj), pl.DeviceIdType.MESH
            copy = pltpu.make_async_remote_copy(
                x_ref, o_ref.at[slot], send_sem, recv_sem, device_id=dev, device_id_type=kind
            )
            copy.start()
            copy.wait_send()
            copy.wait_recv()

    return kernel


def exchange2d(impl, x, logical=False, way="interpret", **params):

    def build(pl, pltpu, interpret=False):
        return lambda x: pl.pallas_call(
            exchange2d_kernel(pl, pltpu, logical),
            out_shape=jax.ShapeDtypeStruct((2, *x.shape), x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=interpret,
        )(x)

    if (
        way != "interpret"
    ):  # the Mosaic ways (tests/ways) on a (2, 2) mesh, run by run_mosaic(mesh_shape=(2, 2))
        return run_sharded(build, x, way, (2, 2))
    pl, pltpu, make_params = IMPLS[impl]
    return smap(build(pl, pltpu, make_params(**params)), mesh2d(), P(("x", "y")), P(("x", "y")))(x)


def signal_ring(impl, x, way="interpret", **params):
    """Remote semaphore signals carry values: device d signals its right
    neighbour with d + 1 and waits for exactly left + 1, then adds what it
    read from the semaphore before waiting (always left + 1) to x."""

    def build(pl, pltpu, interpret=False):
        def kernel(x_ref, o_ref, sem):
            me = lax.axis_index("x")
            right, left = lax.rem(me + 1, N), lax.rem(me - 1 + N, N)
            pl.semaphore_signal(sem, me + 1, device_id=right, device_id_type=pl.DeviceIdType.LOGICAL)
            pl.semaphore_wait(sem, left + 1)
            o_ref[...] = x_ref[...] + (left + 1).astype(x_ref.dtype)

        return lambda x: pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.SemaphoreType.REGULAR],
            interpret=interpret,
        )(x)

    if way != "interpret":  # the Mosaic ways (tests/ways): lowered by ours or JAX's, run by run_mosaic
        return run_sharded(build, x, way, N)
    pl, pltpu, make_params = IMPLS[impl]
    return smap(build(pl, pltpu, make_params(**params)), mesh1d(), P("x"), P("x"))(x)


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl,way", IMPL_WAYS)
@pytest.mark.parametrize("logical", [False, True], ids=["mesh", "logical"])
def test_ring_allgather(impl, way, logical):
    x = rand((N * 8, 128), 1)
    out = allgather(impl, x, logical=logical, way=way)
    expected = jnp.tile(x.reshape(1, N, 8, 128), (N, 1, 1, 1)).reshape(N * N, 8, 128)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.interpret_only(reason="race detection")
def test_ring_allgather_matches_jax_with_race_detection():
    x = rand((N * 8, 256), 2)
    ours = allgather("ours", x, detect_races=True)
    theirs = allgather("jax", x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert not interpret_multi.races.races_found


@pytest.mark.parametrize("impl,way", IMPL_WAYS)
def test_ring_allreduce_with_remote_signals(impl, way):
    x = rand((N * 8, 128), 3)
    out = allreduce(impl, x, way=way)
    expected = jnp.tile(x.reshape(N, 8, 128).sum(0), (N, 1))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-5)


@pytest.mark.interpret_only(reason="race detection")
def test_ring_allreduce_race_free():
    x = rand((N * 8, 128), 4)
    out = allreduce("ours", x, detect_races=True)
    expected = jnp.tile(x.reshape(N, 8, 128).sum(0), (N, 1))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-5)
    assert not interpret_multi.races.races_found


@pytest.mark.parametrize("impl,way", IMPL_WAYS)
@pytest.mark.parametrize("logical", [False, True], ids=["mesh", "logical"])
def test_2d_mesh_exchange(impl, way, logical):
    x = rand((N * 8, 128), 5)
    out = np.asarray(exchange2d(impl, x, logical=logical, way=way)).reshape(2, 2, 2, 8, 128)
    xs = np.asarray(x).reshape(2, 2, 8, 128)
    for i in range(2):
        for j in range(2):
            np.testing.assert_array_equal(out[i, j, 0], xs[i, 1 - j])
            np.testing.assert_array_equal(out[i, j, 1], xs[1 - i, j])


@pytest.mark.parametrize("impl,way", IMPL_WAYS)
def test_remote_signal_values(impl, way):
    x = rand((N * 8, 128), 6)
    out = signal_ring(impl, x, way=way)
    left = (np.arange(N) - 1) % N
    expected = np.asarray(x).reshape(N, 8, 128) + (left + 1)[:, None, None]
    np.testing.assert_allclose(np.asarray(out).reshape(N, 8, 128), expected)


@pytest.mark.interpret_only(reason="the interpreter pairs the devices' kernel calls")
def test_two_kernels_in_one_program_pair_up():
    # The n-th call on each device meets the n-th call on the others.
    x = rand((N * 8, 128), 7)
    _, _, make_params = IMPLS["ours"]

    def call(x):
        return pl.pallas_call(
            allgather_kernel(pl, pltpu, False),
            out_shape=jax.ShapeDtypeStruct((N, *x.shape), x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=make_params(),
        )(x)

    def f(x):
        a = call(x)
        return call(a[0] * 2.0), a

    b, a = smap(f, mesh1d(), P("x"), (P("x"), P("x")))(x)
    xs = np.asarray(x).reshape(N, 8, 128)
    np.testing.assert_array_equal(np.asarray(a).reshape(N, N, 8, 128), np.broadcast_to(xs, (N, N, 8, 128)))
    # a[0] on device d is x of device 0; gathering it gives 2 * x0 everywhere.
    np.testing.assert_array_equal(
        np.asarray(b).reshape(N, N, 8, 128), np.broadcast_to(2 * xs[0], (N, N, 8, 128))
    )


# ---------------------------------------------------------------------------
# Error paths.


@pytest.mark.interpret_only(reason="interpret-mode error message")
def test_remote_copy_outside_shard_map_is_a_trace_time_error():
    def kernel(x_ref, o_ref, send_sem, recv_sem):
        pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=(1,)).start()

    with pytest.raises(ValueError, match="inside jax.shard_map"):
        pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
            interpret=pltpu.InterpretParams(),
        )(jnp.ones((8, 128)))


@pytest.mark.interpret_only(reason="interpret-mode error message")
def test_barrier_needs_collective_id():
    def kernel(x_ref, o_ref):
        barrier(pl, pltpu, [(lax.rem(lax.axis_index("x") + 1, N),)])
        o_ref[...] = x_ref[...]

    def f(x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=pltpu.InterpretParams()
        )(x)

    with pytest.raises(ValueError, match="collective_id"):
        smap(f, mesh1d(), P("x"), P("x"))(jnp.ones((N * 8, 128)))


def _run_signal_kernel(signal_to, wait_for, x):
    def kernel(x_ref, o_ref, sem):
        me = lax.axis_index("x")
        signal_to(me, sem)
        wait_for(me, sem)
        o_ref[...] = x_ref[...]

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            scratch_shapes=[pltpu.SemaphoreType.REGULAR],
            interpret=pltpu.InterpretParams(),
        )(x)

    return smap(f, mesh1d(), P("x"), P("x"))(x)


@pytest.mark.interpret_only(reason="deadlock detection")
def test_deadlock_is_reported_not_hung():
    def signal_to(me, sem):
        @pl.when(me != 0)
        def _():
            pl.semaphore_signal(sem, 1, device_id=(lax.rem(me + 1, N),))

    def wait_for(me, sem):
        pl.semaphore_wait(sem, 1)  # device 1 waits for device 0, which never signals

    t0 = time.monotonic()
    with pytest.raises(
        Exception, match=r"deadlock: device 1 waits at test_multi_device.py:\d+ on scratch_shapes\[0\]"
    ):
        jax.block_until_ready(_run_signal_kernel(signal_to, wait_for, rand((N * 8, 128), 8)))
    assert time.monotonic() - t0 < 15  # found when every device is stuck or done, not by the timeout


@pytest.mark.interpret_only(reason="deadlock detection")
def test_wait_while_the_others_finished_is_a_deadlock():
    def signal_to(me, sem):
        @pl.when(me != 0)
        def _():
            pl.semaphore_signal(sem, 1, device_id=(me,))  # a remote signal to itself

    def wait_for(me, sem):
        pl.semaphore_wait(sem, 1)

    with pytest.raises(Exception, match=r"device 0 waits .*device 1 finished the kernel; device 2 finished"):
        jax.block_until_ready(_run_signal_kernel(signal_to, wait_for, rand((N * 8, 128), 9)))


@pytest.mark.interpret_only(reason="deadlock detection")
def test_deadlock_timeout_when_a_device_never_starts():
    # Not every device of the mesh joined, so only the timeout can end the wait.
    interpret_multi.set_deadlock_timeout(0.3)
    s = interpret_multi.join_session(("unit test",), 2, 0, "in TPU kernel 'k'", False)
    with s.cv, pytest.raises(pltpu.KernelError, match=r"waited 0.3 s .*devices \[1\] never started"):
        s.block(0, lambda: False, "waits on a semaphore")


@pytest.mark.interpret_only(reason="interpret-mode error message")
def test_signal_outside_the_mesh():
    def signal_to(me, sem):
        pl.semaphore_signal(sem, 1, device_id=(me + 1,))  # device 3 signals device 4

    def wait_for(me, sem):
        pass

    with pytest.raises(Exception, match="device_id 4 is outside the mesh of 4 devices"):
        jax.block_until_ready(_run_signal_kernel(signal_to, wait_for, rand((N * 8, 128), 10)))


@pytest.mark.interpret_only(reason="interpret-mode error message")
def test_unwaited_remote_signal_is_reported():
    def signal_to(me, sem):
        pl.semaphore_signal(sem, 1, device_id=(lax.rem(me + 1, N),))

    def wait_for(me, sem):
        pass

    with pytest.raises(Exception, match=r"holds 1 when the kernel ends"):
        jax.block_until_ready(_run_signal_kernel(signal_to, wait_for, rand((N * 8, 128), 11)))


@pytest.mark.interpret_only(reason="interpret-mode error message")
def test_wrong_number_of_mesh_coordinates():
    def signal_to(me, sem):
        pl.semaphore_signal(sem, 1, device_id=(0, 0))

    with pytest.raises(ValueError, match="one coordinate per mesh axis"):
        _run_signal_kernel(signal_to, lambda me, sem: None, rand((N * 8, 128), 12))


@pytest.mark.interpret_only(reason="the interpreter's shared state after an error")
def test_state_recovers_after_an_error():
    # A failed run (deadlock) must not desynchronize the pairing of later calls.
    def wait_for(me, sem):
        pl.semaphore_wait(sem, 1)

    with pytest.raises(Exception, match="deadlock"):
        jax.block_until_ready(_run_signal_kernel(lambda me, sem: None, wait_for, rand((N * 8, 128), 13)))
    x = rand((N * 8, 128), 14)
    out = allgather("ours", x)
    np.testing.assert_array_equal(
        np.asarray(out).reshape(N, N, 8, 128),
        np.broadcast_to(np.asarray(x).reshape(N, 8, 128), (N, N, 8, 128)),
    )


# ---------------------------------------------------------------------------
# run_mosaic on a 2-D mesh: its errors name devices by id and mesh coordinates.


def _run_2d_signal_kernel(way, body):
    """``body(pl, i, j, sem)`` in a kernel on a (2, 2) mesh, lowered the ``way``
    way and run by ``run_mosaic(mesh_shape=(2, 2))``."""

    def build(pl, pltpu, interpret=False):
        def kernel(x_ref, o_ref, sem):
            body(pl, lax.axis_index("x"), lax.axis_index("y"), sem)
            o_ref[...] = x_ref[...]

        return lambda x: pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.SemaphoreType.REGULAR],
        )(x)

    return run_sharded(build, rand((N * 8, 128), 15), way, (2, 2))


@pytest.mark.parametrize("way", [Way("mosaic"), Way("jax_mosaic")], ids=["ours", "jax"])
def test_run_mosaic_2d_mesh_signal_outside_the_mesh(way):
    def body(pl, i, j, sem):
        @pl.when((i == 1) & (j == 1))
        def _():  # mesh coordinates (2, 1): logical id 5
            pl.semaphore_signal(sem, 1, device_id=(i + 1, j), device_id_type=pl.DeviceIdType.MESH)

    with pytest.raises(
        pltpu.MosaicError,
        match=r"device id 5 is outside the mesh of shape \(2, 2\): 4 devices \(ids 0\.\.3\)",
    ):
        _run_2d_signal_kernel(way, body)


@pytest.mark.parametrize("way", [Way("mosaic"), Way("jax_mosaic")], ids=["ours", "jax"])
def test_run_mosaic_2d_mesh_deadlock_names_mesh_coordinates(way):
    def body(pl, i, j, sem):
        @pl.when((i == 1) & (j == 0))
        def _():
            pl.semaphore_wait(sem, 1)  # nobody signals device (1, 0)

    with pytest.raises(
        pltpu.MosaicError,
        match=r"deadlock: device 2 \(mesh coordinates \(1, 0\)\) waits at 'tpu.sem_wait' .* \(device 0 \(mesh "
        r"coordinates \(0, 0\)\) finished; device 1 \(mesh coordinates \(0, 1\)\) finished; device 3",
    ):
        _run_2d_signal_kernel(way, body)


def test_run_mosaic_mesh_shape_operands():
    """Device (i, j) of a (2, 2) mesh gets operand[i, j]; the outputs have the mesh axes too."""
    out_shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    (body,) = tpu_modules(
        lambda a: pl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2), out_shape=out_shape
        )(a),
        jnp.ones((8, 128), jnp.float32),
    )
    x = np.asarray(rand((2, 2, 8, 128), 16))
    np.testing.assert_array_equal(pltpu.run_mosaic(body, x, out_shape=out_shape, mesh_shape=(2, 2)), x * 2)
    with pytest.raises(
        ValueError,
        match=r"operand 0 has shape \[4, 8, 128\]; with mesh_shape=\(2, 2\) its leading axes must be \[2, 2\]",
    ):
        pltpu.run_mosaic(body, x.reshape(4, 8, 128), out_shape=out_shape, mesh_shape=(2, 2))
    with pytest.raises(ValueError, match=r"mesh_shape=\(2, 2\) \(4 devices\) with num_devices=3"):
        pltpu.run_mosaic(body, x, out_shape=out_shape, mesh_shape=(2, 2), num_devices=3)


del functools
