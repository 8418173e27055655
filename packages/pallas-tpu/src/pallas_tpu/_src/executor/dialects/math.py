"""``run_mosaic``'s rules for the ``math`` dialect (elementwise, from tables;
16-bit floats computed in float32, see ``arith``)."""

from __future__ import annotations

import numpy as np

from pallas_tpu._src.executor.dialects.arith import elementwise
from pallas_tpu._src.executor.framework import rule
from pallas_tpu._src.executor.values import cast, f32, to_bits, unsigned, width


def _erf(x):
    import jax

    return np.asarray(jax.lax.erf(np.asarray(x, np.float32)))


elementwise({"math.powf": np.power, "math.atan2": np.arctan2, "math.copysign": np.copysign}, "float")
elementwise(
    {
        "math.exp": np.exp,
        "math.exp2": np.exp2,
        "math.expm1": np.expm1,
        "math.log": np.log,
        "math.log1p": np.log1p,
        "math.log2": np.log2,
        "math.log10": np.log10,
        "math.sqrt": np.sqrt,
        "math.rsqrt": lambda x: 1 / np.sqrt(x),
        "math.cbrt": np.cbrt,
        "math.tanh": np.tanh,
        "math.sin": np.sin,
        "math.cos": np.cos,
        "math.tan": np.tan,
        "math.asin": np.arcsin,
        "math.acos": np.arccos,
        "math.atan": np.arctan,
        "math.sinh": np.sinh,
        "math.cosh": np.cosh,
        "math.asinh": np.arcsinh,
        "math.acosh": np.arccosh,
        "math.atanh": np.arctanh,
        "math.absf": np.abs,
        "math.floor": np.floor,
        "math.ceil": np.ceil,
        "math.roundeven": np.rint,
        "math.round": lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5),
        "math.trunc": np.trunc,
        "math.erf": _erf,
    },
    "unary_float",
)
elementwise(
    {
        "math.absi": np.abs,
        "math.ctpop": lambda x: np.bitwise_count(unsigned(x)).astype(np.asarray(x).dtype),
    },
    "unary_int",
)


@rule("math.fma")
def _fma(ex, op, vals, env):
    a, b, c = (f32(v) for v in vals)
    return [cast(a * b + c, op)]


@rule("math.isnan", "math.isinf", "math.isfinite")
def _isclass(ex, op, vals, env):
    fn = {"math.isnan": np.isnan, "math.isinf": np.isinf, "math.isfinite": np.isfinite}[op.operation.name]
    return [fn(f32(vals[0]))]


@rule("math.ctlz")
def _ctlz(ex, op, vals, env):
    w = width(op.operation.results[0].type)
    bits = to_bits(vals[0], w)
    length = np.zeros(bits.shape, np.int64)
    for b in range(w):
        length += (bits >> np.uint64(b)) != 0
    return [cast(w - length, op)]
