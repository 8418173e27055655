"""``run_mosaic``'s rules for the ``memref`` dialect: scalar loads and
stores, allocations, reshapes (of ``Buffer`` views, see ``values``)."""

from __future__ import annotations

import numpy as np

from pallas_tpu._src.executor import memory
from pallas_tpu._src.executor.errors import MosaicError, where
from pallas_tpu._src.executor.framework import rule


@rule("memref.load")
def _load(ex, op, vals, env):
    buf, idx = vals[0], vals[1:]
    return [np.asarray(buf.array[memory.slices(buf, idx, (), op)])]


@rule("memref.store")
def _store(ex, op, vals, env):
    val, buf, idx = vals[0], vals[1], vals[2:]
    buf.array[memory.slices(buf, idx, (), op)] = np.asarray(val).astype(buf.array.dtype)


@rule("memref.alloca", "memref.alloc")
def alloca(ex, op, vals, env):
    return [ex.allocate(op)]


@rule("memref.dealloc")
def _dealloc(ex, op, vals, env):
    return None


@rule("memref.reshape", "memref.collapse_shape", "memref.expand_shape")
def reshape(ex, op, vals, env):
    buf = vals[0]
    view = buf.array.reshape(memory.reshaped(op, buf.array.shape))
    if not np.shares_memory(view, buf.array) and view.size:
        raise MosaicError(f"run_mosaic: {where(op)}: reshape of a strided memref view is not supported")
    return [buf.view(view)]
