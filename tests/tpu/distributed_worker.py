"""One process of the two-process job of ``test_distributed.py`` (not a test module).

Run as ``python distributed_worker.py PROCESS_ID PORT SEED``: joins a
``jax.distributed`` job of two processes on localhost, two CPU devices each, and
runs kernels under ``jax.shard_map`` over a mesh of all four devices, each checked
against ``jnp`` on the shards this process holds. Prints one ``PASS <case>`` line
per case that ran and matched, ``REFUSED <case>: <message>`` for the kernel that
needs remote DMAs across processes; any other outcome is a traceback and a
non-zero exit.
"""

from __future__ import annotations

import sys

import jax

process_id, port, seed = (int(a) for a in sys.argv[1:4])
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_enable_checks", True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the psum across processes
jax.distributed.initialize(
    f"localhost:{port}", num_processes=2, process_id=process_id, initialization_timeout=30
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas as pl  # noqa: E402
import pallas_tpu as pltpu  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))  # devices of both processes
local_mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("x",))
rng = np.random.default_rng(seed)  # the same global data in both processes


def global_array(x: np.ndarray, m=mesh):
    return jax.make_array_from_callback(x.shape, NamedSharding(m, P("x")), lambda i: x[i])


def smap(f, m, in_specs, out_specs):
    # check_vma=False: the kernels' out_shape carry no manual_axis_type (JAX's Pallas asks the same).
    return jax.jit(jax.shard_map(f, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def check_shards(out, ref, case):
    for shard in out.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), ref[shard.index], rtol=1e-5, atol=1e-5)
    print(f"PASS {case}", flush=True)


# -- a pallas-core kernel (interpret=True), and a psum of its results across processes.


def core_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) * y_ref[...] + 1.0


def core_local(x, y):
    spec = pl.BlockSpec((4, 128), lambda i: (i, 0))
    o = pl.pallas_call(
        core_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 4,),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=True,
    )(x, y)
    return o, lax.psum(jnp.sum(o, axis=0), "x")


xg = rng.standard_normal((32, 128), np.float32)
yg = rng.standard_normal((32, 128), np.float32)
out, total = smap(core_local, mesh, (P("x"), P("x")), (P("x"), P()))(global_array(xg), global_array(yg))
ref = np.sin(xg) * yg + 1.0
check_shards(out, ref, "pallas-core kernel")
np.testing.assert_allclose(np.asarray(total.addressable_shards[0].data), ref.sum(0), rtol=1e-4, atol=1e-4)
print("PASS psum across processes", flush=True)


# -- a pallas-tpu kernel in TPU interpret mode: blocked input, an HBM input fetched by a
# local DMA, VMEM scratch accumulating over the grid's reduction axis.


def tpu_kernel(x_ref, y_hbm, o_ref, acc, ybuf, sem):
    i, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)
        copy = pltpu.make_async_copy(y_hbm.at[pl.ds(i * 8, 8)], ybuf, sem)
        copy.start()
        copy.wait()

    acc[...] += 2.0 * x_ref[...]

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc[...] + ybuf[...]


def tpu_local(x, y):
    return pl.pallas_call(
        tpu_kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(x.shape[0] // 8, x.shape[1] // 128),
        in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
        scratch_shapes=[
            pltpu.VMEM((8, 128), jnp.float32),
            pltpu.VMEM((8, 128), jnp.float32),
            pltpu.SemaphoreType.DMA,
        ],
        interpret=pltpu.InterpretParams(),
    )(x, y)


xg = rng.standard_normal((64, 256), np.float32)
yg = rng.standard_normal((64, 128), np.float32)
out = smap(tpu_local, mesh, (P("x"), P("x")), P("x"))(global_array(xg), global_array(yg))
check_shards(out, 2.0 * (xg[:, :128] + xg[:, 128:]) + yg, "pallas-tpu kernel")


# -- remote DMAs: a ring shift. Over this process's devices it runs; over the mesh of
# both processes it is refused when traced (the interpreter's shared state is per process).


def ring_kernel(x_ref, o_ref, send_sem, recv_sem):
    me, n = lax.axis_index("x"), lax.axis_size("x")
    copy = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id=(lax.rem(me + 1, n),))
    copy.start()
    copy.wait_send()
    copy.wait_recv()


def ring_local(x):
    return pl.pallas_call(
        ring_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(),
    )(x)


xg = rng.standard_normal((16, 128), np.float32)
out = smap(ring_local, local_mesh, P("x"), P("x"))(global_array(xg, local_mesh))
check_shards(out, np.roll(xg, 8, axis=0), "remote DMAs on this process's devices")

# The global mesh, and one of two devices (no more than a process has) that spans both.
cross_mesh = jax.sharding.Mesh(np.array(jax.devices()[1:3]), ("x",))
for name, m in (("all devices", mesh), ("one device of each process", cross_mesh)):
    xg = rng.standard_normal((8 * m.size, 128), np.float32)
    try:
        jax.block_until_ready(smap(ring_local, m, P("x"), P("x"))(global_array(xg, m)))
    except NotImplementedError as e:
        print(f"REFUSED remote DMAs across processes ({name}): {' '.join(str(e).split())}", flush=True)
    else:
        raise AssertionError(f"a kernel with remote DMAs ran over a mesh that spans processes ({name})")

jax.distributed.shutdown()
