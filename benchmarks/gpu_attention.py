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

Then a sweep (default arguments only: ours, JAX's and cuDNN) over seq
1024-16384 at 16384 tokens (batch 16-1), 32 heads, head dim 128, writes
``benchmarks/results/attention.csv`` and, if matplotlib imports,
``attention.png`` (also copied to ``$OUT`` when set).

    python benchmarks/gpu_attention.py               # on the GPU
    python benchmarks/gpu_attention.py --sweep-only  # on the GPU: the sweep alone
    python benchmarks/gpu_attention.py --small       # tiny shapes on the CPU (Triton's interpreter), no timing
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import warnings

import jax
import jax.numpy as jnp
from _timing import Panel, measure, write_results

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


def checked_runner(f, backward, inputs, ref, label):
    """Jits ``f(q, k, v)`` (the forward, or with ``backward`` the forward and
    ``jax.vjp``'s gradients for the cotangent ``do``), runs it once on
    ``inputs`` = (q, k, v, do) and checks it against ``ref``. Returns
    (runner for ``measure`` or None, whether the check failed); an exception
    is printed and gives (None, False)."""
    if backward:
        run = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(f, q, k, v)))
    else:
        run = jax.jit(lambda q, k, v, do: (f(q, k, v),))
    try:
        got = run(*inputs)
    except Exception as e:  # noqa: BLE001
        print(f"  check {label}: ERROR {type(e).__name__}: {str(e)[:300]}")
        return None, False
    if check(label, got, ref[: len(got)]):
        return (functools.partial(run, *inputs), jax.block_until_ready), False
    return None, True


def sweep_shapes(small, head_dim=128):
    """[batch, seq, heads, dim] of the sweep: 16384 tokens at seq 1k-16k (--small: two tiny CPU shapes)."""
    if small:
        return [(1, s, 2, 32) for s in (128, 256)]
    return [(16384 // s, s, 32, head_dim) for s in (1024, 2048, 4096, 8192, 16384)]


SWEEP_FIELDS = ["seq", "batch", "causal", "pass", "impl", "ms", "tflops"]


def sweep(args, theirs) -> list[str]:
    """Each implementation at its default arguments over ``sweep_shapes``,
    causal and not, forward and forward + backward: checked (the last batch
    row, first and last head), then timed in 3 interleaved rounds; writes
    results/attention.csv and .png. --small: ours only, checks, no timing, no
    files. Returns the failed checks (and ours' errors)."""
    it = plgpu.InterpretParams() if args.small else False
    impls = {"ours": functools.partial(ours.mha, segment_ids=None, interpret=it)}
    if not args.small:
        if theirs is not None:
            impls["JAX Pallas"] = functools.partial(theirs.mha, segment_ids=None)
        impls["cuDNN"] = lambda q, k, v, sm_scale, causal: jax.nn.dot_product_attention(
            q, k, v, scale=sm_scale, is_causal=causal, implementation="cudnn"
        )
    rows, failed = [], []
    print(f"\nsweep (default arguments): {', '.join(impls)}")
    for shape in sweep_shapes(args.small, args.head_dim):
        B, S, H, D = shape
        scale = D**-0.5
        try:
            keys = jax.random.split(jax.random.key(S), 4)
            inputs = tuple(jax.random.normal(kk, shape, F32).astype(jnp.bfloat16) for kk in keys)
            for causal in (False, True):
                ref = reference(*inputs, causal, scale)
                fwd_flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
                for what, flops in (("fwd", fwd_flops), ("fwd+bwd", 3.5 * fwd_flops)):
                    cands, tag = {}, f"B{B} S{S} {what}{' causal' if causal else ''}"
                    for impl, f in impls.items():
                        label = f"sweep {impl} {tag}"
                        fn = functools.partial(f, sm_scale=scale, causal=causal)
                        r, bad = checked_runner(fn, what == "fwd+bwd", inputs, ref, label)
                        if bad or (r is None and impl == "ours"):
                            failed.append(label)
                        if r is not None:
                            cands[impl] = r
                    if args.small or not cands:
                        continue
                    try:
                        t = measure(cands, rounds=3)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {tag}: timing ERROR {type(e).__name__}: {str(e)[:300]}")
                        continue
                    for impl, sec in t.items():
                        rows.append({"seq": S, "batch": B, "causal": causal, "pass": what, "impl": impl,
                                     "ms": f"{sec * 1e3:.4f}", "tflops": f"{flops / sec / 1e12:.2f}"})  # fmt: skip
                    figs = " | ".join(f"{c} {flops / sec / 1e12:.1f}" for c, sec in t.items())
                    print(f"  {tag}: {figs} TFLOP/s", flush=True)
                    del cands
                del ref
        except Exception as e:  # noqa: BLE001
            print(f"  sweep B{B} S{S}: ERROR {type(e).__name__}: {str(e)[:300]}")
            failed.append(f"sweep B{B} S{S}")
        inputs = None
        gc.collect()
    if rows:
        panels = [[Panel(f"{'forward' if p == 'fwd' else 'forward + backward'}, {'causal' if c else 'non-causal'}",
                         "seq", "tflops", {"pass": p, "causal": c}, ylabel="TFLOP/s",
                         xlabel=f"sequence length (batch x seq = {B * S}; H{H} D{D} bf16)") for c in (False, True)]
                  for p in ("fwd", "fwd+bwd")]  # fmt: skip
        write_results("attention", rows, SWEEP_FIELDS, panels)
    return failed


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
            q, k, v, None, do, lse2, delta, scale, causal, bq, bk, w, st, it, False
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
    that --tune, the default rows and the sweep (ours' defaults, forward and
    forward + backward at every sweep shape) run, at full size, filling the
    disk cache (PALLAS_GPU_CACHE_DIR) that a GPU run then reads."""
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
        for sweep_shape in sweep_shapes(False, args.head_dim):  # the sweep's defaults, forward and fwd+bwd
            sspec = jax.ShapeDtypeStruct(sweep_shape, jnp.bfloat16)
            Bs, Ss = sweep_shape[:2]
            f = lambda q, k, v, c=causal: ours.mha(q, k, v, None, sm_scale=scale, causal=c)
            todo.append((f"sweep fwd B{Bs} S{Ss}", jax.jit(f), [sspec] * 3))
            if sweep_shape != shape:  # the main shape's fwd+bwd is "default" above
                g = lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)
                todo.append((f"sweep fwd+bwd B{Bs} S{Ss}", jax.jit(g), [sspec] * 4))
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
                    f = lambda q, k, v, do, l, d, c=(bq, bk, w, st): ours._backward_dkv(
                        q, k, v, None, do, l, d, scale, causal, *c, False, False
                    )
                    todo.append((f"dkv {(bq, bk, w, st)}", jax.jit(f), [spec] * 4 + [vec, vec]))
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


def main_rows(args, theirs) -> list[str]:
    """The [4, 4096, 32, head dim] rows: each side's defaults and (without
    --defaults-only) its best candidate, and cuDNN. Returns the failed checks."""
    shape = (1, 128, 2, 32) if args.small else (4, 4096, 32, args.head_dim)
    B, S, H, D = shape
    scale = D**-0.5
    interpret = plgpu.InterpretParams() if args.small else False
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, shape, F32).astype(jnp.bfloat16) for kk in keys)
    impls = {"ours": (ours, interpret)}
    if theirs is not None:
        impls["JAX Pallas"] = (theirs, bool(args.small))
    failed = []
    print(f"mha bf16 B{B} S{S} H{H} D{D}; jax {jax.__version__}, device {jax.devices()[0]}")
    for causal in (False, True):
        ref = reference(q, k, v, do, causal, scale)
        fwd_flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        for what, flops in (("forward", fwd_flops), ("forward+backward", 3.5 * fwd_flops)):
            print(f"\n[{what}, causal={causal}]")

            def runner(f, label):
                r, bad = checked_runner(f, what == "forward+backward", (q, k, v, do), ref, label)
                if bad:
                    failed.append(f"{what} causal={causal} {label}")
                return r

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
    return failed


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
    ap.add_argument("--no-sweep", action="store_true", help="only the [4, 4096, 32, head dim] rows")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep over seq 1k-16k")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if args.prewarm:
        return prewarm(args)
    if args.tune:
        return tune(args)
    theirs = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as theirs
    except Exception as e:  # noqa: BLE001
        print(f"JAX Pallas mha unavailable: {e!r}")
    failed = [] if args.sweep_only else main_rows(args, theirs)
    if not args.no_sweep:
        failed += sweep(args, theirs)
    print(f"\nfailed checks: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
