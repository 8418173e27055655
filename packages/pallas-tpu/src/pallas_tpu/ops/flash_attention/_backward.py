"""The backward kernels: ``dk``/``dv`` key-major with ``dq`` fused, and the separate query-major ``dq``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu

from ._blocks import F32, LOG2E, NUM_LANES, TRANS_B_DIM_NUMBERS
from ._forward import cost_estimate
from ._tiles import (
    Sweep,
    as_column,
    as_row,
    base2_logits,
    causal_kv_block,
    grid_params,
    lane_replicated,
    masked_scores,
    query_major_inputs,
    segment_id_operands,
    square_tile,
)


def logit_grads(p, dp_minus_di, sm_scale):
    """The gradient of the scaled logits ``(s + ab) * sm_scale``: ``p * (dp - di) * sm_scale`` in
    float32, scaled before it is rounded for the MXU, as JAX's kernels do (scaling the float32
    accumulators afterwards instead saves a multiply per score but rounds another number: up to
    1.3x JAX's dq/dk error at sm_scale = D**-0.5 on a v5e)."""
    ds = p * dp_minus_di
    return ds if sm_scale == 1.0 else ds * sm_scale


def backward_dq(q, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug):
    return _dq_call(
        q, k, v, ab, segment_ids, lse, d_out, di, causal=causal, sm_scale=sm_scale,
        block_q=blocks.block_q_dq, block_kv=blocks.block_k_major_dq, tile_kv=blocks.block_k_dq, debug=debug,
    )  # fmt: skip


def _dq_call(
    q, k, v, ab, segment_ids, lse, d_out, di, *, causal, sm_scale, block_q, block_kv, tile_kv, debug
):
    """``(dq, dab)`` (``dab`` None without ``ab``): per query block, the keys swept as in the forward."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    n_q, n_kv = q_len // block_q, kv_len // block_kv
    sweep = Sweep(block_q, block_kv, block_q, tile_kv, causal, True, square_tile(block_q, block_kv))
    row_ids, col_ids = segment_id_operands(segment_ids, kv_major=False)
    scale2 = sm_scale * LOG2E  # base-2 logits, as the forward pass's

    kv_block = causal_kv_block(causal, block_q, block_kv)

    def kernel(*refs):
        refs = list(refs)
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
        del refs[:6]
        ab_ref = refs.pop(0) if ab is not None else None
        rid_ref, cid_ref = (refs.pop(0), refs.pop(0)) if segment_ids is not None else (None, None)
        dq_ref = refs.pop(0)
        dab_ref = refs.pop(0) if ab is not None else None
        acc_ref, lse_col_ref, di_col_ref = refs
        i, j = pl.program_id(2), pl.program_id(3)

        @pl.when(j == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)
            lse_col_ref[...] = as_column(lse_ref[...])
            di_col_ref[...] = as_column(di_ref[...])

        if dab_ref is not None and causal:
            dab_ref[...] = jnp.zeros(dab_ref.shape, dab_ref.dtype)  # what no tile writes is masked

        def tile(r0, rows, c0, cols, diagonal):
            r, c = pl.ds(r0, rows), pl.ds(c0, cols)
            k_tile = k_ref[c, :]
            s = lax.dot_general(q_ref[r, :], k_tile, TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
            s = base2_logits(s, None if ab_ref is None else ab_ref[r, c], scale2)
            s = masked_scores(s, rid_ref, cid_ref, r, c, diagonal, rows_are_queries=True)
            p = jnp.exp2(s - lane_replicated(lse_col_ref[r, :], cols))
            dp = lax.dot_general(do_ref[r, :], v_ref[c, :], TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
            ds = logit_grads(p, dp - lane_replicated(di_col_ref[r, :], cols), sm_scale)
            acc_ref[r, :] += lax.dot(ds.astype(k_tile.dtype), k_tile, preferred_element_type=F32)
            if dab_ref is not None:
                dab_ref[r, c] = ds.astype(dab_ref.dtype)

        sweep.run(tile, i * block_q, j * block_kv)

        @pl.when(j == n_kv - 1)
        def _():
            dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)

    q_spec = pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, i, j: (b, h, kv_block(i, j), 0))
    row_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j: (b, h, 0, i))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    extra_specs, extra_args = query_major_inputs(ab, row_ids, col_ids, block_q, block_kv, kv_block)
    in_specs += extra_specs
    args = [q, k, v, d_out, lse, di, *extra_args]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [q_spec]
    if ab is not None:
        out_shape.append(jax.ShapeDtypeStruct(ab.shape, ab.dtype))
        out_specs.append(pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, i, j: (b, h, i, j)))
    scratch = [
        pltpu.VMEM((block_q, head_dim), F32),  # dq accumulator
        pltpu.VMEM((block_q, NUM_LANES), F32),  # logsumexp, lane-replicated
        pltpu.VMEM((block_q, NUM_LANES), F32),  # di, lane-replicated
    ]
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(batch, heads, n_q, n_kv),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=grid_params(("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate(3, q, k, causal, args, out_shape),
        debug=debug,
        name="flash_attention_dq",
    )(*args)
    return outs[0], (outs[1] if ab is not None else None)


def backward_dkv(q, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug, with_dq=False):
    return _dkv_call(
        q, k, v, ab, segment_ids, lse, d_out, di, causal=causal, sm_scale=sm_scale,
        block_kv=blocks.block_k_major_dkv, block_q=blocks.block_q_major_dkv, tile_kv=blocks.block_k_dkv,
        tile_q=blocks.block_q_dkv, debug=debug, with_dq=with_dq,
    )  # fmt: skip


def _dkv_call(
    q,
    k,
    v,
    ab,
    segment_ids,
    lse,
    d_out,
    di,
    *,
    causal,
    sm_scale,
    block_kv,
    block_q,
    tile_kv,
    tile_q,
    debug,
    with_dq=False,
):
    """``(dk, dv)``, and with ``with_dq`` also ``(dq, dab)``: per key block, the queries swept in
    tiles of the transposed scores ``k @ q.T``.

    Without ``with_dq``, ``di`` is ``rowsum(dO * O)`` as ``[b, h, 1, q_len]``. With ``with_dq``
    (one fused backward kernel), ``di`` is the forward's output ``O``: the first key block's steps
    copy each query block and compute its ``di`` into VMEM, where they stay for the other key blocks (no XLA
    passes over ``q``, ``O`` and ``dO``), and the gradient of the queries is accumulated in VMEM
    across the key blocks (a float32 ``[q_len, head_dim]`` per head), which saves the separate
    ``dq`` kernel's recomputation of the scores and of ``dO @ v.T``.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    n_kv, n_q = kv_len // block_kv, q_len // block_q
    sweep = Sweep(block_kv, block_q, tile_kv, tile_q, causal, False, square_tile(block_kv, block_q))
    row_ids, col_ids = segment_id_operands(segment_ids, kv_major=True)
    scale2 = sm_scale * LOG2E  # base-2 logits, as the forward pass's
    with_dab = with_dq and ab is not None

    def q_block(j, i):
        # Causal: steps before the key block's first key re-name the first query block needed
        # (the last query block where the key block lies past every query: keys beyond the
        # queries, kv_len > q_len, are seen by none and their steps do nothing).
        return jnp.minimum(jnp.maximum(i, (j * block_kv) // block_q), n_q - 1) if causal else i

    def first_pass_block(j, i):
        # Read on the first key block's steps only (which visit every query block); after them
        # the last block stays named, so nothing more is copied.
        return jnp.where(j == 0, i, n_q - 1)

    def kernel(*refs):
        refs = list(refs)
        q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
        del refs[:6]
        ab_ref = refs.pop(0) if ab is not None else None
        rid_ref, cid_ref = (refs.pop(0), refs.pop(0)) if segment_ids is not None else (None, None)
        dk_ref, dv_ref = refs.pop(0), refs.pop(0)
        dq_ref = refs.pop(0) if with_dq else None
        dab_ref = refs.pop(0) if with_dab else None
        dk_acc, dv_acc = refs.pop(0), refs.pop(0)
        j, i = pl.program_id(2), pl.program_id(3)
        q_start = i * block_q
        if with_dq:
            dq_acc, q_all, di_all = refs
            here = pl.ds(q_start, block_q)

            @pl.when(j == 0)
            def _():
                @pl.when(i == 0)
                def _():
                    dq_acc[...] = jnp.zeros(dq_acc.shape, F32)

                q_all[here, :] = q_ref[...]
                d = jnp.sum(di_ref[...].astype(F32) * do_ref[...].astype(F32), axis=1, keepdims=True)
                di_all[:, here] = as_row(jnp.broadcast_to(d, (block_q, NUM_LANES)))

            def queries(c):
                return q_all[pl.ds(q_start + c.start, c.size), :]

            def corrections(c):
                return di_all[:, pl.ds(q_start + c.start, c.size)]

        else:

            def queries(c):
                return q_ref[c, :]

            def corrections(c):
                return di_ref[:, c]

        @pl.when(i == 0)
        def _():
            dk_acc[...] = jnp.zeros(dk_acc.shape, F32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, F32)

        if dab_ref is not None and causal:
            dab_ref[...] = jnp.zeros(dab_ref.shape, dab_ref.dtype)  # what no tile writes is masked

        def tile(r0, rows, c0, cols, diagonal):
            """Keys ``[r0, r0+rows)`` of the key block against queries ``[c0, c0+cols)`` of the query block."""
            r, c = pl.ds(r0, rows), pl.ds(c0, cols)
            q_tile, do_tile, k_tile = queries(c), do_ref[c, :], k_ref[r, :]
            s = lax.dot_general(k_tile, q_tile, TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
            s = base2_logits(s, None if ab_ref is None else jnp.transpose(ab_ref[c, r].astype(F32)), scale2)
            s = masked_scores(s, rid_ref, cid_ref, r, c, diagonal, rows_are_queries=False)
            p = jnp.exp2(s - lse_ref[:, c])
            dv_acc[r, :] += lax.dot(p.astype(do_tile.dtype), do_tile, preferred_element_type=F32)
            dp = lax.dot_general(v_ref[r, :], do_tile, TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
            ds = logit_grads(p, dp - corrections(c), sm_scale)
            ds_low = ds.astype(q_tile.dtype)
            dk_acc[r, :] += lax.dot(ds_low, q_tile, preferred_element_type=F32)
            if with_dq:
                dq_acc[pl.ds(q_start + c0, cols), :] += lax.dot_general(
                    ds_low, k_tile, (((0,), (0,)), ((), ())), preferred_element_type=F32
                )
            if dab_ref is not None:
                dab_ref[c, r] = jnp.transpose(ds).astype(dab_ref.dtype)

        sweep.run(tile, j * block_kv, q_start)

        @pl.when(i == n_q - 1)
        def _():
            dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

        if dq_ref is not None:

            @pl.when((j == n_kv - 1) & (i == n_q - 1))
            def _():
                dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)

    q_spec = pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, j, i: (b, h, q_block(j, i), 0))
    kv_spec = pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, j, i: (b, h, j, 0))
    row_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, j, i: (b, h, 0, q_block(j, i)))
    if with_dq:
        first_spec = pl.BlockSpec(
            (None, None, block_q, head_dim), lambda b, h, j, i: (b, h, first_pass_block(j, i), 0)
        )
        in_specs = [first_spec, kv_spec, kv_spec, q_spec, row_spec, first_spec]
    else:
        in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [q, k, v, d_out, lse, di]
    if ab is not None:
        in_specs.append(
            pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, j, i: (b, h, q_block(j, i), j))
        )
        args.append(ab)
    if segment_ids is not None:
        in_specs.append(pl.BlockSpec((None, block_kv, NUM_LANES), lambda b, h, j, i: (b, j, 0)))
        in_specs.append(pl.BlockSpec((None, 1, block_q), lambda b, h, j, i: (b, 0, q_block(j, i))))
        args += [row_ids, col_ids]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [kv_spec, kv_spec]
    scratch = [pltpu.VMEM((block_kv, head_dim), F32), pltpu.VMEM((block_kv, head_dim), F32)]
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    if with_dq:
        out_shape.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
        out_specs.append(pl.BlockSpec((None, None, q_len, head_dim), lambda b, h, j, i: (b, h, 0, 0)))
        if with_dab:
            out_shape.append(jax.ShapeDtypeStruct(ab.shape, ab.dtype))
            out_specs.append(pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, j, i: (b, h, i, j)))
        scratch += [
            pltpu.VMEM((q_len, head_dim), F32),  # dq accumulator
            pltpu.VMEM((q_len, head_dim), q.dtype),  # the queries, read once
            pltpu.VMEM((1, q_len), F32),  # di
        ]
        semantics = ("parallel", "parallel", "arbitrary", "arbitrary")  # dq sums over the key blocks
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(batch, heads, n_kv, n_q),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=grid_params(semantics),
        cost_estimate=cost_estimate(5 if with_dq else 4, q, k, causal, args, out_shape),
        debug=debug,
        name="flash_attention_bwd" if with_dq else "flash_attention_dkv",
    )(*args)
    return tuple(outs) + ((None,) if with_dq and not with_dab else ())
