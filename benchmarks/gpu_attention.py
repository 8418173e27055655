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
import os
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


# Launches timed by --tune, one kernel at a time: (block_q, block_k, num_warps, num_stages).
TUNE = {
    "fwd": [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3),
            (128, 128, 4, 2), (64, 128, 4, 3)],
    "dkv": [(bq, bk, w, 1) for bq, bk, w in [(16, 128, 4), (16, 128, 8), (32, 128, 4), (32, 128, 8), (64, 128, 8),
            (64, 128, 4), (32, 64, 4), (64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 128, 8), (16, 64, 4)]],
    "dq": [(128, 32, 4, 2), (128, 32, 4, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
           (128, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2),
           (64, 128, 4, 2), (128, 16, 4, 3)],
}  # fmt: skip
# --tune --extra: the neighbours of the launches picked from TUNE (the first of each is the default).
EXTRA = {
    "fwd": [(128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 4, 3), (64, 64, 4, 3), (256, 64, 8, 2), (128, 32, 4, 4)],
    "dkv": [(bq, bk, w, 1) for bq, bk, w in [(64, 64, 4), (64, 32, 4), (128, 64, 4), (32, 32, 4), (64, 64, 2),
            (128, 32, 4), (32, 64, 2)]],
    "dq": [(64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 8, 2), (64, 128, 8, 2), (128, 128, 8, 3), (32, 64, 4, 2),
           (128, 64, 8, 4), (64, 32, 2, 2)],
}  # fmt: skip
# Matrix products per kernel, in forward products (2 each): dk/dv recomputes q k^T and do v^T and
# forms dv and dk (4 products), dq recomputes both and forms dq (3).
KERNEL_FLOPS = {"fwd": 1.0, "dkv": 2.0, "dq": 1.5}


def kernel_fns(shape, causal, small):
    """{kernel: f(launch) -> jitted thunk} over fixed random inputs; the forward
    writes the residuals that the backward kernels read."""
    B, S, H, D = shape
    scale = D**-0.5
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(kk, shape, F32).astype(jnp.bfloat16) for kk in keys)
    it = plgpu.InterpretParams() if small else False
    fwd = lambda bq, bk, w, st: jax.jit(  # noqa: E731
        lambda q, k, v: ours._forward(q, k, v, None, scale, causal, bq, bk, w, st, it, False)
    )
    if small:
        out, lse = fwd(32, 32, 4, 1)(q, k, v)
    else:
        out, lse = ours.mha(q, k, v, None, sm_scale=scale, causal=causal, return_residuals=True)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(F32), do.astype(F32))
    lse2 = lse * ours.LOG2E
    dkv = lambda bq, bk, w, st: jax.jit(  # noqa: E731
        lambda q, k, v, do: ours._backward_dkv(
            q, k, v, None, do, lse2, delta, scale, causal, bq, bk, w, it, False
        )
    )
    dq = lambda bq, bk, w, st: jax.jit(  # noqa: E731
        lambda q, k, v, do: ours._backward_dq(q, k, v, None, do, lse2, delta, scale, causal, bq, bk, w, st, it,
                                              False)
    )  # fmt: skip
    return {
        "fwd": lambda *c: functools.partial(fwd(*c), q, k, v),
        "dkv": lambda *c: functools.partial(dkv(*c), q, k, v, do),
        "dq": lambda *c: functools.partial(dq(*c), q, k, v, do),
    }


def tune(args) -> int:
    """Times each kernel alone over ``TUNE``'s launches (causal; the forward
    also non-causal), checks every output against the first launch's, prints
    the fastest of each and the fwd+bwd figure they add up to."""
    shape = (1, 128, 2, 32) if args.small else (4, 4096, 32, args.head_dim)
    B, S, H, D = shape
    fwd_flops = 4 * B * H * S * S * D
    failed, best = [], {}
    print(f"tune mha kernels bf16 B{B} S{S} H{H} D{D}; jax {jax.__version__}, device {jax.devices()[0]}")
    for causal in (True, False):
        fns = kernel_fns(shape, causal, args.small)
        for kern, launches in (EXTRA if args.extra else TUNE).items():
            if not causal and kern != "fwd":
                continue
            if args.small:
                launches = [(32, 32, 4, 1), (16, 32, 4, 2)]
            flops = KERNEL_FLOPS[kern] * fwd_flops * (0.5 if causal else 1.0)
            runners, ref = {}, None
            for c in launches:
                try:
                    run = fns[kern](*c)
                    got = jax.tree.leaves(run())
                except Exception as e:  # noqa: BLE001
                    print(f"  {kern} {c}: ERROR {type(e).__name__}: {str(e)[:200]}")
                    continue
                got = [g.astype(F32) for g in got[:2] if g.ndim == 4]
                if ref is None:
                    ref = got
                err = max(float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) for g, r in zip(got, ref))
                if err > 2e-2:
                    print(
                        f"  {kern} {c}: FAIL, {err:.1e} off the first launch's output (relative to its max)"
                    )
                    failed.append(f"{kern} {c} causal={causal}")
                    continue
                runners[c] = (run, jax.block_until_ready)
            if args.small or not runners:
                continue
            t = measure(runners, rounds=3, min_round_s=0.03)
            order = sorted(t, key=t.get)
            print(f"[{kern}, causal={causal}] ms / TFLOP/s of the kernel's own products:")
            for c in order:
                print(f"  {kern} {c}: {t[c] * 1e3:.3f} ms  {flops / t[c] / 1e12:.1f}")
            best[kern, causal] = (order[0], t[order[0]])
    if not args.small:
        fwd_c = best[("fwd", True)][1]
        total = fwd_c + best[("dkv", True)][1] + best[("dq", True)][1]
        print("\nbest: " + ", ".join(f"{k}{'' if c else ' non-causal'} {v[0]}" for (k, c), v in best.items()))
        print(f"fwd+bwd causal from the best kernels (counted 3.5x fwd, delta left out): "
              f"{3.5 * 0.5 * fwd_flops / total / 1e12:.1f} TFLOP/s")  # fmt: skip
    print(f"failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def prewarm(args) -> int:
    """Compiles (without a GPU: PALLAS_GPU_COMPUTE_CAPABILITY) every kernel
    that --tune and the default rows run, at full size, filling the disk
    cache (PALLAS_GPU_CACHE_DIR) that a GPU run then reads."""
    import time

    os.environ.setdefault("PALLAS_GPU_COMPUTE_CAPABILITY", "90")
    shape = (4, 4096, 32, args.head_dim)
    spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    B, S, H, D = shape
    vec = jax.ShapeDtypeStruct((B, H, S), F32)
    n = 0
    for causal in (True, False):
        scale = D**-0.5
        todo = [
            (
                "default",
                jax.jit(
                    lambda q, k, v, do, c=causal: jax.vjp(
                        lambda q, k, v: ours.mha(q, k, v, None, sm_scale=scale, causal=c), q, k, v
                    )[1](do)
                ),
                [spec] * 4,
            )
        ]
        for kern, launches in (EXTRA if args.extra else TUNE).items():
            if not causal and kern != "fwd" and not args.all:
                continue
            for bq, bk, w, st in launches:
                if kern == "fwd":
                    f = lambda q, k, v, c=(bq, bk, w, st): ours._forward(
                        q, k, v, None, scale, causal, *c, False, False
                    )
                    todo.append((f"fwd {(bq, bk, w, st)}", jax.jit(f), [spec] * 3))
                elif kern == "dkv":
                    f = lambda q, k, v, do, l, d, c=(bq, bk, w): ours._backward_dkv(
                        q, k, v, None, do, l, d, scale, causal, *c, False, False
                    )
                    todo.append((f"dkv {(bq, bk, w)}", jax.jit(f), [spec] * 4 + [vec, vec]))
                else:
                    f = lambda q, k, v, do, l, d, c=(bq, bk, w, st): ours._backward_dq(
                        q, k, v, None, do, l, d, scale, causal, *c, False, False
                    )
                    todo.append((f"dq {(bq, bk, w, st)}", jax.jit(f), [spec] * 4 + [vec, vec]))
        for label, f, avals in todo:
            t = time.perf_counter()
            try:
                f.trace(*avals).lower(lowering_platforms=("cuda",))
                n += 1
                print(f"  compiled {label} causal={causal} in {time.perf_counter() - t:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {label} causal={causal}: ERROR {type(e).__name__}: {str(e)[:300]}")
    print(f"prewarmed {n} functions into {os.environ.get('PALLAS_GPU_CACHE_DIR', 'the default cache')}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, Triton's interpreter, no timing")
    ap.add_argument("--defaults-only", action="store_true", help="default arguments only (no tuned rows)")
    ap.add_argument("--tune", action="store_true", help="time each kernel alone over TUNE's launches")
    ap.add_argument("--prewarm", action="store_true", help="compile the kernels into the disk cache (no GPU)")
    ap.add_argument(
        "--all", action="store_true", help="with --prewarm: also the non-causal backward launches"
    )
    ap.add_argument(
        "--extra", action="store_true", help="with --tune/--prewarm: EXTRA's launches, not TUNE's"
    )
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if args.prewarm:
        return prewarm(args)
    if args.tune:
        return tune(args)
    shape = (1, 128, 2, 32) if args.small else (4, 4096, 32, args.head_dim)
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

            def runner(f, label):
                if what == "forward":
                    run = jax.jit(lambda q, k, v, do, f=f: (f(q, k, v),))
                else:
                    run = jax.jit(
                        lambda q, k, v, do, f=f: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(f, q, k, v))
                    )
                try:
                    got = run(q, k, v, do)
                except Exception as e:  # noqa: BLE001
                    print(f"  check {label}: ERROR {type(e).__name__}: {str(e)[:300]}")
                    return None
                if check(label, got, ref[: len(got)]):
                    return (functools.partial(run, q, k, v, do), jax.block_until_ready)
                failed.append(f"{what} causal={causal} {label}")
                return None

            final, labels = {}, {}
            for col, (mod, interp) in impls.items():
                # the defaults row: the function as a user calls it
                f = functools.partial(
                    mod.mha, segment_ids=None, sm_scale=scale, causal=causal, interpret=interp
                )
                r = runner(f, f"{col} default")
                if r is not None:
                    final[f"{col} (default)"] = r
                if args.defaults_only:
                    continue
                runners = {}
                for label, bs, warps, stages in candidates(args.small):
                    f = functools.partial(mod.mha, segment_ids=None, sm_scale=scale, causal=causal,
                                          block_sizes=mod.BlockSizes(**bs), num_warps=warps, num_stages=stages,
                                          interpret=interp)  # fmt: skip
                    r = runner(f, f"{col} {label}")
                    if r is not None:
                        runners[label] = r
                if args.small or not runners:
                    continue
                t = measure(runners, rounds=2, min_round_s=0.03)
                print(
                    f"  tune {col:11s} " + " | ".join(f"{lb} {flops / s / 1e12:.1f}" for lb, s in t.items())
                )
                label = min(t, key=t.get)
                final[f"{col} (tuned)"], labels[f"{col} (tuned)"] = runners[label], label
            if not args.small:
                cudnn = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=causal,
                                          implementation="cudnn")  # fmt: skip
                r = runner(cudnn, "cuDNN")
                if r is not None:
                    final["cuDNN"] = r
            if args.small or not final:
                continue
            t = measure(final, rounds=7, min_round_s=0.1)
            figs = {col: flops / t[col] / 1e12 for col in final}
            print("  " + " | ".join(f"{c} {figs[c]:.1f}" + (f" ({labels[c]})" if c in labels else "")
                                    for c in figs) + " TFLOP/s")  # fmt: skip
            for mine in [c for c in figs if c.startswith("ours")]:
                parts = [
                    f"{ref_} {figs[mine] / figs[ref_]:.3f}x" for ref_ in figs if not ref_.startswith("ours")
                ]
                print(f"  {mine} / " + " | ".join(parts))
    print(f"\nfailed checks: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
