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
* bf16: arithmetic, ``tl.dot`` and fp32 -> bf16 casts compute on values and
  round to nearest even, as the GPU does (Triton 3.6 works on the raw
  ``uint16`` storage and truncates);
* NumPy >= 2.5: scalar tensors convert to Python ints through their element;
* nested ``@triton.jit`` calls run interpreted, and the patches are undone
  afterwards, so later GPU compiles see the real ``triton.language``.

A launch that takes longer than ``JAX_KERNEL_RUNTIME_INTERPRET_PROGRESS_S``
seconds (default 5) prints its progress to stderr (programs done / total).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any, NamedTuple

import numpy as np

# THE interpreter lock of the process: held while a kernel is interpreted
# (triton.language is patched meanwhile), and by whoever needs the real
# language (compile_triton, jax-triton's front-end check).
lock = threading.Lock()
_lock = lock
_bounds: _Bounds | None = None  # the running kernel's buffers (under _lock)


class Pointer(NamedTuple):
    """A pointer argument: Triton's type (``"*fp32"``) and the host array."""

    type: str
    array: np.ndarray


class OutOfBoundsError(IndexError):
    """An interpreted kernel accessed memory outside its argument buffers."""


class HintError(ValueError):
    """An interpreted kernel gave the compiler a hint that its values break
    (``tl.multiple_of``, ``tl.max_contiguous``; ``pl.multiple_of``)."""


class _Bounds:
    def __init__(self, kernel: str, buffers: list[tuple[str, int, int, np.dtype]]):
        self.kernel = kernel
        self.buffers = buffers  # (argument name, start address, bytes, dtype)
        spans = sorted((start, start + n) for _, start, n, _ in buffers if n > 0)
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = np.array([lo for lo, _ in merged], np.uint64)
        self.lengths = np.array([hi - lo for lo, hi in merged], np.uint64)
        self.program = (0, 0, 0)

    def check(self, what: str, ptrs: np.ndarray, mask: np.ndarray | None, elem_bytes: int) -> None:
        p = np.asarray(ptrs, np.uint64)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask, bool), p.shape)]
        p = p.reshape(-1)
        if p.size == 0:
            return
        if self.starts.size == 0:
            ok = np.zeros(p.shape, bool)
        else:
            idx = np.searchsorted(self.starts, p, side="right").astype(np.int64) - 1
            i = np.maximum(idx, 0)
            off = p - self.starts[i]  # meaningful where idx >= 0 (p >= start)
            room = np.where(off < self.lengths[i], self.lengths[i] - off, np.uint64(0))
            ok = (idx >= 0) & (room >= np.uint64(elem_bytes))
        if ok.all():
            return
        bad = p[~ok]
        raise OutOfBoundsError(self._message(what, int(bad[0]), int(bad.size), int(p.size), elem_bytes))

    def _message(self, what: str, ptr: int, n_bad: int, n: int, elem_bytes: int) -> str:
        def distance(b):
            _, start, nbytes, _ = b
            return start - ptr if ptr < start else max(0, ptr + elem_bytes - (start + nbytes))

        article = "an" if what[0] in "aeiou" else "a"
        head = f"{self.kernel}, program {self.program}: {article} {what} "
        if not self.buffers:
            return head + f"accesses address {ptr:#x}, but the kernel has no pointer arguments"
        name, start, nbytes, dtype = min(self.buffers, key=distance)
        byte_off = ptr - start
        elems = nbytes // dtype.itemsize if dtype.itemsize else 0
        where = (
            f"element offset {byte_off // elem_bytes}"
            if byte_off % elem_bytes == 0
            else f"byte offset {byte_off}"
        )
        valid = f"valid element offsets 0..{elems - 1}" if elems else "empty"
        return (
            head + f"is out of bounds: {n_bad} of its {n} masked-in pointers lie outside every argument "
            f"buffer; the first is at {where} from argument {name!r} (the nearest buffer: "
            f"{elems} x {dtype.name} = {nbytes} bytes, {valid}). On a "
            "GPU this reads or corrupts unrelated memory. Mask the access (e.g. "
            "mask=offsets < n) or fix the index computation."
        )


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
    global _bounds
    from jax_kernel_runtime import _triton_patches as patches

    with lock:
        interp = patches.interpreter()
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
                call_args[arg_name] = patches.pointer_arg(value.type, addr)
            else:
                call_args[arg_name] = patches.scalar_arg(value)
        _bounds = _Bounds(name, buffers)
        scope = patches.apply(fn)
        builder = interp.interpreter_builder
        scope[0].set_attr(builder, "options", dataclasses.replace(builder.options, debug=debug))
        try:
            _run_grid(rewritten, grid, call_args, name, interp)
        finally:
            patches.restore(scope)
            _bounds = None


def max_batch() -> int:
    """Most programs per batched pass (``JAX_KERNEL_RUNTIME_INTERPRET_BATCH``,
    default 4096; 1 runs every program on its own, as Triton does)."""
    try:
        return max(1, int(os.environ.get("JAX_KERNEL_RUNTIME_INTERPRET_BATCH", "4096")))
    except ValueError:
        return 4096


_FIRST_PASS = 16  # programs in a launch's first pass, which measures the block sizes
_ELEMENTS_PER_VALUE = 1 << 21  # a pass's largest value holds about this many elements


def _run_grid(rewritten, grid, call_args, name: str, interp) -> None:
    from jax_kernel_runtime import _triton_batched

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
            batched, permanent, per_program = _triton_batched.run_chunk(rewritten, call_args, coords)
            if permanent:
                limit = 1
            size = min(limit, max(2, _ELEMENTS_PER_VALUE // max(1, per_program)))
        if not batched:  # one by one, as Triton runs them
            for linear in range(done, done + n):
                x, y, z = linear // (grid[1] * grid[2]), linear // grid[2] % grid[1], linear % grid[2]
                interp.interpreter_builder.set_grid_idx(x, y, z)
                _bounds.program = (x, y, z)
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


def check_access(what: str, ptrs: np.ndarray, mask: np.ndarray | None, elem_bytes: int) -> None:
    """Called by the patched memory operations; raises ``OutOfBoundsError``."""
    if _bounds is not None:
        _bounds.check(what, ptrs, mask, elem_bytes)


def check_hint(kind: str, values: np.ndarray, hint: list[int], shape: list[int]) -> None:
    """Raises ``HintError`` when ``values`` (a tensor of ``shape``, maybe with
    leading program axes) break the compiler hint ``kind`` (``tt.divisibility``,
    ``tt.contiguity``): the GPU compiler trusts a hint (it vectorizes and aligns
    accesses by it), so a false one gives wrong answers there and none here.

    ``multiple_of`` is checked on scalars (the start of a ``pl.ds``), where it
    means every value; on a tensor it speaks of the first element of each
    contiguous run, which is left to ``max_contiguous``'s check.
    """
    data = np.asarray(values)
    if not np.issubdtype(data.dtype, np.integer):
        return
    where = _bounds.kernel if _bounds is not None else "a Triton kernel"
    if kind == "tt.divisibility":
        n = int(hint[0]) if hint else 1
        if shape or n <= 1:
            return
        bad = data[data % n != 0]
        if bad.size:
            raise HintError(
                f"{where}: multiple_of(x, {n}) is false: x = {int(bad.reshape(-1)[0])}. The GPU "
                "compiler trusts the hint (aligned, vectorized accesses), so the kernel would read or "
                "write the wrong elements there; fix the hint (pl.multiple_of / tl.multiple_of) or drop it"
            )
    elif kind == "tt.contiguity":
        for d, (size, c) in enumerate(zip(shape, hint)):
            c = int(c)
            if c <= 1 or size % c:
                continue
            axis = data.ndim - len(shape) + d
            runs = np.moveaxis(data.astype(np.int64), axis, -1).reshape(*data.shape[:axis],
                                                                        *data.shape[axis + 1 :], size // c, c)  # fmt: skip
            if not (np.diff(runs, axis=-1) == 1).all():
                raise HintError(
                    f"{where}: max_contiguous(x, {list(hint)}) is false: along dim {d}, x does not "
                    f"hold runs of {c} consecutive values. The GPU compiler trusts the hint (vectorized "
                    "accesses), so the kernel would read or write the wrong elements there; fix the "
                    "hint (plgpu.max_contiguous / tl.max_contiguous) or drop it"
                )
