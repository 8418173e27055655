"""Trace-time checks of a ``triton_call`` on the CPU: Triton's front end runs
in jax_kernel_runtime's shared Triton layer
(``jax_kernel_runtime.triton.check_frontend``); this module binds it to a
``BoundCall`` and words the hints of jax-triton's errors.
"""

from __future__ import annotations

import os

from jax_kernel_runtime import triton as jkr_triton
from jax_kernel_runtime.triton import TritonFrontendError
from jax_triton._src.signature import BoundCall

__all__ = ["TritonFrontendError", "check", "kernel_source", "zero_d_hint"]


def check(fn, bound: BoundCall, options: dict) -> None:
    """Raises ``TritonFrontendError`` when Triton's front end rejects the kernel."""
    key = (fn.cache_key, bound.key(), tuple(sorted(options.items())))
    jkr_triton.check_frontend(fn, bound.signature(), bound.constexprs(), bound.attrs(), options, key)


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
