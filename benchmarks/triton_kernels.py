"""Kernel speed on the GPU: each example kernel through jax_triton.triton_call
vs the same @triton.jit kernel launched from torch, plus XLA, in one run.

Prints one line per kernel with times, throughput and the ratio
(torch time / triton_call time; >= 0.98 is the target). Needs torch.
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import jax
import jax.numpy as jnp
import numpy as np
import torch
import triton
import triton_add
import triton_flash_attention as fa
import triton_matmul
import triton_softmax


def bench(fn, sync, n=50, reps=5):
    """Median over `reps` of the mean wall time of `n` back-to-back calls (s)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times))


def jax_bench(f, *args, n=50):
    out = [None]

    def run():
        out[0] = f(*args)

    return bench(run, lambda: jax.block_until_ready(out[0]), n)


def torch_bench(run, n=50):
    return bench(run, torch.cuda.synchronize, n)


def report(name, unit, work, t_jt, t_torch, t_xla):
    print(
        f"{name:28s} triton_call {t_jt * 1e3:8.3f} ms ({work / t_jt / 1e12:7.2f} {unit})  "
        f"torch-launch {t_torch * 1e3:8.3f} ms ({work / t_torch / 1e12:7.2f})  "
        f"xla {t_xla * 1e3:8.3f} ms ({work / t_xla / 1e12:7.2f})  "
        f"ratio torch/triton_call = {t_torch / t_jt:.3f}  xla/triton_call = {t_xla / t_jt:.3f}",
        flush=True,
    )


def to_torch(x):
    return torch.from_dlpack(x)


def main():
    # vector add f32 2^28
    n = 1 << 28
    x = jax.random.normal(jax.random.key(0), (n,))
    y = jax.random.normal(jax.random.key(1), (n,))
    add = jax.jit(lambda a, b: triton_add.add(a, b, block_size=1024))
    np.testing.assert_array_equal(np.asarray(add(x, y)[:4096]), np.asarray((x + y)[:4096]))
    tx, ty = to_torch(x), to_torch(y)
    to = torch.empty_like(tx)
    grid = (triton.cdiv(n, 1024),)
    t_torch = torch_bench(lambda: triton_add.add_kernel[grid](tx, ty, n, to, BLOCK_SIZE=1024))
    report(
        "add f32 2^28",
        "TB/s",
        3 * 4 * n,
        jax_bench(add, x, y),
        t_torch,
        jax_bench(jax.jit(jnp.add), x, y),
    )

    # softmax f32 16384 x 8192
    s = jax.random.normal(jax.random.key(2), (16384, 8192))
    sm = jax.jit(triton_softmax.softmax)
    np.testing.assert_allclose(np.asarray(sm(s)[:8]), np.asarray(jax.nn.softmax(s[:8], -1)), atol=1e-6)
    ts = to_torch(s)
    tso = torch.empty_like(ts)
    t_torch = torch_bench(
        lambda: triton_softmax.softmax_kernel[(16384,)](ts, 8192, tso, BLOCK_SIZE=8192, num_warps=8)
    )
    xla = jax.jit(lambda v: jax.nn.softmax(v, -1))
    report(
        "softmax f32 16384x8192",
        "TB/s",
        2 * 4 * s.size,
        jax_bench(sm, s),
        t_torch,
        jax_bench(xla, s),
    )

    # matmul bf16 8192^3 with triton.autotune (runtime tunes on first call)
    m = 8192
    a = jax.random.normal(jax.random.key(3), (m, m)).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(4), (m, m)).astype(jnp.bfloat16)
    mm = jax.jit(triton_matmul.matmul)
    got = np.asarray(mm(a, b)[:64].astype(jnp.float32))
    ref = np.asarray(jnp.dot(a[:64], b, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=0.5)
    ta, tb = to_torch(a), to_torch(b)
    tc = torch.empty_like(ta)

    def torch_mm():
        triton_matmul.matmul_kernel[
            lambda META: (triton.cdiv(m, META["BLOCK_M"]) * triton.cdiv(m, META["BLOCK_N"]),)
        ](ta, tb, tc, m, m, m, m, 1, m, 1, m, 1)

    t_torch = torch_bench(torch_mm, n=10)
    xla = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16))
    report(
        "matmul bf16 8192^3",
        "TFLOP/s",
        2 * m**3,
        jax_bench(mm, a, b, n=10),
        t_torch,
        jax_bench(xla, a, b, n=10),
    )

    # flash attention fwd bf16 B4 H32 S4096 D128
    B, H, S, D = 4, 32, 4096, 128
    q, k, v = (jax.random.normal(jax.random.key(5 + i), (B, H, S, D)).astype(jnp.bfloat16) for i in range(3))
    for causal in (False, True):
        att = jax.jit(lambda q, k, v, c=causal: fa.attention(q, k, v, causal=c))
        got = np.asarray(att(q[:1, :2], k[:1, :2], v[:1, :2]).astype(jnp.float32))
        ref = np.asarray(fa.reference(q[:1, :2], k[:1, :2], v[:1, :2], causal))
        np.testing.assert_allclose(got, ref, atol=2e-2)
        tq, tk, tv = to_torch(q), to_torch(k), to_torch(v)
        tout = torch.empty_like(tq)
        g = (S // 128, B * H)

        def torch_att(c=causal):
            fa.attention_fwd_kernel[g](tq, tk, tv, tout, D**-0.5, S, HEAD_DIM=D, BLOCK_M=128, BLOCK_N=64,
                                       CAUSAL=c, num_warps=8, num_stages=3)  # fmt: skip

        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        cudnn = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
            q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), is_causal=c,
            implementation="cudnn"))  # fmt: skip
        report(f"attention fwd causal={causal}", "TFLOP/s", flops, jax_bench(att, q, k, v, n=10),
               torch_bench(torch_att, n=10), jax_bench(cudnn, q, k, v, n=10))  # fmt: skip
    print("autotune records (tune_key[:12], device, chosen, ms per config):")
    import jax_kernel_runtime as jkr

    for key, device, chosen, times in jkr.tune_records():
        print(f"  {key[:12]} dev{device} chose {chosen} times {[round(t, 3) for t in times]}")


if __name__ == "__main__":
    main()
