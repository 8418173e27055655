"""pallas_gpu.ops.decode_attention: ``gqa`` and ``mqa`` against plain-jnp
attention on fresh random data (ragged ``start_idx``/``kv_seq_len`` per row,
sequence lengths that are not multiples of ``block_k`` or ``k_splits``),
through Triton's interpreter on the CPU (also compiled for sm_80 and sm_90),
or compiled and run on the GPU with PALLAS_GPU_TESTS=gpu; pallas-core's
interpreter; JAX's Pallas ``gqa``/``mqa`` in interpret mode as a second
reference; the argument checks; ``gpu``-marked tests at the serving size."""

from __future__ import annotations

import inspect
import math
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
from pallas_gpu.ops import decode_attention as da


def normal(shape, dtype=jnp.float32):
    return jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype)


def up(a):
    return a.astype(jnp.float32)


def attention_jnp(q, k, v, start, length, sm_scale):
    """Independent reference: a loop over batch rows and query heads, each a
    plain masked softmax over its valid tokens (zeros if there are none)."""
    q, k, v = (np.asarray(up(a), np.float64) for a in (q, k, v))
    B, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    out = np.zeros((B, Hq, D))
    for b in range(B):
        lo, hi = max(int(start[b]), 0), min(int(length[b]), S)
        if lo >= hi:
            continue
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            x = k[b, lo:hi, kv] @ q[b, h] * sm_scale
            p = np.exp(x - x.max())
            out[b, h] = p @ v[b, lo:hi, kv] / p.sum()
    return out


def tolerance(dtype):
    if dtype == jnp.bfloat16:
        return dict(rtol=2e-2, atol=2e-2)
    # On the GPU, f32 dots run in TF32.
    return dict(rtol=2e-2, atol=2e-2) if ON_DEVICE else dict(rtol=2e-5, atol=2e-5)


CASES = [
    # (batch, q heads, kv heads, seq, head_dim), dtype, block_k, k_splits, start_idx, kv_seq_len
    ((3, 8, 2, 200, 32), jnp.float32, 32, 3, [0, 5, 70], [200, 133, 71]),  # ragged, 1-token row
    ((2, 4, 4, 96, 16), jnp.float32, 16, None, [10, 96], [90, 96]),  # an empty row (start == len)
    ((2, 12, 3, 150, 64), jnp.bfloat16, 64, 2, None, [150, 37]),  # group of 4, S % block_k != 0
    ((2, 6, 1, 130, 32), jnp.bfloat16, 32, 5, [3, 0], None),  # MQA-shaped, only start_idx
    ((1, 32, 2, 64, 32), jnp.float32, 16, 1, None, None),  # group of 16, one split, no bounds
    ((2, 4, 2, 10, 16), jnp.float32, 64, None, None, [10, 3]),  # fewer tokens than the smallest block
    (
        (3, 8, 2, 120, 32),
        jnp.bfloat16,
        32,
        1,
        [0, 7, 40],
        [120, 7, 99],
    ),  # one split (one kernel), an empty row
]
KERNELS = {CASES[0][0]: 2, CASES[-1][0]: 1}  # the split and combine kernels; with one split, one kernel


@pytest.mark.parametrize("shape,dtype,block_k,k_splits,start,length", CASES)
def test_gqa_matches_plain_attention(shape, dtype, block_k, k_splits, start, length):
    B, Hq, Hkv, S, D = shape
    q, k, v = normal((B, Hq, D), dtype), normal((B, S, Hkv, D), dtype), normal((B, S, Hkv, D), dtype)
    st = None if start is None else jnp.asarray(start, jnp.int32)
    ln = None if length is None else jnp.asarray(length, jnp.int32)
    f = lambda q, k, v: da.gqa(q, k, v, st, ln, block_k=block_k, k_splits=k_splits, interpret=triton_mode())  # noqa: E731
    out = f(q, k, v)
    ref = attention_jnp(q, k, v, start or [0] * B, length or [S] * B, 1 / math.sqrt(D))
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(up(out), ref.astype(np.float32), **tolerance(dtype))
    assert_close(up(out), up(da.gqa_reference(q, k, v, st, ln)), **tolerance(dtype))
    if not ON_DEVICE and shape in KERNELS:
        n = check_all_compile(f, [q, k, v], plgpu.CompilerParams(num_warps=4, num_stages=3))
        assert n == KERNELS[shape]
        if n == 1:  # the kernel writes the normalized output: no epilogue after it
            assert "div" not in ops_outside_kernels(f, *[q, k, v])


def test_gqa_residuals_and_unnormalized_output():
    B, Hq, Hkv, S, D = 2, 8, 2, 100, 32
    q, k, v = normal((B, Hq, D)), normal((B, S, Hkv, D)), normal((B, S, Hkv, D))
    st, ln = jnp.asarray([7, 60], jnp.int32), jnp.asarray([77, 60], jnp.int32)  # row 1 is empty
    for normalize in (True, False):
        out, (l, m) = da.gqa(q, k, v, st, ln, sm_scale=0.3, block_k=16, k_splits=3, interpret=triton_mode(),
                             return_residuals=True, normalize_output=normalize)  # fmt: skip
        # Plain jnp: the softmax max and sum per head over row 0's tokens 7..76.
        logits = jnp.einsum("hd,shd->hs", q[0], jnp.repeat(k[0, 7:77], Hq // Hkv, axis=1)) * 0.3
        m_ref = logits.max(-1)
        p = jnp.exp(logits - m_ref[:, None])
        o_ref = jnp.einsum("hs,shd->hd", p, jnp.repeat(v[0, 7:77], Hq // Hkv, axis=1))
        if normalize:
            o_ref = o_ref / p.sum(-1)[:, None]
        tol = tolerance(jnp.float32)
        assert_close(out[0], o_ref, **tol)
        assert_close(l[0], p.sum(-1), **tol)
        assert_close(m[0], m_ref, **tol)
        np.testing.assert_array_equal(np.asarray(out[1]), 0.0)  # no valid token
        np.testing.assert_array_equal(np.asarray(l[1]), 0.0)
        assert np.all(np.isneginf(np.asarray(m[1])))


@pytest.mark.parametrize("k_splits", [1, 3])  # one split: the kernel writes the output itself
def test_mqa_unnormalized_output_without_residuals(k_splits):
    B, H, S, D = 2, 4, 64, 32
    q, k, v = normal((B, H, D)), normal((B, S, D)), normal((B, S, D))
    ln = jnp.asarray([64, 21], jnp.int32)
    out = da.mqa(q, k, v, None, ln, block_k=16, k_splits=k_splits, normalize_output=False,
                 interpret=triton_mode())  # fmt: skip
    for b, n in enumerate([64, 21]):  # plain jnp: sum_t exp(logit_t - max) v_t over the row's tokens
        logits = q[b] @ k[b, :n].T / math.sqrt(D)
        p = jnp.exp(logits - logits.max(-1, keepdims=True))
        assert_close(out[b], p @ v[b, :n], **tolerance(jnp.float32))


def test_mqa_matches_plain_attention():
    B, H, S, D = 2, 20, 77, 32
    q, k, v = (
        normal((B, H, D), jnp.bfloat16),
        normal((B, S, D), jnp.bfloat16),
        normal((B, S, D), jnp.bfloat16),
    )
    ln = jnp.asarray([77, 30], jnp.int32)
    out = da.mqa(q, k, v, 4, ln, block_k=16, k_splits=2, interpret=triton_mode())  # scalar start_idx
    ref = attention_jnp(q, k[:, :, None], v[:, :, None], [4, 4], [77, 30], 1 / math.sqrt(D))
    assert out.shape == (B, H, D) and out.dtype == jnp.bfloat16
    assert_close(up(out), ref.astype(np.float32), **tolerance(jnp.bfloat16))
    assert_close(up(out), up(da.mqa_reference(q, k, v, 4, ln)), **tolerance(jnp.bfloat16))


def test_pallas_core_interpreter_runs_the_same_kernels():
    B, Hq, Hkv, S, D = 2, 4, 2, 90, 16
    q, k, v = normal((B, Hq, D)), normal((B, S, Hkv, D)), normal((B, S, Hkv, D))
    st, ln = jnp.asarray([3, 0], jnp.int32), jnp.asarray([90, 41], jnp.int32)
    out = da.gqa(q, k, v, st, ln, block_k=16, k_splits=4, interpret=True)
    ref = attention_jnp(q, k, v, [3, 0], [90, 41], 1 / math.sqrt(D))
    tol = 2e-2 if ON_DEVICE else 2e-5
    assert_close(out, ref.astype(np.float32), rtol=tol, atol=tol)


def jax_decode_attention():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("jax.experimental.pallas.ops.gpu.decode_attention")


@pytest.mark.parametrize("op", ["gqa", "mqa"])
def test_matches_jax_pallas_op_in_interpret_mode(op):
    upstream = jax_decode_attention()
    B, Hq, Hkv, S, D = 2, 8, 2, 128, 32
    kv_shape = (B, S, Hkv, D) if op == "gqa" else (B, S, D)
    q, k, v = normal((B, Hq, D)), normal(kv_shape), normal(kv_shape)
    st, ln = jnp.asarray([5, 40], jnp.int32), jnp.asarray([128, 97], jnp.int32)
    kw = dict(block_k=32, k_splits=4, return_residuals=True)  # JAX's needs S % k_splits == 0
    theirs, (l_t, m_t) = getattr(upstream, op)(q, k, v, st, ln, interpret=True, **kw)
    ours, (l_o, m_o) = getattr(da, op)(q, k, v, st, ln, interpret=triton_mode(), **kw)
    tol = 2e-2 if ON_DEVICE else 2e-5
    for a, b in ((ours, theirs), (l_o, l_t), (m_o, m_t)):
        assert_close(a, b, rtol=tol, atol=tol)


def test_default_k_splits_fill_the_gpu():
    # Serving size: 32 rows x 8 KV heads fill the H200 in one wave of 256 programs: no split.
    assert da.default_k_splits(32 * 8, 8192 // 64) == 1
    # Fewer (row, head) pairs: as many splits as keep one wave of at most 264 programs...
    assert da.default_k_splits(64, 8192 // 64) == 4
    assert da.default_k_splits(100, 8192 // 64) == 2
    # ... but at least 4 blocks each.
    assert da.default_k_splits(8, 8192 // 64) == 32
    assert da.default_k_splits(8, 6) == 1
    # A big batch needs no split.
    assert da.default_k_splits(4096, 512) == 1
    # Splits that do not divide the blocks: the last one is shorter, none is empty.
    assert da.split_plan(10, 4) == (3, 4)
    assert da.split_plan(10, 6) == (2, 5)
    assert da.split_plan(3, 16) == (1, 3)


def test_default_splits_give_the_same_answer():
    B, Hq, Hkv, S, D = 1, 4, 1, 1000, 16  # default k_splits: 1000 tokens / 64 -> 16 blocks, 4 splits
    q, k, v = normal((B, Hq, D)), normal((B, S, Hkv, D)), normal((B, S, Hkv, D))
    ln = jnp.asarray([999], jnp.int32)
    out = da.gqa(q, k, v, None, ln, interpret=triton_mode())
    ref = attention_jnp(q, k, v, [0], [999], 1 / math.sqrt(D))
    assert_close(out, ref.astype(np.float32), **tolerance(jnp.float32))


def test_same_signatures_as_jax():
    upstream = jax_decode_attention()
    for name in ("mqa", "gqa", "mqa_reference", "gqa_reference", "mha_reference"):
        ours, theirs = inspect.signature(getattr(da, name)), inspect.signature(getattr(upstream, name))
        assert [(p.name, p.kind) for p in ours.parameters.values()] == [
            (p.name, p.kind) for p in theirs.parameters.values()
        ], name
    # Defaults that differ on purpose: tuned for bandwidth (block_k, num_stages) and k_splits=None
    # (chosen from the shapes to fill the GPU); every other default is JAX's.
    for name in ("mqa", "gqa"):
        ours, theirs = inspect.signature(getattr(da, name)), inspect.signature(getattr(upstream, name))
        differ = {n for n, p in ours.parameters.items() if p.default != theirs.parameters[n].default}
        assert differ == {"block_k", "k_splits", "num_stages"}, (name, differ)


def call_gqa(q_shape=(2, 8, 32), kv_shape=(2, 64, 2, 32), **kw):
    q = jnp.zeros(q_shape, jnp.float32)
    k = v = jnp.zeros(kv_shape, jnp.float32)
    return da.gqa(q, k, v, kw.pop("start_idx", None), kw.pop("kv_seq_len", None), interpret=plgpu.InterpretParams(),
                  **kw)  # fmt: skip


@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(q_shape=(2, 8)), ValueError, r"gqa: q must be \[batch_size, num_heads, head_dim\]"),
        (dict(kv_shape=(2, 64, 32)), ValueError, r"gqa: k and v must be \[batch_size, k_seq_len, num_kv_heads"),
        (dict(q_shape=(2, 6, 32), kv_shape=(2, 64, 4, 32)), ValueError,
         r"gqa: the 6 query heads cannot be grouped over the 4 KV heads"),
        (dict(q_shape=(3, 8, 32)), ValueError, r"gqa: k has batch size 2 but q has 3"),
        (dict(kv_shape=(2, 64, 2, 16)), ValueError, r"gqa: head_dim of q \(32\) and of k, v \(16\) differ"),
        (dict(q_shape=(2, 8, 8), kv_shape=(2, 64, 2, 8)), ValueError, r"head_dim 8 is below 16"),
        (dict(kv_shape=(2, 0, 2, 32)), ValueError, r"the KV cache is empty"),
        (dict(block_k=48), ValueError, r"gqa: block_k must be a power of two >= 16; got 48"),
        (dict(block_k=8), ValueError, r"block_k must be a power of two >= 16; got 8"),
        (dict(block_h=0), ValueError, r"gqa: block_h must be a positive int; got 0"),
        (dict(k_splits=0), ValueError, r"gqa: k_splits must be a positive int or None"),
        (dict(grid=(2, 2)), NotImplementedError, r"gqa: grid= is chosen by pallas_gpu"),
        (dict(normalize_output=False), NotImplementedError, r"normalize_output is False.*residuals"),
        (dict(start_idx=jnp.zeros((3,), jnp.int32)), ValueError,
         r"gqa: start_idx must be a scalar or \[batch_size\] = \(2,\); got shape \(3,\)"),
        (dict(kv_seq_len=jnp.zeros((2, 1), jnp.int32)), ValueError, r"gqa: kv_seq_len must be a scalar or"),
        (dict(kv_seq_len=jnp.zeros((2,), jnp.float32)), ValueError, r"gqa: kv_seq_len must hold integers"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(kw, error, match):
    with pytest.raises(error, match=match):
        call_gqa(**kw)


def test_mqa_bad_arguments_are_named():
    q = jnp.zeros((2, 4, 32))
    with pytest.raises(ValueError, match=r"mqa: k and v must be \[batch_size, k_seq_len, head_dim\]"):
        da.mqa(q, jnp.zeros((2, 64, 1, 32)), jnp.zeros((2, 64, 1, 32)), interpret=plgpu.InterpretParams())
    with pytest.raises(ValueError, match=r"mqa: k and v must have the same shape"):
        da.mqa(q, jnp.zeros((2, 64, 32)), jnp.zeros((2, 32, 32)), interpret=plgpu.InterpretParams())


# ---------------------------------------------------------------------------
# On the GPU, at the serving size of benchmarks/decode_attention.py (compiled, default arguments)


@pytest.mark.gpu
def test_gqa_serving_size_on_gpu():
    B, Hq, Hkv, S, D = 32, 32, 8, 8192, 128
    q, k, v = (
        normal((B, Hq, D), jnp.bfloat16),
        normal((B, S, Hkv, D), jnp.bfloat16),
        normal((B, S, Hkv, D), jnp.bfloat16),
    )
    rng = np.random.default_rng(13)
    st = jnp.asarray(rng.integers(0, 300, B), jnp.int32)
    ln = (
        jnp.asarray(rng.integers(1000, S + 1, B), jnp.int32).at[0].set(S).at[1].set(int(st[1]))
    )  # full, empty
    out, (l, m) = da.gqa(q, k, v, st, ln, return_residuals=True)
    ref, (l_ref, m_ref) = da.gqa_reference(q, k, v, st, ln, return_residuals=True)
    assert_close(up(out), up(ref), rtol=2e-2, atol=1e-2)
    assert_close(l, l_ref, rtol=2e-2, atol=1e-2)
    rows = np.array([0, *range(2, B)])  # row 1 has no valid token: m is -inf in both
    assert_close(m[rows], m_ref[rows], rtol=1e-2, atol=1e-2)
    assert np.all(np.isneginf(np.asarray(m[1]))) and float(jnp.max(jnp.abs(up(out[1])))) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("block_k,num_stages,num_warps", [(64, 3, 4), (128, 2, 4), (128, 3, 8), (32, 4, 4)])
def test_gqa_configs_on_gpu(block_k, num_stages, num_warps):
    B, Hq, Hkv, S, D = 4, 32, 8, 4000, 128  # S not a multiple of any block_k
    q, k, v = (
        normal((B, Hq, D), jnp.bfloat16),
        normal((B, S, Hkv, D), jnp.bfloat16),
        normal((B, S, Hkv, D), jnp.bfloat16),
    )
    ln = jnp.asarray([4000, 3333, 65, 2049], jnp.int32)
    out = da.gqa(q, k, v, None, ln, block_k=block_k, num_stages=num_stages, num_warps=num_warps)
    ref = attention_jnp(q, k, v, [0] * B, [4000, 3333, 65, 2049], 1 / math.sqrt(D))
    assert_close(up(out), ref.astype(np.float32), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
def test_mqa_and_jax_gqa_agree_on_gpu():
    upstream = jax_decode_attention()
    B, Hq, S, D = 8, 16, 2048, 128
    q, k, v = (
        normal((B, Hq, D), jnp.bfloat16),
        normal((B, S, D), jnp.bfloat16),
        normal((B, S, D), jnp.bfloat16),
    )
    ln = jnp.asarray(np.random.default_rng(3).integers(1, S + 1, B), jnp.int32)
    ours = da.mqa(q, k, v, None, ln)
    theirs = upstream.mqa(q, k, v, None, ln)
    assert_close(up(ours), up(theirs), rtol=2e-2, atol=1e-2)
    assert_close(up(ours), up(da.mqa_reference(q, k, v, None, ln)), rtol=2e-2, atol=1e-2)
