"""Triton's front end (kernel source -> Triton IR), run when lowering for the CPU.

The interpreter executes the kernel's Python inside a host callback, so a
kernel that does not compile (an undefined name, a type error, a bad
``tl.constexpr``) would otherwise fail only when the call runs, as an opaque
``CpuCallback error``. Running the front end the GPU compile starts with finds
those errors while lowering, with Triton's message and source line. Only the
front end runs (no GPU, no ptxas; milliseconds), and GPU-only limits the
interpreter does not have (the smallest ``tl.dot``) are relaxed as in the
interpreter.

TODO(shared Triton layer): this uses Triton internals (``make_backend``,
``ASTSource.make_ir``); it belongs in jax_kernel_runtime next to
``_triton_compile``, where pallas-gpu's interpreter path could use it too.
"""

from __future__ import annotations

import os
import threading

from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from jax_kernel_runtime import _triton_interpret
from jax_triton._src.signature import BoundCall

_checked: set = set()
_lock = threading.Lock()


class TritonFrontendError(Exception):
    """Raised by ``check`` with Triton's diagnostic; wrapped by the caller."""


def check(fn, bound: BoundCall, options: dict) -> None:
    """Raises ``TritonFrontendError`` when Triton's front end rejects the kernel."""
    key = (fn.cache_key, bound.key(), tuple(sorted(options.items())))
    with _lock:
        if key in _checked:
            return
    # While a kernel is interpreted (in a callback thread) triton.language is
    # patched with the interpreter's functions: wait for the real language.
    with _triton_interpret._lock:
        try:
            _make_ir(fn, bound, options)
        except Exception as e:  # Triton raises CompilationError and plain errors
            raise TritonFrontendError(str(e) or repr(e)) from e
    with _lock:
        _checked.add(key)


def _make_ir(fn, bound: BoundCall, options: dict) -> None:
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen_fns = backend.get_codegen_implementation(parsed)
    codegen_fns["min_dot_size"] = lambda lhs_type, rhs_type: (1, 1, 1)  # as the interpreter
    src = ASTSource(fn, bound.signature(), constexprs=bound.constexprs(), attrs=bound.attrs())
    src.make_ir(target, parsed, codegen_fns, backend.get_module_map(), context)


def kernel_source(fn) -> str:
    """``file.py:LINE`` where the kernel's Python function starts."""
    code = getattr(fn.fn, "__code__", None)
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else "?"


def zero_d_hint(bound: BoundCall, in_avals) -> str:
    """A note for 0-d array inputs: they are pointers, not scalar values."""
    names = [p.name for p in bound.params
             if p.kind == "buffer" and p.operand < len(in_avals) and not in_avals[p.operand].shape]  # fmt: skip
    if not names:
        return ""
    return (
        f"\nNote: {names} got 0-d arrays, which are passed as pointers to one "
        f"element. For a scalar value pass a Python/numpy scalar; a traced value "
        f"cannot be a scalar parameter: tl.load it in the kernel."
    )
