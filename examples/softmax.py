"""Row softmax: one block of rows per program.

The grid runs over blocks of `block_rows` rows; each program loads its rows whole (the block
spans every column), so the max and the sum of a row never leave the program. Subtracting the
row max before `exp` keeps large logits from overflowing.

Run: python examples/softmax.py [--size small|large]
"""

import functools

import jax
import jax.numpy as jnp
from _common import check_and_report, setup, time_ms

import pallas as pl


def softmax_kernel(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    x = x - jnp.max(x, axis=1, keepdims=True)
    e = jnp.exp(x)
    o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)


def softmax(x, *, block_rows, backend):
    rows, cols = x.shape
    # The block covers all `cols` columns, so the index map's second block index is always 0.
    spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
    return pl.pallas_call(
        softmax_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[spec],
        out_specs=spec,
        **backend.call_kwargs(num_warps=8),
    )(x)


def main():
    backend, cfg = setup(
        "Pallas row softmax",
        {
            "small": {"rows": 512, "cols": 1024, "block_rows": 16},
            "large": {"rows": 16384, "cols": 4096, "block_rows": 4},
        },
    )
    x = 4.0 * jax.random.normal(jax.random.key(0), (cfg["rows"], cfg["cols"]), jnp.float32)

    fn = jax.jit(functools.partial(softmax, block_rows=cfg["block_rows"], backend=backend))
    out = fn(x)
    ms = time_ms(fn, x, runs=cfg["runs"])
    expected = jax.nn.softmax(x, axis=-1)
    check_and_report("softmax", out, expected, tol=1e-5, ms=ms, runs=cfg["runs"], backend=backend)


if __name__ == "__main__":
    main()
