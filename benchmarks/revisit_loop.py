"""Revisited output blocks on the GPU: a k-loop matmul written TPU-style.

The kernel accumulates into its output block along the grid's k axis (the
block's index map ignores k; the block is zeroed under ``pl.when(k == 0)``).
pallas-gpu runs such an axis as a loop inside one Triton program, keeping the
block on chip between steps. The same kernel (written once, as a function of
the ``pl`` module) runs under

* ours: ``pallas`` + ``pallas_gpu`` (compiled by Triton, launched by
  jax_kernel_runtime);
* JAX's Pallas GPU backend with Triton (``jax.experimental.pallas`` with
  ``jax.experimental.pallas.triton.CompilerParams``), the reference;
* ``jnp.dot`` (XLA's cuBLAS/Triton GEMM), the bar.

Every result is checked against ``jnp.dot`` in float32. Prints the median time
per call, TFLOP/s and the ratios. On a machine without a GPU it says so and
exits 0.

Run: python benchmarks/revisit_loop.py [--dtype bfloat16|float16|float32]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _examples  # noqa: E402
from _timing import measure  # noqa: E402

# (M, N, K, block_m, block_n, block_k): square, and a long k loop.
SHAPES = [
    (1024, 1024, 1024, 128, 128, 32),
    (4096, 4096, 4096, 128, 128, 32),
    (512, 512, 16384, 64, 64, 64),
]


def kloop_matmul(pl, compiler_params, x, y, bm, bn, bk, interpret=False):
    """``x @ y`` with the output block revisited along grid axis 2: examples/matmul.py's
    ``matmul``, with this ``pl`` (ours or JAX's)."""
    calls = _examples.Calls(interpret=interpret, compiler_params=compiler_params)
    return _examples.load("matmul", _examples.which(pl)).matmul(x, y, bm=bm, bn=bn, bk=bk, backend=calls)


def gpu_or_none():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    return gpus[0] if gpus else None


def small_check() -> int:
    """The benchmark's kernels at a tiny size, interpreted (ours: the generated
    Triton code under Triton's interpreter; JAX's: interpret=True)."""
    from jax.experimental import pallas as jpl

    import pallas as pl
    import pallas_gpu as plgpu

    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 128), jnp.float32)
    y = jax.random.normal(ky, (128, 32), jnp.float32)
    want = np.asarray(jnp.dot(x, y, precision="highest"))
    for name, module, interpret in (("ours", pl, plgpu.InterpretParams()), ("JAX Pallas", jpl, True)):
        got = kloop_matmul(module, None, x, y, 32, 16, 32, interpret=interpret)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        print(f"{name}: k-loop matmul 64 x 32 x 128 (grid 2 x 2 x 4) matches jnp.dot")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--small",
        action="store_true",
        help="no GPU needed: one tiny shape in interpret mode, checked, not timed",
    )
    args = parser.parse_args()
    device = gpu_or_none()
    if args.small:
        return small_check()
    if device is None:
        print(
            "revisit_loop.py needs a GPU (JAX sees: "
            f"{', '.join(d.platform for d in jax.devices())}); nothing was measured."
        )
        return 0
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import triton as jplt

    import pallas as pl
    import pallas_gpu as plgpu

    dtype = jnp.dtype(args.dtype)
    print(f"jax {jax.__version__}, device {device.device_kind}, inputs {dtype.name}, float32 accumulation")
    header = f"{'M x N x K':>20s} {'blocks':>12s} {'ours ms':>9s} {'JAX Pallas ms':>14s} {'jnp.dot ms':>11s}"
    print(header + "   ours/JAX-Pallas  ours/jnp.dot   (TFLOP/s ours, JAX Pallas, jnp.dot; <1 = ours faster)")
    ok = True
    for m, n, k, bm, bn, bk in SHAPES:
        kx, ky = jax.random.split(jax.random.key(m + n + k))
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
        y = jax.random.normal(ky, (k, n), jnp.float32).astype(dtype)
        cands = {
            "ours": jax.jit(
                functools.partial(
                    kloop_matmul, pl, plgpu.CompilerParams(num_warps=4, num_stages=3), bm=bm, bn=bn, bk=bk
                )
            ),
            "jax_pallas": jax.jit(
                functools.partial(
                    kloop_matmul, jpl, jplt.CompilerParams(num_warps=4, num_stages=3), bm=bm, bn=bn, bk=bk
                )
            ),
            "jnp": jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)),
        }
        want = np.asarray(jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32), precision="highest"))
        scale = np.abs(want).max()
        for name, f in cands.items():
            got = np.asarray(f(x, y))
            err = np.abs(got - want).max() / scale
            if err > (2e-2 if dtype != jnp.float32 else 1e-2):
                print(f"  WRONG: {name} at {m}x{n}x{k}: max error {err:.3g} of the largest |value|")
                ok = False
        times = measure(
            {name: (functools.partial(f, x, y), jax.block_until_ready) for name, f in cands.items()}
        )
        flops = 2 * m * n * k
        tf = {name: flops / t / 1e12 for name, t in times.items()}
        print(
            f"{f'{m} x {n} x {k}':>20s} {f'{bm}x{bn}x{bk}':>12s} {times['ours'] * 1e3:9.3f} "
            f"{times['jax_pallas'] * 1e3:14.3f} {times['jnp'] * 1e3:11.3f}   "
            f"{times['ours'] / times['jax_pallas']:15.2f} {times['ours'] / times['jnp']:13.2f}   "
            f"({tf['ours']:.0f}, {tf['jax_pallas']:.0f}, {tf['jnp']:.0f})",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
