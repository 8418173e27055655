"""pallas_gpu.ops.paged_attention against plain-jnp attention over the
dense cache the page tables describe (fresh random data, shuffled pages,
ragged lengths including 0 and lengths inside a page), through Triton's
interpreter on the CPU (also compiled for sm_80 and sm_90) or on the GPU with
PALLAS_GPU_TESTS=gpu; quantized pages with scales; soft capping; JAX's Pallas
``paged_attention`` in interpret mode as a second reference; the argument
checks; ``gpu``-marked tests at the serving size."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import (
    ON_DEVICE,
    assert_close,
    check_all_compile,
    fresh_key,
    ops_outside_kernels,
    triton_mode,
)

import pallas_gpu as plgpu
from pallas_gpu.ops import paged_attention as pa


def normal(shape, dtype=jnp.float32):
    return jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype)


def up(a):
    return a.astype(jnp.float32)


def paged_problem(batch, q_heads, kv_heads, head_dim, page_size, pages_per_seq, dtype, spare_pages=3):
    """q, the page pools, a block table of distinct shuffled pages, and the
    dense [batch, pages_per_seq * page_size, kv_heads, head_dim] K and V it
    describes."""
    total = batch * pages_per_seq + spare_pages
    q = normal((batch, q_heads, head_dim), dtype)
    k_pages, v_pages = (normal((kv_heads, total, page_size, head_dim), dtype) for _ in range(2))
    perm = np.random.default_rng(batch * 1000 + pages_per_seq).permutation(total)
    tables = jnp.asarray(perm[: batch * pages_per_seq].reshape(batch, pages_per_seq), jnp.int32)
    return q, k_pages, v_pages, tables, dense(k_pages, tables), dense(v_pages, tables)


def dense(pages, tables):
    """[kv_heads, pages, page_size, D] gathered by tables [batch, n] -> [batch, n * page_size, kv_heads, D]."""
    g = pages[:, tables]  # [kv_heads, batch, n, page_size, D]
    h, b, n, ps, d = g.shape
    return jnp.transpose(g, (1, 2, 3, 0, 4)).reshape(b, n * ps, h, d)


def attention_jnp(q, k, v, lengths, soft_cap=None):
    """Independent reference: per row and head, a plain softmax over the
    row's first ``lengths[b]`` tokens, unscaled logits (zeros for length 0)."""
    q, k, v = (np.asarray(up(a), np.float64) for a in (q, k, v))
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    out = np.zeros((B, Hq, D))
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        for h in range(Hq):
            x = k[b, :n, h // (Hq // Hkv)] @ q[b, h]
            if soft_cap is not None:
                x = np.tanh(x / soft_cap) * soft_cap
            p = np.exp(x - x.max())
            out[b, h] = p @ v[b, :n, h // (Hq // Hkv)] / p.sum()
    return out


def tolerance(dtype):
    if dtype == jnp.bfloat16:
        return dict(rtol=2e-2, atol=2e-2)
    return dict(rtol=2e-2, atol=2e-2) if ON_DEVICE else dict(rtol=2e-5, atol=2e-5)


CASES = [
    # (batch, q heads, kv heads, head_dim, page_size, pages_per_seq), dtype, pages per step, k_splits, lengths
    ((3, 8, 2, 32, 8, 7), jnp.float32, 2, 2, [50, 0, 19]),  # a length-0 row, lengths inside pages
    ((2, 4, 4, 16, 16, 5), jnp.float32, 1, None, [80, 17]),  # group of 1, default splits
    ((2, 12, 3, 64, 16, 6), jnp.bfloat16, 4, 3, [96, 33]),  # group of 4, blocks not dividing the pages
    ((2, 6, 1, 32, 4, 9), jnp.bfloat16, 4, 2, None),  # MQA-shaped, no lengths (all pages full)
    ((3, 8, 2, 32, 8, 6), jnp.bfloat16, 2, 1, [48, 0, 13]),  # one split (one kernel), a length-0 row
]
KERNELS = {CASES[0][0]: 2, CASES[-1][0]: 1}  # the split and combine kernels; with one split, one kernel


@pytest.mark.parametrize("shape,dtype,block_pages,k_splits,lengths", CASES)
def test_paged_attention_matches_plain_attention(shape, dtype, block_pages, k_splits, lengths):
    B, Hq, Hkv, D, ps, pps = shape
    q, k_pages, v_pages, tables, k, v = paged_problem(B, Hq, Hkv, D, ps, pps, dtype)
    ln = None if lengths is None else jnp.asarray(lengths, jnp.int32)

    def f(q, k_pages, v_pages, tables):
        return pa.paged_attention(q, k_pages, v_pages, tables, ln, pages_per_compute_block=block_pages,
                                  k_splits=k_splits, interpret=triton_mode())  # fmt: skip

    out = f(q, k_pages, v_pages, tables)
    ref = attention_jnp(q, k, v, lengths or [pps * ps] * B)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(up(out), ref.astype(np.float32), **tolerance(dtype))
    assert_close(up(out), up(pa.paged_attention_reference(q, k, v, ln)), **tolerance(dtype))
    if not ON_DEVICE and shape in KERNELS:
        n = check_all_compile(
            f, [q, k_pages, v_pages, tables], plgpu.CompilerParams(num_warps=4, num_stages=3)
        )
        assert n == KERNELS[shape]
        if n == 1:  # the kernel writes the normalized output: no epilogue after it
            assert "div" not in ops_outside_kernels(f, *[q, k_pages, v_pages, tables])


def test_block_table_entries_past_the_length_are_ignored():
    # Entries past a row's last page may hold anything (here: out of range): no error, no effect.
    q, k_pages, v_pages, tables, k, v = paged_problem(2, 4, 2, 32, 8, 6, jnp.float32)
    lengths = [20, 41]  # row 0 uses pages 0-2 of its table, row 1 all six
    tables = tables.at[0, 3:5].set(-7).at[0, 5].set(10**6)
    out = pa.paged_attention(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
                             pages_per_compute_block=2, k_splits=2, interpret=triton_mode())  # fmt: skip
    assert_close(out, attention_jnp(q, k, v, lengths).astype(np.float32), **tolerance(jnp.float32))


def test_quantized_pages_with_scales():
    B, Hq, Hkv, D, ps, pps = 2, 8, 2, 32, 8, 5
    total = B * pps + 1
    q = normal((B, Hq, D))
    kq, vq = (jax.random.randint(fresh_key(), (Hkv, total, ps, D), -127, 128, jnp.int32).astype(jnp.int8)
              for _ in range(2))  # fmt: skip
    k_scales, v_scales = (jax.random.uniform(fresh_key(), (Hkv, total, ps), jnp.float32, 0.001, 0.02)
                          for _ in range(2))  # fmt: skip
    tables = jnp.asarray(np.random.default_rng(7).permutation(total)[: B * pps].reshape(B, pps), jnp.int32)
    ln = jnp.asarray([40, 23], jnp.int32)
    out = pa.paged_attention(q, kq, vq, tables, ln, k_scales, v_scales, pages_per_compute_block=2,
                             interpret=triton_mode())  # fmt: skip
    k = dense(kq.astype(jnp.float32) * k_scales[..., None], tables)
    v = dense(vq.astype(jnp.float32) * v_scales[..., None], tables)
    tol = dict(rtol=2e-2, atol=2e-2) if ON_DEVICE else dict(rtol=1e-4, atol=1e-4)
    assert_close(out, attention_jnp(q, k, v, [40, 23]).astype(np.float32), **tol)


def test_soft_cap():
    q, k_pages, v_pages, tables, k, v = paged_problem(2, 4, 2, 32, 8, 4, jnp.float32)
    q = q * 3.0  # logits large enough for the cap to matter
    ln = jnp.asarray([32, 9], jnp.int32)
    out = pa.paged_attention(q, k_pages, v_pages, tables, ln, pages_per_compute_block=2, attn_logits_soft_cap=5.0,
                             interpret=triton_mode())  # fmt: skip
    ref = attention_jnp(q, k, v, [32, 9], soft_cap=5.0)
    assert_close(out, ref.astype(np.float32), **tolerance(jnp.float32))
    uncapped = attention_jnp(q, k, v, [32, 9])
    assert np.max(np.abs(ref - uncapped)) > 0.1  # the cap changed the answer


def test_pallas_core_interpreter_runs_the_same_kernels():
    q, k_pages, v_pages, tables, k, v = paged_problem(2, 4, 2, 16, 8, 4, jnp.float32)
    ln = jnp.asarray([30, 5], jnp.int32)
    out = pa.paged_attention(
        q, k_pages, v_pages, tables, ln, pages_per_compute_block=2, k_splits=2, interpret=True
    )
    tol = 2e-2 if ON_DEVICE else 2e-5
    assert_close(out, attention_jnp(q, k, v, [30, 5]).astype(np.float32), rtol=tol, atol=tol)


def jax_paged_attention():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("jax.experimental.pallas.ops.gpu.paged_attention")


def test_matches_jax_pallas_op_in_interpret_mode():
    upstream = jax_paged_attention()
    q, k_pages, v_pages, tables, _, _ = paged_problem(2, 16, 2, 32, 16, 8, jnp.float32)
    ln = jnp.asarray([128, 45], jnp.int32)
    kw = dict(pages_per_compute_block=2, k_splits=2)  # JAX's needs pages_per_sequence % k_splits == 0
    theirs = upstream.paged_attention(q, k_pages, v_pages, tables, ln, interpret=True, **kw)
    ours = pa.paged_attention(q, k_pages, v_pages, tables, ln, interpret=triton_mode(), **kw)
    tol = 2e-2 if ON_DEVICE else 2e-5
    assert_close(ours, theirs, rtol=tol, atol=tol)


def test_same_signature_as_jax():
    upstream = jax_paged_attention()
    for name in ("paged_attention", "paged_attention_reference"):
        ours, theirs = inspect.signature(getattr(pa, name)), inspect.signature(getattr(upstream, name))
        assert [(p.name, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.kind) for p in theirs.parameters.values()
        ], name
    ours, theirs = inspect.signature(pa.paged_attention), inspect.signature(upstream.paged_attention)
    differ = {n for n, p in ours.parameters.items() if p.default != theirs.parameters[n].default}
    # Chosen from the shapes and the GPU (None); every other default is JAX's.
    assert differ == {"pages_per_compute_block", "k_splits", "num_warps", "num_stages"}, differ
    assert pa.DEFAULT_MASK_VALUE == upstream.DEFAULT_MASK_VALUE


def call(q_shape=(2, 8, 32), pages_shape=(2, 10, 8, 32), tables_shape=(2, 4), lengths=None, **kw):
    q = jnp.zeros(q_shape, jnp.float32)
    pages = jnp.zeros(pages_shape, jnp.float32)
    v_pages = kw.pop("v_pages", pages)
    tables = kw.pop("tables", jnp.zeros(tables_shape, jnp.int32))
    return pa.paged_attention(q, pages, v_pages, tables, lengths, interpret=plgpu.InterpretParams(), **kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(q_shape=(2, 8)), r"paged_attention: q must be \[batch_size, num_heads, head_dim\]"),
        (dict(pages_shape=(2, 80, 32)), r"k_pages must be \[num_kv_heads, total_num_pages, page_size, head_dim\]"),
        (dict(v_pages=jnp.zeros((2, 10, 4, 32))), r"k_pages and v_pages must have the same shape"),
        (dict(q_shape=(2, 6, 32), pages_shape=(4, 10, 8, 32)), r"Number of Q heads must be divisible by number of KV heads. Got 6 and 4"),
        (dict(pages_shape=(2, 10, 8, 16)), r"head_dim of Q must be the same as that of K/V. Got 32 and 16"),
        (dict(q_shape=(2, 8, 8), pages_shape=(2, 10, 8, 8)), r"head_dim 8 is below 16"),
        (dict(tables_shape=(3, 4)), r"block_tables must be \[batch_size, pages_per_sequence\] with batch_size 2"),
        (dict(tables=jnp.zeros((2, 4), jnp.float32)), r"block_tables must hold integers"),
        (dict(lengths=jnp.zeros((3,), jnp.int32)), r"lengths must be \[batch_size\] = \(2,\); got \(3,\)"),
        (dict(lengths=jnp.zeros((2,), jnp.int16)), r"The dtype of `lengths` must be int32. Got int16"),
        (dict(k_scales_pages=jnp.zeros((2, 10, 4))), r"k_scales_pages must be \[num_kv_heads, total_num_pages, page_size\]"),
        (dict(v_scales_pages=jnp.zeros((2, 10))), r"v_scales_pages must be"),
        (dict(block_h=24), r"block_h must divisible by 16, but is 24"),
        (dict(pages_per_compute_block=0), r"pages_per_compute_block must be a positive int or None; got 0"),
        (dict(pages_per_compute_block=1), r"pages_per_compute_block \* page_size = 1 \* 8 tokens per step is below 16"),
        (dict(k_splits=-1), r"k_splits must be a positive int or None"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        call(**kw)


# ---------------------------------------------------------------------------
# On the GPU, at the serving size of benchmarks/decode_attention.py (compiled, default arguments)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_serving_size_on_gpu(page_size):
    B, Hq, Hkv, D, S = 32, 32, 8, 128, 8192
    q, k_pages, v_pages, tables, k, v = paged_problem(B, Hq, Hkv, D, page_size, S // page_size, jnp.bfloat16)
    lengths = np.random.default_rng(page_size).integers(1, S + 1, B)
    lengths[:2] = (S, 0)
    ln = jnp.asarray(lengths, jnp.int32)
    out = pa.paged_attention(q * (D**-0.5), k_pages, v_pages, tables, ln)
    ref = pa.paged_attention_reference(q * (D**-0.5), k, v, ln)
    assert_close(up(out), up(ref), rtol=2e-2, atol=1e-2)
    assert float(jnp.max(jnp.abs(up(out[1])))) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("block_pages,num_stages,num_warps", [(4, 3, 4), (8, 2, 4), (8, 3, 8), (2, 4, 4)])
def test_configs_on_gpu(block_pages, num_stages, num_warps):
    B, Hq, Hkv, D, ps, pps = 4, 32, 8, 128, 16, 250  # pages not a multiple of any step
    q, k_pages, v_pages, tables, k, v = paged_problem(B, Hq, Hkv, D, ps, pps, jnp.bfloat16)
    lengths = [4000, 3333, 65, 2049]
    out = pa.paged_attention(q * (D**-0.5), k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
                             pages_per_compute_block=block_pages, num_stages=num_stages, num_warps=num_warps)  # fmt: skip
    ref = attention_jnp(q * (D**-0.5), k, v, lengths)
    assert_close(up(out), ref.astype(np.float32), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize(
    "stage_bytes,cc,stages",
    [(64 << 10, 90, 3), (128 << 10, 90, 1), (96 << 10, 90, 2), (64 << 10, 80, 2), (32 << 10, 86, 2),
     (64 << 10, 86, 1), (300 << 10, 90, 1), (64 << 10, None, 3), (32 << 10, 61, 1)],
)  # fmt: skip
def test_default_stages_fit_the_shared_memory(stage_bytes, cc, stages):
    from pallas_gpu.ops._common import pipeline_stages

    assert pipeline_stages(stage_bytes, 3, cc) == stages


@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype", [(128, jnp.bfloat16), (256, jnp.bfloat16), (128, jnp.float32)])
def test_default_stages_on_gpu(D, dtype):
    """num_stages=None at head dims and dtypes whose 3-stage K/V buffers do not all fit."""
    B, Hq, Hkv, ps, pps = 2, 8, 2, 16, 40
    q, k_pages, v_pages, tables, k, v = paged_problem(B, Hq, Hkv, D, ps, pps, dtype)
    lengths = [640, 301]
    out = pa.paged_attention(q * (D**-0.5), k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32))
    ref = attention_jnp(q * (D**-0.5), k, v, lengths)
    assert_close(up(out), ref.astype(np.float32), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
def test_jax_paged_attention_agrees_on_gpu():
    upstream = jax_paged_attention()
    q, k_pages, v_pages, tables, _, _ = paged_problem(8, 32, 8, 128, 16, 128, jnp.bfloat16)
    ln = jnp.asarray(np.random.default_rng(5).integers(1, 2049, 8), jnp.int32)
    ours = pa.paged_attention(q, k_pages, v_pages, tables, ln)
    theirs = upstream.paged_attention(q, k_pages, v_pages, tables, ln)
    assert_close(up(ours), up(theirs), rtol=2e-2, atol=2e-2)
