"""``libdevice`` for Triton's CPU interpreter.

Triton's interpreter cannot run ``extern_elementwise`` calls, so generated
kernels running under it import this object instead of
``triton.language.extra.libdevice``: the same function names, computed with
numpy on the interpreter's host tensors.
"""

from __future__ import annotations

import math

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import TensorHandle

from pallas import backend as plb


def _round_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _erfinv(x):
    # Newton iterations on erf from a good start (pallas-core's float32 erf_inv,
    # Giles' approximation).
    y = plb.erf_inv_f32(x, xp=np)
    erf = np.vectorize(math.erf)
    for _ in range(2):
        y = y - (erf(y) - x) / (2.0 / math.sqrt(math.pi) * np.exp(-y * y))
    return np.where(np.abs(x) == 1, np.sign(x) * np.inf, y)


def _clz(x):
    bits = 8 * x.dtype.itemsize
    u = x.view(np.uint32 if bits == 32 else np.uint64).astype(np.uint64)
    n = np.zeros(x.shape, np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        if shift >= bits:
            continue
        top = u >> np.uint64(bits - shift)
        empty = top == 0
        n += np.where(empty, shift, 0)
        u = np.where(empty, u << np.uint64(shift), u) & np.uint64((1 << bits) - 1)
    return np.where(x == 0, bits, n)


def _popc(x):  # numpy counts the bits of |x| for signed integers; libdevice counts the pattern
    return np.bitwise_count(x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint64))


def _mulhi(x, y):
    bits = 8 * x.dtype.itemsize
    if bits == 32:
        return ((x.astype(np.int64) * y.astype(np.int64)) >> 32).astype(x.dtype)
    x, y = np.broadcast_arrays(x, y)
    return (
        np.array([(int(a) * int(b)) >> 64 for a, b in zip(x.ravel(), y.ravel())], dtype=object)
        .astype(x.dtype)
        .reshape(x.shape)
    )


_FUNCS = {
    "log1p": np.log1p, "expm1": np.expm1, "cbrt": np.cbrt, "tan": np.tan, "tanh": np.tanh,
    "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "pow": np.power,
    "atan2": np.arctan2, "nextafter": np.nextafter, "rint": np.rint, "round": _round_away,
    "erfinv": _erfinv, "erfc": np.vectorize(math.erfc), "lgamma": np.vectorize(math.lgamma),
    "clz": _clz, "popc": _popc, "mulhi": _mulhi,
}  # fmt: skip


class _Libdevice:
    def __getattr__(self, name):
        if name not in _FUNCS:
            raise NotImplementedError(f"libdevice.{name} is not available in Triton's interpreter")
        fn = _FUNCS[name]

        def call(*args):
            x = args[0]
            with np.errstate(all="ignore"):
                data = fn(*[a.handle.data for a in args])
            data = np.asarray(data).astype(x.handle.data.dtype)
            return tl.core.tensor(TensorHandle(data, x.handle.dtype), x.type)

        return call


libdevice = _Libdevice()
