"""Block addressing for the memory rules (``memory.py``): the views
``ref.at[...]`` and indexing make of a block or scratch Ref, a block Ref's
element starts (``block_ref``), and the pointer and mask of an access
(``block_address``). It registers no rules.

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
from typing import cast

import numpy as np

from pallas import backend as pallas_backend
from pallas_gpu._src import compat
from pallas_gpu._src.lowering.lowering import (
    BlockRef,
    Emitter,
    KernelFrame,
    RuleContext,
    Val,
    arg_name,
    expand_to_axis,
    next_pow2,
)


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


def add_exprs(a, b):
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


def block_ref(kl: KernelFrame, i: int, bm, ids: list[Val]) -> BlockRef:
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
                add_exprs(_clamp(em, ix, max(n + lo + hi - size, 0)), -lo)
                if lo
                else _clamp(em, ix, max(n + hi - size, 0))
            )
            in_bounds.append(False)
            nonneg.append(lo == 0)
        else:
            size = 1 if isinstance(dim, pallas_backend.Squeezed) else dim.block_size
            # A block of size 0 (a whole-array block of an empty dim) has one
            # block, starting at 0; its masks are all off.
            last = -(-n // size) - 1 if size else 0
            if size == 0:
                ix = 0
            elif bound is None or bound > last:
                ix = _clamp(em, _wrap(em, ix, last + 1), last)
            start = _mul(ix, size)
            in_bounds.append(size == 0 or n % size == 0)
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


def apply_indexers(
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
    n = cast(int, v.size)  # a sliced dim: apply_indexers indexes those only
    size: int | None
    if isinstance(idx, compat.Slice):
        size, stride = cast(int, idx.size), idx.stride  # static: a Ref's view has a static shape
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
    inside = v.inside and isinstance(start, int) and 0 <= start and start + span <= n
    if past and size is None and not isinstance(start, int) and v.start == 0 and v.stride == 1:
        return DimView(_wrap(rc.em, start, n), None, 1, False, past_block=True)
    if clamp and not isinstance(start, int):
        if stride > 1 and size is not None and size > 1:
            return DimView(start, size, stride, v.inside, n, v.start, v.stride)
        start = _clamp(rc.em, _wrap(rc.em, start, n), max(n - span, 0))
        inside = v.inside and span <= n
    new_start = add_exprs(v.start, _mul(start, v.stride))
    return DimView(new_start, size, v.stride * stride if size is not None else 1, inside)


def _wrap(em: Emitter, start: str | int, n: int) -> str:
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
        first = cast(int, axes[next(k for k, v in enumerate(view) if v.group is not None)])  # has an axis
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
            axis = cast(int, axes[cast(int, k)])  # v is view[k]: a gather's dim, with an axis
            lin = add_exprs(
                add_exprs(base, v.parent_start), _mul(_clipped_elements(em, v, ""), v.parent_stride)
            )
            off = named(em, "offs", _place(f"({lin})", axis, len(v.group.shape), rank))
            if not safe:
                masks.append(f"({off} < {n})")
                if not nonneg:
                    masks.append(f"({off} >= 0)")
            offsets.append(_mul(off, stride))  # even where n == 1: it gives the gather's shape
            continue
        if v.past_block:
            # Below the block (after one wrap) it is clamped to the block's start, as in JAX.
            off = named(em, "i", f"tl.minimum({base} + tl.maximum({v.start}, 0), {n - 1})")
        elif v.size is None:
            off = add_exprs(base, v.start)
            if not safe:
                off = named(em, "i", off)
                masks.append(f"({off} < {n})")
                if not nonneg:
                    masks.append(f"({off} >= 0)")
        else:
            p = next_pow2(v.size)
            ar = f"tl.arange(0, {p})"
            lin = add_exprs(add_exprs(base, v.start), _mul(ar, v.stride) if v.stride != 1 else ar)
            if v.clip is not None or v.elements is not None:
                lin = add_exprs(
                    add_exprs(base, v.parent_start), _mul(_clipped_elements(em, v, ar), v.parent_stride)
                )
            axis = cast(int, axes[cast(int, k)])  # v is view[k]: a slice, with an axis
            off = named(em, "offs", expand_to_axis(str(lin), axis, rank))
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


def named(em: Emitter, hint: str, expr) -> str:
    name = em.fresh(hint)
    em.emit(f"{name} = {expr}")
    return name


def _clipped_elements(em: Emitter, v: DimView, ar: str) -> str:
    """Per-element indices of a gather or a strided dynamic slice, each
    wrapped and clamped into [0, v.clip) as interpret mode does."""
    e = v.elements if v.elements is not None else named(em, "el", f"{v.start} + {ar} * {v.stride}")
    if v.clip is None:
        return e
    return named(em, "el", f"tl.minimum(tl.maximum(tl.where({e} < 0, {e} + {v.clip}, {e}), 0), {v.clip - 1})")
