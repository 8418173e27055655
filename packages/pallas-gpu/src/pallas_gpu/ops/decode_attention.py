"""Decode attention (one query token per sequence) over a dense KV cache, with
the API of JAX's Pallas GPU op ``decode_attention`` (``mqa``, ``gqa``,
``mqa_reference``, ``gqa_reference``, ``mha_reference``).

Decoding reads the whole KV cache to produce one token: it is bound by memory
bandwidth, so the kernels are built to read every K/V byte once, at full
width, with enough programs in flight to fill the GPU:

* One program per (batch row, KV head, k-split) takes **all** the query heads
  that share that KV head (grouped-query attention): K and V are read once per
  group, not once per query head. The group's queries are the rows of the
  ``q @ k^T`` tile (padded to at least 16 rows, the smallest dot Triton runs).
* Split-K: the cached tokens are cut into ``k_splits`` parts handled by
  separate programs (by default as many as keep ``batch * kv_heads *
  k_splits`` to one wave of programs, none where the (row, KV head) pairs
  fill the GPU alone); each walks its part in blocks of ``block_k``
  tokens with an online softmax in base 2 (f32 accumulation, inputs loaded in
  their own dtype, software-pipelined by ``num_stages``) and writes its
  unnormalized partial output with its running max and sum. A second, small
  kernel combines the parts per query head. With one split (no residuals
  asked) the program finishes its rows itself and no second kernel runs.
* ``start_idx`` and ``kv_seq_len`` (per batch row) bound the tokens each row
  attends to: a program only walks the blocks that hold valid tokens (a part
  wholly outside them does no memory traffic), and masks the tokens of its
  edge blocks. The sequence length need not be a multiple of ``block_k`` or
  of ``k_splits``. A row with no valid token gets zeros (and ``l = 0``,
  ``m = -inf`` as residuals).

``interpret`` takes ``True`` (pallas-core's interpreter) or
``pallas_gpu.InterpretParams()`` (the generated Triton kernels under Triton's
interpreter), so the kernels run on a CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
from pallas_gpu._src.language.primitives import load as _gpu_load
from pallas_gpu.ops._common import call_params, next_power_of_2

#: log2(e): the kernels compute ``exp`` as ``exp2`` of logits scaled by it.
LOG2E = math.log2(math.e)
_F32 = jnp.float32
# At most this many programs, in one wave: two per SM of a 132-SM H200 (they fit three per SM).
# On the H200 at 32 rows x 8 KV heads x 8192 tokens, one program per (row, KV head) and no
# split read the cache at 0.99x cuDNN's speed, 8 splits (5.2 waves) at 0.93x
# (benchmarks/decode_splits.py; cuDNN's kernel is one wave of 256 programs, unsplit).
_WAVE_PROGRAMS = 264
_MIN_BLOCKS_PER_SPLIT = 4  # a split shorter than this spends more on its prologue than it saves


# ---------------------------------------------------------------------------
# Launch parameters


def default_k_splits(batch_heads: int, n_blocks: int) -> int:
    """Splits of the key axis: the most for which ``batch_heads * k_splits``
    programs still run as one wave (``_WAVE_PROGRAMS``), so 1 where the
    (row, KV head) pairs alone fill the GPU, keeping at least
    ``_MIN_BLOCKS_PER_SPLIT`` blocks per split where there are that many.
    Several waves leave a partial last one and more partial outputs for the
    combine kernel to read."""
    want = max(1, _WAVE_PROGRAMS // batch_heads)
    return max(1, min(want, n_blocks // _MIN_BLOCKS_PER_SPLIT))


def split_plan(n_blocks: int, k_splits: int) -> tuple[int, int]:
    """(blocks per split, number of non-empty splits) for ``k_splits`` asked."""
    per = -(-n_blocks // max(1, min(k_splits, n_blocks)))
    return per, -(-n_blocks // per)


def heads_per_program(block_h: int, group: int) -> int:
    """Rows of the query tile: the whole head group, at least ``block_h`` and
    16 (the smallest dot), as a power of two."""
    return next_power_of_2(max(16, block_h, group))


def default_warps(rows: int) -> int:
    """The default ``num_warps`` for a program holding ``rows`` query rows."""
    return 4 if rows <= 32 else 8


# ---------------------------------------------------------------------------
# Kernels


def online_softmax_step(carry, x, v, *, to_base2, v_scale=None):
    """One block of the online softmax: ``x`` (rows, block_k) f32 logits
    (masked entries -inf or very negative), ``v`` (block_k, D). Returns the
    new (m, l, acc). ``to_base2`` multiplies the exponent by log2(e) (1.0 when
    ``x`` is already in base 2); ``v_scale`` (1, block_k) scales the
    probabilities that weigh ``v`` (dequantization), not their sum."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    alpha = jnp.exp2((m - m_new) * to_base2)
    p = jnp.exp2((x - m_new[:, None]) * to_base2)
    pv = p if v_scale is None else p * v_scale
    acc = acc * alpha[:, None] + jnp.dot(pv.astype(v.dtype), v, preferred_element_type=_F32)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc


def token_bounds(lo_tok, hi_tok, split, block_k: int, per_split: int):
    """(first block, end block) of a split's loop: only blocks holding a
    token of ``[lo_tok, hi_tok)``; none when that range is empty."""
    first = split * per_split
    lo = jnp.maximum(first, lax.div(lo_tok, block_k))  # lo_tok >= 0
    hi = jnp.minimum(first + per_split, lax.div(jnp.maximum(hi_tok, 0) + block_k - 1, block_k))
    return lo, jnp.where(lo_tok < hi_tok, hi, lo)


def pad_rows(x, rows: int):
    """``x`` (group, D) with zero rows appended up to ``rows`` (the dot needs
    at least 16); done in registers, once per program."""
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def store_result(out_refs, m, l, acc, group: int, normalize: bool):
    """Stores a program's rows. One output ref (one split, no residuals): the
    finished output in its dtype, so no second kernel runs; three: the
    unnormalized part with its running max and sum, for ``combine``."""
    if len(out_refs) == 1:
        out = acc / jnp.where(l > 0, l, 1.0)[:, None] if normalize else acc
        out_refs[0][...] = out[:group].astype(out_refs[0].dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...], m_ref[...], l_ref[...] = acc[:group], m[:group], l[:group]


def result_specs(B: int, H: int, group: int, D: int, ks: int, out_dtype, residuals: bool):
    """(out_shape, out_specs) of a decode kernel over the grid (row, KV head,
    split): the output itself for one split without residuals (see
    ``store_result``), else the parts for ``combine``."""
    if ks == 1 and not residuals:
        return [jax.ShapeDtypeStruct((B, H, D), out_dtype)], [
            pl.BlockSpec((None, group, D), lambda b, h, s: (b, h, 0))
        ]
    stat_spec = pl.BlockSpec((None, group, None), lambda b, h, s: (b, h, s))
    return [jax.ShapeDtypeStruct((B, H, ks, D), _F32), *[jax.ShapeDtypeStruct((B, H, ks), _F32)] * 2], [
        pl.BlockSpec((None, group, None, D), lambda b, h, s: (b, h, s, 0)),
        stat_spec,
        stat_spec,
    ]


def _split_kernel(q_ref, k_ref, v_ref, start_ref, len_ref, *out_refs, scale, block_k, per_split, group, rows,
                  normalize):  # fmt: skip
    seq_len = k_ref.shape[0]
    lo_tok = jnp.maximum(start_ref[()], 0)
    hi_tok = jnp.minimum(len_ref[()], seq_len)
    lo, hi = token_bounds(lo_tok, hi_tok, pl.program_id(2), block_k, per_split)
    q = pad_rows(q_ref[...], rows)

    def body(j, carry):
        t0 = pl.multiple_of(j * block_k, block_k)
        # plgpu.load masks the tokens past the end of the cache (the last block
        # may be partial): they read as 0 and are masked below.
        k = _gpu_load(k_ref.at[pl.ds(t0, block_k), :])
        x = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=_F32) * scale
        tok = t0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        x = jnp.where((tok >= lo_tok) & (tok < hi_tok), x, -jnp.inf)
        v = _gpu_load(v_ref.at[pl.ds(t0, block_k), :])
        return online_softmax_step(carry, x, v, to_base2=1.0)

    init = (
        jnp.full((rows,), -jnp.inf, _F32),
        jnp.zeros((rows,), _F32),
        jnp.zeros((rows, q_ref.shape[1]), _F32),
    )
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    store_result(out_refs, m, l, acc, group, normalize)


def _combine_kernel(o_ref, m_ref, l_ref, out_ref, *res_refs, normalize: bool, base2: bool):
    m = m_ref[...]  # (k_splits,): -inf for a split with no valid token
    top = jnp.max(m)
    top = jnp.where(top == -jnp.inf, 0.0, top)  # a row with no valid token: all weights 0
    w = jnp.exp2(m - top) if base2 else jnp.exp(m - top)
    l = jnp.sum(l_ref[...] * w)
    o = jnp.sum(o_ref[...] * w[:, None], axis=0)
    if normalize:
        o = o / jnp.where(l > 0, l, 1.0)
    out_ref[...] = o.astype(out_ref.dtype)
    if res_refs:
        l_out, m_out = res_refs
        l_out[...] = l
        m_out[...] = jnp.where(l > 0, top / LOG2E if base2 else top, -jnp.inf)


def combine(o, m, l, out_dtype, *, normalize: bool, residuals: bool, base2: bool, interpret, debug, name):
    """The parts ``o`` [B, H, k_splits, D] (unnormalized, f32) with their
    maxima ``m`` and sums ``l`` [B, H, k_splits] -> [B, H, D] (and the
    residuals ``l``, ``m`` [B, H] in natural-log units with ``residuals``)."""
    B, H, ks, D = o.shape
    if ks == 1:
        # One part: an elementwise epilogue (one XLA fusion). A Pallas kernel over
        # (1,)-shaped blocks here fails to lower (a length-1 block dim loads a scalar).
        l1 = l[:, :, 0]
        out = o[:, :, 0] / jnp.where(l1 > 0, l1, 1.0)[..., None] if normalize else o[:, :, 0]
        m1 = jnp.where(l1 > 0, m[:, :, 0] / LOG2E if base2 else m[:, :, 0], -jnp.inf)
        return (out.astype(out_dtype), (l1, m1)) if residuals else out.astype(out_dtype)
    vec = pl.BlockSpec((None, None, ks), lambda b, h: (b, h, 0))
    out_specs = [pl.BlockSpec((None, None, D), lambda b, h: (b, h, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, H, D), out_dtype)]
    if residuals:
        out_specs += [pl.BlockSpec((None, None), lambda b, h: (b, h))] * 2
        out_shape += [jax.ShapeDtypeStruct((B, H), _F32)] * 2
    outs = pl.pallas_call(
        functools.partial(_combine_kernel, normalize=normalize, base2=base2),
        out_shape=out_shape,
        grid=(B, H),
        in_specs=[pl.BlockSpec((None, None, ks, D), lambda b, h: (b, h, 0, 0)), vec, vec],
        out_specs=out_specs,
        name=f"{name}_combine",
        debug=debug,
        **call_params(interpret, 2 if ks * D <= 2048 else 4, 1),
    )(o, m, l)
    return (outs[0], (outs[1], outs[2])) if residuals else outs[0]


# ---------------------------------------------------------------------------
# Checks


def _check_positions(name, arg, x, batch):
    if x is None:
        return
    x = jnp.asarray(x)
    if x.ndim not in (0, 1) or (x.ndim == 1 and x.shape[0] != batch):
        raise ValueError(f"{name}: {arg} must be a scalar or [batch_size] = ({batch},); got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}: {arg} must hold integers; got {x.dtype}")


def _check(name, q, k, v, start_idx, kv_seq_len, block_h, block_k, k_splits, grid):
    kv_rank = 4 if name == "gqa" else 3
    kv_layout = (
        "[batch_size, k_seq_len, num_kv_heads, head_dim]"
        if name == "gqa"
        else "[batch_size, k_seq_len, head_dim]"
    )
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [batch_size, num_heads, head_dim]; got shape {q.shape}")
    if k.ndim != kv_rank or v.ndim != kv_rank:
        raise ValueError(f"{name}: k and v must be {kv_layout}; got k{k.shape}, v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v must have the same shape; got k{k.shape}, v{v.shape}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: k has batch size {k.shape[0]} but q has {q.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{name}: head_dim of q ({q.shape[-1]}) and of k, v ({k.shape[-1]}) differ")
    if q.shape[-1] < 16:
        raise ValueError(f"{name}: head_dim {q.shape[-1]} is below 16, the smallest dot Triton runs")
    if k.shape[1] < 1:
        raise ValueError(f"{name}: the KV cache is empty (k_seq_len = 0)")
    if kv_rank == 4 and q.shape[1] % k.shape[2]:
        raise ValueError(
            f"{name}: the {q.shape[1]} query heads cannot be grouped over the {k.shape[2]} KV heads "
            "(num_heads must be a multiple of num_kv_heads)"
        )
    if not isinstance(block_k, int) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"{name}: block_k must be a power of two >= 16; got {block_k!r}")
    if not isinstance(block_h, int) or block_h < 1:
        raise ValueError(f"{name}: block_h must be a positive int; got {block_h!r}")
    if k_splits is not None and (not isinstance(k_splits, int) or k_splits < 1):
        raise ValueError(
            f"{name}: k_splits must be a positive int or None (chosen from the shapes); got {k_splits!r}"
        )
    if grid is not None:
        raise NotImplementedError(f"{name}: grid= is chosen by pallas_gpu's kernels; pass grid=None")
    _check_positions(name, "start_idx", start_idx, q.shape[0])
    _check_positions(name, "kv_seq_len", kv_seq_len, q.shape[0])


# ---------------------------------------------------------------------------
# The public functions


def _decode(q, k, v, start_idx, kv_seq_len, *, name, sm_scale, block_h, block_k, k_splits, num_warps, num_stages,
            grid, interpret, debug, return_residuals, normalize_output):  # fmt: skip
    """``q`` [B, Hq, D], ``k``/``v`` [B, S, Hkv, D]."""
    _check(name, q, k if name == "gqa" else k[:, :, 0], v if name == "gqa" else v[:, :, 0], start_idx,
           kv_seq_len, block_h, block_k, k_splits, grid)  # fmt: skip
    B, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    block_k = min(block_k, max(16, next_power_of_2(S)))
    n_blocks = -(-S // block_k)
    if k_splits is None:
        k_splits = default_k_splits(B * Hkv, n_blocks)
    per_split, ks = split_plan(n_blocks, k_splits)
    rows = heads_per_program(block_h, group)
    start = jnp.broadcast_to(jnp.asarray(0 if start_idx is None else start_idx, jnp.int32), (B,))
    length = jnp.broadcast_to(jnp.asarray(S if kv_seq_len is None else kv_seq_len, jnp.int32), (B,))

    kv_spec = pl.BlockSpec((None, S, None, D), lambda b, h, s: (b, 0, h, 0))
    pos_spec = pl.BlockSpec((None,), lambda b, h, s: (b,))
    out_shape, out_specs = result_specs(B, Hq, group, D, ks, q.dtype, return_residuals)
    kernel = functools.partial(_split_kernel, scale=sm_scale * LOG2E, block_k=block_k, per_split=per_split,
                               group=group, rows=rows, normalize=normalize_output)  # fmt: skip
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, Hkv, ks),
        in_specs=[
            pl.BlockSpec((None, group, D), lambda b, h, s: (b, h, 0)),
            kv_spec,
            kv_spec,
            pos_spec,
            pos_spec,
        ],
        out_specs=out_specs,
        name=f"{name}_decode",
        debug=debug,
        **call_params(interpret, num_warps or default_warps(rows), num_stages),
    )(q, k, v, start, length)
    if len(outs) == 1:  # one split: the kernel wrote the output
        return outs[0]
    o, m, l = outs
    return combine(o, m, l, q.dtype, normalize=normalize_output, residuals=return_residuals, base2=True,
                   interpret=interpret, debug=debug, name=name)  # fmt: skip


_STATIC = ["sm_scale", "block_h", "block_k", "k_splits", "num_warps", "num_stages", "grid", "interpret", "debug",
           "return_residuals", "normalize_output"]  # fmt: skip


def _public(name: str, doc: str):
    """JAX's ``mqa`` or ``gqa`` (``name``), jitted: one signature for both."""

    def decode(
        q,
        k,
        v,
        start_idx=None,
        kv_seq_len=None,
        sm_scale: float | None = None,
        block_h: int = 16,
        block_k: int = 64,
        k_splits: int | None = None,
        num_warps: int | None = None,
        num_stages: int = 3,
        grid: tuple[int, ...] | None = None,
        interpret: Any = False,
        debug: bool = False,
        return_residuals: bool = False,
        normalize_output: bool = True,
    ):
        if name == "mqa":  # one KV head: gqa's layout with a KV-head axis of 1
            k, v = k[:, :, None], v[:, :, None]
        elif not normalize_output and not return_residuals:
            raise NotImplementedError(
                "gqa: when normalize_output is False, attention residuals must be returned."
            )
        elif k.ndim != 4 or v.ndim != 4:
            raise ValueError(
                f"gqa: k and v must be [batch_size, k_seq_len, num_kv_heads, head_dim]; got k{k.shape}, v{v.shape}"
            )
        return _decode(q, k, v, start_idx, kv_seq_len, name=name, sm_scale=sm_scale, block_h=block_h,
                       block_k=block_k, k_splits=k_splits, num_warps=num_warps, num_stages=num_stages, grid=grid,
                       interpret=interpret, debug=debug, return_residuals=return_residuals,
                       normalize_output=normalize_output)  # fmt: skip

    decode.__name__ = decode.__qualname__ = name
    decode.__doc__ = doc
    return jax.jit(decode, static_argnames=_STATIC)


mqa = _public(
    "mqa",
    """Multi-query decode attention: every query head attends to the one
    shared K/V head.

    Args:
      q: [batch_size, num_heads, head_dim], one query token per row.
      k, v: [batch_size, k_seq_len, head_dim].
      start_idx, kv_seq_len: None, a scalar or [batch_size] ints: row b
        attends to tokens ``start_idx[b] <= t < kv_seq_len[b]``.
      sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
      block_h: the query tile has ``max(16, block_h, num_heads)`` rows (a
        power of two): all heads are handled by one program, so K/V are read
        once.
      block_k: tokens per loop step (a power of two >= 16).
      k_splits: programs per (row, head group) along the tokens; None picks
        enough to fill the GPU (see ``default_k_splits``). Need not divide
        anything.
      num_warps: None picks 4 (8 for tiles of more than 32 rows).
      num_stages: software-pipelining stages of the token loop.
      grid: must be None (the grid is chosen here).
      interpret: ``True`` or ``pallas_gpu.InterpretParams()`` to run on a CPU.
      return_residuals: also return ``(l, m)`` [batch_size, num_heads] f32:
        the softmax's sum and max (natural-log units) per head.
      normalize_output: divide by the softmax sum (with False, the output is
        ``sum_t exp(logit_t - m) v_t``).
    Returns:
      [batch_size, num_heads, head_dim] in q's dtype (and the residuals).
    """,
)

gqa = _public(
    "gqa",
    """Grouped-query decode attention: query head ``i`` attends to KV head
    ``i // (num_heads // num_kv_heads)``.

    Args:
      q: [batch_size, num_heads, head_dim], one query token per row.
      k, v: [batch_size, k_seq_len, num_kv_heads, head_dim] (read in place:
        no transpose).
      The other arguments as in ``mqa``; one program takes all the query
      heads of a KV head. ``normalize_output=False`` needs
      ``return_residuals=True`` (as in JAX's ``gqa``).
    Returns:
      [batch_size, num_heads, head_dim] in q's dtype (and the residuals).
    """,
)


# ---------------------------------------------------------------------------
# References (plain JAX)


def _valid_tokens(S, batch, start_idx, kv_seq_len):
    t = jnp.arange(S)[None, :]
    start = jnp.broadcast_to(0 if start_idx is None else start_idx, (batch,))
    length = jnp.broadcast_to(S if kv_seq_len is None else kv_seq_len, (batch,))
    return (t >= start[:, None]) & (t < length[:, None])  # [batch, S]


def _softmax_parts(logits, valid):
    """(weights, l, m) of a masked softmax over the last axis; a row with no
    valid entry gets zero weights, ``l = 0`` and ``m = -inf``."""
    x = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(x, axis=-1)
    s = jnp.where(valid, jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    return s, jnp.sum(s, axis=-1), m


@functools.partial(jax.jit, static_argnames=["sm_scale", "return_residuals", "normalize_output"])
def gqa_reference(q, k, v, start_idx=None, kv_seq_len=None, sm_scale=None, return_residuals=False,
                  normalize_output=True):  # fmt: skip
    """Plain-JAX ``gqa`` (f32 math) with the same arguments."""
    B, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    qg = q.astype(_F32).reshape(B, Hkv, Hq // Hkv, D)
    logits = jnp.einsum("bhgd,bshd->bhgs", qg, k.astype(_F32), precision="highest") * sm_scale
    valid = _valid_tokens(S, B, start_idx, kv_seq_len)[:, None, None, :]
    s, l, m = _softmax_parts(logits, valid)
    if normalize_output:
        s = s / jnp.where(l > 0, l, 1.0)[..., None]
    o = (
        jnp.einsum("bhgs,bshd->bhgd", s, v.astype(_F32), precision="highest")
        .reshape(B, Hq, D)
        .astype(q.dtype)
    )
    return (o, (l.reshape(B, Hq), m.reshape(B, Hq))) if return_residuals else o


@functools.partial(jax.jit, static_argnames=["sm_scale", "return_residuals", "normalize_output"])
def mqa_reference(q, k, v, start_idx=None, kv_seq_len=None, sm_scale=None, return_residuals=False,
                  normalize_output=True):  # fmt: skip
    """Plain-JAX ``mqa`` (f32 math) with the same arguments."""
    return gqa_reference(q, k[:, :, None], v[:, :, None], start_idx, kv_seq_len, sm_scale=sm_scale,
                         return_residuals=return_residuals, normalize_output=normalize_output)  # fmt: skip


@functools.partial(jax.jit, static_argnames=["sm_scale"])
def mha_reference(q, k, v, start_idx=None, kv_seq_len=None, sm_scale=None):
    """Plain-JAX decode attention with one KV head per query head: ``q``
    [batch, heads, D], ``k``/``v`` [batch, k_seq_len, heads, D]."""
    return gqa_reference(q, k, v, start_idx, kv_seq_len, sm_scale=sm_scale)
