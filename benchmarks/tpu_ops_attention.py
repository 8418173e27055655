"""Flash attention on a TPU: ``pallas_tpu.ops.flash_attention`` against JAX's Pallas op and XLA.

Each row times, at one shape and one workload (forward, or forward and backward; causal or not):
ours (default blocks), JAX's ``jax.experimental.pallas.ops.tpu.flash_attention`` at its default
blocks and at the best of a few block sizes, and XLA's ``jax.nn.dot_product_attention(
implementation="xla")``. Arguments are made on the chip with ``jax.random`` (bf16); a time is the
median of 10 calls after a warm-up, each call waited for (``block_until_ready``). TFLOP/s count
4*B*H*Lq*Lk*D for the forward pass and 3.5 times that for forward and backward (the backward pass
as 2.5 forwards, FlashAttention-2's accounting); causal rows count half. Every row also checks
our output (and gradients) against XLA's.

    python benchmarks/tpu_ops_attention.py            # the table (a TPU)
    python benchmarks/tpu_ops_attention.py --sweep    # also ours over block sizes, per workload
    python benchmarks/tpu_ops_attention.py --smoke    # a tiny shape in interpret mode (a CPU)
    python benchmarks/tpu_ops_attention.py --only fwd --shapes 2x16x4096x128

Writes results/tpu_ops_attention[_<shapes>].csv and ..._sweep.csv (copied to $OUT when set). The
whole run takes longer than one 10-minute chip command: run it a shape or two at a time (``--shapes``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import pallas_tpu as pltpu
from pallas_tpu.ops import flash_attention as fa

PEAK_V5E = 197.0  # bf16 TFLOP/s
SHAPES = ("2x16x4096x128", "1x16x8192x128", "2x8x4096x256")
WORKLOADS = ("fwd", "fwd_causal", "fwd_bwd", "fwd_bwd_causal")
# JAX's op at a few blocks (block_q, block_k_major, block_k; the backward's all 512): its best
# counts. 512s are the blocks of the JAX figures; q1024/k1024 its best causal.
JAX_BLOCKS = ((512, 512, 512), (1024, 1024, 512), (1024, 2048, 1024))
# Ours over: forward (block_q, block_k_major, block_k); backward (block_k_major_dkv,
# block_q_major_dkv, block_k_dkv, block_q_dkv).
SWEEP_FWD = {
    False: (
        (1024, 4096, 1024),
        (512, 4096, 1024),
        (1024, 4096, 512),
        (512, 4096, 512),
        (1024, 2048, 1024),
        (2048, 4096, 1024),
    ),
    True: (
        (1024, 2048, 1024),
        (1024, 1024, 1024),
        (512, 1024, 512),
        (512, 2048, 512),
        (1024, 4096, 1024),
        (2048, 2048, 1024),
    ),
}
SWEEP_BWD = {
    False: (
        (1024, 4096, 1024, 1024),
        (1024, 4096, 512, 1024),
        (512, 4096, 512, 1024),
        (1024, 4096, 1024, 512),
        (1024, 2048, 1024, 1024),
    ),
    True: (
        (1024, 2048, 1024, 1024),
        (1024, 1024, 1024, 1024),
        (512, 1024, 512, 512),
        (512, 2048, 512, 1024),
        (512, 1024, 512, 1024),
    ),
}


def time_call(f, args, calls=10, first=None):
    """Median seconds of ``calls`` calls of ``f(*args)`` after one warm-up, each waited for;
    ``first`` (a list) gets the warm-up's seconds: the first call (trace, lower, compile, run)."""
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    if first is not None:
        first.append(time.perf_counter() - start)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def our_blocks(shape, causal, fwd=None, bwd=None):
    b, h, length, d = shape
    base = fa.tuned_block_sizes(b, h, length, length, d, causal=causal)
    kw = {}
    if fwd:
        kw.update(block_q=fwd[0], block_k_major=fwd[1], block_k=fwd[2])
    if bwd:
        kw.update(block_k_major_dkv=bwd[0], block_q_major_dkv=bwd[1], block_k_dkv=bwd[2], block_q_dkv=bwd[3])
    return dataclasses.replace(base, **kw)


def jax_blocks(jfa, fwd, length):
    q, km, k = fwd
    b = min(512, length)
    return jfa.BlockSizes(
        block_q=q, block_k_major=km, block_k=k, block_b=1,
        block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b,
        block_k_major_dq=b, block_k_dq=b, block_q_dq=b,
    )  # fmt: skip


def timed(op, backward):
    """A jitted ``(q, k, v, do) -> out`` or ``-> (dq, dk, dv)`` (forward included) of ``op(q, k, v)``."""
    if not backward:
        return jax.jit(lambda q, k, v, do: op(q, k, v))
    return jax.jit(lambda q, k, v, do: jax.vjp(op, q, k, v)[1](do))


def xla_attention(causal, scale):
    """XLA's attention; it takes ``[batch, seq, heads, head_dim]`` (``run_row`` makes its arguments so)."""
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="xla"
    )


def max_error(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(a, b))


def run_row(shape, workload, jfa, interpret, blocks_list):
    b, h, length, d = shape
    causal = workload.endswith("causal")
    backward = workload.startswith("fwd_bwd")
    scale = 1.0 / d**0.5
    keys = jax.random.split(jax.random.key(0), 4)
    make = jax.jit(lambda key, s: jax.random.normal(key, s, jnp.bfloat16), static_argnums=1)
    q, k, v, do = (make(key, shape) for key in keys)
    to_bthd = jax.jit(lambda x: jnp.swapaxes(x, 1, 2))
    args_x = tuple(to_bthd(x) for x in (q, k, v, do))  # XLA's layout, made before timing

    def ours_op(blocks=None):
        return lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=blocks)

    def jax_op(blocks=None):
        return lambda q, k, v: jfa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=blocks)

    flops = 4 * b * h * length * length * d * (3.5 if backward else 1.0) / (2 if causal else 1)
    tf = lambda s: flops / s / 1e12  # noqa: E731
    ours_ctx = (
        pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if interpret else contextlib.nullcontext()
    )
    jax_ctx = contextlib.nullcontext()
    if interpret:
        from jax.experimental.pallas import tpu as jax_pltpu

        jax_ctx = jax_pltpu.force_tpu_interpret_mode(jax_pltpu.InterpretParams())
    row = dict(shape="x".join(map(str, shape)), workload=workload)

    def attempt(what, f):
        """``f()``, or NaN where it fails (an XLA that runs out of memory, a block JAX's op refuses)."""
        try:
            return f()
        except Exception as e:
            print(f"  {what}: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}", flush=True)
            return float("nan")

    with ours_ctx:
        ours_f = timed(ours_op(), backward)
        got = ours_f(q, k, v, do)
        got = (got,) if not backward else got
        row["ours_ms"] = time_call(ours_f, (q, k, v, do)) * 1e3
    xla_f = timed(xla_attention(causal, scale), backward)

    def check():
        want = xla_f(*args_x)
        want = tuple(jnp.swapaxes(x, 1, 2) for x in ((want,) if not backward else want))
        return max_error(got, want)

    row["err_vs_xla"] = f"{attempt('XLA (for the check)', check):.3g}"
    row["xla_ms"] = attempt("XLA", lambda: time_call(xla_f, args_x) * 1e3)
    with jax_ctx:
        row["jax_default_ms"] = attempt(
            "JAX's op at its defaults", lambda: time_call(timed(jax_op(), backward), (q, k, v, do)) * 1e3
        )
        best = None
        for blocks in blocks_list:
            if any(x > length for x in blocks):
                continue
            ms = attempt(
                f"JAX's op at blocks {blocks}",
                lambda blocks=blocks: (
                    time_call(timed(jax_op(jax_blocks(jfa, blocks, length)), backward), (q, k, v, do)) * 1e3
                ),
            )
            if ms == ms and (best is None or ms < best[0]):
                best = (ms, blocks)
    row["jax_best_ms"], row["jax_best_blocks"] = best if best else (float("nan"), "")
    row["jax_best_blocks"] = "/".join(map(str, row["jax_best_blocks"]))
    for impl in ("ours", "jax_best", "jax_default", "xla"):
        row[f"{impl}_tflops"] = tf(row[f"{impl}_ms"] / 1e3)
    row["ours_vs_jax_best"] = row["jax_best_ms"] / row["ours_ms"]
    row["ours_vs_jax_default"] = row["jax_default_ms"] / row["ours_ms"]
    row["ours_vs_xla"] = row["xla_ms"] / row["ours_ms"]
    row["ours_of_v5e_peak"] = row["ours_tflops"] / PEAK_V5E
    return row


SMOKE_SWEEP_FWD = ((128, 256, 128), (256, 256, 128))
SMOKE_SWEEP_BWD = ((128, 256, 128, 128), (256, 256, 128, 256))


def sweep(shape, workload, interpret):
    b, h, length, d = shape
    causal = workload.endswith("causal")
    backward = workload.startswith("fwd_bwd")
    scale = 1.0 / d**0.5
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16))(key) for key in keys)
    flops = 4 * b * h * length * length * d * (3.5 if backward else 1.0) / (2 if causal else 1)

    def ctx():  # a fresh one each time: a generator's context manager runs once
        return (
            pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if interpret else contextlib.nullcontext()
        )

    rows = []
    fwd_list = SMOKE_SWEEP_FWD if interpret else SWEEP_FWD[causal]
    bwd_list = SMOKE_SWEEP_BWD if interpret else SWEEP_BWD[causal]
    configs = [(f, None) for f in fwd_list] if not backward else [(None, bw) for bw in bwd_list]
    for fwd, bwd in configs:
        if any(x > length for x in (fwd or bwd)):
            continue
        blocks = our_blocks(shape, causal, fwd, bwd)
        op = lambda q, k, v, blocks=blocks: fa.flash_attention(
            q, k, v, causal=causal, sm_scale=scale, block_sizes=blocks
        )  # noqa: E731
        first: list[float] = []
        try:
            with ctx():
                ms = time_call(timed(op, backward), (q, k, v, do), first=first) * 1e3
        except Exception as e:
            print(f"  ours at {fwd or bwd}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        label = ("fwd q/kv/k " if fwd else "bwd kv/q/tk/tq ") + "/".join(map(str, fwd or bwd))
        rows.append(
            dict(
                shape="x".join(map(str, shape)),
                workload=workload,
                blocks=label,
                ms=ms,
                tflops=flops / ms / 1e9,
                first_call_s=first[0],
            )
        )
        print(
            f"  sweep {workload:15s} {label:28s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s"
            f"  first call {first[0]:.2f} s",
            flush=True,
        )
    return rows


def print_table(rows):
    head = (
        "| workload | shape | ours TFLOP/s (ms) | JAX best (blocks) | JAX default | XLA | ours/JAX best "
        "| ours/JAX default | ours/XLA | ours of v5e peak | max err vs XLA |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['shape']} | {r['ours_tflops']:.1f} ({r['ours_ms']:.3f}) "
            f"| {r['jax_best_tflops']:.1f} ({r['jax_best_blocks']}) | {r['jax_default_tflops']:.1f} "
            f"| {r['xla_tflops']:.1f} | {r['ours_vs_jax_best']:.2f}x | {r['ours_vs_jax_default']:.2f}x "
            f"| {r['ours_vs_xla']:.2f}x | {100 * r['ours_of_v5e_peak']:.0f} % | {r['err_vs_xla']} |"
        )


def write_csv(name, rows):
    if not rows:
        return
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.csv"
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fields)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    if os.environ.get("OUT"):
        shutil.copy(path, os.environ["OUT"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape in TPU interpret mode (no TPU needed)")
    ap.add_argument("--sweep", action="store_true", help="also time ours over several block sizes")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="BxHxLxD,... (default: %(default)s)")
    ap.add_argument("--only", default="", help="comma-separated workloads of " + ", ".join(WORKLOADS))
    args = ap.parse_args(argv)
    from jax.experimental.pallas.ops.tpu import flash_attention as jfa

    on_tpu = jax.devices()[0].platform == "tpu"
    if not on_tpu and not args.smoke:
        sys.exit("no TPU here: run on the chip, or pass --smoke for a tiny shape in interpret mode")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    workloads = [w for w in (args.only.split(",") if args.only else WORKLOADS) if w]
    blocks_list = JAX_BLOCKS
    if args.smoke:
        shapes, blocks_list = [(1, 2, 256, 128)], ((128, 128, 128), (128, 256, 128))
    print(
        f"{datetime.date.today()}  jax {jax.__version__}  device {jax.devices()[0].device_kind}"
        + ("  (interpret mode, smoke)" if args.smoke else ""),
        flush=True,
    )
    rows, sweep_rows = [], []
    for shape in shapes:
        for workload in workloads:
            if not args.sweep_only:
                try:
                    row = run_row(shape, workload, jfa, args.smoke, blocks_list)
                except Exception as e:  # keep the other rows
                    print(f"{workload} {shape}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    continue
                rows.append(row)
                print(
                    f"{workload:15s} {row['shape']:15s} ours {row['ours_tflops']:6.1f} TFLOP/s  JAX best "
                    f"{row['jax_best_tflops']:6.1f}  XLA {row['xla_tflops']:6.1f}  ours/JAX best "
                    f"{row['ours_vs_jax_best']:.2f}x  err {row['err_vs_xla']}",
                    flush=True,
                )
            if (args.sweep or args.sweep_only) and shape == shapes[0]:
                sweep_rows += sweep((1, 2, 256, 128) if args.smoke else shape, workload, args.smoke)
    print()
    print_table(rows)
    if not args.smoke:  # a smoke run leaves the chip's results alone
        name = "tpu_ops_attention" + (
            "" if args.shapes == ",".join(SHAPES) else "_" + args.shapes.replace(",", "_")
        )
        write_csv(name, rows)
        write_csv(name + "_sweep", sweep_rows)


if __name__ == "__main__":
    main()
