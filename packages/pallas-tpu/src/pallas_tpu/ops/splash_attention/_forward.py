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

import math

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
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
    q_band = band_of(block_q, block_kv_compute)
    heads, q_len, head_dim = q.shape
    head_dim_v = v.shape[-1]
    maps = cm.StepMaps.of(info, q, k, block_q, cfg, "splash attention")
    sched = maps.sched
    materialized = info.partial_mask_ids is not None
    has_seg = segment_ids is not None
    has_sinks = sinks is not None
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

    def kernel(*refs):
        refs = list(refs)
        steps_ref, base_ref = refs.pop(0), refs.pop(0)
        if materialized:
            refs.pop(0)
        sinks_ref = refs.pop(0) if has_sinks else None
        q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
        mask_ref = refs.pop(0) if materialized else None
        seg_q_ref, seg_kv_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
        o_ref = refs.pop(0)
        lse_ref = refs.pop(0) if keep_lse else None
        m_ref, l_ref, acc_ref = refs
        h, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        w = maps.word(h, s, t, steps_ref)
        q_start = (base_ref[s] + w["q_block"]) * block_q
        kv_start = w["kv_block"] * block_kv

        @pl.when(w["first"])
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, F32)
            l_ref[...] = jnp.zeros(l_ref.shape, F32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

        def tile(r0, rows, c0, partial):
            """Queries ``[r0, r0 + rows)`` of the block against its keys ``[c0, c0 + chunk)``."""
            cols = block_kv_compute
            r, c = pl.ds(r0, rows), pl.ds(c0, cols)
            # The query block as given to the MXU; the float32 logits taken to base 2 (one
            # multiply, the soft cap's own when there is one): one exp2 per score.
            s_ = lax.dot_general(q_ref[r, :], k_ref[c, :], cm.NT_DIMS, preferred_element_type=F32)
            s_ = cm.base2_logits(s_, cfg.attn_logits_soft_cap)
            keep = cm.keep_mask(
                s_.shape,
                partial=partial,
                mask_function=cfg.mask_function,
                q_start=q_start + r0,
                kv_start=kv_start + c0,
                mask_tile=mask_ref[r, c] if mask_ref is not None else None,
                seg_rows=seg_q_ref[r, :] if has_seg else None,
                seg_cols=seg_kv_ref[:, c] if has_seg else None,
                rows_are_queries=True,
            )
            if keep is not None:
                s_ = jnp.where(keep, s_, cfg.mask_value)
            m_prev = m_ref[r, :]
            m_next = jnp.maximum(m_prev, jnp.max(s_, axis=1, keepdims=True))
            p = jnp.exp2(s_ - cm.lane_replicated(m_next, cols))
            alpha = jnp.exp2(m_prev - m_next)
            m_ref[r, :] = m_next
            l_ref[r, :] = alpha * l_ref[r, :] + jnp.sum(p, axis=1, keepdims=True)
            pv = cm.probs_times(p, v_ref[c, :])
            acc_ref[r, :] = acc_ref[r, :] * cm.lane_replicated(alpha, head_dim_v) + pv

        cm.run_patterns(w["pattern"], patterns, tile, q_band, block_kv_compute, "fwd")

        @pl.when(w["last"])
        def _finish():
            m, l = m_ref[...], l_ref[...]
            if sinks_ref is not None:  # the sink's logit joins the softmax's denominator
                sink = sinks_ref[h] * _LOG2E
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
            o_ref[...] = (acc_ref[...] * cm.lane_replicated(scale, head_dim_v)).astype(o_ref.dtype)
            if lse_ref is not None:
                lse = (m + jnp.log2(l)) * _LN2  # natural log, as JAX's
                if sinks_ref is None:
                    lse = jnp.where(hidden, jnp.inf, lse)
                lse_ref[...] = cm.as_row(lse)

    scratch = [
        pltpu.VMEM((block_q, cm.NUM_LANES), F32),  # running max
        pltpu.VMEM((block_q, cm.NUM_LANES), F32),  # running sum
        pltpu.VMEM((block_q, head_dim_v), F32),  # unnormalized output
    ]
    steps_total = heads * sched.q_shards * sched.num_steps
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=sched.grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=cm.compiler_params(),
        cost_estimate=cm.cost(2 * (head_dim + head_dim_v), steps_total * block_q * block_kv, args, out_shape),
        interpret=cfg.interpret,
        name=kernel_name("fwd", cfg, has_seg, keep_lse),
    )(*prefetch, *args)
    lse = outs[1].reshape(heads, q_len) if keep_lse else None
    return outs[0], lse


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
