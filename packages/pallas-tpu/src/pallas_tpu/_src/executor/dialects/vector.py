"""``run_mosaic``'s rules for the ``vector`` dialect: loads and stores,
broadcasts and shape casts, reductions, transposes, extracts."""

from __future__ import annotations

import numpy as np

from pallas_tpu._src.executor import memory
from pallas_tpu._src.executor.attrs import array_attr, enum_attr, operand, operands
from pallas_tpu._src.executor.errors import MosaicError, where
from pallas_tpu._src.executor.framework import rule
from pallas_tpu._src.executor.values import cast, f32, out_dtype, shape_of, unsigned


@rule("vector.load")
def load(ex, op, vals, env):
    return memory.load(op, operand(op, env, "base"), operands(op, env, "indices"))


@rule("vector.store")
def _store(ex, op, vals, env):
    memory.store(op, operand(op, env, "base"), operands(op, env, "indices"), operand(op, env, "valueToStore"))


@rule("vector.broadcast", "vector.splat")
def _broadcast(ex, op, vals, env):
    shape = shape_of(op.operation.results[0].type)
    return [np.broadcast_to(np.asarray(vals[0]), shape).astype(out_dtype(op))]


@rule("vector.shape_cast")
def reshape(ex, op, vals, env):
    return [np.asarray(vals[0]).reshape(shape_of(op.operation.results[0].type))]


REDUCE = {
    "add": np.add,
    "mul": np.multiply,
    "maxsi": np.maximum,
    "maxui": np.maximum,
    "minui": np.minimum,
    "maxnumf": np.fmax,
    "maximumf": np.maximum,
    "minsi": np.minimum,
    "minnumf": np.fmin,
    "minimumf": np.minimum,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "max": np.maximum,
    "min": np.minimum,
    "sum": np.add,
}


def reduce(x, dims, kind, op):
    """``x`` reduced over ``dims`` by a ``#vector.kind`` or ``#tpu.reduction_kind``."""
    fn = REDUCE.get(kind)
    if fn is None:
        raise MosaicError(f"run_mosaic: {where(op)}: reduction kind {kind} is not supported")
    x = np.asarray(x)
    if kind in ("maxui", "minui"):
        return fn.reduce(unsigned(x), axis=tuple(dims)).view(x.dtype) if dims else x
    x = f32(x) if x.dtype.kind in "fV" else x
    return fn.reduce(x, axis=tuple(dims)) if dims else x


@rule("vector.multi_reduction")
def _multi_reduction(ex, op, vals, env):
    src, acc = (np.asarray(v) for v in vals)
    kind = enum_attr(op.attributes["kind"])
    r = reduce(src, array_attr(op, "reduction_dims"), kind, op)
    if kind in ("maxui", "minui"):
        return [REDUCE[kind](unsigned(r), unsigned(acc)).view(acc.dtype)]
    return [cast(REDUCE[kind](r, f32(acc) if acc.dtype.kind in "fV" else acc), op)]


@rule("vector.transpose")
def transpose(ex, op, vals, env):
    return [np.transpose(vals[0], array_attr(op, "permutation"))]


@rule("vector.extract")
def _extract(ex, op, vals, env):
    dyn = iter(vals[1:])
    pos = [int(next(dyn)) if p < -(2**62) else p for p in array_attr(op, "static_position")]
    return [np.asarray(np.asarray(vals[0])[tuple(pos)])]


@rule("vector.extract_strided_slice")
def _extract_strided(ex, op, vals, env):
    offs, sizes = array_attr(op, "offsets"), array_attr(op, "sizes")
    strides = array_attr(op, "strides") or [1] * len(offs)
    sl = tuple(slice(o, o + (n - 1) * s + 1, s) for o, n, s in zip(offs, sizes, strides))
    return [np.asarray(vals[0])[sl].copy()]
