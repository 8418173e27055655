"""Paged decode attention, with the API of JAX's Pallas GPU op
``paged_attention`` (``paged_attention``, ``paged_attention_reference``).

The KV cache is a pool of pages, ``[num_kv_heads, total_num_pages, page_size,
head_dim]``; row b of ``block_tables`` lists the pages of sequence b in
order. The kernel is the dense decode kernel of ``decode_attention`` with a
page-table gather:

* one program per (batch row, KV head, k-split), taking all the query heads
  of that KV head (K/V pages are read once per group);
* each loop step covers ``pages_per_compute_block`` pages: it reads their
  numbers from the block table, then gathers their tokens' K and V rows
  (each row one contiguous ``head_dim`` vector) straight from the page pool,
  software-pipelined like a dense load;
* the tokens are split ``k_splits`` ways over programs, and a small kernel
  combines the parts (with one split, the default where the (row, KV head)
  pairs fill the GPU, the program writes the output itself); a program only
  walks blocks below its row's length,
  and tokens past the length are masked and never read (nor are their
  block-table entries).

Optional per-token scales (``k_scales_pages``, ``v_scales_pages``) dequantize
int8 (or other) pages, and ``attn_logits_soft_cap`` caps the logits with
``tanh``, as in JAX's op. Logits are not scaled: fold ``1/sqrt(head_dim)``
into ``q``. A row of length 0 gets zeros.

``interpret`` takes ``True`` or ``pallas_gpu.InterpretParams()`` to run on a
CPU.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
from pallas_gpu._src.language.primitives import load as _gpu_load
from pallas_gpu.ops import decode_attention as _dec
from pallas_gpu.ops._common import (
    call_params,
    compute_capability,
    interpreted,
    pipeline_stages,
)

#: The logit of a masked token (JAX's ``paged_attention`` uses the same).
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)
_F32 = jnp.float32
# Tokens per loop step when pages_per_compute_block is None, and the default stages: on the
# H200 at batch 32, 32/8 heads, 8192 tokens, 16-token pages, no split
# (benchmarks/decode_splits.py --wide, 2026-12-02) 128 tokens at 3 stages read 4.15 TB/s of
# KV (0.981x cuDNN's speed), at 2 stages 4.09 (0.966x), 64 tokens at 3 or 4 stages 3.55;
# 8 warps trail 4 by 1-2 %. Fewer tokens where a step would hold more than 64 KiB of K and V
# (larger heads or dtypes), fewer stages where 3 do not fit.
_BLOCK_TOKENS = 128
_STEP_BYTES = 64 * 1024
_MOST_STAGES = 3


def _kernel(*refs, has_k_scales, has_v_scales, block_pages, page_size, per_split, group, rows, mask_value,
            soft_cap):  # fmt: skip
    refs = list(refs)
    q_ref, k_ref = refs.pop(0), refs.pop(0)
    ks_ref = refs.pop(0) if has_k_scales else None
    v_ref = refs.pop(0)
    vs_ref = refs.pop(0) if has_v_scales else None
    bt_ref, len_ref, *out_refs = refs
    block_k = block_pages * page_size
    hi_tok = jnp.minimum(len_ref[()], bt_ref.shape[0] * page_size)
    lo, hi = _dec.token_bounds(0, hi_tok, pl.program_id(2), block_k, per_split)
    q = _dec.pad_rows(q_ref[...], rows)

    def body(j, carry):
        tok = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        valid = tok < hi_tok
        # The page of each token (block-table entries past the length are not read) ...
        page = _gpu_load(bt_ref, (lax.div(tok, page_size),), mask=valid, other=0)
        # ... and its row in the pool of the KV head: K/V rows are gathered, masked past the length.
        row = page * page_size + lax.rem(tok, page_size)
        k = _gpu_load(k_ref, (row, slice(None)), mask=valid[:, None], other=0)
        x = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=_F32)
        if ks_ref is not None:
            x = x * _gpu_load(ks_ref, (row,), mask=valid, other=0).astype(_F32)[None, :]
        if soft_cap is not None:
            x = jnp.tanh(x / soft_cap) * soft_cap
        x = jnp.where(valid[None, :], x * _dec.LOG2E, mask_value)  # base 2 from here
        v = _gpu_load(v_ref, (row, slice(None)), mask=valid[:, None], other=0).astype(q.dtype)
        v_scale = None
        if vs_ref is not None:
            v_scale = _gpu_load(vs_ref, (row,), mask=valid, other=0).astype(_F32)[None, :]
        return _dec.online_softmax_step(carry, x, v, to_base2=1.0, v_scale=v_scale)

    init = (
        jnp.full((rows,), -jnp.inf, _F32),
        jnp.zeros((rows,), _F32),
        jnp.zeros((rows, q_ref.shape[1]), _F32),
    )
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    _dec.store_result(out_refs, m, l, acc, group, normalize=True)


def _check(q, k_pages, v_pages, block_tables, lengths, k_scales_pages, v_scales_pages, block_h,
           pages_per_compute_block, k_splits):  # fmt: skip
    name = "paged_attention"
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [batch_size, num_heads, head_dim]; got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"{name}: k_pages must be [num_kv_heads, total_num_pages, page_size, head_dim]; got {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"{name}: k_pages and v_pages must have the same shape. Got {k_pages.shape} and {v_pages.shape}"
        )
    batch, num_heads, head_dim = q.shape
    num_kv_heads, total_pages, page_size, head_dim_k = k_pages.shape
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{name}: Number of Q heads must be divisible by number of KV heads. Got {num_heads} and {num_kv_heads}."
        )
    if head_dim_k != head_dim:
        raise ValueError(
            f"{name}: head_dim of Q must be the same as that of K/V. Got {head_dim} and {head_dim_k}."
        )
    if head_dim < 16:
        raise ValueError(f"{name}: head_dim {head_dim} is below 16, the smallest dot Triton runs")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"{name}: block_tables must be [batch_size, pages_per_sequence] with batch_size {batch} "
            f"(the batch size of q); got {block_tables.shape}"
        )
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"{name}: block_tables must hold integers; got {block_tables.dtype}")
    if lengths is not None:
        if lengths.shape != (batch,):
            raise ValueError(f"{name}: lengths must be [batch_size] = ({batch},); got {lengths.shape}")
        if lengths.dtype != jnp.int32:
            raise ValueError(f"{name}: The dtype of `lengths` must be int32. Got {lengths.dtype}")
    for arg, s in (("k_scales_pages", k_scales_pages), ("v_scales_pages", v_scales_pages)):
        if s is not None and s.shape != (num_kv_heads, total_pages, page_size):
            raise ValueError(
                f"{name}: {arg} must be [num_kv_heads, total_num_pages, page_size] = "
                f"{(num_kv_heads, total_pages, page_size)}; got {s.shape}"
            )
    if not isinstance(block_h, int) or block_h < 16 or block_h % 16:
        raise ValueError(f"{name}: block_h must divisible by 16, but is {block_h}.")
    ppcb = pages_per_compute_block
    if ppcb is not None and (not isinstance(ppcb, int) or ppcb < 1):
        raise ValueError(f"{name}: pages_per_compute_block must be a positive int or None; got {ppcb!r}")
    if ppcb is not None and ppcb * page_size < 16:
        raise ValueError(
            f"{name}: pages_per_compute_block * page_size = {ppcb} * {page_size} tokens per step is below 16, "
            "the smallest dot Triton runs; take more pages per step"
        )
    if k_splits is not None and (not isinstance(k_splits, int) or k_splits < 1):
        raise ValueError(
            f"{name}: k_splits must be a positive int or None (chosen from the shapes); got {k_splits!r}"
        )


@functools.partial(
    jax.jit,
    static_argnames=["block_h", "pages_per_compute_block", "k_splits", "num_warps", "num_stages", "interpret",
                     "debug", "mask_value", "attn_logits_soft_cap"],
)  # fmt: skip
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array | None,
    k_scales_pages: jax.Array | None = None,
    v_scales_pages: jax.Array | None = None,
    *,
    block_h: int = 16,
    pages_per_compute_block: int | None = None,
    k_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: Any = False,
    debug: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    attn_logits_soft_cap: float | None = None,
) -> jax.Array:
    """Paged grouped-query decode attention.

    Args:
      q: [batch_size, num_heads, head_dim] (logits are ``q . k``, unscaled).
      k_pages, v_pages: [num_kv_heads, total_num_pages, page_size, head_dim].
      block_tables: i32[batch_size, pages_per_sequence], entries in
        ``[0, total_num_pages)``: the pages of each sequence, in order.
      lengths: i32[batch_size] tokens per sequence, or None (all pages full).
      k_scales_pages, v_scales_pages: None or
        [num_kv_heads, total_num_pages, page_size] per-token scales of the
        K/V pages (K and V are cast to q's dtype, then scaled).
      block_h: a multiple of 16; the query tile has ``max(block_h, group)``
        rows (rounded up to a power of two), where group is
        ``num_heads // num_kv_heads``: one program takes the whole group.
      pages_per_compute_block: pages per loop step; None takes 128 tokens
        worth (``max(1, 128 // page_size)`` pages), fewer where those hold more
        than 64 KiB of K and V (head dims above 128, f32 pages).
      k_splits: programs per (row, KV head) along the pages; None picks enough
        to fill the GPU. Need not divide anything.
      num_warps: None picks 4 (8 for tiles of more than 32 rows).
      num_stages: software-pipelining stages of the page loop; None picks 3,
        or fewer where 3 stages of K and V blocks do not fit in the GPU's
        shared memory.
      interpret: ``True`` or ``pallas_gpu.InterpretParams()`` to run on a CPU.
      mask_value: the logit of the tokens past a sequence's length inside the
        blocks a program walks.
      attn_logits_soft_cap: None, or c for logits ``c * tanh(logits / c)``.
    Returns:
      [batch_size, num_heads, head_dim] in q's dtype.
    """
    _check(q, k_pages, v_pages, block_tables, lengths, k_scales_pages, v_scales_pages, block_h,
           pages_per_compute_block, k_splits)  # fmt: skip
    B, Hq, D = q.shape
    Hkv, _, page_size, _ = k_pages.shape
    group = Hq // Hkv
    block_pages, per_split, ks, rows, num_stages = _launch_plan(
        q, k_pages, v_pages, block_tables, block_h, pages_per_compute_block, k_splits, num_stages, interpret
    )
    in_specs, args = _operands(q, k_pages, v_pages, block_tables, lengths, k_scales_pages, v_scales_pages)
    out_shape, out_specs = _dec.result_specs(B, Hq, group, D, ks, q.dtype, residuals=False)
    kernel = _bound_kernel(k_scales_pages is not None, v_scales_pages is not None, block_pages, page_size,
                           per_split, group, rows, mask_value, attn_logits_soft_cap)  # fmt: skip
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, Hkv, ks),
        in_specs=in_specs,
        out_specs=out_specs,
        name="paged_attention",
        debug=debug,
        **call_params(interpret, num_warps or _dec.default_warps(rows), num_stages),
    )(*args)
    if len(outs) == 1:  # one split: the kernel wrote the output
        return outs[0]
    o, m, l = outs
    return _dec.combine(o, m, l, q.dtype, normalize=True, residuals=False, base2=True, interpret=interpret,
                        debug=debug, name="paged_attention")  # fmt: skip


def _bound_kernel(has_k_scales, has_v_scales, block_pages, page_size, per_split, group, rows, mask_value,
                  soft_cap):  # fmt: skip
    """``_kernel`` with its static parameters bound."""
    return functools.partial(
        _kernel,
        has_k_scales=has_k_scales,
        has_v_scales=has_v_scales,
        block_pages=block_pages,
        page_size=page_size,
        per_split=per_split,
        group=group,
        rows=rows,
        # mask_value in base 2, kept finite (the default times log2(e) overflows f32)
        mask_value=max(mask_value * _dec.LOG2E, -float(np.finfo(np.float32).max)),
        soft_cap=soft_cap,
    )


def _launch_plan(q, k_pages, v_pages, block_tables, block_h, pages_per_compute_block, k_splits, num_stages,
                 interpret):  # fmt: skip
    """(pages per loop step, page blocks per split, splits, query rows per
    program, pipeline stages) of ``paged_attention``, the Nones chosen."""
    B, Hq, D = q.shape
    Hkv, _, page_size, _ = k_pages.shape
    pps = block_tables.shape[1]
    kv_itemsize = k_pages.dtype.itemsize + v_pages.dtype.itemsize
    # By default at most 64 KiB of K and V per step (128 tokens of bf16 at head dim 128).
    block_tokens = min(_BLOCK_TOKENS, 1 << (max(1, _STEP_BYTES // (D * kv_itemsize)).bit_length() - 1))
    block_pages = pages_per_compute_block or max(1, block_tokens // page_size)
    block_pages = min(block_pages, max(pps, -(-16 // page_size)))
    n_blocks = -(-pps // block_pages)
    if k_splits is None:
        k_splits = _dec.default_k_splits(B * Hkv, n_blocks)
    per_split, ks = _dec.split_plan(n_blocks, k_splits)
    rows = _dec.heads_per_program(block_h, Hq // Hkv)
    if num_stages is None:
        stage_bytes = block_pages * page_size * D * kv_itemsize
        num_stages = pipeline_stages(
            stage_bytes, _MOST_STAGES, None if interpreted(interpret) else compute_capability()
        )
    return block_pages, per_split, ks, rows, num_stages


def _operands(q, k_pages, v_pages, block_tables, lengths, k_scales_pages, v_scales_pages):
    """(in_specs, args) of the kernel: q, the K pool (and its scales), the V
    pool (and its scales), the block table and the lengths; grid (b, h, s)."""
    B, Hq, D = q.shape
    Hkv, P, page_size, _ = k_pages.shape
    pps = block_tables.shape[1]
    if lengths is None:
        lengths = jnp.full((B,), pps * page_size, jnp.int32)
    pool = pl.BlockSpec((None, P * page_size, D), lambda b, h, s: (h, 0, 0))
    scale_pool = pl.BlockSpec((None, P * page_size), lambda b, h, s: (h, 0))
    in_specs = [pl.BlockSpec((None, Hq // Hkv, D), lambda b, h, s: (b, h, 0)), pool]
    args = [q, k_pages.reshape(Hkv, P * page_size, D)]
    if k_scales_pages is not None:
        in_specs.append(scale_pool)
        args.append(k_scales_pages.reshape(Hkv, P * page_size))
    in_specs.append(pool)
    args.append(v_pages.reshape(Hkv, P * page_size, D))
    if v_scales_pages is not None:
        in_specs.append(scale_pool)
        args.append(v_scales_pages.reshape(Hkv, P * page_size))
    in_specs += [
        pl.BlockSpec((None, pps), lambda b, h, s: (b, 0)),
        pl.BlockSpec((None,), lambda b, h, s: (b,)),
    ]
    args += [block_tables.astype(jnp.int32), lengths]
    return in_specs, args


@functools.partial(jax.jit, static_argnames=["mask_value", "attn_logits_soft_cap"])
def paged_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    mask_value: float = DEFAULT_MASK_VALUE,
    attn_logits_soft_cap: float | None = None,
) -> jax.Array:
    """Plain-JAX grouped-query decode attention over a dense cache: ``q``
    [batch, num_heads, D], ``k``/``v`` [batch, kv_seq_len, num_kv_heads, D],
    ``lengths`` [batch] (None: all tokens). Logits unscaled, as in
    ``paged_attention``; a row of length 0 gets zeros."""
    B, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    qg = q.astype(_F32).reshape(B, Hkv, Hq // Hkv, D)
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, k.astype(_F32), precision="highest")
    if attn_logits_soft_cap is not None:
        logits = jnp.tanh(logits / attn_logits_soft_cap) * attn_logits_soft_cap
    if lengths is None:
        lengths = jnp.full((B,), S, jnp.int32)
    valid = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    w = jax.nn.softmax(jnp.where(valid, logits, mask_value), axis=-1)
    w = jnp.where(jnp.any(valid, axis=-1, keepdims=True), w, 0.0)
    o = jnp.einsum("bhgs,bshd->bhgd", w, v.astype(_F32), precision="highest")
    return o.reshape(B, Hq, D).astype(q.dtype)
