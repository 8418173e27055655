"""Ragged paged attention as vLLM's TPU backend calls it (the ``v3`` kernel of the
``tpu-inference`` project): the new tokens' keys and values are written into the paged cache
by the kernel, which then attends, and ``(output, updated kv_cache)`` come back.

``kv_cache`` is ``[total_num_pages, page_size, num_kv_heads * 2 // kv_packing, kv_packing,
head_dim]`` (``get_kv_cache_shape``): a token's combined heads alternate K and V (head ``2h``
is K of KV head ``h``, ``2h + 1`` its V), ``kv_packing`` of them to a 32-bit word, and
``head_dim`` a multiple of 128 (queries, keys and values may be narrower: zero-padded). The
cache is donated: the kernel's cache output is its input's buffer (``input_output_aliases``).

Sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]`` (``q_len`` tokens) and its new
keys/values are the same rows of ``keys``/``values``; they take cache positions ``[kv_lens[s]
- q_len, kv_lens[s])`` of the pages ``page_indices[s * pages_per_seq:]``, and its queries attend
causally to the ``kv_lens[s]`` keys. ``distribution = (i, j, k)``: sequences ``[0, i)`` are
decodes (one query token each), ``[i, j)`` chunked prefills, ``[j, k)`` mixed; ``k`` is the
number of sequences.

The kernel is the one of ``kernel.ragged_paged_attention`` (its docstring says how it works)
with the cache update in front: at the first grid step every new token's K/V run of each page
is DMA'd from HBM into the cache's page in HBM (``_update``), and all are waited for before any
page is read; decode sequences take the kernel's narrow path (a few score rows, not the
block's). An attention sink (a per-q-head logit of a key with value 0) starts each row's online
softmax: ``m = sink``, ``l = 1``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tpu.ops.ragged_paged_attention import _validate
from pallas_tpu.ops.ragged_paged_attention._kernel import DEFAULT_MASK_VALUE
from pallas_tpu.ops.ragged_paged_attention._kernel import call as _call
from pallas_tpu.ops.ragged_paged_attention._kernel import plan_for as _plan_for
from pallas_tpu.ops.ragged_paged_attention._validate import get_dtype_packing

_OP = "ragged_paged_attention v3"


def align_to(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return -(-x // a) * a


def get_kv_cache_shape(total_num_pages, page_size, actual_num_kv_heads, actual_head_dim, kv_dtype):
    """The ``kv_cache`` shape for these sizes (``head_dim`` rounded up to 128)."""
    packing = get_dtype_packing(kv_dtype)
    combined = align_to(actual_num_kv_heads * 2, packing)
    return (total_num_pages, page_size, combined // packing, packing, align_to(actual_head_dim, 128))


def static_validate_inputs(
    queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink=None,
    *, sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=None, q_scale=None, k_scale=None,
    v_scale=None, chunk_prefill_size=None, num_kv_pages_per_block=None, num_queries_per_block=None,
    vmem_limit_bytes=None, out_dtype=None,
):  # fmt: skip
    """vLLM's call checked before it is traced: the arrays' shapes and dtypes (the cache's by
    ``get_kv_cache_shape``) and the static options; a ValueError or TypeError names the argument."""
    del sm_scale, mask_value  # any value
    _validate.check_ndim(_OP, "queries", queries, 3, "[max_num_tokens, num_q_heads, head_dim]")
    for name, x in (("keys", keys), ("values", values)):
        if x.ndim != 3 or x.shape[0] != queries.shape[0] or x.shape[2] != queries.shape[2]:
            raise ValueError(
                f"{_OP}: {name} must be [max_num_tokens={queries.shape[0]}, num_kv_heads, "
                f"head_dim={queries.shape[2]}] like queries, got {x.shape}"
            )
    if values.shape != keys.shape:
        raise ValueError(f"{_OP}: values' shape {values.shape} differs from keys' {keys.shape}")
    layout = "[total_num_pages, page_size, num_kv_heads * 2 // kv_packing, kv_packing, head_dim] (get_kv_cache_shape)"
    _validate.check_ndim(_OP, "kv_cache", kv_cache, 5, layout)
    _validate.check_dtypes(_OP, "queries", queries.dtype, "kv_cache", kv_cache.dtype)
    for name, x in (("keys", keys), ("values", values)):
        if not jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != kv_cache.dtype:
            raise TypeError(f"{_OP}: {name} must be floating or kv_cache's {kv_cache.dtype}, got {x.dtype}")
    num_q_heads, num_kv_heads, head_dim = queries.shape[1], keys.shape[1], queries.shape[2]
    page_size = kv_cache.shape[1]
    want = get_kv_cache_shape(kv_cache.shape[0], page_size, num_kv_heads, head_dim, kv_cache.dtype)
    if kv_cache.shape != want:
        raise ValueError(f"{_OP}: kv_cache must have shape {want} (get_kv_cache_shape), got {kv_cache.shape}")
    if (2 * num_kv_heads) % get_dtype_packing(kv_cache.dtype):
        raise ValueError(
            f"{_OP}: a {kv_cache.dtype} cache needs num_kv_heads * 2 in multiples of "
            f"{get_dtype_packing(kv_cache.dtype)} (no padded heads), got num_kv_heads={num_kv_heads}"
        )
    _validate.check_heads(_OP, num_q_heads, num_kv_heads)
    _validate.check_ndim(_OP, "kv_lens", kv_lens, 1, "[max_num_seqs]")
    max_num_seqs = kv_lens.shape[0]
    if page_indices.ndim != 1 or page_indices.shape[0] % max_num_seqs:
        raise ValueError(
            f"{_OP}: page_indices must be [max_num_seqs * pages_per_seq] with max_num_seqs={max_num_seqs}, "
            f"got shape {page_indices.shape}"
        )
    if distribution.shape != (3,):
        raise ValueError(f"{_OP}: distribution must have shape (3,), got {distribution.shape}")
    _validate.check_tables(_OP, max_num_seqs, kv_lens=kv_lens, page_indices=page_indices,
                           cu_q_lens=cu_q_lens, distribution=distribution)  # fmt: skip
    if attention_sink is not None and (
        attention_sink.shape != (num_q_heads,) or attention_sink.dtype != jnp.float32
    ):
        raise ValueError(
            f"{_OP}: attention_sink must be float32[{num_q_heads}] (one logit per q head), "
            f"got {attention_sink.dtype}{list(attention_sink.shape)}"
        )
    _validate.check_options(
        _OP, page_indices.shape[0] // max_num_seqs, scales=dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale),
        sliding_window=sliding_window, soft_cap=soft_cap, num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes,
        chunk_prefill_size=chunk_prefill_size,
    )  # fmt: skip
    if out_dtype is not None and np.dtype(out_dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise TypeError(f"{_OP}: out_dtype must be float32, bfloat16 or None, got {np.dtype(out_dtype)}")


def dynamic_validate_inputs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                            attention_sink=None, **kwargs):  # fmt: skip
    """``static_validate_inputs``, then the checks of the values (concrete arrays, not under
    ``jit``): ``distribution`` ordered within the tables, decodes of one token, every page list
    long enough, the tokens within ``queries``, no sequence with more queries than keys, and
    every page index within the cache."""
    args = (queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink)
    static_validate_inputs(*args, **kwargs)
    max_num_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // max_num_seqs
    page_size = kv_cache.shape[1]
    d = [int(x) for x in np.asarray(distribution)]
    if not 0 <= d[0] <= d[1] <= d[2] <= max_num_seqs:
        raise ValueError(
            f"{_OP}: distribution={d} must satisfy 0 <= i <= j <= k <= max_num_seqs={max_num_seqs}"
        )
    n = d[2]
    kv, cu = np.asarray(kv_lens), np.asarray(cu_q_lens)
    if cu[0] != 0 or cu[n] > queries.shape[0]:
        raise ValueError(
            f"{_OP}: cu_q_lens must start at 0 and end within queries' {queries.shape[0]} rows, got {cu[: n + 1]}"
        )
    for s in range(n):
        q_len = cu[s + 1] - cu[s]
        _validate.check_sequence(_OP, s, q_len, kv[s])
        if s < d[0] and q_len > 1:
            raise ValueError(
                f"{_OP}: sequence {s} is a decode (distribution[0]={d[0]}) but has {q_len} query tokens"
            )
        if kv[s] > pages_per_seq * page_size:
            raise ValueError(
                f"{_OP}: sequence {s}'s kv_lens {kv[s]} exceed pages_per_seq={pages_per_seq} pages of {page_size}"
            )
        used = np.asarray(page_indices)[s * pages_per_seq : s * pages_per_seq + -(-int(kv[s]) // page_size)]
        if used.size and not (0 <= used.min() and used.max() < kv_cache.shape[0]):
            raise ValueError(f"{_OP}: sequence {s}'s page_indices {used} must be in [0, {kv_cache.shape[0]})")


def _merge(keys, values, kv_cache):
    """``[tokens, combined heads, head_dim]`` in the cache's dtype: K and V of each head
    alternating, zero-padded to the cache's head_dim."""
    hd = kv_cache.shape[-1]
    pad = ((0, 0), (0, 0), (0, hd - keys.shape[2]))
    kv = jnp.stack([jnp.pad(keys, pad), jnp.pad(values, pad)], axis=2)
    return kv.reshape(keys.shape[0], 2 * keys.shape[1], hd).astype(kv_cache.dtype)


def _quantized_queries(queries, kv_dtype, q_scale):
    """``queries / q_scale`` in the cache's dtype (clipped to its range), back in queries' dtype."""
    q = queries.astype(jnp.float32) / q_scale
    info = jnp.finfo(kv_dtype) if jnp.issubdtype(kv_dtype, jnp.floating) else jnp.iinfo(kv_dtype)
    return jnp.clip(q, float(info.min), float(info.max)).astype(kv_dtype).astype(queries.dtype)


def ref_ragged_paged_attention(
    queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink=None,
    *, sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=None, q_scale=None, k_scale=None,
    v_scale=None, out_dtype=None,
):  # fmt: skip
    """Plain JAX (concrete tables): the cache updated, then each sequence's attention;
    ``(outputs of the cu_q_lens[k] tokens, updated kv_cache)``."""
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
              q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype)  # fmt: skip
    args = (queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink)
    dynamic_validate_inputs(*args, **kw)
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    out_dtype = out_dtype or queries.dtype
    pages, page_size, _, _, hd = kv_cache.shape
    kv_heads, groups, width = keys.shape[1], queries.shape[1] // keys.shape[1], queries.shape[2]
    pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]
    new = _merge(keys, values, kv_cache)
    flat = kv_cache.reshape(pages * page_size, 2 * kv_heads, hd)
    if q_scale is not None:
        queries, sm_scale = _quantized_queries(queries, kv_cache.dtype, q_scale), sm_scale * q_scale
    outs = []
    for s in range(int(distribution[2])):
        lo, hi, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        pos = jnp.arange(kv_len)
        rows = jnp.asarray(page_indices)[s * pages_per_seq + pos // page_size] * page_size + pos % page_size
        flat = flat.at[rows[kv_len - (hi - lo) :]].set(new[lo:hi])
        cache = flat[rows].astype(jnp.float32)
        k, v = cache[:, 0::2, :width], cache[:, 1::2, :width]
        k, v = k * (k_scale or 1.0), v * (v_scale or 1.0)
        qs = queries[lo:hi].astype(jnp.float32).reshape(hi - lo, kv_heads, groups, width)
        logits = jnp.einsum("tngd,snd->ngts", qs, k) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        q_pos = kv_len - (hi - lo) + jnp.arange(hi - lo)[:, None]
        hidden = pos[None, :] > q_pos
        if sliding_window is not None:
            hidden |= pos[None, :] <= q_pos - sliding_window
        logits = jnp.where(hidden, mask_value, logits)
        if attention_sink is not None:
            sink = jnp.broadcast_to(
                attention_sink.reshape(kv_heads, groups, 1, 1), (kv_heads, groups, hi - lo, 1)
            )
            weights = jax.nn.softmax(jnp.concatenate([sink, logits], axis=-1), axis=-1)[..., 1:]
        else:
            weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("ngts,snd->tngd", weights, v).reshape(hi - lo, kv_heads * groups, width)
        outs.append(out.astype(out_dtype))
    out = jnp.concatenate(outs, axis=0) if outs else jnp.zeros((0,) + queries.shape[1:], out_dtype)
    return out, flat.reshape(kv_cache.shape)


_STATIC = ("sm_scale", "sliding_window", "soft_cap", "mask_value", "q_scale", "k_scale", "v_scale",
           "chunk_prefill_size", "num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes", "out_dtype",
           "interpret")  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=["kv_cache"])
def ragged_paged_attention(
    queries: jax.Array, keys: jax.Array, values: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
    page_indices: jax.Array, cu_q_lens: jax.Array, distribution: jax.Array, attention_sink: jax.Array | None = None,
    *, sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
    mask_value: float | None = None, q_scale: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None, chunk_prefill_size: int | None = None, num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None, vmem_limit_bytes: int | None = None, out_dtype=None, interpret=False,
):  # fmt: skip
    """Writes the new tokens' K/V into the paged cache, then ragged paged attention over a
    batch of decodes, chunked prefills and mixed sequences.

    Args:
      queries: ``[max_num_tokens, num_q_heads, head_dim]``: all sequences' queries, concatenated.
      keys, values: ``[max_num_tokens, num_kv_heads, head_dim]``: their new keys and values
        (cast to the cache's dtype: quantized by the caller for an 8-bit cache).
      kv_cache: ``get_kv_cache_shape(...)``: the paged cache (bfloat16, float32, int8 or
        float8), donated.
      kv_lens: ``int32[max_num_seqs]``: keys per sequence, the new ones included.
      page_indices: ``int32[max_num_seqs * pages_per_seq]``: each sequence's pages.
      cu_q_lens: ``int32[max_num_seqs + 1]``: cumulative query lengths.
      distribution: ``int32[3]``, ``(i, j, k)``: sequences ``[0, i)`` decode, ``[i, j)``
        chunked prefill, ``[j, k)`` mixed; ``k`` sequences in all.
      attention_sink: None or ``float32[num_q_heads]``: a sink logit per q head, a key of
        value 0 in every softmax.
      sm_scale: multiplies ``q @ k.T``; sliding_window: a query sees its last
        ``sliding_window`` keys; soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``;
        mask_value: the logit of masked keys (None: ``DEFAULT_MASK_VALUE``).
      q_scale: queries are quantized to the cache's dtype as ``queries / q_scale`` and the
        logits multiplied by ``q_scale``; k_scale, v_scale: the cache's keys (values) are
        multiplied by them.
      chunk_prefill_size: accepted for vLLM's call (checked, not used: the blocks are chosen
        by ``tuned_block_sizes``).
      num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes: the blocks, as in
        ``kernel.ragged_paged_attention`` (None: chosen from the chip's facts).
      out_dtype: the output's dtype (None: ``queries``').
      interpret: run in TPU interpret mode (``True`` or ``pltpu.InterpretParams``).

    Returns:
      ``(output [max_num_tokens, num_q_heads, head_dim], updated kv_cache)``; output rows past
      ``cu_q_lens[k]`` are unspecified, and the cache's other entries unchanged.
    """
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
              q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, chunk_prefill_size=chunk_prefill_size,
              num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block,
              vmem_limit_bytes=vmem_limit_bytes, out_dtype=out_dtype)  # fmt: skip
    static_validate_inputs(
        queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sink, **kw
    )
    tokens, num_q_heads, width = queries.shape
    _, page_size, _, _, head_dim = kv_cache.shape
    q = queries
    if q_scale is not None:
        q, sm_scale = _quantized_queries(q, kv_cache.dtype, q_scale), sm_scale * q_scale
    q = jnp.pad(q, ((0, 0), (0, 0), (0, head_dim - width)))
    table = (kv_lens.shape[0], page_indices.shape[0] // kv_lens.shape[0])
    plan = _plan_for(
        q.dtype, kv_cache.dtype, tokens, num_q_heads, keys.shape[1], head_dim, page_size, table,
        (num_kv_pages_per_block, num_queries_per_block), sliding_window, soft_cap, mask_value, k_scale, v_scale,
        update_cache=True, num_seqs_slot=2, attention_sink=attention_sink is not None,
    )  # fmt: skip
    new_kv = _merge(keys, values, kv_cache).reshape((tokens,) + kv_cache.shape[2:])
    out, cache = _call(
        plan, q, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, float(sm_scale), vmem_limit_bytes,
        interpret, new_kv=new_kv, sink=attention_sink, out_dtype=out_dtype or queries.dtype,
    )  # fmt: skip
    return out[:, :, :width], cache
