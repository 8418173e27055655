"""Pieces the forward and backward kernels share: lane layouts, masks, and the sweep of a grid step's tiles (``Sweep``)."""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops._attention_common import as_column as as_column
from pallas_tpu.ops._attention_common import as_row as as_row
from pallas_tpu.ops._attention_common import lane_replicated as lane_replicated

from ._blocks import (
    DEFAULT_MASK_VALUE,
    DIAGONAL_TILE,
    F32,
    NUM_LANES,
    NUM_SUBLANES,
    SEES_NOTHING,
    TRANS_B_DIM_NUMBERS,
    max_unrolled_scores,
)


def diagonal_keep(shape, rows_are_queries: bool, shift=0):
    """The visible part of a tile crossing the causal diagonal, key <= query: a square tile
    centred on it (``shift`` 0), or any tile whose first column is ``shift`` positions past its
    first row (global column minus global row; static or traced)."""
    offset = lax.broadcasted_iota(jnp.int32, shape, 1) - lax.broadcasted_iota(jnp.int32, shape, 0)
    if not (isinstance(shift, int) and shift == 0):
        offset = offset + shift
    return offset <= 0 if rows_are_queries else offset >= 0


def masked_scores(s, rid_ref, cid_ref, r, c, diagonal, *, rows_are_queries: bool):
    """The tile of scores ``s`` with what its rows may not see set to ``DEFAULT_MASK_VALUE``:
    the entries whose segment ids differ (``rid_ref[r, :]`` lane-replicated against
    ``cid_ref[:, c]``; no refs, no segments) and, on a ``diagonal`` tile, those past the
    causal diagonal."""
    rows, cols = s.shape
    keep = None
    if rid_ref is not None:
        keep = lane_replicated(rid_ref[r, :], cols) == cid_ref[:, c]
    if diagonal is not False:  # True: centred on the diagonal; else the tile's (traced) shift
        shift = 0 if diagonal is True else diagonal
        on = diagonal_keep((rows, cols), rows_are_queries=rows_are_queries, shift=shift)
        keep = on if keep is None else keep & on
    if keep is not None:
        s = jnp.where(keep, s, DEFAULT_MASK_VALUE)
    return s


def causal_kv_block(causal: bool, block_q: int, block_kv: int):
    """The key block a query-major step ``(i, j)`` names: causal, the steps past the query
    block's last row re-name the last block needed (no copy)."""

    def kv_block(i, j):
        return jnp.minimum(j, (i * block_q + block_q - 1) // block_kv) if causal else j

    return kv_block


def query_major(q, k, ab, segment_ids, causal: bool, block_q: int, block_kv: int, tile_kv: int):
    """What the query-major kernels (forward, ``dq``) share: their ``grid``, ``n_kv``, ``sweep``,
    the ``q_spec`` and ``kv_spec`` of their blocks, and their optional inputs (``extra_specs``,
    ``extra_args``): the bias block of the step, then the segment ids of its queries and keys."""
    batch, heads, q_len, head_dim = q.shape
    n_q, n_kv = q_len // block_q, k.shape[2] // block_kv
    sweep = Sweep(block_q, block_kv, block_q, tile_kv, causal, True, square_tile(block_q, block_kv))
    row_ids, col_ids = segment_id_operands(segment_ids, kv_major=False)
    kv_block = causal_kv_block(causal, block_q, block_kv)
    extra_specs, extra_args = [], []
    if ab is not None:
        extra_specs.append(
            pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, i, j: (b, h, i, kv_block(i, j)))
        )
        extra_args.append(ab)
    if row_ids is not None:
        extra_specs.append(pl.BlockSpec((None, block_q, NUM_LANES), lambda b, h, i, j: (b, i, 0)))
        extra_specs.append(pl.BlockSpec((None, 1, block_kv), lambda b, h, i, j: (b, 0, kv_block(i, j))))
        extra_args += [row_ids, col_ids]
    return types.SimpleNamespace(
        grid=(batch, heads, n_q, n_kv),
        n_kv=n_kv,
        sweep=sweep,
        q_spec=pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0)),
        kv_spec=pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, i, j: (b, h, kv_block(i, j), 0)),
        extra_specs=extra_specs,
        extra_args=extra_args,
    )


def segment_id_operands(segment_ids, kv_major: bool):
    """The segment ids as the kernels read them: the tile rows' ids lane-replicated
    ``[batch, rows, 128]``, the tile columns' ids as a lane-dense ``[batch, 1, cols]`` row."""
    if segment_ids is None:
        return None, None
    rows, cols = (segment_ids.kv, segment_ids.q) if kv_major else (segment_ids.q, segment_ids.kv)
    dtype = segment_id_dtype(segment_ids)
    batch, n = rows.shape
    row_ids = lax.broadcast_in_dim(rows.astype(dtype), (batch, n, NUM_LANES), (0, 1))
    col_ids = cols.astype(dtype)[:, None, :]
    return row_ids, col_ids


def segment_id_dtype(segment_ids):
    """The dtype the kernels compare segment ids in: int32 for integer (and bool) ids, float32
    when either side is floating (compared as given, never truncated)."""
    floating = any(jnp.issubdtype(x.dtype, jnp.floating) for x in segment_ids)
    return jnp.float32 if floating else jnp.int32


def _loop(lo, hi, body):
    """``body(i)`` for ``lo <= i < hi``; traced bounds make an ``scf.for``. (Not unrolled: on jax
    0.10.2's libtpu, Mosaic aborts the process on an unrolled ``fori_loop`` here.)"""
    if isinstance(lo, int) and isinstance(hi, int) and hi - lo <= 1:
        if hi - lo == 1:
            body(lo)
        return

    def step(i, carry):
        body(i)
        return carry

    lax.fori_loop(lo, hi, step, 0)


def tile_scores(x, rows, cols, r, c, diagonal, scale2, *, rows_are_queries: bool):
    """A tile's base-2 logits ``rows @ cols.T`` (queries against keys, or keys against queries
    when not ``rows_are_queries``), with the bias ``x.ab`` (rows ``r``, columns ``c`` of the
    tile's block) and the segment and causal masks (``masked_scores``)."""
    s = lax.dot_general(rows, cols, TRANS_B_DIM_NUMBERS, preferred_element_type=F32)
    if x.ab is None:
        ab = None
    elif rows_are_queries:
        ab = x.ab[r, c]
    else:
        ab = jnp.transpose(x.ab[c, r].astype(F32))
    s = base2_logits(s, ab, scale2)
    return masked_scores(s, x.rid, x.cid, r, c, diagonal, rows_are_queries=rows_are_queries)


def flash_call(
    kernel, in_specs, out_specs, scratch, out_shape, args, *, grid, semantics, matmuls, causal, debug, name
):
    """The outputs of ``kernel`` over ``grid``: ``args`` in ``in_specs``, ``out_shape`` in
    ``out_specs``, ``scratch`` in VMEM; its cost, ``matmuls`` products of ``q``'s (``args[0]``)
    shape against ``k``'s (``args[1]``), halved when ``causal``."""
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch
        ),
        out_shape=out_shape,
        compiler_params=grid_params(semantics),
        cost_estimate=cost_estimate(matmuls, args[0], args[1], causal, args, out_shape),
        debug=debug,
        name=name,
    )(*args)


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


def grid_params(semantics):
    return pltpu.CompilerParams(
        dimension_semantics=semantics, vmem_limit_bytes=_policy.vmem_budget("attention")
    )


@dataclasses.dataclass(frozen=True)
class Sweep:
    """How a grid step's ``rows x cols`` block of scores is cut into tiles.

    Rows are the axis the kernel owns (queries for the forward pass and ``dq``, keys for
    ``dk``/``dv``), columns the axis it sweeps. ``run`` calls ``tile(r, nr, c, nc, diagonal)``
    for each tile: local offsets ``r``, ``c`` (ints or traced), static sizes, and whether the tile
    sits centred on the causal diagonal (and needs its triangle masked).
    """

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int
    causal: bool
    rows_are_queries: bool
    square: int  # edge of the tiles along the causal diagonal
    # A step of at most this many scores is unrolled into straight-line tiles (the scheduler then
    # overlaps one tile's matmuls with the next one's softmax); a larger one loops. None:
    # ``max_unrolled_scores()``.
    max_unrolled: int | None = None

    def run(self, tile, row0, col0):
        """The tiles of the step whose block starts at global row ``row0`` and column ``col0``."""
        if not self.causal:
            self._all(tile)
            return
        if self.rows_are_queries:  # visible: key (column) <= query (row)
            all_visible = col0 + self.cols - 1 <= row0
            any_visible = col0 <= row0 + self.rows - 1
        else:
            all_visible = row0 + self.rows - 1 <= col0
            any_visible = row0 <= col0 + self.cols - 1
        pl.when(all_visible)(lambda: self._all(tile))
        if self.cols % self.rows == 0 and self.cols // self.rows <= 4 and self._unrolled():
            # The diagonal square starts at one of cols // rows places in a step that holds it:
            # a straight-line body for each.
            for at in range(self.cols // self.rows):
                pl.when(col0 + at * self.rows == row0)(
                    functools.partial(self._diagonal, tile, at * self.rows)
                )
        else:
            partial = jnp.logical_and(any_visible, jnp.logical_not(all_visible))
            pl.when(partial)(lambda: self._straddling(tile, row0, col0))

    def _all(self, tile):
        """Every tile, none masked."""
        n_cols = self.cols // self.tile_cols
        for a in range(self.rows // self.tile_rows):
            r = a * self.tile_rows
            if self._unrolled():
                for b in range(n_cols):
                    tile(r, self.tile_rows, b * self.tile_cols, self.tile_cols, False)
            else:
                col = functools.partial(self._col, self.tile_cols)
                _loop(0, n_cols, lambda t, r=r: tile(r, self.tile_rows, col(t), self.tile_cols, False))

    def _diagonal(self, tile, at):
        """A step holding the diagonal square at local column ``at``: the columns wholly visible
        beside it in ordinary tiles; the square in bands of ``square`` rows, each band's tile on
        the diagonal masked and the visible columns beside it in one unmasked tile."""
        sq, n = self.square, self.rows // self.square
        if self.rows_are_queries:
            self._tiles(tile, 0, at)  # keys before the square
        for a in range(n):
            r = a * sq
            if self.rows_are_queries:
                if a:
                    tile(r, sq, at, r, False)  # keys before the band's first query
                tile(r, sq, at + r, sq, True)
            else:
                tile(r, sq, at + r, sq, True)
                if a < n - 1:
                    tile(r, sq, at + r + sq, self.rows - r - sq, False)  # queries after the band's last key
        if not self.rows_are_queries:
            self._tiles(tile, at + self.rows, self.cols)  # queries after the square

    def _tiles(self, tile, lo, hi):
        """Unmasked tiles over local columns ``[lo, hi)`` (static), all rows."""
        for a in range(self.rows // self.tile_rows):
            for c in range(lo, hi, self.tile_cols):
                tile(a * self.tile_rows, self.tile_rows, c, min(self.tile_cols, hi - c), False)

    def _straddling(self, tile, row0, col0):
        """A step crossing the diagonal with unequal blocks: the columns wholly visible in a loop,
        then the ``rows x rows`` square on the diagonal in static tiles, each only where it falls
        in this step (its column range is known once ``row0`` and ``col0`` are)."""
        sq, n_sq = self.square, self.rows // self.square
        if n_sq * (n_sq + 1) // 2 > 16 and self._unrolled():
            # Diagonal squares too small to tile the block (lengths with no common factor, one
            # query a block): one tile of the whole block, masked from its global position.
            tile(0, self.rows, 0, self.cols, col0 - row0)
            return
        width = math.gcd(self.tile_cols, self.rows)
        n = self.cols // width
        if self.rows_are_queries:  # keys before the first query
            lo, hi = 0, jnp.clip((row0 - col0) // width, 0, n)
        else:  # queries after the last key
            lo, hi = jnp.clip((row0 + self.rows - col0) // width, 0, n), n
        for a in range(self.rows // self.tile_rows):
            r = a * self.tile_rows
            _loop(lo, hi, lambda t, r=r: tile(r, self.tile_rows, self._col(width, t), width, False))
        for a in range(n_sq):
            for b in range(a + 1) if self.rows_are_queries else range(a, n_sq):
                c = row0 + b * sq - col0

                @pl.when((c >= 0) & (c < self.cols))
                def _(a=a, b=b, c=c):
                    tile(a * sq, sq, pl.multiple_of(c, sq), sq, a == b)

    def _unrolled(self) -> bool:
        """Whether the step's tiles run as straight-line code (else: loops, and one body for the
        causal diagonal wherever it falls in the step)."""
        return self.rows * self.cols <= (self.max_unrolled or max_unrolled_scores())

    @staticmethod
    def _col(width, t):
        return pl.multiple_of(t * width, width)


def square_tile(*sizes: int) -> int:
    """The edge of the tiles along the causal diagonal: at most ``DIAGONAL_TILE``, dividing every size."""
    tile = functools.reduce(math.gcd, sizes)
    while tile > DIAGONAL_TILE and tile % 2 == 0 and (tile // 2) % NUM_SUBLANES == 0:
        tile //= 2
    return tile


def base2_logits(s, ab, scale2):
    """The float32 scores ``s = q @ k.T`` as base-2 logits ``(s + ab) * sm_scale * log2(e)``
    (``scale2`` is the product): the scale is applied here, to the float32 scores, never to
    the queries (a query rescaled in its own dtype would be rounded twice).

    With a bias, the logits are clamped at ``DEFAULT_MASK_VALUE`` (a ``-inf`` bias then counts
    as masked, not NaN). The clamp also keeps every use of a logit the same rounded value: where
    the product may be fused into the next subtraction (an FMA, as XLA does on the CPU in
    interpret mode), ``(s + ab) * scale2 - m`` of a -1e30 bias is the product's rounding error,
    ~1e23, and ``exp2`` of it is inf."""
    if ab is None:
        return s * scale2
    return jnp.maximum((s + ab.astype(F32)) * scale2, DEFAULT_MASK_VALUE)


def row_logsumexp(m, l):
    """The base-2 logsumexp ``m + log2(l)`` of rows with max ``m`` and sum ``l``; ``+inf`` for a
    row that sees no key (its max below ``SEES_NOTHING``: every key masked, or a bias of about
    -1e30), so that the backward pass's ``exp2(logit - lse)`` is 0 and the row contributes no
    gradient (at such magnitudes ``m + log2(l)`` rounds to ``m`` and would give ``p = 1``)."""
    return jnp.where(m < SEES_NOTHING, jnp.inf, m + jnp.log2(l))
