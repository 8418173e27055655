"""Decode attention at the serving size of ``decode_attention.py`` (B32, 32
query heads over 8 KV heads, 8192 cached tokens, D128 bf16; paged: 16-token
pages), timed over the launch parameters that set how the work fills the GPU:
``k_splits`` (programs per (batch row, KV head)), ``block_k`` /
``pages_per_compute_block`` and ``num_stages``, beside cuDNN through
``jax.nn.dot_product_attention`` in the same run. This is the measurement
behind the defaults of ``ops.decode_attention`` and ``ops.paged_attention``
(decode at cuDNN's speed): Nsight Compute shows cuDNN's kernel as one wave of
256 programs (one per (row, KV head), two per SM), ours as 5.2 waves.

    python benchmarks/decode_splits.py             # on the GPU
    python benchmarks/decode_splits.py --wide      # no split; block sizes x stages x warps 4 and 8
    python benchmarks/decode_splits.py --prewarm   # no GPU: compile every candidate into
                                                   # PALLAS_GPU_CACHE_DIR for a GPU run to read (with --wide: those)
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from _timing import measure
from decode_attention import Problem

from pallas_gpu.ops import decode_attention as dec
from pallas_gpu.ops import paged_attention as paged

F32, BF16 = jnp.float32, jnp.bfloat16
SPLITS = (1, 2, 3, 4, 6, 8, 16)
GQA = ((64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 3, 4))  # block_k, num_stages, num_warps
PAGED = ((4, 3, 4), (8, 2, 4), (8, 3, 4))  # pages_per_compute_block, num_stages, num_warps
# --wide: no split, a wider grid of block sizes, stages and warps.
WIDE_GQA = tuple((bk, st, w) for bk in (64, 128) for st in (2, 3, 4) for w in (4, 8) if bk * st <= 384)
WIDE_PAGED = tuple((pp, st, w) for pp in (4, 8) for st in (2, 3, 4) for w in (4, 8) if pp * st <= 24)


def candidates(pb: Problem, wide: bool = False):
    """{label: (function, args)}: the defaults of `gqa` and `paged_attention`, then each at every launch choice."""
    q, k, v = pb.q, pb.k, pb.v
    qs = (q.astype(F32) * pb.scale).astype(BF16)
    P = (qs, pb.k_pages, pb.v_pages, pb.tables, pb.lengths)
    out = {"gqa default": (jax.jit(dec.gqa), (q, k, v)), "paged default": (jax.jit(paged.paged_attention), P)}
    for ks in (1,) if wide else SPLITS:
        for bk, st, w in WIDE_GQA if wide else GQA:
            f = jax.jit(
                lambda q, k, v, ks=ks, bk=bk, st=st, w=w: dec.gqa(
                    q, k, v, k_splits=ks, block_k=bk, num_stages=st, num_warps=w
                )
            )
            out[f"gqa ks{ks} bk{bk} {st}s {w}w"] = (f, (q, k, v))
        for pp, st, w in WIDE_PAGED if wide else PAGED:
            f = jax.jit(
                lambda *a, ks=ks, pp=pp, st=st, w=w: paged.paged_attention(
                    *a, k_splits=ks, pages_per_compute_block=pp, num_stages=st, num_warps=w
                )
            )
            out[f"paged ks{ks} pp{pp} {st}s {w}w"] = (f, P)
    return out


def main(argv) -> int:
    if "--prewarm" in argv:
        os.environ.setdefault("PALLAS_GPU_COMPUTE_CAPABILITY", "90")
        pb = Problem(32, 32, 8, 8192, 128, 16)
        for f, args in candidates(pb, "--wide" in argv).values():
            f.trace(*args).lower(lowering_platforms=("cuda",))
        print(f"prewarmed into {os.environ.get('PALLAS_GPU_CACHE_DIR', 'the default cache')}")
        return 0
    pb = Problem(32, 32, 8, 8192, 128, 16)
    ref = pb.reference()
    s = pb.scale
    cudnn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, scale=s, implementation="cudnn")[:, 0]
    )
    runners = {"cuDNN": (lambda: cudnn(pb.q, pb.k, pb.v), jax.block_until_ready)}
    for label, (f, args) in candidates(pb, "--wide" in argv).items():
        err = float(jnp.max(jnp.abs(f(*args).astype(F32) - ref)))
        if err > 2e-2:
            print(f"{label}: FAIL max_abs_err={err:.2e}")
            continue
        runners[label] = (lambda f=f, args=args: f(*args), jax.block_until_ready)
    times = measure(runners, rounds=3, min_round_s=0.03)
    base = times["cuDNN"]
    for label, t in sorted(times.items(), key=lambda kv: kv[1]):
        print(
            f"{label:24s} {t * 1e3:.4f} ms  {pb.kv_bytes / t / 1e12:.2f} TB/s  {base / t:.3f}x cuDNN's speed"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
