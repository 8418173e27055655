"""The kernel bodies of ``gmm`` and ``tgmm`` and their ``pallas_call``s (``megablox.gmm``'s
docstring says how they work); the visit table they read comes from ``_schedule``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops.matmul._kernel import accumulate
from pallas_tpu.ops.megablox import _schedule as sched
from pallas_tpu.ops.megablox._blocks import vmem_bytes

# A visit of a tile that other groups share computes only the chunks of rows (of this many)
# its group has rows in: a group boundary costs at most one chunk twice, not a whole tile.
_CHUNK = 128


def _flag(value, bit):
    return (value & bit) != 0


def _chunk_rows(tm: int) -> int:
    """Rows per chunk of a tile that a partial visit computes chunk by chunk."""
    return _CHUNK if tm % _CHUNK == 0 else tm


def _for_each_chunk(lo, hi, size, body):
    """``body(rows)`` for each chunk of ``size`` rows (``rows``: a ``pl.ds``) that has rows
    in ``[lo, hi)``: one loop, so the kernel holds one copy of the chunk's code."""

    def step(c, carry):
        body(pl.ds(pl.multiple_of(c * size, size), size))
        return carry

    lax.fori_loop(lo // size, (hi + size - 1) // size, step, 0)


def _in_rows(shape, axis, rows, lo, hi):
    """Which elements of a chunk (``rows`` along ``axis``) lie in rows ``[lo, hi)`` of the tile."""
    row = lax.broadcasted_iota(jnp.int32, shape, axis) + rows.start
    return jnp.logical_and(row >= lo, row < hi)


class _Visit:
    """What a grid step reads of the visit table: its group's rows ``[lo, hi)`` in the tile and
    its flags; ``whole``: the group has every row of the tile (``tm`` of them)."""

    def __init__(self, table, step, tm, last_flag):
        flags, self.lo, self.hi = table[sched.FLAGS, step], table[sched.LO, step], table[sched.HI, step]
        self.computes, self.first = _flag(flags, sched.COMPUTE), _flag(flags, sched.FIRST)
        self.last_or_real = _flag(flags, last_flag)
        self.whole = jnp.logical_and(self.lo == 0, self.hi == tm)
        self.partial = jnp.logical_and(self.computes, jnp.logical_not(self.whole))


def _zero_overhang(lhs_ref, rhs_ref, k_tail, contract):
    """The last k block runs past k: zero the overhang of both blocks, in place (the same zeros
    for every visit that finds the block still in VMEM)."""
    a, b = lhs_ref[...], rhs_ref[...]
    lhs_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 1) < k_tail, a, jnp.zeros_like(a))
    b_k = lax.broadcasted_iota(jnp.int32, b.shape, contract)
    rhs_ref[...] = jnp.where(b_k < k_tail, b, jnp.zeros_like(b))


def _gmm_product(lhs_ref, rhs_ref, contract, widen, rows=slice(None)):
    a, b = lhs_ref[rows, :], rhs_ref[...]
    if widen is not None:
        a, b = a.astype(widen), b.astype(widen)
    return lax.dot_general(a, b, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32)


def _store_partial(out_ref, base, visit, chunk, chunk_value):
    """A tile shared with other groups: its first visit fills it from ``base()``, then each
    visit writes its group's rows, computing only the chunks it has rows in (a group boundary
    costs one chunk twice, not a whole tile)."""

    @pl.when(visit.first)
    def _fresh():
        out_ref[...] = base()

    def merge(rows):
        value = chunk_value(rows).astype(out_ref.dtype)
        mine = _in_rows(value.shape, 0, rows, visit.lo, visit.hi)
        out_ref[rows, :] = jnp.where(mine, value, out_ref[rows, :])

    _for_each_chunk(visit.lo, visit.hi, chunk, merge)


def _gmm_k_steps(visit, kk, last_k, out_ref, acc_ref, product, store_partial, chunk):
    """A tile over several k steps: its product accumulated in ``acc_ref``, stored on the last."""

    @pl.when(jnp.logical_and(visit.partial, kk == 0))
    def _init():  # a shared tile's chunks add into zeros
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(jnp.logical_and(visit.computes, visit.whole))
    def _add_whole():  # the first k step's product stored as it is (no zeroing pass)
        accumulate(acc_ref, product, kk == 0)

    def add_rows(rows):
        acc_ref[rows, :] += product(rows)

    pl.when(visit.partial)(lambda: _for_each_chunk(visit.lo, visit.hi, chunk, add_rows))

    @pl.when(jnp.logical_and(last_k, jnp.logical_and(visit.computes, visit.whole)))
    def _store_whole():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    pl.when(jnp.logical_and(last_k, visit.partial))(lambda: store_partial(lambda rows: acc_ref[rows, :]))


def _gmm_kernel(table, lhs_ref, rhs_ref, *refs, tm, tiles_k, k_tail, contract, widen, existing):
    existing_ref = refs[0] if existing else None
    out_ref = refs[1] if existing else refs[0]
    acc_ref = refs[-1] if tiles_k > 1 else None
    step, kk = pl.program_id(1), pl.program_id(2)
    visit = _Visit(table, step, tm, sched.REAL)
    last_k = kk == tiles_k - 1
    chunk = _chunk_rows(tm)
    if k_tail is not None:
        pl.when(jnp.logical_and(visit.computes, last_k))(
            lambda: _zero_overhang(lhs_ref, rhs_ref, k_tail, contract)
        )
    product = functools.partial(_gmm_product, lhs_ref, rhs_ref, contract, widen)

    def base():
        if existing_ref is not None:
            return existing_ref[...]
        return jnp.zeros(out_ref.shape, out_ref.dtype)

    store_partial = functools.partial(_store_partial, out_ref, base, visit, chunk)

    @pl.when(jnp.logical_and(jnp.logical_and(visit.last_or_real, jnp.logical_not(visit.computes)), last_k))
    def _untouched():  # no local group has rows here
        out_ref[...] = base()

    if tiles_k > 1:
        _gmm_k_steps(visit, kk, last_k, out_ref, acc_ref, product, store_partial, chunk)
        return

    @pl.when(jnp.logical_and(visit.computes, visit.whole))
    def _whole():
        out_ref[...] = product().astype(out_ref.dtype)

    pl.when(visit.partial)(lambda: store_partial(product))


def _tgmm_kernel(table, lhs_ref, rhs_ref, *refs, lhs_rows_first, widen, existing):
    existing_ref = refs[0] if existing else None
    out_ref, acc_ref = refs[-2], refs[-1]
    tm = rhs_ref.shape[0]
    visit = _Visit(table, pl.program_id(2), tm, sched.LAST)
    lo, hi = visit.lo, visit.hi
    row_axis = 0 if lhs_rows_first else 1  # where lhs's m axis is in its block

    def product(rows=slice(None), masked=False):
        """The tile's (or a chunk's) contribution: lhs and rhs contracted over their rows."""
        a = lhs_ref[rows, :] if lhs_rows_first else lhs_ref[:, rows]
        b = rhs_ref[rows, :]
        if masked:  # only the group's rows (the others belong to other groups)
            a = jnp.where(_in_rows(a.shape, row_axis, rows, lo, hi), a, jnp.zeros_like(a))
            b = jnp.where(_in_rows(b.shape, 0, rows, lo, hi), b, jnp.zeros_like(b))
        if widen is not None:
            a, b = a.astype(widen), b.astype(widen)
        return lax.dot_general(a, b, (((row_axis,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(visit.first)
    def _zero():  # (one product in the kernel's code, not one to set and one to add)
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(jnp.logical_and(visit.computes, visit.whole))
    def _add_whole():
        acc_ref[...] += product()

    def add_rows(rows):
        acc_ref[...] += product(rows, masked=True)

    pl.when(visit.partial)(lambda: _for_each_chunk(lo, hi, _chunk_rows(tm), add_rows))

    @pl.when(visit.last_or_real)
    def _store():
        total = acc_ref[...]
        if existing_ref is not None:
            total = total + existing_ref[...].astype(jnp.float32)
        out_ref[...] = total.astype(out_ref.dtype)


def _call(kernel, operands, existing_out, in_specs, out_spec, out_shape, *, grid, scratch, semantics, need,
          flops, bytes_accessed, name, info, interpret):  # fmt: skip
    """The ``pallas_call`` of gmm or tgmm over ``operands`` (the visit table, lhs, rhs), with
    ``existing_out`` (if given) read through the output's blocks and aliased to the output."""
    aliases = {}
    if existing_out is not None:
        in_specs, operands, aliases = [*in_specs, out_spec], [*operands, existing_out], {3: 0}
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_spec, scratch_shapes=scratch
        ),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics, vmem_limit_bytes=_policy.vmem_limit("megablox", need, info)
        ),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_accessed),
        interpret=interpret,
        name=name,
    )(*operands)


def gmm(table, lhs, rhs, existing_out, tiling, out_dtype, mxu, *, transpose_rhs, interpret, info):
    """``gmm``'s ``pallas_call`` over the visit ``table`` with tiles ``tiling``; ``mxu``: the
    dtype both operands meet the MXU in."""
    (m, k), num_local = lhs.shape, rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = tiling
    # A chosen tm may leave a partial last tile: its rows past m belong to no group.
    tiles_m, tiles_k, tiles_n = -(-m // tm), -(-k // tk), -(-n // tn)
    steps = table.shape[1]

    def fetch_k(step, kk, t):
        # Steps that compute nothing keep the blocks of the last step that did.
        computes = (t[sched.FLAGS, step] & sched.COMPUTE) != 0
        return jnp.where(computes, kk, tiles_k - 1)

    def lhs_index(j, step, kk, t):
        return t[sched.FETCH_TILE, step], fetch_k(step, kk, t)

    def rhs_index(j, step, kk, t):
        kb = fetch_k(step, kk, t)
        return (t[sched.FETCH_GROUP, step], j, kb) if transpose_rhs else (t[sched.FETCH_GROUP, step], kb, j)

    def out_index(j, step, kk, t):
        return t[sched.TILE, step], j

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    in_specs = [pl.BlockSpec((tm, tk), lhs_index), pl.BlockSpec(rhs_block, rhs_index)]
    existing = existing_out is not None
    kernel = functools.partial(
        _gmm_kernel, tm=tm, tiles_k=tiles_k, k_tail=k - (tiles_k - 1) * tk if k % tk else None,
        contract=1 if transpose_rhs else 0, widen=None if lhs.dtype == rhs.dtype == mxu else mxu,
        existing=existing,
    )  # fmt: skip
    need = vmem_bytes(tm, tk, tn, mxu.itemsize, out_dtype.itemsize, tiles_k=tiles_k, transposed=False,
                      existing=existing)  # fmt: skip
    rhs_loads = num_local if tiles_k == 1 else min(steps, tiles_m + num_local)
    moved = lhs.size * lhs.dtype.itemsize * tiles_n + k * n * rhs.dtype.itemsize * rhs_loads
    return _call(
        kernel, [table, lhs, rhs], existing_out, in_specs, pl.BlockSpec((tm, tn), out_index),
        jax.ShapeDtypeStruct((m, n), out_dtype), grid=(tiles_n, steps, tiles_k),
        scratch=[pltpu.VMEM((tm, tn), jnp.float32)] if tiles_k > 1 else [],
        semantics=("parallel", "arbitrary", "arbitrary"), need=need, flops=2 * m * k * n,
        bytes_accessed=moved + m * n * out_dtype.itemsize, name="gmm", info=info, interpret=interpret,
    )  # fmt: skip


def tgmm(
    table, lhs, rhs, existing_out, tiling, out_dtype, mxu, *, lhs_rows_first, num_local, interpret, info
):
    """``tgmm``'s ``pallas_call`` (``lhs`` ``[m, k]`` with ``lhs_rows_first``, else ``[k, m]``)."""
    m, k = lhs.shape if lhs_rows_first else lhs.shape[::-1]
    n = rhs.shape[1]
    tm, tk, tn = tiling
    tiles_k, tiles_n = -(-k // tk), -(-n // tn)

    def lhs_index(i, j, step, t):
        return (t[sched.FETCH_TILE, step], i) if lhs_rows_first else (i, t[sched.FETCH_TILE, step])

    def rhs_index(i, j, step, t):
        return t[sched.FETCH_TILE, step], j

    def out_index(i, j, step, t):
        return t[sched.GROUP, step], i, j

    lhs_block = (tm, tk) if lhs_rows_first else (tk, tm)
    in_specs = [pl.BlockSpec(lhs_block, lhs_index), pl.BlockSpec((tm, tn), rhs_index)]
    existing = existing_out is not None
    kernel = functools.partial(
        _tgmm_kernel, lhs_rows_first=lhs_rows_first, widen=None if lhs.dtype == rhs.dtype == mxu else mxu,
        existing=existing,
    )  # fmt: skip
    need = vmem_bytes(tm, tk, tn, mxu.itemsize, out_dtype.itemsize, tiles_k=tiles_k, transposed=True,
                      existing=existing)  # fmt: skip
    moved = lhs.size * lhs.dtype.itemsize * tiles_n + rhs.size * rhs.dtype.itemsize * tiles_k
    return _call(
        kernel, [table, lhs, rhs], existing_out, in_specs, pl.BlockSpec((None, tk, tn), out_index),
        jax.ShapeDtypeStruct((num_local, k, n), out_dtype), grid=(tiles_k, tiles_n, table.shape[1]),
        scratch=[pltpu.VMEM((tk, tn), jnp.float32)], semantics=("parallel", "parallel", "arbitrary"),
        need=need, flops=2 * m * k * n, bytes_accessed=moved + num_local * k * n * out_dtype.itemsize, name="tgmm", info=info,
        interpret=interpret,
    )  # fmt: skip
