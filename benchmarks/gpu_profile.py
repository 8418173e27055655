"""One workload of issue 13 per process, for Nsight Compute (``ncu``) to profile
our kernel beside the library kernel it is compared with.

Each workload runs its function a few times (compile, autotune, warm-up) and
then once more; ``scripts/gpu_check.sh profile`` runs every workload under
``ncu --launch-skip`` so that only that last launch of the named kernel is
profiled (SpeedOfLight, compute and memory workload, occupancy, launch stats,
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
WARMUP = 4  # runs before the profiled one (ncu --launch-skip counts the kernel's launches)


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
    "matmul_skinny": (functools.partial(_matmul, 8192, 1024, 8192, BF16, "ours"), "matmul"),
    "matmul_fp8": (functools.partial(_matmul, 8192, 8192, 8192, FP8, "ours"), "matmul"),
    "matmul_fp8_cublas": (
        functools.partial(_matmul, 8192, 8192, 8192, FP8, "cublas"),
        "gemm|nvjet|xmma|cutlass",
    ),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] == "--list":
        for name, (_, regex) in WORKLOADS.items():
            print(f"{name} {regex}")
        return 0
    make, _ = WORKLOADS[argv[0]]
    run = make()
    for _ in range(WARMUP):
        jax.block_until_ready(run())
    jax.block_until_ready(run())  # the profiled launch
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
