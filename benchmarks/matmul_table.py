"""The table of ``pallas_gpu.ops.matmul``'s configurations, and its first calls.

``--measure FILE``: autotunes ``ops.matmul`` (its usual timing: every candidate of
``configs_for``, outputs checked, interleaved 25 ms batches) at each shape of ``SHAPES``
and writes the winners as JSON rows ``{"inputs", "out", "m", "n", "k", "config",
"times_ms"}``: the data of ``pallas_gpu/ops/matmul_table.json``, which ``matmul`` reads
on a first call instead of tuning (nearest shape of the same input class).

``--first-call``: the first call of ``ops.matmul`` at shapes not in the table, each in a
fresh process with an empty cache (so: trace, lowering, Triton/Gluon compile, launch),
beside XLA's first ``jnp.dot`` at the same shape in that process; then the steady-state
speed of the table's pick against the autotuned pick and cuBLAS (XLA) at a few shapes of
the table, in one interleaved measurement.

    python benchmarks/matmul_table.py --measure $OUT/matmul_table.json   # on the GPU
    python benchmarks/matmul_table.py --first-call                       # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

#: (m, n, k) per input class: square, skinny k, small m (decode-like), long k.
SHAPES = {
    "16-bit": [
        (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
        (2048, 2048, 1024), (4096, 4096, 1024), (8192, 8192, 1024), (16384, 16384, 1024),
        (256, 8192, 8192), (1024, 8192, 8192), (8192, 1024, 8192),
        (1024, 1024, 16384), (2048, 2048, 8192),
    ],
    "fp8": [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 1024), (1024, 8192, 8192)],
}  # fmt: skip
#: (inputs, out) dtypes tuned per class
DTYPES = {"16-bit": ("bfloat16", "bfloat16"), "fp8": ("float8_e4m3fn", "float32")}
#: first-call shapes, none in the table
NEW_SHAPES = [(6144, 6144, 6144), (3000, 5000, 2000)]


def _operands(m, n, k, dtype):
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(m * 7 + n * 3 + k))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    return a, b


def measure(path: str) -> None:
    import jax.numpy as jnp

    from pallas_gpu.ops import matmul as mm
    from pallas_gpu.ops._common import compute_capability

    rows = []
    cc = compute_capability()
    for cls, shapes in SHAPES.items():
        inputs, out = DTYPES[cls]
        for m, n, k in shapes:
            start = time.perf_counter()
            a, b = _operands(m, n, k, jnp.dtype(inputs))
            configs = mm.configs_for(m, n, k, a.dtype, jnp.dtype(out), cc)
            tuned = mm._tuned(configs)
            kw = dict(out_dtype=jnp.dtype(out), interpret=False, debug=False)
            best = tuned.best_index(a, b, **kw)
            times = tuned.times.get(tuned.tune_key(a, b, **kw), [])
            row = {
                "inputs": inputs, "out": out, "m": m, "n": n, "k": k, "config": configs[best].label(),
                "times_ms": {c.label(): round(t * 1e3, 4) for c, t in zip(configs, times) if t != float("inf")},
            }  # fmt: skip
            rows.append(row)
            tflops = 2 * m * n * k / (min(times) if times else float("nan")) / 1e12
            print(
                f"{cls} {m}x{n}x{k}: {row['config']} {tflops:.0f} TFLOP/s ({time.perf_counter() - start:.1f} s)"
            )
            with open(path, "w") as f:  # after every row: a cut-off run keeps what it measured
                json.dump(rows, f, indent=1)


_CHILD = r"""
import sys, time
t0 = time.perf_counter()
import jax, jax.numpy as jnp
from pallas_gpu.ops.matmul import matmul
m, n, k = map(int, sys.argv[1:4])
a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(jnp.bfloat16)
jax.block_until_ready((a, b))
t = time.perf_counter(); jax.block_until_ready(jnp.dot(a, b)); xla = time.perf_counter() - t
t = time.perf_counter(); out = jax.block_until_ready(matmul(a, b)); ours = time.perf_counter() - t
ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
print(f"{ours:.2f} {xla:.2f} {err:.1e}")
"""


def first_call() -> None:
    print("first call of ops.matmul (bf16) at a shape not in the table, fresh process and empty cache")
    print(f"{'shape':>18} {'ours s':>7} {'XLA s':>6} {'ours/XLA':>8} {'rel err':>8}")
    for m, n, k in NEW_SHAPES:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, PALLAS_GPU_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            res = subprocess.run(
                [sys.executable, "-c", _CHILD, str(m), str(n), str(k)],
                env=env,
                capture_output=True,
                text=True,
            )
        if res.returncode:
            print(f"{m}x{n}x{k}: failed\n{res.stderr[-2000:]}")
            continue
        ours, xla, err = res.stdout.split()[-3:]
        print(f"{f'{m}x{n}x{k}':>18} {ours:>7} {xla:>6} {float(ours) / float(xla):8.1f} {err:>8}")
    _table_against_tuned()


def _table_against_tuned() -> None:
    """The table's pick, the autotuned pick and XLA at a few shapes, interleaved."""
    sys.path.insert(0, os.path.dirname(__file__))
    import jax
    import jax.numpy as jnp
    from _timing import measure as timed

    from pallas_gpu.ops import matmul as mm

    print("\nsteady state, TFLOP/s: table pick / autotuned / XLA (cuBLAS)")
    for m, n, k in [(8192, 8192, 8192), (8192, 8192, 1024), (6144, 6144, 6144)]:
        a, b = _operands(m, n, k, jnp.bfloat16)
        table = jax.jit(lambda a, b: mm.matmul(a, b))
        tuned = jax.jit(lambda a, b: mm.matmul(a, b, autotune=True))
        xla = jax.jit(jnp.dot)
        ts = timed({name: (lambda f=f: f(a, b), jax.block_until_ready) for name, f in
                    [("table", table), ("tuned", tuned), ("xla", xla)]}, rounds=9)  # fmt: skip
        fl = {name: 2 * m * n * k / t / 1e12 for name, t in ts.items()}
        print(
            f"{m}x{n}x{k}: {fl['table']:.0f} / {fl['tuned']:.0f} / {fl['xla']:.0f}"
            f"  (table/tuned {fl['table'] / fl['tuned']:.3f}, table/XLA {fl['table'] / fl['xla']:.3f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--measure", metavar="FILE")
    p.add_argument("--first-call", action="store_true")
    args = p.parse_args()
    if args.measure:
        measure(args.measure)
    if args.first_call:
        first_call()
    if not (args.measure or args.first_call):
        p.error("say --measure FILE or --first-call")


if __name__ == "__main__":
    main()
