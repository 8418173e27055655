"""Flash attention as a library call: ``pallas_gpu.ops.attention.mha`` beside
JAX's ``jax.experimental.pallas.ops.gpu.attention.mha``, forward and
forward + backward, bf16, batch 4, 32 heads, seq 4096, head dim 128, causal
and not.

Both get the same candidate configurations (block sizes, warps, stages); each
column keeps its fastest, then the two run in interleaved rounds
(``_timing.measure``). Outputs and gradients are checked against plain JAX on
the last batch row and the first and last head (attention is independent per
batch row and head). FLOPs: forward 4·B·H·S²·D (half when causal); backward
2.5 times the forward, so forward + backward counts 3.5 times.

    python benchmarks/gpu_attention.py            # on the GPU
    python benchmarks/gpu_attention.py --small    # tiny shapes on the CPU (Triton's interpreter), no timing
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings

import jax
import jax.numpy as jnp
from _timing import measure

import pallas_gpu as plgpu
from pallas_gpu.ops import attention as ours

F32 = jnp.float32


def candidates(small: bool):
    """(label, BlockSizes kwargs, num_warps, num_stages); the first is JAX's default."""
    if small:
        return [("32/32", dict(block_q=32, block_k=32, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32,
                               block_kv_dq=32), None, 2)]  # fmt: skip
    default = dict(block_q=128, block_k=128, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    fa2 = dict(block_q=128, block_k=64, block_q_dkv=32, block_kv_dkv=128, block_q_dq=128, block_kv_dq=32)
    mid = dict(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    return [("default/8w/2s", default, None, 2), ("fa2/8w/2s", fa2, 8, 2), ("fa2/4w/3s", fa2, 4, 3),
            ("64s/8w/2s", mid, 8, 2), ("128x64/8w/3s", dict(block_q=128, block_k=64), 8, 3),
            ("128x128,fa2/8w/3s", {**fa2, "block_k": 128}, 8, 3)]  # fmt: skip


def reference(q, k, v, do, causal, scale):
    """Output and gradients of plain-JAX attention on the checked slice."""
    sl = lambda t: t[-1:, :, :: t.shape[2] - 1].astype(F32)  # noqa: E731
    f = functools.partial(ours.mha_reference, segment_ids=None, sm_scale=scale, causal=causal)
    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v), sl(q), sl(k), sl(v))
        return (out, *vjp(sl(do)))


def check(label, got, ref, tol=3e-2, grad_tol=5e-2) -> bool:
    """Output within ``tol``, gradients (bf16, summed over 4096 rows) within
    ``grad_tol``, relative plus absolute; a wrong kernel is off by O(1)."""
    sl = lambda t: t[-1:, :, :: t.shape[2] - 1].astype(F32)  # noqa: E731
    tols = [tol] + [grad_tol] * (len(got) - 1)
    errs = [float(jnp.max(jnp.abs(sl(g) - r) / (t + t * jnp.abs(r)))) for g, r, t in zip(got, ref, tols)]
    ok = max(errs) <= 1.0
    detail = ", ".join(f"{n} {e:.2f}" for n, e in zip(("out", "dq", "dk", "dv"), errs))
    print(f"  check {label:36s} {'PASS' if ok else 'FAIL'}  error / tolerance: {detail}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, Triton's interpreter, no timing")
    args = ap.parse_args()
    shape = (1, 128, 2, 32) if args.small else (4, 4096, 32, 128)
    B, S, H, D = shape
    scale = D**-0.5
    interpret = plgpu.InterpretParams() if args.small else False
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, shape, F32).astype(jnp.bfloat16) for kk in keys)
    impls = {"ours": (ours, interpret)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as theirs
        impls["JAX Pallas"] = (theirs, bool(args.small))
    except Exception as e:  # noqa: BLE001
        print(f"JAX Pallas mha unavailable: {e!r}")
    failed = []
    print(f"mha bf16 B{B} S{S} H{H} D{D}; jax {jax.__version__}, device {jax.devices()[0]}")
    for causal in (False, True):
        ref = reference(q, k, v, do, causal, scale)
        fwd_flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        for what, flops in (("forward", fwd_flops), ("forward+backward", 3.5 * fwd_flops)):
            print(f"\n[{what}, causal={causal}]")
            best = {}
            for col, (mod, interp) in impls.items():
                runners = {}
                for label, bs, warps, stages in candidates(args.small):
                    f = functools.partial(mod.mha, segment_ids=None, sm_scale=scale, causal=causal,
                                          block_sizes=mod.BlockSizes(**bs), num_warps=warps, num_stages=stages,
                                          interpret=interp)  # fmt: skip
                    if what == "forward":
                        run = jax.jit(lambda q, k, v, do, f=f: (f(q, k, v),))
                    else:
                        run = jax.jit(
                            lambda q, k, v, do, f=f: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(f, q, k, v))
                        )
                    try:
                        got = run(q, k, v, do)
                    except Exception as e:  # noqa: BLE001
                        print(f"  check {col} {label}: ERROR {type(e).__name__}: {str(e)[:300]}")
                        continue
                    if check(f"{col} {label}", got, ref[: len(got)]):
                        runners[label] = (functools.partial(run, q, k, v, do), jax.block_until_ready)
                    else:
                        failed.append(f"{what} causal={causal} {col} {label}")
                if args.small or not runners:
                    continue
                t = measure(runners, rounds=2, min_round_s=0.03)
                print(
                    f"  tune {col:11s} " + " | ".join(f"{lb} {flops / s / 1e12:.1f}" for lb, s in t.items())
                )
                label = min(t, key=t.get)
                best[col] = (label, runners[label])
            if len(best) < 1:
                continue
            t = measure({col: r for col, (_, r) in best.items()}, rounds=9, min_round_s=0.1)
            figs = {col: flops / t[col] / 1e12 for col in best}
            print("  " + " | ".join(f"{col} {figs[col]:.1f} TFLOP/s ({best[col][0]})" for col in best))
            if "JAX Pallas" in figs:
                ratio = figs["ours"] / figs["JAX Pallas"]
                print(
                    f"  ours/JAX Pallas = {ratio:.3f}x (target >= 1.00: {'MET' if ratio >= 1.0 else 'MISSED'})"
                )
    print(f"\nfailed checks: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
