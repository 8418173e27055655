"""TPU interpret mode with race detection: ours against JAX's, per grid step, on the CPU.

A long grid with one DMA a step (a row block of an HBM
input copied into a VMEM scratch, waited for, and written to the pipelined output). It runs
with our `pallas_tpu.InterpretParams(detect_races=True)`, without race detection, and with
JAX's `jax.experimental.pallas.tpu.InterpretParams(detect_races=True)` (imported here only
as the reference), each jitted, checked against `x + 1`, timed on its second call (the first
compiles). Race detection runs on the host, one callback per memory access and DMA, so its
cost is per grid step; before 2026-12-04 ours grew with the grid (every access was checked
against all earlier ones: 16 ms a step at 10^5 steps).

Run: python benchmarks/tpu_race_detection.py [--steps N] [--skip-jax]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def build(pl, pltpu, steps: int, detect_races: bool):
    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(pl.program_id(0) * 8, 8)], buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[...] + 1.0

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(steps,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
            interpret=pltpu.InterpretParams(detect_races=detect_races),
        )(x)

    return jax.jit(f)


def seconds_per_call(fn, x) -> float:
    out = jax.block_until_ready(fn(x))  # compile
    jax.effects_barrier()
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) + 1.0)
    t = time.perf_counter()
    jax.block_until_ready(fn(x))
    jax.effects_barrier()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000, help="grid steps (default 1000: under a minute)")
    ap.add_argument("--skip-jax", action="store_true", help="leave JAX's interpret mode out")
    args = ap.parse_args()

    import pallas as pl
    import pallas_tpu as pltpu

    n = args.steps
    x = jax.random.normal(jax.random.key(0), (n * 8, 128), jnp.float32)
    rows = {
        "ours, detect_races=False": seconds_per_call(build(pl, pltpu, n, False), x),
        "ours, detect_races=True": seconds_per_call(build(pl, pltpu, n, True), x),
    }
    if not args.skip_jax:
        from jax.experimental import pallas as jpl
        from jax.experimental.pallas import tpu as jpltpu

        jpltpu.reset_tpu_interpret_mode_state()
        rows["JAX, detect_races=True"] = seconds_per_call(build(jpl, jpltpu, n, True), x)

    print(f"grid of {n} steps, one DMA a step (second call; ms per grid step)")
    for name, t in rows.items():
        print(f"  {name:28s} {t:8.2f} s  {t / n * 1e3:8.3f} ms/step")
    ours = rows["ours, detect_races=True"]
    print(f"race detection costs ours {ours / rows['ours, detect_races=False']:.0f}x the run without it")
    if "JAX, detect_races=True" in rows:
        print(f"JAX / ours with race detection: {rows['JAX, detect_races=True'] / ours:.1f}x")


if __name__ == "__main__":
    main()
