"""Combine functions of ``tl.reduce`` and ``tl.associative_scan`` that are one
NumPy ufunc, for Triton's interpreter.

Triton's interpreter reduces with NumPy only for ``triton.language.standard``'s
own combine functions (``tl.sum``, ``tl.max``...); any other, however simple,
is called once per element through Triton's semantic layer, about 0.1 ms a
call: a ``[64, 1024]`` sum by ``def add(a, b): return a + b`` takes seconds.
Pallas-gpu's lowering emits such functions (``tl.sum`` is a ``@triton.jit``
library function, which generated kernels cannot call in the interpreter), and
users of jax-triton write them. ``combine_ufunc`` recognizes a combine function
whose body is one commutative elementwise operation of its two arguments, so
the reduction runs as that ufunc's ``reduce`` (a scan as its ``accumulate``):
the same values up to the order of floating-point additions, and the same
NaN handling as the interpreter's ``tl.maximum``/``tl.minimum``
(``np.maximum``/``np.minimum`` either way).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import numpy as np

_BINARY = {
    ast.Add: np.add,
    ast.Mult: np.multiply,
    ast.BitAnd: np.bitwise_and,
    ast.BitOr: np.bitwise_or,
    ast.BitXor: np.bitwise_xor,
}
_CALLS = {"maximum": np.maximum, "minimum": np.minimum}

# id(combine function) -> (the function, its ufunc or None); the function is
# kept so that a recycled id is not mistaken for it.
_seen: dict[int, tuple[Any, np.ufunc | None]] = {}


def combine_ufunc(combine_fn) -> np.ufunc | None:
    """The ufunc ``combine_fn`` computes (``return a + b``, ``a * b``,
    ``a & b``, ``a | b``, ``a ^ b``, ``tl.maximum(a, b, ...)``,
    ``tl.minimum(a, b, ...)``, arguments in either order), else None."""
    hit = _seen.get(id(combine_fn))
    if hit is not None and hit[0] is combine_fn:
        return hit[1]
    ufunc = _parse(getattr(combine_fn, "fn", combine_fn))
    _seen[id(combine_fn)] = (combine_fn, ufunc)
    return ufunc


def _parse(fn) -> np.ufunc | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    f = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(f, ast.FunctionDef):
        return None
    a = f.args
    if len(a.args) != 2 or a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults:
        return None
    body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return None
    names = {arg.arg for arg in a.args}
    value = body[0].value

    def the_arguments(x, y) -> bool:
        return isinstance(x, ast.Name) and isinstance(y, ast.Name) and {x.id, y.id} == names

    if isinstance(value, ast.BinOp) and type(value.op) in _BINARY:
        return _BINARY[type(value.op)] if the_arguments(value.left, value.right) else None
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)):
        return None
    module = value.func.value
    if not (isinstance(module, ast.Name) and value.func.attr in _CALLS and len(value.args) == 2):
        return None
    import triton.language as tl

    if getattr(fn, "__globals__", {}).get(module.id) is not tl or not the_arguments(*value.args):
        return None
    if any(k.arg != "propagate_nan" for k in value.keywords):
        return None
    return _CALLS[value.func.attr]


def ufunc_for(combine_fn, inputs) -> np.ufunc | None:
    """``combine_ufunc(combine_fn)`` where the reduction or scan of ``inputs``
    (a tuple of ``tl.tensor``) can use it: one input, held by the interpreter
    as NumPy values of its own type (not bf16 or fp8, which it holds as bit
    patterns), and no arithmetic on booleans (Triton would widen them)."""
    if len(inputs) != 1:
        return None
    ufunc = combine_ufunc(combine_fn)
    if ufunc is None:
        return None
    import triton.language as tl

    dtype = inputs[0].dtype.scalar
    if dtype == tl.int1:
        return None if ufunc in (np.add, np.multiply) else ufunc
    if dtype.is_int() or dtype in (tl.float16, tl.float32, tl.float64):
        return ufunc
    return None
