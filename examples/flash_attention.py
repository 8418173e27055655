"""Flash attention, forward pass: softmax(q k^T / sqrt(d)) v without the (seq, seq) matrix.

The grid is `(batch * heads, seq / block_q)`: each program owns one block of queries of one
head and sees that head's whole `k` and `v`. It walks the keys one block at a time in a
`fori_loop`, keeping for every query row the running max `m`, the running softmax denominator
`l` and the running unnormalized output `acc` ("online softmax"). When a new key block raises
the max, the old `l` and `acc` are rescaled by `exp(m_old - m_new)`; at the end `acc / l` is
the attention output. Memory per program is O(block_q * d), whatever the sequence length.

Run: python examples/flash_attention.py [--size small|large]
"""

import functools
import math

import jax
import jax.numpy as jnp
from _common import check_and_report, setup, time_ms

import pallas as pl


def flash_attention_kernel(q_ref, k_ref, v_ref, o_ref, *, block_k):
    block_q, head_dim = q_ref.shape
    q = q_ref[...] * (1.0 / math.sqrt(head_dim))

    def body(step, carry):
        m, l, acc = carry
        start = pl.multiple_of(step * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # (block_q, block_k)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_new)  # rescales what was accumulated under the old max
        p = jnp.exp(s - m_new[:, None])
        l_new = l * correction + jnp.sum(p, axis=1)
        acc_new = acc * correction[:, None] + jnp.dot(
            p.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return m_new, l_new, acc_new

    m = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    acc = jnp.zeros((block_q, head_dim), jnp.float32)
    num_k_blocks = k_ref.shape[0] // block_k
    m, l, acc = jax.lax.fori_loop(0, num_k_blocks, body, (m, l, acc))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def flash_attention(q, k, v, *, block_q, block_k, backend):
    batch, heads, seq, head_dim = q.shape
    q, k, v = (a.reshape(batch * heads, seq, head_dim) for a in (q, k, v))
    # `None` squeezes the (batch * heads) dimension: the kernel sees 2-D (rows, head_dim) refs.
    q_spec = pl.BlockSpec((None, block_q, head_dim), lambda bh, i: (bh, i, 0))
    kv_spec = pl.BlockSpec((None, seq, head_dim), lambda bh, i: (bh, 0, 0))
    out = pl.pallas_call(
        functools.partial(flash_attention_kernel, block_k=block_k),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch * heads, pl.cdiv(seq, block_q)),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        **backend.call_kwargs(num_warps=4, num_stages=2),
    )(q, k, v)
    return out.reshape(batch, heads, seq, head_dim)


def attention_reference(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def main():
    backend, cfg = setup(
        "Pallas flash attention (forward)",
        {
            "small": {
                "batch": 2,
                "heads": 2,
                "seq": 256,
                "head_dim": 64,
                "block_q": 64,
                "block_k": 64,
            },
            "large": {
                "batch": 4,
                "heads": 16,
                "seq": 4096,
                "head_dim": 64,
                "block_q": 128,
                "block_k": 64,
            },
        },
    )
    shape = (cfg["batch"], cfg["heads"], cfg["seq"], cfg["head_dim"])
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in (kq, kk, kv))

    blocks = {"block_q": cfg["block_q"], "block_k": cfg["block_k"]}
    fn = jax.jit(functools.partial(flash_attention, **blocks, backend=backend))
    out = fn(q, k, v)
    ms = time_ms(fn, q, k, v, runs=cfg["runs"])
    # GPU dots on f32 inputs may run in TF32 (10-bit mantissa), hence the looser GPU tolerance.
    tol = 1e-4 if backend.interpret else 2e-2
    check_and_report(
        "flash_attention",
        out,
        attention_reference(q, k, v),
        tol=tol,
        ms=ms,
        runs=cfg["runs"],
        backend=backend,
    )


if __name__ == "__main__":
    main()
