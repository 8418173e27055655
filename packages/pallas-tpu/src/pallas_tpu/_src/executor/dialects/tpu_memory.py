"""``run_mosaic``'s rules for the ``tpu`` dialect's memory ops (loads and
stores, memref views), DMAs and semaphores, and the ops that ask where the
kernel runs (device, core, grid). DMAs copy when started (on another device
for a remote DMA) and add the bytes copied to the target semaphore (a remote
DMA also to the local source semaphore); a wait takes the bytes of its
descriptor's destination back, and fails if they never come (a deadlock on a
TPU)."""

from __future__ import annotations

import jax
import numpy as np
from jaxlib.mlir import ir

from pallas_tpu._src.executor import memory
from pallas_tpu._src.executor.attrs import array_attr, bool_attr, int_attr, operand, operands
from pallas_tpu._src.executor.dialects import memref, vector
from pallas_tpu._src.executor.errors import MosaicError, where
from pallas_tpu._src.executor.framework import rule
from pallas_tpu._src.executor.values import Buffer, allocate, np_dtype, out_dtype, shape_of

# -- memory ------------------------------------------------------------------


@rule("tpu.load", "tpu.vector_load")
def _load(ex, op, vals, env):
    return vector.load(ex, op, vals, env)


@rule("tpu.strided_load")
def _strided_load(ex, op, vals, env):
    return memory.load(op, operand(op, env, "base"), operands(op, env, "indices"), array_attr(op, "strides"))


@rule("tpu.vector_store")
def _tpu_vector_store(ex, op, vals, env):
    strides = array_attr(op, "strides") or None
    _no_zero_stride(op, strides)
    add = bool_attr(op, "add")
    buf, idx = operand(op, env, "base"), operands(op, env, "indices")
    memory.store(op, buf, idx, operand(op, env, "valueToStore"), operand(op, env, "mask"), strides, add)


@rule("tpu.strided_store")
def _strided_store(ex, op, vals, env):
    buf, idx = operand(op, env, "base"), operands(op, env, "indices")
    strides = array_attr(op, "strides")
    _no_zero_stride(op, strides)
    memory.store(op, buf, idx, operand(op, env, "valueToStore"), strides=strides)


def _no_zero_stride(op, strides) -> None:
    if strides and 0 in list(strides):  # one element written several times: undefined
        raise MosaicError(
            f"{where(op)}: a store with a zero stride (strides {list(strides)}) writes one element several times"
        )


@rule("tpu.store")
def _sublane_store(ex, op, vals, env):
    val = np.asarray(operand(op, env, "valueToStore"))
    mask = None
    if "sublane_mask" in op.attributes:
        rows = np.array(list(ir.DenseBoolArrayAttr(op.attributes["sublane_mask"])), bool)
        reps = val.shape[-2] // max(len(rows), 1)
        mask = np.broadcast_to(np.tile(rows, reps)[:, None], val.shape[-2:])
    memory.store(op, operand(op, env, "base"), operands(op, env, "indices"), val, mask)


@rule("tpu.sem_alloc")
def _sem_alloc(ex, op, vals, env):
    return [ex.allocate(op)]


@rule("tpu.memref_slice")
def _memref_slice(ex, op, vals, env):
    """A view of ``buf`` at ``base_idx``. A slice of a kernel argument may
    reach into its tile padding (JAX's partial blocks copy the padded edge
    tile and mask), but not beyond it."""
    buf = operand(op, env, "mem_ref")
    base = [int(b) for b in operands(op, env, "base_idx")]
    dyn = iter(int(x) for x in operands(op, env, "dynamic_sizes"))
    shape = [next(dyn) if s < 0 else s for s in shape_of(op.operation.results[0].type)]
    full = buf.padded if buf.padded is not None else buf.array
    if len(base) != full.ndim or len(shape) != full.ndim:
        raise MosaicError(
            f"run_mosaic: {where(op)}: {len(base)} indices and a slice of rank {len(shape)} for a memref of "
            f"shape {list(buf.array.shape)}"
        )
    if 0 in shape:  # an empty slice touches nothing, wherever it starts (a DMA of 0 rows)
        return [buf.view(full[tuple(slice(0, min(n, m)) for n, m in zip(shape, full.shape))])]
    sl, keep = [], []
    for d, (b, n) in enumerate(zip(base, shape)):
        if b < 0 or n < 0 or b + n > full.shape[d]:
            padding = (
                f" (stored padded to {list(full.shape)} by its memory tiling)"
                if full is not buf.array
                else ""
            )
            raise MosaicError(
                f"run_mosaic: {where(op)}: slice at {base} of shape {shape} is out of bounds of a "
                f"memref of shape {list(buf.array.shape)} in memory space {buf.space}{padding}"
            )
        sl.append(slice(b, b + n))
        # a slice of a whole dimension keeps that dimension's padding (Mosaic: "the data is padded to tiling")
        keep.append(slice(b, full.shape[d]) if b == 0 and n == buf.array.shape[d] else sl[-1])
    out = buf.view(full[tuple(sl)])
    if any(k != s for k, s in zip(keep, sl)):
        out.padded = full[tuple(keep)]
    return [out]


@rule("tpu.memref_squeeze", "tpu.memref_reshape")
def _memref_reshape(ex, op, vals, env):
    buf = vals[0]
    if isinstance(buf.array, BitcastView):  # a table of byte offsets reshapes as any array
        return [buf.view(buf.array.reshape(memory.reshaped(op, buf.array.shape)))]
    return memref.reshape(ex, op, vals, env)


@rule("tpu.memref_bitcast")
def _memref_bitcast(ex, op, vals, env):
    """The same memory read as another element type. Of the same width, a
    NumPy view. A change of width packs along the second-to-last dimension
    (``(16, 128)`` i32 is ``(32, 128)`` bf16, row ``2r + k`` holding half ``k``,
    least significant first, of row ``r``: JAX's rule), which no NumPy view
    expresses: a ``BitcastView``, whose elements are found through a table of
    their bytes in the allocation."""
    buf = vals[0]
    out_type = op.operation.results[0].type
    dtype = np_dtype(out_type)
    arr = buf.array
    if dtype.itemsize == arr.dtype.itemsize and not isinstance(arr, BitcastView):
        return [buf.view(arr.view(dtype))]
    data, offsets = _byte_table(op, buf, dtype)
    src, dst = arr.dtype.itemsize, dtype.itemsize
    if src != dst and (arr.ndim < 2 or (arr.shape[-2] * src) % dst):
        raise MosaicError(
            f"run_mosaic: {where(op)}: a bitcast of a memref of shape {list(arr.shape)} from {arr.dtype.name} "
            f"to {dtype.name}: the second-to-last dimension times {src} bytes must be a multiple of {dst}"
        )
    *lead, m, n = arr.shape if arr.ndim >= 2 else (None, None)
    if src > dst:  # each element's bytes split in k parts, part j the rows' (k * r + j)
        k = src // dst
        offsets = np.moveaxis(offsets.reshape(*lead, m, n, k, dst), -2, -3).reshape(*lead, m * k, n, dst)
    elif src < dst:  # rows k * r .. k * r + k - 1 the k parts of row r
        k = dst // src
        offsets = np.moveaxis(offsets.reshape(*lead, m // k, k, n, src), -3, -2).reshape(
            *lead, m // k, n, dst
        )
    out = BitcastView(data, offsets, dtype)
    if out.shape != tuple(shape_of(out_type)):
        raise MosaicError(
            f"run_mosaic: {where(op)}: a bitcast of a memref of shape {list(arr.shape)} from {arr.dtype.name} "
            f"gives shape {list(out.shape)}, not the result type's {list(shape_of(out_type))}"
        )
    return [buf.view(out)]


def _byte_table(op, buf: Buffer, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the allocation's bytes, flat; per element of ``buf`` the offsets of its bytes there)."""
    arr = buf.array
    if isinstance(arr, BitcastView):
        return arr.data, arr.offsets
    root = buf.root
    if root is None or not root.flags.c_contiguous:
        raise MosaicError(f"run_mosaic: {where(op)}: a bitcast of a memref that is not part of an allocation")
    for d in (arr.dtype, dtype):
        if d == np.bool_ or d.itemsize * 8 != jax.dtypes.itemsize_bits(d):  # i1, and 4-bit types
            raise MosaicError(f"run_mosaic: {where(op)}: a width-changing bitcast of {d.name} elements")
    start = arr.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    offsets = np.full(arr.shape + (arr.dtype.itemsize,), start, np.int64)
    for d, (size, stride) in enumerate(zip(arr.shape, arr.strides)):
        offsets += (np.arange(size, dtype=np.int64) * stride).reshape(
            [-1 if e == d else 1 for e in range(arr.ndim + 1)]
        )
    offsets += np.arange(arr.dtype.itemsize, dtype=np.int64)
    return root.reshape(-1).view(np.uint8), offsets


class BitcastView:
    """A memref whose elements are not a NumPy view of their allocation (a
    width-changing bitcast): ``data`` is the allocation's bytes and
    ``offsets[..., b]`` the position there of byte ``b`` of each element. It
    answers what the executor asks of a memref's array: ``shape``/``dtype``,
    indexing (a view: the table indexed), assignment (written through),
    ``reshape``, ``astype``/``copy``/``np.asarray`` (the values)."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray, dtype):
        self.data, self.offsets, self.dtype = data, offsets, np.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.offsets.shape[:-1]

    @property
    def ndim(self) -> int:
        return self.offsets.ndim - 1

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def _key(self, key):
        key = key if isinstance(key, tuple) else (key,)
        return key if Ellipsis in key else key + (Ellipsis,)

    def __getitem__(self, key) -> BitcastView:
        return BitcastView(self.data, self.offsets[self._key(key)], self.dtype)

    def __setitem__(self, key, value) -> None:
        at = self.offsets[self._key(key)]
        value = np.ascontiguousarray(np.broadcast_to(np.asarray(value).astype(self.dtype), at.shape[:-1]))
        self.data[at] = value.reshape(-1).view(np.uint8).reshape(at.shape)

    def __array__(self, dtype=None, copy=None):
        out = self.data[self.offsets].reshape(-1).view(self.dtype).reshape(self.shape)
        return out if dtype is None else out.astype(dtype)

    def reshape(self, *shape) -> BitcastView:
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return BitcastView(self.data, self.offsets.reshape(*dims, self.dtype.itemsize), self.dtype)

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    def copy(self) -> np.ndarray:
        return np.asarray(self)

    def __add__(self, other):
        return np.asarray(self) + other


# -- DMAs and semaphores -----------------------------------------------------


def _sem(op, buf, what) -> Buffer:
    if not isinstance(buf, Buffer) or not buf.is_semaphore or buf.array.shape != ():
        raise MosaicError(f"run_mosaic: {where(op)}: {what} is not a single semaphore")
    return buf


def _target_device(ex, op, env):
    """The unit (device and core) an op's ``device_id``/``core_id`` name: by
    default this device, and the same core (of the other device)."""
    mesh = ex.mesh
    core = ex.core
    if hasattr(op, "core_id") and op.core_id is not None:
        core = int(env[op.core_id])
        if not 0 <= core < mesh.num_cores:
            raise MosaicError(
                f"run_mosaic: {where(op)}: core_id {core} is outside the {mesh.num_cores} "
                f"core{'s' if mesh.num_cores > 1 else ''} of a device (core ids 0..{mesh.num_cores - 1}; "
                "run_mosaic's num_cores)"
            )
    dev = operand(op, env, "device_id") if hasattr(op, "device_id") else None
    dev = ex.chip if dev is None else int(dev)
    mesh.check_device(dev)
    return dev * mesh.num_cores + core


def _wait(ex, op, sem, amount, what):
    mesh = ex.mesh
    with mesh.cv:
        desc = f"{mesh.name(ex.device)} waits at {where(op)} for {amount} on {what}"
        mesh.wait(
            ex.device, lambda: int(sem.array) >= amount, desc + f" (holding {int(sem.array)})", who=ex.device
        )
        sem.array[...] -= amount


@rule("tpu.sem_signal")
def _sem_signal(ex, op, vals, env):
    sem = _sem(op, operand(op, env, "semaphore"), "the signalled value")
    dev = _target_device(ex, op, env)
    with ex.mesh.cv:
        target = sem if dev == ex.device else sem.on(ex.mesh, dev)
        target.array[...] += int(operand(op, env, "amount"))
        ex.mesh.cv.notify_all()


@rule("tpu.sem_wait")
def _sem_wait(ex, op, vals, env):
    sem = _sem(op, operand(op, env, "semaphore"), "the awaited value")
    _wait(ex, op, sem, int(operand(op, env, "amount")), "a semaphore")


@rule("tpu.sem_read")
def _sem_read(ex, op, vals, env):
    with ex.mesh.cv:
        return [np.asarray(_sem(op, vals[0], "the read value").array, np.int32)]


@rule("tpu.sem_barrier")
def _sem_barrier(ex, op, vals, env):
    key = ("barrier",)
    with ex.mesh.cv:
        if key not in ex.mesh.roots[ex.device]:
            buf = allocate(op.operation.results[0].type, key)
            ex.mesh.roots[ex.device][key] = buf.root
            ex.mesh.cv.notify_all()
        root = ex.mesh.roots[ex.device][key]
    return [Buffer(root, "semaphore_mem", True, key, root)]


@rule("tpu.enqueue_dma")
def _enqueue_dma(ex, op, vals, env):
    src, dst = operand(op, env, "source"), operand(op, env, "target")
    dev = _target_device(ex, op, env)
    if src.array.shape != dst.array.shape:
        raise MosaicError(
            f"run_mosaic: {where(op)}: DMA from shape {list(src.array.shape)} to shape {list(dst.array.shape)}"
        )
    tsem = _sem(op, operand(op, env, "target_semaphore"), "the DMA's target semaphore")
    ssem = operand(op, env, "source_semaphore")
    mesh = ex.mesh
    if dev != ex.device:
        dst, tsem = dst.on(mesh, dev), tsem.on(mesh, dev)
    with mesh.cv:
        dst.array[...] = src.array.astype(dst.array.dtype)
        tsem.array[...] += dst.array.nbytes
        if ssem is not None:
            _sem(op, ssem, "the DMA's source semaphore").array[...] += dst.array.nbytes
        mesh.cv.notify_all()


@rule("tpu.wait_dma2", "tpu.wait_dma")
def _wait_dma(ex, op, vals, env):
    if "wait_target" in op.attributes:  # JAX 0.12's form: the enqueue's operands and which side to wait for
        target = bool_attr(op, "wait_target")
        sem_name, ref_name = ("target_semaphore", "target") if target else ("source_semaphore", "source")
        sem = _sem(op, operand(op, env, sem_name), f"the DMA's {sem_name.replace('_', ' ')}")
        ref = operand(op, env, ref_name)
    else:
        sem = _sem(op, operand(op, env, "semaphore"), "the DMA semaphore")
        ref = operand(op, env, "dst") if hasattr(op, "dst") else operand(op, env, "ref")
    _wait(ex, op, sem, ref.array.nbytes, f"a DMA semaphore (a DMA of {ref.array.nbytes} bytes)")


@rule("tpu.device_id")
def _device_id(ex, op, vals, env):
    return [np.asarray(ex.chip, out_dtype(op))]


@rule("tpu.core_id", "tpu.subcore_id")
def _core_id(ex, op, vals, env):
    return [np.asarray(ex.core, out_dtype(op))]


@rule("tpu.annotate")
def _annotate(ex, op, vals, env):
    """Access hints; JAX's form gives the memref back (the same memory)."""
    return [vals[0]] if len(op.operation.results) else None


@rule(
    "tpu.trace_start",
    "tpu.trace_stop",
    "tpu.delay",
    "tpu.log",
    "tpu.trace_value",
)
def _nothing(ex, op, vals, env):
    return None


# -- the grid, regions ---------------------------------------------------------


@rule("tpu.iteration_bound")
def _iteration_bound(ex, op, vals, env):
    """The grid's size along ``dim`` (a dynamic size: the operand given for it)."""
    dim = int_attr(op, "dim")
    bounds = ex.iteration_bounds
    if not 0 <= dim < len(bounds):
        raise MosaicError(f"run_mosaic: {where(op)}: the grid has {len(bounds)} dimensions, not {dim + 1}")
    return [np.asarray(bounds[dim], out_dtype(op))]


@rule("tpu.region", "tpu.trace", regions=True)
def _region(ex, op, vals, env, regions):
    return ex.run(regions[0], [], env)


@rule("tpu.assume_multiple", "tpu.assume_layout", "tpu.erase_memref_layout")
def _identity(ex, op, vals, env):
    return [vals[0]]
