"""The backward kernels: ``dk``/``dv`` key-major with ``dq`` fused, and the separate query-major ``dq``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops._attention_common import take_refs

from ._blocks import F32, LOG2E, NUM_LANES, TRANS_B_DIM_NUMBERS
from ._tiles import (
    Sweep,
    as_column,
    as_row,
    flash_call,
    lane_replicated,
    query_major,
    segment_id_operands,
    square_tile,
    tile_scores,
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
    head_dim = q.shape[3]
    qm = query_major(q, k, ab, segment_ids, causal, block_q, block_kv, tile_kv)
    kernel = functools.partial(
        _dq_kernel, ab=ab is not None, segments=segment_ids is not None, causal=causal, sweep=qm.sweep,
        sm_scale=sm_scale, block_q=block_q, block_kv=block_kv, n_kv=qm.n_kv,
    )  # fmt: skip
    row_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j: (b, h, 0, i))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [qm.q_spec]
    if ab is not None:
        out_shape.append(jax.ShapeDtypeStruct(ab.shape, ab.dtype))
        out_specs.append(pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, i, j: (b, h, i, j)))
    scratch = [
        pltpu.VMEM((block_q, head_dim), F32),  # dq accumulator
        pltpu.VMEM((block_q, NUM_LANES), F32),  # logsumexp, lane-replicated
        pltpu.VMEM((block_q, NUM_LANES), F32),  # di, lane-replicated
    ]
    outs = flash_call(
        kernel, [qm.q_spec, qm.kv_spec, qm.kv_spec, qm.q_spec, row_spec, row_spec, *qm.extra_specs], out_specs,
        scratch, out_shape, [q, k, v, d_out, lse, di, *qm.extra_args], grid=qm.grid,
        semantics=("parallel", "parallel", "parallel", "arbitrary"), matmuls=3, causal=causal, debug=debug,
        name="flash_attention_dq",
    )  # fmt: skip
    return outs[0], (outs[1] if ab is not None else None)


def _dq_kernel(*refs, ab, segments, causal, sweep, sm_scale, block_q, block_kv, n_kv):
    x = take_refs(
        refs, "q", "k", "v", "do", "lse", "di", ("ab", ab), ("rid", segments), ("cid", segments), "dq",
        ("dab", ab), "acc", "lse_col", "di_col",
    )  # fmt: skip
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        x.acc[...] = jnp.zeros(x.acc.shape, F32)
        x.lse_col[...] = as_column(x.lse[...])
        x.di_col[...] = as_column(x.di[...])

    if x.dab is not None and causal:
        x.dab[...] = jnp.zeros(x.dab.shape, x.dab.dtype)  # what no tile writes is masked

    def tile(r0, rows, c0, cols, diagonal):
        r, c = pl.ds(r0, rows), pl.ds(c0, cols)
        k_tile = x.k[c, :]
        s = tile_scores(x, x.q[r, :], k_tile, r, c, diagonal, sm_scale * LOG2E, rows_are_queries=True)
        p = jnp.exp2(s - lane_replicated(x.lse_col[r, :], cols))
        dp = lax.dot_general(x.do[r, :], x.v[c, :], TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
        ds = logit_grads(p, dp - lane_replicated(x.di_col[r, :], cols), sm_scale)
        x.acc[r, :] += lax.dot(ds.astype(k_tile.dtype), k_tile, preferred_element_type=F32)
        if x.dab is not None:
            x.dab[r, c] = ds.astype(x.dab.dtype)

    sweep.run(tile, i * block_q, j * block_kv)

    @pl.when(j == n_kv - 1)
    def _():
        x.dq[...] = x.acc[...].astype(x.dq.dtype)


def backward_dkv(q, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug, with_dq=False):
    return _dkv_call(
        q, k, v, ab, segment_ids, lse, d_out, di, causal=causal, sm_scale=sm_scale,
        block_kv=blocks.block_k_major_dkv, block_q=blocks.block_q_major_dkv, tile_kv=blocks.block_k_dkv,
        tile_q=blocks.block_q_dkv, debug=debug, with_dq=with_dq,
    )  # fmt: skip


def _dkv_call(
    q, k, v, ab, segment_ids, lse, d_out, di, *, causal, sm_scale, block_kv, block_q, tile_kv, tile_q, debug,
    with_dq=False,
):  # fmt: skip
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
    n_kv, n_q = k.shape[2] // block_kv, q_len // block_q
    sweep = Sweep(block_kv, block_q, tile_kv, tile_q, causal, False, square_tile(block_kv, block_q))
    with_dab = with_dq and ab is not None
    in_specs, args = _dkv_inputs(q, k, v, ab, segment_ids, lse, d_out, di, block_q, block_kv, causal, with_dq)
    out_specs, out_shape, scratch = _dkv_outputs(q, k, v, ab, block_q, block_kv, with_dq, with_dab)
    kernel = functools.partial(
        _dkv_kernel, ab=ab is not None, segments=segment_ids is not None, causal=causal, with_dq=with_dq,
        with_dab=with_dab, sweep=sweep, sm_scale=sm_scale, block_q=block_q, block_kv=block_kv, n_q=n_q, n_kv=n_kv,
    )  # fmt: skip
    # with dq: it sums over the key blocks
    semantics = ("parallel", "parallel", "arbitrary" if with_dq else "parallel", "arbitrary")
    outs = flash_call(
        kernel, in_specs, out_specs, scratch, out_shape, args, grid=(batch, heads, n_kv, n_q), semantics=semantics,
        matmuls=5 if with_dq else 4, causal=causal, debug=debug,
        name="flash_attention_bwd" if with_dq else "flash_attention_dkv",
    )  # fmt: skip
    return tuple(outs) + ((None,) if with_dq and not with_dab else ())


def _dkv_inputs(q, k, v, ab, segment_ids, lse, d_out, di, block_q, block_kv, causal, with_dq):
    """``(in_specs, args)`` of the ``dk``/``dv`` kernel (grid ``(b, h, key block j, query block i)``)."""
    head_dim, n_q = q.shape[3], q.shape[2] // block_q

    def q_block(j, i):
        # Causal: steps before the key block's first key re-name the first query block needed
        # (the last query block where the key block lies past every query: keys beyond the
        # queries, kv_len > q_len, are seen by none and their steps do nothing).
        return jnp.minimum(jnp.maximum(i, (j * block_kv) // block_q), n_q - 1) if causal else i

    def first_pass_block(j, i):
        # Read on the first key block's steps only (which visit every query block); after them
        # the last block stays named, so nothing more is copied.
        return jnp.where(j == 0, i, n_q - 1)

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
        row_ids, col_ids = segment_id_operands(segment_ids, kv_major=True)
        in_specs.append(pl.BlockSpec((None, block_kv, NUM_LANES), lambda b, h, j, i: (b, j, 0)))
        in_specs.append(pl.BlockSpec((None, 1, block_q), lambda b, h, j, i: (b, 0, q_block(j, i))))
        args += [row_ids, col_ids]
    return in_specs, args


def _dkv_outputs(q, k, v, ab, block_q, block_kv, with_dq, with_dab):
    """``(out_specs, out_shape, scratch)`` of the ``dk``/``dv`` kernel (with ``dq``, ``dab``)."""
    q_len, head_dim = q.shape[2:]
    kv_spec = pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, j, i: (b, h, j, 0))
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    out_specs = [kv_spec, kv_spec]
    scratch = [pltpu.VMEM((block_kv, head_dim), F32), pltpu.VMEM((block_kv, head_dim), F32)]
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
    return out_specs, out_shape, scratch


def _dkv_kernel(
    *refs, ab, segments, causal, with_dq, with_dab, sweep, sm_scale, block_q, block_kv, n_q, n_kv
):
    x = take_refs(
        refs, "q", "k", "v", "do", "lse", "di", ("ab", ab), ("rid", segments), ("cid", segments), "dk", "dv",
        ("dq", with_dq), ("dab", with_dab), "dk_acc", "dv_acc", ("dq_acc", with_dq), ("q_all", with_dq),
        ("di_all", with_dq),
    )  # fmt: skip
    j, i = pl.program_id(2), pl.program_id(3)
    q_start = i * block_q
    if with_dq:
        queries, corrections = _first_pass(x, i, j, q_start, block_q)
    else:
        queries, corrections = (lambda c: x.q[c, :]), (lambda c: x.di[:, c])

    @pl.when(i == 0)
    def _():
        x.dk_acc[...] = jnp.zeros(x.dk_acc.shape, F32)
        x.dv_acc[...] = jnp.zeros(x.dv_acc.shape, F32)

    if x.dab is not None and causal:
        x.dab[...] = jnp.zeros(x.dab.shape, x.dab.dtype)  # what no tile writes is masked

    def tile(r0, rows, c0, cols, diagonal):
        """Keys ``[r0, r0+rows)`` of the key block against queries ``[c0, c0+cols)`` of the query block."""
        r, c = pl.ds(r0, rows), pl.ds(c0, cols)
        q_tile, do_tile, k_tile = queries(c), x.do[c, :], x.k[r, :]
        s = tile_scores(x, k_tile, q_tile, r, c, diagonal, sm_scale * LOG2E, rows_are_queries=False)
        p = jnp.exp2(s - x.lse[:, c])
        x.dv_acc[r, :] += lax.dot(p.astype(do_tile.dtype), do_tile, preferred_element_type=F32)
        dp = lax.dot_general(x.v[r, :], do_tile, TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
        ds = logit_grads(p, dp - corrections(c), sm_scale)
        ds_low = ds.astype(q_tile.dtype)
        x.dk_acc[r, :] += lax.dot(ds_low, q_tile, preferred_element_type=F32)
        if with_dq:
            x.dq_acc[pl.ds(q_start + c0, cols), :] += lax.dot_general(
                ds_low, k_tile, (((0,), (0,)), ((), ())), preferred_element_type=F32
            )
        if x.dab is not None:
            x.dab[c, r] = jnp.transpose(ds).astype(x.dab.dtype)

    sweep.run(tile, j * block_kv, q_start)

    @pl.when(i == n_q - 1)
    def _():
        x.dk[...] = x.dk_acc[...].astype(x.dk.dtype)
        x.dv[...] = x.dv_acc[...].astype(x.dv.dtype)

    if x.dq is not None:

        @pl.when((j == n_kv - 1) & (i == n_q - 1))
        def _():
            x.dq[...] = x.dq_acc[...].astype(x.dq.dtype)


def _first_pass(x, i, j, q_start, block_q):
    """The fused kernel's ``(queries, corrections)`` of a tile's query columns ``c``: read from
    VMEM, where the first key block's steps copy each query block and its ``di`` (``x.di`` is
    then the forward's output ``O``)."""
    here = pl.ds(q_start, block_q)

    @pl.when(j == 0)
    def _():
        @pl.when(i == 0)
        def _():
            x.dq_acc[...] = jnp.zeros(x.dq_acc.shape, F32)

        x.q_all[here, :] = x.q[...]
        d = jnp.sum(x.di[...].astype(F32) * x.do[...].astype(F32), axis=1, keepdims=True)
        x.di_all[:, here] = as_row(jnp.broadcast_to(d, (block_q, NUM_LANES)))

    def queries(c):
        return x.q_all[pl.ds(q_start + c.start, c.size), :]

    def corrections(c):
        return x.di_all[:, pl.ds(q_start + c.start, c.size)]

    return queries, corrections
