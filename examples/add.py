"""Vector add: the smallest Pallas kernel.

Each program of a 1-D grid adds one block of `x` and `y`. `BlockSpec` tells `pallas_call`
which block of each array a program sees: program `i` gets elements
`[i * block, (i + 1) * block)` of every operand, as a Ref it reads with `x_ref[...]`.

Run: python examples/add.py [--size small|large]
"""

import functools

import jax
import jax.numpy as jnp
from _common import check_and_report, setup, time_ms

import pallas as pl


def add_kernel(x_ref, y_ref, o_ref):
    # The refs hold this program's block; no index arithmetic is needed in the kernel.
    o_ref[...] = x_ref[...] + y_ref[...]


def add(x, y, *, block, backend):
    (n,) = x.shape
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(
        add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(n, block),),
        in_specs=[spec, spec],
        out_specs=spec,
        **backend.call_kwargs(num_warps=4),
    )(x, y)


def main():
    backend, cfg = setup(
        "Pallas vector add",
        {
            "small": {"n": 1 << 18, "block": 1 << 14},
            "large": {"n": 1 << 26, "block": 1 << 12},
        },
    )
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (cfg["n"],), jnp.float32)
    y = jax.random.normal(ky, (cfg["n"],), jnp.float32)

    fn = jax.jit(functools.partial(add, block=cfg["block"], backend=backend))
    out = fn(x, y)
    ms = time_ms(fn, x, y, runs=cfg["runs"])
    check_and_report("add", out, x + y, tol=1e-6, ms=ms, runs=cfg["runs"], backend=backend)


if __name__ == "__main__":
    main()
