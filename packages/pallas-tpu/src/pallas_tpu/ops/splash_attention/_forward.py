"""The splash attention forward kernel: online softmax over the non-empty blocks of the mask.

Grid ``(heads, q shards, steps)``; each step is one ``(q block, kv block)`` pair of the
schedule (``splash_attention_mask_info``). The packed step words are scalar-prefetched, so the
index maps copy the q block and the kv blocks the step names: a hidden block is never copied
nor computed, and a kv block that the next step names again is not copied again. A q block's
steps are consecutive: its output block stays in VMEM across them and is written once.

Per q block the running row max ``m`` and row sum ``l`` are kept lane-replicated
(``(block_q, 128)`` float32, so they meet the score tiles without relayouts); the output is
accumulated unnormalized in float32 and divided by ``l`` once, on the block's last step. The
query block goes to the MXU as given; the float32 scores are taken to base 2 (times
``log2(e)``, or the soft cap's factor), so a score costs one ``exp2``. The probabilities meet
``v`` as float32 operands (``_common.probs_times``). A step
computes the cells of its pattern (``band`` queries by ``block_kv_compute`` keys;
``run_patterns``) as straight-line tiles: FULL cells with no mask arithmetic at all, PARTIAL
ones with the mask computed from the mask's function (or read from its loaded block), EMPTY
ones not at all; a causal diagonal costs about three quarters of its block, not all of it.
A query row that sees no key gives zeros (and a logsumexp of +inf: no gradient).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
from pallas_tpu.ops.splash_attention import _common as cm
from pallas_tpu.ops.splash_attention import splash_attention_mask_info as info_lib

F32 = cm.F32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def forward(
    info: info_lib.ScheduleInfo,
    q,
    k,
    v,
    segment_ids,
    sinks,
    *,
    cfg: cm.Config,
    blocks,
    patterns,
    keep_lse: bool,
):
    """``(out [heads, q_len, head_dim], lse [heads, q_len] natural-log or None)``."""
    block_q, block_kv, block_kv_compute = blocks
    heads, q_len, head_dim = q.shape
    head_dim_v = v.shape[-1]
    maps = cm.StepMaps.of(info, q, k, block_q, cfg, "splash attention")
    has_seg, has_sinks = segment_ids is not None, sinks is not None
    extra_specs, extra_args = maps.mask_and_segment_inputs(
        info, segment_ids, block_q, block_kv, rows_are_queries=True
    )
    prefetch = cm.prefetch_of(info)
    if has_sinks:
        prefetch.append(sinks.astype(F32))
    k_spec = pl.BlockSpec(maps.kv_shape(block_kv, head_dim), maps.kv_map)
    v_spec = pl.BlockSpec(maps.kv_shape(block_kv, head_dim_v), maps.kv_map)
    in_specs = [pl.BlockSpec((None, block_q, head_dim), maps.q_map), k_spec, v_spec, *extra_specs]
    args = [q, k, v, *extra_args]
    out_shape = [jax.ShapeDtypeStruct((heads, q_len, head_dim_v), q.dtype)]
    out_specs = [pl.BlockSpec((None, block_q, head_dim_v), maps.q_map)]
    if keep_lse:
        out_shape.append(jax.ShapeDtypeStruct((heads, 1, q_len), F32))
        out_specs.append(pl.BlockSpec((None, 1, block_q), maps.row_map))
    kernel = functools.partial(
        _kernel, maps=maps, cfg=cfg, patterns=patterns, blocks=blocks, keep_lse=keep_lse,
        materialized=info.partial_mask_ids is not None, has_seg=has_seg, has_sinks=has_sinks,
    )  # fmt: skip
    outs = cm.splash_call(
        kernel, prefetch, args, in_specs, out_specs, cm.softmax_scratch(block_q, head_dim_v), out_shape,
        maps=maps, blocks=blocks, flops=2 * (head_dim + head_dim_v), cfg=cfg,
        name=kernel_name("fwd", cfg, has_seg, keep_lse),
    )  # fmt: skip
    lse = outs[1].reshape(heads, q_len) if keep_lse else None
    return outs[0], lse


def _kernel(*refs, maps, cfg, patterns, blocks, keep_lse, materialized, has_seg, has_sinks):
    block_q, block_kv, block_kv_compute = blocks
    x = cm.take_refs(
        refs, "steps", "base", ("mask_ids", materialized), ("sinks", has_sinks), "q", "k", "v",
        ("mask", materialized), ("seg_q", has_seg), ("seg_kv", has_seg), "o", ("lse", keep_lse), "m", "l", "acc",
    )  # fmt: skip
    h, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    w = maps.word(h, s, t, x.steps)
    q_start = (x.base[s] + w["q_block"]) * block_q
    kv_start = w["kv_block"] * block_kv
    pl.when(w["first"])(lambda: cm.softmax_init(x.m, x.l, x.acc))

    def tile(r0, rows, c0, partial):
        """Queries ``[r0, r0 + rows)`` of the block against its keys ``[c0, c0 + chunk)``."""
        r, c = pl.ds(r0, rows), pl.ds(c0, block_kv_compute)
        # The query block as given to the MXU; the float32 logits taken to base 2 (one
        # multiply, the soft cap's own when there is one): one exp2 per score.
        s_ = lax.dot_general(x.q[r, :], x.k[c, :], cm.NT_DIMS, preferred_element_type=F32)
        s_ = cm.base2_logits(s_, cfg.attn_logits_soft_cap)
        s_ = cm.masked_tile(s_, x, cfg, partial, q_start + r0, kv_start + c0, r, c, rows_are_queries=True)
        cm.softmax_update(s_, x.m, x.l, x.acc, r, lambda p: cm.probs_times(p, x.v[c, :]))

    cm.run_patterns(w["pattern"], patterns, tile, band_of(block_q, block_kv_compute), block_kv_compute, "fwd")
    pl.when(w["last"])(lambda: _finish(x, h, cfg))


def _finish(x, h, cfg) -> None:
    """A query block's last step: the output normalized (the sink's logit joining the
    denominator), and the natural-log logsumexp."""
    m, l = x.m[...], x.l[...]
    if x.sinks is not None:  # the sink's logit joins the softmax's denominator
        sink = x.sinks[h] * _LOG2E
        m_all = jnp.maximum(m, sink)
        alpha = jnp.exp2(m - m_all)
        l = l * alpha + jnp.exp2(sink - m_all)
        scale = alpha / l
        m = m_all
    else:
        # A row that saw no key (its block skipped: m = -inf; every key masked: m the
        # mask value, which no scaled logit reaches) has no softmax: zeros, and a
        # logsumexp of +inf, so that the backward pass's exp(s - lse) is 0 there.
        hidden = m <= cfg.mask_value
        scale = jnp.where(hidden, 0.0, 1.0 / l)
    x.o[...] = (x.acc[...] * cm.lane_replicated(scale, x.acc.shape[1])).astype(x.o.dtype)
    if x.lse is not None:
        lse = (m + jnp.log2(l)) * _LN2  # natural log, as JAX's
        if x.sinks is None:
            lse = jnp.where(hidden, jnp.inf, lse)
        x.lse[...] = cm.as_row(lse)


def band_of(block_q: int, block_kv_compute: int) -> int:
    """The rows of a forward cell: as many as the compute chunk's keys (square cells, so that
    a causal diagonal wastes at most half of one cell per band), at least 256 (taller tiles
    keep the MXU's weights longer), dividing ``block_q``."""
    band = max(min(block_q, block_kv_compute), 256)
    while block_q % band:
        band //= 2
    return max(min(band, block_q), 1)


def kernel_name(phase: str, cfg: cm.Config, segmented: bool, residuals: bool) -> str:
    kind = "mqa" if cfg.is_mqa else "mha"
    return f"splash_{kind}_{phase}{'_segmented' if segmented else ''}{'_residuals' if residuals else '_no_residuals'}"
