"""Flash attention for TPUs, forward and backward (FlashAttention-2), written with pallas-tpu.

The names and call signatures are those of JAX's ``ops.tpu.flash_attention``:
``flash_attention(q, k, v, ab=None, segment_ids=None, *, causal, sm_scale, block_sizes, debug)``
on ``[batch, heads, seq, head_dim]`` arrays, ``BlockSizes``, ``SegmentIds``, the constants and
the ``mha_reference`` family. The logits are ``(q @ k.T + ab) * sm_scale``, masked where the
segment ids differ and (``causal``) where the key comes after the query (top-left aligned).

How the kernels work (the choices made for the TPU v5e; static bundle counts from libtpu's
scheduler, ``--xla_jf_dump_to``, guided them):

* Forward: a grid step holds ``block_q`` query rows and ``block_k_major`` key rows and sweeps
  them in tiles of ``block_k`` keys with the online softmax: a running row max ``m`` and row
  sum ``l`` kept lane-replicated (``(block_q, 128)`` float32: they meet the score tiles without
  relayouts), the output accumulated unnormalized in float32 and divided by ``l`` once. The
  softmax runs in base 2 with ``sm_scale * log2(e)`` folded into the query block once, so a
  score costs one ``exp2`` and no multiply. A step's tiles are straight-line code (no loop), so
  the scheduler overlaps one tile's matmuls with the next one's softmax; by default a step is a
  head's whole key sequence (L <= 4096), copied to VMEM once per head. The residual for the
  backward pass is one lane-dense logsumexp row (not ``m`` and ``l`` lane-replicated).
* Causal: steps wholly below the diagonal run the unmasked tiles; steps above it do nothing and,
  their block indices clamped to the last block needed, copy nothing; a step holding the
  diagonal runs, for the position the diagonal has in it, the unmasked tiles beside it and the
  diagonal square in bands of ``_DIAGONAL_TILE`` rows, only the tile on the diagonal masked
  (one iota difference against a constant). Only when the query block is longer than the key
  block does the diagonal cross steps (``_Sweep._straddling``: a loop and membership tests).
* Backward: one kernel, key-major: per key block it sweeps the queries in tiles of the
  transposed scores ``k @ q.T`` (so ``p.T @ do``, ``ds.T @ q`` are plain matmuls), recomputing
  the probabilities from the logsumexp, and accumulates ``dq`` for the whole sequence in VMEM
  across the key blocks: five matmuls a tile where separate ``dq`` and ``dk``/``dv`` kernels take
  seven. It also scales the queries and computes ``di = rowsum(dO * O)`` itself, on its first
  key block. Where a head's ``dq`` does not fit VMEM, ``dq`` is a separate query-major kernel.
* Blocks: ``BlockSizes.get_default`` picks them from the shapes and the chip's VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
NUM_LANES = 128
NUM_SUBLANES = 8
MIN_BLOCK_SIZE = 128
TRANS_B_DIM_NUMBERS = (((1,), (1,)), ((), ()))  # a @ b.T

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_F32 = jnp.float32
# The tile edge of the causal diagonal square: smaller tiles skip more of the masked half,
# larger ones feed the MXU longer runs.
_DIAGONAL_TILE = 256


_BACKWARD_BLOCKS = (
    "block_q_dq",
    "block_k_dq",
    "block_k_major_dq",
    "block_q_dkv",
    "block_k_dkv",
    "block_q_major_dkv",
    "block_k_major_dkv",
)


class SegmentIds(NamedTuple):
    """Segment ids of the query and key sequences: a query attends to the keys of its own segment.

    Attributes:
      q: ``[batch, q_seq_len]`` integer ids of the queries.
      kv: ``[batch, kv_seq_len]`` integer ids of the keys and values.
    """

    q: jax.Array
    kv: jax.Array


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the flash attention kernels (speed only; the results do not depend on them).

    Forward: ``block_q`` query rows and ``block_k_major`` key rows per grid step, the keys
    taken ``block_k`` at a time inside it. ``block_b`` is accepted for JAX's signature; the
    kernels take one batch row per grid step whatever it says. Backward: ``block_k_major_dkv``
    key rows and ``block_q_major_dkv`` query rows per grid step, in tiles of ``block_k_dkv``
    keys by ``block_q_dkv`` queries; the ``_dq`` blocks (``block_q_dq`` query rows and
    ``block_k_major_dq`` key rows per step, keys ``block_k_dq`` at a time) serve the separate
    ``dq`` kernel, used only where a head's ``dq`` does not fit VMEM beside the fused backward
    kernel. Backward blocks left as None are chosen by ``get_default``'s rule (JAX raises instead).
    """

    block_q: int
    block_k_major: int
    block_k: int
    block_b: int

    block_q_major_dkv: int | None = None
    block_k_major_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dkv: int | None = None

    block_k_major_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dq: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            size = getattr(self, f.name)
            if size is not None and (not isinstance(size, (int, np.integer)) or size < 1):
                raise ValueError(f"BlockSizes.{f.name} must be a positive int, got {size!r}")
        pairs = (
            ("block_k", "block_k_major"),
            ("block_k_dkv", "block_k_major_dkv"),
            ("block_q_dkv", "block_q_major_dkv"),
            ("block_k_dq", "block_k_major_dq"),
        )
        for minor, major in pairs:
            lo, hi = getattr(self, minor), getattr(self, major)
            if lo is not None and hi is not None and hi % lo:
                raise ValueError(
                    f"BlockSizes.{minor}={lo} must divide BlockSizes.{major}={hi} "
                    f"(the {minor} tiles are taken from inside one {major} block)"
                )

    @property
    def has_backward_blocks(self) -> bool:
        """Whether every backward block is given."""
        return all(getattr(self, name) is not None for name in _BACKWARD_BLOCKS)

    @classmethod
    def get_default(cls, batch_size, num_heads, q_seq_len, kv_len, d_model, *, causal=False) -> BlockSizes:
        """The blocks ``flash_attention`` uses when none are given, from the shapes and the chip.

        Tiles of 1024 x 1024 scores (512 x 512 on chips with less than 64 MiB of VMEM). Without
        ``causal`` a grid step sweeps up to four tiles' worth of keys (``dk``/``dv``: queries),
        so at L <= 4096 a head's keys are copied to VMEM once and its tiles run as straight-line
        code; with ``causal`` a step takes two tiles' worth, so the steps that cross the diagonal
        stay few and small. A step's unrolled tiles spill their scores to VMEM, so its size is
        bounded by the VMEM too. (``causal`` is this module's addition to JAX's signature; JAX's
        defaults are blocks of 128 whatever the shapes.)
        """
        del batch_size, num_heads, d_model
        budget = _vmem_budget()
        tile = 1024 if budget >= 48 * 2**20 else 512
        widest = max(tile, min(4 * tile, _max_unrolled() // tile))
        block_q = _fit(q_seq_len, tile)
        block_kv = _fit(kv_len, tile)
        sweep_kv = _fit(kv_len, 2 * block_q if causal else widest)
        sweep_q = _fit(q_seq_len, 2 * block_kv if causal else widest)
        return cls(
            block_q=block_q,
            block_k_major=sweep_kv,
            block_k=_fit(sweep_kv, tile),
            block_b=1,
            block_q_major_dkv=sweep_q,
            block_k_major_dkv=block_kv,
            block_k_dkv=block_kv,
            block_q_dkv=_fit(sweep_q, tile),
            block_k_major_dq=sweep_kv,
            block_k_dq=_fit(sweep_kv, tile),
            block_q_dq=block_q,
        )


def _fit(n: int, target: int) -> int:
    """The largest multiple of 128 at most ``target`` that divides ``n``; ``n`` itself when
    ``n <= target`` or none does (a block as long as its axis is always a legal TPU block)."""
    if n <= target:
        return n
    for size in range(target - target % 128, 127, -128):
        if n % size == 0:
            return size
    return n


def _vmem_budget() -> int:
    """The VMEM the kernels may ask for: three quarters of the chip's (16 MiB when unknown)."""
    try:
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    except Exception:  # no TPU facts for this device: the smallest scoped default
        capacity = 16 * 2**20 * 4 // 3
    return int(min(capacity * 3 // 4, 100 * 2**20))


def _max_unrolled() -> int:
    """The most scores a grid step may hold as straight-line tiles: their float32 spills take
    up to 4 bytes each, kept to a quarter of the VMEM budget."""
    return _vmem_budget() // 16


def below_or_on_diag(r, r_blk_size, c, c_blk_size):
    """Whether block ``(r, c)`` of a causal mask (row blocks of ``r_blk_size``, column blocks of
    ``c_blk_size``) holds any visible entry: its last row is at or past its first column."""
    last_row = r * r_blk_size + (r_blk_size - 1)
    return last_row >= c * c_blk_size


# ---------------------------------------------------------------------------------------------
# The public entry point and its VJP.


@functools.partial(jax.jit, static_argnames=["causal", "sm_scale", "block_sizes", "debug"])
def flash_attention(
    q,
    k,
    v,
    ab=None,
    segment_ids=None,
    *,
    causal: bool = False,
    sm_scale: float = 1.0,
    block_sizes: BlockSizes | None = None,
    debug: bool = False,
):
    """Multi-head attention ``softmax((q @ k.T + ab) * sm_scale, masked) @ v``, differentiable.

    Args:
      q: ``[batch, heads, q_seq_len, head_dim]`` queries.
      k: ``[batch, heads, kv_seq_len, head_dim]`` keys.
      v: ``[batch, heads, kv_seq_len, head_dim]`` values.
      ab: optional ``[batch, heads, q_seq_len, kv_seq_len]`` bias added to the logits before the
        scale (it gets a gradient).
      segment_ids: optional ``SegmentIds``: queries attend only to keys of the same segment.
      causal: query ``i`` attends only to keys ``j <= i``.
      sm_scale: the scale of the logits.
      block_sizes: a ``BlockSizes``; None: ``BlockSizes.get_default``'s.
      debug: print the kernels' jaxprs and Mosaic modules.

    Returns:
      ``[batch, heads, q_seq_len, head_dim]`` attention output in ``q``'s dtype.
    """
    _check_shapes(q, k, v, ab, segment_ids)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    blocks = _resolve_blocks(block_sizes, batch, heads, q_len, kv_len, head_dim, causal)
    return _attention(q, k, v, ab, segment_ids, bool(causal), float(sm_scale), blocks, debug)


def _check_shapes(q, k, v, ab, segment_ids):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"flash_attention: {name} must be [batch, heads, seq, head_dim], got shape {x.shape}"
            )
    (b, h, lq, d), (bk, hk, lk, dk), (bv, hv, lv, dv) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ValueError(f"flash_attention: batch sizes of q, k, v differ: {b}, {bk}, {bv}")
    if not h == hk == hv:
        raise ValueError(f"flash_attention: head counts of q, k, v differ: {h}, {hk}, {hv}")
    if d != dk:
        raise ValueError(f"flash_attention: head_dim of q ({d}) and k ({dk}) differ")
    if d != dv:
        raise NotImplementedError(f"flash_attention: head_dim of v ({dv}) differs from q's and k's ({d})")
    if lk != lv:
        raise ValueError(f"flash_attention: kv_seq_len of k ({lk}) and v ({lv}) differ")
    if ab is not None and ab.shape != (b, h, lq, lk):
        raise ValueError(
            f"flash_attention: ab must have shape (batch, heads, q_seq_len, kv_seq_len) = {(b, h, lq, lk)}, "
            f"got {ab.shape}"
        )
    if segment_ids is not None:
        if segment_ids.q.shape != (b, lq):
            raise ValueError(
                f"flash_attention: segment_ids.q must have shape (batch, q_seq_len) = {(b, lq)}, "
                f"got {segment_ids.q.shape}"
            )
        if segment_ids.kv.shape != (b, lk):
            raise ValueError(
                f"flash_attention: segment_ids.kv must have shape (batch, kv_seq_len) = {(b, lk)}, "
                f"got {segment_ids.kv.shape}"
            )


def _resolve_blocks(block_sizes, batch, heads, q_len, kv_len, head_dim, causal) -> BlockSizes:
    """The user's blocks with the missing backward ones defaulted, checked against the shapes."""
    default = BlockSizes.get_default(batch, heads, q_len, kv_len, head_dim, causal=causal)
    if block_sizes is None:
        blocks = default
    else:
        missing = {
            f.name: getattr(default, f.name)
            for f in dataclasses.fields(BlockSizes)
            if getattr(block_sizes, f.name) is None
        }
        blocks = dataclasses.replace(block_sizes, **missing)
    checks = (
        ("block_q", "q_seq_len", q_len),
        ("block_k_major", "kv_seq_len", kv_len),
        ("block_k", "block_k_major", blocks.block_k_major),
        ("block_q_major_dkv", "q_seq_len", q_len),
        ("block_k_major_dkv", "kv_seq_len", kv_len),
        ("block_k_dkv", "block_k_major_dkv", blocks.block_k_major_dkv),
        ("block_q_dkv", "block_q_major_dkv", blocks.block_q_major_dkv),
        ("block_q_dq", "q_seq_len", q_len),
        ("block_k_major_dq", "kv_seq_len", kv_len),
        ("block_k_dq", "block_k_major_dq", blocks.block_k_major_dq),
    )
    for name, of, n in checks:
        size = getattr(blocks, name)
        if size > n or n % size:
            raise ValueError(f"flash_attention: block_sizes.{name}={size} must divide {of}={n}")
        if size != n and size % NUM_LANES:
            raise ValueError(
                f"flash_attention: block_sizes.{name}={size} must be a multiple of {NUM_LANES} "
                f"(a TPU tile of lanes) or all of {of}={n}"
            )
    if blocks.block_b > batch:
        raise ValueError(f"flash_attention: block_sizes.block_b={blocks.block_b} exceeds batch={batch}")
    return blocks


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug):
    out, _ = _forward(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug, keep_lse=False)
    return out


def _attention_fwd(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug):
    out, lse = _forward(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug, keep_lse=True)
    return out, (q, k, v, ab, segment_ids, out, lse)


def _attention_bwd(causal, sm_scale, blocks, debug, residuals, d_out):
    q, k, v, ab, segment_ids, out, lse = residuals
    if _fused_backward_fits(q):
        dk, dv, dq, dab = _backward_dkv(
            q, k, v, ab, segment_ids, lse, d_out, out, causal, sm_scale, blocks, debug, with_dq=True
        )
    else:
        # The separate kernels read the query pre-scaled (rounded as the forward kernel rounds
        # it: the very logits the forward pass saw) and di = rowsum(dO * O) = rowsum(dP * P),
        # the softmax's correction, as a lane-dense row per head.
        qs = _scaled_query(q, sm_scale)
        di = jnp.sum(out.astype(_F32) * d_out.astype(_F32), axis=-1)[:, :, None, :]
        dk, dv = _backward_dkv(qs, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug)
        dq, dab = _backward_dq(qs, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug)
    return dq, dk, dv, dab, None


def _fused_backward_fits(q) -> bool:
    """Whether a head's ``dq`` accumulator and scaled queries take at most a quarter of the VMEM budget."""
    return q.shape[2] * q.shape[3] * (4 + q.dtype.itemsize) <= _vmem_budget() // 4


_attention.defvjp(_attention_fwd, _attention_bwd)


def _scaled_query(q, sm_scale):
    """``q * sm_scale * log2(e)`` in ``q``'s dtype: logits in base 2 straight off the MXU."""
    return (q.astype(_F32) * (sm_scale * _LOG2E)).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Pieces shared by the kernels.


def _lanes(x, n: int):
    """A lane-replicated ``(rows, 128)`` value widened (or cut) to ``(rows, n)``."""
    if n == NUM_LANES:
        return x
    whole, part = divmod(n, NUM_LANES)
    pieces = [x] * whole + ([x[:, :part]] if part else [])
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def _column(row, width=NUM_LANES):
    """A ``(1, n)`` row as an ``(n, width)`` column block: row ``i`` holds ``row[0, i]`` in every lane."""
    return jnp.transpose(jnp.broadcast_to(row, (width, row.shape[1])))


def _row(column):
    """Lane 0 of an ``(n, 128)`` lane-replicated block as a lane-dense ``(1, n)`` row."""
    return jnp.transpose(column)[:1, :]


def _diagonal_keep(shape, rows_are_queries: bool):
    """The visible half of a square tile centred on the causal diagonal: key <= query."""
    offset = lax.broadcasted_iota(jnp.int32, shape, 1) - lax.broadcasted_iota(jnp.int32, shape, 0)
    return offset <= 0 if rows_are_queries else offset >= 0


def _segment_ids(segment_ids, kv_major: bool):
    """The segment ids as the kernels read them: the tile rows' ids lane-replicated
    ``[batch, rows, 128]``, the tile columns' ids as a lane-dense ``[batch, 1, cols]`` row."""
    if segment_ids is None:
        return None, None
    rows, cols = (segment_ids.kv, segment_ids.q) if kv_major else (segment_ids.q, segment_ids.kv)
    batch, n = rows.shape
    row_ids = lax.broadcast_in_dim(rows.astype(jnp.int32), (batch, n, NUM_LANES), (0, 1))
    col_ids = cols.astype(jnp.int32)[:, None, :]
    return row_ids, col_ids


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


def _compiler_params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_vmem_budget())


@dataclasses.dataclass(frozen=True)
class _Sweep:
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
    # ``_max_unrolled()``.
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
        if self.cols % self.rows == 0 and self.cols // self.rows <= 4:
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
            if self.rows * self.cols <= (self.max_unrolled or _max_unrolled()):
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
        width = math.gcd(self.tile_cols, self.rows)
        n = self.cols // width
        if self.rows_are_queries:  # keys before the first query
            lo, hi = 0, jnp.clip((row0 - col0) // width, 0, n)
        else:  # queries after the last key
            lo, hi = jnp.clip((row0 + self.rows - col0) // width, 0, n), n
        for a in range(self.rows // self.tile_rows):
            r = a * self.tile_rows
            _loop(lo, hi, lambda t, r=r: tile(r, self.tile_rows, self._col(width, t), width, False))
        sq, n_sq = self.square, self.rows // self.square
        for a in range(n_sq):
            for b in range(a + 1) if self.rows_are_queries else range(a, n_sq):
                c = row0 + b * sq - col0

                @pl.when((c >= 0) & (c < self.cols))
                def _(a=a, b=b, c=c):
                    tile(a * sq, sq, pl.multiple_of(c, sq), sq, a == b)

    @staticmethod
    def _col(width, t):
        return pl.multiple_of(t * width, width)


def _square(*sizes: int) -> int:
    """The edge of the tiles along the causal diagonal: at most ``_DIAGONAL_TILE``, dividing every size."""
    tile = functools.reduce(math.gcd, sizes)
    while tile > _DIAGONAL_TILE and tile % 2 == 0 and (tile // 2) % NUM_SUBLANES == 0:
        tile //= 2
    return tile


# ---------------------------------------------------------------------------------------------
# Forward.


def _forward(q, k, v, ab, segment_ids, causal, sm_scale, blocks, debug, *, keep_lse):
    """``(out, lse)``: the attention and (``keep_lse``) its base-2 logsumexp ``[b, h, 1, q_len]``."""
    return _forward_call(
        q,
        k,
        v,
        ab,
        segment_ids,
        causal=causal,
        sm_scale=sm_scale,
        block_q=blocks.block_q,
        block_kv=blocks.block_k_major,
        tile_kv=blocks.block_k,
        keep_lse=keep_lse,
        debug=debug,
    )


def _forward_call(q, k, v, ab, segment_ids, *, causal, sm_scale, block_q, block_kv, tile_kv, keep_lse, debug):
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    n_q, n_kv = q_len // block_q, kv_len // block_kv
    sweep = _Sweep(block_q, block_kv, block_q, tile_kv, causal, True, _square(block_q, block_kv))
    row_ids, col_ids = _segment_ids(segment_ids, kv_major=False)
    bias_scale = sm_scale * _LOG2E

    def kv_block(i, j):
        # Causal: steps past the query block's last row re-name the last block needed (no copy).
        return jnp.minimum(j, (i * block_q + block_q - 1) // block_kv) if causal else j

    def kernel(*refs):
        refs = list(refs)
        q_ref, k_ref, v_ref = refs[:3]
        del refs[:3]
        ab_ref = refs.pop(0) if ab is not None else None
        rid_ref, cid_ref = (refs.pop(0), refs.pop(0)) if segment_ids is not None else (None, None)
        o_ref = refs.pop(0)
        lse_ref = refs.pop(0) if keep_lse else None
        qs_ref, m_ref, l_ref, acc_ref = refs
        i, j = pl.program_id(2), pl.program_id(3)

        @pl.when(j == 0)
        def _():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
            l_ref[...] = jnp.zeros(l_ref.shape, _F32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
            qs_ref[...] = _scaled_query(q_ref[...], sm_scale)

        def tile(r0, rows, c0, cols, diagonal):
            """Rows ``[r0, r0+rows)`` of the query block against keys ``[c0, c0+cols)`` of the key block."""
            r, c = pl.ds(r0, rows), pl.ds(c0, cols)
            s = lax.dot_general(qs_ref[r, :], k_ref[c, :], TRANS_B_DIM_NUMBERS, preferred_element_type=_F32)
            if ab_ref is not None:
                s = s + ab_ref[r, c].astype(_F32) * bias_scale
            keep = None
            if rid_ref is not None:
                keep = _lanes(rid_ref[r, :], cols) == cid_ref[:, c]
            if diagonal:
                on = _diagonal_keep((rows, cols), rows_are_queries=True)
                keep = on if keep is None else keep & on
            if keep is not None:
                s = jnp.where(keep, s, DEFAULT_MASK_VALUE)
            m_prev = m_ref[r, :]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp2(s - _lanes(m_next, cols))
            rescale = jnp.exp2(m_prev - m_next)
            m_ref[r, :] = m_next
            l_ref[r, :] = rescale * l_ref[r, :] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot(p.astype(v_ref.dtype), v_ref[c, :], preferred_element_type=_F32)
            acc_ref[r, :] = acc_ref[r, :] * _lanes(rescale, head_dim) + pv

        sweep.run(tile, i * block_q, j * block_kv)

        @pl.when(j == n_kv - 1)
        def _():
            l = l_ref[...]
            o_ref[...] = (acc_ref[...] * _lanes(1.0 / l, head_dim)).astype(o_ref.dtype)
            if lse_ref is not None:
                lse_ref[...] = _row(m_ref[...] + jnp.log2(l))

    in_specs = [
        pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0)),
        pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, i, j: (b, h, kv_block(i, j), 0)),
        pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, i, j: (b, h, kv_block(i, j), 0)),
    ]
    args = [q, k, v]
    if ab is not None:
        in_specs.append(
            pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, i, j: (b, h, i, kv_block(i, j)))
        )
        args.append(ab)
    if segment_ids is not None:
        in_specs.append(pl.BlockSpec((None, block_q, NUM_LANES), lambda b, h, i, j: (b, i, 0)))
        in_specs.append(pl.BlockSpec((None, 1, block_kv), lambda b, h, i, j: (b, 0, kv_block(i, j))))
        args += [row_ids, col_ids]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0))]
    if keep_lse:
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, 1, q_len), _F32))
        out_specs.append(pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j: (b, h, 0, i)))
    scratch = [
        pltpu.VMEM((block_q, head_dim), q.dtype),  # the scaled query block
        pltpu.VMEM((block_q, NUM_LANES), _F32),  # running max
        pltpu.VMEM((block_q, NUM_LANES), _F32),  # running sum
        pltpu.VMEM((block_q, head_dim), _F32),  # unnormalized output
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
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(2, q, k, causal, args, out_shape),
        debug=debug,
        name="flash_attention_fwd",
    )(*args)
    return outs[0], (outs[1] if keep_lse else None)


def _cost(matmuls, q, k, causal, args, out_shape):
    batch, heads, q_len, head_dim = q.shape
    pairs = batch * heads * q_len * k.shape[2] // (2 if causal else 1)
    return pl.CostEstimate(
        flops=2 * matmuls * pairs * head_dim,
        transcendentals=pairs,
        bytes_accessed=sum(_nbytes(x) for x in args) + sum(_nbytes(x) for x in out_shape),
    )


def _nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


# ---------------------------------------------------------------------------------------------
# Backward: dq (query-major) and dk, dv (key-major).


def _backward_dq(qs, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug):
    return _dq_call(
        qs,
        k,
        v,
        ab,
        segment_ids,
        lse,
        d_out,
        di,
        causal=causal,
        sm_scale=sm_scale,
        block_q=blocks.block_q_dq,
        block_kv=blocks.block_k_major_dq,
        tile_kv=blocks.block_k_dq,
        debug=debug,
    )


def _dq_call(
    qs, k, v, ab, segment_ids, lse, d_out, di, *, causal, sm_scale, block_q, block_kv, tile_kv, debug
):
    """``(dq, dab)`` (``dab`` None without ``ab``): per query block, the keys swept as in the forward."""
    batch, heads, q_len, head_dim = qs.shape
    kv_len = k.shape[2]
    n_q, n_kv = q_len // block_q, kv_len // block_kv
    sweep = _Sweep(block_q, block_kv, block_q, tile_kv, causal, True, _square(block_q, block_kv))
    row_ids, col_ids = _segment_ids(segment_ids, kv_major=False)
    bias_scale = sm_scale * _LOG2E

    def kv_block(i, j):
        return jnp.minimum(j, (i * block_q + block_q - 1) // block_kv) if causal else j

    def kernel(*refs):
        refs = list(refs)
        qs_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
        del refs[:6]
        ab_ref = refs.pop(0) if ab is not None else None
        rid_ref, cid_ref = (refs.pop(0), refs.pop(0)) if segment_ids is not None else (None, None)
        dq_ref = refs.pop(0)
        dab_ref = refs.pop(0) if ab is not None else None
        acc_ref, lse_col_ref, di_col_ref = refs
        i, j = pl.program_id(2), pl.program_id(3)

        @pl.when(j == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
            lse_col_ref[...] = _column(lse_ref[...])
            di_col_ref[...] = _column(di_ref[...])

        if dab_ref is not None and causal:
            dab_ref[...] = jnp.zeros(dab_ref.shape, dab_ref.dtype)  # what no tile writes is masked

        def tile(r0, rows, c0, cols, diagonal):
            r, c = pl.ds(r0, rows), pl.ds(c0, cols)
            k_tile = k_ref[c, :]
            s = lax.dot_general(qs_ref[r, :], k_tile, TRANS_B_DIM_NUMBERS, preferred_element_type=_F32)
            if ab_ref is not None:
                s = s + ab_ref[r, c].astype(_F32) * bias_scale
            keep = None
            if rid_ref is not None:
                keep = _lanes(rid_ref[r, :], cols) == cid_ref[:, c]
            if diagonal:
                on = _diagonal_keep((rows, cols), rows_are_queries=True)
                keep = on if keep is None else keep & on
            if keep is not None:
                s = jnp.where(keep, s, DEFAULT_MASK_VALUE)
            p = jnp.exp2(s - _lanes(lse_col_ref[r, :], cols))
            dp = lax.dot_general(do_ref[r, :], v_ref[c, :], TRANS_B_DIM_NUMBERS, preferred_element_type=_F32)
            ds = p * (dp - _lanes(di_col_ref[r, :], cols))
            acc_ref[r, :] += lax.dot(ds.astype(k_tile.dtype), k_tile, preferred_element_type=_F32)
            if dab_ref is not None:
                dab_ref[r, c] = (ds * sm_scale).astype(dab_ref.dtype)

        sweep.run(tile, i * block_q, j * block_kv)

        @pl.when(j == n_kv - 1)
        def _():
            dq_ref[...] = (acc_ref[...] * sm_scale).astype(dq_ref.dtype)

    q_spec = pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_kv, head_dim), lambda b, h, i, j: (b, h, kv_block(i, j), 0))
    row_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j: (b, h, 0, i))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [qs, k, v, d_out, lse, di]
    out_shape = [jax.ShapeDtypeStruct(qs.shape, qs.dtype)]
    out_specs = [q_spec]
    if ab is not None:
        in_specs.append(
            pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, i, j: (b, h, i, kv_block(i, j)))
        )
        args.append(ab)
        out_shape.append(jax.ShapeDtypeStruct(ab.shape, ab.dtype))
        out_specs.append(pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, i, j: (b, h, i, j)))
    if segment_ids is not None:
        in_specs.append(pl.BlockSpec((None, block_q, NUM_LANES), lambda b, h, i, j: (b, i, 0)))
        in_specs.append(pl.BlockSpec((None, 1, block_kv), lambda b, h, i, j: (b, 0, kv_block(i, j))))
        args += [row_ids, col_ids]
    scratch = [
        pltpu.VMEM((block_q, head_dim), _F32),  # dq accumulator
        pltpu.VMEM((block_q, NUM_LANES), _F32),  # logsumexp, lane-replicated
        pltpu.VMEM((block_q, NUM_LANES), _F32),  # di, lane-replicated
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
        compiler_params=_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(3, qs, k, causal, args, out_shape),
        debug=debug,
        name="flash_attention_dq",
    )(*args)
    return outs[0], (outs[1] if ab is not None else None)


def _backward_dkv(q, k, v, ab, segment_ids, lse, d_out, di, causal, sm_scale, blocks, debug, with_dq=False):
    return _dkv_call(
        q,
        k,
        v,
        ab,
        segment_ids,
        lse,
        d_out,
        di,
        causal=causal,
        sm_scale=sm_scale,
        block_kv=blocks.block_k_major_dkv,
        block_q=blocks.block_q_major_dkv,
        tile_kv=blocks.block_k_dkv,
        tile_q=blocks.block_q_dkv,
        debug=debug,
        with_dq=with_dq,
    )


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

    Without ``with_dq``, ``q`` comes scaled (``_scaled_query``) and ``di`` is ``rowsum(dO * O)``
    as ``[b, h, 1, q_len]``. With ``with_dq`` (one fused backward kernel), ``q`` comes as the user
    gave it and ``di`` is the forward's output ``O``: the first key block's steps scale each query
    block and compute its ``di`` into VMEM, where they stay for the other key blocks (no XLA
    passes over ``q``, ``O`` and ``dO``), and the gradient of the queries is accumulated in VMEM
    across the key blocks (a float32 ``[q_len, head_dim]`` per head), which saves the separate
    ``dq`` kernel's recomputation of the scores and of ``dO @ v.T``.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    n_kv, n_q = kv_len // block_kv, q_len // block_q
    sweep = _Sweep(block_kv, block_q, tile_kv, tile_q, causal, False, _square(block_kv, block_q))
    row_ids, col_ids = _segment_ids(segment_ids, kv_major=True)
    bias_scale = sm_scale * _LOG2E
    with_dab = with_dq and ab is not None

    def q_block(j, i):
        # Causal: steps before the key block's first key re-name the first query block needed.
        return jnp.maximum(i, (j * block_kv) // block_q) if causal else i

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
            dq_acc, qs_all, di_all = refs
            here = pl.ds(q_start, block_q)

            @pl.when(j == 0)
            def _():
                @pl.when(i == 0)
                def _():
                    dq_acc[...] = jnp.zeros(dq_acc.shape, _F32)

                qs_all[here, :] = _scaled_query(q_ref[...], sm_scale)
                d = jnp.sum(di_ref[...].astype(_F32) * do_ref[...].astype(_F32), axis=1, keepdims=True)
                di_all[:, here] = _row(jnp.broadcast_to(d, (block_q, NUM_LANES)))

            def queries(c):
                return qs_all[pl.ds(q_start + c.start, c.size), :]

            def corrections(c):
                return di_all[:, pl.ds(q_start + c.start, c.size)]

        else:

            def queries(c):
                return q_ref[c, :]

            def corrections(c):
                return di_ref[:, c]

        @pl.when(i == 0)
        def _():
            dk_acc[...] = jnp.zeros(dk_acc.shape, _F32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, _F32)

        if dab_ref is not None and causal:
            dab_ref[...] = jnp.zeros(dab_ref.shape, dab_ref.dtype)  # what no tile writes is masked

        def tile(r0, rows, c0, cols, diagonal):
            """Keys ``[r0, r0+rows)`` of the key block against queries ``[c0, c0+cols)`` of the query block."""
            r, c = pl.ds(r0, rows), pl.ds(c0, cols)
            q_tile, do_tile, k_tile = queries(c), do_ref[c, :], k_ref[r, :]
            s = lax.dot_general(k_tile, q_tile, TRANS_B_DIM_NUMBERS, preferred_element_type=_F32)
            if ab_ref is not None:
                s = s + jnp.transpose(ab_ref[c, r].astype(_F32)) * bias_scale
            keep = None
            if rid_ref is not None:
                keep = _lanes(rid_ref[r, :], cols) == cid_ref[:, c]
            if diagonal:
                on = _diagonal_keep((rows, cols), rows_are_queries=False)
                keep = on if keep is None else keep & on
            if keep is not None:
                s = jnp.where(keep, s, DEFAULT_MASK_VALUE)
            p = jnp.exp2(s - lse_ref[:, c])
            dv_acc[r, :] += lax.dot(p.astype(do_tile.dtype), do_tile, preferred_element_type=_F32)
            dp = lax.dot_general(v_ref[r, :], do_tile, TRANS_B_DIM_NUMBERS, preferred_element_type=_F32)
            ds = p * (dp - corrections(c))
            ds_low = ds.astype(q_tile.dtype)
            dk_acc[r, :] += lax.dot(ds_low, q_tile, preferred_element_type=_F32)
            if with_dq:
                dq_acc[pl.ds(q_start + c0, cols), :] += lax.dot_general(
                    ds_low, k_tile, (((0,), (0,)), ((), ())), preferred_element_type=_F32
                )
            if dab_ref is not None:
                dab_ref[c, r] = jnp.transpose(ds * sm_scale).astype(dab_ref.dtype)

        sweep.run(tile, j * block_kv, q_start)

        @pl.when(i == n_q - 1)
        def _():
            dk_ref[...] = (dk_acc[...] * _LN2).astype(dk_ref.dtype)
            dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

        if dq_ref is not None:

            @pl.when((j == n_kv - 1) & (i == n_q - 1))
            def _():
                dq_ref[...] = (dq_acc[...] * sm_scale).astype(dq_ref.dtype)

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
    scratch = [pltpu.VMEM((block_kv, head_dim), _F32), pltpu.VMEM((block_kv, head_dim), _F32)]
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    if with_dq:
        out_shape.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
        out_specs.append(pl.BlockSpec((None, None, q_len, head_dim), lambda b, h, j, i: (b, h, 0, 0)))
        if with_dab:
            out_shape.append(jax.ShapeDtypeStruct(ab.shape, ab.dtype))
            out_specs.append(pl.BlockSpec((None, None, block_q, block_kv), lambda b, h, j, i: (b, h, i, j)))
        scratch += [
            pltpu.VMEM((q_len, head_dim), _F32),  # dq accumulator
            pltpu.VMEM((q_len, head_dim), q.dtype),  # the scaled queries
            pltpu.VMEM((1, q_len), _F32),  # di
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
        compiler_params=_compiler_params(semantics),
        cost_estimate=_cost(5 if with_dq else 4, q, k, causal, args, out_shape),
        debug=debug,
        name="flash_attention_bwd" if with_dq else "flash_attention_dkv",
    )(*args)
    return tuple(outs) + ((None,) if with_dq and not with_dab else ())


# ---------------------------------------------------------------------------------------------
# Plain-JAX references (JAX's module's names and signatures).


def _reference_logits(q, k, ab, segment_ids, causal, mask_value, sm_scale):
    """Masked logits ``[b, h, q_len, kv_len]``: ``(q @ k.T + ab) * sm_scale``, ``mask_value`` added where masked."""
    logits = jnp.einsum("bhid,bhjd->bhij", q, k)
    if ab is not None:
        logits = logits + ab
    logits = logits * sm_scale if sm_scale != 1.0 else logits
    q_len, kv_len = q.shape[2], k.shape[2]
    visible = None
    if segment_ids is not None:
        visible = (segment_ids.q[:, :, None] == segment_ids.kv[:, None, :])[:, None]
    if causal:
        keys_before = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        visible = keys_before[None, None] if visible is None else visible & keys_before
    if visible is None:
        return logits
    return logits + jnp.where(visible, 0.0, mask_value)


def mha_reference_no_custom_vjp(
    q,
    k,
    v,
    ab=None,
    segment_ids=None,
    *,
    causal: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    sm_scale: float = 1.0,
    save_residuals: bool = False,
):
    """Attention in plain ``jnp`` (differentiated by JAX); with ``save_residuals`` also the
    softmax's row sums ``l`` and row maxima ``m``: ``(out, l, m)``."""
    logits = _reference_logits(q, k, ab, segment_ids, causal, mask_value, sm_scale)
    m = jnp.max(logits, axis=-1)
    e = jnp.exp(logits - m[..., None])
    l = jnp.sum(e, axis=-1)
    out = jnp.einsum("bhij,bhjd->bhid", e / l[..., None], v)
    return (out, l, m) if save_residuals else out


@functools.partial(jax.jit, static_argnames=["causal", "mask_value", "sm_scale"])
@jax.default_matmul_precision("bfloat16")
def mha_reference(
    q,
    k,
    v,
    ab,
    segment_ids: SegmentIds | None = None,
    causal: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    sm_scale=1.0,
):
    """Attention in plain ``jnp``, differentiated by ``mha_reference_bwd``."""
    return _reference(q, k, v, ab, segment_ids, causal, mask_value, sm_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _reference(q, k, v, ab, segment_ids, causal, mask_value, sm_scale):
    return mha_reference_no_custom_vjp(
        q, k, v, ab, segment_ids, causal=causal, mask_value=mask_value, sm_scale=sm_scale
    )


def _reference_fwd(q, k, v, ab, segment_ids, causal, mask_value, sm_scale):
    kw = dict(causal=causal, mask_value=mask_value, sm_scale=sm_scale)
    out, sums, maxes = mha_reference_no_custom_vjp(q, k, v, ab, segment_ids, save_residuals=True, **kw)
    return out, (q, k, v, ab, segment_ids, out, sums, maxes)


def _reference_bwd(causal, mask_value, sm_scale, saved, d_out):
    kw = dict(causal=causal, mask_value=mask_value, sm_scale=sm_scale)
    *grads, dab = mha_reference_bwd(*saved, d_out, **kw)
    return (*grads, dab, None)  # nothing for the segment ids


_reference.defvjp(_reference_fwd, _reference_bwd)


@functools.partial(jax.jit, static_argnames=["causal", "mask_value", "sm_scale"])
def mha_reference_bwd(
    q,
    k,
    v,
    ab,
    segment_ids: SegmentIds | None,
    o,
    l,
    m,
    do,
    causal: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    sm_scale: float = 1.0,
):
    """``(dq, dk, dv, dab)`` of attention from the forward's output ``o``, row sums ``l`` and
    row maxima ``m`` (``dab`` None without ``ab``), in float32 ``jnp``."""
    f32 = [x.astype(_F32) for x in (q, k, v, o, do)]
    q32, k32, v32, o32, do32 = f32
    logits = _reference_logits(q32, k32, ab, segment_ids, causal, mask_value, sm_scale)
    probs = jnp.exp(logits - m[..., None]) / l[..., None]
    dv = jnp.einsum("bhij,bhid->bhjd", probs, do32)
    dprobs = jnp.einsum("bhid,bhjd->bhij", do32, v32)
    correction = jnp.sum(o32 * do32, axis=-1, keepdims=True)
    dlogits = probs * (dprobs - correction) * sm_scale
    dq = jnp.einsum("bhij,bhjd->bhid", dlogits, k32)
    dk = jnp.einsum("bhij,bhid->bhjd", dlogits, q32)
    dab = dlogits.astype(ab.dtype) if ab is not None else None
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dab
