"""Triton-interpreter speed on the CPU: one program at a time (Triton's way,
``JAX_KERNEL_RUNTIME_INTERPRET_BATCH=1``) against batched passes (the default).

A 1-D elementwise kernel (``o = x * 2 + sin(y)``, 128 elements per program,
masked loads in the Triton kernel) runs with grids of 10^4 and 10^5 programs through both CPU
paths of the shared interpreter:

* pallas-gpu: ``pallas_call(..., interpret=plgpu.InterpretParams())``;
* jax-triton: ``triton_call`` of a ``@triton.jit`` kernel on the CPU.

Each result is checked against ``jnp``. The one-at-a-time path takes about
1-10 ms per program (10^5 programs: minutes), so for grids above
``--sequential-limit`` it is timed on that many programs and scaled linearly
(its cost per program is constant; the line says so). Times are wall clock
and process CPU time (the CPU may be shared).

Run: python benchmarks/interpreter_speed.py [--grids 10000 100000] [--sequential-limit 10000]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import jax_triton as jt  # noqa: E402
import pallas as pl  # noqa: E402
import pallas_gpu as plgpu  # noqa: E402

BLOCK = 128
_BATCH_ENV = "JAX_KERNEL_RUNTIME_INTERPRET_BATCH"


@triton.jit
def elementwise_kernel(x_ptr, y_ptr, n, o_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(o_ptr + offs, x * 2.0 + tl.sin(y), mask=mask)


def _pallas_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + jnp.sin(y_ref[...])


def pallas_gpu_call(programs: int):
    spec = pl.BlockSpec((BLOCK,), lambda i: (i,))
    return jax.jit(
        lambda x, y: pl.pallas_call(
            _pallas_kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(programs,),
            in_specs=[spec, spec],
            out_specs=spec,
            interpret=plgpu.InterpretParams(),
        )(x, y)
    )


def triton_call(programs: int):
    def f(x, y):
        return jt.triton_call(
            x, y, x.shape[0], kernel=elementwise_kernel, out_shape=x, grid=programs, BLOCK=BLOCK
        )

    return jax.jit(f)


PATHS = {"pallas-gpu interpret": pallas_gpu_call, "triton_call (CPU)": triton_call}


def inputs(programs: int):
    n = programs * BLOCK
    kx, ky = jax.random.split(jax.random.key(programs))
    return jax.random.normal(kx, (n,), jnp.float32), jax.random.normal(ky, (n,), jnp.float32)


def timed(fn, x, y, batch: str) -> tuple[float, float, np.ndarray]:
    """(wall s, process CPU s, result) of one call, compiled beforehand."""
    os.environ[_BATCH_ENV] = batch
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        out = np.asarray(jax.block_until_ready(fn(x, y)))
        return time.perf_counter() - wall, time.process_time() - cpu, out
    finally:
        os.environ.pop(_BATCH_ENV, None)


def measure(make, programs: int, sequential_limit: int) -> dict:
    x, y = inputs(programs)
    want = np.asarray(x * 2.0 + jnp.sin(y))
    fn = make(programs)
    fn.lower(x, y).compile()
    after_wall, after_cpu, out = timed(fn, x, y, "4096")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    seq_programs = min(programs, sequential_limit)
    if seq_programs == programs:
        before_wall, before_cpu, out = timed(fn, x, y, "1")
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    else:
        xs, ys = inputs(seq_programs)
        small = make(seq_programs)
        small.lower(xs, ys).compile()
        wall, cpu, out = timed(small, xs, ys, "1")
        np.testing.assert_allclose(out, np.asarray(xs * 2.0 + jnp.sin(ys)), rtol=1e-5, atol=1e-5)
        before_wall, before_cpu = wall * programs / seq_programs, cpu * programs / seq_programs
    return dict(
        before_wall=before_wall, before_cpu=before_cpu, after_wall=after_wall, after_cpu=after_cpu,
        extrapolated_from=None if seq_programs == programs else seq_programs,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grids", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--sequential-limit", type=int, default=10_000)
    parser.add_argument("--only", choices=sorted(PATHS), default=None)
    args = parser.parse_args()
    print(f"1-D elementwise kernel, {BLOCK} elements per program; before = one program at a time, "
          "after = batched passes (the default)")  # fmt: skip
    print(
        f"{'path':24s} {'programs':>9s} {'before s':>10s} {'after s':>9s} {'ratio':>7s}   (CPU s: before / after)"
    )
    for name, make in PATHS.items():
        if args.only and name != args.only:
            continue
        for programs in args.grids:
            r = measure(make, programs, args.sequential_limit)
            note = (
                f"  [before extrapolated from {r['extrapolated_from']} programs]"
                if r["extrapolated_from"]
                else ""
            )
            print(
                f"{name:24s} {programs:9d} {r['before_wall']:10.2f} {r['after_wall']:9.2f} "
                f"{r['before_wall'] / r['after_wall']:6.1f}x   ({r['before_cpu']:.2f} / {r['after_cpu']:.2f}, "
                f"{r['before_cpu'] / max(r['after_cpu'], 1e-9):.1f}x){note}",
                flush=True,
            )


if __name__ == "__main__":
    main()
