"""The splash attention backward kernels, visiting only the mask's non-empty blocks.

* ``dq``: query-major, the forward's walk (its own block sizes): per step the scores of the
  q block against the step's kv block are recomputed, ``p = exp(s - lse)``,
  ``ds = p * (dO v^T - di)``, ``dq += ds k``; ``lse`` and ``di = rowsum(dO * O)`` come as
  lane-dense rows and are turned into lane-replicated columns once per q block.
* ``dk``/``dv``: key-major (the transposed schedule): the owned kv block's ``dk``, ``dv``
  accumulate in VMEM over the q blocks that see it, the scores taken transposed
  (``k q^T``: keys on rows), so that ``lse`` and ``di`` broadcast as rows and the products
  ``p^T dO`` and ``ds^T q`` are plain matmuls. With grouped or shared kv heads, or several q
  shards in one call, each q head (and shard) writes its own float32 ``dk``/``dv``, summed after.

Both sweep a step in cells (``cell_of``: 512 x 512 in the default 1024 blocks) by
``run_patterns``, as the forward does: a causal diagonal block skips its empty cell, and its
full cell takes no mask arithmetic. Unlike the forward's, a pattern of more than 1M scores loops
over its alike chunks (``_common.STRAIGHT_LINE_SCORES["bwd"]``: as fast on the v5e, less code).

The gradient of a sink is ``-sum_rows exp(sink - lse) * di``, computed with ``jnp``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops.splash_attention import _common as cm
from pallas_tpu.ops.splash_attention._forward import kernel_name

F32 = cm.F32


def backward(
    dq_info, dkv_info, q, k, v, segment_ids, sinks, out, lse, d_out, *, cfg, dq_blocks, dkv_blocks, patterns
):
    """``(dq, dk, dv, dsinks)``; ``patterns``: those of the ``dq`` and the ``dk``/``dv`` schedules."""
    heads, q_len, _ = q.shape
    di = jnp.sum(out.astype(F32) * d_out.astype(F32), axis=-1)  # [heads, q_len]
    lse_rows, di_rows = lse.reshape(heads, 1, q_len), di.reshape(heads, 1, q_len)
    dq_patterns, dkv_patterns = patterns
    dq = _dq(
        dq_info,
        q,
        k,
        v,
        segment_ids,
        lse_rows,
        di_rows,
        d_out,
        cfg=cfg,
        blocks=dq_blocks,
        patterns=dq_patterns,
    )
    dk, dv = _dkv(
        dkv_info,
        q,
        k,
        v,
        segment_ids,
        lse_rows,
        di_rows,
        d_out,
        cfg=cfg,
        blocks=dkv_blocks,
        patterns=dkv_patterns,
    )
    dsinks = None
    if sinks is not None:
        weight = jnp.exp(sinks.astype(F32)[:, None] - lse)
        dsinks = (-jnp.sum(weight * di, axis=-1)).astype(sinks.dtype)
    return dq, dk, dv, dsinks


def cell_of(block: int) -> int:
    """The side of the backward kernels' cells along a block of ``block`` queries (or, for
    ``dq``, keys): half the block from 512 up (cells of 512 in the default 1024 blocks), else
    the block. A causal diagonal block then skips its empty quarter instead of computing all
    of it: at L=4096 and 1024 blocks a causal backward pass computes 10 blocks of pairs for
    8 blocks' worth, in 512 x 512 cells 9 (libtpu's v5e bundles: the full cells run at the
    MXU's rate either way)."""
    return block // 2 if block >= 512 and block % 256 == 0 else block


def _inputs(maps: cm.StepMaps, info, dense, segment_ids, blocks, *, rows_are_queries: bool):
    """``(prefetch, in_specs, args)`` of a backward kernel: ``dense`` (q, k, v, dO, lse, di),
    then the mask's partial blocks and the segment ids."""
    block_q, block_kv = blocks[:2]
    head_dim, head_dim_v = dense[0].shape[-1], dense[2].shape[-1]
    extra_specs, extra_args = maps.mask_and_segment_inputs(
        info, segment_ids, block_q, block_kv, rows_are_queries=rows_are_queries
    )
    prefetch = cm.prefetch_of(info)
    q_spec = pl.BlockSpec((None, block_q, head_dim), maps.q_map)
    do_spec = pl.BlockSpec((None, block_q, head_dim_v), maps.q_map)
    k_spec = pl.BlockSpec(maps.kv_shape(block_kv, head_dim), maps.kv_map)
    v_spec = pl.BlockSpec(maps.kv_shape(block_kv, head_dim_v), maps.kv_map)
    row_spec = pl.BlockSpec((None, 1, block_q), maps.row_map)
    in_specs = [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec, *extra_specs]
    return prefetch, in_specs, [*dense, *extra_args]


def _softcap_grad(ds, t):
    """``ds`` through ``cap * tanh(s / cap)``: times ``1 - tanh^2``."""
    return ds * (1.0 - t * t)


def _dq(info, q, k, v, segment_ids, lse_rows, di_rows, d_out, *, cfg: cm.Config, blocks, patterns):
    block_q, block_kv = blocks
    band, chunk = cell_of(block_q), cell_of(block_kv)
    heads, q_len, head_dim = q.shape
    maps = cm.StepMaps.of(info, q, k, block_q, cfg, "splash attention dq")
    sched = maps.sched
    materialized = info.partial_mask_ids is not None
    has_seg = segment_ids is not None
    prefetch, in_specs, args = _inputs(
        maps, info, (q, k, v, d_out, lse_rows, di_rows), segment_ids, blocks, rows_are_queries=True
    )

    def kernel(*refs):
        refs = list(refs)
        steps_ref, base_ref = refs.pop(0), refs.pop(0)
        if materialized:
            refs.pop(0)
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
        del refs[:6]
        mask_ref = refs.pop(0) if materialized else None
        seg_q_ref, seg_kv_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
        dq_ref, acc_ref, lse_col, di_col = refs
        h, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        w = maps.word(h, s, t, steps_ref)

        @pl.when(w["first"])
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)
            lse_col[...] = cm.as_column(lse_ref[...])
            di_col[...] = cm.as_column(di_ref[...])

        def body(r0, rows, c0, partial):
            """Queries ``[r0, r0 + rows)`` of the block against its keys ``[c0, c0 + chunk)``."""
            r, c = pl.ds(r0, rows), pl.ds(c0, chunk)
            k_tile = k_ref[c, :]
            s_ = lax.dot_general(q_ref[r, :], k_tile, cm.NT_DIMS, preferred_element_type=F32)
            t_ = None
            if cfg.attn_logits_soft_cap is not None:
                s_, t_ = cm.cap_logits(s_, cfg.attn_logits_soft_cap)
            keep = cm.keep_mask(
                s_.shape,
                partial=partial,
                mask_function=cfg.mask_function,
                q_start=(base_ref[s] + w["q_block"]) * block_q + r0,
                kv_start=w["kv_block"] * block_kv + c0,
                mask_tile=mask_ref[r, c] if mask_ref is not None else None,
                seg_rows=seg_q_ref[r, :] if has_seg else None,
                seg_cols=seg_kv_ref[:, c] if has_seg else None,
                rows_are_queries=True,
            )
            if keep is not None:
                s_ = jnp.where(keep, s_, cfg.mask_value)
            p = jnp.exp(s_ - cm.lane_replicated(lse_col[r, :], chunk))
            dp = lax.dot_general(do_ref[r, :], v_ref[c, :], cm.NT_DIMS, preferred_element_type=F32)
            ds = p * (dp - cm.lane_replicated(di_col[r, :], chunk))
            if t_ is not None:
                ds = _softcap_grad(ds, t_)
            acc_ref[r, :] += lax.dot(ds.astype(k_tile.dtype), k_tile, preferred_element_type=F32)

        cm.run_patterns(w["pattern"], patterns, body, band, chunk, "bwd")

        @pl.when(w["last"])
        def _finish():
            dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)

    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    scratch = [
        pltpu.VMEM((block_q, head_dim), F32),
        pltpu.VMEM((block_q, cm.NUM_LANES), F32),
        pltpu.VMEM((block_q, cm.NUM_LANES), F32),
    ]
    steps_total = heads * sched.q_shards * sched.num_steps
    (dq,) = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=sched.grid,
            in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, block_q, head_dim), maps.q_map)],
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=cm.compiler_params(),
        cost_estimate=cm.cost(6 * head_dim, steps_total * block_q * block_kv, args, out_shape),
        interpret=cfg.interpret,
        name=kernel_name("dq", cfg, has_seg, False),
    )(*prefetch, *args)
    return dq


def _dkv(info, q, k, v, segment_ids, lse_rows, di_rows, d_out, *, cfg: cm.Config, blocks, patterns):
    block_q, block_kv, block_kv_compute = blocks
    band = cell_of(block_q)
    heads, q_len, head_dim = q.shape
    kv_len, head_dim_v = k.shape[-2], v.shape[-1]
    maps = cm.StepMaps.of(info, q, k, block_q, cfg, "splash attention dkv")
    sched, group = maps.sched, maps.group
    kv_heads = heads // group
    # Each q head (and q shard of this call) writes its own dk, dv when they must be summed.
    summed = group > 1 or sched.q_shards > 1
    materialized = info.partial_mask_ids is not None
    has_seg = segment_ids is not None
    prefetch, in_specs, args = _inputs(
        maps, info, (q, k, v, d_out, lse_rows, di_rows), segment_ids, blocks, rows_are_queries=False
    )

    def dkv_map(h, s, t, steps_ref, *_):
        kv = maps.kv_block(h, s, t, steps_ref)
        return (s, h, kv, 0) if summed else (h, kv, 0)

    def kernel(*refs):
        refs = list(refs)
        steps_ref, base_ref = refs.pop(0), refs.pop(0)
        if materialized:
            refs.pop(0)
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
        del refs[:6]
        mask_ref = refs.pop(0) if materialized else None
        seg_kv_ref, seg_q_ref = (refs.pop(0), refs.pop(0)) if has_seg else (None, None)
        dk_ref, dv_ref, dk_acc, dv_acc = refs
        h, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        w = maps.word(h, s, t, steps_ref)

        @pl.when(w["first"])
        def _init():
            dk_acc[...] = jnp.zeros(dk_acc.shape, F32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, F32)

        def chunk(q0, q_rows, r0, partial):
            """Keys ``[r0, r0 + block_kv_compute)`` of the block against its queries
            ``[q0, q0 + q_rows)``."""
            rows = block_kv_compute
            r, qs = pl.ds(r0, rows), pl.ds(q0, q_rows)
            q_tile, do_tile = q_ref[qs, :], do_ref[qs, :]
            s_ = lax.dot_general(
                k_ref[r, :], q_tile, cm.NT_DIMS, preferred_element_type=F32
            )  # keys x queries
            t_ = None
            if cfg.attn_logits_soft_cap is not None:
                s_, t_ = cm.cap_logits(s_, cfg.attn_logits_soft_cap)
            keep = cm.keep_mask(
                s_.shape,
                partial=partial,
                mask_function=cfg.mask_function,
                q_start=(base_ref[s] + w["q_block"]) * block_q + q0,
                kv_start=w["kv_block"] * block_kv + r0,
                mask_tile=mask_ref[r, qs] if mask_ref is not None else None,
                seg_rows=seg_kv_ref[r, :] if has_seg else None,
                seg_cols=seg_q_ref[:, qs] if has_seg else None,
                rows_are_queries=False,
            )
            if keep is not None:
                s_ = jnp.where(keep, s_, cfg.mask_value)
            p = jnp.exp(s_ - lse_ref[:, qs])
            dv_acc[r, :] += lax.dot(p.astype(do_tile.dtype), do_tile, preferred_element_type=F32)
            dp = lax.dot_general(v_ref[r, :], do_tile, cm.NT_DIMS, preferred_element_type=F32)
            ds = p * (dp - di_ref[:, qs])
            if t_ is not None:
                ds = _softcap_grad(ds, t_)
            dk_acc[r, :] += lax.dot(ds.astype(q_tile.dtype), q_tile, preferred_element_type=F32)

        cm.run_patterns(w["pattern"], patterns, chunk, band, block_kv_compute, "bwd")

        @pl.when(w["last"])
        def _finish():
            dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    lead: tuple[int, ...] = (sched.q_shards, heads) if summed else (heads,)
    block_lead: tuple[None, ...] = (None,) * len(lead)
    dtypes = (F32, F32) if summed else (k.dtype, v.dtype)
    out_shape = [
        jax.ShapeDtypeStruct((*lead, kv_len, d), dt) for d, dt in zip((head_dim, head_dim_v), dtypes)
    ]
    out_specs = [pl.BlockSpec((*block_lead, block_kv, d), dkv_map) for d in (head_dim, head_dim_v)]
    scratch = [pltpu.VMEM((block_kv, head_dim), F32), pltpu.VMEM((block_kv, head_dim_v), F32)]
    steps_total = heads * sched.q_shards * sched.num_steps
    dk, dv = pl.pallas_call(
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
        cost_estimate=cm.cost(4 * (head_dim + head_dim_v), steps_total * block_q * block_kv, args, out_shape),
        interpret=cfg.interpret,
        name=kernel_name("dkv", cfg, has_seg, False),
    )(*prefetch, *args)
    if summed:
        dk, dv = dk.sum(axis=0), dv.sum(axis=0)  # over the q shards of this call
        if cfg.is_mqa:
            dk, dv = dk.sum(axis=0), dv.sum(axis=0)
        else:
            dk = dk.reshape(kv_heads, group, kv_len, head_dim).sum(axis=1)
            dv = dv.reshape(kv_heads, group, kv_len, head_dim_v).sum(axis=1)
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    return dk, dv
