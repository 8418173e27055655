"""Straight-line tiles against loops in flash and splash attention: speed and first call, on a TPU.

A grid step of ``flash_attention`` (a pattern of splash attention's cells) runs as straight-line
code up to ``STRAIGHT_LINE_SCORES`` scores (``flash_attention._blocks``, ``splash_attention._common``)
and loops over its tiles past that. Unrolled, the scheduler overlaps one tile's matmuls with the
next one's softmax; looped, Mosaic compiles one tile's code instead of the step's. This script
puts the two side by side at the benchmark shapes (bf16): ``straight`` (no limit: every step
unrolled, as before the limit) and ``loops`` (the package's limit), each workload's first call
(trace, lower, compile, first run; a fresh ``jax.jit``) and its steady time (``_timing.measure``,
alternating rounds), with the largest difference between the two variants' outputs.

    python benchmarks/tpu_ops_code_size.py            # a TPU
    python benchmarks/tpu_ops_code_size.py --smoke    # tiny shapes, TPU interpret mode (a CPU)
    python benchmarks/tpu_ops_code_size.py --only splash

TFLOP/s count 4*B*H*Lq*Lk*D for a forward pass and 3.5 times that for forward and backward;
causal rows count half. Writes results/tpu_ops_code_size.csv (copied to $OUT when set).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import measure  # noqa: E402

import pallas_tpu as pltpu  # noqa: E402
from pallas_tpu.ops import flash_attention as fa  # noqa: E402
from pallas_tpu.ops import splash_attention as sa  # noqa: E402
from pallas_tpu.ops.flash_attention import _blocks as flash_blocks  # noqa: E402
from pallas_tpu.ops.splash_attention import _common as splash_common  # noqa: E402

UNLIMITED = 1 << 62
LIMITS = {
    "flash": (flash_blocks, flash_blocks.STRAIGHT_LINE_SCORES),
    "splash": (splash_common, splash_common.STRAIGHT_LINE_SCORES),
}


def flash_case(shape, causal, backward):
    b, h, length, d = shape

    def make():
        def fwd(q, k, v):
            return fa.flash_attention(q, k, v, causal=causal, sm_scale=d**-0.5)

        if not backward:
            return jax.jit(fwd)
        return jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))

    return make, [(b, h, length, d)] * 3


def splash_case(shape, kv_heads, causal, backward, interpret):
    b, h, length, d = shape
    mask_one = sa.CausalMask((length, length)) if causal else sa.FullMask((length, length))
    mask = sa.MultiHeadMask([mask_one] * h)

    def make():
        kernel = jax.vmap(sa.make_splash_mha_single_device(mask, interpret=interpret))
        if not backward:
            return jax.jit(kernel)
        return jax.jit(jax.grad(lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))

    return make, [(b, h, length, d), (b, kv_heads, length, d), (b, kv_heads, length, d)]


def workloads(smoke, interpret):
    a = (1, 2, 512, 128) if smoke else (2, 16, 4096, 128)
    g = (1, 4, 1024, 128) if smoke else (1, 32, 8192, 128)
    gkv = 2 if smoke else 8
    return {
        "flash fwd": ("flash", a, False, False, flash_case(a, False, False)),
        "flash fwd causal": ("flash", a, True, False, flash_case(a, True, False)),
        "flash fwd+bwd": ("flash", a, False, True, flash_case(a, False, True)),
        "flash fwd+bwd causal": ("flash", a, True, True, flash_case(a, True, True)),
        "splash fwd": ("splash", a, False, False, splash_case(a, a[1], False, False, interpret)),
        "splash fwd causal": ("splash", a, True, False, splash_case(a, a[1], True, False, interpret)),
        "splash fwd+bwd causal": ("splash", a, True, True, splash_case(a, a[1], True, True, interpret)),
        "splash GQA L8192 fwd causal": (
            "splash",
            g,
            True,
            False,
            splash_case(g, gkv, True, False, interpret),
        ),
    }


def tflops(shape, causal, backward, seconds):
    b, h, length, d = shape
    flops = 4 * b * h * length * length * d * (3.5 if backward else 1.0) / (2 if causal else 1)
    return flops / seconds / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in TPU interpret mode (no TPU needed)")
    ap.add_argument("--only", action="append", help="workloads whose name contains this (repeatable)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    interpret = args.smoke

    def ctx():
        return (
            pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if interpret else contextlib.nullcontext()
        )

    print(
        f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; bf16; straight: every step unrolled, loops: the package's limit"
    )
    print(
        f"{'workload':30s} {'first call s straight / loops':>30s} {'ms straight / loops':>22s} {'TFLOP/s straight / loops':>26s} {'loops/straight':>15s} {'max |diff|':>10s}"
    )
    rows = []
    for name, (family, shape, causal, backward, (make, arg_shapes)) in workloads(
        args.smoke, interpret
    ).items():
        if args.only and not any(o in name for o in args.only):
            continue
        keys = jax.random.split(jax.random.key(0), len(arg_shapes))
        xs = [jax.random.normal(k_, s, jnp.float32).astype(jnp.bfloat16) for k_, s in zip(keys, arg_shapes)]
        module, limit = LIMITS[family]
        calls, first, outs = {}, {}, {}
        with ctx():
            for variant, value in (("straight", UNLIMITED), ("loops", limit)):
                module.STRAIGHT_LINE_SCORES = value
                try:
                    f = make()
                    t = time.perf_counter()
                    outs[variant] = jax.block_until_ready(f(*xs))
                    first[variant] = time.perf_counter() - t
                finally:
                    module.STRAIGHT_LINE_SCORES = limit
                calls[variant] = (lambda f=f: f(*xs), jax.block_until_ready)
            times = measure(calls, rounds=args.rounds)
        diff = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(jax.tree.leaves(outs["straight"]), jax.tree.leaves(outs["loops"]))
        )
        st, lo = times["straight"], times["loops"]
        row = dict(
            workload=name,
            shape="x".join(map(str, shape)),
            first_straight_s=round(first["straight"], 2),
            first_loops_s=round(first["loops"], 2),
            ms_straight=round(st * 1e3, 3),
            ms_loops=round(lo * 1e3, 3),
            tflops_straight=round(tflops(shape, causal, backward, st), 1),
            tflops_loops=round(tflops(shape, causal, backward, lo), 1),
            speed_loops_over_straight=round(st / lo, 3),
            max_abs_diff=diff,
        )
        rows.append(row)
        print(
            f"{name:30s} {row['first_straight_s']:>14.2f} / {row['first_loops_s']:<13.2f} "
            f"{row['ms_straight']:>10.3f} / {row['ms_loops']:<9.3f} {row['tflops_straight']:>12.1f} / "
            f"{row['tflops_loops']:<11.1f} {row['speed_loops_over_straight']:>15.3f} {diff:>10.2e}",
            flush=True,
        )
    if args.smoke or not rows:
        return
    out = Path(__file__).resolve().parent / "results" / "tpu_ops_code_size.csv"
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if os.environ.get("OUT"):
        shutil.copy(out, os.environ["OUT"])


if __name__ == "__main__":
    main()
