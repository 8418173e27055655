"""Layer norm (forward) with a learned weight and bias.

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      (statistics over each row)

One block of rows per program, as in `softmax.py`. `weight` and `bias` are 1-D and every
program needs all of them: their BlockSpec covers the whole vector and its index map returns
block 0 whatever the program, so each program sees the same block.

Run: python examples/layer_norm.py [--size small|large]
"""

import functools

import jax
import jax.numpy as jnp
from _common import check_and_report, setup, time_ms

import pallas as pl


def layer_norm_kernel(x_ref, weight_ref, bias_ref, o_ref, *, eps):
    x = x_ref[...].astype(jnp.float32)
    mean = jnp.mean(x, axis=1, keepdims=True)
    centered = x - mean
    var = jnp.mean(centered * centered, axis=1, keepdims=True)
    y = centered * jax.lax.rsqrt(var + eps)
    o_ref[...] = (y * weight_ref[...] + bias_ref[...]).astype(o_ref.dtype)


def layer_norm(x, weight, bias, *, block_rows, backend, eps=1e-5):
    rows, cols = x.shape
    row_spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
    vector_spec = pl.BlockSpec((cols,), lambda i: (0,))
    return pl.pallas_call(
        functools.partial(layer_norm_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[row_spec, vector_spec, vector_spec],
        out_specs=row_spec,
        **backend.call_kwargs(num_warps=8),
    )(x, weight, bias)


def layer_norm_reference(x, weight, bias, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * weight + bias


def main():
    backend, cfg = setup(
        "Pallas layer norm (forward)",
        {
            "small": {"rows": 512, "cols": 1024, "block_rows": 16},
            "large": {"rows": 16384, "cols": 4096, "block_rows": 4},
        },
    )
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    x = 3.0 + 2.0 * jax.random.normal(kx, (cfg["rows"], cfg["cols"]), jnp.float32)
    weight = 1.0 + 0.1 * jax.random.normal(kw, (cfg["cols"],), jnp.float32)
    bias = 0.1 * jax.random.normal(kb, (cfg["cols"],), jnp.float32)

    fn = jax.jit(functools.partial(layer_norm, block_rows=cfg["block_rows"], backend=backend))
    out = fn(x, weight, bias)
    ms = time_ms(fn, x, weight, bias, runs=cfg["runs"])
    expected = layer_norm_reference(x, weight, bias)
    check_and_report("layer_norm", out, expected, tol=1e-4, ms=ms, runs=cfg["runs"], backend=backend)


if __name__ == "__main__":
    main()
