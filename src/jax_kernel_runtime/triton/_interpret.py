"""Running a ``@triton.jit`` kernel on host memory with Triton's interpreter,
for pallas-gpu (``interpret=plgpu.InterpretParams()``) and jax-triton (CPU).

Triton's interpreter keeps the current program id and its language patches
in module globals, so one kernel runs at a time in a process: ``interpret``
holds the one lock, whichever package calls it. While a kernel runs, the
interpreter is patched:

* bounds: every masked-in pointer of a load, store or atomic must lie inside
  one of the kernel's argument buffers; otherwise ``OutOfBoundsError`` names
  the kernel, the program, the argument nearest the pointer and the offset
  (the interpreter itself dereferences raw addresses: a bad index would
  crash the process or silently read or corrupt host memory);
* bf16: arithmetic, ``tl.dot`` and every cast to or from bf16 compute on
  values (through fp32) and round to nearest even, as the GPU does (Triton's
  interpreter works on the raw ``uint16`` storage; 3.6 truncates);
* NumPy >= 2.5: scalar tensors convert to Python ints through their element;
* nested ``@triton.jit`` calls run interpreted, and the patches are undone
  afterwards, so later GPU compiles see the real ``triton.language``.

The patches live in ``_patches`` (bounds, bf16, hints) and ``_batched``
(many programs per pass); this module applies them in order (``apply``) and
runs the grid. The lock, the running kernel's buffers and the checks are
``_state``'s, below all three.

A launch that takes longer than ``JAX_KERNEL_RUNTIME_INTERPRET_PROGRESS_S``
seconds (default 5) prints its progress to stderr (programs done / total).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, NamedTuple

import numpy as np

from jax_kernel_runtime.triton import _batched, _patches, _state
from jax_kernel_runtime.triton._state import lock


class Pointer(NamedTuple):
    """A pointer argument: Triton's type (``"*fp32"``) and the host array."""

    type: str
    array: np.ndarray


def _progress_seconds() -> float:
    try:
        return float(os.environ.get("JAX_KERNEL_RUNTIME_INTERPRET_PROGRESS_S", "5"))
    except ValueError:
        return 5.0


def interpret(fn: Any, grid: tuple[int, int, int], args: dict[str, Any], *, name: str,
              constexprs: frozenset[str] | set[str] = frozenset(), debug: bool = False) -> None:  # fmt: skip
    """Runs the Python function ``fn`` of a ``@triton.jit`` kernel (its
    ``.fn``) on the host, for every program of ``grid``.

    ``args`` maps every kernel parameter to a ``Pointer`` (into a host array,
    which the kernel reads and writes in place), a Python scalar, or, for
    names in ``constexprs``, the constexpr value. ``name`` names the kernel
    in errors and progress lines. ``debug`` turns ``tl.device_assert`` on, as
    Triton's ``debug=True`` does on the GPU (its interpreter never sets it).
    """
    with lock:
        interp = _state.interpreter()
        rewritten = interp.InterpretedFunction(fn).rewrite()
        call_args, buffers, keep = {}, [], []
        for arg_name, value in args.items():
            if arg_name in constexprs:
                call_args[arg_name] = value
            elif isinstance(value, Pointer):
                arr = value.array
                # A zero-size array still needs a valid address for the kernel.
                target = arr if arr.size else np.zeros(1, arr.dtype)
                keep.append(target)
                addr = target.ctypes.data
                buffers.append((arg_name, addr, arr.nbytes, arr.dtype))
                call_args[arg_name] = _patches.pointer_arg(value.type, addr)
            else:
                call_args[arg_name] = _patches.scalar_arg(value)
        bounds = _state.begin(name, buffers)
        scope = apply(fn)
        builder = interp.interpreter_builder
        scope[0].set_attr(builder, "options", dataclasses.replace(builder.options, debug=debug))
        try:
            _run_grid(rewritten, grid, call_args, bounds, interp)
        finally:
            restore(scope)
            _state.end()


def max_batch() -> int:
    """Most programs per batched pass (``JAX_KERNEL_RUNTIME_INTERPRET_BATCH``,
    default 4096; 1 runs every program on its own, as Triton does)."""
    try:
        return max(1, int(os.environ.get("JAX_KERNEL_RUNTIME_INTERPRET_BATCH", "4096")))
    except ValueError:
        return 4096


_FIRST_PASS = 16  # programs in a launch's first pass, which measures the block sizes
_ELEMENTS_PER_VALUE = 1 << 21  # a pass's largest value holds about this many elements


def _run_grid(rewritten, grid, call_args, bounds: _state.Bounds, interp) -> None:
    name = bounds.kernel
    interp.interpreter_builder.set_grid_dim(*grid)
    total = grid[0] * grid[1] * grid[2]
    every = _progress_seconds()
    start = time.monotonic()
    next_report = start + every
    reported = False
    limit = max_batch()
    size = min(limit, _FIRST_PASS)
    done = 0
    while done < total:
        n = min(size, total - done)
        batched = False
        if n >= 2:
            ids = np.arange(done, done + n)
            coords = np.stack([ids // (grid[1] * grid[2]), ids // grid[2] % grid[1], ids % grid[2]], 1)
            batched, permanent, per_program = _batched.run_chunk(rewritten, call_args, coords)
            if permanent:
                limit = 1
            size = min(limit, max(2, _ELEMENTS_PER_VALUE // max(1, per_program)))
        if not batched:  # one by one, as Triton runs them
            for linear in range(done, done + n):
                x, y, z = linear // (grid[1] * grid[2]), linear // grid[2] % grid[1], linear % grid[2]
                interp.interpreter_builder.set_grid_idx(x, y, z)
                bounds.program = (x, y, z)
                rewritten(**call_args)
        done += n
        now = time.monotonic()
        if now >= next_report and done < total:
            _report(name, done, total, now - start)
            reported = True
            next_report = now + max(every, 1.0)
    if reported:
        _report(name, done, total, time.monotonic() - start)


def _report(name: str, done: int, total: int, elapsed: float) -> None:
    left = elapsed / done * (total - done)
    tail = "done" if done == total else f"about {left:.0f} s left"
    print(
        f"[jax_kernel_runtime] interpreting {name} on the CPU: "
        f"{done}/{total} programs done in {elapsed:.1f} s, {tail} "
        "(programs run one at a time where they cannot run together; a smaller grid goes faster)",
        file=sys.stderr,
        flush=True,
    )


# ---------------------------------------------------------------------------
# Applying the patches


def _call_jit_function_interpreted(self, *args, **kwargs):
    """Stands in for ``JITFunction.__call__`` while a kernel is interpreted:
    a nested ``@triton.jit`` call (``tl.max`` and other library helpers
    too) runs interpreted, and its language patch is undone afterwards."""
    interp = _state.interpreter()
    scope = interp._patch_lang(self.fn)
    _batched.lang_patches(scope)  # the language patch above replaced them
    _patches.hint_patches(scope)
    try:
        return interp.InterpretedFunction(self.fn).rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def apply(fn) -> Any:
    """Patches the language for ``fn`` and the interpreter; returns what
    ``restore`` undoes."""
    from triton.runtime.jit import JITFunction

    interp = _state.interpreter()
    scope = interp._patch_lang(fn)
    # Scalar conversions that work with NumPy >= 2.5 (which removed int() of
    # arrays with ndim > 0, used on the interpreter's (1,)-shaped scalars) and
    # with batched programs; reductions and scans that know the program axis.
    _batched.lang_patches(scope)
    _patches.hint_patches(scope)
    _patches.builder_patches(scope)
    _batched.builder_patches(scope)  # on top of the patches above
    original_call = JITFunction.__call__
    JITFunction.__call__ = _call_jit_function_interpreted
    return scope, original_call


def restore(state) -> None:
    """Undoes ``apply``."""
    from triton.runtime.jit import JITFunction

    scope, original_call = state
    JITFunction.__call__ = original_call
    scope.restore()
