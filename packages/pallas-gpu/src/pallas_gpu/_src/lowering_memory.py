"""Lowering rules for memory: Ref reads/writes (``get``/``swap``/``addupdate``)
on block and scratch Refs, block addressing, and the GPU-only ``plgpu.load``,
``plgpu.store`` and atomics.

A block Ref is a base pointer plus per-array-dimension element starts; an
access computes ``pointer + offsets`` and a mask that keeps it inside the
array (and off the power-of-two padding of the value).

Out-of-range indices follow interpret mode (JAX's and pallas-core's): a block
index outside the grid of blocks is clamped into it, and a dynamic index or
``pl.ds`` start inside the kernel wraps once if negative (as in numpy) and is
then clamped so the slice lies inside the Ref (strided slices: each element
index is clamped). One exception, as in JAX 0.11's interpret mode: a dynamic
integer index that *reads* a block Ref (``x_ref[i]``) at the kernel's top
level (not inside a loop or cond) is not clamped into the block; past the
block's end it reads the array there, clamped to the array's last element
(below the block's start, after one wrap, it is clamped to that start).
With JAX 0.12+ that read is clamped into the block too, as JAX 0.12 does it.
``plgpu.load``/``store`` and the atomics do not clamp: they mask, as Triton
code does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np
from jax import tree_util

from pallas import backend as pallas_backend
from pallas_gpu._src import compat
from pallas_gpu._src import primitives as gpu_primitives
from pallas_gpu._src.lowering import (
    _DTYPES,
    INT4,
    BlockRef,
    Emitter,
    NotResident,
    ResidentRef,
    RuleContext,
    ScratchRef,
    Val,
    arg_name,
    expand_to_axis,
    is_bool,
    is_float,
    next_pow2,
    register_lowering,
)

if TYPE_CHECKING:
    from pallas_gpu._src.lowering_kernel import KernelLowering


@dataclasses.dataclass(frozen=True)
class GatherGroup:
    """The integer-array indices of one indexer (``ref.at[rows, cols]``): their
    broadcast shape, which the result holds on consecutive axes, and where:
    first (``front``, NumPy's rule when scalar or array indices are not
    adjacent) or where the first of them stands."""

    shape: tuple[int, ...]
    front: bool


@dataclasses.dataclass
class DimView:
    """One kernel-block dim after ``ref.at[...]``/indexing: a scalar index
    (``size is None``), a strided slice, or one dim of a gather (``group``)."""

    start: str | int
    size: int | None
    stride: int = 1
    inside: bool = True  # statically known to lie inside the block
    # Per-element indices into the parent view (whose start and stride are
    # parent_*): ``elements`` (an int array index: a gather, a tensor of the
    # group's rank broadcastable to its shape) or, if None, start + arange *
    # stride (a strided dynamic slice); with ``clip``, each is wrapped and
    # clamped into [0, clip).
    clip: int | None = None
    parent_start: str | int = 0
    parent_stride: int = 1
    elements: str | None = None
    group: GatherGroup | None = None
    # A read at a dynamic integer index of a block dim: block start + index,
    # clamped into the array rather than into the block (JAX's interpret mode).
    past_block: bool = False


def view_axes(view: list[DimView]) -> tuple[tuple[int, ...], list[int | None]]:
    """(result shape, the result axis of each dim of ``view``): a slice has
    one axis, the dims of a gather share their group's axes (the first is
    given), a scalar index has none."""
    group = next((v.group for v in view if v.group is not None), None)
    shape: list[int] = list(group.shape) if group is not None and group.front else []
    first = 0 if group is not None and group.front else None
    axes: list[int | None] = []
    for v in view:
        if v.group is not None:
            if first is None:
                first = len(shape)
                shape += v.group.shape
            axes.append(first)
        elif v.size is not None:
            axes.append(len(shape))
            shape.append(v.size)
        else:
            axes.append(None)
    return tuple(shape), axes


def _place(expr: str, first: int, k: int, rank: int) -> str:
    """A rank-``k`` tensor expression on axes ``first..first+k`` of rank ``rank``."""
    if k == rank:
        return expr
    return f"{expr}[{', '.join(['None'] * first + [':'] * k + ['None'] * (rank - first - k))}]"


# ---------------------------------------------------------------------------
# Index arithmetic on expressions (ints fold at trace time)


def _add(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if a == 0:
        return b
    if b == 0:
        return a
    return f"({a} + {b})"


def _mul(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    if a == 1:
        return b
    if b == 1:
        return a
    if a == 0 or b == 0:
        return 0
    return f"({a} * {b})"


# ---------------------------------------------------------------------------
# Blocks and views


def _clamp(em: Emitter, ix, hi: int):
    """``ix`` clamped into [0, hi] (folded when ``ix`` is static)."""
    if isinstance(ix, int):
        return min(max(ix, 0), hi)
    if hi == 0:
        return 0
    name = em.fresh("ix")
    em.emit(f"{name} = tl.minimum(tl.maximum({ix}, 0), {hi})")
    return name


def _wrap(em: Emitter, ix, n: int):
    """``ix`` counted once from the end (``+ n``) when negative, as a negative
    block start is in interpret mode (JAX's)."""
    if isinstance(ix, int):
        return ix + n if ix < 0 else ix
    name = em.fresh("ix")
    em.emit(f"{name} = tl.where({ix} < 0, {ix} + {n}, {ix})")
    return name


def block_ref(kl: KernelLowering, i: int, bm, ids: list[Val]) -> BlockRef:
    """The BlockRef of block mapping ``i``: its element starts from the index
    map, as in interpret mode (``dynamic_slice`` on the array padded to whole
    blocks): a negative block index counts once from the last block, then it
    is clamped into range, so nothing outside the array is touched."""
    em = kl.em
    em.emit(f"# {bm.origin}: {bm.dtype}{list(bm.array_shape)}, block {tuple(str(d) for d in bm.block_shape)}")
    idx = kl.lower_jaxpr(bm.index_map, ids)
    # The grid index itself needs no clamp where the grid fits the blocks.
    id_bound = {ids[ax].expr: g - 1 for ax, g in enumerate(kl.gm.grid)}
    starts, in_bounds, nonneg, kernel_dims = [], [], [], []
    for d, (dim, n) in enumerate(zip(bm.block_shape, bm.array_shape)):
        v = idx[d]
        ix = v.expr if v.static is None else int(v.static)
        bound = id_bound.get(ix, None) if isinstance(ix, str) else None
        if isinstance(dim, pallas_backend.Element):
            lo, hi = dim.padding
            size = dim.block_size
            start = (
                _add(_clamp(em, ix, max(n + lo + hi - size, 0)), -lo)
                if lo
                else _clamp(em, ix, max(n + hi - size, 0))
            )
            in_bounds.append(False)
            nonneg.append(lo == 0)
        else:
            size = 1 if isinstance(dim, pallas_backend.Squeezed) else dim.block_size
            last = -(-n // size) - 1
            if bound is None or bound > last:
                ix = _clamp(em, _wrap(em, ix, last + 1), last)
            start = _mul(ix, size)
            in_bounds.append(n % size == 0)
            nonneg.append(True)
        if not isinstance(start, int):
            name = em.fresh("start")
            em.emit(f"{name} = {start}")
            start = name
        starts.append(start)
        if not isinstance(dim, pallas_backend.Squeezed):
            kernel_dims.append(d)
    return BlockRef(
        arg_name(bm, i),
        tuple(bm.array_shape),
        np.dtype(bm.dtype),
        starts,
        kernel_dims,
        tuple(bm.kernel_block_shape),
        in_bounds,
        nonneg,
    )


def _apply_indexers(
    ref, transforms, rule_ctx: RuleContext, clamp: bool = True, read: bool = False
) -> list[DimView]:
    """The view of ``ref`` after ``transforms``. With ``clamp``, dynamic
    indices are wrapped and clamped into the view (see the module docstring);
    ``read``: a read, whose dynamic integer indices of a block dim may pass
    the block's end."""
    shape = ref.block_shape if isinstance(ref, BlockRef) else ref.shape
    view = [DimView(0, n) for n in shape]
    for k, t in enumerate(transforms):
        if not isinstance(t, compat.NDIndexer):
            raise rule_ctx.error(f"Ref transform {type(t).__name__} is not supported")
        if any(v.clip is not None or v.group is not None for v in view):
            if _whole(t, view_axes(view)[0]):  # plgpu.load(x_ref.at[idx]) adds one
                continue
            raise rule_ctx.error(_INDEX_ONCE)
        live = [i for i, v in enumerate(view) if v.size is not None]
        if len(t.indices) != len(live):
            raise rule_ctx.error(f"indexer {t} does not match the Ref's {len(live)} dims")
        group = _gather_group(t.indices)
        past = clamp and read and k == 0 and isinstance(ref, BlockRef)
        for i, idx in zip(live, t.indices):
            view[i] = _index_dim(rule_ctx, view[i], idx, clamp, group, past)
    return view


_INDEX_ONCE = (
    "indexing a Ref again after an integer-array index or a strided pl.ds with a dynamic "
    "start is not supported; index once (or load, then index the value)"
)


def _whole(t, shape: tuple[int, ...]) -> bool:
    """Whether the indexer ``t`` takes the whole of a view of ``shape``."""
    return len(t.indices) == len(shape) and all(
        isinstance(i, compat.Slice) and _scalar_or_none(i.start) == 0 and i.size == n and i.stride == 1
        for i, n in zip(t.indices, shape)
    )


def _scalar_or_none(x) -> int | None:
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, Val) and x.static is not None and not isinstance(x.static, bool):
        return int(x.static)
    return None


def _gather_group(indices) -> GatherGroup | None:
    """The gather of one indexer's integer-array indices, as JAX's NDIndexer
    shapes it (NumPy's advanced indexing): the arrays broadcast together; their
    axes stand where the first integer index is when every integer index
    (scalars too) is adjacent, else first."""
    arrays = [idx.shape for idx in indices if isinstance(idx, Val) and idx.shape != ()]
    if not arrays:
        return None
    ints = [i for i, idx in enumerate(indices) if not isinstance(idx, compat.Slice)]
    adjacent = all(b - a == 1 for a, b in zip(ints, ints[1:]))
    return GatherGroup(tuple(int(d) for d in np.broadcast_shapes(*arrays)), front=not adjacent)


def _index_dim(
    rc: RuleContext, v: DimView, idx, clamp: bool, group: GatherGroup | None, past: bool = False
) -> DimView:
    """``v`` (a sliced dim) indexed by one index: a slice, a scalar or an
    integer array (one dim of the gather ``group``); ``past``: a dynamic
    scalar index of a whole block dim reads past the block (``past_block``)."""
    if isinstance(idx, compat.Slice):
        size, stride = idx.size, idx.stride
        start = _scalar_expr(idx.start, rc)
    elif isinstance(idx, Val) and idx.shape == ():
        size, stride, start = None, 1, _scalar_expr(idx, rc)
    elif isinstance(idx, Val):
        assert group is not None
        k, r = len(group.shape), len(idx.shape)
        elements = idx.expr if r == k else f"({idx.expr})[{', '.join(['None'] * (k - r) + [':'] * r)}]"
        clip = v.size if clamp else None
        return DimView(0, None, 1, v.inside and clamp, clip, v.start, v.stride, elements, group)
    elif isinstance(idx, (int, np.integer)):
        size, stride, start = None, 1, int(idx)
    else:
        raise rc.error(f"unsupported index {idx!r}")
    span = 1 if size is None else (size - 1) * stride + 1
    inside = v.inside and isinstance(start, int) and 0 <= start and start + span <= v.size
    if past and size is None and not isinstance(start, int) and v.start == 0 and v.stride == 1:
        return DimView(_wrap(rc.em, start, v.size), None, 1, False, past_block=True)
    if clamp and not isinstance(start, int):
        if stride > 1 and size is not None and size > 1:
            return DimView(start, size, stride, v.inside, v.size, v.start, v.stride)
        start = _clamp(rc.em, _wrap(rc.em, start, v.size), max(v.size - span, 0))
        inside = v.inside and span <= v.size
    new_start = _add(v.start, _mul(start, v.stride))
    return DimView(new_start, size, v.stride * stride if size is not None else 1, inside)


def _wrap(em: Emitter, start: str, n: int) -> str:
    """A dynamic index made nonnegative as numpy does (``-1`` is ``n - 1``)."""
    name = em.fresh("ix")
    em.emit(f"{name} = tl.where({start} < 0, {start} + {n}, {start})")
    return name


def _scalar_expr(x, rule_ctx) -> str | int:
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, Val):
        if x.static is not None and not isinstance(x.static, bool):
            return int(x.static)
        return x.expr
    raise rule_ctx.error(f"unsupported index {x!r}")


def block_address(em: Emitter, ref: BlockRef, view: list[DimView]) -> tuple[str, str | None, tuple[int, ...]]:
    """(pointer expression, mask expression or None, logical result shape)."""
    out_shape, axes = view_axes(view)
    rank = len(out_shape)
    kdim = {d: k for k, d in enumerate(ref.kernel_dims)}
    wide = math.prod(ref.array_shape) >= 2**31
    offsets, masks = [], []
    group = next((v.group for v in view if v.group is not None), None)
    if group is not None:  # the gather's padding
        first = axes[next(k for k, v in enumerate(view) if v.group is not None)]
        for j, m in enumerate(group.shape):
            if next_pow2(m) != m:
                masks.append(f"({expand_to_axis(f'tl.arange(0, {next_pow2(m)})', first + j, rank)} < {m})")
    for d, n in enumerate(ref.array_shape):
        stride = math.prod(ref.array_shape[d + 1 :])
        base = ref.starts[d]
        if wide and base != 0:
            base = f"{base}.to(tl.int64)"
        k = kdim.get(d)
        v = view[k] if k is not None else DimView(0, None)
        # Inside the block: the block's own bounds decide whether to mask.
        safe, nonneg = ref.in_bounds[d] and v.inside, ref.nonnegative[d] and v.inside
        if v.group is not None:
            lin = _add(_add(base, v.parent_start), _mul(_clipped_elements(em, v, ""), v.parent_stride))
            off = _named(em, "offs", _place(f"({lin})", axes[k], len(v.group.shape), rank))
            if not safe:
                masks.append(f"({off} < {n})")
                if not nonneg:
                    masks.append(f"({off} >= 0)")
            offsets.append(_mul(off, stride))  # even where n == 1: it gives the gather's shape
            continue
        if v.past_block:
            # Below the block (after one wrap) it is clamped to the block's start, as in JAX.
            off = _named(em, "i", f"tl.minimum({base} + tl.maximum({v.start}, 0), {n - 1})")
        elif v.size is None:
            off = _add(base, v.start)
            if not safe:
                off = _named(em, "i", off)
                masks.append(f"({off} < {n})")
                if not nonneg:
                    masks.append(f"({off} >= 0)")
        else:
            p = next_pow2(v.size)
            ar = f"tl.arange(0, {p})"
            lin = _add(_add(base, v.start), _mul(ar, v.stride) if v.stride != 1 else ar)
            if v.clip is not None or v.elements is not None:
                lin = _add(_add(base, v.parent_start), _mul(_clipped_elements(em, v, ar), v.parent_stride))
            axis = axes[k]
            off = _named(em, "offs", expand_to_axis(str(lin), axis, rank))
            if p != v.size:
                masks.append(f"({expand_to_axis(ar, axis, rank)} < {v.size})")
            if not safe:
                masks.append(f"({off} < {n})")
                if not (nonneg and v.stride > 0):
                    masks.append(f"({off} >= 0)")
        if n > 1 or v.size is not None:  # a slice gives the pointer its axis, even of one element
            offsets.append(_mul(off, stride))
    ptr = ref.ptr
    for o in offsets:
        if o != 0:
            ptr = f"{ptr} + {o}"
    return ptr, (" & ".join(masks) if masks else None), out_shape


def _named(em: Emitter, hint: str, expr) -> str:
    name = em.fresh(hint)
    em.emit(f"{name} = {expr}")
    return name


def _clipped_elements(em: Emitter, v: DimView, ar: str) -> str:
    """Per-element indices of a gather or a strided dynamic slice, each
    wrapped and clamped into [0, v.clip) as interpret mode does."""
    e = v.elements if v.elements is not None else _named(em, "el", f"{v.start} + {ar} * {v.stride}")
    if v.clip is None:
        return e
    return _named(
        em, "el", f"tl.minimum(tl.maximum(tl.where({e} < 0, {e} + {v.clip}, {e}), 0), {v.clip - 1})"
    )


# ---------------------------------------------------------------------------
# TMA (CompilerParams(use_tma=True)): dense tiles through tensor descriptors

# Largest TMA box dimension (elements), and the smallest inner box (bytes).
TMA_MAX_BOX = 256
TMA_MIN_INNER_BYTES = 16


def tma_tile(ref: BlockRef, view: list[DimView]) -> tuple[list[int], list] | None:
    """(box shape per array dim, element offset per array dim) when the access
    ``view`` of ``ref`` can be one TMA tile, else None (pointer arithmetic)."""
    itemsize = ref.dtype.itemsize
    rank = len(ref.array_shape)
    if is_bool(ref.dtype) or ref.dtype.name in INT4 or not 1 <= rank <= 5:
        return None
    # Global strides other than the innermost must be multiples of 16 bytes.
    if any(math.prod(ref.array_shape[d + 1 :]) * itemsize % 16 for d in range(rank - 1)):
        return None
    kdim = {d: k for k, d in enumerate(ref.kernel_dims)}
    box, offsets = [], []
    for d in range(rank):
        v = view[kdim[d]] if d in kdim else DimView(0, None)
        if v.clip is not None or v.elements is not None or v.past_block:
            return None
        size = 1 if v.size is None else v.size
        if size > 1 and v.stride != 1:
            return None
        if size & (size - 1) or size > TMA_MAX_BOX:
            return None
        box.append(size)
        offsets.append(_add(ref.starts[d], v.start))
    if box[-1] * itemsize < TMA_MIN_INNER_BYTES:
        return None
    return box, offsets


def _tma_load(kl, ref: BlockRef, view: list[DimView]) -> tuple[str, tuple[int, ...]] | None:
    tile = tma_tile(ref, view) if kl is not None and kl.use_tma else None
    if tile is None:
        return None
    box, offsets = tile
    desc = kl.tma_descriptor(ref.ptr, ref.array_shape, box)
    shape = view_axes(view)[0]
    expr = f"{desc}.load([{', '.join(str(o) for o in offsets)}])"
    if list(shape) != box:
        expr = f"tl.reshape({expr}, {list(shape)})"
    return expr, shape


def _tma_store(kl, ref: BlockRef, view: list[DimView], val: Val) -> bool:
    tile = tma_tile(ref, view) if kl is not None and kl.use_tma else None
    if tile is None:
        return False
    box, offsets = tile
    desc = kl.tma_descriptor(ref.ptr, ref.array_shape, box)
    x = val.expr
    if val.dtype != ref.dtype:
        x = f"{x}.to({_DTYPES[ref.dtype.name][0]})"
    if list(val.shape) != box:
        x = f"tl.reshape({x}, {box})"
    kl.em.emit(f"{desc}.store([{', '.join(str(o) for o in offsets)}], {x})")
    return True


def _load_ref(rc: RuleContext, ref, view, out_dtype) -> Val:
    em = rc.em
    if isinstance(ref, ScratchRef):
        _check_whole(rc, ref, view)
        return em.assign(ref.var, ref.shape, ref.dtype)
    if ref.dtype.name in INT4:
        return _load_int4(em, ref, view)
    tma = _tma_load(rc.lowering, ref, view)
    if tma is not None:
        return em.assign(tma[0], tma[1], out_dtype)
    ptr, mask, shape = block_address(em, ref, view)
    if mask is None:
        expr = f"tl.load({ptr})"
    else:
        m = em.fresh("mask")
        em.emit(f"{m} = {mask}")
        expr = f"tl.load({ptr}, mask={m}, other={_zero(ref.dtype)})"
    if is_bool(ref.dtype):
        expr = f"{expr} != 0"
    return em.assign(expr, shape, out_dtype)


def _load_int4(
    em: Emitter,
    ref: BlockRef,
    view: list[DimView],
    user_mask: str | None = None,
    other: str | None = None,
    kw="",
) -> Val:
    """A load from a 4-bit array, which XLA packs two elements per byte (the
    even element in the low nibble): bytes at offset // 2, shifted and
    sign-extended into the int8 (uint8) that holds a 4-bit value. ``user_mask``
    and ``other`` as ``plgpu.load``'s (masked elements read ``other``)."""
    offset, mask, shape = block_address(em, dataclasses.replace(ref, ptr="0"), view)
    o = _named(em, "o", offset)
    mask = _and_masks(mask, user_mask)
    load = (
        f"tl.load({ref.ptr} + {o} // 2, mask={mask}, other=0{kw})"
        if mask
        else f"tl.load({ref.ptr} + {o} // 2{kw})"
    )
    nibble = _named(em, "nib", f"({load}.to(tl.int32) >> (({o} % 2) * 4)) & 15")
    if ref.dtype.name == "int4":
        val = f"(({nibble} << 28) >> 28).to(tl.int8)"
    else:
        val = f"{nibble}.to(tl.uint8)"
    if mask and other not in (None, "0"):
        val = (
            f"tl.where({mask}, {val}, ({other}).to({'tl.int8' if ref.dtype.name == 'int4' else 'tl.uint8'}))"
        )
    return em.assign(val, shape, ref.dtype)


def _store_ref(rc: RuleContext, ref, view, val: Val) -> None:
    em = rc.em
    if isinstance(ref, ScratchRef):
        _check_whole(rc, ref, view)
        em.emit(f"{ref.var} = {val.expr}")
        return
    _no_int4(rc, ref, "stores into")
    shape = view_axes(view)[0]
    if shape != val.shape:
        raise rc.error(f"storing a {val.shape} value into a {shape} slice of a Ref")
    if _tma_store(rc.lowering, ref, view, val):
        return
    ptr, mask, shape = block_address(em, ref, view)
    x = val.expr
    if is_bool(ref.dtype):
        x = f"{x}.to(tl.int8)"
    if shape == () and val.shape == ():
        pass
    if mask is None:
        em.emit(f"tl.store({ptr}, {x})")
    else:
        em.emit(f"tl.store({ptr}, {x}, mask={mask})")


def _no_int4(rc: RuleContext, ref: BlockRef, what: str) -> None:
    if ref.dtype.name in INT4:
        raise rc.error(
            f"{what} {ref.dtype.name} Refs are not supported (XLA packs them two per byte); read "
            "them with ref[...] / pl.ds, or pass int8 arrays"
        )


def _check_whole(rc: RuleContext, ref: ScratchRef, view: list[DimView]) -> None:
    if any(v.size is None or v.start != 0 or v.size != n or v.stride != 1 for v, n in zip(view, ref.shape)):
        if isinstance(ref, ResidentRef):
            raise NotResident(ref.index)
        raise rc.error(
            "scratch Refs live in registers in the Triton backend and can only be read and "
            "written whole (ref[...]); index them after loading instead"
        )


def load_block(em: Emitter, ref: BlockRef, kl: KernelLowering | None = None) -> Val:
    """The whole block of ``ref`` (masked at the array's edges; a TMA tile
    where ``kl`` asks for TMA and the block allows it)."""
    whole = [DimView(0, n) for n in ref.block_shape]
    tma = _tma_load(kl, ref, whole)
    if tma is not None:
        return em.assign(tma[0], tma[1], ref.dtype, "acc")
    ptr, mask, shape = block_address(em, ref, whole)
    expr = f"tl.load({ptr}, mask={mask}, other={_zero(ref.dtype)})" if mask else f"tl.load({ptr})"
    return em.assign(f"{expr} != 0" if is_bool(ref.dtype) else expr, shape, ref.dtype, "acc")


def _zero(dtype) -> str:
    """``other=`` of a masked load: Triton casts an int 0 to every type but fp8 (it converts
    fp8 only from other floats)."""
    return "0.0" if np.dtype(dtype).itemsize == 1 and is_float(dtype) else "0"


def store_block(em: Emitter, ref: BlockRef, val: Val, kl: KernelLowering | None = None) -> None:
    if _tma_store(kl, ref, [DimView(0, n) for n in ref.block_shape], val):
        return
    ptr, mask, _ = block_address(em, ref, [DimView(0, n) for n in ref.block_shape])
    x = f"{val.expr}.to(tl.int8)" if is_bool(ref.dtype) else val.expr
    em.emit(f"tl.store({ptr}, {x}, mask={mask})" if mask else f"tl.store({ptr}, {x})")


def _unflatten_transforms(rc: RuleContext, idx_args, tree):
    return tree_util.tree_unflatten(tree, list(idx_args))


@register_lowering(compat.get_p)
def _get_rule(rc: RuleContext, ref, *idx, tree):
    # JAX's interpret mode reads past the block only at the kernel's top level, where
    # XLA < 0.12 fuses the read with the block's slice; inside a loop or cond it clamps
    # (and so does every read with JAX 0.12+).
    top_level = rc.em.depth == 1 and compat.reads_past_the_block_reach_the_array()
    view = _apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc, read=top_level)
    return _load_ref(rc, ref, view, rc.avals_out[0].dtype)


@register_lowering(compat.swap_p)
def _swap_rule(rc: RuleContext, ref, val, *idx, tree):
    view = _apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc)
    old = None
    if rc.lowering.is_used(rc.eqn.outvars[0]):
        old = _load_ref(rc, ref, view, rc.avals_out[0].dtype)
    _store_ref(rc, ref, view, val)
    return old if old is not None else Val("None", rc.avals_out[0].shape, rc.avals_out[0].dtype)


@register_lowering(compat.addupdate_p)
def _addupdate_rule(rc: RuleContext, ref, val, *idx, tree):
    view = _apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc)
    old = _load_ref(rc, ref, view, val.dtype)
    new = rc.em.assign(f"{old.expr} + {val.expr}", val.shape, val.dtype)
    _store_ref(rc, ref, view, new)
    return []


def _and_masks(*ms) -> str | None:
    ms = [m for m in ms if m]
    return " & ".join(f"({m})" for m in ms) if ms else None


def _gpu_access(rc: RuleContext, ref, tree, args, what: str):
    if isinstance(ref, ResidentRef):
        raise NotResident(ref.index)
    if not isinstance(ref, BlockRef):
        raise rc.error(f"plgpu.{what} works on input/output Refs, not on scratch Refs")
    if what != "load":  # loads of packed 4-bit arrays: _load_int4
        _no_int4(rc, ref, f"plgpu.{what} on")
    n = tree.num_leaves
    view = _apply_indexers(ref, _unflatten_transforms(rc, args[:n], tree), rc, clamp=False)
    if ref.dtype.name in INT4:
        return view, None, None, list(args[n:])
    ptr, mask, shape = block_address(rc.em, ref, view)
    return ptr, mask, shape, list(args[n:])


@register_lowering(gpu_primitives.load_p)
def _plgpu_load_rule(
    rc: RuleContext, ref, *args, tree, has_mask, has_other, cache_modifier, eviction_policy, volatile
):
    ptr, mask, shape, rest = _gpu_access(rc, ref, tree, args, "load")
    user_mask = rest.pop(0).expr if has_mask else None
    other = rest.pop(0).expr if has_other else "0"
    m = _and_masks(mask, user_mask)
    kw = ""
    if cache_modifier:
        kw += f", cache_modifier={cache_modifier!r}"
    if eviction_policy:
        kw += f", eviction_policy={eviction_policy!r}"
    if volatile:
        kw += ", volatile=True"
    if ref.dtype.name in INT4:  # ptr is the view: the packed bytes are read by _load_int4
        return _load_int4(rc.em, ref, ptr, user_mask, other if has_other else None, kw)
    expr = f"tl.load({ptr}, mask={m}, other={other}{kw})" if m else f"tl.load({ptr}{kw})"
    if is_bool(ref.dtype):
        expr = f"{expr} != 0"
    return rc.out(expr)


@register_lowering(gpu_primitives.store_p)
def _plgpu_store_rule(rc: RuleContext, ref, val, *args, tree, has_mask, eviction_policy):
    ptr, mask, shape, rest = _gpu_access(rc, ref, tree, args, "store")
    m = _and_masks(mask, rest[0].expr if has_mask else None)
    x = f"{val.expr}.to(tl.int8)" if is_bool(ref.dtype) else val.expr
    kw = f", eviction_policy={eviction_policy!r}" if eviction_policy else ""
    rc.em.emit(f"tl.store({ptr}, {x}, mask={m}{kw})" if m else f"tl.store({ptr}, {x}{kw})")
    return []


@register_lowering(gpu_primitives.atomic_rmw_p)
def _plgpu_atomic_rule(rc: RuleContext, ref, val, *args, tree, has_mask, op):
    ptr, mask, shape, rest = _gpu_access(rc, ref, tree, args, f"atomic_{op}")
    m = _and_masks(mask, rest[0].expr if has_mask else None)
    kw = f", mask={m}" if m else ""
    return rc.out(f"tl.atomic_{op}({ptr}, {val.expr}{kw})")


@register_lowering(gpu_primitives.atomic_cas_p)
def _plgpu_atomic_cas_rule(rc: RuleContext, ref, cmp, val, *idx, tree):
    ptr, mask, shape, _ = _gpu_access(rc, ref, tree, idx, "atomic_cas")
    cmp_expr = cmp.expr
    if mask is not None:
        # tl.atomic_cas takes no mask: masked-off lanes (padding, outside the
        # array) compare-and-swap val for val at the array's first element,
        # which leaves it unchanged.
        m = rc.em.fresh("mask")
        rc.em.emit(f"{m} = {mask}")
        ptr = f"tl.where({m}, {ptr}, {ref.ptr})"
        cmp_expr = f"tl.where({m}, {cmp.expr}, {val.expr})"
    return rc.out(f"tl.atomic_cas({ptr}, {cmp_expr}, {val.expr})")
