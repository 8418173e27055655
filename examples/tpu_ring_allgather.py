"""Ring all-gather over 4 devices with remote DMAs, in TPU interpret mode on CPU devices.

Each of the 4 devices holds one `(rows, cols)` shard of `x`; afterwards every device holds all 4.
The kernel runs inside `jax.shard_map`, once per device. After a barrier (every device signals
its two neighbours' barrier semaphore, then waits for both signals, so nobody writes into a
neighbour that has not started), step `i` of `N - 1` sends the slot received last
(`(me - i) mod N`, first our own) to the right neighbour with
`pltpu.make_async_remote_copy`, writing the same slot there; `wait_send` / `wait_recv` wait
for our outgoing and the incoming copy. The destination index is the sender's, as on a TPU.

Off a TPU, or on a TPU machine of fewer than 4 chips, the 4 devices are CPU devices (`--xla_force_host_platform_device_count=4`, set below
before JAX starts) and the kernel runs with `interpret=pltpu.InterpretParams()`, whose
multi-device mode carries DMAs and semaphore signals between the devices' programs.
`--detect-races` turns on its race detector.

Run: python examples/tpu_ring_allgather.py [--size small|large] [--detect-races]
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import Backend, check_and_report, time_ms, use_cpu_for_tpu_interpret
from jax import lax
from jax.sharding import PartitionSpec as P

import pallas as pl
import pallas_tpu as pltpu

N = 4  # devices in the ring


def allgather_kernel(x_ref, o_ref, send_sem, recv_sem):
    me = lax.axis_index("x")
    right, left = lax.rem(me + 1, N), lax.rem(me - 1 + N, N)
    barrier = pltpu.get_barrier_semaphore()
    for neighbour in (left, right):
        pl.semaphore_signal(barrier, 1, device_id=(neighbour,), device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, 2)
    o_ref[me] = x_ref[...]

    def step(i, carry):
        slot = lax.rem(me - i + N, N)
        copy = pltpu.make_async_remote_copy(
            o_ref.at[slot], o_ref.at[slot], send_sem, recv_sem, device_id=(right,)
        )
        copy.start()
        copy.wait_send()
        copy.wait_recv()
        return carry

    lax.fori_loop(0, N - 1, step, 0)


def allgather(x, *, interpret):
    return pl.pallas_call(
        allgather_kernel,
        out_shape=jax.ShapeDtypeStruct((N, *x.shape), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=interpret,
    )(x)


def main():
    sizes = {"small": {"rows": 8, "cols": 128}, "large": {"rows": 512, "cols": 1024}}
    parser = argparse.ArgumentParser(description="Ring all-gather with remote DMAs over 4 devices")
    parser.add_argument("--size", choices=sorted(sizes), default="small")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--detect-races", action="store_true")
    args = parser.parse_args()
    cfg = sizes[args.size]
    if jax.default_backend() == "tpu" and jax.device_count() < N:
        # A TPU machine of fewer chips (the lent v5e has one): the ring runs in TPU
        # interpret mode on its CPU's devices instead.
        print(f"{jax.device_count()} TPU chip(s), the ring needs {N}: TPU interpret mode on {N} CPU devices")
        jax.config.update("jax_default_device", jax.devices("cpu")[0])
        on_tpu = False
    else:
        on_tpu = not use_cpu_for_tpu_interpret()
    backend = Backend("tpu" if on_tpu else "tpu-interpret", interpret=not on_tpu)
    print(
        f"backend: {backend.name}  (jax {jax.__version__}, {jax.device_count()} devices: {jax.devices()[0]}...)"
    )
    print(f"size: {args.size}  " + "  ".join(f"{k}={v}" for k, v in cfg.items()))
    if len(jax.devices() if on_tpu else jax.devices("cpu")) < N:
        print(f"tpu_ring_allgather: FAIL  needs {N} devices, found {jax.device_count()}")
        sys.exit(1)
    interpret = False if on_tpu else pltpu.InterpretParams(detect_races=args.detect_races)
    devices = jax.devices() if on_tpu else jax.devices("cpu")
    mesh = jax.sharding.Mesh(np.array(devices[:N]), ("x",))
    fn = jax.jit(
        jax.shard_map(
            lambda x: allgather(x, interpret=interpret),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
    )
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.key(0), (N * cfg["rows"], cfg["cols"]), dtype)
        out = fn(x).reshape(N, N * cfg["rows"], cfg["cols"])  # device d's gathered copy
        expected = jnp.broadcast_to(x, (N, *x.shape))
        ms = time_ms(fn, x, runs=args.runs)
        name = f"tpu_ring_allgather_{jnp.dtype(dtype).name}"
        check_and_report(name, out, expected, tol=0.0, ms=ms, runs=args.runs, backend=backend)


if __name__ == "__main__":
    main()
