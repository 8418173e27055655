"""Every use of Triton (and of JAX internals) in jax_triton goes through here.

Triton is pinned exactly, so a Triton release breaks this one file, not the
package. Public Triton APIs are preferred; the interpreter internals
(`triton.runtime.interpreter`) have no public equivalent for running a kernel
on host memory without torch, so they are wrapped here.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import triton
import triton.language as tl
from jax._src import dispatch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import interpreter as _interp
from triton.runtime.autotuner import Autotuner, Config, Heuristics
from triton.runtime.jit import JITFunction

# The Triton this release was validated against. The wheel identity is the
# sha256 of triton/_C/libtriton.so recorded in triton-3.6.0.dist-info/RECORD
# (PyPI manylinux_2_27/2_28 x86_64 wheel, cp312), i.e. the v3.6.0 release tag.
VALIDATED_TRITON_VERSION = "3.6.0"
VALIDATED_TRITON_BUILD = (
    "v3.6.0 release wheel; libtriton.so sha256=KNqqcKkE5Pit11TlGFM-imm5SrixZDHOd9RfHyUoK4c"
)

__all__ = [
    "ASTSource",
    "Autotuner",
    "Config",
    "GPUTarget",
    "Heuristics",
    "JITFunction",
    "dispatch",
    "tl",
    "triton",
]  # fmt: skip

_warned = False


def check_triton_version() -> None:
    """Warns once per process when the installed Triton is not the pinned one."""
    global _warned
    if _warned or triton.__version__ == VALIDATED_TRITON_VERSION:
        return
    _warned = True
    warnings.warn(
        f"jax_triton was validated with triton=={VALIDATED_TRITON_VERSION} "
        f"({VALIDATED_TRITON_BUILD}) but triton {triton.__version__} is "
        f"installed; kernels may fail to compile or run. Install "
        f"'triton=={VALIDATED_TRITON_VERSION}'.",
        RuntimeWarning,
        stacklevel=3,
    )


def pointer_type(signature_type: str):
    """Triton type object for a signature string such as '*fp32'."""
    return tl.str_to_ty(signature_type, None)


# The interpreter keeps the current program id in module globals, so only one
# interpreted kernel may run at a time in a process.
_interpret_lock = threading.Lock()


def _call_jit_function_interpreted(self, *args, **kwargs):
    """Stands in for ``JITFunction.__call__`` while a kernel is interpreted.

    Under TRITON_INTERPRET=1 Triton decorates every @jit function (including
    ``tl.max`` and other standard-library helpers) as an interpreted one at
    import time. We interpret without that variable, so nested @jit calls are
    redirected here; unlike ``InterpretedFunction.__call__`` the language patch
    is undone afterwards, so later GPU compilations see the real ``tl``.
    """
    scope = _interp._patch_lang(self.fn)
    try:
        return _interp.InterpretedFunction(self.fn).rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def _as_scalar(t):
    return t.handle.data.reshape(-1)[0]


def _patch_numpy_scalar_conversion(scope) -> None:
    """Works around Triton 3.6's interpreter under NumPy >= 2.5.

    The interpreter turns scalar tensors (1-element arrays of shape (1,)) into
    Python ints with ``int(array)``, which NumPy 2.5 removed for arrays with
    ndim > 0 ("only 0-dimensional arrays can be converted to Python
    scalars"): ``range(tl.cdiv(K, BLOCK_K))`` in a kernel then fails. We
    convert through the single element instead.
    """
    scope.set_attr(tl.core.tensor, "__index__", lambda self: int(_as_scalar(self)))
    scope.set_attr(
        tl.core.tensor,
        "__bool__",
        lambda self: bool(_as_scalar(self)) if self.handle.data.size == 1 else True,
    )


def _dot_with_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``create_dot`` that widens bf16 operands to fp32 first.

    Triton 3.6's interpreter stores bf16 as uint16 and multiplies the raw bits
    as integers in ``create_dot``; the GPU multiplies the values. We convert
    bf16 blocks to fp32 (exact) and defer to the original for everything else.
    """
    convert = []
    for t in (a, b):
        if t.dtype.scalar == tl.bfloat16:
            data = _interp._convert_float(t.data, tl.bfloat16, tl.float32, None)
            t = _interp.TensorHandle(data.view(np.float32), tl.float32)
        convert.append(t)
    return _original_create_dot(self, convert[0], convert[1], d, input_precision, max_num_imprecise_acc)


_original_create_dot = _interp.InterpreterBuilder.create_dot
_original_binary_op = _interp.InterpreterBuilder.binary_op
_COMPARISONS = {
    np.less,
    np.less_equal,
    np.greater,
    np.greater_equal,
    np.equal,
    np.not_equal,
}


def _bf16_to_fp32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)  # exact


def _fp32_to_bf16(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return np.where(np.isnan(data), 0x7FC0, rounded).astype(np.uint16)


def _binary_op_with_bf16(self, lhs, rhs, op):
    """``binary_op`` that computes bf16 arithmetic on values, not bit patterns.

    Triton 3.6's interpreter stores bf16 as uint16 and applies numpy ops to
    the raw storage, so ``x + y`` on bf16 blocks adds integers. We compute in
    fp32 and round back to bf16 as the GPU does.
    """
    if lhs.dtype.scalar != tl.bfloat16:
        return _original_binary_op(self, lhs, rhs, op)
    lhs32 = _interp.TensorHandle(_bf16_to_fp32(lhs.data), tl.float32)
    rhs32 = _interp.TensorHandle(_bf16_to_fp32(rhs.data), tl.float32)
    out = _original_binary_op(self, lhs32, rhs32, op)
    if op in _COMPARISONS:
        return out
    return _interp.TensorHandle(_fp32_to_bf16(out.data), tl.bfloat16)


_original_cast_impl = _interp.InterpreterBuilder.cast_impl


def _cast_with_bf16_rounding(self, src, dst_type):
    """``cast_impl`` that rounds fp32 -> bf16 to nearest even, as the GPU does.

    Triton 3.6's interpreter drops the low mantissa bits (rounds toward zero).
    """
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return _interp.TensorHandle(_fp32_to_bf16(src.data), tl.bfloat16)
    return _original_cast_impl(self, src, dst_type)


def interpret(fn, grid, kwargs: dict, constexpr_names: set[str]) -> None:
    """Runs the Python function of a ``@triton.jit`` kernel on the host.

    ``kwargs`` maps every kernel parameter to: a ``(signature_type, address)``
    pair for pointers into host memory, a Python scalar, or, for names in
    ``constexpr_names``, the constexpr value.
    """
    with _interpret_lock:
        rewritten = _interp.InterpretedFunction(fn).rewrite()
        args = {}
        for name, value in kwargs.items():
            if name in constexpr_names:
                args[name] = value
            elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
                ty = pointer_type(value[0])
                handle = _interp.TensorHandle(np.array([value[1]], dtype=np.uint64), ty)
                args[name] = tl.tensor(handle, ty)
            else:
                args[name] = _interp._implicit_cvt(value)
        scope = _interp._patch_lang(fn)
        _patch_numpy_scalar_conversion(scope)
        scope.set_attr(_interp.InterpreterBuilder, "create_dot", _dot_with_bf16)
        scope.set_attr(_interp.InterpreterBuilder, "binary_op", _binary_op_with_bf16)
        scope.set_attr(_interp.InterpreterBuilder, "cast_impl", _cast_with_bf16_rounding)
        original_call = JITFunction.__call__
        JITFunction.__call__ = _call_jit_function_interpreted
        try:
            _interp.interpreter_builder.set_grid_dim(*grid)
            for x in range(grid[0]):
                for y in range(grid[1]):
                    for z in range(grid[2]):
                        _interp.interpreter_builder.set_grid_idx(x, y, z)
                        rewritten(**args)
        finally:
            JITFunction.__call__ = original_call
            scope.restore()
