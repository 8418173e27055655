"""Which (row tile, group) pair each grid step of a grouped matmul works on.

The rows of ``lhs`` are sorted by group: group ``g`` owns rows
``[ends[g-1], ends[g])`` with ``ends = cumsum(group_sizes)``. A kernel walks
row tiles of ``tm`` rows; a tile whose rows belong to several groups is visited
once per group, and each visit keeps only its group's rows. The visits are
computed here with ``jnp`` from ``group_sizes`` (so they follow the data) and
handed to the kernel as one scalar-prefetched int32 table, ``(FIELDS, steps)``:

* ``TILE``: the row tile the step's result belongs to;
* ``GROUP``: the step's group, counted from ``group_offset`` (the local rhs index);
* ``FETCH_TILE``, ``FETCH_GROUP``: the blocks to load; equal to the above on
  steps that compute, and on the others (an empty group, a tile no local group
  touches, the padding after the last visit) those of the nearest computing
  step, so that the pipeline finds them already in VMEM and moves nothing;
* ``LO``, ``HI``: the group's rows in the tile, ``[LO, HI)`` counted from the
  tile's first row;
* ``FLAGS``: ``COMPUTE`` (the group has rows in the tile), ``FIRST`` and
  ``LAST`` (the first/last visit of the tile, for ``gmm``; of the group, for
  ``tgmm``), ``REAL`` (not padding).

The number of visits depends on the data; the grid has a fixed number of steps
(``max_visits``), and the steps after the last visit do nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

TILE, GROUP, FETCH_TILE, FETCH_GROUP, LO, HI, FLAGS = range(7)
FIELDS = 7
COMPUTE, FIRST, LAST, REAL = 1, 2, 4, 8


def max_visits(num_tiles: int, num_local_groups: int) -> int:
    """An upper bound on visits: each tile once, plus one for each boundary between two of
    the local groups inside a tile (and, for ``tgmm``, one per empty group: the same bound)."""
    return num_tiles + max(num_local_groups, 1) - 1


def _group_rows(group_sizes, m):
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def _pinned(index, computes):
    """For each step, ``index`` of the nearest computing step at or before it (or the first
    computing step, for steps before any)."""
    steps = jnp.arange(index.shape[0], dtype=jnp.int32)
    latest = lax.cummax(jnp.where(computes, steps, -1))
    source = jnp.where(latest >= 0, latest, jnp.argmax(computes).astype(jnp.int32))
    return index[source]


def _table(tile, group, lo, hi, flags, computes, group_offset, num_local):
    local = jnp.clip(group - group_offset, 0, num_local - 1)
    rows = [tile, local, _pinned(tile, computes), _pinned(local, computes), lo, hi, flags]
    return jnp.stack([r.astype(jnp.int32) for r in rows])


def _flags(**bits):
    weights = {"compute": COMPUTE, "first": FIRST, "last": LAST, "real": REAL}
    return sum(jnp.where(v, weights[k], 0) for k, v in bits.items())


def _rows_in_tile(starts, ends, group, tile, tm, computes):
    lo = jnp.clip(starts[group] - tile * tm, 0, tm)
    hi = jnp.clip(ends[group] - tile * tm, 0, tm)
    return jnp.where(computes, lo, 0), jnp.where(computes, hi, 0)


def _group_spans(starts, ends, group_offset, num_local, tm):
    """Per group: whether it is local, whether it has rows, its first and last tile."""
    gid = jnp.arange(starts.shape[0], dtype=jnp.int32)
    local = (gid >= group_offset) & (gid < group_offset + num_local)
    has_rows = ends > starts
    first_tile = starts // tm
    last_tile = jnp.maximum(ends - 1, starts) // tm
    return local, has_rows, first_tile, last_tile


def gmm_schedule(group_sizes, group_offset, *, m: int, tm: int, num_local: int) -> jax.Array:
    """The visits of ``gmm``, in row-tile order: each tile once per local group with rows
    in it, and once (``COMPUTE`` unset) if none has, so that every output row is
    written. Visits of one tile are consecutive, so its output block stays in VMEM
    between them. ``FIRST``/``LAST``: the tile's first/last visit."""
    num_tiles = -(-m // tm)
    steps = max_visits(num_tiles, num_local)
    starts, ends = _group_rows(group_sizes, m)
    local, has_rows, first_tile, last_tile = _group_spans(starts, ends, group_offset, num_local, tm)
    tiles_of_group = jnp.where(local & has_rows, last_tile - first_tile + 1, 0)
    group_end = jnp.cumsum(tiles_of_group)
    covering = group_end[-1]
    # The covering visits in group order (which is also tile order).
    w = jnp.arange(steps, dtype=jnp.int32)
    w_group = jnp.minimum(
        jnp.searchsorted(group_end, w, side="right", method="compare_all"), starts.shape[0] - 1
    )
    w_tile = first_tile[w_group] + w - (group_end - tiles_of_group)[w_group]
    per_tile = (
        jnp.zeros((num_tiles,), jnp.int32).at[jnp.where(w < covering, w_tile, num_tiles)].add(1, mode="drop")
    )
    # Every tile gets max(1, its covering visits); a tile nobody covers gets a write-only visit.
    visits = jnp.maximum(per_tile, 1)
    tile_end = jnp.cumsum(visits)
    total = tile_end[-1]
    v = jnp.minimum(jnp.arange(steps, dtype=jnp.int32), total - 1)
    tile = jnp.minimum(
        jnp.searchsorted(tile_end, v, side="right", method="compare_all"), num_tiles - 1
    ).astype(jnp.int32)
    nth = v - (tile_end - visits)[tile]
    computes = per_tile[tile] > 0
    group = w_group[jnp.minimum((jnp.cumsum(per_tile) - per_tile)[tile] + nth, steps - 1)]
    real = jnp.arange(steps) < total
    lo, hi = _rows_in_tile(starts, ends, group, tile, tm, computes)
    flags = _flags(
        compute=computes & real, first=(nth == 0) & real, last=(nth == visits[tile] - 1) & real, real=real
    )
    return _table(tile, group, lo, hi, flags, computes, group_offset, num_local)


def tgmm_schedule(group_sizes, group_offset, *, m: int, tm: int, num_local: int) -> jax.Array:
    """The visits of ``tgmm``, in group order: each local group once per tile it has
    rows in, an empty one once (``COMPUTE`` unset: its output is zeros). Visits of one
    group are consecutive; ``FIRST``/``LAST``: the group's first/last visit."""
    num_tiles = -(-m // tm)
    steps = max_visits(num_tiles, num_local)
    starts, ends = _group_rows(group_sizes, m)
    local, has_rows, first_tile, last_tile = _group_spans(starts, ends, group_offset, num_local, tm)
    visits = jnp.where(local, jnp.where(has_rows, last_tile - first_tile + 1, 1), 0)
    group_end = jnp.cumsum(visits)
    total = group_end[-1]
    v = jnp.minimum(jnp.arange(steps, dtype=jnp.int32), total - 1)
    group = jnp.minimum(
        jnp.searchsorted(group_end, v, side="right", method="compare_all"), starts.shape[0] - 1
    ).astype(jnp.int32)
    nth = v - (group_end - visits)[group]
    tile = jnp.minimum(first_tile[group] + nth, num_tiles - 1)
    computes = has_rows[group]
    real = jnp.arange(steps) < total
    lo, hi = _rows_in_tile(starts, ends, group, tile, tm, computes)
    flags = _flags(
        compute=computes & real, first=(nth == 0) & real, last=(nth == visits[group] - 1) & real, real=real
    )
    return _table(tile, group, lo, hi, flags, computes, group_offset, num_local)


def _pick(onehot, values):
    """``values[index]`` per row of ``onehot`` ([rows, n] bool, one True a row): a masked sum."""
    return jnp.sum(jnp.where(onehot, values[None, :], 0), axis=1)


def gmm_schedule_dense(group_sizes, group_offset, *, m: int, tm: int, num_local: int) -> jax.Array:
    """``gmm_schedule``'s table, equal to it, from comparisons of small broadcast matrices
    ((steps, groups), (steps, tiles), (steps, steps)) and masked sums instead of cumsums,
    searches, a scatter and gathers: fewer XLA ops before the kernel (66 HLO instructions
    to 38 for 8 groups on the v5e), each ~0.5-1 us on the chip by the fit of
    benchmarks/tpu_gmm_schedule.py."""
    num_tiles = -(-m // tm)
    steps = max_visits(num_tiles, num_local)
    i32 = jnp.int32
    sizes = jnp.maximum(group_sizes, 0).astype(i32)
    g = jnp.arange(sizes.shape[0], dtype=i32)
    upto = g[None, :] <= g[:, None]
    ends = jnp.minimum(jnp.sum(jnp.where(upto, sizes[None, :], 0), 1), m)
    starts = jnp.minimum(jnp.sum(jnp.where(g[None, :] < g[:, None], sizes[None, :], 0), 1), m)
    local = (g >= group_offset) & (g < group_offset + num_local)
    first_tile = starts // tm
    last_tile = jnp.maximum(ends - 1, starts) // tm
    tiles_of_group = jnp.where(local & (ends > starts), last_tile - first_tile + 1, 0)
    group_end = jnp.sum(jnp.where(upto, tiles_of_group[None, :], 0), 1)
    covering = jnp.sum(tiles_of_group)
    w = jnp.arange(steps, dtype=i32)
    w_group = jnp.minimum(jnp.sum(group_end[None, :] <= w[:, None], 1), sizes.shape[0] - 1).astype(i32)
    w_tile = _pick(g[None, :] == w_group[:, None], first_tile - (group_end - tiles_of_group)) + w
    t = jnp.arange(num_tiles, dtype=i32)
    per_tile = jnp.sum((w[None, :] < covering) & (w_tile[None, :] == t[:, None]), 1).astype(i32)
    visits = jnp.maximum(per_tile, 1)
    tile_end = jnp.sum(jnp.where(t[None, :] <= t[:, None], visits[None, :], 0), 1)
    total = jnp.sum(visits)
    v = jnp.minimum(w, total - 1)
    tile = jnp.minimum(jnp.sum(tile_end[None, :] <= v[:, None], 1), num_tiles - 1).astype(i32)
    at_tile = t[None, :] == tile[:, None]
    nth = v - _pick(at_tile, tile_end - visits)
    covers = _pick(at_tile, per_tile)
    before = _pick(at_tile, jnp.sum(jnp.where(t[None, :] < t[:, None], per_tile[None, :], 0), 1))
    computes = covers > 0
    group = _pick(w[None, :] == jnp.minimum(before + nth, steps - 1)[:, None], w_group)
    at_group = g[None, :] == group[:, None]
    lo = jnp.where(computes, jnp.clip(_pick(at_group, starts) - tile * tm, 0, tm), 0)
    hi = jnp.where(computes, jnp.clip(_pick(at_group, ends) - tile * tm, 0, tm), 0)
    real = w < total
    flags = _flags(
        compute=computes & real, first=(nth == 0) & real, last=(nth == jnp.maximum(covers, 1) - 1) & real,
        real=real,
    )  # fmt: skip
    local_group = jnp.clip(group - group_offset, 0, num_local - 1)
    # Steps that compute nothing fetch what the nearest computing step before them did
    # (before any: the first computing step).
    latest = jnp.max(jnp.where((w[None, :] <= w[:, None]) & computes[None, :], w[None, :], -1), 1)
    first = jnp.min(jnp.where(computes, w, steps))
    source = jnp.where(latest >= 0, latest, jnp.where(first == steps, 0, first))
    at_source = w[None, :] == source[:, None]
    rows = [tile, local_group, _pick(at_source, tile), _pick(at_source, local_group), lo, hi, flags]
    return jnp.stack([r.astype(i32) for r in rows])


# The largest comparison matrix (elements) the dense table may build; above it the search.
DENSE_TABLE_MAX = 1 << 20


def gmm_visit_table(group_sizes, group_offset, *, m: int, tm: int, num_local: int) -> jax.Array:
    """gmm's visit table: ``gmm_schedule_dense`` where its comparison matrices are small
    (fewer XLA ops before the kernel: on the v5e, 2026-12-06, the table alone 0.122 ->
    0.118 ms and gmm G8 8192x2048x2048 0.392 -> 0.385 ms), ``gmm_schedule`` otherwise (its
    searches grow as n log n, the dense matrices as n^2)."""
    num_tiles = -(-m // tm)
    steps, groups = max_visits(num_tiles, num_local), group_sizes.shape[0]
    if max(steps, num_tiles, groups) * max(steps, groups) <= DENSE_TABLE_MAX:
        return gmm_schedule_dense(group_sizes, group_offset, m=m, tm=tm, num_local=num_local)
    return gmm_schedule(group_sizes, group_offset, m=m, tm=tm, num_local=num_local)
