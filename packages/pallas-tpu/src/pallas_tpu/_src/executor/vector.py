"""``run_mosaic`` rules for vector ops and math (see ``run.py``)."""

from __future__ import annotations

import re
import string

import numpy as np

from pallas_tpu._src.executor.ops import (
    MosaicError,
    _array_attr,
    _cast,
    _f32,
    _out_dtype,
    _unsigned,
    bool_attr,
    enum_attr,
    np_dtype,
    rule,
    shape_of,
    where,
)
from pallas_tpu._src.language import random as tpu_random
from pallas_tpu._src.language import vector_primitives as vp

# -- vectors -----------------------------------------------------------------


@rule("vector.broadcast", "vector.splat")
def _broadcast(ex, op, vals, env):
    shape = shape_of(op.operation.results[0].type)
    return [np.broadcast_to(np.asarray(vals[0]), shape).astype(_out_dtype(op))]


@rule("vector.shape_cast", "tpu.reshape")
def _reshape(ex, op, vals, env):
    return [np.asarray(vals[0]).reshape(shape_of(op.operation.results[0].type))]


_REDUCE = {
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


def _reduce(x, dims, kind, op):
    fn = _REDUCE.get(kind)
    if fn is None:
        raise MosaicError(f"run_mosaic: {where(op)}: reduction kind {kind} is not supported")
    x = np.asarray(x)
    if kind in ("maxui", "minui"):
        return fn.reduce(_unsigned(x), axis=tuple(dims)).view(x.dtype) if dims else x
    x = _f32(x) if x.dtype.kind in "fV" else x
    return fn.reduce(x, axis=tuple(dims)) if dims else x


def _kind(op) -> str:
    return enum_attr(op.attributes["kind"])


@rule("vector.multi_reduction")
def _multi_reduction(ex, op, vals, env):
    src, acc = (np.asarray(v) for v in vals)
    kind = _kind(op)
    r = _reduce(src, _array_attr(op, "reduction_dims"), kind, op)
    if kind in ("maxui", "minui"):
        return [_REDUCE[kind](_unsigned(r), _unsigned(acc)).view(acc.dtype)]
    return [_cast(_REDUCE[kind](r, _f32(acc) if acc.dtype.kind in "fV" else acc), op)]


@rule("tpu.reduce_index")
def _reduce_index(ex, op, vals, env):
    kind = enum_attr(op.attributes["kind"])
    axis = _array_attr(op, "axis")[0]
    x = _f32(vals[0]) if np.asarray(vals[0]).dtype.kind in "fV" else np.asarray(vals[0])
    fn = {"arg_max": np.argmax, "arg_min": np.argmin}.get(kind)
    if fn is None:
        raise MosaicError(f"run_mosaic: {where(op)}: index reduction kind {kind} is not supported")
    return [fn(x, axis=axis).astype(_out_dtype(op))]


@rule("tpu.reduce", "tpu.all_reduce")
def _tpu_reduce(ex, op, vals, env):
    dims = _array_attr(op, "dimensions") or _array_attr(op, "dim")
    r = _reduce(vals[0], dims, _kind(op), op)
    if op.operation.name == "tpu.all_reduce":
        r = np.broadcast_to(np.expand_dims(r, tuple(dims)), np.shape(vals[0]))
    return [_cast(r, op)]


@rule("vector.transpose", "tpu.transpose")
def _transpose(ex, op, vals, env):
    return [np.transpose(vals[0], _array_attr(op, "permutation"))]


@rule("vector.extract")
def _extract(ex, op, vals, env):
    dyn = iter(vals[1:])
    pos = [int(next(dyn)) if p < -(2**62) else p for p in _array_attr(op, "static_position")]
    return [np.asarray(np.asarray(vals[0])[tuple(pos)])]


@rule("vector.extract_strided_slice")
def _extract_strided(ex, op, vals, env):
    offs, sizes = _array_attr(op, "offsets"), _array_attr(op, "sizes")
    strides = _array_attr(op, "strides") or [1] * len(offs)
    sl = tuple(slice(o, o + (n - 1) * s + 1, s) for o, n, s in zip(offs, sizes, strides))
    return [np.asarray(vals[0])[sl].copy()]


@rule("tpu.iota")
def _iota(ex, op, vals, env):
    shape = shape_of(op.operation.results[0].type)
    dims = _array_attr(op, "dimensions") or _array_attr(op, "dimension")
    out = np.zeros(shape, np.int64)
    for d in dims:
        out = out * shape[d] + np.indices(shape)[d]
    return [out.astype(_out_dtype(op))]


@rule("tpu.matmul")
def _matmul(ex, op, vals, env):
    lhs, rhs, acc = vals
    if "dimension_numbers" in op.attributes:
        # #tpu.dot_dimension_numbers<[1], [0], [0], [1], [0, 0, 1, 1], [], []>: the bindings
        # have no reader for it (see ops.enum_attr), so its text is read.
        lc, rc, _, _, order, lb, rb = (
            [int(x) for x in g.split(",") if x.strip()]
            for g in re.findall(r"\[([^\]]*)\]", str(op.attributes["dimension_numbers"]))
        )
    else:
        t = bool_attr(op, "transpose_rhs")
        lc, rc, lb, rb = [1], [1 if t else 0], [], []
        order = [0, 0, 1, 0 if t else 1]
    letters = iter(string.ascii_letters)
    lhs_l = [next(letters) for _ in range(np.ndim(lhs))]
    rhs_l = [next(letters) for _ in range(np.ndim(rhs))]
    for a, b in [*zip(lc, rc), *zip(lb, rb)]:
        rhs_l[b] = lhs_l[a]
    out_l = [(lhs_l, rhs_l)[o][d] for o, d in zip(order[::2], order[1::2])]
    kind = np.asarray(acc).dtype
    compute = np.float32 if kind.kind in "fV" else np.int64
    prod = np.einsum(
        f"{''.join(lhs_l)},{''.join(rhs_l)}->{''.join(out_l)}",
        np.asarray(lhs).astype(compute),
        np.asarray(rhs).astype(compute),
    )
    return [_cast(np.asarray(acc).astype(compute) + prod, op)]


@rule("tpu.dynamic_rotate", "tpu.rotate")
def _rotate(ex, op, vals, env):
    x = np.asarray(vals[0])
    amount = int(vals[1]) if len(vals) > 1 else _array_attr(op, "amount")[0]
    axis = _array_attr(op, "dimension")[0]
    stride = _array_attr(op, "stride")
    if not stride:
        return [np.roll(x, amount, axis)]
    sdim = _array_attr(op, "stride_dimension")[0]
    parts = [np.roll(np.take(x, [i], axis=sdim), amount + i * stride[0], axis) for i in range(x.shape[sdim])]
    return [np.concatenate(parts, axis=sdim)]


@rule("tpu.concatenate")
def _concatenate(ex, op, vals, env):
    return [np.concatenate([np.asarray(v) for v in vals], axis=_array_attr(op, "dimension")[0])]


@rule("tpu.repeat")
def _repeat(ex, op, vals, env):
    return [
        np.concatenate(
            [np.asarray(vals[0])] * _array_attr(op, "times")[0], axis=_array_attr(op, "dimension")[0]
        )
    ]


def _width(t) -> int:
    """The bit width of an MLIR element type (or of a shaped type's elements)."""
    from jaxlib.mlir import ir

    if isinstance(t, ir.ShapedType):
        t = ir.ShapedType(t).element_type
    if isinstance(t, ir.IntegerType):
        return ir.IntegerType(t).width
    if isinstance(t, ir.FloatType):
        return ir.FloatType(t).width
    raise MosaicError(f"run_mosaic: element type {t} has no bit width")


def _to_bits(x, width: int) -> np.ndarray:
    """The bit patterns of ``x`` (elements of ``width`` bits) as uint64."""
    x = np.asarray(x)
    if width < 8:  # int4 and friends: one value per byte
        return (x.astype(np.int8).view(np.uint8) & ((1 << width) - 1)).astype(np.uint64)
    return x.view(np.dtype(f"uint{width}")).astype(np.uint64)


def _from_bits(bits, dtype, width: int) -> np.ndarray:
    """``width``-bit patterns (uint64) as values of ``dtype``."""
    bits = np.asarray(bits, np.uint64) & np.uint64((1 << width) - 1)
    if width < 8:
        signed = bits.astype(np.int64) - np.where(bits >> np.uint64(width - 1), 1 << width, 0)
        return signed.astype(dtype)
    return bits.astype(np.dtype(f"uint{width}")).view(dtype)


@rule("tpu.bitcast", "tpu.bitcast_vreg")
def _vector_bitcast(ex, op, vals, env):
    """A TPU bitcast: a change of element width is absorbed by the
    second-minor dimension. Narrowing ``k`` times, row ``k * i + j`` is part
    ``j`` (least significant first) of row ``i``; widening is the inverse
    (``pltpu.bitcast``'s interpret-mode semantics, and JAX's)."""
    x = np.asarray(vals[0])
    dtype = _out_dtype(op)
    src, dst = _width(op.operation.operands[0].type), _width(op.operation.results[0].type)
    if src == dst:
        return [x.view(dtype) if src >= 8 else _from_bits(_to_bits(x, src), dtype, dst)]
    if op.operation.name != "tpu.bitcast" or x.ndim < 2:
        raise MosaicError(
            f"run_mosaic: {where(op)}: a bitcast from {src}-bit to {dst}-bit elements needs "
            "tpu.bitcast of a vector of rank >= 2"
        )
    *lead, m, n = x.shape
    bits = _to_bits(x, src)
    if src < dst:
        k = dst // src
        parts = bits.reshape(*lead, m // k, k, n)
        word = np.zeros((*lead, m // k, n), np.uint64)
        for j in range(k):
            word |= parts[..., j, :] << np.uint64(j * src)
        return [_from_bits(word, dtype, dst)]
    k = src // dst
    parts = np.stack([bits >> np.uint64(j * dst) for j in range(k)], axis=-2)  # (..., m, k, n)
    return [_from_bits(parts.reshape(*lead, m * k, n), dtype, dst)]


# -- packing, stochastic rounding, the hardware PRNG --------------------------


def _type_attr(op, name):
    from jaxlib.mlir import ir

    return ir.TypeAttr(op.attributes[name]).value


@rule("tpu.pack_elementwise")
def _pack_elementwise(ex, op, vals, env):
    """Source ``i`` converted to the target type fills bits ``[i*p, (i+1)*p)``
    of each word (floats rounded to nearest even, integers truncated)."""
    target = _type_attr(op, "target_type")
    p = _width(target)
    packed = np_dtype(target)
    word = np.zeros(np.shape(vals[0]), np.uint64)
    for i, x in enumerate(vals):
        x = np.asarray(x)
        if x.dtype.kind in "fV":
            field = _to_bits(_f32(x).astype(packed), p)
        else:
            field = _to_bits(x, x.dtype.itemsize * 8) & np.uint64((1 << p) - 1)
        word |= field << np.uint64(i * p)
    return [_from_bits(word, _out_dtype(op), _width(op.operation.results[0].type))]


@rule("tpu.unpack_elementwise")
def _unpack_elementwise(ex, op, vals, env):
    """Element ``index`` of each word, read as the source type: floats are
    converted exactly, integers sign-extended (MLIR integers are signless)."""
    from jaxlib.mlir import ir

    source = _type_attr(op, "source_type")
    p = _width(source)
    index = ir.IntegerAttr(op.attributes["index"]).value
    x = np.asarray(vals[0])
    field = (_to_bits(x, _width(op.operation.operands[0].type)) >> np.uint64(index * p)) & np.uint64(
        (1 << p) - 1
    )
    if isinstance(source, ir.FloatType):
        value = _f32(_from_bits(field, np_dtype(source), p))
    else:
        value = field.astype(np.int64) - np.where(field >> np.uint64(p - 1), 1 << p, 0)
    return [_cast(value, op)]


@rule("tpu.stochastic_convert")
def _stochastic_convert(ex, op, vals, env):
    """float32 rounded up or down by the random bits: ``pltpu.stochastic_round``'s
    interpret-mode rule (see its docstring), so run_mosaic and interpret mode agree."""
    import jax.numpy as jnp

    x, bits = np.asarray(vals[0]), np.asarray(vals[1])  # float32 (the verifier checks)
    target = _out_dtype(op)
    r = vp._stochastic_round_impl(jnp.asarray(x), jnp.asarray(bits.view(np.uint32)), target_dtype=target)
    return [np.asarray(r).astype(target)]


# The hardware PRNG cannot be reproduced: run_mosaic follows pallas_tpu's TPU
# interpret mode instead (pallas_tpu._src.language.random): each device's run of a kernel
# starts unseeded; prng_set_seed_32 derives a threefry key from the seeds; each
# prng_random_bits draws jax.random.bits of (key, counter) and advances the
# counter. The state lives on through the grid steps, as a core's PRNG does.


def _prng_state(ex):
    if getattr(ex, "prng_state", None) is None:
        ex.prng_state = tpu_random.state_from_seeds(())
    return ex.prng_state


@rule("tpu.prng_set_seed_32")
def _prng_set_seed(ex, op, vals, env):
    seeds = [np.asarray(v).astype(np.int32).view(np.uint32) for v in vals]
    ex.prng_state = tpu_random.state_from_seeds(seeds)


@rule("tpu.prng_random_bits")
def _prng_random_bits(ex, op, vals, env):
    state = _prng_state(ex)
    shape = shape_of(op.operation.results[0].type)
    if _width(op.operation.results[0].type) != 32:
        raise MosaicError(f"run_mosaic: {where(op)}: prng_random_bits draws 32-bit words")
    bits = np.asarray(tpu_random.bits_from_state(state, shape))
    ex.prng_state = state.at[2].add(np.uint32(1))
    return [bits.view(_out_dtype(op))]


# -- other math ----------------------------------------------------------------


@rule("tpu.dynamic_gather")
def _dynamic_gather(ex, op, vals, env):
    """``out[..., i, ...] = src[..., idx[..., i, ...], ...]`` along one dimension
    (``jnp.take_along_axis``)."""
    dims = _array_attr(op, "dimensions")
    src, idx = np.asarray(vals[0]), np.asarray(vals[1]).astype(np.int64)
    if len(dims) != 1:
        raise MosaicError(f"run_mosaic: {where(op)}: gathers along {len(dims)} dimensions are not supported")
    n = src.shape[dims[0]]
    if np.any((idx < 0) | (idx >= n)):
        raise MosaicError(
            f"run_mosaic: {where(op)}: gather index {int(idx[(idx < 0) | (idx >= n)][0])} is out of bounds "
            f"of dimension {dims[0]} (size {n})"
        )
    return [np.take_along_axis(src, idx, axis=dims[0])]


@rule("tpu.reduce_precision")
def _reduce_precision(ex, op, vals, env):
    """XLA's ``reduce_precision`` (round to nearest even in the narrower
    format, overflow to inf, underflow to zero), computed by XLA on the CPU."""
    import jax
    from jaxlib.mlir import ir

    e = ir.IntegerAttr(op.attributes["exponent_bits"]).value
    m = ir.IntegerAttr(op.attributes["mantissa_bits"]).value
    x = _f32(vals[0])
    return [_cast(jax.lax.reduce_precision(x, exponent_bits=e, mantissa_bits=m), op)]


@rule("arith.mulsi_extended", "arith.mului_extended")
def _mul_extended(ex, op, vals, env):
    """The low and high halves of the double-width product."""
    w = _width(op.operation.results[0].type)
    if w > 32:
        raise MosaicError(
            f"run_mosaic: {where(op)}: extended multiplies of {w}-bit integers are not supported"
        )
    a, b = (np.asarray(v) for v in vals)
    if op.operation.name == "arith.mului_extended":
        prod = _to_bits(a, w).astype(np.int64) * _to_bits(b, w).astype(np.int64)
    else:
        prod = a.astype(np.int64) * b.astype(np.int64)
    dtype = _out_dtype(op)
    low = _from_bits(prod.view(np.uint64), dtype, w)
    high = _from_bits((prod >> w).view(np.uint64), dtype, w)
    return [low, high]


@rule("math.ctlz")
def _ctlz(ex, op, vals, env):
    w = _width(op.operation.results[0].type)
    bits = _to_bits(vals[0], w)
    length = np.zeros(bits.shape, np.int64)
    for b in range(w):
        length += (bits >> np.uint64(b)) != 0
    return [_cast(w - length, op)]
