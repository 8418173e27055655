"""The interpreter's process state, below every other module of the layer:
the one lock, the running kernel's buffers, the checks the patched operations
call (``check_access``, ``check_hint``) and their errors, and Triton's
interpreter module.

Triton's interpreter keeps the current program id and its language patches
in module globals, so one kernel runs at a time in a process: ``lock`` is held
while a kernel is interpreted (``_interpret.interpret``), and by whoever needs
the real ``triton.language`` (``_compile.compile_triton``, ``_frontend.check_frontend``).
"""

from __future__ import annotations

import functools
import threading

import numpy as np

#: THE interpreter lock of the process: held while a kernel is interpreted
#: (triton.language is patched meanwhile), and by whoever needs the real
#: language (compile_triton, the front-end check).
lock = threading.Lock()
_running: Bounds | None = None  # the running kernel's buffers (under lock)


@functools.cache
def interpreter():
    """Triton's interpreter module (``triton.runtime.interpreter``), imported
    on first use."""
    from triton.runtime import interpreter

    return interpreter


def begin(kernel: str, buffers: list[tuple[str, int, int, np.dtype]]) -> Bounds:
    """Makes ``buffers`` (argument name, start address, bytes, dtype) those of
    the running kernel ``kernel`` (under ``lock``); returns them."""
    global _running
    _running = Bounds(kernel, buffers)
    return _running


def end() -> None:
    """No kernel runs any more."""
    global _running
    _running = None


class OutOfBoundsError(IndexError):
    """An interpreted kernel accessed memory outside its argument buffers."""


class HintError(ValueError):
    """An interpreted kernel gave the compiler a hint that its values break
    (``tl.multiple_of``, ``tl.max_contiguous``; ``pl.multiple_of``)."""


class Bounds:
    """The argument buffers of the running kernel and the program it is at."""

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


def check_access(what: str, ptrs: np.ndarray, mask: np.ndarray | None, elem_bytes: int) -> None:
    """Called by the patched memory operations; raises ``OutOfBoundsError``."""
    if _running is not None:
        _running.check(what, ptrs, mask, elem_bytes)


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
    where = _running.kernel if _running is not None else "a Triton kernel"
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
