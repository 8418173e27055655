"""``run_mosaic``'s values (see ``run.py``): vectors are NumPy arrays, scalars
0-d arrays, memrefs ``Buffer``s (a NumPy view and its memory space); MLIR
types map to NumPy dtypes here, and fresh memory is filled here."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import ml_dtypes
import numpy as np

from pallas import backend as plb
from pallas_tpu._src.executor.attrs import enum_attr
from pallas_tpu._src.executor.errors import MosaicError


@dataclasses.dataclass
class Buffer:
    """A memref: a NumPy view and its memory space (``vmem``, ``smem``,
    ``any``/``hbm``, ``semaphore_mem``). Semaphore memrefs hold int64 counts.
    ``key`` names the allocation the view is part of, the same on every device
    (a window, a scratch operand, an alloca), and ``root`` is that
    allocation's array on this device: a remote DMA or signal reaches the
    same part of the same allocation on another device (``on``).

    ``padded``, where set, is the tile-padded storage whose corner
    ``[:n0, :n1, ...]`` is ``array``: a kernel argument (an HBM array or a
    whole-array VMEM window) is stored padded to its memory tiling, as
    Mosaic's ``infer-memref-layout`` lays it out, and ``tpu.memref_slice``
    may cut into that padding (see ``memory.tiled_shape``)."""

    array: np.ndarray
    space: str
    is_semaphore: bool = False
    key: Any = None
    root: np.ndarray | None = None
    padded: np.ndarray | None = None

    def view(self, array) -> Buffer:
        return Buffer(array, self.space, self.is_semaphore, self.key, self.root)

    def on(self, mesh, device: int) -> Buffer:
        """This view of the same allocation on ``device`` (of a ``mesh.Mesh``)."""
        other = mesh.root(device, self.key)
        root = typing.cast(np.ndarray, self.root)  # a shared allocation (a key) has a root
        offset = self.array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        arr = np.ndarray(
            self.array.shape, self.array.dtype, buffer=other, offset=offset, strides=self.array.strides
        )
        return Buffer(arr, self.space, self.is_semaphore, self.key, other)


_DTYPES = {
    "f32": np.float32,
    "f64": np.float64,
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "i1": np.bool_,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "index": np.int64,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn,
    "f8E5M2": ml_dtypes.float8_e5m2,
    "i4": ml_dtypes.int4,
    "i2": ml_dtypes.int2,
}
UNSIGNED = {
    np.dtype(np.int8): np.uint8,
    np.dtype(np.int16): np.uint16,
    np.dtype(np.int32): np.uint32,
    np.dtype(np.int64): np.uint64,
    np.dtype(ml_dtypes.int4): ml_dtypes.uint4,
    np.dtype(ml_dtypes.int2): ml_dtypes.uint2,
}


def element_type(t) -> str:
    """The element type's name (``f32``, ``bf16``, ``i32``,
    ``!tpu.dma_semaphore``): a type, printed, not an attribute parsed. The
    builtin types have classes in jaxlib's bindings, but the ``tpu`` dialect's
    semaphore types have none (only ``tpu.Float8EXMYType`` does), and a name
    keys the dtype table."""
    from jaxlib.mlir import ir

    if isinstance(t, ir.ShapedType):
        return str(ir.ShapedType(t).element_type)
    return str(t)


def np_dtype(t) -> np.dtype:
    name = element_type(t)
    if name not in _DTYPES:
        raise MosaicError(f"run_mosaic: element type {name} is not supported")
    return np.dtype(_DTYPES[name])


def shape_of(t) -> tuple[int, ...]:
    from jaxlib.mlir import ir

    return tuple(ir.ShapedType(t).shape) if isinstance(t, ir.ShapedType) else ()


def memory_space(mt) -> str:
    ms = mt.memory_space
    if ms is None:
        return "any"
    return enum_attr(ms)


def uninitialized(shape, dtype) -> np.ndarray:
    """Memory nothing has written yet, filled by pallas-core's policy
    (``pallas.backend.uninitialized_fill``): NaN for floats, the smallest value
    for integers (0 for unsigned ones), False for bools. A memref's dtype is
    all run_mosaic sees: a Pallas bool scratch buffer is an i32 memref, and
    starts as int32 does."""
    dtype = np.dtype(dtype)
    return np.full(shape, plb.uninitialized_fill(dtype), dtype)


def allocate(t, key=None) -> Buffer:
    """A fresh buffer for a memref type (scratch operands, allocas)."""
    from jaxlib.mlir import ir

    mt = ir.MemRefType(t)
    if "semaphore" in element_type(t):
        arr = np.zeros(tuple(mt.shape), np.int64)
        return Buffer(arr, "semaphore_mem", True, key, arr)
    arr = uninitialized(tuple(mt.shape), np_dtype(t))
    return Buffer(arr, memory_space(mt), False, key, arr)


# -- values of an op's results -------------------------------------------------


def out_dtype(op, i=0) -> np.dtype:
    return np_dtype(op.operation.results[i].type)


def cast(x, op, i=0):
    return np.asarray(x).astype(out_dtype(op, i))


def f32(x):
    """16-bit floats computed in float32 (rounded to the result type by ``cast``)."""
    x = np.asarray(x)
    return (
        x.astype(np.float32)
        if x.dtype.itemsize < 4 and x.dtype.kind in "fV" or x.dtype == ml_dtypes.bfloat16
        else x
    )


def unsigned(x):
    x = np.asarray(x)
    return x.view(UNSIGNED[x.dtype]) if x.dtype in UNSIGNED else x


_SIGNED = {np.dtype(u): s for s, u in UNSIGNED.items()}


def signed(x):
    """``x``'s bit patterns read as signed (MLIR integers are signless: a value loaded
    from a uint16 buffer is an i16 that ``shrsi``, ``extsi`` and ``cmpi slt`` read as signed)."""
    x = np.asarray(x)
    return x.view(_SIGNED[x.dtype]) if x.dtype in _SIGNED else x


# -- bit patterns --------------------------------------------------------------


def width(t) -> int:
    """The bit width of an MLIR element type (or of a shaped type's elements)."""
    from jaxlib.mlir import ir

    if isinstance(t, ir.ShapedType):
        t = ir.ShapedType(t).element_type
    if isinstance(t, ir.IntegerType):
        return ir.IntegerType(t).width
    if isinstance(t, ir.FloatType):
        return ir.FloatType(t).width
    raise MosaicError(f"run_mosaic: element type {t} has no bit width")


def to_bits(x, width: int) -> np.ndarray:
    """The bit patterns of ``x`` (elements of ``width`` bits) as uint64."""
    x = np.asarray(x)
    if width < 8:  # int4 and friends: one value per byte
        return (x.astype(np.int8).view(np.uint8) & ((1 << width) - 1)).astype(np.uint64)
    return x.view(np.dtype(f"uint{width}")).astype(np.uint64)


def from_bits(bits, dtype, width: int) -> np.ndarray:
    """``width``-bit patterns (uint64) as values of ``dtype``."""
    bits = np.asarray(bits, np.uint64) & np.uint64((1 << width) - 1)
    if width < 8:
        signed = bits.astype(np.int64) - np.where(bits >> np.uint64(width - 1), 1 << width, 0)
        return signed.astype(dtype)
    return bits.astype(np.dtype(f"uint{width}")).view(dtype)
