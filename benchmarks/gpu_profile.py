"""One GPU benchmark workload (attention, decode, matmul, memory-bound ops) per process, for Nsight Compute (``ncu``) to profile
our kernel beside the library kernel it is compared with.

Each workload runs its function a few times (compile, autotune, warm-up) and
then once more between ``cuProfilerStart`` and ``cuProfilerStop``;
``scripts/gpu_check.sh profile`` runs every workload under
``ncu --profile-from-start off`` so that only the kernels of that last call
whose names match the workload's regex are profiled (SpeedOfLight, compute and memory workload, occupancy, launch stats,
warp stall reasons), and writes one report per workload to ``$OUT``.

    python benchmarks/gpu_profile.py --list     # workload: kernel-name regex
    python benchmarks/gpu_profile.py attn_fwd   # run one (on the GPU)
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

BF16, F32, FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
WARMUP = 4  # runs before the profiled one


def _attention(causal: bool, impl: str):
    from pallas_gpu.ops import attention

    shape = (4, 4096, 32, 128)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, F32).astype(BF16) for i in range(3))
    scale = shape[-1] ** -0.5
    if impl == "ours":
        f = jax.jit(functools.partial(attention.mha, segment_ids=None, sm_scale=scale, causal=causal))
    else:
        f = jax.jit(
            functools.partial(
                jax.nn.dot_product_attention, scale=scale, is_causal=causal, implementation="cudnn"
            )
        )
    return lambda: f(q, k, v)


def _matmul(m, k, n, dtype, impl: str):
    from pallas_gpu.ops import matmul as mm

    a = jax.random.normal(jax.random.key(0), (m, k), F32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), F32).astype(dtype)
    out = BF16 if dtype == BF16 else F32
    if impl == "ours":
        f = jax.jit(functools.partial(mm.matmul, preferred_element_type=out))
    else:
        f = jax.jit(functools.partial(jnp.dot, preferred_element_type=out))
    return lambda: f(a, b)


def _decode(impl: str):
    """Decode at the serving size of benchmarks/decode_attention.py (its Problem: B32,
    32 query heads over 8 KV heads, 8192 cached tokens, D128 bf16; paged: 16-token
    pages in a shuffled pool)."""
    from decode_attention import Problem

    from pallas_gpu.ops import decode_attention, paged_attention

    pb = Problem(32, 32, 8, 8192, 128, 16)
    if impl == "paged":
        f = jax.jit(paged_attention.paged_attention)
        return lambda: f(pb.q, pb.k_pages, pb.v_pages, pb.tables, pb.lengths)
    if impl == "ours":
        f = jax.jit(decode_attention.gqa)
    else:
        f = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0]
        )
    return lambda: f(pb.q, pb.k, pb.v)


# name -> (make the function, regex of the kernel to profile: ours are named by their
# pallas_call, the libraries' by what cuDNN / cuBLAS call theirs)
WORKLOADS = {
    "attn_fwd": (functools.partial(_attention, False, "ours"), "mha_forward"),
    "attn_fwd_cudnn": (functools.partial(_attention, False, "cudnn"), "sdpa|fmha|flash|cudnn"),
    "attn_fwd_causal": (functools.partial(_attention, True, "ours"), "mha_forward"),
    "matmul_bf16": (functools.partial(_matmul, 8192, 8192, 8192, BF16, "ours"), "matmul"),
    "matmul_bf16_cublas": (
        functools.partial(_matmul, 8192, 8192, 8192, BF16, "cublas"),
        "gemm|nvjet|xmma|cutlass",
    ),
    "matmul_4096": (functools.partial(_matmul, 4096, 4096, 4096, BF16, "ours"), "matmul"),
    "matmul_4096_cublas": (
        functools.partial(_matmul, 4096, 4096, 4096, BF16, "cublas"),
        "gemm|nvjet|xmma|cutlass",
    ),
    "matmul_skinny": (functools.partial(_matmul, 8192, 1024, 8192, BF16, "ours"), "matmul"),
    "matmul_fp8": (functools.partial(_matmul, 8192, 8192, 8192, FP8, "ours"), "matmul"),
    "matmul_fp8_cublas": (
        functools.partial(_matmul, 8192, 8192, 8192, FP8, "cublas"),
        "gemm|nvjet|xmma|cutlass",
    ),
    "matmul_skinny_cublas": (
        functools.partial(_matmul, 8192, 1024, 8192, BF16, "cublas"),
        "gemm|nvjet|xmma|cutlass",
    ),
    # decode: our split kernel and its combine kernel; cuDNN's every kernel of one call
    "decode_gqa": (functools.partial(_decode, "ours"), "gqa_decode|gqa_combine"),
    "decode_gqa_cudnn": (functools.partial(_decode, "cudnn"), "."),
    "decode_paged": (functools.partial(_decode, "paged"), "paged_attention"),
}


def _cuda_driver():
    """libcuda (for cuProfilerStart/Stop), or None where there is none."""
    import ctypes

    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def main(argv: list[str]) -> int:
    if not argv or argv[0] == "--list":
        for name, (_, regex) in WORKLOADS.items():
            print(f"{name} {regex}")
        return 0
    make, _ = WORKLOADS[argv[0]]
    run = make()
    for _ in range(WARMUP):
        jax.block_until_ready(run())
    driver = _cuda_driver()
    if driver is not None:
        driver.cuProfilerStart()
    jax.block_until_ready(run())  # the profiled call (ncu --profile-from-start off)
    if driver is not None:
        driver.cuProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
