"""``run_mosaic``'s rules for the ``tpu`` dialect's vector ops: reductions,
matmul, iota, rotates, concatenation, bitcasts, packing, stochastic rounding,
the hardware PRNG, gathers (and the ``tpu`` casts and math that share the
``arith``, ``math`` and ``vector`` rules)."""

from __future__ import annotations

import string

import ml_dtypes
import numpy as np

from pallas_tpu._src.executor.attrs import (
    array_attr,
    bool_attr,
    dot_dimension_numbers,
    enum_attr,
    int_attr,
    type_attr,
)
from pallas_tpu._src.executor.dialects import arith, vector
from pallas_tpu._src.executor.dialects.arith import elementwise
from pallas_tpu._src.executor.errors import MosaicError, where
from pallas_tpu._src.executor.framework import rule
from pallas_tpu._src.executor.values import (
    cast,
    f32,
    from_bits,
    np_dtype,
    out_dtype,
    shape_of,
    to_bits,
    width,
)
from pallas_tpu._src.language import random as tpu_random
from pallas_tpu._src.language import vector_primitives as vp

elementwise(
    {"tpu.reciprocal": lambda x: 1 / x, "tpu.logistic": lambda x: 1 / (1 + np.exp(-x))}, "unary_float"
)
rule("tpu.extf", "tpu.truncf")(arith.convert)
rule("tpu.sitofp")(arith.convert_signed)
rule("tpu.fptosi")(arith.fptosi)
rule("tpu.reshape")(vector.reshape)
rule("tpu.transpose")(vector.transpose)


@rule("tpu.reduce_index")
def _reduce_index(ex, op, vals, env):
    kind = enum_attr(op.attributes["kind"])
    axis = array_attr(op, "axis")[0]
    x = f32(vals[0]) if np.asarray(vals[0]).dtype.kind in "fV" else np.asarray(vals[0])
    fn = {"arg_max": np.argmax, "arg_min": np.argmin}.get(kind)
    if fn is None:
        raise MosaicError(f"run_mosaic: {where(op)}: index reduction kind {kind} is not supported")
    # The result keeps the reduced dim as size 1 (jaxlib 0.12.1's dialect) or drops it (older).
    shape = shape_of(op.operation.results[0].type)
    return [fn(x, axis=axis).reshape(shape).astype(out_dtype(op))]


@rule("tpu.reduce", "tpu.all_reduce")
def _tpu_reduce(ex, op, vals, env):
    dims = array_attr(op, "dimensions") or array_attr(op, "dim")
    r = vector.reduce(vals[0], dims, enum_attr(op.attributes["kind"]), op)
    if op.operation.name == "tpu.all_reduce":
        r = np.broadcast_to(np.expand_dims(r, tuple(dims)), np.shape(vals[0]))
    return [cast(r, op)]


@rule("tpu.iota")
def _iota(ex, op, vals, env):
    shape = shape_of(op.operation.results[0].type)
    dims = array_attr(op, "dimensions") or array_attr(op, "dimension")
    out = np.zeros(shape, np.int64)
    for d in dims:
        out = out * shape[d] + np.indices(shape)[d]
    return [out.astype(out_dtype(op))]


@rule("tpu.matmul")
def _matmul(ex, op, vals, env):
    lhs, rhs, acc = vals
    if "dimension_numbers" in op.attributes:  # text: see attrs.dot_dimension_numbers
        lc, rc, _, _, order, lb, rb = dot_dimension_numbers(op.attributes["dimension_numbers"])
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
    spec = f"{''.join(lhs_l)},{''.join(rhs_l)}->{''.join(out_l)}"
    if kind.kind not in "fV":
        prod = np.einsum(spec, np.asarray(lhs).astype(np.int64), np.asarray(rhs).astype(np.int64))
        return [cast(np.asarray(acc).astype(np.int64) + prod, op)]
    precision = "fp32"
    if ex.program.mxu_rounding:
        precision = enum_attr(op.attributes["precision"]) if "precision" in op.attributes else "bf16"
    pieces = mxu_pieces(np.asarray(lhs), np.asarray(rhs), precision)
    prod = sum(np.einsum(spec, a, b) for a, b in pieces)
    return [cast(np.asarray(acc).astype(np.float32) + prod, op)]


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (to nearest even), kept in float32."""
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def mxu_pieces(lhs: np.ndarray, rhs: np.ndarray, precision: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The products a TPU's MXU sums for a float matmul of ``precision``
    (``tpu.contract_precision``; absent means ``bf16``), as float32 operand pairs.
    The MXU multiplies bfloat16: a 32-bit float operand is rounded to bf16 for one
    pass (``bf16``: the default, what ``lax.Precision.DEFAULT`` gives; the v5e's
    results equal it), split into a high and a low bf16 part for three passes
    (``bf16x3``: ``HIGH``; the product of the low parts is dropped), or taken whole
    (``fp32``: ``HIGHEST``). Narrower floats are exact in bf16."""
    lhs32, rhs32 = lhs.astype(np.float32), rhs.astype(np.float32)
    if precision == "fp32" or (lhs.dtype.itemsize < 4 and rhs.dtype.itemsize < 4):
        return [(lhs32, rhs32)]
    lh, rh = _to_bf16(lhs32), _to_bf16(rhs32)
    if precision == "bf16x3":
        return [(lh, rh), (lh, _to_bf16(rhs32 - rh)), (_to_bf16(lhs32 - lh), rh)]
    return [(lh, rh)]


@rule("tpu.dynamic_rotate", "tpu.rotate")
def _rotate(ex, op, vals, env):
    x = np.asarray(vals[0])
    amount = int(vals[1]) if len(vals) > 1 else array_attr(op, "amount")[0]
    axis = array_attr(op, "dimension")[0]
    stride = array_attr(op, "stride")
    if not stride:
        return [np.roll(x, amount, axis)]
    sdim = array_attr(op, "stride_dimension")[0]
    parts = [np.roll(np.take(x, [i], axis=sdim), amount + i * stride[0], axis) for i in range(x.shape[sdim])]
    return [np.concatenate(parts, axis=sdim)]


@rule("tpu.concatenate")
def _concatenate(ex, op, vals, env):
    return [np.concatenate([np.asarray(v) for v in vals], axis=array_attr(op, "dimension")[0])]


@rule("tpu.repeat")
def _repeat(ex, op, vals, env):
    return [
        np.concatenate(
            [np.asarray(vals[0])] * array_attr(op, "times")[0], axis=array_attr(op, "dimension")[0]
        )
    ]


@rule("tpu.bitcast", "tpu.bitcast_vreg")
def _vector_bitcast(ex, op, vals, env):
    """A TPU bitcast: a change of element width is absorbed by the
    second-minor dimension. Narrowing ``k`` times, row ``k * i + j`` is part
    ``j`` (least significant first) of row ``i``; widening is the inverse
    (``pltpu.bitcast``'s interpret-mode semantics, and JAX's)."""
    x = np.asarray(vals[0])
    dtype = out_dtype(op)
    src, dst = width(op.operation.operands[0].type), width(op.operation.results[0].type)
    if src == dst:
        return [x.view(dtype) if src >= 8 else from_bits(to_bits(x, src), dtype, dst)]
    if op.operation.name != "tpu.bitcast" or x.ndim < 2:
        raise MosaicError(
            f"run_mosaic: {where(op)}: a bitcast from {src}-bit to {dst}-bit elements needs "
            "tpu.bitcast of a vector of rank >= 2"
        )
    *lead, m, n = x.shape
    bits = to_bits(x, src)
    if src < dst:
        k = dst // src
        parts = bits.reshape(*lead, m // k, k, n)
        word = np.zeros((*lead, m // k, n), np.uint64)
        for j in range(k):
            word |= parts[..., j, :] << np.uint64(j * src)
        return [from_bits(word, dtype, dst)]
    k = src // dst
    parts = np.stack([bits >> np.uint64(j * dst) for j in range(k)], axis=-2)  # (..., m, k, n)
    return [from_bits(parts.reshape(*lead, m * k, n), dtype, dst)]


# -- packing, stochastic rounding, the hardware PRNG --------------------------


@rule("tpu.pack_elementwise")
def _pack_elementwise(ex, op, vals, env):
    """Source ``i`` converted to the target type fills bits ``[i*p, (i+1)*p)``
    of each word (floats rounded to nearest even, integers truncated)."""
    target = type_attr(op, "target_type")
    p = width(target)
    packed = np_dtype(target)
    word = np.zeros(np.shape(vals[0]), np.uint64)
    for i, x in enumerate(vals):
        x = np.asarray(x)
        if x.dtype.kind in "fV":
            field = to_bits(f32(x).astype(packed), p)
        else:
            field = to_bits(x, x.dtype.itemsize * 8) & np.uint64((1 << p) - 1)
        word |= field << np.uint64(i * p)
    return [from_bits(word, out_dtype(op), width(op.operation.results[0].type))]


@rule("tpu.unpack_elementwise")
def _unpack_elementwise(ex, op, vals, env):
    """Element ``index`` of each word, read as the source type: floats are
    converted exactly, integers sign-extended (MLIR integers are signless)."""
    from jaxlib.mlir import ir

    source = type_attr(op, "source_type")
    p = width(source)
    index = int_attr(op, "index")
    x = np.asarray(vals[0])
    field = (to_bits(x, width(op.operation.operands[0].type)) >> np.uint64(index * p)) & np.uint64(
        (1 << p) - 1
    )
    if isinstance(source, ir.FloatType):
        value = f32(from_bits(field, np_dtype(source), p))
    else:
        value = field.astype(np.int64) - np.where(field >> np.uint64(p - 1), 1 << p, 0)
    return [cast(value, op)]


@rule("tpu.stochastic_convert")
def _stochastic_convert(ex, op, vals, env):
    """float32 rounded up or down by the random bits: ``pltpu.stochastic_round``'s
    interpret-mode rule (see its docstring), so run_mosaic and interpret mode agree."""
    import jax.numpy as jnp

    x, bits = np.asarray(vals[0]), np.asarray(vals[1])  # float32 (the verifier checks)
    target = out_dtype(op)
    r = vp.stochastic_round_impl(jnp.asarray(x), jnp.asarray(bits.view(np.uint32)), target_dtype=target)
    return [np.asarray(r).astype(target)]


# The hardware PRNG cannot be reproduced: run_mosaic follows pallas_tpu's TPU
# interpret mode instead (pallas_tpu._src.language.random): each device's run of a kernel
# starts unseeded; prng_set_seed_32 derives a threefry key from the seeds; each
# prng_random_bits draws jax.random.bits of (key, counter) and advances the
# counter. The state lives on through the grid steps, as a core's PRNG does.


def _prng_state(ex):
    if ex.prng_state is None:
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
    if width(op.operation.results[0].type) != 32:
        raise MosaicError(f"run_mosaic: {where(op)}: prng_random_bits draws 32-bit words")
    bits = np.asarray(tpu_random.bits_from_state(state, shape))
    ex.prng_state = state.at[2].add(np.uint32(1))
    return [bits.view(out_dtype(op))]


# -- other math ----------------------------------------------------------------


@rule("tpu.dynamic_gather")
def _dynamic_gather(ex, op, vals, env):
    """``out[..., i, ...] = src[..., idx[..., i, ...], ...]`` along one dimension
    (``jnp.take_along_axis``)."""
    dims = array_attr(op, "dimensions")
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

    e, m = int_attr(op, "exponent_bits"), int_attr(op, "mantissa_bits")
    x = f32(vals[0])
    return [cast(jax.lax.reduce_precision(x, exponent_bits=e, mantissa_bits=m), op)]
