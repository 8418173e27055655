"""Memory for ``run_mosaic``'s rules (see ``run.py``): bounds-checked loads
and stores of memref views, memref reshapes, and the tiled layout in which
Mosaic stores a kernel argument (its padding, and what the padding holds)."""

from __future__ import annotations

import numpy as np
from jaxlib.mlir import ir

from pallas_tpu._src.executor.errors import MosaicError, where
from pallas_tpu._src.executor.values import Buffer, element_type, memory_space, np_dtype, shape_of


def slices(buf: Buffer, idx, shape, op, strides=None):
    """Index expression of a ``shape``-sized access at ``idx`` (leading memref
    dims beyond the vector's rank are indexed by one element), bounds checked."""
    arr = buf.array
    lead = arr.ndim - len(shape)
    if lead < 0 or len(idx) != arr.ndim:
        raise MosaicError(
            f"run_mosaic: {where(op)}: {len(idx)} indices and shape {list(shape)} for a memref of shape {list(arr.shape)}"
        )
    out = []
    for d, i in enumerate(idx):
        i = int(i)
        size = 1 if d < lead else shape[d - lead]
        step = strides[d] if strides else 1
        if i < 0 or i + (size - 1) * step >= arr.shape[d] or size == 0 and i > arr.shape[d]:
            raise MosaicError(
                f"run_mosaic: {where(op)}: access at {[int(j) for j in idx]} of shape {list(shape)} "
                f"(strides {strides or 1}) is out of bounds of a {buf.space} memref of shape {list(arr.shape)}"
            )
        # Stride 0 (``pl.ds(i, n, 0)``): the element at ``i``, broadcast by ``load``.
        out.append(i if d < lead else slice(i, i + (size - 1) * step + 1, step) if step else slice(i, i + 1))
    return tuple(out)


def load(op, buf, idx, strides=None):
    shape = shape_of(op.operation.results[0].type)
    return [np.broadcast_to(buf.array[slices(buf, idx, shape, op, strides)], shape).copy()]


def store(op, buf, idx, val, mask=None, strides=None, add=False):
    val = np.asarray(val)
    if strides and 0 in strides:
        raise MosaicError(f"run_mosaic: {where(op)}: a strided store with stride 0 (strides {list(strides)})")
    sl = slices(buf, idx, val.shape, op, strides)
    val = val.astype(buf.array.dtype)
    if add:
        val = (buf.array[sl] + val).astype(buf.array.dtype)
    if mask is not None:
        val = np.where(mask, val, buf.array[sl])
    buf.array[sl] = val


def _tiling_factor(num_128s: int, bitwidth: int) -> int:
    """Mosaic's ``getTilingFactor`` (infer_memref_layout.cc) for TPU v4 and
    later with XLA's default tiling flags: the rows of a memory tile."""
    packing = 32 // bitwidth
    if num_128s >= 8:  # tall enough for a whole (8, 128) tile
        return 8
    tiling = packing
    while tiling < min(num_128s, 8):
        tiling *= 2
    return tiling


def tiled_shape(t) -> tuple[int, ...]:
    """The shape a kernel argument of memref type ``t`` occupies in memory:
    Mosaic's ``infer-memref-layout`` gives it a tiled layout and pads its
    tiled dimensions to whole tiles (``(rows, 128)`` tiles on the last two
    dimensions, ``rows * 128`` elements for a 1-D memref); the padding holds
    whatever the memory held. Semaphores, SMEM, 0-d memrefs and elements
    narrower than 4 bits are not tiled here."""
    mt = ir.MemRefType(t)
    shape = tuple(mt.shape)
    if not shape or memory_space(mt) in ("smem", "semaphore_mem") or "semaphore" in element_type(t):
        return shape
    bits = np_dtype(t).itemsize * 8 if element_type(t) != "i4" else 4
    if element_type(t) == "i1" or bits > 32:
        return shape
    up = lambda n, m: -(-n // m) * m  # noqa: E731
    if len(shape) == 1:
        return (up(shape[0], _tiling_factor(-(-shape[0] // 128), bits) * 128),)
    rows = _tiling_factor(shape[-2], bits)
    return (*shape[:-2], up(shape[-2], rows), up(shape[-1], 128))


def reshaped(op, src: tuple[int, ...]) -> tuple[int, ...]:
    """The result shape of a memref reshape or squeeze of a ``src``-shaped
    view (the result type's, with its dynamic dimensions filled in). A
    squeeze drops the static size-1 dimensions of the operand type that the
    result type lacks (matched from the minor end, as Mosaic does); a reshape
    may have one dynamic dimension."""
    want = shape_of(op.operation.results[0].type)
    if all(w >= 0 for w in want):
        return want
    if op.operation.name == "tpu.memref_squeeze":
        have = shape_of(op.operation.operands[0].type)
        kept, j = [], len(want) - 1
        for i in reversed(range(len(have))):
            if j >= 0 and (have[i] == want[j] or have[i] < 0 and want[j] < 0):
                kept.append(i)
                j -= 1
            elif have[i] != 1:
                break
        if j < 0 and len(kept) == len(want):
            return tuple(src[i] for i in reversed(kept))
    elif sum(w < 0 for w in want) == 1:
        rest = int(np.prod([w for w in want if w >= 0]))
        if rest and int(np.prod(src)) % rest == 0:
            return tuple(int(np.prod(src)) // rest if w < 0 else w for w in want)
    raise MosaicError(
        f"run_mosaic: {where(op)}: cannot reshape a memref view of shape {list(src)} to {op.operation.results[0].type}"
    )
