"""TPU-style blocked matmul: an f32 accumulator in VMEM scratch, k walked by the grid.

`o = x @ y` with `x: (m, k)`, `y: (k, n)`. The grid is `(m / bm, n / bn, k / bk)`: program
`(i, j, kk)` multiplies block `(i, kk)` of `x` by block `(kk, j)` of `y` and adds the product
into a `(bm, bn)` f32 accumulator that lives in VMEM scratch (`scratch_shapes`), not in the
output. Scratch persists across grid steps, and on a TPU the grid runs in order, so the
accumulator carries the partial sum along k: `kk == 0` zeroes it, every step adds into it, and
the last step (`kk == nk - 1`) casts it to the output dtype and writes the output block once.
Keeping the sum in f32 scratch is what lets a bf16 output keep f32 accuracy.

`dimension_semantics` tells Mosaic which grid axes are independent: `m` and `n` are
"parallel" (a megacore TPU may split them across its cores), `k` is "arbitrary" (it carries
the accumulator, so it must run in order on one core).

On a TPU the kernel is compiled by Mosaic. Anywhere else it runs in TPU interpret mode
(`interpret=pltpu.InterpretParams()`), which simulates VMEM, DMAs and semaphores on the CPU.

Run: python examples/tpu_matmul.py [--size small|large]
"""

import functools

import jax
import jax.numpy as jnp
from _common import check_and_report, setup, time_ms, tpu_backend

# Moving from JAX's Pallas changed only these two lines (they were
# `from jax.experimental import pallas as pl` and `... import tpu as pltpu`).
import pallas as pl
import pallas_tpu as pltpu


def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    kk, nk = pl.program_id(2), pl.num_programs(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kk == nk - 1)
    def _writeback():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def matmul(x, y, *, bm, bn, bk, call_kwargs):
    (m, k), (_, n) = x.shape, y.shape
    return pl.pallas_call(
        matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(m // bm, n // bn, k // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        **call_kwargs,
    )(x, y)


def main():
    _, cfg = setup(
        "Pallas TPU blocked matmul with a VMEM f32 accumulator",
        {
            "small": {"m": 512, "n": 384, "k": 512, "bm": 128, "bn": 128, "bk": 128},
            "large": {"m": 4096, "n": 4096, "k": 4096, "bm": 512, "bn": 512, "bk": 512},
        },
        tpu=True,
    )
    backend, call_kwargs = tpu_backend()
    print(f"tpu backend: {backend.name}")
    blocks = {b: cfg[b] for b in ("bm", "bn", "bk")}
    fn = jax.jit(functools.partial(matmul, **blocks, call_kwargs=call_kwargs))

    for dtype in (jnp.bfloat16, jnp.float32):
        kx, ky = jax.random.split(jax.random.key(0 if dtype == jnp.bfloat16 else 1))
        x = jax.random.normal(kx, (cfg["m"], cfg["k"]), dtype)
        y = jax.random.normal(ky, (cfg["k"], cfg["n"]), dtype)
        expected = jnp.dot(x, y, preferred_element_type=jnp.float32, precision="highest")
        out = fn(x, y)
        ms = time_ms(fn, x, y, runs=cfg["runs"])
        if dtype == jnp.bfloat16:
            # The f32 sum is exact up to summation order; rounding it to the bf16 output moves
            # a value v by at most half a bf16 ulp, <= 2^-8 |v|. Allow one ulp of the largest.
            tol = 2.0**-7 * float(jnp.max(jnp.abs(expected)))
        else:
            # f32 products and sums: error grows ~ sqrt(k) ulps of values ~ sqrt(k). On a TPU
            # the default f32 dot may run bf16 passes, hence the looser tolerance there.
            tol = 1e-5 * cfg["k"] if backend.interpret else 2e-2 * cfg["k"] ** 0.5
        name = f"tpu_matmul_{jnp.dtype(dtype).name}"
        check_and_report(name, out, expected, tol=tol, ms=ms, runs=cfg["runs"], backend=backend)


if __name__ == "__main__":
    main()
