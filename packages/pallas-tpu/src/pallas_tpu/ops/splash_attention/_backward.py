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
* fused (``use_fused_bwd_kernel=True``, the default blocks' choice): the ``dk``/``dv`` kernel also
  takes each tile's share of ``dq`` (``ds k``, from the transposed ``ds`` it already has) into its
  head's float32 ``dq``, kept whole in VMEM across the head's steps (``fits_fused``: up to 8 MiB,
  else the two kernels above run), so the scores are computed once.

Both sweep a step in cells (``cell_of``: 512 x 512 in the default 1024 blocks) by
``run_patterns``, as the forward does: a causal diagonal block skips its empty cell, and its
full cell takes no mask arithmetic. Unlike the forward's, a pattern of more than 1M scores loops
over its alike chunks (``_common.STRAIGHT_LINE_SCORES["bwd"]``: as fast on the v5e, less code).

The gradient of a sink is ``-sum_rows exp(sink - lse) * di``, computed with ``jnp``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops.splash_attention import _common as cm
from pallas_tpu.ops.splash_attention._forward import kernel_name

F32 = cm.F32
TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b


def backward(
    dq_info, dkv_info, q, k, v, segment_ids, sinks, out, lse, d_out, *, cfg, dq_blocks, dkv_blocks, patterns,
    fused=False,
):  # fmt: skip
    """``(dq, dk, dv, dsinks)``; ``patterns``: those of the ``dq`` and the ``dk``/``dv`` schedules;
    ``fused``: ``dq`` computed in the ``dk``/``dv`` kernel where a head's fits VMEM (``fits_fused``)."""
    heads, q_len, _ = q.shape
    di = jnp.sum(out.astype(F32) * d_out.astype(F32), axis=-1)  # [heads, q_len]
    lse_rows, di_rows = lse.reshape(heads, 1, q_len), di.reshape(heads, 1, q_len)
    dq_patterns, dkv_patterns = patterns
    if fused and fits_fused(q):
        dq, dk, dv = _dkv(
            dkv_info, q, k, v, segment_ids, lse_rows, di_rows, d_out, cfg=cfg, blocks=dkv_blocks,
            patterns=dkv_patterns, fused=True,
        )  # fmt: skip
        return dq, dk, dv, _dsinks(sinks, lse, di)
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
    return dq, dk, dv, _dsinks(sinks, lse, di)


def _dsinks(sinks, lse, di):
    if sinks is None:
        return None
    weight = jnp.exp(sinks.astype(F32)[:, None] - lse)
    return (-jnp.sum(weight * di, axis=-1)).astype(sinks.dtype)


# The most bytes a head's float32 dq accumulator may take for the fused backward kernel (it
# stays in VMEM for the head's whole sweep, beside its double-buffered output block).
FUSED_DQ_BYTES = 8 << 20


def fits_fused(q) -> bool:
    """Whether a head's ``dq`` (``q``'s length by its head dim, float32) fits ``FUSED_DQ_BYTES``."""
    return q.shape[-2] * q.shape[-1] * 4 <= FUSED_DQ_BYTES


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
    head_dim = q.shape[-1]
    maps = cm.StepMaps.of(info, q, k, block_q, cfg, "splash attention dq")
    has_seg = segment_ids is not None
    prefetch, in_specs, args = _inputs(
        maps, info, (q, k, v, d_out, lse_rows, di_rows), segment_ids, blocks, rows_are_queries=True
    )
    kernel = functools.partial(
        _dq_kernel, maps=maps, cfg=cfg, patterns=patterns, blocks=blocks,
        materialized=info.partial_mask_ids is not None, has_seg=has_seg,
    )  # fmt: skip
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    scratch = [
        pltpu.VMEM((block_q, head_dim), F32),
        pltpu.VMEM((block_q, cm.NUM_LANES), F32),
        pltpu.VMEM((block_q, cm.NUM_LANES), F32),
    ]
    (dq,) = cm.splash_call(
        kernel, prefetch, args, in_specs, [pl.BlockSpec((None, block_q, head_dim), maps.q_map)], scratch,
        out_shape, maps=maps, blocks=blocks, flops=6 * head_dim, cfg=cfg, name=kernel_name("dq", cfg, has_seg, False),
    )  # fmt: skip
    return dq


def _refs(refs, materialized: bool, has_seg: bool, segments: tuple[str, str], *outs: str):
    """A backward kernel's refs by name: the schedule's, the dense inputs, the mask's partial
    blocks, the segment ids (``segments``: their names in order) and ``outs``."""
    return cm.take_refs(
        refs, "steps", "base", ("mask_ids", materialized), "q", "k", "v", "do", "lse", "di",
        ("mask", materialized), (segments[0], has_seg), (segments[1], has_seg), *outs,
    )  # fmt: skip


def _scores(x, w, s, cfg, blocks, rows, cols, q0, kv0, r, c, partial, *, rows_are_queries: bool):
    """A backward tile's natural-log logits ``rows @ cols.T`` (capped: also ``tanh``, for the
    cap's gradient, else None), masked; ``q0``, ``kv0`` its offsets in the step's blocks."""
    s_ = lax.dot_general(rows, cols, cm.NT_DIMS, preferred_element_type=F32)
    t_ = None
    if cfg.attn_logits_soft_cap is not None:
        s_, t_ = cm.cap_logits(s_, cfg.attn_logits_soft_cap)
    q_start = (x.base[s] + w["q_block"]) * blocks[0] + q0
    kv_start = w["kv_block"] * blocks[1] + kv0
    return cm.masked_tile(s_, x, cfg, partial, q_start, kv_start, r, c, rows_are_queries=rows_are_queries), t_


def _dq_kernel(*refs, maps, cfg, patterns, blocks, materialized, has_seg):
    x = _refs(refs, materialized, has_seg, ("seg_q", "seg_kv"), "dq", "acc", "lse_col", "di_col")
    band, chunk = cell_of(blocks[0]), cell_of(blocks[1])
    h, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    w = maps.word(h, s, t, x.steps)

    @pl.when(w["first"])
    def _init():
        x.acc[...] = jnp.zeros(x.acc.shape, F32)
        x.lse_col[...] = cm.as_column(x.lse[...])
        x.di_col[...] = cm.as_column(x.di[...])

    def body(r0, rows, c0, partial):
        """Queries ``[r0, r0 + rows)`` of the block against its keys ``[c0, c0 + chunk)``."""
        r, c = pl.ds(r0, rows), pl.ds(c0, chunk)
        k_tile = x.k[c, :]
        s_, t_ = _scores(
            x, w, s, cfg, blocks, x.q[r, :], k_tile, r0, c0, r, c, partial, rows_are_queries=True
        )
        p = jnp.exp(s_ - cm.lane_replicated(x.lse_col[r, :], chunk))
        dp = lax.dot_general(x.do[r, :], x.v[c, :], cm.NT_DIMS, preferred_element_type=F32)
        ds = p * (dp - cm.lane_replicated(x.di_col[r, :], chunk))
        if t_ is not None:
            ds = _softcap_grad(ds, t_)
        x.acc[r, :] += lax.dot(ds.astype(k_tile.dtype), k_tile, preferred_element_type=F32)

    cm.run_patterns(w["pattern"], patterns, body, band, chunk, "bwd")

    @pl.when(w["last"])
    def _finish():
        x.dq[...] = x.acc[...].astype(x.dq.dtype)


def _dkv(
    info, q, k, v, segment_ids, lse_rows, di_rows, d_out, *, cfg: cm.Config, blocks, patterns, fused=False
):
    block_kv = blocks[1]
    heads, _, head_dim = q.shape
    kv_len, head_dim_v = k.shape[-2], v.shape[-1]
    maps = cm.StepMaps.of(info, q, k, blocks[0], cfg, "splash attention dkv")
    sched, group = maps.sched, maps.group
    # Each q head (and q shard of this call) writes its own dk, dv when they must be summed.
    summed = group > 1 or sched.q_shards > 1
    has_seg = segment_ids is not None
    prefetch, in_specs, args = _inputs(
        maps, info, (q, k, v, d_out, lse_rows, di_rows), segment_ids, blocks, rows_are_queries=False
    )

    def dkv_map(h, s, t, steps_ref, *_):
        kv = maps.kv_block(h, s, t, steps_ref)
        return (s, h, kv, 0) if summed else (h, kv, 0)

    kernel = functools.partial(
        _dkv_kernel, maps=maps, cfg=cfg, patterns=patterns, blocks=blocks,
        materialized=info.partial_mask_ids is not None, has_seg=has_seg, fused=fused,
    )  # fmt: skip
    lead: tuple[int, ...] = (sched.q_shards, heads) if summed else (heads,)
    block_lead: tuple[None, ...] = (None,) * len(lead)
    dtypes = (F32, F32) if summed else (k.dtype, v.dtype)
    out_shape = [
        jax.ShapeDtypeStruct((*lead, kv_len, d), dt) for d, dt in zip((head_dim, head_dim_v), dtypes)
    ]
    out_specs = [pl.BlockSpec((*block_lead, block_kv, d), dkv_map) for d in (head_dim, head_dim_v)]
    scratch = [pltpu.VMEM((block_kv, head_dim), F32), pltpu.VMEM((block_kv, head_dim_v), F32)]
    semantics = None
    if fused:  # a head's dq: one block for all its steps, accumulated in VMEM
        out_shape.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
        out_specs.append(pl.BlockSpec((None, q.shape[1], head_dim), lambda h, s, t, *_: (h, 0, 0)))
        scratch.append(pltpu.VMEM((q.shape[1], head_dim), F32))
        semantics = ("parallel", "arbitrary", "arbitrary")
    dk, dv, *dq = cm.splash_call(
        kernel, prefetch, args, in_specs, out_specs, scratch, out_shape, maps=maps, blocks=blocks,
        flops=(6 if fused else 4) * head_dim + 4 * head_dim_v, cfg=cfg, semantics=semantics,
        name=kernel_name("dkv_fused" if fused else "dkv", cfg, has_seg, False),
    )  # fmt: skip
    if summed:
        dk, dv = dk.sum(axis=0), dv.sum(axis=0)  # over the q shards of this call
        if cfg.is_mqa:
            dk, dv = dk.sum(axis=0), dv.sum(axis=0)
        else:
            dk = dk.reshape(heads // group, group, kv_len, head_dim).sum(axis=1)
            dv = dv.reshape(heads // group, group, kv_len, head_dim_v).sum(axis=1)
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    return (dq[0], dk, dv) if fused else (dk, dv)


def _dkv_kernel(*refs, maps, cfg, patterns, blocks, materialized, has_seg, fused=False):
    x = _refs(
        refs, materialized, has_seg, ("seg_kv", "seg_q"), "dk", "dv", ("dq", fused), "dk_acc", "dv_acc",
        ("dq_acc", fused),
    )  # fmt: skip
    block_kv_compute = blocks[2]
    h, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    w = maps.word(h, s, t, x.steps)

    if fused:  # a head's first grid step

        @pl.when((s == 0) & (t == 0))
        def _init_dq():
            x.dq_acc[...] = jnp.zeros(x.dq_acc.shape, F32)

    @pl.when(w["first"])
    def _init():
        x.dk_acc[...] = jnp.zeros(x.dk_acc.shape, F32)
        x.dv_acc[...] = jnp.zeros(x.dv_acc.shape, F32)

    def chunk(q0, q_rows, r0, partial):
        """Keys ``[r0, r0 + block_kv_compute)`` of the block against its queries ``[q0, q0 + q_rows)``."""
        r, qs = pl.ds(r0, block_kv_compute), pl.ds(q0, q_rows)
        q_tile, do_tile = x.q[qs, :], x.do[qs, :]
        # keys x queries
        s_, t_ = _scores(
            x, w, s, cfg, blocks, x.k[r, :], q_tile, q0, r0, r, qs, partial, rows_are_queries=False
        )
        p = jnp.exp(s_ - x.lse[:, qs])
        x.dv_acc[r, :] += lax.dot(p.astype(do_tile.dtype), do_tile, preferred_element_type=F32)
        dp = lax.dot_general(x.v[r, :], do_tile, cm.NT_DIMS, preferred_element_type=F32)
        ds = p * (dp - x.di[:, qs])
        if t_ is not None:
            ds = _softcap_grad(ds, t_)
        ds = ds.astype(q_tile.dtype)
        x.dk_acc[r, :] += lax.dot(ds, q_tile, preferred_element_type=F32)
        if fused:  # dq of these queries: ds^T k, summed over the head's key blocks
            rows = pl.ds(pl.multiple_of((x.base[s] + w["q_block"]) * blocks[0] + q0, 8), q_rows)
            x.dq_acc[rows, :] += lax.dot_general(ds, x.k[r, :], TN_DIMS, preferred_element_type=F32)

    cm.run_patterns(w["pattern"], patterns, chunk, cell_of(blocks[0]), block_kv_compute, "bwd")

    @pl.when(w["last"])
    def _finish():
        x.dk[...] = x.dk_acc[...].astype(x.dk.dtype)
        x.dv[...] = x.dv_acc[...].astype(x.dv.dtype)

    if fused:  # a head's last grid step

        @pl.when((s == pl.num_programs(1) - 1) & (t == pl.num_programs(2) - 1))
        def _finish_dq():
            x.dq[...] = x.dq_acc[...].astype(x.dq.dtype)
