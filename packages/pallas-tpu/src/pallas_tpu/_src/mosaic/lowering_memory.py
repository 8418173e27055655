"""Mosaic rules for memory: Ref reads and writes (``vector.load`` /
``tpu.vector_store`` in VMEM, ``memref.load/store`` of SMEM scalars),
``ref.at[...]`` views, scoped scratch, DMAs and semaphores.

Gathers (a Ref read indexed by an array, ``x_ref[idx]``, ``x_ref[idx, :]``)
have no Mosaic op: each gathered index is extracted from the index vector
(``vector.extract`` at a static position), its slice is read at that dynamic
start, and the pieces are stored into a VMEM scratch of the result (in a
``tpu.region``) that is read back whole. ``lax.dynamic_slice`` and
``dynamic_update_slice`` of values go through a VMEM scratch too: the value
is stored, the window read (written) at the clamped dynamic starts. Those
reads and writes, and strided views, take the forms Mosaic compiles
(``read_window``, ``write_window``: a dynamic start on a tiled dim that Mosaic
cannot prove aligned is a whole-extent access and a ``tpu.dynamic_rotate``)."""

from __future__ import annotations

import dataclasses
import string

import numpy as np
from jax import lax, tree_util
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import primitives as tpu_prims
from pallas_tpu._src.language import random as tpu_random
from pallas_tpu._src.mosaic.lowering import (
    BACKEND,
    BOOL_MEMORY_DTYPE,
    Aval,
    BlockRef,
    as_i32,
    aval_type,
    broadcast_to,
    constant,
    index,
    is_bool,
    is_float,
    is_smem,
    is_unsigned,
    lower_jaxpr,
    memref_type,
    ref_type,
    register_lowering,
    shape_cast,
    value_type,
)
from pallas_tpu._src.mosaic.lowering_math import BINARY


@dataclasses.dataclass
class Window:
    """One indexing of a Ref: per dim a start (int or value), a size, and
    whether the dim is dropped (an integer index)."""

    starts: list
    sizes: list[int]
    squeezed: list[bool]
    strides: list[int] | None = None  # None: all 1

    @property
    def strided(self) -> bool:
        return any(s != 1 for s in self.strides or ())

    @property
    def gather(self) -> bool:
        return any(_is_vector(s) for s in self.starts)


def _is_vector(v) -> bool:
    return isinstance(v, ir.Value) and isinstance(v.type, ir.VectorType)


_GATHER_REFUSED = (
    "an array-indexed view (ref.at[idx_array]) as a DMA, semaphore or call operand, or with "
    "views after it, is not supported: a Mosaic memref view has one start per dim; read or write "
    "ref[idx_array] (a gather) instead"
)


def window(indexer) -> Window:
    _, Slice = compat.indexing_types()
    starts, sizes, squeezed, strides = [], [], [], []
    for idx in indexer.indices:
        if isinstance(idx, Slice):
            starts.append(idx.start)
            sizes.append(idx.size if isinstance(idx.size, ir.Value) else int(idx.size))  # a value: traced
            squeezed.append(False)
            strides.append(int(idx.stride))
        else:
            starts.append(idx)  # an integer, a scalar, or an index vector (a gather)
            sizes.append(1)
            squeezed.append(True)
            strides.append(1)
    return Window(starts, sizes, squeezed, strides)


def _transforms(tree, leaves) -> list:
    """A Ref's transforms as views: a ``Window`` per ``.at[...]`` indexing, a
    shape tuple per ``.reshape(...)``."""
    NDIndexer, _ = compat.indexing_types()
    out = []
    for t in tree_util.tree_unflatten(tree, list(leaves)) if tree is not None else ():
        if isinstance(t, NDIndexer):
            out.append(window(t))
        elif isinstance(t, compat.ReshapeTransform):
            out.append(tuple(t.shape))
        else:
            raise NotImplementedError(f"Ref transform {type(t).__name__} is not supported ({BACKEND})")
    return out


def _whole(shape) -> Window:
    return Window([0] * len(shape), list(shape), [False] * len(shape))


def _views(ref, tree, leaves) -> tuple[ir.Value, list]:
    """The memref under ``ref`` and its views (``_transforms``); a
    ``BlockRef``'s squeezed dims become integer indices 0 of the first window."""
    views = _transforms(tree, leaves)
    if isinstance(ref, BlockRef):
        shape = [n for n, q in zip(ir.MemRefType(ref.memref.type).shape, ref.squeezed) if not q]
        first, rest = (
            (views[0], views[1:]) if views and isinstance(views[0], Window) else (_whole(shape), views)
        )
        dims = iter(zip(first.starts, first.sizes, first.squeezed, first.strides or [1] * len(first.sizes)))
        full = [(0, 1, True, 1) if q else next(dims) for q in ref.squeezed]
        views = [Window(*map(list, zip(*full))), *rest]
        ref = ref.memref
    return ref, views


def apply_view(ref: ir.Value, v) -> ir.Value:
    """A window of ``ref`` (``tpu.memref_slice`` + squeeze) or a reshape of it
    (``tpu.memref_reshape``), as a memref."""
    t = ir.MemRefType(ref.type)
    like = lambda shape: ir.MemRefType.get(list(shape), t.element_type, memory_space=t.memory_space)  # noqa: E731
    if not isinstance(v, Window):
        return tpu.memref_reshape(like(v), ref)
    if v.gather:
        raise NotImplementedError(_GATHER_REFUSED)
    if v.strided:
        raise NotImplementedError(
            "strided views (ref.at[pl.ds(..., stride=k)]) as a DMA, semaphore or call operand are not "
            "supported: a Mosaic memref view has no strides (tpu.memref_slice takes none); read or "
            "write the view (a strided load/store), or copy a contiguous window"
        )
    # A traced size (a DMA of emit_pipeline's pl.BoundedSlice block) is a dynamic dim.
    shape = [ir.ShapedType.get_dynamic_size() if isinstance(n, ir.Value) else n for n in v.sizes]
    dynamic = [as_i32(n) for n in v.sizes if isinstance(n, ir.Value)]
    out = tpu.memref_slice(like(shape), ref, [as_i32(s) for s in v.starts], dynamic)
    if any(v.squeezed):
        out = tpu.memref_squeeze(like([n for n, q in zip(shape, v.squeezed) if not q]), out)
    return out


def view(ref, leaves, tree, padded_shape=None, padded_tiling=None) -> ir.Value:
    """The memref of ``ref`` after all its transforms; ``padded_shape``: the
    last one, a window, widened to that shape (a DMA's ``padded_shape``);
    ``padded_tiling``: its sizes rounded up to those multiples (``padded_tiling``)."""
    ref, views = _views(ref, tree, leaves)
    if padded_shape is not None:
        views[-1] = _widened(views[-1] if views else None, padded_shape)
    if padded_tiling is not None:
        views[-1] = _rounded_up(views[-1] if views else None, padded_tiling)
    for v in views:
        ref = apply_view(ref, v)
    return ref


def _widened(w, shape) -> Window:
    """Window ``w`` with its kept dims' sizes widened to ``shape``."""
    if not isinstance(w, Window) or w.gather or w.strided:
        raise NotImplementedError("a DMA's padded_shape needs its views to end in a contiguous window")
    kept = [d for d, q in enumerate(w.squeezed) if not q]
    if len(kept) != len(shape) or any(shape[i] < w.sizes[d] for i, d in enumerate(kept)):
        raise NotImplementedError(f"a DMA's padded_shape {list(shape)} does not cover its window {w.sizes}")
    sizes = list(w.sizes)
    for i, d in enumerate(kept):
        sizes[d] = shape[i]
    return dataclasses.replace(w, sizes=sizes)


def _rounded_up(w, tiles) -> Window:
    """Window ``w`` with the size of its ``i``-th kept dim rounded up to a multiple of
    ``tiles[i]`` (a traced size: computed, and given to Mosaic as that multiple)."""
    if not isinstance(w, Window) or w.gather or w.strided:
        raise NotImplementedError("a DMA's padded_tiling needs its views to end in a contiguous window")
    kept = [d for d, q in enumerate(w.squeezed) if not q]
    if len(kept) != len(tiles):
        raise NotImplementedError(f"a DMA's padded_tiling {list(tiles)} does not match its window {w.sizes}")
    sizes = list(w.sizes)
    for d, t in zip(kept, tiles):
        n = sizes[d]
        if t == 1:
            continue
        if isinstance(n, int):
            sizes[d] = -(-n // t) * t
        else:
            up = arith.muli(arith.divsi(arith.addi(as_i32(n), as_i32(t - 1)), as_i32(t)), as_i32(t))
            sizes[d] = tpu.assume_multiple(up, t)
    return dataclasses.replace(w, sizes=sizes)


def _access(ref, tree, leaves):
    """(memref, window) of a read or write: the transforms before the last
    indexing become views; that one is the accessed window. Where a view is
    strided, it and the windows after it compose into the accessed window
    (one strided load/store: Mosaic has no strided memref view)."""
    ref, views = _views(ref, tree, leaves)
    if any(isinstance(n, ir.Value) for v in views if isinstance(v, Window) for n in v.sizes):
        raise NotImplementedError(
            "a read or write of a window of traced size (ref.at[pl.ds(start, n)] with n traced) is not "
            "supported: Mosaic vectors have static shapes (DMAs take such windows)"
        )
    first = len(views)
    while first and isinstance(views[first - 1], Window):
        first -= 1
    windows = views[first:]
    if any(isinstance(v, Window) and v.strided for v in views[:first]):
        raise NotImplementedError(
            "a reshape of a strided view (ref.at[pl.ds(..., stride=k)]) is not supported"
        )
    if not any(w.strided for w in windows[:-1]):
        first = len(views) - 1 if windows else len(views)
        windows = views[first:]
    for v in views[:first]:
        ref = apply_view(ref, v)
    if not windows:
        return ref, _whole(ir.MemRefType(ref.type).shape)
    last = windows[0]
    for w in windows[1:]:
        last = _compose(last, w)
    return ref, last


def _compose(outer: Window, inner: Window) -> Window:
    """``inner`` (a window of ``outer``'s result) as one window of ``outer``'s memref."""
    if outer.gather or inner.gather:
        raise NotImplementedError(_GATHER_REFUSED)
    dims = iter(zip(inner.starts, inner.sizes, inner.squeezed, inner.strides or [1] * len(inner.sizes)))
    out = []
    for s, q, k in zip(outer.starts, outer.squeezed, outer.strides or [1] * len(outer.sizes)):
        if q:
            out.append((s, 1, True, 1))
            continue
        s2, n2, q2, k2 = next(dims)
        if isinstance(s, int) and isinstance(s2, int):
            start = s + s2 * k
        else:
            start = arith.addi(index(s), arith.muli(index(s2), index(k)))
        out.append((start, n2, q2, k * k2))
    return Window(*map(list, zip(*out)))


def load(ctx, ref, ref_aval, tree, leaves, out_aval) -> ir.Value:
    if is_bool(out_aval.dtype):  # stored as int32
        mem = Aval(out_aval.shape, BOOL_MEMORY_DTYPE)
        x = load(ctx, ref, ref_aval, tree, leaves, mem)
        return arith.cmpi(arith.CmpIPredicate.ne, x, constant(0, out_aval.shape, BOOL_MEMORY_DTYPE))
    ref, w = _access(ref, tree, leaves)
    if w.gather:
        return _gather(ref, w, is_smem(ref_aval), out_aval)
    if is_smem(ref_aval):
        if out_aval.shape:
            raise NotImplementedError(
                f"reading a {list(out_aval.shape)} block from SMEM: SMEM holds scalars, read one element at a time"
            )
        return memref.load(ref, [index(s) for s in w.starts])
    _check_not_rank0(ref)
    if w.strided:
        v = _strided_read(ref, w, out_aval.dtype)
    else:
        v = read_window(ref, w.starts, w.sizes, out_aval.dtype)
    return shape_cast(v, out_aval.shape, out_aval.dtype)


# Gathers run one index at a time: more than this many is refused (the module grows with it).
MAX_GATHERED = 1024


def _gather(ref, w: Window, smem: bool, out_aval) -> ir.Value:
    """``ref[w]`` where some starts are index vectors (NumPy's advanced
    indexing: the index shape replaces the indexed dims where they are
    adjacent, else leads). Each index's slice is read as ``read_window`` reads
    a dynamic start."""
    int_dims = [d for d, q in enumerate(w.squeezed) if q]
    vectors = [s for s in w.starts if _is_vector(s)]
    batch = tuple(np.broadcast_shapes(*(tuple(ir.VectorType(v.type).shape) for v in vectors)))
    slices = [n for n, q in zip(w.sizes, w.squeezed) if not q]
    if int_dims == list(range(int_dims[0], int_dims[-1] + 1)):
        lead = sum(1 for d in range(int_dims[0]) if not w.squeezed[d])
    else:
        lead = 0
    out_shape = (*slices[:lead], *batch, *slices[lead:])
    if out_shape != tuple(out_aval.shape):
        raise NotImplementedError(f"a gather of shape {out_aval.shape} (expected {out_shape})")
    count = int(np.prod(batch))
    if count > MAX_GATHERED:
        raise NotImplementedError(
            f"a gather of {count} indices (at most {MAX_GATHERED}: each is one load); "
            "gather in a loop over smaller index blocks"
        )
    if smem and slices:
        raise NotImplementedError("gathering slices from SMEM: SMEM holds scalars, gather single elements")
    dtype = out_aval.dtype
    slot = (*slices[:lead], *(1 for _ in batch), *slices[lead:])
    region = tpu.RegionOp([value_type(out_shape, dtype)])
    with ir.InsertionPoint(region.body):
        scratch = memref.alloca(memref_type(out_shape, dtype, None), [], [])
        starts = [broadcast_to(s, batch) if _is_vector(s) else s for s in w.starts]
        for pos in np.ndindex(*batch):
            idx = [vector.extract(s, [], list(pos)) if _is_vector(s) else s for s in starts]
            if smem:
                piece = broadcast_to(memref.load(ref, [index(i) for i in idx]), slot)
            else:
                at = dataclasses.replace(w, starts=idx)
                piece = _strided_read(ref, at, dtype) if w.strided else read_window(ref, idx, w.sizes, dtype)
                piece = shape_cast(piece, slot, dtype)
            at = [*(0 for _ in slices[:lead]), *pos, *(0 for _ in slices[lead:])]
            tpu.vector_store(piece, scratch, [index(i) for i in at], strides=[])
        zeros = [index(0) for _ in out_shape]
        tpu.yield_([vector.load(value_type(out_shape, dtype), scratch, zeros)])
    return region.results[0]


def store(ctx, ref, ref_aval, tree, leaves, val, val_aval) -> None:
    if is_bool(val_aval.dtype):
        mem = Aval(val_aval.shape, BOOL_MEMORY_DTYPE)
        val = arith.extui(aval_type(mem), val)
        val_aval = mem
    ref, w = _access(ref, tree, leaves)
    if w.gather:
        raise NotImplementedError(
            "writing a Ref through an array index (a scatter, ref[idx_array] = v) is not supported; "
            "write the rows one at a time (ref[i] = v[j] in a loop)"
        )
    idx = [index(s) for s in w.starts]
    if is_smem(ref_aval):
        if val_aval.shape:
            raise NotImplementedError(
                f"writing a {list(val_aval.shape)} block to SMEM: SMEM holds scalars, write one element at a time"
            )
        memref.store(val, ref, idx)
        return
    _check_not_rank0(ref)
    val = shape_cast(val, w.sizes, val_aval.dtype)
    if w.strided:
        _strided_write(ref, w, val, val_aval.dtype)
    else:
        write_window(ref, w.starts, val, val_aval.dtype)


def _check_not_rank0(ref) -> None:
    if not ir.MemRefType(ref.type).shape:
        raise NotImplementedError(
            "reading or writing a rank-0 Ref in VMEM (a scratch of shape ()): Mosaic has no rank-0 "
            "vectors nor scalar accesses of VMEM; give it shape (1,), or put it in SMEM (pltpu.SMEM(()))"
        )


# ---------------------------------------------------------------------------
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
        w.strides[-1] == 1
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
    dims = [d for d, k in enumerate(w.strides) if k != 1]
    return dims, list(np.ndindex(*(w.sizes[d] for d in dims)))


def _strided_read(ref, w: Window, dtype) -> ir.Value:
    """A strided window: ``tpu.strided_load`` where Mosaic takes it, else its
    covering window read once and its rows (columns) picked into a scratch."""
    if _mosaic_strided(ref, w, dtype):
        return tpu.strided_load(value_type(w.sizes, dtype), ref, [index(s) for s in w.starts], w.strides)
    dims, picks = _strided_rows(w)
    if len(picks) > MAX_GATHERED:
        raise NotImplementedError(
            f"a strided read of {len(picks)} rows (at most {MAX_GATHERED}, one at a time)"
        )
    span = [(n - 1) * k + 1 for n, k in zip(w.sizes, w.strides)]
    whole = read_window(ref, w.starts, span, dtype)
    region = tpu.RegionOp([value_type(w.sizes, dtype)])
    with ir.InsertionPoint(region.body):
        out = memref.alloca(memref_type(w.sizes, dtype, None), [], [])
        for pos in picks:
            offsets, sizes, at = [0] * len(span), list(w.sizes), [0] * len(span)
            for d, j in zip(dims, pos):
                offsets[d], sizes[d], at[d] = j * w.strides[d], 1, j
            row = vector.extract_strided_slice(
                value_type(sizes, dtype), whole, offsets, sizes, [1] * len(sizes)
            )
            tpu.vector_store(row, out, [index(i) for i in at], strides=[])
        tpu.yield_([vector.load(value_type(w.sizes, dtype), out, [index(0) for _ in w.sizes])])
    return region.results[0]


def _strided_write(ref, w: Window, val, dtype) -> None:
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
            step = j * w.strides[d]
            starts[d] = s + step if isinstance(s, (int, np.integer)) else arith.addi(index(s), index(step))
        row = vector.extract_strided_slice(value_type(sizes, dtype), val, offsets, sizes, [1] * len(sizes))
        write_window(ref, starts, row, dtype)


# ---------------------------------------------------------------------------
# dynamic_slice / dynamic_update_slice of values (through a VMEM scratch)


def _clamped_starts(starts, shape, sizes) -> list:
    """``lax.dynamic_slice``'s starts: each clamped to ``[0, dim - size]`` (0
    where the size is the dim's)."""
    out = []
    for s, n, k in zip(starts, shape, sizes, strict=True):
        if k == n:
            out.append(0)
            continue
        out.append(arith.maxsi(arith.minsi(index(s), index(n - k)), index(0)))
    return out


def _through_scratch(x, aval, out_shape, body) -> ir.Value:
    """``body(scratch, dtype)`` in a ``tpu.region`` with a VMEM scratch holding
    ``x`` (of ``aval``; bools as int32 ``dtype``); returns its value of ``out_shape``."""
    dtype = BOOL_MEMORY_DTYPE if is_bool(aval.dtype) else aval.dtype
    if is_bool(aval.dtype):
        x = arith.extui(value_type(aval.shape, dtype), x)
    zeros = [index(0) for _ in aval.shape]
    region = tpu.RegionOp([value_type(out_shape, dtype)])
    with ir.InsertionPoint(region.body):
        scratch = memref.alloca(memref_type(aval.shape, dtype, None), [], [])
        tpu.vector_store(x, scratch, zeros, strides=[])
        tpu.yield_([body(scratch, dtype)])
    out = region.results[0]
    if is_bool(aval.dtype):
        out = arith.cmpi(arith.CmpIPredicate.ne, out, constant(0, out_shape, dtype))
    return out


def _as_2d(x, aval):
    """A 1-D value as ``(1, n)`` (Mosaic rotates and slices 2-D vectors), its aval, and the way back."""
    if len(aval.shape) != 1:
        return x, aval, lambda v, shape: v
    flat = Aval((1, *aval.shape), aval.dtype)
    return (
        shape_cast(x, flat.shape, aval.dtype),
        flat,
        lambda v, shape: shape_cast(v, shape, aval.dtype),
    )


@register_lowering(lax.dynamic_slice_p)
def _dynamic_slice(ctx, x, *starts, slice_sizes):
    """The value through a VMEM scratch, read at the clamped starts (``read_window``)."""
    aval = ctx.avals_in[0]
    if not aval.shape:
        return x
    n = len(aval.shape)
    sizes = tuple(slice_sizes)
    starts = _clamped_starts(starts[:n], aval.shape, sizes)
    x, aval2, back = _as_2d(x, aval)
    if len(aval2.shape) != n:
        starts, sizes = [0, *starts], (1, *sizes)
    read = lambda scratch, dtype: read_window(scratch, starts, sizes, dtype, limited=False)  # noqa: E731
    return back(_through_scratch(x, aval2, sizes, read), tuple(slice_sizes))


@register_lowering(lax.dynamic_update_slice_p)
def _dynamic_update_slice(ctx, x, update, *starts):
    """The value through a VMEM scratch, the update written at the clamped starts (``write_window``)."""
    aval, upd_aval = ctx.avals_in[:2]
    if not aval.shape:
        return update
    starts = _clamped_starts(starts, aval.shape, upd_aval.shape)
    x, aval2, back = _as_2d(x, aval)
    update, upd2, _ = _as_2d(update, upd_aval)
    if len(aval2.shape) != len(aval.shape):
        starts = [0, *starts]

    def body(scratch, dtype):
        upd = update
        if is_bool(upd_aval.dtype):
            upd = arith.extui(value_type(upd2.shape, dtype), upd)
        write_window(scratch, starts, upd, dtype, limited=False)
        return vector.load(value_type(aval2.shape, dtype), scratch, [index(0) for _ in aval2.shape])

    return back(_through_scratch(x, aval2, aval2.shape, body), aval.shape)


@register_lowering(compat.get_p)
def _get(ctx, ref, *leaves, tree):
    return load(ctx, ref, ctx.avals_in[0], tree, leaves, ctx.avals_out[0])


@register_lowering(compat.swap_p)
def _swap(ctx, ref, val, *leaves, tree):
    ref_aval, val_aval = ctx.avals_in[:2]
    old = None
    if not compat.is_drop_var(ctx.eqn.outvars[0]):
        old = load(ctx, ref, ref_aval, tree, leaves, ctx.avals_out[0])
    store(ctx, ref, ref_aval, tree, leaves, val, val_aval)
    return old


@register_lowering(compat.addupdate_p)
def _addupdate(ctx, ref, val, *leaves, tree):
    ref_aval, val_aval = ctx.avals_in[:2]
    old = load(ctx, ref, ref_aval, tree, leaves, val_aval)
    op = BINARY[lax.add_p][0 if is_float(val_aval.dtype) else 1]
    store(ctx, ref, ref_aval, tree, leaves, op(old, val), val_aval)
    return []


# ---------------------------------------------------------------------------
# Scoped scratch


def alloc(aval) -> ir.Value:
    """A scratch buffer for a Ref aval: ``tpu.sem_alloc`` for semaphores,
    ``memref.alloca`` otherwise."""
    t = ref_type(aval)
    if isinstance(aval.memory_space, plb.SemaphoreSpace):
        return tpu.sem_alloc(t)
    return memref.alloca(t, [], [])


@register_lowering(plb.run_scoped_p)
def _run_scoped(ctx, *consts, jaxpr, num_consts, **_):
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    scratch = inner.invars[num_consts:]
    region = tpu.RegionOp([aval_type(a) for a in ctx.avals_out])
    with ir.InsertionPoint(region.body):
        refs = [alloc(v.aval) for v in scratch]
        outs = lower_jaxpr(ctx.kernel, jaxpr, [*consts, *refs])
        tpu.yield_(outs)
    return list(region.results)


# ---------------------------------------------------------------------------
# Semaphores and DMAs


@register_lowering(plb.semaphore_signal_p)
def _semaphore_signal(ctx, sem, *rest, sem_tree, device_id_tree, device_id_type, has_core_index):
    n = sem_tree.num_leaves
    leaves, inc, extra = rest[:n], rest[n], list(rest[n + 1 :])
    core = extra.pop() if has_core_index else None
    device = logical_device_id(ctx, extra, device_id_tree, device_id_type)
    tpu.sem_signal(view(sem, leaves, sem_tree), inc, device_id=device, core_id=core)
    return []


@register_lowering(plb.semaphore_wait_p)
def _semaphore_wait(ctx, sem, *rest, sem_tree, decrement):
    if not decrement:
        raise NotImplementedError("pl.semaphore_wait(..., decrement=False) has no Mosaic equivalent")
    n = sem_tree.num_leaves
    tpu.sem_wait(view(sem, rest[:n], sem_tree), rest[n])
    return []


@register_lowering(plb.semaphore_read_p)
def _semaphore_read(ctx, sem, *leaves, sem_tree):
    return tpu.sem_read(view(sem, leaves, sem_tree))


@register_lowering(tpu_prims.get_barrier_semaphore_p)
def _barrier_semaphore(ctx):
    return tpu.sem_barrier(ref_type(ctx.avals_out[0]))


@register_lowering(plb.delay_p)
def _delay(ctx, nanos):
    tpu.delay(nanos)
    return []


@register_lowering(tpu_random.prng_seed_p)
def _prng_seed(ctx, *seeds):
    tpu.prng_set_seed_32(list(seeds))
    return []


@register_lowering(tpu_random.prng_random_bits_p)
def _prng_random_bits(ctx, *, shape):
    if len(shape) < 2:
        raise NotImplementedError("prng_random_bits needs a shape of rank >= 2 on the TPU")
    return [tpu.prng_random_bits(aval_type(ctx.avals_out[0]))]


@register_lowering(plb.debug_print_p)
def _debug_print(ctx, *args, fmt, **_):
    """``tpu.log`` of scalars (``{}`` placeholders become Mosaic's ``$s0``,
    ``$f1``...), or ``tpu.log_buffer`` of one array (``fmt`` ending in ``{}``)."""
    avals = ctx.avals_in
    if any(a.shape for a in avals):
        if len(avals) != 1 or not fmt.endswith("{}") or "{}" in fmt[:-2]:
            raise NotImplementedError(
                "pl.debug_print prints scalars, or one array with a format ending in {} (e.g. 'x: {}')"
            )
        region = tpu.RegionOp([])
        with ir.InsertionPoint(region.body):
            buf = memref.alloca(memref_type(avals[0].shape, avals[0].dtype, None), [], [])
            vector.store(args[0], buf, [index(0)] * len(avals[0].shape))
            tpu.log_buffer(buf, list(avals[0].shape), fmt[:-2])
            tpu.yield_([])
        return []
    pieces = list(string.Formatter().parse(fmt))
    formatted = any(field is not None for _, field, _, _ in pieces)
    if formatted:
        if any(np.dtype(a.dtype).itemsize != 4 or is_bool(a.dtype) for a in avals):
            raise TypeError("pl.debug_print with {} placeholders prints 32-bit ints and floats only")
        spec = ["f" if is_float(a.dtype) else "u" if is_unsigned(a.dtype) else "s" for a in avals]
        fmt = "".join(
            t + (f"${spec[i]}{i}" if f is not None else "") for i, (t, f, _, _) in enumerate(pieces)
        )
    tpu.log(list(args), fmt, formatted=formatted)
    return []


def _dma_operands(ctx, args, layout):
    """The DMA's memref views and its target's logical device id (None: local)."""
    parts = layout.split(args)
    trees = {"src": layout.src_tree, "dst": layout.dst_tree, "dst_sem": layout.dst_sem_tree}
    if layout.src_sem_tree is not None:
        trees["src_sem"] = layout.src_sem_tree
    padded = {"src": layout.padded_shape, "dst": layout.padded_shape}
    tiling = {"src": layout.padded_tiling, "dst": layout.padded_tiling}
    views = {k: view(*parts[k], trees[k], padded.get(k), tiling.get(k)) for k in trees}
    device = logical_device_id(ctx, parts["device_id"], layout.device_id_tree, layout.device_id_type)
    return views, device


@register_lowering(tpu_prims.dma_start_p)
def _dma_start(ctx, *args, layout, priority, add):
    if add:
        raise NotImplementedError("DMAs that add into the destination (add=True) are not supported")
    v, device = _dma_operands(ctx, args, layout)
    tpu.enqueue_dma(
        v["src"],
        v["dst"],
        target_semaphore=v["dst_sem"],
        source_semaphore=v.get("src_sem"),
        device_id=device,
        priority=priority or None,
    )
    return []


@register_lowering(tpu_prims.dma_wait_p)
def _dma_wait(ctx, *args, layout, which="dst", **_):
    """Waits as the running JAX's lowering does: ``tpu.wait_dma`` naming the
    whole copy (JAX 0.12+), else ``tpu.wait_dma2`` on the destination's
    semaphore, or for ``.wait_send()`` on the source's with src and dst
    swapped and device 0."""
    v, device = _dma_operands(ctx, args, layout)
    send = which == "send"
    if compat.emits_wait_dma():
        tpu.wait_dma(
            v["src"],
            v["dst"],
            not send,
            source_semaphore=v.get("src_sem"),
            target_semaphore=v["dst_sem"],
            device_id=device,
        )
    elif send:
        zero = as_i32(0)
        tpu.wait_dma2(v["src_sem"], v["dst"], v["src"], device_id=zero, core_id=zero)
    else:
        tpu.wait_dma2(v["dst_sem"], v["src"], v["dst"], device_id=device)
    return []


# ---------------------------------------------------------------------------
# Devices of a jax.shard_map mesh


def _mesh(ctx) -> tuple[tuple[str, int], ...]:
    if not ctx.kernel.mesh_axes:
        raise NotImplementedError(
            "the kernel addresses devices of a mesh, but is not lowered inside jax.shard_map over one"
        )
    return ctx.kernel.mesh_axes


def mesh_axis_index(ctx, name) -> ir.Value:
    """This device's index along mesh axis ``name``: (device_id // stride) % size."""
    axes = _mesh(ctx)
    names = [n for n, _ in axes]
    if name not in names:
        raise NotImplementedError(f"axis '{name}' is neither a grid axis nor an axis of the mesh {names}")
    k = names.index(name)
    stride = int(np.prod([s for _, s in axes[k + 1 :]], dtype=np.int64))
    return arith.remsi(arith.divsi(tpu.device_id(), as_i32(stride)), as_i32(axes[k][1]))


def logical_device_id(ctx, leaves, tree, device_id_type):
    """The logical (flat, row-major over the mesh) id of a device id given as
    ``pl.DeviceIdType.LOGICAL`` or as MESH coordinates (a tuple in mesh axis
    order, or a dict {axis: index} whose missing axes are this device's)."""
    if tree is None or not leaves:
        return None
    if device_id_type is plb.DeviceIdType.LOGICAL:
        return leaves[0]
    axes = _mesh(ctx)
    coords = tree_util.tree_unflatten(tree, list(leaves))
    if isinstance(coords, dict):
        coords = [coords[n] if n in coords else mesh_axis_index(ctx, n) for n, _ in axes]
    elif not isinstance(coords, (tuple, list)):
        coords = [coords]
    if len(coords) != len(axes):
        raise ValueError(f"device_id {coords} has {len(coords)} coordinates for the mesh {dict(axes)}")
    flat = None
    for c, (_, size) in zip(coords, axes):
        flat = c if flat is None else arith.addi(arith.muli(flat, as_i32(size)), c)
    return flat


@register_lowering(compat.axis_index_p)
def _axis_index(ctx, *, axis_name):
    return mesh_axis_index(ctx, axis_name)
