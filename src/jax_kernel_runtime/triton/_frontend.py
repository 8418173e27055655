"""Triton's front end (kernel source -> Triton IR), without a GPU.

A kernel run by the interpreter executes its Python inside a host callback,
so a kernel that does not compile (an undefined name, a type error, a bad
``tl.constexpr``) would otherwise fail only when the call runs, as an opaque
``CpuCallback error``. ``check_frontend`` runs the front end the GPU compile starts
with, at trace time, so those errors come with Triton's message and source
line. Only the front end runs (no GPU, no ptxas; milliseconds), and GPU-only
limits the interpreter does not have (the smallest ``tl.dot``) are relaxed
as in the interpreter. Results are memoized per key.

This module touches Triton internals (``make_backend``, ``ASTSource.make_ir``);
a Triton release that moves them breaks this file only.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from jax_kernel_runtime.triton._state import lock as interpreter_lock

_checked: set = set()
_lock = threading.Lock()


class TritonFrontendError(Exception):
    """Triton's front end rejected a kernel; the message is Triton's diagnostic."""


def check_frontend(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    attrs: dict,
    options: dict[str, Any],
    key: Hashable,
) -> None:
    """Raises ``TritonFrontendError`` when Triton's front end rejects the
    ``@triton.jit`` function ``fn`` with this signature (as ``ASTSource``
    takes it) and compile ``options``. ``key`` identifies the specialization:
    a key checked before is not checked again."""
    with _lock:
        if key in _checked:
            return
    # While a kernel is interpreted (in a callback thread) triton.language is
    # patched with the interpreter's functions: wait for the real language.
    with interpreter_lock:
        try:
            _make_ir(fn, signature, constexprs, attrs, options)
        except Exception as e:  # Triton raises CompilationError and plain errors
            raise TritonFrontendError(str(e) or repr(e)) from e
    with _lock:
        _checked.add(key)


def _make_ir(fn, signature, constexprs, attrs, options) -> None:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    parsed = backend.parse_options(dict(options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen_fns = backend.get_codegen_implementation(parsed)
    codegen_fns["min_dot_size"] = lambda lhs_type, rhs_type: (1, 1, 1)  # as the interpreter
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    src.make_ir(target, parsed, codegen_fns, backend.get_module_map(), context)
