"""Ragged paged attention for TPUs (mixed prefill and decode), written with pallas-tpu, with the
names and call signatures of JAX's ``ops.tpu.ragged_paged_attention.kernel``.

The queries of all sequences are concatenated (``q``: ``[max_num_batched_tokens, num_q_heads,
head_dim]``, sequence ``s`` owning rows ``cu_q_lens[s]:cu_q_lens[s+1]``); each attends causally
to its sequence's ``kv_lens[s]`` keys, its last query token sitting at the last key. Keys and
values share one paged cache, ``kv_pages``: ``[total_num_pages, page_size, 2 * num_kv_heads,
head_dim]``, a token's combined heads alternating K and V (head ``2h`` is K of KV head ``h``,
``2h + 1`` its V). As in JAX 0.11.2's op (and 0.10.2's, the same), the cache is read only: new
keys are written into it by the caller.

How the kernel works:

* The grid walks query blocks of ``num_queries_per_block`` tokens; a block's rows are laid out
  per KV head as (token, q head of the group) pairs, ``[num_kv_heads, tokens * groups,
  head_dim]`` (an XLA transpose in and out), so one matmul serves a KV head's whole group.
* Inside a step, the sequences with rows in the block are work items, each walking the KV
  blocks (``num_kv_pages_per_block`` pages) its rows' causal and sliding-window span covers:
  blocks wholly before the window or after the last row's key are never copied. The lengths,
  offsets and page table are scalar-prefetched (SMEM); the pages stay in HBM (``ANY``) and are
  copied, one DMA per page of all heads, into a VMEM double buffer. The next KV block (of this
  item, the next sequence, or the next grid step's first item) is always in flight while one
  is computed.
* A sequence with few rows in the block (a decode) runs a narrow path over an aligned window
  of 8 (or 16) tokens rather than the whole block, so a block of decodes costs each one a few
  score rows, not the block's.
* K and V of one head share 32-bit words (16-bit caches: low half K; 8-bit: two bytes), so a
  head's keys and values come from one sublane-strided load and are split with shifts.
* The online softmax keeps ``m``, ``l`` and the unnormalized output in VMEM per row; masks are
  selects (``mask_value``), so stale VMEM never reaches a sum.
* Accuracy: ``q`` enters the score matmul as given (never pre-scaled and rounded);
  ``sm_scale * k_scale`` is one float32 multiply a score; the float32 probabilities meet the
  values as two 16-bit parts (two matmuls of exact products), so the only roundings beyond
  float32 are the output's own.

Rows of ``q`` past ``cu_q_lens[num_seqs]`` get unspecified values (JAX's op leaves them too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tpu as pltpu
from pallas_tpu.ops.ragged_paged_attention import _validate
from pallas_tpu.ops.ragged_paged_attention._kernel import DEFAULT_MASK_VALUE as DEFAULT_MASK_VALUE
from pallas_tpu.ops.ragged_paged_attention._kernel import call as _call
from pallas_tpu.ops.ragged_paged_attention._kernel import plan_for as _plan_for
from pallas_tpu.ops.ragged_paged_attention._validate import get_dtype_packing as get_dtype_packing
from pallas_tpu.ops.ragged_paged_attention.tuned_block_sizes import (
    get_tuned_block_sizes as get_tuned_block_sizes,
)

_OP = "ragged_paged_attention"


def _tiles_whole(rows: int, packing: int) -> bool:
    """Whether ``rows`` rows of a dtype packing ``packing`` per 32-bit word fill XLA's TPU tiles
    of a second-minor dimension: whole words, and 1, 2, 4, 8 or a multiple of 8 of them."""
    if rows % packing:
        return False
    words = rows // packing
    return words in (1, 2, 4, 8) or words % 8 == 0


def get_min_heads_per_blk(num_q_heads, num_combined_kv_heads, q_dtype, kv_dtype):
    """JAX's head block of its ragged kernel: ``(q heads, combined K/V heads)`` per block, the
    fewest heads whose blocks tile whole (one full sublane tile of combined K/V heads, 8 words of
    ``kv_dtype``, where that divides them, and the q heads that go with them), else every head.
    Raises ValueError when the combined K/V heads cannot tile at all. Ours' kernel takes every
    head of a KV block at once and does not ask this; it answers as JAX's for code that does."""
    q_packing, kv_packing = get_dtype_packing(q_dtype), get_dtype_packing(kv_dtype)
    if not _tiles_whole(num_combined_kv_heads, kv_packing):
        raise ValueError(
            f"get_min_heads_per_blk: num_combined_kv_heads={num_combined_kv_heads} of "
            f"{np.dtype(kv_dtype).name} does not fill whole TPU tiles (whole 32-bit words: 1, 2, 4, "
            f"8 or a multiple of 8 of them)"
        )
    if num_combined_kv_heads % 2 or num_q_heads % (num_combined_kv_heads // 2):
        raise ValueError(
            f"get_min_heads_per_blk: num_q_heads={num_q_heads} must be a multiple of the "
            f"{num_combined_kv_heads // 2} KV heads in num_combined_kv_heads={num_combined_kv_heads}"
        )
    group = num_q_heads // (num_combined_kv_heads // 2)
    tile = 8 * kv_packing
    kv_block = tile if num_combined_kv_heads % tile == 0 else num_combined_kv_heads
    q_block = kv_block // 2 * group
    if _tiles_whole(q_block, q_packing):
        return q_block, kv_block
    return num_q_heads, num_combined_kv_heads


def static_validate_inputs(
    q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
    num_seqs: jax.Array, *, sm_scale: float | None = None, sliding_window: int | None = None,
    soft_cap: float | None = None, mask_value: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None, num_kv_pages_per_block: int | None = None, num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
):  # fmt: skip
    """JAX's checks of the arguments' shapes, dtypes and static options (at trace time), each
    failure a ValueError or TypeError naming the argument and what it must be."""
    del sm_scale, mask_value  # any value
    _validate.check_ndim(_OP, "q", q, 3, "[max_num_batched_tokens, num_q_heads, head_dim]")
    _validate.check_ndim(
        _OP, "kv_pages", kv_pages, 4, "[total_num_pages, page_size, num_combined_kv_heads, head_dim]"
    )
    _, num_q_heads, head_dim = q.shape
    _, _, combined, head_dim_k = kv_pages.shape
    if combined % 2:
        raise ValueError(f"{_OP}: kv_pages' combined heads ({combined}) must be even: K and V alternate")
    if head_dim_k != head_dim:
        raise ValueError(f"{_OP}: q's head_dim {head_dim} differs from kv_pages' {head_dim_k}")
    _validate.check_heads(_OP, num_q_heads, combined // 2)
    _validate.check_ndim(_OP, "page_indices", page_indices, 2, "[max_num_seqs, pages_per_seq]")
    max_num_seqs, pages_per_seq = page_indices.shape
    if num_seqs.shape != (1,):
        raise ValueError(f"{_OP}: num_seqs must have shape (1,), got {num_seqs.shape}")
    if kv_lens.shape != (max_num_seqs,):
        raise ValueError(
            f"{_OP}: kv_lens must have shape ({max_num_seqs},) (page_indices' rows), got {kv_lens.shape}"
        )
    _validate.check_tables(_OP, max_num_seqs, kv_lens=kv_lens, page_indices=page_indices,
                           cu_q_lens=cu_q_lens, num_seqs=num_seqs)  # fmt: skip
    _validate.check_dtypes(_OP, "q", q.dtype, "kv_pages", kv_pages.dtype)
    if combined % get_dtype_packing(kv_pages.dtype):
        raise ValueError(
            f"{_OP}: {kv_pages.dtype} kv_pages need combined heads in multiples of "
            f"{get_dtype_packing(kv_pages.dtype)} (one 32-bit word), got {combined}"
        )
    _validate.check_options(
        _OP, pages_per_seq, scales=dict(k_scale=k_scale, v_scale=v_scale), sliding_window=sliding_window,
        soft_cap=soft_cap, num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes,
    )  # fmt: skip


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs):
    """``static_validate_inputs``, then the checks of the values (concrete arrays, not under
    ``jit``): ``num_seqs`` within the tables, every page list long enough, the query tokens
    within ``q``, and no sequence with more queries than keys."""
    static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs)
    page_size = kv_pages.shape[1]
    max_num_seqs, pages_per_seq = page_indices.shape
    n = int(num_seqs[0])
    if not 0 <= n <= max_num_seqs:
        raise ValueError(f"{_OP}: num_seqs[0]={n} must be in [0, {max_num_seqs}] (page_indices' rows)")
    kv, cu = np.asarray(kv_lens), np.asarray(cu_q_lens)
    longest = int(kv[:n].max(initial=0))
    if pages_per_seq * page_size < longest:
        raise ValueError(
            f"{_OP}: pages_per_seq={pages_per_seq} pages of {page_size} hold fewer than the longest kv_lens {longest}"
        )
    if cu[n] > q.shape[0]:
        raise ValueError(f"{_OP}: cu_q_lens[num_seqs]={cu[n]} query tokens exceed q's {q.shape[0]} rows")
    for s in range(n):
        _validate.check_sequence(_OP, s, cu[s + 1] - cu[s], kv[s])


def ref_ragged_paged_attention(
    queries: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
    num_seqs: jax.Array, *, sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE, k_scale: float | None = None, v_scale: float | None = None,
):  # fmt: skip
    """Plain JAX, one sequence at a time (concrete ``num_seqs`` and ``cu_q_lens``): the
    outputs of the ``cu_q_lens[num_seqs]`` query tokens."""
    static_validate_inputs(
        queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else mask_value
    _, page_size, combined, head_dim = kv_pages.shape
    kv_heads = combined // 2
    groups = queries.shape[1] // kv_heads
    outs = []
    for s in range(int(num_seqs[0])):
        lo, hi, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        cache = kv_pages[page_indices[s]].reshape(-1, combined, head_dim)[:kv_len]
        k, v = cache[:, 0::2], cache[:, 1::2]
        if k_scale is not None:
            k = (k.astype(jnp.float32) * k_scale).astype(queries.dtype)
        if v_scale is not None:
            v = (v.astype(jnp.float32) * v_scale).astype(queries.dtype)
        qs = queries[lo:hi].reshape(hi - lo, kv_heads, groups, head_dim)
        logits = jnp.einsum("tngd,snd->ngts", qs, k, preferred_element_type=jnp.float32) * sm_scale
        q_pos = kv_len - (hi - lo) + jnp.arange(hi - lo)[:, None]
        k_pos = jnp.arange(kv_len)[None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = logits + jnp.where(hidden, mask_value, 0.0)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("ngts,snd->tngd", weights, v).reshape(hi - lo, kv_heads * groups, head_dim)
        outs.append(out.astype(queries.dtype))
    return jnp.concatenate(outs, axis=0)


_STATIC = ("sm_scale", "mask_value", "num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes",
           "sliding_window", "soft_cap", "k_scale", "v_scale", "interpret")  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention(
    q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
    num_seqs: jax.Array, *, sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE, k_scale: float | None = None, v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None, num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None, interpret=False,
):  # fmt: skip
    """Ragged paged attention over a batch that mixes prefills and decodes.

    Args:
      q: ``[max_num_batched_tokens, num_q_heads, head_dim]``: all sequences' queries, concatenated.
      kv_pages: ``[total_num_pages, page_size, 2 * num_kv_heads, head_dim]``: the paged cache, K
        and V of each KV head interleaved (float32, bfloat16, int8 or float8).
      kv_lens: ``int32[max_num_seqs]``: keys per sequence (the first ``num_seqs`` are used).
      page_indices: ``int32[max_num_seqs, pages_per_seq]``: each sequence's pages in ``kv_pages``.
      cu_q_lens: ``int32[max_num_seqs + 1]``: cumulative query lengths (the first ``num_seqs + 1``
        are used).
      num_seqs: ``int32[1]``: how many sequences there are.
      sm_scale: multiplies ``q @ k.T``.
      sliding_window: when set, a query sees only its last ``sliding_window`` keys.
      soft_cap: when set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      mask_value: the logit of masked keys (None: ``DEFAULT_MASK_VALUE``).
      k_scale, v_scale: when set, keys (values) are multiplied by them (a scaled, e.g.
        float8, cache). The kernel applies ``sm_scale * k_scale`` to the float32 scores and
        ``v_scale`` to the output, so the cache's codes meet the matmuls exact (JAX's op casts
        ``k * k_scale`` to ``q``'s dtype first; ``ref_ragged_paged_attention`` does as JAX's).
      num_kv_pages_per_block: pages per KV compute block; num_queries_per_block: query tokens
        per grid step (rounded up to a multiple of 8, or 16 for an odd group); None: chosen by
        ``get_tuned_block_sizes``.
      vmem_limit_bytes: the kernel's VMEM limit (None: from what the blocks need).
      interpret: run in TPU interpret mode (``True`` or ``pltpu.InterpretParams``).

    Returns:
      ``[max_num_batched_tokens, num_q_heads, head_dim]`` in ``q``'s dtype.
    """
    blocks = (num_kv_pages_per_block, num_queries_per_block)
    static_validate_inputs(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale, v_scale=v_scale, num_kv_pages_per_block=blocks[0],
        num_queries_per_block=blocks[1], vmem_limit_bytes=vmem_limit_bytes,
    )  # fmt: skip
    tokens, num_q_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    plan = _plan_for(q.dtype, kv_pages.dtype, tokens, num_q_heads, combined // 2, head_dim, page_size,
                     page_indices.shape, blocks, sliding_window, soft_cap, mask_value, k_scale, v_scale)  # fmt: skip
    return _call(plan, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, float(sm_scale), vmem_limit_bytes,
                 interpret)  # fmt: skip


class MultiPageAsyncCopyDescriptor:
    """The copies of a KV block's pages into a VMEM buffer, with the constructor of JAX's class
    of this name: ``metadata = (seq, start_page, end_page)``; slot ``i`` of ``vmem_buf`` gets
    page ``page_indices_ref[seq, start_page + i]`` (the sequence's first page past
    ``end_page``), all copies signalling ``sem``. For kernels written against JAX's module;
    ``ragged_paged_attention``'s own kernel schedules its copies itself."""

    def __init__(self, pages_hbm_ref, vmem_buf, sem, page_indices_ref, metadata):
        seq, start, end = metadata
        self._buf = vmem_buf
        self._copies = []
        for i in range(vmem_buf.shape[0]):
            page = jnp.where(start + i < end, start + i, 0)
            src = pages_hbm_ref.at[page_indices_ref[seq, page]]
            self._copies.append(pltpu.make_async_copy(src, vmem_buf.at[i], sem))

    def start(self):
        """Starts every copy."""
        for copy in self._copies:
            copy.start()

    def wait(self):
        """Waits for every copy; the VMEM buffer back."""
        for copy in self._copies:
            copy.wait()
        return self._buf


def ragged_paged_attention_kernel(
    kv_lens_ref, page_indices_ref, cu_q_lens_ref, seq_buf_idx_ref, num_seqs_ref, q_ref, kv_pages_hbm_ref, o_ref,
    kv_bufs, sems, l_ref, m_ref, acc_ref, *, sm_scale: float, sliding_window: int | None = None,
    soft_cap: float | None = None, mask_value: float | None = DEFAULT_MASK_VALUE, k_scale: float | None = None,
    v_scale: float | None = None,
):  # fmt: skip
    """JAX's kernel name and signature; raises ``NotImplementedError``: JAX's kernel body (its
    grid, scratch and semaphore layout) is not provided. Call ``ragged_paged_attention``."""
    raise NotImplementedError(
        "ragged_paged_attention_kernel: JAX's kernel body of this name is not provided; call "
        "ragged_paged_attention(...) (its kernel walks work items of sequences per query block), or use "
        "MultiPageAsyncCopyDescriptor in a kernel of your own"
    )
