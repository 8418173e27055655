"""Reads and writes of a window of a VMEM memref in the forms Mosaic compiles:
``read_window`` / ``write_window`` (``vector.load`` / ``tpu.vector_store``; a
dynamic start on a tiled dim that Mosaic cannot prove aligned is a whole-extent
access and a ``tpu.dynamic_rotate``, up to ``MAX_WHOLE_EXTENT_BYTES``),
``is_multiple`` (the alignment proof), and ``strided_read`` / ``strided_write``
(``tpu.strided_load/store`` where Mosaic takes them, else row by row). The rules
that call them live in ``lowering_memory.py``."""

from __future__ import annotations

from typing import cast

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mosaic.python import tpu

from pallas_tpu._src.mosaic.lowering import (
    as_i32,
    broadcast_to,
    index,
    is_float,
    is_unsigned,
    memref_type,
    shape_cast,
    value_type,
)
from pallas_tpu._src.mosaic.lowering_views import Window

# Gathers run one index at a time: more than this many is refused (the module grows with it).
MAX_GATHERED = 1024


# Reads and writes at starts Mosaic cannot prove aligned
#
# Mosaic's vector loads and stores of VMEM take any start on the leading dims
# of a memref, and on its last two (tiled) dims a static start, or a dynamic
# one it proves a multiple of the memory tiling (constants, pl.multiple_of's
# tpu.assume_multiple, products and sums of those); 32-bit data in a memref
# one tile wide (last dim <= 128, never sliced along it) also takes any row.
# A start we prove a multiple of the tiling (``is_multiple``) is given to
# Mosaic as tpu.assume_multiple.
# What our rules make at other dynamic starts (a gather's indices, the clamped
# starts of lax.dynamic_slice, the rows of a strided view) is read as the
# whole extent of those dims rotated into place (tpu.dynamic_rotate) and
# written by rotating the value into place and selecting it into the extent.
# tpu.strided_load/store take a stride on the rows only, in a memref whose
# last dim is 128 (32-bit, lane start 0): other strided views are read as their
# covering window, picked row by row (column by column for a lane stride), and
# written one row (column) at a time.

_LANES = 128


def _tile(dtype) -> tuple[int, int]:
    """The (rows, lanes) of a VMEM memory tile of ``dtype`` (Mosaic's native tiling)."""
    return 8 * max(1, 4 // np.dtype(dtype).itemsize), _LANES


def _producer(v: ir.Value):
    owner = v.owner
    return owner if isinstance(owner, (ir.Operation, ir.OpView)) else None


# The forms Mosaic's own analysis (isGuaranteedDivisible) follows, in every release we meet.
_MOSAIC_PROVES = ("arith.constant", "tpu.assume_multiple", "arith.index_cast", "arith.muli", "arith.addi")


def is_multiple(v, n: int, fuel: int = 256, mosaic: bool = False) -> bool:
    """Whether index ``v`` is provably a multiple of ``n``: constants,
    ``tpu.assume_multiple`` (``pl.multiple_of``), products, sums, differences,
    selects, min/max and casts of those (``mosaic``: only the forms Mosaic
    proves itself; a start proved only here is given to it as ``tpu.assume_multiple``)."""
    if isinstance(v, (int, np.integer)):
        return int(v) % n == 0
    if n == 1:
        return True
    op = _producer(v)
    if op is None or fuel <= 0:
        return False
    op = getattr(op, "operation", op)
    name, args = op.name, list(op.operands)
    if mosaic and name not in _MOSAIC_PROVES:
        return False
    if name == "arith.constant":
        return ir.IntegerAttr(op.attributes["value"]).value % n == 0
    if name == "tpu.assume_multiple":
        return ir.IntegerAttr(op.attributes["multiple"]).value % n == 0 or (
            not mosaic and is_multiple(args[0], n, fuel - 1)
        )
    if name in ("arith.index_cast", "arith.extsi"):
        return is_multiple(args[0], n, fuel - 1, mosaic)
    if name == "arith.muli":
        return any(is_multiple(x, n, fuel // 2, mosaic) for x in args)
    if name in ("arith.addi", "arith.subi", "arith.minsi", "arith.maxsi"):
        return all(is_multiple(x, n, fuel // 2, mosaic) for x in args)
    if name == "arith.select":
        return all(is_multiple(x, n, fuel // 2, mosaic) for x in args[1:])
    return False


def _one_tile_wide(ref: ir.Value) -> bool:
    """Whether ``ref`` and every memref it is a view of are at most 128 wide."""
    while True:
        shape = ir.MemRefType(ref.type).shape
        if not shape or shape[-1] > _LANES:
            return False
        op = _producer(ref)
        op = getattr(op, "operation", op)
        if op is None or op.name not in ("tpu.memref_slice", "tpu.memref_squeeze"):
            return True
        ref = op.operands[0]


def _direct_start(ref, d: int, start, dtype):
    """``start`` as Mosaic takes it as the start of dim ``d`` of ``ref`` (a
    proved multiple of the tiling given as ``tpu.assume_multiple``), or None
    where it would refuse it."""
    rank = len(ir.MemRefType(ref.type).shape)
    if d < rank - 2 or isinstance(start, (int, np.integer)):
        return start
    if rank == 1:
        return None  # 1-D memrefs are tiled by a multiple of 128 lanes: read whole and rotated
    rows, lanes = _tile(dtype)
    if d == rank - 2 and np.dtype(dtype).itemsize == 4 and _one_tile_wide(ref):
        return start
    multiple = lanes if d == rank - 1 else rows
    if is_multiple(start, multiple, mosaic=True):
        return start
    return tpu.assume_multiple(as_i32(start), multiple) if is_multiple(start, multiple) else None


def _starts(ref, starts, sizes, dtype) -> tuple[list, set]:
    """The starts of a direct access to ``ref`` (0 on a whole dim, and on each
    dim Mosaic would refuse the start of: those are the set returned)."""
    shape = list(ir.MemRefType(ref.type).shape)
    at, whole = [], set()
    for d, (s, n) in enumerate(zip(starts, sizes)):
        direct = 0 if n == shape[d] else _direct_start(ref, d, s, dtype)
        if direct is None:
            whole.add(d)
        at.append(0 if direct is None else direct)
    return at, whole


def _to_32bit(v: ir.Value, dtype):
    """``v`` widened to 32 bits for a rotate (exactly), and the narrowing back."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 4:
        return v, lambda x: x
    shape = ir.VectorType(v.type).shape
    if is_float(dtype):
        wide = value_type(shape, np.float32)
        return arith.extf(wide, v), lambda x: arith.truncf(v.type, x)
    wide = value_type(shape, np.int32)
    ext = arith.extui if is_unsigned(dtype) else arith.extsi
    return ext(wide, v), lambda x: arith.trunci(v.type, x)


def _rotate(v: ir.Value, amounts: dict, dtype) -> ir.Value:
    """``v`` rolled by ``amounts[d]`` (an index) along each dim ``d`` (``jnp.roll``)."""
    shape = ir.VectorType(v.type).shape
    v, back = _to_32bit(v, dtype)
    for d, k in amounts.items():
        k = arith.remsi(arith.addi(index(k), index(shape[d])), index(shape[d]))  # in [0, n)
        v = tpu.dynamic_rotate(v, as_i32(k), d)
    return back(v)


# A whole-extent access of a kernel's Ref (not our scratch) is refused beyond
# this many bytes: reading a large block to pick a few rows would be silently slow.
MAX_WHOLE_EXTENT_BYTES = 256 * 1024


def _check_extent(ref, extent, dtype, starts, sizes, whole, limited) -> None:
    nbytes = int(np.prod(extent)) * np.dtype(dtype).itemsize
    if not limited or nbytes <= MAX_WHOLE_EXTENT_BYTES:
        return
    shape = list(ir.MemRefType(ref.type).shape)
    rows, lanes = _tile(dtype)
    dims = ", ".join(
        f"dim {d} ({'lanes, tiles of ' + str(lanes) if d == len(shape) - 1 else 'rows, tiles of ' + str(rows)})"
        for d in sorted(whole)
    )
    raise NotImplementedError(
        f"a window of {list(sizes)} of a Ref of shape {shape} at a dynamic start on {dims} that Mosaic "
        "cannot prove a multiple of the memory tiling: Mosaic loads and stores start tiled dims at "
        f"multiples of it, and reading the whole extent instead ({nbytes} bytes, more than "
        f"{MAX_WHOLE_EXTENT_BYTES}) is refused. Give the start as pl.multiple_of(start, tile) where it "
        "is one, keep 32-bit rows in a Ref at most 128 lanes wide (any row start), or copy the window "
        "with a DMA (pltpu.sync_copy)"
    )


def read_window(ref: ir.Value, starts, sizes, dtype, limited=True) -> ir.Value:
    """``ref[starts : starts + sizes]`` (a VMEM memref; starts are ints or
    scalars), a vector of ``sizes``, in a form Mosaic takes: a dim whose
    dynamic start it would refuse is read whole and rotated into place
    (``limited``: at most ``MAX_WHOLE_EXTENT_BYTES``)."""
    shape = list(ir.MemRefType(ref.type).shape)
    if len(shape) == 1:
        if (start := _direct_start(ref, 0, starts[0], dtype)) is not None or sizes[0] == shape[0]:
            return vector.load(value_type(sizes, dtype), ref, [index(0 if start is None else start)])
        _check_extent(ref, shape, dtype, starts, sizes, {0}, limited)
        whole = shape_cast(vector.load(value_type(shape, dtype), ref, [index(0)]), (1, shape[0]), dtype)
        v = _rotate(whole, {1: arith.subi(index(0), index(starts[0]))}, dtype)
        v = vector.extract_strided_slice(value_type((1, sizes[0]), dtype), v, [0, 0], [1, sizes[0]], [1, 1])
        return shape_cast(v, sizes, dtype)
    at, rotated = _starts(ref, starts, sizes, dtype)
    extent = [shape[d] if d in rotated else n for d, n in enumerate(sizes)]
    v = vector.load(value_type(extent, dtype), ref, [index(s) for s in at])
    if not rotated:
        return v
    _check_extent(ref, extent, dtype, starts, sizes, rotated, limited)
    v = _rotate(v, {d: arith.subi(index(0), index(starts[d])) for d in sorted(rotated)}, dtype)
    return vector.extract_strided_slice(
        value_type(sizes, dtype), v, [0] * len(sizes), list(sizes), [1] * len(sizes)
    )


def _merged(old, val, starts: dict, dtype) -> ir.Value:
    """``old`` with ``val`` written at ``starts[d]`` along each dim ``d`` of
    ``starts`` (at 0 along the others): ``val`` placed at the start of a
    scratch shaped like ``old``, rotated into place and selected."""
    extent = list(ir.VectorType(old.type).shape)
    sizes = list(ir.VectorType(val.type).shape)
    region = tpu.RegionOp([value_type(extent, dtype)])
    with ir.InsertionPoint(region.body):
        pad = memref.alloca(memref_type(extent, dtype, None), [], [])
        tpu.vector_store(val, pad, [index(0) for _ in extent], strides=[])
        tpu.yield_([vector.load(value_type(extent, dtype), pad, [index(0) for _ in extent])])
    new = _rotate(region.results[0], dict(sorted(starts.items())), dtype)
    inside = None
    for d, start in sorted(starts.items()):
        pos = tpu.iota(value_type(extent, np.int32), [d])
        lo = broadcast_to(as_i32(start), extent)
        hi = broadcast_to(arith.addi(as_i32(start), as_i32(sizes[d])), extent)
        m = arith.andi(
            arith.cmpi(arith.CmpIPredicate.sge, pos, lo), arith.cmpi(arith.CmpIPredicate.slt, pos, hi)
        )
        inside = m if inside is None else arith.andi(inside, m)
    return arith.select(inside, new, old)


def write_window(ref: ir.Value, starts, val: ir.Value, dtype, limited=True) -> None:
    """``ref[starts : starts + val.shape] = val`` in a form Mosaic takes: a dim
    whose dynamic start it would refuse is written whole (the value rotated
    into place and selected into what the extent holds; ``limited``: at most
    ``MAX_WHOLE_EXTENT_BYTES``)."""
    shape = list(ir.MemRefType(ref.type).shape)
    sizes = list(ir.VectorType(val.type).shape)
    if len(shape) == 1:
        if (start := _direct_start(ref, 0, starts[0], dtype)) is not None or sizes[0] == shape[0]:
            tpu.vector_store(val, ref, [index(0 if start is None else start)], strides=[])
            return
        _check_extent(ref, shape, dtype, starts, sizes, {0}, limited)
        old = shape_cast(vector.load(value_type(shape, dtype), ref, [index(0)]), (1, shape[0]), dtype)
        new = _merged(old, shape_cast(val, (1, sizes[0]), dtype), {1: starts[0]}, dtype)
        tpu.vector_store(shape_cast(new, shape, dtype), ref, [index(0)], strides=[])
        return
    at, moved = _starts(ref, starts, sizes, dtype)
    if not moved:
        tpu.vector_store(val, ref, [index(s) for s in at], strides=[])
        return
    extent = [shape[d] if d in moved else n for d, n in enumerate(sizes)]
    _check_extent(ref, extent, dtype, starts, sizes, moved, limited)
    old = vector.load(value_type(extent, dtype), ref, [index(s) for s in at])
    new = _merged(old, val, {d: starts[d] for d in moved}, dtype)
    tpu.vector_store(new, ref, [index(s) for s in at], strides=[])


def _mosaic_strided(ref, w: Window, dtype) -> bool:
    """Whether tpu.strided_load/store takes window ``w`` of ``ref``: 32-bit,
    rank >= 2, a memref 128 wide (never sliced along it), lane start 0, no lane stride."""
    shape = ir.MemRefType(ref.type).shape
    return (
        cast(list[int], w.strides)[-1] == 1  # a strided window has its strides
        and np.dtype(dtype).itemsize == 4
        and len(shape) >= 2
        and shape[-1] == _LANES
        and _one_tile_wide(ref)
        and isinstance(w.starts[-1], (int, np.integer))
        and int(w.starts[-1]) == 0
        and not any(w.squeezed)
    )


def _strided_rows(w: Window):
    """The strided dims of ``w`` and every combination of positions along them."""
    dims = [d for d, k in enumerate(cast(list[int], w.strides)) if k != 1]  # a strided window has its strides
    return dims, list(np.ndindex(*(w.sizes[d] for d in dims)))


def strided_read(ref, w: Window, dtype) -> ir.Value:
    """A strided window: ``tpu.strided_load`` where Mosaic takes it, else its
    covering window read once and its rows (columns) picked into a scratch."""
    if _mosaic_strided(ref, w, dtype):
        return tpu.strided_load(value_type(w.sizes, dtype), ref, [index(s) for s in w.starts], w.strides)
    dims, picks = _strided_rows(w)
    if len(picks) > MAX_GATHERED:
        raise NotImplementedError(
            f"a strided read of {len(picks)} rows (at most {MAX_GATHERED}, one at a time)"
        )
    strides = cast(list[int], w.strides)  # a strided window has its strides
    span = [(n - 1) * k + 1 for n, k in zip(w.sizes, strides)]
    whole = read_window(ref, w.starts, span, dtype)
    region = tpu.RegionOp([value_type(w.sizes, dtype)])
    with ir.InsertionPoint(region.body):
        out = memref.alloca(memref_type(w.sizes, dtype, None), [], [])
        for pos in picks:
            offsets, sizes, at = [0] * len(span), list(w.sizes), [0] * len(span)
            for d, j in zip(dims, pos):
                offsets[d], sizes[d], at[d] = j * strides[d], 1, j
            row = vector.extract_strided_slice(
                value_type(sizes, dtype), whole, offsets, sizes, [1] * len(sizes)
            )
            tpu.vector_store(row, out, [index(i) for i in at], strides=[])
        tpu.yield_([vector.load(value_type(w.sizes, dtype), out, [index(0) for _ in w.sizes])])
    return region.results[0]


def strided_write(ref, w: Window, val, dtype) -> None:
    """A strided window written: ``tpu.strided_store`` where Mosaic takes it,
    else one row (column) at a time (``write_window``)."""
    if _mosaic_strided(ref, w, dtype):
        tpu.strided_store(val, ref, [index(s) for s in w.starts], w.strides)
        return
    dims, picks = _strided_rows(w)
    if len(picks) > MAX_GATHERED:
        raise NotImplementedError(
            f"a strided write of {len(picks)} rows (at most {MAX_GATHERED}, one at a time)"
        )
    for pos in picks:
        offsets, sizes, starts = [0] * len(w.sizes), list(w.sizes), list(w.starts)
        for d, j in zip(dims, pos):
            offsets[d], sizes[d] = j, 1
            s = w.starts[d]
            step = j * cast(list[int], w.strides)[d]  # a strided window has its strides
            starts[d] = s + step if isinstance(s, (int, np.integer)) else arith.addi(index(s), index(step))
        row = vector.extract_strided_slice(value_type(sizes, dtype), val, offsets, sizes, [1] * len(sizes))
        write_window(ref, starts, row, dtype)
