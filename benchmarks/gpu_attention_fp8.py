"""fp8 attention forward: ``pallas_gpu.ops.attention_fp8.mha_fp8``
(e4m3 q, k, v with per-tensor scales, bf16 output) beside our bf16 ``mha`` forward
(default arguments) and cuDNN's bf16 forward (``jax.nn.dot_product_attention``), in
one process, B4 H32 S4096 D128, causal and not. Target: fp8 >= 1.5x our bf16.

Each fp8 launch of ``LAUNCHES`` is timed (``_timing.measure``: interleaved rounds,
medians); the default launch's row and the best one are printed, with the fp8
output's relative error against f32 attention of the dequantized inputs and
against the unquantized f32 inputs (on one batch row and two heads). The
transpose of v (XLA, before the kernel) is timed as part of ``mha_fp8``; the
``vT`` rows pass v already transposed.

    python benchmarks/gpu_attention_fp8.py          # on the GPU
    python benchmarks/gpu_attention_fp8.py --small  # tiny shapes on the CPU (no timing)
    python benchmarks/gpu_attention_fp8.py --prewarm  # no GPU: compile every launch for sm_90
                                                      # into PALLAS_GPU_CACHE_DIR (carry it)
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import measure

from pallas_gpu.ops import _attention_sm90, attention
from pallas_gpu.ops import attention_fp8 as af

# (block_q, block_k, num_warps, num_stages)
LAUNCHES = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 4, 3), (64, 128, 4, 3),
            (128, 256, 8, 2), (256, 128, 8, 2)]  # fmt: skip


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def gluon(nbuf, scale, causal, *args):
    """``mha_fp8`` through the Gluon kernel with ``nbuf`` K/V slots (read when traced)."""
    _attention_sm90.FP8_NUM_BUFFERS = nbuf
    return af.mha_fp8(*args, sm_scale=scale, causal=causal, implementation="gluon")


def prewarm() -> int:
    """Compiles every kernel the GPU run launches (for sm_90, without a GPU) into the
    disk cache, so that the run on the lent GPU spends its minutes timing."""
    os.environ.setdefault("PALLAS_GPU_COMPUTE_CAPABILITY", "90")
    B, S, H, D = 4, 4096, 32, 128
    f8 = jax.ShapeDtypeStruct((B, S, H, D), af.FP8)
    f8t = jax.ShapeDtypeStruct((B, H, D, S), af.FP8)
    bf = jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16)
    sc = jax.ShapeDtypeStruct((), jnp.float32)
    scale, n = D**-0.5, 0
    for causal in (False, True):
        todo = {}
        for bq, bk, w, st in LAUNCHES:
            kw = dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
            todo[f"fp8 {(bq, bk, w, st)}"] = (functools.partial(af.mha_fp8, **kw), (f8, f8, f8))
        todo["fp8 pallas"] = (functools.partial(af.mha_fp8, implementation="pallas"), (f8, f8, f8))
        todo["fp8 default, vT"] = (functools.partial(af.mha_fp8, v_transposed=True), (f8, f8, f8t))
        for nbuf in (3, 4, 5):
            todo[f"fp8 gluon {nbuf} bufs"] = (functools.partial(gluon, nbuf), (f8, f8, f8))
        for label, (fn, avals) in todo.items():
            kw = {} if "gluon" in label else {"sm_scale": scale, "causal": causal}
            f = functools.partial(fn, scale, causal) if "gluon" in label else functools.partial(fn, **kw)
            t = time.perf_counter()
            try:
                jax.jit(f).trace(*avals, sc, sc, sc).lower(lowering_platforms=("cuda",))
                n += 1
                print(f"  compiled {label} causal={causal} in {time.perf_counter() - t:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - reported, the others go on
                print(f"  {label} causal={causal}: ERROR {type(e).__name__}: {str(e)[:300]}")
        bf16 = functools.partial(attention.mha, segment_ids=None, sm_scale=scale, causal=causal)
        jax.jit(bf16).trace(bf, bf, bf).lower(lowering_platforms=("cuda",))
        n += 1
    print(f"prewarmed {n} functions into {os.environ.get('PALLAS_GPU_CACHE_DIR', 'the default cache')}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument(
        "--prewarm", action="store_true", help="compile every launch into the disk cache (no GPU)"
    )
    args = ap.parse_args()
    if args.prewarm:
        return prewarm()
    B, S, H, D = (1, 256, 2, 64) if args.small else (4, 4096, 32, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.float32) for kk in keys)
    (q8, qs), (k8, ks), (v8, vs) = af.quantize(q), af.quantize(k), af.quantize(v)
    vt8 = jnp.transpose(v8, (0, 2, 3, 1))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    scale = D**-0.5
    interp = {"interpret": True} if args.small else {}
    sl = lambda t: t[-1:, :, :: H - 1]  # noqa: E731
    print(f"fp8 attention forward, B{B} H{H} S{S} D{D}; TFLOP/s (4·B·H·S²·D, half when causal)")
    for causal in (False, True):
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        fp8 = {}
        for bq, bk, w, st in LAUNCHES[: 1 if args.small else None]:
            kw = dict(block_q=min(bq, S), block_k=min(bk, S), num_warps=w, num_stages=st)
            fp8[f"fp8 {bq}x{bk}/{w}w/{st}s"] = jax.jit(functools.partial(
                af.mha_fp8, sm_scale=scale, causal=causal, **(interp or kw)))  # fmt: skip
        fp8["fp8 default"] = jax.jit(functools.partial(af.mha_fp8, sm_scale=scale, causal=causal, **interp))
        if not args.small:  # the fp8 form of mha's Hopper Gluon kernel, and the Pallas forward at its default
            fp8["fp8 pallas"] = jax.jit(
                functools.partial(af.mha_fp8, sm_scale=scale, causal=causal, implementation="pallas")
            )
            for nbuf in (3, 4, 5):
                fp8[f"fp8 gluon {nbuf} bufs"] = jax.jit(functools.partial(gluon, nbuf, scale, causal))
        fp8_vt = jax.jit(
            functools.partial(af.mha_fp8, sm_scale=scale, causal=causal, v_transposed=True, **interp)
        )
        bf16 = jax.jit(functools.partial(attention.mha, segment_ids=None, sm_scale=scale, causal=causal,
                                         **interp))  # fmt: skip
        cands = {name: (functools.partial(f, q8, k8, v8, qs, ks, vs), jax.block_until_ready)
                 for name, f in fp8.items()}  # fmt: skip
        cands["fp8 default, vT"] = (functools.partial(fp8_vt, q8, k8, vt8, qs, ks, vs), jax.block_until_ready)
        cands["ours bf16 mha"] = (functools.partial(bf16, qb, kb, vb), jax.block_until_ready)
        if not args.small:
            cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=causal,
                                              implementation="cudnn"))  # fmt: skip
            cands["cuDNN bf16"] = (functools.partial(cudnn, qb, kb, vb), jax.block_until_ready)
        # Correctness of every fp8 candidate first.
        out = cands["fp8 default"][0]()
        ref_deq = af.mha_fp8_reference(sl(q8), sl(k8), sl(v8), qs, ks, vs, sm_scale=scale, causal=causal,
                                       out_dtype=jnp.float32)  # fmt: skip
        ref_f32 = attention.mha_reference(sl(q), sl(k), sl(v), None, sm_scale=scale, causal=causal)
        ref_bf16 = cands["ours bf16 mha"][0]()
        print(f"causal={causal}: fp8 error vs f32 of the dequantized inputs {rel_err(sl(out), ref_deq):.4f}, "
              f"vs the unquantized f32 inputs {rel_err(sl(out), ref_f32):.4f} "
              f"(our bf16 mha vs f32: {rel_err(sl(ref_bf16), ref_f32):.4f})")  # fmt: skip
        for name, (run, _) in cands.items():
            if name.startswith("fp8 ") and "vT" not in name:
                err = rel_err(sl(run()), ref_deq)
                print(
                    f"  {name}: error vs f32 of the dequantized inputs {err:.4f}"
                    + ("  WRONG" if err > 0.05 else "")
                )
        if args.small:
            continue
        times = measure(cands, rounds=5)
        tf = {name: flops / t / 1e12 for name, t in times.items()}
        base = tf["ours bf16 mha"]
        best = max((n for n in tf if n.startswith("fp8 ") and "vT" not in n), key=tf.get)
        for name in sorted(tf, key=tf.get, reverse=True):
            mark = " <- best fp8 launch" if name == best else ""
            print(f"  {name:24s} {tf[name]:7.1f} TFLOP/s  {tf[name] / base:5.2f}x our bf16{mark}")
        print(f"  => fp8 default / our bf16 = {tf['fp8 default'] / base:.3f}; best fp8 / our bf16 = "
              f"{tf[best] / base:.3f}; our bf16 / cuDNN bf16 = {base / tf['cuDNN bf16']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
