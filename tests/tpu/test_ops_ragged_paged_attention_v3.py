"""``pallas_tpu.ops.ragged_paged_attention.v3`` (vLLM's call: the new tokens' K/V written into
the paged cache, then mixed prefill and decode attention) against a float64 numpy reference
(the cache updated, then attention per sequence) on fresh random data, run every way of an op
(tests/ways' ``every_way(op=True)``): the output, the returned cache equal to the reference update,
and the pages no sequence wrote unchanged. JAX has no op of this signature; the module's
plain-JAX ``ref_ragged_paged_attention`` is checked against the numpy reference too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import every_way

from pallas_tpu.ops.ragged_paged_attention import v3

jax.config.update("jax_enable_checks", True)

# (q_len, kv_len): decodes, then chunked prefills over earlier keys, then mixed sequences (a
# whole prompt, an empty step, a short prompt); runs straddle pages and query blocks.
MIX = [(1, 37), (1, 3), (1, 64), (5, 60), (13, 40), (20, 20), (0, 9), (2, 2)]
DISTRIBUTION = (3, 5, 8)


def inputs(seed, mix=MIX, dist=DISTRIBUTION, *, q_heads=4, kv_heads=2, width=128, page_size=8, pages_per_seq=8,
           max_seqs=10, tokens=48, q_dtype=jnp.float32, kv_dtype=jnp.float32, sink=False):  # fmt: skip
    """The op's positional arguments for the (q_len, kv_len) ``mix``."""
    total = max_seqs * pages_per_seq + 3
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (tokens, q_heads, width), jnp.float32).astype(q_dtype)
    scale = 4.0 if jnp.dtype(kv_dtype).itemsize == 1 else 1.0
    k = (jax.random.normal(ks[1], (tokens, kv_heads, width)) * scale).astype(q_dtype)
    v = (jax.random.normal(ks[2], (tokens, kv_heads, width)) * scale).astype(q_dtype)
    if jnp.dtype(kv_dtype).itemsize == 1:  # quantized by the caller
        k, v = k.astype(jnp.float32).astype(kv_dtype), v.astype(jnp.float32).astype(kv_dtype)
    shape = v3.get_kv_cache_shape(total, page_size, kv_heads, width, kv_dtype)
    cache = (jax.random.normal(ks[3], shape) * scale).astype(kv_dtype)
    kv_lens, cu = np.zeros(max_seqs, np.int32), np.zeros(max_seqs + 1, np.int32)
    for s, (q_len, kv_len) in enumerate(mix):
        kv_lens[s], cu[s + 1] = kv_len, cu[s] + q_len
    cu[len(mix) + 1 :] = cu[len(mix)]
    pages = jax.random.permutation(ks[4], total)[: max_seqs * pages_per_seq].astype(jnp.int32)
    sinks = jax.random.normal(ks[5], (q_heads,), jnp.float32) * 2 if sink else None
    return (q, k, v, cache, jnp.asarray(kv_lens), pages, jnp.asarray(cu), jnp.array(dist, jnp.int32), sinks)


def reference(q, k, v, cache, kv_lens, page_indices, cu_q_lens, distribution, sink=None, *, sm_scale=1.0,
              sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, **_):  # fmt: skip
    """float64 numpy: (outputs of the cu_q_lens[k] tokens, the updated cache in its dtype)."""
    pages, ps, _, _, hd = cache.shape
    kv_heads, width = k.shape[1], q.shape[2]
    groups = q.shape[1] // kv_heads
    per_seq = page_indices.shape[0] // kv_lens.shape[0]
    new_cache = np.array(cache).reshape(pages, ps, 2 * kv_heads, hd)
    idx = np.asarray(page_indices)
    pad = ((0, 0), (0, 0), (0, hd - width))  # new K/V zero-padded to the cache's head_dim
    kk, vv = np.pad(np.array(k.astype(cache.dtype)), pad), np.pad(np.array(v.astype(cache.dtype)), pad)
    cu, lens = np.asarray(cu_q_lens), np.asarray(kv_lens)
    n = int(distribution[2])
    for s in range(n):
        for i, t in enumerate(range(cu[s], cu[s + 1])):
            pos = lens[s] - (cu[s + 1] - cu[s]) + i
            page = idx[s * per_seq + pos // ps]
            new_cache[page, pos % ps, 0::2] = kk[t]
            new_cache[page, pos % ps, 1::2] = vv[t]
    kv64 = new_cache.astype(np.float32).astype(np.float64)
    qs = np.asarray(q.astype(jnp.float32), np.float64)
    out = np.zeros((int(cu[n]), q.shape[1], width))
    for s in range(n):
        m = int(lens[s])
        rows = np.arange(m)
        toks = kv64[idx[s * per_seq + rows // ps], rows % ps]
        for t in range(cu[s], cu[s + 1]):
            pos = m - (cu[s + 1] - cu[s]) + (t - cu[s])
            seen = rows <= pos
            if sliding_window is not None:
                seen &= rows > pos - sliding_window
            for h in range(q.shape[1]):
                kh = toks[:, 2 * (h // groups), :width] * (k_scale or 1.0)
                vh = toks[:, 2 * (h // groups) + 1, :width] * (v_scale or 1.0)
                logits = (kh @ qs[t, h]) * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                top = logits[seen].max() if sink is None else max(logits[seen].max(), float(sink[h]))
                p = np.where(seen, np.exp(logits - top), 0.0)
                denom = p.sum() + (0.0 if sink is None else np.exp(float(sink[h]) - top))
                out[t, h] = (p / denom) @ vh
    return out, new_cache.reshape(cache.shape)


def check(out, new_cache, args, ref, tol):
    q, cache = args[0], args[3]
    assert out.shape == q.shape and new_cache.shape == cache.shape and new_cache.dtype == cache.dtype
    ref_out, ref_cache = ref
    np.testing.assert_allclose(np.asarray(out[: ref_out.shape[0]], np.float64), ref_out, rtol=tol, atol=tol)
    got = np.asarray(new_cache).view(np.uint8)
    np.testing.assert_array_equal(got, ref_cache.view(np.uint8))  # written and untouched, bit for bit


# (inputs' keywords, op's keywords, tolerance)
CASES = {
    # float32: both paths of the kernel, KV blocks of 3 pages, window, soft cap, sm_scale, a sink.
    "f32_window_soft_cap_sink": (
        dict(sink=True),
        dict(sm_scale=0.09, sliding_window=7, soft_cap=3.0, num_kv_pages_per_block=3, num_queries_per_block=16),
        2e-5,
    ),
    # bf16, blocks chosen by the op, 4 q heads per KV head, head_dim 64 padded to the cache's 128.
    "bf16_default_blocks_hd64": (
        dict(q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, q_heads=8, width=64), dict(sm_scale=0.125), 3e-2,
    ),
    # A float8 cache with k_scale/v_scale and q_scale, one q head per KV head, pages of 16.
    "fp8_scaled": (
        dict(q_dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, q_heads=4, kv_heads=4, page_size=16, pages_per_seq=4),
        dict(sm_scale=0.09, k_scale=0.5, v_scale=0.25, num_kv_pages_per_block=2, num_queries_per_block=8),
        3e-2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@every_way(op=True)
def test_ragged_paged_attention_v3(way, case):
    shape, kw, tol = CASES[case]
    args = inputs(len(case), **shape)
    ref = reference(*args, **kw)
    fresh = list(args)
    fresh[3] = jnp.array(args[3], copy=True)  # the op donates its cache
    out, new_cache = way.op(v3.ragged_paged_attention, *fresh, **kw)
    check(out, new_cache, args, ref, way.dot_tol(tol, args[0].dtype))


def test_int8_cache_q_scale_and_out_dtype():
    """An int8 cache with q_scale (queries quantized like the cache), a float32 output."""
    args = inputs(7, q_dtype=jnp.bfloat16, kv_dtype=jnp.int8, kv_heads=2, q_heads=4)
    kw = dict(sm_scale=0.01, q_scale=0.05, k_scale=0.5, v_scale=0.25)
    fresh = list(args)
    fresh[3] = jnp.array(args[3], copy=True)
    out, new_cache = v3.ragged_paged_attention(*fresh, **kw, out_dtype=jnp.float32, interpret=True)
    assert out.dtype == jnp.float32
    q8 = jnp.clip(args[0].astype(jnp.float32) / 0.05, -128, 127).astype(jnp.int8).astype(jnp.float32) * 0.05
    ref = reference(q8, *args[1:], **kw)
    check(out, new_cache, args, ref, 2e-3)


def test_plain_jax_reference():
    """The module's plain-JAX reference against numpy, with a sink and a window."""
    args = inputs(3, sink=True)
    kw = dict(sm_scale=0.09, sliding_window=9, soft_cap=4.0)
    out, cache = v3.ref_ragged_paged_attention(*args, **kw)
    check(jnp.pad(out, ((0, 48 - out.shape[0]), (0, 0), (0, 0))), cache, args, reference(*args, **kw), 1e-5)


def test_decodes_only_under_jit():
    """A batch of decodes only (distribution (k, k, k)) of fewer tokens than a page holds, the
    op under an outer jit."""
    mix = [(1, 5), (1, 17), (1, 64), (1, 1)]
    args = inputs(11, mix, (4, 4, 4), tokens=8, page_size=16, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
    ref = reference(*args)
    fresh = list(args)
    fresh[3] = jnp.array(args[3], copy=True)
    out, new_cache = jax.jit(lambda *a: v3.ragged_paged_attention(*a, interpret=True))(*fresh)
    check(out, new_cache, args, ref, 3e-2)


def _call(**changes):
    names = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution",
             "attention_sink")  # fmt: skip
    args = dict(zip(names, inputs(5)))
    kw = {n: changes.pop(n) for n in list(changes) if n not in args}
    args.update(changes)
    return lambda: v3.ragged_paged_attention(*args.values(), **kw, interpret=True)


_C = (83, 8, 2, 2, 128)
BAD_CALLS = {
    "queries 2-d": (_call(queries=jnp.ones((48, 512))), ValueError, r"queries must be \[max_num_tokens"),
    "keys tokens": (_call(keys=jnp.ones((40, 2, 128))), ValueError, r"keys must be \[max_num_tokens=48"),
    "values shape": (_call(values=jnp.ones((48, 1, 128))), ValueError, "values' shape"),
    "cache 4-d": (_call(kv_cache=jnp.ones((83, 8, 4, 128))), ValueError, "kv_cache must be .*get_kv_cache_shape"),
    "cache dtype": (_call(kv_cache=jnp.ones(_C, jnp.int16)), TypeError, "kv_cache must be one of"),
    "cache heads": (_call(kv_cache=jnp.ones((83, 8, 3, 1, 128))), ValueError, r"kv_cache must have shape \(83, 8, 4, 1, 128\)"),
    "q dtype": (_call(queries=jnp.ones((48, 4, 128), jnp.float16)), TypeError, "queries must be float32 or bfloat16"),
    "keys dtype": (_call(keys=jnp.ones((48, 2, 128), jnp.int32)), TypeError, "keys must be floating"),
    "q heads": (_call(queries=jnp.ones((48, 3, 128))), ValueError, "num_q_heads=3 must be a multiple of num_kv_heads=2"),
    "padded 8-bit heads": (_call(keys=jnp.ones((48, 1, 128)), values=jnp.ones((48, 1, 128)),
                                 kv_cache=jnp.ones((83, 8, 1, 4, 128), jnp.int8)), ValueError, "no padded heads"),
    "page_indices 2-d": (_call(page_indices=jnp.zeros((10, 8), jnp.int32)), ValueError, r"page_indices must be \[max_num_seqs \* pages_per_seq\]"),
    "cu_q_lens shape": (_call(cu_q_lens=jnp.zeros(10, jnp.int32)), ValueError, r"cu_q_lens must have shape \(11,\)"),
    "distribution shape": (_call(distribution=jnp.zeros(2, jnp.int32)), ValueError, r"distribution must have shape \(3,\)"),
    "kv_lens dtype": (_call(kv_lens=jnp.zeros(10, jnp.float32)), ValueError, "kv_lens must be int32"),
    "sink shape": (_call(attention_sink=jnp.zeros(3)), ValueError, r"attention_sink must be float32\[4\]"),
    "q_scale type": (_call(q_scale=1), TypeError, "q_scale must be a float or None"),
    "sliding window": (_call(sliding_window=0), ValueError, "sliding_window=0 must be a positive int"),
    "soft cap": (_call(soft_cap=0.0), ValueError, "soft_cap=0.0 must not be 0.0"),
    "chunk prefill": (_call(chunk_prefill_size=0), ValueError, "chunk_prefill_size=0 must be positive"),
    "kv pages per block": (_call(num_kv_pages_per_block=9), ValueError, r"num_kv_pages_per_block=9 must be in \(0, 8\]"),
    "queries per block": (_call(num_queries_per_block=0), ValueError, "num_queries_per_block=0 must be positive"),
    "vmem limit": (_call(vmem_limit_bytes=-1), ValueError, "vmem_limit_bytes=-1 must be positive"),
    "out dtype": (_call(out_dtype=jnp.int8), TypeError, "out_dtype must be float32, bfloat16 or None"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments(case):
    call, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=message):
        call()


DYNAMIC_BAD = {
    "distribution order": (dict(distribution=jnp.array([5, 3, 8], jnp.int32)), r"distribution=\[5, 3, 8\] must satisfy"),
    "decode of 5 tokens": (dict(distribution=jnp.array([4, 5, 8], jnp.int32)), "sequence 3 is a decode .* has 5 query tokens"),
    "too few pages": (dict(kv_lens=jnp.full(10, 65, jnp.int32)), "kv_lens 65 exceed pages_per_seq=8 pages of 8"),
    "tokens past queries": (dict(queries=jnp.ones((40, 4, 128)), keys=jnp.ones((40, 2, 128)), values=jnp.ones((40, 2, 128))),
                            "end within queries' 40 rows"),
    "more queries than keys": (dict(kv_lens=jnp.full(10, 4, jnp.int32)), "sequence 3 has 5 query tokens and kv_lens 4"),
    "page out of range": (dict(page_indices=jnp.full(80, 83, jnp.int32)), r"page_indices \[83.*must be in \[0, 83\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", DYNAMIC_BAD)
def test_dynamic_validate_inputs(case):
    changes, message = DYNAMIC_BAD[case]
    names = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")
    args = dict(zip(names, inputs(5)[:8]))
    good = tuple(args.values())
    args.update(changes)
    with pytest.raises(ValueError, match=message):
        v3.dynamic_validate_inputs(*args.values())
    v3.dynamic_validate_inputs(*good)  # the unchanged inputs pass
