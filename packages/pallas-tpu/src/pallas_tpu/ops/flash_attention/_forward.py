"""The forward kernel (online softmax over a grid step's key tiles)."""

from __future__ import annotations

import functools

import jax
from jax import lax

import pallas as pl
from pallas_tpu.ops._attention_common import softmax_init, softmax_scratch, softmax_update, take_refs

from ._blocks import F32, LOG2E
from ._tiles import (
    as_row,
    flash_call,
    lane_replicated,
    query_major,
    row_logsumexp,
    tile_scores,
)


def attention_forward(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug, *, keep_lse):
    """``(out, lse)``: the attention and (``keep_lse``) its base-2 logsumexp ``[b, h, 1, q_len]``."""
    return _forward_call(
        q, k, v, ab, segment_ids, causal=causal, sm_scale=sm_scale, block_q=blocks.block_q,
        block_kv=blocks.block_k_major, tile_kv=blocks.block_k, keep_lse=keep_lse, debug=debug,
    )  # fmt: skip


def _forward_call(q, k, v, ab, segment_ids, *, causal, sm_scale, block_q, block_kv, tile_kv, keep_lse, debug):
    batch, heads, q_len, head_dim = q.shape
    qm = query_major(q, k, ab, segment_ids, causal, block_q, block_kv, tile_kv)
    kernel = functools.partial(
        _forward_kernel, ab=ab is not None, segments=segment_ids is not None, keep_lse=keep_lse,
        sweep=qm.sweep, scale2=sm_scale * LOG2E, block_q=block_q, block_kv=block_kv, n_kv=qm.n_kv,
    )  # fmt: skip
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [qm.q_spec]
    if keep_lse:
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, 1, q_len), F32))
        out_specs.append(pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j: (b, h, 0, i)))
    outs = flash_call(
        kernel, [qm.q_spec, qm.kv_spec, qm.kv_spec, *qm.extra_specs], out_specs, softmax_scratch(block_q, head_dim),
        out_shape, [q, k, v, *qm.extra_args], grid=qm.grid,
        semantics=("parallel", "parallel", "parallel", "arbitrary"), matmuls=2, causal=causal, debug=debug,
        name="flash_attention_fwd",
    )  # fmt: skip
    return outs[0], (outs[1] if keep_lse else None)


def _forward_kernel(*refs, ab, segments, keep_lse, sweep, scale2, block_q, block_kv, n_kv):
    x = take_refs(
        refs, "q", "k", "v", ("ab", ab), ("rid", segments), ("cid", segments), "o", ("lse", keep_lse),
        "m", "l", "acc",
    )  # fmt: skip
    i, j = pl.program_id(2), pl.program_id(3)
    pl.when(j == 0)(lambda: softmax_init(x.m, x.l, x.acc))

    def tile(r0, rows, c0, cols, diagonal):
        """Rows ``[r0, r0+rows)`` of the query block against keys ``[c0, c0+cols)`` of the key block."""
        r, c = pl.ds(r0, rows), pl.ds(c0, cols)
        s = tile_scores(x, x.q[r, :], x.k[c, :], r, c, diagonal, scale2, rows_are_queries=True)
        softmax_update(
            s,
            x.m,
            x.l,
            x.acc,
            r,
            lambda p: lax.dot(p.astype(x.v.dtype), x.v[c, :], preferred_element_type=F32),
        )

    sweep.run(tile, i * block_q, j * block_kv)

    @pl.when(j == n_kv - 1)
    def _():
        l = x.l[...]
        x.o[...] = (x.acc[...] * lane_replicated(1.0 / l, x.acc.shape[1])).astype(x.o.dtype)
        if x.lse is not None:
            x.lse[...] = as_row(row_logsumexp(x.m[...], l))
