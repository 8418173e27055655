"""``run_mosaic``'s rules for the ``arith`` dialect: constants, elementwise
integer and float arithmetic (from tables), comparisons, casts. Float math on
16-bit floats runs in float32 and is rounded to the result type, as a TPU's
VPU does on chips without bf16 math. ``elementwise`` registers a table of
elementwise ops, for the ``math`` and ``tpu`` dialects too."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pallas_tpu._src.executor.attrs import int_attr
from pallas_tpu._src.executor.errors import MosaicError, where
from pallas_tpu._src.executor.framework import RULES, rule
from pallas_tpu._src.executor.values import (
    UNSIGNED,
    cast,
    f32,
    from_bits,
    np_dtype,
    out_dtype,
    shape_of,
    signed,
    to_bits,
    unsigned,
    width,
)

# -- constants ---------------------------------------------------------------


@rule("arith.constant")
def _constant(ex, op, vals, env):
    from jaxlib.mlir import ir

    attr = op.attributes["value"]
    t = op.operation.results[0].type
    dtype, shape = np_dtype(t), shape_of(t)
    if isinstance(attr, ir.DenseElementsAttr):
        d = ir.DenseElementsAttr(attr)
        if d.is_splat:
            return [np.full(shape, _scalar(d.get_splat_value()), dtype)]
        return [np.array(d).astype(dtype).reshape(shape)]
    return [np.array(_scalar(attr), dtype)]


def _scalar(attr):
    from jaxlib.mlir import ir

    if isinstance(attr, ir.BoolAttr):
        return ir.BoolAttr(attr).value
    if isinstance(attr, ir.IntegerAttr):
        v = ir.IntegerAttr(attr).value
        return bool(v) if isinstance(attr.type, ir.IntegerType) and attr.type.width == 1 else v
    if isinstance(attr, ir.FloatAttr):
        return ir.FloatAttr(attr).value
    raise MosaicError(f"run_mosaic: constant {attr} is not supported")


# -- elementwise -------------------------------------------------------------


def elementwise(table: dict[str, Callable], kind: str) -> None:
    """Registers the ops of ``table`` (op name -> NumPy function): ``kind``
    ``"int"`` and ``"float"`` binary ops, ``"unsigned"`` binary ops on the bit
    patterns read as unsigned, ``"unary_float"`` and ``"unary_int"``."""
    for name, fn in table.items():
        RULES[name] = _ELEMENTWISE[kind](fn)


def _binary(fn, prep=lambda x: x):
    def r(ex, op, vals, env):
        a, b = (prep(v) for v in vals)
        return [cast(fn(a, b), op)]

    return r


_ELEMENTWISE = {
    "int": lambda fn: _binary(fn, signed),
    "float": lambda fn: _binary(fn, f32),
    "unsigned": lambda fn: lambda ex, op, vals, env: [fn(*(unsigned(v) for v in vals)).view(out_dtype(op))],
    "unary_float": lambda fn: lambda ex, op, vals, env: [cast(fn(f32(vals[0])), op)],
    "unary_int": lambda fn: lambda ex, op, vals, env: [cast(fn(vals[0]), op)],
}


def _trunc_div(a, b):
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)  # INT_MIN / -1 wraps when cast back
    b_safe = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(b_safe)
    q = np.where((a < 0) != (b_safe < 0), -q, q)
    return np.where(b == 0, -1, q)


def _shift(fn, a, b):
    bits = np.asarray(a).dtype.itemsize * 8
    ok = (b >= 0) & (b < bits)
    return np.where(ok, fn(a, np.where(ok, b, 0).astype(np.asarray(a).dtype)), 0)


elementwise(
    {
        "arith.addi": np.add,
        "arith.subi": np.subtract,
        "arith.muli": np.multiply,
        "arith.divsi": _trunc_div,
        "arith.remsi": lambda a, b: np.where(b == 0, a, np.asarray(a, np.int64) - _trunc_div(a, b) * b),
        "arith.floordivsi": lambda a, b: np.floor_divide(a, np.where(b == 0, 1, b)),
        "arith.maxsi": np.maximum,
        "arith.minsi": np.minimum,
        "arith.andi": np.bitwise_and,
        "arith.ori": np.bitwise_or,
        "arith.xori": np.bitwise_xor,
        "arith.shli": lambda a, b: _shift(np.left_shift, a, b),
        "arith.shrsi": lambda a, b: np.right_shift(a, np.clip(b, 0, np.asarray(a).dtype.itemsize * 8 - 1)),
    },
    "int",
)
elementwise(
    {
        "arith.divui": lambda a, b: np.where(b == 0, np.iinfo(a.dtype).max, a // np.where(b == 0, 1, b)),
        "arith.remui": lambda a, b: np.where(b == 0, a, a % np.where(b == 0, 1, b)),
        "arith.maxui": np.maximum,
        "arith.minui": np.minimum,
        "arith.shrui": lambda a, b: _shift(np.right_shift, a, b),
    },
    "unsigned",
)
elementwise(
    {
        "arith.addf": np.add,
        "arith.subf": np.subtract,
        "arith.mulf": np.multiply,
        "arith.divf": np.divide,
        "arith.remf": np.fmod,
        "arith.maximumf": np.maximum,
        "arith.minimumf": np.minimum,
        "arith.maxnumf": np.fmax,
        "arith.minnumf": np.fmin,
    },
    "float",
)
elementwise({"arith.negf": np.negative}, "unary_float")

_PREDICATES_I = ["eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge"]
_CMP = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}
_PREDICATES_F = [
    "false",
    "oeq",
    "ogt",
    "oge",
    "olt",
    "ole",
    "one",
    "ord",
    "ueq",
    "ugt",
    "uge",
    "ult",
    "ule",
    "une",
    "uno",
    "true",
]


@rule("arith.cmpi")
def _cmpi(ex, op, vals, env):
    pred = _PREDICATES_I[int_attr(op, "predicate")]
    a, b = vals
    if pred[0] == "u":
        a, b, pred = unsigned(a), unsigned(b), pred[1:]
    elif pred[0] == "s":
        a, b, pred = signed(a), signed(b), pred[1:]
    return [_CMP[pred](a, b)]


@rule("arith.cmpf")
def _cmpf(ex, op, vals, env):
    pred = _PREDICATES_F[int_attr(op, "predicate")]
    a, b = (f32(v) for v in vals)
    unordered = np.isnan(a) | np.isnan(b)
    if pred in ("false", "true"):
        return [np.full(np.broadcast(a, b).shape, pred == "true")]
    if pred in ("ord", "uno"):
        return [~unordered if pred == "ord" else unordered]
    base = _CMP[{"one": "ne", "une": "ne"}.get(pred, pred[1:])](a, b)
    return [base & ~unordered if pred[0] == "o" else base | unordered]


@rule("arith.select")
def _select(ex, op, vals, env):
    c, a, b = vals
    return [cast(np.where(c, a, b), op)]


@rule("arith.mulsi_extended", "arith.mului_extended")
def _mul_extended(ex, op, vals, env):
    """The low and high halves of the double-width product."""
    w = width(op.operation.results[0].type)
    if w > 32:
        raise MosaicError(
            f"run_mosaic: {where(op)}: extended multiplies of {w}-bit integers are not supported"
        )
    a, b = (np.asarray(v) for v in vals)
    if op.operation.name == "arith.mului_extended":
        prod = to_bits(a, w).astype(np.int64) * to_bits(b, w).astype(np.int64)
    else:
        prod = a.astype(np.int64) * b.astype(np.int64)
    dtype = out_dtype(op)
    low = from_bits(prod.view(np.uint64), dtype, w)
    high = from_bits((prod >> w).view(np.uint64), dtype, w)
    return [low, high]


# -- casts -------------------------------------------------------------------


def _float_to_int(x, dtype):
    """Saturating, NaN to 0 (XLA's convert on TPU)."""
    x = f32(x).astype(np.float64)
    info = np.iinfo(dtype)
    y = np.clip(np.trunc(np.nan_to_num(x, nan=0.0)), info.min, info.max)
    return y.astype(dtype)


@rule("arith.extf", "arith.truncf", "arith.trunci", "arith.index_cast")
def convert(ex, op, vals, env):
    return [cast(vals[0], op)]


@rule("arith.extsi", "arith.sitofp")
def convert_signed(ex, op, vals, env):
    return [cast(signed(vals[0]), op)]


@rule("arith.extui", "arith.uitofp", "arith.index_castui")
def _convert_unsigned(ex, op, vals, env):
    x = np.asarray(vals[0])
    if x.dtype == np.bool_:
        return [cast(x, op)]
    return [cast(unsigned(x), op)]


@rule("arith.fptosi")
def fptosi(ex, op, vals, env):
    return [_float_to_int(vals[0], out_dtype(op))]


@rule("arith.fptoui")
def _fptoui(ex, op, vals, env):
    d = out_dtype(op)
    return [_float_to_int(vals[0], UNSIGNED.get(d, d)).view(d)]


@rule("arith.bitcast")
def _bitcast(ex, op, vals, env):
    return [np.asarray(vals[0]).view(out_dtype(op))]
