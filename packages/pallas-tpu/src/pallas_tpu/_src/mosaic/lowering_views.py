"""Ref views for Mosaic: a Ref's transforms (``ref.at[...]`` indexings, each a
``Window``; ``.reshape(...)``) and a ``BlockRef``'s squeezed dims, turned into
the memref an op takes (``view``: ``tpu.memref_slice`` + ``tpu.memref_squeeze``,
``tpu.memref_reshape``, ``tpu.memref_bitcast`` for ``.bitcast(dtype)``, ``tpu.memref_pad`` for
``pl.pad_ref``; a DMA's ``padded_shape`` and ``padded_tiling`` widen its
last window), or into the memref and the one window a read or write accesses
(``access``: a strided view and the windows after it compose into one strided
window). Array-indexed windows (gathers) and strided windows are refused as
memref views: ``lowering_memory.py`` reads them."""

from __future__ import annotations

import dataclasses

import numpy as np
from jax import tree_util
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.mosaic.lowering import (
    BACKEND,
    BlockRef,
    as_i32,
    element_type,
    index,
)
from pallas_tpu._src.mosaic.lowering_jax012 import needs_jax


@dataclasses.dataclass
class Window:
    """One indexing of a Ref: per dim a start (int or value), a size, and
    whether the dim is dropped (an integer index)."""

    starts: list
    sizes: list  # ints, or an ir.Value for a traced size
    squeezed: list[bool]
    strides: list[int] | None = None  # None: all 1

    @property
    def strided(self) -> bool:
        return any(s != 1 for s in self.strides or ())

    @property
    def gather(self) -> bool:
        return any(is_vector(s) for s in self.starts)


@dataclasses.dataclass(frozen=True)
class Bitcast:
    """``ref.bitcast(dtype)``: the same memory read as ``dtype``. A change of
    element width changes the second-to-last dimension (``(16, 128)`` int32 is
    ``(32, 128)`` bfloat16: Mosaic packs rows along the sublanes), JAX's rule."""

    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class Pad:
    """``pl.pad_ref(ref, shape)``: the Ref seen with the larger ``shape``, padded at
    the end of each dimension (``tpu.memref_pad``, as JAX 0.12.1's lowering)."""

    shape: tuple[int, ...]


def _bits(el: ir.Type) -> int:
    if isinstance(el, ir.IntegerType):
        return ir.IntegerType(el).width
    return ir.FloatType(el).width


def is_vector(v) -> bool:
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
    out: list = []
    for t in tree_util.tree_unflatten(tree, list(leaves)) if tree is not None else ():
        if isinstance(t, NDIndexer):
            out.append(window(t))
        elif isinstance(t, compat.ReshapeTransform):
            out.append(tuple(t.shape))
        elif isinstance(t, compat.BitcastTransform):
            out.append(Bitcast(np.dtype(t.dtype)))
        elif isinstance(t, plb.PadTransform):
            out.append(Pad(tuple(t.shape)))
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
        _check_bitcasts(ref, rest)
        ref = ref.memref
    return ref, views


def _check_bitcasts(ref: BlockRef, views) -> None:
    """JAX's refusal: a bitcast that changes the element width packs along the
    block's second-to-last dimension, which a block squeezing it (``None`` in
    ``block_shape[-2]``) does not have (the kernel's Ref shows another dim there)."""
    if len(ref.squeezed) < 2 or not ref.squeezed[-2]:
        return
    bits = _bits(ir.MemRefType(ref.memref.type).element_type)
    for v in views:
        if not isinstance(v, Bitcast):
            if not isinstance(v, Window):  # a reshape: the kernel's own dims from here on
                return
            continue
        new = _bits(element_type(v.dtype))
        if new != bits:
            raise NotImplementedError(
                f"bitcasting a Ref from {bits}-bit to {new}-bit elements ({v.dtype.name}) when its "
                "block squeezes the second-to-last dimension (None in block_shape[-2]) is not "
                f"supported ({BACKEND}): a TPU bitcast that changes the element width packs along the "
                "block's second-to-last dimension; keep that dimension in the block (size 1), or bitcast "
                "to a type of the same width"
            )
        bits = new


def apply_view(ref: ir.Value, v) -> ir.Value:
    """A window of ``ref`` (``tpu.memref_slice`` + squeeze) or a reshape of it
    (``tpu.memref_reshape``), as a memref."""
    t = ir.MemRefType(ref.type)
    like = lambda shape: ir.MemRefType.get(list(shape), t.element_type, memory_space=t.memory_space)  # noqa: E731
    if isinstance(v, Bitcast):
        return _bitcast(ref, v)
    if isinstance(v, Pad):
        return _pad(ref, v, like)
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


def _pad(ref: ir.Value, v: Pad, like) -> ir.Value:
    """``tpu.memref_pad`` to ``v.shape`` (jaxlib's Mosaic dialect has it from JAX 0.12.1)."""
    if not hasattr(tpu, "MemRefPadOp"):
        raise needs_jax("pl.pad_ref (tpu.memref_pad)", "0.12.1")
    return getattr(tpu, "memref_pad")(like(v.shape), ref)  # noqa: B009  (not in every jaxlib's stubs)


def _bitcast(ref: ir.Value, v: Bitcast) -> ir.Value:
    """``tpu.memref_bitcast`` of ``ref`` to ``v.dtype``, the second-to-last
    dimension scaled by the ratio of the widths (JAX's shape rule, which JAX
    checked when the kernel was traced)."""
    t = ir.MemRefType(ref.type)
    el = element_type(v.dtype)
    src, dst = _bits(t.element_type), _bits(el)
    shape = list(t.shape)
    if src != dst:
        if len(shape) < 2 or shape[-2] * src % dst:
            raise NotImplementedError(
                f"bitcasting a memref of shape {shape} from {src}-bit to {dst}-bit elements is not "
                f"supported ({BACKEND}): the second-to-last dimension times {src} must be a multiple of {dst}"
            )
        shape[-2] = shape[-2] * src // dst
    return tpu.memref_bitcast(ir.MemRefType.get(shape, el, memory_space=t.memory_space), ref)


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


def access(ref, tree, leaves):
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
            "a reshape or bitcast of a strided view (ref.at[pl.ds(..., stride=k)]) is not supported"
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
