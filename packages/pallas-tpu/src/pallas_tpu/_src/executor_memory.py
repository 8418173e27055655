"""``run_mosaic`` rules for memory (loads, stores, memref views), DMAs and
semaphores, and control flow (see ``executor.py``)."""

from __future__ import annotations

import re

import numpy as np

from pallas_tpu._src.executor_ops import (
    Buffer,
    MosaicError,
    _array_attr,
    _operand,
    _operands,
    _out_dtype,
    allocate,
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
    add = "add" in op.attributes and str(op.attributes["add"]) == "true"
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
        rows = np.array([s == "true" for s in re.findall(r"true|false", str(op.attributes["sublane_mask"]))])
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


@rule("tpu.memref_slice")
def _memref_slice(ex, op, vals, env):
    buf = _operand(op, env, "mem_ref")
    base = _operands(op, env, "base_idx")
    dyn = iter(int(x) for x in _operands(op, env, "dynamic_sizes"))
    shape = [next(dyn) if s < 0 else s for s in shape_of(op.operation.results[0].type)]
    sl = []
    for d, (b, n) in enumerate(zip(base, shape)):
        b = int(b)
        if b < 0 or b + n > buf.array.shape[d]:
            raise MosaicError(
                f"run_mosaic: {where(op)}: slice at {[int(x) for x in base]} of shape {shape} is out of bounds "
                f"of a memref of shape {list(buf.array.shape)}"
            )
        sl.append(slice(b, b + n))
    return [buf.view(buf.array[tuple(sl)])]


@rule(
    "tpu.memref_squeeze",
    "tpu.memref_reshape",
    "memref.reshape",
    "memref.collapse_shape",
    "memref.expand_shape",
)
def _memref_reshape(ex, op, vals, env):
    buf = vals[0]
    shape = shape_of(op.operation.results[0].type)
    view = buf.array.reshape(shape)
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
    if hasattr(op, "core_id") and op.core_id is not None and int(env[op.core_id]) != 0:
        raise MosaicError(
            f"run_mosaic: {where(op)}: core_id {int(env[op.core_id])}: run_mosaic runs one core per device"
        )
    dev = _operand(op, env, "device_id") if hasattr(op, "device_id") else None
    return ex.device if dev is None else int(dev)


def _wait(ex, op, sem, amount, what):
    mesh = ex.mesh
    with mesh.cv:
        desc = f"device {ex.device} waits at {where(op)} for {amount} on {what}"
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
        target = str(op.attributes["wait_target"]) == "true"
        sem_name, ref_name = ("target_semaphore", "target") if target else ("source_semaphore", "source")
        sem = _sem(op, _operand(op, env, sem_name), f"the DMA's {sem_name.replace('_', ' ')}")
        ref = _operand(op, env, ref_name)
    else:
        sem = _sem(op, _operand(op, env, "semaphore"), "the DMA semaphore")
        ref = _operand(op, env, "dst") if hasattr(op, "dst") else _operand(op, env, "ref")
    _wait(ex, op, sem, ref.array.nbytes, f"a DMA semaphore (a DMA of {ref.array.nbytes} bytes)")


@rule("tpu.device_id")
def _device_id(ex, op, vals, env):
    return [np.asarray(ex.device, _out_dtype(op))]


@rule("tpu.core_id", "tpu.subcore_id")
def _core_id(ex, op, vals, env):
    return [np.zeros((), _out_dtype(op))]


@rule(
    "tpu.trace_start",
    "tpu.trace_stop",
    "tpu.delay",
    "tpu.log",
    "tpu.trace_value",
    "tpu.annotate",
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


@rule("tpu.region", "tpu.trace")
def _region(ex, op, vals, env):
    return ex.region(op.regions[0], [], env)


@rule("func.call")
def _call(ex, op, vals, env):
    name = str(op.attributes["callee"]).lstrip("@")
    return ex.call(ex.funcs[name], vals)
