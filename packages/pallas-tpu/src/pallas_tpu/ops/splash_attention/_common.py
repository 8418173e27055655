"""Pieces the splash attention kernels share: the static configuration, the schedule's index
arithmetic, the masks of a tile (``masked_tile``), ``splash_call`` and the kernels' VMEM limit
(``ops._policy``'s ``"attention"`` budget); the lane layouts, the refs by name and the online
softmax are ``ops._attention_common``'s, shared with flash attention."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops._attention_common import NUM_LANES as NUM_LANES
from pallas_tpu.ops._attention_common import as_column as as_column
from pallas_tpu.ops._attention_common import as_row as as_row
from pallas_tpu.ops._attention_common import lane_replicated as lane_replicated
from pallas_tpu.ops._attention_common import softmax_init as softmax_init
from pallas_tpu.ops._attention_common import softmax_scratch as softmax_scratch
from pallas_tpu.ops._attention_common import softmax_update as softmax_update
from pallas_tpu.ops._attention_common import take_refs as take_refs
from pallas_tpu.ops.splash_attention import splash_attention_mask as mask_lib
from pallas_tpu.ops.splash_attention import splash_attention_mask_info as info_lib

F32 = jnp.float32
LOG2E = math.log2(math.e)
NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class Config:
    """What a kernel call needs to know besides its arrays (static under ``jit``)."""

    is_mqa: bool
    mask_value: float
    attn_logits_soft_cap: float | None
    mask_function: Callable[..., Any] | None
    interpret: Any = False


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a kernel reads its ``ScheduleInfo`` (flattened to 1-d SMEM arrays): the grid, and per
    grid point the packed step and the head's row of the schedule."""

    heads: int
    mask_heads: int
    q_shards: int
    num_steps: int

    @classmethod
    def of(cls, info: info_lib.ScheduleInfo, heads: int, op: str) -> Schedule:
        mask_heads, q_shards, num_steps = info.steps.shape
        if heads % mask_heads:
            raise ValueError(
                f"{op}: the kernel's mask has {mask_heads} head rows, which do not divide the "
                f"{heads} heads of q (make the kernel for this many heads)"
            )
        return cls(heads, mask_heads, q_shards, num_steps)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.heads, self.q_shards, self.num_steps)

    def index(self, h, s, t):
        row = h // (self.heads // self.mask_heads) if self.mask_heads > 1 else 0
        return (row * self.q_shards + s) * self.num_steps + t

    def word(self, steps_ref, h, s, t):
        return info_lib.unpack(steps_ref[self.index(h, s, t)])


@dataclasses.dataclass(frozen=True)
class StepMaps:
    """The index maps of a kernel that walks a ``Schedule`` over ``(heads, q shards, steps)``:
    each grid point names the q block and kv block of its step (``q_block`` counts from the
    start of q, over the q shards of this call)."""

    sched: Schedule
    q_blocks_per_shard: int
    group: int  # q heads per kv head
    is_mqa: bool

    @classmethod
    def of(cls, info: info_lib.ScheduleInfo, q, k, block_q: int, cfg: Config, op: str) -> StepMaps:
        heads, q_len, _ = q.shape
        sched = Schedule.of(info, heads, op)
        kv_heads = 1 if cfg.is_mqa else k.shape[0]
        return cls(sched, q_len // (sched.q_shards * block_q), heads // kv_heads, cfg.is_mqa)

    def word(self, h, s, t, steps_ref):
        return self.sched.word(steps_ref, h, s, t)

    def q_block(self, h, s, t, steps_ref):
        return s * self.q_blocks_per_shard + self.word(h, s, t, steps_ref)["q_block"]

    def kv_block(self, h, s, t, steps_ref):
        return self.word(h, s, t, steps_ref)["kv_block"]

    def q_map(self, h, s, t, steps_ref, *_):  # q, dO, out, dq: [heads, q_len, head_dim]
        return (h, self.q_block(h, s, t, steps_ref), 0)

    def row_map(self, h, s, t, steps_ref, *_):  # lse, di: [heads, 1, q_len]
        return (h, 0, self.q_block(h, s, t, steps_ref))

    def kv_map(self, h, s, t, steps_ref, *_):  # k, v: [kv_heads, kv_len, head_dim] or [kv_len, head_dim]
        kv = self.kv_block(h, s, t, steps_ref)
        return (kv, 0) if self.is_mqa else (h // self.group, kv, 0)

    def kv_shape(self, block_kv: int, head_dim: int):
        return (block_kv, head_dim) if self.is_mqa else (None, block_kv, head_dim)

    def mask_map(self, h, s, t, steps_ref, base_ref, ids_ref, *_):
        return (ids_ref[self.sched.index(h, s, t)], 0, 0)

    def _q_rows(self, h, s, t, steps_ref, *_):
        return (self.q_block(h, s, t, steps_ref), 0)

    def _q_cols(self, h, s, t, steps_ref, *_):
        return (0, self.q_block(h, s, t, steps_ref))

    def _kv_rows(self, h, s, t, steps_ref, *_):
        return (self.kv_block(h, s, t, steps_ref), 0)

    def _kv_cols(self, h, s, t, steps_ref, *_):
        return (0, self.kv_block(h, s, t, steps_ref))

    def mask_and_segment_inputs(
        self, info, segment_ids, block_q: int, block_kv: int, *, rows_are_queries: bool
    ):
        """``(in_specs, args)`` of the inputs after the kernel's dense ones: the mask's partial
        blocks (when materialized), then the segment ids of the tile's rows and columns (the
        queries' for ``rows_are_queries``, else the keys')."""
        in_specs, args = [], []
        if info.partial_mask_ids is not None:
            shape = (None, block_q, block_kv) if rows_are_queries else (None, block_kv, block_q)
            in_specs.append(pl.BlockSpec(shape, self.mask_map))
            args.append(info.partial_mask_blocks)
        if segment_ids is not None:
            if rows_are_queries:
                rows, cols = (
                    pl.BlockSpec((block_q, NUM_LANES), self._q_rows),
                    pl.BlockSpec((1, block_kv), self._kv_cols),
                )
            else:
                rows, cols = (
                    pl.BlockSpec((block_kv, NUM_LANES), self._kv_rows),
                    pl.BlockSpec((1, block_q), self._q_cols),
                )
            in_specs += [rows, cols]
            args += list(segment_arrays(segment_ids, rows_are_queries=rows_are_queries))
        return in_specs, args


def prefetch_of(info: info_lib.ScheduleInfo) -> list:
    """The scalar-prefetched schedule: the packed steps, the q shards' first blocks and (for a
    materialized mask) the partial blocks' ids."""
    prefetch = [flat(info.steps), flat(info.q_block_base)]
    if info.partial_mask_ids is not None:
        prefetch.append(flat(info.partial_mask_ids))
    return prefetch


def flat(x):
    return None if x is None else jnp.asarray(x).reshape(-1)


def base2_logits(s, cap):
    """The float32 logits ``s`` (natural base) in base 2, soft-capped first when ``cap`` is
    given: ``log2(e) * cap * tanh(s / cap)`` (the cap on the natural logits, as JAX's
    reference), else ``log2(e) * s``; one multiply per score besides the cap's tanh."""
    if cap is None:
        return s * LOG2E
    return jnp.tanh(s * (1.0 / cap)) * (cap * LOG2E)


def probs_times(p, v):
    """``p @ v`` for float32 probabilities ``p`` and a value tile ``v``, accumulated in float32,
    as JAX's kernel takes it: float32 operands at the default precision (on a TPU's MXU one
    bf16 pass, as an explicit rounding of ``p`` would be; exact in interpret mode)."""
    return lax.dot(p, v.astype(F32), preferred_element_type=F32)


def cap_logits(s, cap):
    """``cap * tanh(s / cap)`` (Gemma's soft cap), and the tanh for the backward pass."""
    t = jnp.tanh(s * (1.0 / cap))
    return t * cap, t


def keep_mask(
    shape,
    *,
    partial,
    mask_function,
    q_start,
    kv_start,
    mask_tile,
    seg_rows,
    seg_cols,
    rows_are_queries: bool,
):
    """The visible entries of a tile of scores (None: all), ``shape`` = (rows, cols).

    ``partial`` (a static bool): the mask applies (from ``mask_function`` on the tile's global
    positions, or the loaded ``mask_tile``). ``seg_rows`` (lane-replicated ``(rows, 128)``) and
    ``seg_cols`` (``(1, cols)``) are the segment ids of the tile's rows and columns, or None.
    """
    keep = None
    if partial:
        if mask_function is not None:
            r = lax.broadcasted_iota(jnp.int32, shape, 0)
            c = lax.broadcasted_iota(jnp.int32, shape, 1)
            if rows_are_queries:
                keep = mask_function(r + q_start, c + kv_start)
            else:
                keep = mask_function(c + q_start, r + kv_start)
        else:
            keep = mask_tile.astype(jnp.int32) != 0
    if seg_rows is not None:
        same = lane_replicated(seg_rows, shape[1]) == seg_cols
        keep = same if keep is None else keep & same
    return keep


# The most scores of a pattern run as straight-line cells, per kernel (None: no limit); a larger
# pattern loops over each run of consecutive chunks whose cells have the same kinds, and the
# patterns that differ only in their leading all-FULL chunks (a causal diagonal at each place it
# may fall in a block) share one body. Loops cut Mosaic's compile (B2 H16 L4096 D128 causal,
# first call on the v5e: forward 7.5 s unrolled, 2.0 s looped; GQA L8192 12.2 s and 2.9 s; JAX's
# op 0.8-0.9 s), but in the forward kernel they cost speed on the v5e (full mask 135 TFLOP/s
# against 160 unrolled, causal 130 against 143, GQA L8192 140 against 155:
# benchmarks/tpu_ops_code_size.py): the scheduler overlaps one cell's matmuls with the next one's
# softmax only in straight-line code. The backward kernels ran as fast looped (3.27 ms against
# 3.28 at L4096 causal): they loop.
STRAIGHT_LINE_SCORES: dict[str, int | None] = {"fwd": None, "bwd": 1024 * 1024}


def run_patterns(code, patterns, tile, band: int, chunk: int, kernel: str):
    """For the step's pattern ``code`` (0: nothing), ``tile(q0, rows, kv0, partial)`` over the
    pattern's cells of ``band`` rows by ``chunk`` columns (offsets within the block): EMPTY
    cells skipped, FULL ones with ``partial=False``, the cells of a chunk with one kind in
    consecutive bands as one tile.

    A pattern of at most ``STRAIGHT_LINE_SCORES[kernel]`` (``kernel``: ``"fwd"`` or ``"bwd"``)
    visible scores is one straight-line body (the scheduler overlaps one tile's matmuls with the
    next one's softmax). Larger ones share code:
    patterns that differ only in how many all-FULL chunks lead them (a causal diagonal at each
    place it may fall in a block) are one body, a loop over the leading chunks then the rest;
    and each run of two or more consecutive chunks alike (the same kinds in the same bands) is a
    loop over them."""
    shared: dict[tuple, list[tuple[int, int]]] = {}
    limit = STRAIGHT_LINE_SCORES[kernel]
    for number, pattern in enumerate(patterns, start=1):
        columns = [tuple(b[c] for b in pattern) for c in range(len(pattern[0]))]
        visible = sum(k != mask_lib.EMPTY for col in columns for k in col) * band * chunk
        if limit is None or visible <= limit:
            pl.when(code == number)(functools.partial(_run_columns, columns, 0, tile, band, chunk, False))
            continue
        full = (mask_lib.FULL,) * len(pattern)
        lead = next((i for i, col in enumerate(columns) if col != full), len(columns))
        end = len(columns)
        while end > lead and all(k == mask_lib.EMPTY for k in columns[end - 1]):
            end -= 1
        shared.setdefault(tuple(columns[lead:end]), []).append((number, lead))
    for rest, members in shared.items():
        hit = functools.reduce(jnp.logical_or, [code == n for n, _ in members])
        full = (mask_lib.FULL,) * len(patterns[0])
        pl.when(hit)(functools.partial(_run_shared, code, members, list(rest), full, tile, band, chunk))


def _run_shared(code, members, rest, full, tile, band, chunk):
    """The body of patterns ``members`` (``(code, leading all-FULL chunks)`` each) that end in
    the same chunks ``rest``; ``full`` is an all-FULL chunk's kinds."""
    lead = members[0][1]
    for number, n in members[1:]:
        lead = jnp.where(code == number, n, lead)
    multiple = functools.reduce(math.gcd, [n for _, n in members])
    _loop_chunks(0, lead, lambda col: _column(tile, full, band, col), chunk, band * len(full), multiple)
    _run_columns(rest, lead, tile, band, chunk, True)


def _run_columns(columns, start, tile, band, chunk, loops: bool):
    """The chunks ``columns`` from chunk ``start`` (static or traced) on; with ``loops``, each
    run of two or more chunks alike is a loop over them."""
    at = 0
    for kinds, run in itertools.groupby(columns):
        n = len(list(run))
        if any(k != mask_lib.EMPTY for k in kinds):
            if loops and n > 1:
                rows = band * sum(k != mask_lib.EMPTY for k in kinds)
                body = functools.partial(_column, tile, kinds, band)
                _loop_chunks(start + at, n, body, chunk, rows, n)
            else:
                for c in range(at, at + n):
                    _column(tile, kinds, band, _chunk_offset(start + c, chunk))
        at += n


# The scores a loop over chunks computes per iteration (as many chunks as fit): straight-line
# code inside an iteration lets the scheduler overlap one chunk's matmuls with the next one's
# softmax, which a loop's back edge does not.
LOOP_SCORES = 1024 * 1024


def _loop_chunks(lo, count, body, chunk, rows, multiple):
    """``body(offset)`` for the ``count`` chunks from chunk ``lo`` (each static or traced;
    ``count`` a multiple of ``multiple``): a loop taking up to ``LOOP_SCORES // (rows * chunk)``
    chunks an iteration (a traced ``count``: a divisor of ``multiple``, so no chunk is left
    over), the chunks left over after it (a static ``count``) straight after it."""
    per = max(1, LOOP_SCORES // (rows * chunk))
    if isinstance(count, int):
        iters, left = divmod(count, per)
        if iters <= 1:
            for c in range(count):
                body(_chunk_offset(lo + c, chunk))
            return
    else:
        per = max(d for d in range(1, min(per, multiple) + 1) if multiple % d == 0)
        iters, left = count // per, 0

    def step(i, carry):
        base = lo + i * per
        for u in range(per):
            body(_chunk_offset(base + u, chunk))
        return carry

    lax.fori_loop(0, iters, step, 0)
    for c in range(left):
        body(_chunk_offset(lo + iters * per + c, chunk))


def _chunk_offset(c, chunk):
    return c * chunk if isinstance(c, int) else pl.multiple_of(c * chunk, chunk)


def _column(tile, kinds, band, col):
    """One chunk's cells: the bands of one kind in a row as one tile, EMPTY ones skipped."""
    row = 0
    for kind, run in itertools.groupby(kinds):
        n = len(list(run))
        if kind != mask_lib.EMPTY:
            tile(row * band, n * band, col, kind == mask_lib.PARTIAL)
        row += n


def masked_tile(s, x, cfg, partial, q_start, kv_start, r, c, *, rows_are_queries: bool):
    """The tile of scores ``s`` (rows ``r``, columns ``c`` of the step's block; queries on rows
    when ``rows_are_queries``, else keys) with what may not be seen set to ``cfg.mask_value``:
    ``keep_mask`` of the mask (``partial``: from ``cfg.mask_function`` at the tile's global
    ``q_start``/``kv_start``, or the loaded block ``x.mask``) and the segment ids ``x.seg_q``,
    ``x.seg_kv``."""
    seg_rows, seg_cols = (x.seg_q, x.seg_kv) if rows_are_queries else (x.seg_kv, x.seg_q)
    keep = keep_mask(
        s.shape,
        partial=partial,
        mask_function=cfg.mask_function,
        q_start=q_start,
        kv_start=kv_start,
        mask_tile=x.mask[r, c] if x.mask is not None else None,
        seg_rows=seg_rows[r, :] if seg_rows is not None else None,
        seg_cols=seg_cols[:, c] if seg_cols is not None else None,
        rows_are_queries=rows_are_queries,
    )
    if keep is not None:
        s = jnp.where(keep, s, cfg.mask_value)
    return s


def splash_call(
    kernel, prefetch, args, in_specs, out_specs, scratch, out_shape, *, maps, blocks, flops, cfg, name,
    semantics=None,
):  # fmt: skip
    """The outputs of a splash kernel over ``maps``'s schedule: ``prefetch`` scalar-prefetched,
    ``args`` in ``in_specs`` (``args[0]`` the queries), ``out_shape`` in ``out_specs``,
    ``scratch`` in VMEM; its cost ``flops`` per score of each step's ``blocks[0] x blocks[1]``."""
    steps_total = args[0].shape[0] * maps.sched.q_shards * maps.sched.num_steps
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=maps.sched.grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=compiler_params(semantics),
        cost_estimate=cost(flops, steps_total * blocks[0] * blocks[1], args, out_shape),
        interpret=cfg.interpret,
        name=name,
    )(*prefetch, *args)


def compiler_params(semantics=None):
    return pltpu.CompilerParams(
        dimension_semantics=semantics or ("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=_policy.vmem_budget("attention"),
    )


def segment_arrays(segment_ids, *, rows_are_queries: bool):
    """The segment ids as the kernels read them: the rows' ids lane-replicated ``[n, 128]``,
    the columns' ids a lane-dense ``[1, n]`` row."""
    if segment_ids is None:
        return None, None
    rows, cols = (segment_ids.q, segment_ids.kv) if rows_are_queries else (segment_ids.kv, segment_ids.q)
    dtype = segment_dtype(segment_ids)
    row_ids = lax.broadcast_in_dim(rows.astype(dtype), (rows.shape[0], NUM_LANES), (0,))
    return row_ids, cols.astype(dtype)[None, :]


def segment_dtype(segment_ids):
    """The dtype the kernels compare segment ids in: int32 for integer (or boolean) ids,
    float32 when either side is floating point (compared as given, never truncated)."""
    if any(jnp.issubdtype(x.dtype, jnp.floating) for x in segment_ids):
        return F32
    return jnp.int32


def cost(flops_per_pair: int, pairs: int, args, outs) -> pl.CostEstimate:
    def nbytes(x):
        return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize

    return pl.CostEstimate(
        flops=flops_per_pair * pairs,
        transcendentals=pairs,
        bytes_accessed=sum(nbytes(x) for x in args if x is not None) + sum(nbytes(x) for x in outs),
    )
