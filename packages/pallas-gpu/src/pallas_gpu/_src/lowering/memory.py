"""Lowering rules for memory: Ref reads/writes (``get``/``swap``/``addupdate``)
on block and scratch Refs, whole-block loads and stores, TMA tiles, and the
GPU-only ``plgpu.load``, ``plgpu.store``, ``plgpu.swap`` and atomics.

Where an access points, and how out-of-range indices are clamped or masked,
is ``address.py``'s part (see its docstring): this module turns a
view into loads and stores.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax import tree_util

from pallas_gpu._src import compat
from pallas_gpu._src.language import primitives as gpu_primitives
from pallas_gpu._src.lowering.address import (
    DimView,
    add_exprs,
    apply_indexers,
    block_address,
    named,
    view_axes,
)
from pallas_gpu._src.lowering.lowering import (
    DTYPES,
    INT4,
    BlockRef,
    Emitter,
    KernelFrame,
    NotResident,
    ResidentRef,
    RuleContext,
    ScratchRef,
    Val,
    is_bool,
    is_float,
    register_lowering,
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
        offsets.append(add_exprs(ref.starts[d], v.start))
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
        x = f"{x}.to({DTYPES[ref.dtype.name][0]})"
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
    o = named(em, "o", offset)
    mask = _and_masks(mask, user_mask)
    load = (
        f"tl.load({ref.ptr} + {o} // 2, mask={mask}, other=0{kw})"
        if mask
        else f"tl.load({ref.ptr} + {o} // 2{kw})"
    )
    nibble = named(em, "nib", f"({load}.to(tl.int32) >> (({o} % 2) * 4)) & 15")
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


def load_block(em: Emitter, ref: BlockRef, kl: KernelFrame | None = None) -> Val:
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


def store_block(em: Emitter, ref: BlockRef, val: Val, kl: KernelFrame | None = None) -> None:
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
    view = apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc, read=top_level)
    return _load_ref(rc, ref, view, rc.avals_out[0].dtype)


@register_lowering(compat.swap_p)
def _swap_rule(rc: RuleContext, ref, val, *idx, tree):
    view = apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc)
    old = None
    if rc.lowering.is_used(rc.eqn.outvars[0]):
        old = _load_ref(rc, ref, view, rc.avals_out[0].dtype)
    _store_ref(rc, ref, view, val)
    return old if old is not None else Val("None", rc.avals_out[0].shape, rc.avals_out[0].dtype)


@register_lowering(compat.addupdate_p)
def _addupdate_rule(rc: RuleContext, ref, val, *idx, tree):
    view = apply_indexers(ref, _unflatten_transforms(rc, idx, tree), rc)
    old = _load_ref(rc, ref, view, val.dtype)
    new = rc.em.assign(f"{old.expr} + {val.expr}", val.shape, val.dtype)
    _store_ref(rc, ref, view, new)
    return []


def _and_masks(*ms) -> str | None:
    given = [m for m in ms if m]
    return " & ".join(f"({m})" for m in given) if given else None


def _gpu_access(rc: RuleContext, ref, tree, args, what: str):
    if isinstance(ref, ResidentRef):
        raise NotResident(ref.index)
    if not isinstance(ref, BlockRef):
        raise rc.error(f"plgpu.{what} works on input/output Refs, not on scratch Refs")
    if what != "load":  # loads of packed 4-bit arrays: _load_int4
        _no_int4(rc, ref, f"plgpu.{what} on")
    n = tree.num_leaves
    view = apply_indexers(ref, _unflatten_transforms(rc, args[:n], tree), rc, clamp=False)
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


@register_lowering(gpu_primitives.swap_p)
def _plgpu_swap_rule(rc: RuleContext, ref, val, *args, tree, has_mask, eviction_policy):
    """A (masked) load of the old value, then a (masked) store; masked-off
    elements of the result are ``val`` (JAX's Pallas does the same)."""
    ptr, mask, shape, rest = _gpu_access(rc, ref, tree, args, "swap")
    em = rc.em
    m = _and_masks(mask, rest[0].expr if has_mask else None)
    x = f"{val.expr}.to(tl.int8)" if is_bool(ref.dtype) else val.expr
    ptr, m = named(em, "ptr", ptr), m and named(em, "mask", m)
    old = None
    if rc.lowering.is_used(rc.eqn.outvars[0]):
        other = x if has_mask else _zero(ref.dtype)
        load = f"tl.load({ptr}, mask={m}, other={other})" if m else f"tl.load({ptr})"
        old = rc.out(f"{load} != 0" if is_bool(ref.dtype) else load)
    kw = f", eviction_policy={eviction_policy!r}" if eviction_policy else ""
    em.emit(f"tl.store({ptr}, {x}, mask={m}{kw})" if m else f"tl.store({ptr}, {x}{kw})")
    return old if old is not None else Val("None", rc.avals_out[0].shape, rc.avals_out[0].dtype)


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
