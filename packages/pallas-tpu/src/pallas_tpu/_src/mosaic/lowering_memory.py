"""Mosaic rules for Ref reads and writes: ``get``, ``swap`` and ``addupdate``
(``vector.load`` / ``tpu.vector_store`` in VMEM, ``memref.load/store`` of SMEM
scalars), gathers, ``lax.dynamic_slice`` / ``dynamic_update_slice`` of values,
and scoped scratch (``run_scoped``). Views are ``lowering_views.py``, the forms
of the accesses ``lowering_windows.py``, DMAs and semaphores ``lowering_dma.py``.

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

import numpy as np
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import mxu as tpu_mxu
from pallas_tpu._src.mosaic import lowering_mxu
from pallas_tpu._src.mosaic.lowering import (
    BOOL_MEMORY_DTYPE,
    Aval,
    aval_type,
    broadcast_to,
    constant,
    index,
    is_bool,
    is_float,
    is_smem,
    lower_jaxpr,
    memref_type,
    ref_type,
    register_lowering,
    shape_cast,
    value_type,
)
from pallas_tpu._src.mosaic.lowering_jax012 import store_poison
from pallas_tpu._src.mosaic.lowering_math import BINARY
from pallas_tpu._src.mosaic.lowering_views import Window, access, is_vector
from pallas_tpu._src.mosaic.lowering_windows import (
    MAX_GATHERED,
    read_window,
    strided_read,
    strided_write,
    write_window,
)


def load(ctx, ref, ref_aval, tree, leaves, out_aval) -> ir.Value:
    if is_bool(out_aval.dtype):  # stored as int32
        mem = Aval(out_aval.shape, BOOL_MEMORY_DTYPE)
        x = load(ctx, ref, ref_aval, tree, leaves, mem)
        return arith.cmpi(arith.CmpIPredicate.ne, x, constant(0, out_aval.shape, BOOL_MEMORY_DTYPE))
    ref, w = access(ref, tree, leaves)
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
        v = strided_read(ref, w, out_aval.dtype)
    else:
        v = read_window(ref, w.starts, w.sizes, out_aval.dtype)
    return shape_cast(v, out_aval.shape, out_aval.dtype)


def _gather(ref, w: Window, smem: bool, out_aval) -> ir.Value:
    """``ref[w]`` where some starts are index vectors (NumPy's advanced
    indexing: the index shape replaces the indexed dims where they are
    adjacent, else leads). Each index's slice is read as ``read_window`` reads
    a dynamic start."""
    int_dims = [d for d, q in enumerate(w.squeezed) if q]
    vectors = [s for s in w.starts if is_vector(s)]
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
        starts = [broadcast_to(s, batch) if is_vector(s) else s for s in w.starts]
        for pos in np.ndindex(*batch):
            idx = [vector.extract(s, [], list(pos)) if is_vector(s) else s for s in starts]
            if smem:
                piece = broadcast_to(memref.load(ref, [index(i) for i in idx]), slot)
            else:
                win = dataclasses.replace(w, starts=idx)
                piece = strided_read(ref, win, dtype) if w.strided else read_window(ref, idx, w.sizes, dtype)
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
    ref, w = access(ref, tree, leaves)
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
        strided_write(ref, w, val, val_aval.dtype)
    else:
        write_window(ref, w.starts, val, val_aval.dtype)


def _check_not_rank0(ref) -> None:
    if not ir.MemRefType(ref.type).shape:
        raise NotImplementedError(
            "reading or writing a rank-0 Ref in VMEM (a scratch of shape ()): Mosaic has no rank-0 "
            "vectors nor scalar accesses of VMEM; give it shape (1,), or put it in SMEM (pltpu.SMEM(()))"
        )


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
        # An ACC Ref (pltpu.ACC) is entries of an MXU's accumulators, no memref.
        refs = [
            lowering_mxu.alloc_accumulator(ctx.kernel, v.aval) if tpu_mxu.is_acc(v.aval) else alloc(v.aval)
            for v in scratch
        ]
        if plb.poison_buffers_enabled():  # pl.enable_poison_buffers, as JAX 0.12 lowers it
            for v, r in zip(scratch, refs):
                if not isinstance(v.aval.memory_space, plb.SemaphoreSpace) and not tpu_mxu.is_acc(v.aval):
                    store_poison(r, v.aval)
        outs = lower_jaxpr(ctx.kernel, jaxpr, [*consts, *refs])
        lowering_mxu.free_accumulators(ctx.kernel, refs)
        tpu.yield_(outs)
    return list(region.results)
