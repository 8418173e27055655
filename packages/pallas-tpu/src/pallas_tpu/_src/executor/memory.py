"""``run_mosaic`` rules for memory (loads, stores, memref views), DMAs and
semaphores, and control flow (see ``run.py``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from jaxlib.mlir import ir

from pallas_tpu._src.executor.ops import (
    Buffer,
    MosaicError,
    _array_attr,
    _operand,
    _operands,
    _out_dtype,
    allocate,
    bool_attr,
    element_type,
    memory_space,
    np_dtype,
    rule,
    shape_of,
    where,
)

# -- memory ------------------------------------------------------------------


def _slices(buf: Buffer, idx, shape, op, strides=None):
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
        out.append(i if d < lead else slice(i, i + (size - 1) * step + 1, step))
    return tuple(out)


def _load(op, buf, idx, strides=None):
    shape = shape_of(op.operation.results[0].type)
    return [buf.array[_slices(buf, idx, shape, op, strides)].copy()]


def _store(op, buf, idx, val, mask=None, strides=None, add=False):
    val = np.asarray(val)
    sl = _slices(buf, idx, val.shape, op, strides)
    val = val.astype(buf.array.dtype)
    if add:
        val = (buf.array[sl] + val).astype(buf.array.dtype)
    if mask is not None:
        val = np.where(mask, val, buf.array[sl])
    buf.array[sl] = val


@rule("vector.load", "tpu.load", "tpu.vector_load")
def _vector_load(ex, op, vals, env):
    return _load(op, _operand(op, env, "base"), _operands(op, env, "indices"))


@rule("tpu.strided_load")
def _strided_load(ex, op, vals, env):
    return _load(op, _operand(op, env, "base"), _operands(op, env, "indices"), _array_attr(op, "strides"))


@rule("vector.store")
def _vector_store(ex, op, vals, env):
    _store(op, _operand(op, env, "base"), _operands(op, env, "indices"), _operand(op, env, "valueToStore"))


@rule("tpu.vector_store")
def _tpu_vector_store(ex, op, vals, env):
    strides = _array_attr(op, "strides") or None
    add = bool_attr(op, "add")
    buf, idx = _operand(op, env, "base"), _operands(op, env, "indices")
    _store(op, buf, idx, _operand(op, env, "valueToStore"), _operand(op, env, "mask"), strides, add)


@rule("tpu.strided_store")
def _strided_store(ex, op, vals, env):
    buf, idx = _operand(op, env, "base"), _operands(op, env, "indices")
    _store(op, buf, idx, _operand(op, env, "valueToStore"), strides=_array_attr(op, "strides"))


@rule("tpu.store")
def _sublane_store(ex, op, vals, env):
    val = np.asarray(_operand(op, env, "valueToStore"))
    mask = None
    if "sublane_mask" in op.attributes:
        rows = np.array(list(ir.DenseBoolArrayAttr(op.attributes["sublane_mask"])), bool)
        reps = val.shape[-2] // max(len(rows), 1)
        mask = np.broadcast_to(np.tile(rows, reps)[:, None], val.shape[-2:])
    _store(op, _operand(op, env, "base"), _operands(op, env, "indices"), val, mask)


@rule("memref.load")
def _memref_load(ex, op, vals, env):
    buf, idx = vals[0], vals[1:]
    return [np.asarray(buf.array[_slices(buf, idx, (), op)])]


@rule("memref.store")
def _memref_store(ex, op, vals, env):
    val, buf, idx = vals[0], vals[1], vals[2:]
    buf.array[_slices(buf, idx, (), op)] = np.asarray(val).astype(buf.array.dtype)


@rule("memref.alloca", "memref.alloc", "tpu.sem_alloc")
def _alloca(ex, op, vals, env):
    return [ex.allocate(op)]


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


def padding_fill(dtype) -> np.ndarray:
    """What tile padding holds before anything writes it: NaN for floats, the
    most negative value for integers (not a plausible result, so a read of
    padding that reaches a visible output shows)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fV" or dtype == np.dtype(ml_dtypes.bfloat16):
        return np.array(np.nan, dtype)
    if dtype.kind == "b":
        return np.array(True)
    info = ml_dtypes.iinfo(dtype) if dtype == np.dtype(ml_dtypes.int4) else np.iinfo(dtype)
    return np.array(info.min, dtype)


@rule("tpu.memref_slice")
def _memref_slice(ex, op, vals, env):
    """A view of ``buf`` at ``base_idx``. A slice of a kernel argument may
    reach into its tile padding (JAX's partial blocks copy the padded edge
    tile and mask), but not beyond it."""
    buf = _operand(op, env, "mem_ref")
    base = [int(b) for b in _operands(op, env, "base_idx")]
    dyn = iter(int(x) for x in _operands(op, env, "dynamic_sizes"))
    shape = [next(dyn) if s < 0 else s for s in shape_of(op.operation.results[0].type)]
    full = buf.padded if buf.padded is not None else buf.array
    if len(base) != full.ndim or len(shape) != full.ndim:
        raise MosaicError(
            f"run_mosaic: {where(op)}: {len(base)} indices and a slice of rank {len(shape)} for a memref of "
            f"shape {list(buf.array.shape)}"
        )
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


def _reshaped(op, src: tuple[int, ...]) -> tuple[int, ...]:
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


@rule(
    "tpu.memref_squeeze",
    "tpu.memref_reshape",
    "memref.reshape",
    "memref.collapse_shape",
    "memref.expand_shape",
)
def _memref_reshape(ex, op, vals, env):
    buf = vals[0]
    view = buf.array.reshape(_reshaped(op, buf.array.shape))
    if not np.shares_memory(view, buf.array) and view.size:
        raise MosaicError(f"run_mosaic: {where(op)}: reshape of a strided memref view is not supported")
    return [buf.view(view)]


@rule("tpu.memref_bitcast")
def _memref_bitcast(ex, op, vals, env):
    buf = vals[0]
    dtype = np_dtype(op.operation.results[0].type)
    if dtype.itemsize != buf.array.dtype.itemsize:
        raise MosaicError(
            f"run_mosaic: {where(op)}: bitcasts that change the element width are not supported"
        )
    return [buf.view(buf.array.view(dtype))]


# -- DMAs and semaphores -----------------------------------------------------
# DMAs copy when started (on another device for a remote DMA) and add the bytes
# copied to the target semaphore (a remote DMA also to the local source
# semaphore); a wait takes the bytes of its descriptor's destination back.


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
    dev = _operand(op, env, "device_id") if hasattr(op, "device_id") else None
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
    sem = _sem(op, _operand(op, env, "semaphore"), "the signalled value")
    dev = _target_device(ex, op, env)
    with ex.mesh.cv:
        target = sem if dev == ex.device else sem.on(ex.mesh, dev)
        target.array[...] += int(_operand(op, env, "amount"))
        ex.mesh.cv.notify_all()


@rule("tpu.sem_wait")
def _sem_wait(ex, op, vals, env):
    sem = _sem(op, _operand(op, env, "semaphore"), "the awaited value")
    _wait(ex, op, sem, int(_operand(op, env, "amount")), "a semaphore")


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
    src, dst = _operand(op, env, "source"), _operand(op, env, "target")
    dev = _target_device(ex, op, env)
    if src.array.shape != dst.array.shape:
        raise MosaicError(
            f"run_mosaic: {where(op)}: DMA from shape {list(src.array.shape)} to shape {list(dst.array.shape)}"
        )
    tsem = _sem(op, _operand(op, env, "target_semaphore"), "the DMA's target semaphore")
    ssem = _operand(op, env, "source_semaphore")
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
        sem = _sem(op, _operand(op, env, sem_name), f"the DMA's {sem_name.replace('_', ' ')}")
        ref = _operand(op, env, ref_name)
    else:
        sem = _sem(op, _operand(op, env, "semaphore"), "the DMA semaphore")
        ref = _operand(op, env, "dst") if hasattr(op, "dst") else _operand(op, env, "ref")
    _wait(ex, op, sem, ref.array.nbytes, f"a DMA semaphore (a DMA of {ref.array.nbytes} bytes)")


@rule("tpu.device_id")
def _device_id(ex, op, vals, env):
    return [np.asarray(ex.chip, _out_dtype(op))]


@rule("tpu.core_id", "tpu.subcore_id")
def _core_id(ex, op, vals, env):
    return [np.asarray(ex.core, _out_dtype(op))]


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
    "memref.dealloc",
)
def _nothing(ex, op, vals, env):
    return None


# -- control flow ------------------------------------------------------------


@rule("scf.if")
def _if(ex, op, vals, env):
    region = op.regions[0] if bool(vals[0]) else op.regions[1]
    return ex.region(region, [], env) if len(region.blocks) else []


@rule("scf.for")
def _for(ex, op, vals, env):
    lb, ub, step, *carry = vals
    i = lb
    while i < ub:
        carry = ex.region(op.regions[0], [i, *carry], env)
        i = type(np.asarray(lb)[()])(i + step)
    return carry


@rule("scf.while")
def _while(ex, op, vals, env):
    carry = vals
    while True:
        cond, *args = ex.region(op.regions[0], carry, env)
        if not bool(cond):
            return args
        carry = ex.region(op.regions[1], args, env)


@rule("scf.index_switch")
def _switch(ex, op, vals, env):
    cases = _array_attr(op, "cases")
    k = int(vals[0])
    region = op.regions[1 + cases.index(k)] if k in cases else op.regions[0]
    return ex.region(region, [], env)


@rule("tpu.iteration_bound")
def _iteration_bound(ex, op, vals, env):
    """The grid's size along ``dim`` (a dynamic size: the operand given for it)."""
    dim = ir.IntegerAttr(op.attributes["dim"]).value
    bounds = ex.iteration_bounds
    if not 0 <= dim < len(bounds):
        raise MosaicError(f"run_mosaic: {where(op)}: the grid has {len(bounds)} dimensions, not {dim + 1}")
    return [np.asarray(bounds[dim], _out_dtype(op))]


@rule("tpu.region", "tpu.trace")
def _region(ex, op, vals, env):
    return ex.region(op.regions[0], [], env)


@rule("func.call")
def _call(ex, op, vals, env):
    name = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    return ex.call(ex.funcs[name], vals)
