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
the same values up to the order of floating-point additions. ``tl.maximum``
and ``tl.minimum`` are taken on floats only with ``propagate_nan=
tl.PropagateNan.ALL`` (``np.maximum``/``np.minimum``): without it, Triton 3.6's
interpreter propagates NaN and later ones ignore it (``np.fmax``), so those
keep the generic path, which follows the installed interpreter.
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

# id(combine function) -> (the function, its ufunc or None, whether floats may
# use it); the function is kept so that a recycled id is not mistaken for it.
_seen: dict[int, tuple[Any, np.ufunc | None, bool]] = {}


def combine_ufunc(combine_fn) -> np.ufunc | None:
    """The ufunc ``combine_fn`` computes (``return a + b``, ``a * b``,
    ``a & b``, ``a | b``, ``a ^ b``, ``tl.maximum(a, b, ...)``,
    ``tl.minimum(a, b, ...)``, arguments in either order), else None."""
    return _lookup(combine_fn)[0]


def _lookup(combine_fn) -> tuple[np.ufunc | None, bool]:
    hit = _seen.get(id(combine_fn))
    if hit is None or hit[0] is not combine_fn:
        hit = (combine_fn, *_parse(getattr(combine_fn, "fn", combine_fn)))
        _seen[id(combine_fn)] = hit
    return hit[1], hit[2]


_NONE = (None, False)


def _parse(fn) -> tuple[np.ufunc | None, bool]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return _NONE
    f = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(f, ast.FunctionDef):
        return _NONE
    a = f.args
    if len(a.args) != 2 or a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults:
        return _NONE
    body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return _NONE
    names = {arg.arg for arg in a.args}
    value = body[0].value

    def the_arguments(x, y) -> bool:
        return isinstance(x, ast.Name) and isinstance(y, ast.Name) and {x.id, y.id} == names

    if isinstance(value, ast.BinOp) and type(value.op) in _BINARY:
        return (_BINARY[type(value.op)], True) if the_arguments(value.left, value.right) else _NONE
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)):
        return _NONE
    module = value.func.value
    if not (isinstance(module, ast.Name) and value.func.attr in _CALLS and len(value.args) == 2):
        return _NONE
    import triton.language as tl

    if getattr(fn, "__globals__", {}).get(module.id) is not tl or not the_arguments(*value.args):
        return _NONE
    if any(k.arg != "propagate_nan" for k in value.keywords):
        return _NONE
    # Floats only with propagate_nan=tl.PropagateNan.ALL (the module docstring says why).
    nan = [k.value for k in value.keywords]
    floats = bool(nan) and isinstance(nan[0], ast.Attribute) and nan[0].attr == "ALL"
    return _CALLS[value.func.attr], floats


def ufunc_for(combine_fn, inputs) -> np.ufunc | None:
    """``combine_ufunc(combine_fn)`` where the reduction or scan of ``inputs``
    (a tuple of ``tl.tensor``) can use it: one input, held by the interpreter
    as NumPy values of its own type (not bf16 or fp8, which it holds as bit
    patterns), and no arithmetic on booleans (Triton would widen them)."""
    if len(inputs) != 1:
        return None
    ufunc, floats = _lookup(combine_fn)
    if ufunc is None:
        return None
    import triton.language as tl

    dtype = inputs[0].dtype.scalar
    if dtype == tl.int1:
        return None if ufunc in (np.add, np.multiply) else ufunc
    if dtype.is_int() or (floats and dtype in (tl.float16, tl.float32, tl.float64)):
        return ufunc
    return None
