"""pallas_gpu vs JAX's own Pallas (Triton backend) vs XLA on the GPU.

Prints median times and ratios measured in the same run. Sizes are reduced
from issue 4's targets to fit a short device slot; pass --full for those.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas as pl
import pallas_gpu as plgpu


def bench(f, *args, iters=20):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def jax_pallas():
    try:
        from jax.experimental import pallas as jpl
        from jax.experimental.pallas import triton as jplt

        return jpl, jplt
    except Exception as e:  # noqa: BLE001
        print("JAX Pallas unavailable:", e)
        return None, None


def add_kernels(pl_mod, cp):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    def make(n, block=4096):
        return jax.jit(
            pl_mod.pallas_call(
                kernel,
                jax.ShapeDtypeStruct((n,), jnp.float32),
                grid=(n // block,),
                in_specs=[pl_mod.BlockSpec((block,), lambda i: (i,))] * 2,
                out_specs=pl_mod.BlockSpec((block,), lambda i: (i,)),
                compiler_params=cp,
            )
        )

    return make


def softmax_kernels(pl_mod, cp):
    def kernel(x_ref, o_ref):
        v = x_ref[...]
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    def make(m, n):
        return jax.jit(
            pl_mod.pallas_call(
                kernel,
                jax.ShapeDtypeStruct((m, n), jnp.float32),
                grid=(m,),
                in_specs=[pl_mod.BlockSpec((1, n), lambda i: (i, 0))],
                out_specs=pl_mod.BlockSpec((1, n), lambda i: (i, 0)),
                compiler_params=cp,
            )
        )

    return make


def matmul_kernels(pl_mod, cp, bm=128, bn=128, bk=64):
    def kernel(a_ref, b_ref, o_ref):
        k = a_ref.shape[1]

        def body(kk, acc):
            s = pl_mod.multiple_of(kk * bk, bk)
            return acc + jnp.dot(
                a_ref[:, pl_mod.ds(s, bk)], b_ref[pl_mod.ds(s, bk), :], preferred_element_type=jnp.float32
            )

        o_ref[...] = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), jnp.float32)).astype(o_ref.dtype)

    def make(m, k, n):
        return jax.jit(
            pl_mod.pallas_call(
                kernel,
                jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                grid=(m // bm, n // bn),
                in_specs=[
                    pl_mod.BlockSpec((bm, k), lambda i, j: (i, 0)),
                    pl_mod.BlockSpec((k, bn), lambda i, j: (0, j)),
                ],
                out_specs=pl_mod.BlockSpec((bm, bn), lambda i, j: (i, j)),
                compiler_params=cp,
            )
        )

    return make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    jpl, jplt = jax_pallas()
    ours = plgpu.CompilerParams(num_warps=4, num_stages=3)
    theirs = jplt.CompilerParams(num_warps=4, num_stages=3) if jplt else None
    key = jax.random.key(0)

    n = 2**28 if args.full else 2**26
    x = jax.random.normal(key, (n,), jnp.float32)
    y = x + 1
    t_copy = bench(jax.jit(lambda a: a * 1.0001), x)
    t_ours = bench(add_kernels(pl, ours)(n), x, y)
    t_xla = bench(jax.jit(jnp.add), x, y)
    line = f"add f32 n={n}: ours {3 * 4 * n / t_ours / 1e12:.2f} TB/s, XLA {3 * 4 * n / t_xla / 1e12:.2f} TB/s, copy {2 * 4 * n / t_copy / 1e12:.2f} TB/s"
    if jpl:
        t_j = bench(add_kernels(jpl, theirs)(n), x, y)
        line += f", JAX Pallas {3 * 4 * n / t_j / 1e12:.2f} TB/s; ours/JAX-Pallas = {t_j / t_ours:.3f}x"
    print(line, flush=True)

    m, c = (16384, 8192) if args.full else (4096, 8192)
    s = jax.random.normal(key, (m, c), jnp.float32)
    t_ours = bench(softmax_kernels(pl, ours)(m, c), s)
    t_xla = bench(jax.jit(lambda a: jax.nn.softmax(a, axis=1)), s)
    line = f"softmax f32 {m}x{c}: ours {2 * 4 * m * c / t_ours / 1e12:.2f} TB/s, XLA {2 * 4 * m * c / t_xla / 1e12:.2f} TB/s"
    if jpl:
        t_j = bench(softmax_kernels(jpl, theirs)(m, c), s)
        line += f", JAX Pallas {2 * 4 * m * c / t_j / 1e12:.2f} TB/s; ours/JAX-Pallas = {t_j / t_ours:.3f}x"
    print(line, flush=True)

    d = 8192 if args.full else 4096
    a = jax.random.normal(key, (d, d), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (d, d), jnp.bfloat16)
    mm_cp = plgpu.CompilerParams(num_warps=8, num_stages=3)
    t_ours = bench(matmul_kernels(pl, mm_cp)(d, d, d), a, b, iters=10)
    t_xla = bench(jax.jit(jnp.dot), a, b, iters=10)
    fl = 2 * d**3
    line = f"matmul bf16 {d}^3 (128x128x64, 8 warps, 3 stages): ours {fl / t_ours / 1e12:.0f} TFLOP/s, XLA {fl / t_xla / 1e12:.0f} TFLOP/s"
    if jpl:
        t_j = bench(
            matmul_kernels(jpl, jplt.CompilerParams(num_warps=8, num_stages=3))(d, d, d), a, b, iters=10
        )
        line += f", JAX Pallas {fl / t_j / 1e12:.0f} TFLOP/s; ours/JAX-Pallas = {t_j / t_ours:.3f}x"
    print(line, flush=True)

    # First call (trace + lower + compile) of a small kernel, fresh kernel object.
    def small(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    z = jnp.ones((1024,), jnp.float32)
    t = time.perf_counter()
    jax.block_until_ready(pl.pallas_call(small, jax.ShapeDtypeStruct(z.shape, z.dtype))(z))
    print(
        f"first call of a small kernel: {1e3 * (time.perf_counter() - t):.0f} ms (Triton's own disk cache may be warm)"
    )


if __name__ == "__main__":
    main()
