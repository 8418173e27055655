"""Flash-attention forward (bf16, optional causal mask) written in the Triton DSL.

One program computes BLOCK_M query rows of one (batch, head), streaming over
key/value blocks with the online softmax. Q, K, V, O are [B, H, S, D]
contiguous; S must be a multiple of BLOCK_M and BLOCK_N.
"""

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

import jax_triton as jt


@triton.jit
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, sm_scale, seq_len,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1).to(tl.int64)
    base = off_bh * seq_len * HEAD_DIM
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.44269504  # exp(x) = exp2(x * log2(e))
    hi = (start_m + 1) * BLOCK_M if CAUSAL else seq_len
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_ptr + base + cols[None, :] * HEAD_DIM + offs_d[:, None])
        qk = tl.dot(q, k) * qk_scale
        if CAUSAL:
            qk = tl.where(offs_m[:, None] >= cols[None, :], qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + base + cols[:, None] * HEAD_DIM + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
    )


@functools.partial(jax.jit, static_argnames=("causal", "block_m", "block_n", "num_warps", "num_stages"))
def attention(q, k, v, causal=False, block_m=128, block_n=64, num_warps=8, num_stages=3):
    b, h, s, d = q.shape
    return jt.triton_call(
        q, k, v,
        kernel=attention_fwd_kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(s // block_m, b * h),
        num_warps=num_warps, num_stages=num_stages,
        sm_scale=float(d) ** -0.5, seq_len=s,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
    )  # fmt: skip


def reference(q, k, v, causal=False):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    if causal:
        mask = jnp.tril(jnp.ones(s.shape[-2:], bool))
        s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def main(b: int = 1, h: int = 2, s: int = 128, d: int = 32) -> None:
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (b, h, s, d), jnp.float32).astype(jnp.bfloat16) for key in (kq, kk, kv))
    ok = True
    for causal in (False, True):
        out = attention(q, k, v, causal=causal, block_m=32, block_n=32, num_warps=4).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(out - reference(q, k, v, causal))))
        ok &= err < 2e-2
        print(f"triton_flash_attention(causal={causal}): {'PASS' if err < 2e-2 else 'FAIL'}  "
              f"max_abs_err={err:.1e} (tol 2e-2)  backend={jax.default_backend()}")  # fmt: skip
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
