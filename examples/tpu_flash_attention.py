"""TPU-style flash attention, forward pass: the key loop is a grid axis, the state is VMEM scratch.

`softmax(q k^T / sqrt(d)) v` without the (seq, seq) matrix. The grid is
`(batch * heads, seq / block_q, seq / block_k)`: program `(b, i, j)` sees query block `i` and
key/value block `j` of head `b`. Unlike `flash_attention.py`, which walks the keys in a
`fori_loop` inside the kernel, here the grid walks them, and the online-softmax state lives in
VMEM scratch (`scratch_shapes`), which persists across grid steps:

- `m`: running row max, `l`: running softmax denominator, both `(block_q, 128)` f32 with the
  value repeated across the 128 lanes (a TPU vector register is 8 x 128, so a `(block_q, 1)`
  column would cost as much and need relayouts);
- `acc`: running unnormalized output, `(block_q, head_dim)` f32.

`j == 0` resets the state, every step folds one key block in (rescaling `l` and `acc` by
`exp(m_old - m_new)` when the max grows), and the last step writes `acc / l` to the output
block. The key axis carries state, so it is "arbitrary"; the other two are "parallel".

Causal: key block `j` is entirely masked for query block `i` when its first key comes after
the block's last query; such steps do nothing (`pl.when`), and their k/v index map repeats the
last needed block, so the pipeline does not fetch blocks that are never read (a block index
equal to the previous step's is not copied again). Only blocks on the diagonal apply the mask.

On a TPU the kernel is compiled by Mosaic. Anywhere else it runs in TPU interpret mode
(`interpret=pltpu.InterpretParams()`), which simulates VMEM, DMAs and semaphores on the CPU.

Run: python examples/tpu_flash_attention.py [--size small|large]
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from _common import check_and_report, setup, time_ms, tpu_backend

# Moving from JAX's Pallas changed only these two lines (they were
# `from jax.experimental import pallas as pl` and `... import tpu as pltpu`).
import pallas as pl
import pallas_tpu as pltpu

LANES = 128
# Finite, so a fully masked row gives exp(MASK - m) = 0 instead of exp(-inf - -inf) = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def flash_attention_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, causal):
    block_q, head_dim = q_ref.shape
    block_k = k_ref.shape[0]
    i, j = pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def fold_in_block(masked):
        q = q_ref[...] * (1.0 / math.sqrt(head_dim))
        # q @ k^T as a dot_general contracting the last dims of both: no explicit transpose.
        s = jax.lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if masked:
            rows = i * block_q + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            cols = j * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(cols <= rows, s, MASK_VALUE)
        m_prev, l_prev = m_ref[...], l_ref[...]  # (block_q, LANES), lanes all equal
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, :1])
        m_ref[...] = m_next
        l_ref[...] = l_prev * correction + jnp.sum(p, axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * correction[:, :1] + pv

    if causal:
        q_last = (i + 1) * block_q - 1
        k_first, k_last = j * block_k, (j + 1) * block_k - 1
        # Blocks wholly below the diagonal need no mask; wholly above it, no work at all.
        pl.when(k_last <= i * block_q)(lambda: fold_in_block(masked=False))
        pl.when((k_first <= q_last) & (k_last > i * block_q))(lambda: fold_in_block(masked=True))
    else:
        fold_in_block(masked=False)

    @pl.when(j == pl.num_programs(2) - 1)
    def _writeback():
        o_ref[...] = (acc_ref[...] / l_ref[:, :1]).astype(o_ref.dtype)


def flash_attention(q, k, v, *, block_q, block_k, causal, call_kwargs):
    batch, heads, seq, head_dim = q.shape
    q, k, v = (a.reshape(batch * heads, seq, head_dim) for a in (q, k, v))

    def kv_index(b, i, j):
        if causal:
            # The last key block query block i needs; later steps repeat it (no new copy).
            # lax.div, not `//`: the operands are non-negative, and Python's floor division
            # of signed ints lowers to extra sign fix-ups.
            j = jnp.minimum(j, jax.lax.div((i + 1) * block_q - 1, block_k))
        return b, j, 0

    # `None` squeezes the (batch * heads) dimension: the kernel sees 2-D (rows, head_dim) refs.
    q_spec = pl.BlockSpec((None, block_q, head_dim), lambda b, i, j: (b, i, 0))
    kv_spec = pl.BlockSpec((None, block_k, head_dim), kv_index)
    out = pl.pallas_call(
        functools.partial(flash_attention_kernel, causal=causal),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(batch * heads, seq // block_q, seq // block_k),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((block_q, LANES), jnp.float32),  # m
            pltpu.VMEM((block_q, LANES), jnp.float32),  # l
            pltpu.VMEM((block_q, head_dim), jnp.float32),  # acc
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        **call_kwargs,
    )(q, k, v)
    return out.reshape(batch, heads, seq, head_dim)


def attention_reference(q, k, v, *, causal):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def main():
    _, cfg = setup(
        "Pallas TPU flash attention (forward), key blocks on the grid",
        {
            "small": {
                "batch": 2,
                "heads": 2,
                "seq": 512,
                "head_dim": 128,
                "block_q": 128,
                "block_k": 128,
            },
            "large": {
                "batch": 4,
                "heads": 16,
                "seq": 4096,
                "head_dim": 128,
                "block_q": 512,
                "block_k": 512,
            },
        },
        tpu=True,
    )
    backend, call_kwargs = tpu_backend()
    print(f"tpu backend: {backend.name}")
    shape = (cfg["batch"], cfg["heads"], cfg["seq"], cfg["head_dim"])
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in (kq, kk, kv))

    blocks = {"block_q": cfg["block_q"], "block_k": cfg["block_k"]}
    # f32 dots are exact-ish in interpret mode; a TPU runs default-precision f32 dots in bf16
    # passes, hence the looser tolerance there.
    tol = 1e-4 if backend.interpret else 2e-2
    for causal in (False, True):
        fn = jax.jit(functools.partial(flash_attention, **blocks, causal=causal, call_kwargs=call_kwargs))
        out = fn(q, k, v)
        ms = time_ms(fn, q, k, v, runs=cfg["runs"])
        check_and_report(
            "tpu_flash_attention" + ("_causal" if causal else ""),
            out,
            attention_reference(q, k, v, causal=causal),
            tol=tol,
            ms=ms,
            runs=cfg["runs"],
            backend=backend,
        )


if __name__ == "__main__":
    main()
