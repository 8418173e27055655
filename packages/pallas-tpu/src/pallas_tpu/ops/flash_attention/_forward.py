"""The forward kernel (online softmax over a grid step's key tiles)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu

from ._blocks import F32, LOG2E, NUM_LANES, TRANS_B_DIM_NUMBERS
from ._tiles import (
    Sweep,
    as_row,
    base2_logits,
    causal_kv_block,
    grid_params,
    lane_replicated,
    masked_scores,
    query_major_inputs,
    row_logsumexp,
    segment_id_operands,
    square_tile,
)


def attention_forward(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug, *, keep_lse):
    """``(out, lse)``: the attention and (``keep_lse``) its base-2 logsumexp ``[b, h, 1, q_len]``."""
    return _forward_call(
        q, k, v, ab, segment_ids, causal=causal, sm_scale=sm_scale, block_q=blocks.block_q,
        block_kv=blocks.block_k_major, tile_kv=blocks.block_k, keep_lse=keep_lse, debug=debug,
    )  # fmt: skip


def _forward_call(q, k, v, ab, segment_ids, *, causal, sm_scale, block_q, block_kv, tile_kv, keep_lse, debug):
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    n_q, n_kv = q_len // block_q, kv_len // block_kv
    sweep = Sweep(block_q, block_kv, block_q, tile_kv, causal, True, square_tile(block_q, block_kv))
    row_ids, col_ids = segment_id_operands(segment_ids, kv_major=False)
    scale2 = sm_scale * LOG2E  # logits in base 2: the softmax's exponentials are exp2

    kv_block = causal_kv_block(causal, block_q, block_kv)

    def kernel(*refs):
        refs = list(refs)
        q_ref, k_ref, v_ref = refs[:3]
        del refs[:3]
        ab_ref = refs.pop(0) if ab is not None else None
        rid_ref, cid_ref = (refs.pop(0), refs.pop(0)) if segment_ids is not None else (None, None)
        o_ref = refs.pop(0)
        lse_ref = refs.pop(0) if keep_lse else None
        m_ref, l_ref, acc_ref = refs
        i, j = pl.program_id(2), pl.program_id(3)

        @pl.when(j == 0)
        def _():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, F32)
            l_ref[...] = jnp.zeros(l_ref.shape, F32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

        def tile(r0, rows, c0, cols, diagonal):
            """Rows ``[r0, r0+rows)`` of the query block against keys ``[c0, c0+cols)`` of the key block."""
            r, c = pl.ds(r0, rows), pl.ds(c0, cols)
            s = lax.dot_general(q_ref[r, :], k_ref[c, :], TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
            s = base2_logits(s, None if ab_ref is None else ab_ref[r, c], scale2)
            s = masked_scores(s, rid_ref, cid_ref, r, c, diagonal, rows_are_queries=True)
            m_prev = m_ref[r, :]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp2(s - lane_replicated(m_next, cols))
            rescale = jnp.exp2(m_prev - m_next)
            m_ref[r, :] = m_next
            l_ref[r, :] = rescale * l_ref[r, :] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot(p.astype(v_ref.dtype), v_ref[c, :], preferred_element_type=F32)
            acc_ref[r, :] = acc_ref[r, :] * lane_replicated(rescale, head_dim) + pv

        sweep.run(tile, i * block_q, j * block_kv)

        @pl.when(j == n_kv - 1)
        def _():
            l = l_ref[...]
            o_ref[...] = (acc_ref[...] * lane_replicated(1.0 / l, head_dim)).astype(o_ref.dtype)
            if lse_ref is not None:
                lse_ref[...] = as_row(row_logsumexp(m_ref[...], l))

    in_specs = [
        pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0)),
        pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, i, j: (b, h, kv_block(i, j), 0)),
        pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, i, j: (b, h, kv_block(i, j), 0)),
    ]
    extra_specs, extra_args = query_major_inputs(ab, row_ids, col_ids, block_q, block_kv, kv_block)
    in_specs += extra_specs
    args = [q, k, v, *extra_args]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0))]
    if keep_lse:
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, 1, q_len), F32))
        out_specs.append(pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j: (b, h, 0, i)))
    scratch = [
        pltpu.VMEM((block_q, NUM_LANES), F32),  # running max
        pltpu.VMEM((block_q, NUM_LANES), F32),  # running sum
        pltpu.VMEM((block_q, head_dim), F32),  # unnormalized output
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
        cost_estimate=cost_estimate(2, q, k, causal, args, out_shape),
        debug=debug,
        name="flash_attention_fwd",
    )(*args)
    return outs[0], (outs[1] if keep_lse else None)


def cost_estimate(matmuls, q, k, causal, args, out_shape):
    batch, heads, q_len, head_dim = q.shape
    pairs = batch * heads * q_len * k.shape[2] // (2 if causal else 1)
    return pl.CostEstimate(
        flops=2 * matmuls * pairs * head_dim,
        transcendentals=pairs,
        bytes_accessed=sum(_nbytes(x) for x in args) + sum(_nbytes(x) for x in out_shape),
    )


def _nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize
