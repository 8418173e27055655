"""Does the length of the autotuner's timed batches change ``ops.matmul``'s pick? (GPU)

``plgpu.autotune`` times each candidate in rounds of back-to-back calls; this
script ranks ``ops.matmul``'s candidates at the sizes of ``gpu_matmul.py``
three ways in one run: the tuner's timing with short batches (2 ms, 30 rounds),
with long batches (``--long`` ms, 10 rounds), the benchmark harness
(``_timing.measure``: rounds of >= 0.1 s, 7 rounds), then short batches again (do
two passes agree?), and prints each ranking's fastest four with TFLOP/s. A GPU that runs at a higher clock for a burst than
under a sustained load can rank the candidates differently in bursts.

    python benchmarks/matmul_tuning.py            # on the GPU
    python benchmarks/matmul_tuning.py --long 50  # long batches of 50 ms
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from _timing import measure

from pallas_gpu._src.compile.autotune import interleaved_times
from pallas_gpu.ops import matmul as mm
from pallas_gpu.ops._common import compute_capability

BF16, F32 = jnp.bfloat16, jnp.float32
SHAPES = [(4096, 4096, 4096), (8192, 1024, 8192), (8192, 8192, 8192)]


def ranking(name, labels, times, flops):
    ranked = sorted(zip(times, labels))[:4]
    cells = ", ".join(f"{lbl} {flops / t / 1e12:.1f}" for t, lbl in ranked)
    print(f"  {name:28s} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=float, default=25.0, help="ms per batch of the long-batch ranking")
    args = ap.parse_args()
    if not any(d.platform == "gpu" for d in jax.devices()):
        print("matmul_tuning: needs a GPU")
        return
    cc = compute_capability()
    for m, k, n in SHAPES:
        key = jax.random.key(m + k + n)
        a = jax.random.normal(key, (m, k), F32).astype(BF16)
        b = jax.random.normal(jax.random.fold_in(key, 1), (k, n), F32).astype(BF16)
        configs = mm.configs_for(m, n, k, BF16, BF16, cc)
        labels = [c.label() for c in configs]
        fns = [jax.jit(functools.partial(mm.matmul, config=c)) for c in configs]
        flops = 2 * m * n * k
        print(f"bf16 {m}x{k}x{n}: TFLOP/s, fastest four")
        short, _ = interleaved_times(fns, (a, b), warmup=3, repeats=30, min_batch_s=2e-3)
        ranking("tuner, 2 ms batches", labels, short, flops)
        long, _ = interleaved_times(fns, (a, b), warmup=3, repeats=10, min_batch_s=args.long * 1e-3)
        ranking(f"tuner, {args.long:g} ms batches", labels, long, flops)
        harness = measure(
            {lbl: (functools.partial(f, a, b), jax.block_until_ready) for lbl, f in zip(labels, fns)},
            rounds=7,
            min_round_s=0.1,
        )
        ranking("harness, 0.1 s rounds", list(harness), list(harness.values()), flops)
        short2, _ = interleaved_times(fns, (a, b), warmup=3, repeats=30, min_batch_s=2e-3)
        ranking("tuner, 2 ms batches (again)", labels, short2, flops)


if __name__ == "__main__":
    main()
