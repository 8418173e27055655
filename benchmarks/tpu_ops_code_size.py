"""Straight-line tiles against loops in flash and splash attention: speed and first call, on a TPU.

A grid step of ``flash_attention`` (a pattern of splash attention's cells) runs as straight-line
code up to ``STRAIGHT_LINE_SCORES`` scores (``flash_attention._blocks``, ``splash_attention._common``)
and loops over its tiles past that. Unrolled, the scheduler overlaps one tile's matmuls with the
next one's softmax; looped, Mosaic compiles one tile's code instead of the step's. This script
puts the two side by side at the benchmark shapes (bf16): ``straight`` (no limit: every step
unrolled, the package's choice in the forward kernels) and ``loops`` (a limit of 1M scores in
every kernel; splash's loops take ``LOOP_SCORES`` scores an iteration), and JAX's op of the same name at its best blocks of the
sweeps in tpu_ops_attention.py / tpu_ops_splash.py: each one's first call (trace, lower, compile,
first run; caches cleared, a fresh ``jax.jit``) and steady time (``_timing.measure``, alternating
rounds), with the largest difference between our two variants' outputs.

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
import functools
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

# The two variants of our kernels: every step (pattern) unrolled, and the loops' limit of 1M scores
# (splash's loops taking ``LOOP_SCORES`` an iteration), in every kernel.
LOOP_LIMIT = 1024 * 1024


@contextlib.contextmanager
def straight_line_limit(family, limit):
    """Our ``family``'s kernels traced with at most ``limit`` straight-line scores (None: no limit)."""
    if family == "flash":
        saved = flash_blocks.STRAIGHT_LINE_SCORES
        flash_blocks.STRAIGHT_LINE_SCORES = limit
        try:
            yield
        finally:
            flash_blocks.STRAIGHT_LINE_SCORES = saved
    else:
        saved_limits = dict(splash_common.STRAIGHT_LINE_SCORES)
        splash_common.STRAIGHT_LINE_SCORES.update(fwd=limit, bwd=limit)
        try:
            yield
        finally:
            splash_common.STRAIGHT_LINE_SCORES.update(saved_limits)


def _jax_ops():
    """JAX's flash and splash modules, or (None, None) where this JAX has none."""
    try:
        from jax.experimental.pallas.ops.tpu import flash_attention as jfa
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as jsk
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as jsm
    except ImportError:
        return None, None
    return jfa, (jsk, jsm)


def _grad(f):
    return jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def flash_case(shape, causal, backward, side="ours"):
    """``make() -> jitted f`` of ours or (``side="jax"``) of JAX's op at its best blocks of
    benchmarks/tpu_ops_attention.py's sweeps on the v5e (forward 1024/2048/1024 without causal,
    else 1024/1024/512; backward blocks of 512)."""
    b, h, length, d = shape
    jfa, _ = _jax_ops()
    if side == "jax" and jfa is None:
        return None
    mod = fa if side == "ours" else jfa
    blocks = None
    if side == "jax":
        fwd_blocks = (1024, 2048, 1024) if not causal and not backward else (1024, 1024, 512)
        q, km, k = (min(x, length) for x in fwd_blocks)
        s = min(512, length)
        blocks = jfa.BlockSizes(
            block_q=q, block_k_major=km, block_k=k, block_b=1,
            block_q_major_dkv=s, block_k_major_dkv=s, block_k_dkv=s, block_q_dkv=s,
            block_k_major_dq=s, block_k_dq=s, block_q_dq=s,
        )  # fmt: skip

    def make():
        def fwd(q, k, v):
            return mod.flash_attention(q, k, v, causal=causal, sm_scale=d**-0.5, block_sizes=blocks)

        return jax.jit(_grad(fwd) if backward else fwd)

    return make


def splash_case(shape, causal, backward, interpret, side="ours"):
    """As ``flash_case``; JAX's splash at blocks of 1024 (its best in benchmarks/tpu_ops_splash.py)."""
    b, h, length, d = shape
    _, jsplash = _jax_ops()
    if side == "jax" and (jsplash is None or interpret):
        return None
    if side == "ours":
        kernel_mod, mask_mod, blocks = sa, sa, None
    else:
        kernel_mod, mask_mod = jsplash
        s = min(1024, length)
        blocks = kernel_mod.BlockSizes(
            block_q=s, block_kv=s, block_kv_compute=s, block_q_dkv=s, block_kv_dkv=s,
            block_kv_dkv_compute=s, block_q_dq=s, block_kv_dq=s,
        )  # fmt: skip
    one = mask_mod.CausalMask((length, length)) if causal else mask_mod.FullMask((length, length))
    mask = mask_mod.MultiHeadMask([one] * h)

    def make():
        kw = {"interpret": interpret} if side == "ours" else {}
        kernel = jax.vmap(kernel_mod.make_splash_mha_single_device(mask, block_sizes=blocks, **kw))
        return jax.jit(_grad(kernel) if backward else kernel)

    return make


def workloads(smoke, interpret):
    """{name: (family, shape, kv heads, causal, backward, case(side) -> make or None)}."""
    a = (1, 2, 512, 128) if smoke else (2, 16, 4096, 128)
    g = (1, 4, 1024, 128) if smoke else (1, 32, 8192, 128)
    gkv = 2 if smoke else 8
    out = {}
    for name, family, shape, kv, causal, backward in (
        ("flash fwd", "flash", a, a[1], False, False),
        ("flash fwd causal", "flash", a, a[1], True, False),
        ("flash fwd+bwd", "flash", a, a[1], False, True),
        ("flash fwd+bwd causal", "flash", a, a[1], True, True),
        ("splash fwd", "splash", a, a[1], False, False),
        ("splash fwd causal", "splash", a, a[1], True, False),
        ("splash fwd+bwd causal", "splash", a, a[1], True, True),
        ("splash GQA L8192 fwd causal", "splash", g, gkv, True, False),
    ):
        if family == "flash":
            case = functools.partial(flash_case, shape, causal, backward)
        else:
            case = functools.partial(splash_case, shape, causal, backward, interpret)
        out[name] = (family, shape, kv, causal, backward, case)
    return out


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
        f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; bf16; straight: every step unrolled, loops: at most 1M scores straight-line"
    )
    print(
        f"{'workload':28s} {'first call s: straight / loops / JAX':38s} {'TFLOP/s: straight / loops / JAX':33s}"
        f"{'loops/straight':>15s} {'loops/JAX':>10s} {'max |diff|':>10s}"
    )
    rows = []
    for name, (family, shape, kv, causal, backward, case) in workloads(args.smoke, interpret).items():
        if args.only and not any(o in name for o in args.only):
            continue
        arg_shapes = [shape, (*shape[:1], kv, *shape[2:]), (*shape[:1], kv, *shape[2:])]
        keys = jax.random.split(jax.random.key(0), 3)
        xs = [jax.random.normal(k_, s, jnp.float32).astype(jnp.bfloat16) for k_, s in zip(keys, arg_shapes)]
        calls, first, outs = {}, {}, {}
        variants = [("straight", None, case("ours")), ("loops", LOOP_LIMIT, case("ours"))]
        if not interpret and (jax_make := case("jax")) is not None:  # JAX's op: on a TPU
            variants.append(("jax", None, jax_make))
        with ctx():
            for variant, limit, make in variants:
                jax.clear_caches()  # each variant traced and compiled afresh (the op's inner jits too)
                with straight_line_limit(family, limit):
                    # compiled ahead of time: a later clear_caches cannot make it trace again
                    t = time.perf_counter()
                    f = make().lower(*xs).compile()
                    outs[variant] = jax.block_until_ready(f(*xs))
                    first[variant] = time.perf_counter() - t
                calls[variant] = (lambda f=f: f(*xs), jax.block_until_ready)
            times = measure(calls, rounds=args.rounds)
        diff = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(jax.tree.leaves(outs["straight"]), jax.tree.leaves(outs["loops"]))
        )
        st, lo, jx = times["straight"], times["loops"], times.get("jax")
        row = dict(
            workload=name,
            shape="x".join(map(str, shape)),
            first_straight_s=round(first["straight"], 2),
            first_loops_s=round(first["loops"], 2),
            first_jax_s=round(first["jax"], 2) if "jax" in first else "",
            ms_straight=round(st * 1e3, 3),
            ms_loops=round(lo * 1e3, 3),
            ms_jax=round(jx * 1e3, 3) if jx else "",
            tflops_straight=round(tflops(shape, causal, backward, st), 1),
            tflops_loops=round(tflops(shape, causal, backward, lo), 1),
            tflops_jax=round(tflops(shape, causal, backward, jx), 1) if jx else "",
            loops_over_straight=round(st / lo, 3),
            loops_over_jax=round(jx / lo, 3) if jx else "",
            max_abs_diff=diff,
        )
        rows.append(row)
        print(
            f"{name:28s} {row['first_straight_s']:>6.2f} / {row['first_loops_s']:<5.2f} / {row['first_jax_s']!s:6s}"
            f"{row['tflops_straight']:>8.1f} / {row['tflops_loops']:<6.1f} / {row['tflops_jax']!s:7s}"
            f"{row['loops_over_straight']:>8.3f} {row['loops_over_jax']!s:>8s} {diff:>10.2e}",
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
