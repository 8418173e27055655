"""Grouped matrix multiplication kernels for the TensorCore: ``gmm`` and
``tgmm``, with the call signatures of JAX's ``megablox.gmm`` module.

``gmm``: ``out[rows of g] = lhs[rows of g] @ rhs[g]`` for the groups of
``group_sizes`` (rows sorted by group). Grid ``(n tiles, visits, k steps)``:
each visit (``schedule.gmm_schedule``) is a ``(row tile, group)`` pair; a
tile shared by several groups is visited once per group in a row, so its
output block stays in VMEM between the visits. A tile wholly inside one
group (the usual case) is one product stored as it is; a shared tile's visit
computes only the 128-row chunks its group has rows in and merges those rows,
so a group boundary costs one chunk twice, not a whole tile.

``tgmm``: ``out[g] = lhs[:, rows of g] @ rhs[rows of g]``, the weight gradient.
Grid ``(k tiles, n tiles, visits)``, visits in group order; the group's
``(tk, tn)`` result accumulates in an f32 VMEM scratch over its tiles (a
shared tile: over the chunks with the group's rows, masked) and is written
when the group's last visit ends.

Operands go to the MXU in their own dtype (bf16 straight in) with f32
accumulation; a ``k`` or ``n`` that the tile does not divide is handled in
the kernel (the k overhang zeroed on the last step), as is an ``m`` that
``tm`` does not divide when the tiling is chosen here. ``tiling=None``
chooses tiles (``choose_tiling``): rows per tile near the mean group size,
k and n as whole as the VMEM budget allows, so that a group's rhs panel is
loaded once per group and ``lhs`` once per n tile.

The modules (the skeleton of every family, ``pallas_tpu.ops``' docstring): ``gmm`` (this one),
``ops`` and ``common`` the API with JAX's names; ``_kernel`` the kernel bodies and their
``pallas_call``s, ``_schedule`` the visit tables they read; ``_blocks`` the tile choice; the
reference is ``jax.lax.ragged_dot``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tpu as pltpu
from pallas_tpu.ops.megablox import _kernel
from pallas_tpu.ops.megablox import _schedule as sched
from pallas_tpu.ops.megablox._blocks import choose_tiling as choose_tiling

# The API (``LutFn``, a type, is JAX's too; ``transposed_gmm`` and ``local_rows`` serve ``ops``).
__all__ = ["gmm", "tgmm", "make_group_metadata", "choose_tiling", "GMM_TABLE"]

# A tiling function: ``(m, k, n) -> (tm, tk, tn)``, or None for the chosen tiles.
LutFn = Callable[[int, int, int], "tuple[int, int, int] | None"]
# What computes gmm's visit table (equal tables): ``_schedule.gmm_visit_table`` (dense
# comparisons where small, else searches); the benchmark's candidates set one of them.
GMM_TABLE = sched.gmm_visit_table

_LANE = 128


# ----------------------------------------------------------------- validation


def _fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def _check_operand(op: str, name: str, x, ndim: int, layout: str):
    if not hasattr(x, "ndim") or x.ndim != ndim:
        _fail(op, f"'{name}' must be a {ndim}-d array {layout}, got shape {getattr(x, 'shape', x)}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        _fail(op, f"'{name}' must be bfloat16 or float32, got {x.dtype}")


def _check_group_sizes(op: str, group_sizes, num_local: int):
    if not hasattr(group_sizes, "ndim") or group_sizes.ndim != 1:
        _fail(
            op,
            f"'group_sizes' must be a 1-d int32 array, got shape {getattr(group_sizes, 'shape', group_sizes)}",
        )
    if group_sizes.dtype != jnp.int32:
        _fail(op, f"'group_sizes' must be int32, got {group_sizes.dtype}")
    if group_sizes.shape[0] < max(num_local, 1):
        _fail(
            op, f"'group_sizes' has {group_sizes.shape[0]} groups, fewer than the {num_local} computed here"
        )


def _check_concrete_group_sizes(op: str, group_sizes):
    """Refuses negative group sizes when they are known (not traced): under a trace a
    negative size counts as 0 rows (the groups after it start where the sizes before it end)."""
    if isinstance(group_sizes, jax.core.Tracer) or not hasattr(group_sizes, "ndim"):
        return
    sizes = np.asarray(group_sizes)
    if sizes.ndim == 1 and sizes.size and sizes.min() < 0:
        bad = int(np.argmax(sizes < 0))
        _fail(op, f"'group_sizes' must be >= 0 (rows per group), got {int(sizes[bad])} for group {bad}")


def _group_offset(op: str, group_offset):
    if group_offset is None:
        return jnp.zeros((), jnp.int32)
    group_offset = jnp.asarray(group_offset)
    if group_offset.shape:
        _fail(op, f"'group_offset' must be a ()-shaped int32 array, got shape {group_offset.shape}")
    if not jnp.issubdtype(group_offset.dtype, jnp.integer):
        _fail(op, f"'group_offset' must be an integer, got {group_offset.dtype}")
    return group_offset.astype(jnp.int32)


def _check_existing(op: str, existing_out, shape, dtype):
    if existing_out is None:
        return
    if tuple(existing_out.shape) != tuple(shape):
        _fail(
            op, f"'existing_out' must have the output's shape {tuple(shape)}, got {tuple(existing_out.shape)}"
        )
    if existing_out.dtype != np.dtype(dtype):
        _fail(
            op,
            f"'existing_out' dtype {existing_out.dtype} must match preferred_element_type {np.dtype(dtype)}",
        )


def _check_tiling(op: str, tiling, m: int, k: int, n: int):
    if len(tiling) != 3 or not all(isinstance(t, (int, np.integer)) and t > 0 for t in tiling):
        _fail(op, f"'tiling' must be three positive ints (tm, tk, tn), got {tiling!r}")
    tm, tk, tn = (int(t) for t in tiling)
    if m % tm:
        _fail(op, f"'tiling' tm={tm} does not divide the {m} rows of m")
    if tm % 8 and tm != m:
        _fail(op, f"'tiling' tm={tm} must be a multiple of 8 (or all {m} rows)")
    for name, t, dim in (("tk", tk, k), ("tn", tn, n)):
        if t % _LANE and t != dim:
            _fail(
                op,
                f"'tiling' {name}={t} must be a multiple of {_LANE} (or all {dim} of its dimension): "
                f"it is the lane (last) dimension of a block, which Mosaic lays out in 128-lane tiles "
                f"and refuses otherwise on a TPU (JAX's op runs such a tiling only in interpret mode); "
                f"use {name}={-(-t // _LANE) * _LANE} (a {name} that does not divide {dim} is fine) or "
                f"tiling=None",
            )
    return tm, tk, tn


def local_rows(group_sizes, group_offset, num_local: int, m: int):
    """``[m, 1]``: the rows of groups ``group_offset .. group_offset + num_local - 1``
    (``group_offset`` None: from group 0)."""
    offset = jnp.zeros((), jnp.int32) if group_offset is None else group_offset
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    last = group_sizes.shape[0] - 1
    lo = starts[jnp.minimum(offset, last)]
    hi = ends[jnp.minimum(offset + num_local - 1, last)]
    rows = jnp.arange(m)[:, None]
    return (rows >= lo) & (rows < hi)


# --------------------------------------------------------------- tile choice


def _mxu_dtype(lhs, rhs, info):
    if lhs.dtype == rhs.dtype == jnp.bfloat16 and info.is_matmul_supported(jnp.bfloat16, jnp.bfloat16):
        return np.dtype(jnp.bfloat16)
    return np.dtype(np.float32)


def _resolve_tiling(op, tiling, m, k, n, num_groups, in_dtype, out_dtype, *, transposed, existing, info):
    if callable(tiling):
        tiling = tiling(m, k, n)
    if tiling is None:
        return choose_tiling(
            m, k, n, num_groups, in_dtype, out_dtype, transposed=transposed, existing=existing, info=info
        )
    return _check_tiling(op, tiling, m, k, n)


# ----------------------------------------------------------------- the ops


def _without_kernel(m, k, n, out_dtype, existing_out, group_sizes, offset, num_local):
    """``gmm`` of an empty dimension: the empty result (or ``existing_out``, as it is); ``k`` =
    0, an empty sum: the local groups' rows are zeros."""
    base = jnp.zeros((m, n), out_dtype) if existing_out is None else existing_out
    if 0 in (m, n):
        return base
    return jnp.where(local_rows(group_sizes, offset, num_local, m), jnp.zeros((), out_dtype), base)


@functools.partial(
    jax.jit, static_argnames=["preferred_element_type", "tiling", "transpose_rhs", "interpret"]
)
def _gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type: jax.typing.DTypeLike = jnp.float32,
    tiling: tuple[int, int, int] | LutFn | None = None,
    group_offset: jax.Array | None = None,
    existing_out: jax.Array | None = None,
    transpose_rhs: bool = False,
    interpret=False,
) -> jax.Array:
    """``lhs[rows of g] @ rhs[g]`` for each group ``g`` of ``group_sizes``.

    Args:
      lhs: ``[m, k]``, bfloat16 or float32, rows sorted by group.
      rhs: ``[num_local_groups, k, n]`` (``[num_local_groups, n, k]`` with
        ``transpose_rhs``): the weights of groups ``group_offset ..
        group_offset + num_local_groups - 1``.
      group_sizes: ``[num_groups]`` int32, rows per group (all groups, local or not), each
        >= 0: a negative size raises ``ValueError`` when the sizes are concrete; under a
        trace it counts as 0 rows (JAX's op lets it move the later groups' rows instead).
      preferred_element_type: the output dtype.
      tiling: ``(tm, tk, tn)``, a function ``(m, k, n) -> (tm, tk, tn) | None``,
        or None (chosen here, as is a function's None; JAX's op defaults to
        ``(128, 128, 128)`` and refuses a function's None). ``tm`` must divide m; ``tk``
        and ``tn`` must be multiples of 128 (or the whole dimension) and need not divide it.
      group_offset: ``()`` int32, the first group ``rhs`` holds (rhs sharded over groups).
      existing_out: ``[m, n]`` of ``preferred_element_type``: rows outside the local
        groups are taken from it (and its buffer is reused) instead of zeros.
      transpose_rhs: ``rhs`` is ``[groups, n, k]``.
      interpret: run in interpret mode (``True``, or ``pltpu.InterpretParams()``).

    Returns:
      ``[m, n]`` of ``preferred_element_type``; rows of no local group are zeros
      (or ``existing_out``'s). ``m``, ``n`` or ``k`` of 0 runs no kernel (``k`` = 0: the
      local groups' rows are zeros).
    """
    op = "gmm"
    _check_operand(op, "lhs", lhs, 2, "[m, k]")
    _check_operand(op, "rhs", rhs, 3, "[groups, n, k]" if transpose_rhs else "[groups, k, n]")
    num_local = rhs.shape[0]
    _check_group_sizes(op, group_sizes, num_local)
    offset = _group_offset(op, group_offset)
    m, k = lhs.shape
    n, rhs_k = (rhs.shape[1], rhs.shape[2]) if transpose_rhs else (rhs.shape[2], rhs.shape[1])
    if rhs_k != k:
        _fail(
            op, f"'lhs' [m, k]={list(lhs.shape)} and 'rhs' {list(rhs.shape)} disagree on k ({k} != {rhs_k})"
        )
    out_dtype = np.dtype(preferred_element_type)
    _check_existing(op, existing_out, (m, n), out_dtype)
    if 0 in (m, n, k):
        return _without_kernel(m, k, n, out_dtype, existing_out, group_sizes, offset, num_local)
    info = pltpu.get_tpu_info()
    mxu = _mxu_dtype(lhs, rhs, info)
    existing = existing_out is not None
    tm, tk, tn = _resolve_tiling(
        op,
        tiling,
        m,
        k,
        n,
        group_sizes.shape[0],
        mxu,
        out_dtype,
        transposed=False,
        existing=existing,
        info=info,
    )
    table = GMM_TABLE(group_sizes, offset, m=m, tm=tm, num_local=num_local)
    return _kernel.gmm(
        table, lhs, rhs, existing_out, (tm, tk, tn), out_dtype, mxu, transpose_rhs=transpose_rhs,
        interpret=interpret, info=info,
    )  # fmt: skip


def transposed_gmm(
    lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, num_actual_groups, existing_out,
    interpret, *, lhs_rows_first: bool,
):  # fmt: skip
    """``tgmm`` with ``lhs`` either ``[k, m]`` (``tgmm``'s layout) or ``[m, k]``
    (``lhs_rows_first``: the forward's lhs as it is, contracted over its rows in VMEM,
    which spares the backward pass a transpose of it in HBM)."""
    op = "tgmm"
    _check_operand(op, "lhs", lhs, 2, "[m, k]" if lhs_rows_first else "[k, m]")
    _check_operand(op, "rhs", rhs, 2, "[m, n]")
    num_groups = group_sizes.shape[0] if hasattr(group_sizes, "shape") and group_sizes.ndim == 1 else 0
    num_local = num_groups if num_actual_groups is None else int(num_actual_groups)
    _check_group_sizes(op, group_sizes, num_local)
    if num_local < 1:
        _fail(op, f"'num_actual_groups' must be at least 1, got {num_actual_groups}")
    offset = _group_offset(op, group_offset)
    m, k = lhs.shape if lhs_rows_first else lhs.shape[::-1]
    if rhs.shape[0] != m:
        _fail(
            op,
            f"'lhs' {list(lhs.shape)} and 'rhs' [m, n]={list(rhs.shape)} disagree on m ({m} != {rhs.shape[0]})",
        )
    n = rhs.shape[1]
    out_dtype = np.dtype(preferred_element_type)
    _check_existing(op, existing_out, (num_local, k, n), out_dtype)
    if 0 in (m, k, n):  # no rows (an empty sum: zeros) or an empty result
        return jnp.zeros((num_local, k, n), out_dtype) if existing_out is None else existing_out
    info = pltpu.get_tpu_info()
    mxu = _mxu_dtype(lhs, rhs, info)
    tiles = _resolve_tiling(
        op, tiling, m, k, n, num_groups, mxu, out_dtype, transposed=True, existing=existing_out is not None,
        info=info,
    )  # fmt: skip
    table = sched.tgmm_schedule(group_sizes, offset, m=m, tm=tiles[0], num_local=num_local)
    return _kernel.tgmm(
        table, lhs, rhs, existing_out, tiles, out_dtype, mxu, lhs_rows_first=lhs_rows_first,
        num_local=num_local, interpret=interpret, info=info,
    )  # fmt: skip


@functools.partial(
    jax.jit, static_argnames=["preferred_element_type", "tiling", "num_actual_groups", "interpret"]
)
def _tgmm(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, preferred_element_type: jax.typing.DTypeLike = jnp.float32,
    tiling: tuple[int, int, int] | LutFn | None = None, group_offset: jax.Array | None = None,
    num_actual_groups: int | None = None, existing_out: jax.Array | None = None, interpret=False,
) -> jax.Array:  # fmt: skip
    """``lhs[:, rows of g] @ rhs[rows of g]`` for each local group ``g``.

    Args:
      lhs: ``[k, m]``, bfloat16 or float32.
      rhs: ``[m, n]``, rows sorted by group.
      group_sizes: ``[num_groups]`` int32, rows per group, each >= 0 (as ``gmm``'s).
      preferred_element_type: the output dtype.
      tiling: ``(tm, tk, tn)``, a function ``(m, k, n) -> (tm, tk, tn) | None``,
        or None (chosen here; JAX's op defaults to ``(128, 128, 128)``). ``tm`` must divide m.
      group_offset: ``()`` int32, the first group computed.
      num_actual_groups: how many groups from ``group_offset`` (default all).
      existing_out: ``[num_actual_groups, k, n]``, added to the result (its buffer reused).
      interpret: run in interpret mode (``True``, or ``pltpu.InterpretParams()``).

    Returns:
      ``[num_actual_groups, k, n]`` of ``preferred_element_type``; an empty group's
      slice is zeros (plus ``existing_out``).
    """
    return transposed_gmm(
        lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, num_actual_groups,
        existing_out, interpret, lhs_rows_first=False,
    )  # fmt: skip


def _refusing_negative_sizes(op: str, jitted):
    """``jitted`` (JAX's signature and docstring) after refusing concrete negative group sizes,
    which a trace cannot see; ``__wrapped__``: the traced function, for a fresh trace."""

    @functools.wraps(jitted.__wrapped__)
    def call(*args, **kwargs):
        _check_concrete_group_sizes(op, args[2] if len(args) > 2 else kwargs.get("group_sizes"))
        return jitted(*args, **kwargs)

    call.__name__ = call.__qualname__ = op
    return call


gmm = _refusing_negative_sizes("gmm", _gmm)
tgmm = _refusing_negative_sizes("tgmm", _tgmm)


def make_group_metadata(
    *,
    group_sizes: jax.Array,
    m: int,
    tm: int,
    start_group: jax.Array,
    num_nonzero_groups: int,
    visit_empty_groups: bool = True,
):
    """JAX's grouped-matmul metadata (``megablox.gmm.make_group_metadata``), for callers that
    build their own grid; ``gmm`` and ``tgmm`` here use ``schedule``'s visit tables instead.

    Args:
      group_sizes: ``int32[num_groups]``, rows per group (rows sorted by group).
      m: the rows of ``lhs``; tm: rows per tile (must divide ``m``).
      start_group: the first group computed (``rhs`` sharded over groups).
      num_nonzero_groups: how many groups from ``start_group`` are computed.
      visit_empty_groups: give an empty group one visit (``tgmm`` must zero its output).

    Returns:
      ``((group_offsets, group_ids, m_tile_ids), num_tiles)``: ``group_offsets``
      ``int32[num_groups + 1]``, the first row of each group and ``m`` last;
      ``group_ids`` and ``m_tile_ids``, ``int32[m // tm + num_groups - 1]``, the group and
      row tile of each grid visit (a tile shared by groups visited once per group, in
      order), rotated so that the visits of ``start_group`` on come first (the array's
      unused tail repeats its last entry before the rotation); ``num_tiles``: the visits
      of groups ``start_group .. start_group + num_nonzero_groups - 1``.
    """
    if tm <= 0 or m % tm:
        _fail("make_group_metadata", f"tm={tm} must be a positive divisor of m={m}")
    sizes = jnp.asarray(group_sizes, jnp.int32)
    num_groups = sizes.shape[0]
    tiles_m = m // tm
    length = tiles_m + num_groups - 1
    ends = jnp.cumsum(sizes, dtype=jnp.int32)
    starts = ends - sizes
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    empty = sizes == 0
    # The tiles a group's rows touch: from the tile of its first row to the tile of its last.
    first_tile, end_tile = starts // tm, (ends + tm - 1) // tm
    tiles = jnp.where(empty, 1 if visit_empty_groups else 0, end_tile - first_tile)
    group_ids = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), tiles, total_repeat_length=length)
    # A tile is visited once, plus once for each group starting inside it (not on its first
    # row), plus (visit_empty_groups) once for each empty group at it.
    extra = jnp.where(empty, visit_empty_groups, starts % tm != 0)
    extra = extra & (first_tile < tiles_m)
    visits = 1 + jnp.zeros((tiles_m,), jnp.int32).at[jnp.where(extra, first_tile, tiles_m)].add(
        1, mode="drop"
    )
    m_tile_ids = jnp.repeat(jnp.arange(tiles_m, dtype=jnp.int32), visits, total_repeat_length=length)
    shift = jnp.sum(group_ids < start_group)
    group_ids = jnp.roll(group_ids, -shift)
    m_tile_ids = jnp.roll(m_tile_ids, -shift)
    groups = jnp.arange(num_groups, dtype=jnp.int32)
    mine = (groups >= start_group) & (groups < start_group + num_nonzero_groups)
    return (offsets, group_ids, m_tile_ids), jnp.sum(jnp.where(mine, tiles, 0))
