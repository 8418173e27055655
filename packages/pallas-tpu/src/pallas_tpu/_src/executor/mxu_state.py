"""``run_mosaic``'s model of one core's MXUs (``dialects/tpu_mxu.py``): the staging
registers, the loaded weights, the result FIFOs and the accumulators, as numpy arrays.

Registers hold float32 (every MXU operand type is exact in it); products are
float64 sums rounded to float32 (float operands) or int64 sums wrapped to int32
(integer operands). Accumulators are addressed as Mosaic addresses them: in vregs from
the start of an MXU's accumulator memory, one vreg holding 8 rows of 128 columns.
"""

from __future__ import annotations

import collections
import weakref

import numpy as np

from pallas_tpu._src.executor.errors import MosaicError, where


class MxuState:
    """One core's MXUs (made on first use by ``of``)."""

    def __init__(self):
        self.staged: dict[tuple[int, int], np.ndarray] = {}  # (mxu, register) -> RHS
        self.weights: dict[int, np.ndarray] = {}  # mxu -> loaded RHS
        self.fifo: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # rows
        self.acc: dict[tuple[int, int], np.ndarray] = {}  # (mxu, vreg address) -> (8, 128) values

    def push(self, op, mxu: int, reg: int, rhs: np.ndarray) -> None:
        if (mxu, reg) in self.staged:
            raise MosaicError(
                f"run_mosaic: {where(op)}: staging register {reg} of MXU {mxu} still holds an RHS no matmul loaded"
            )
        self.staged[mxu, reg] = rhs

    def multiply(self, op, mxu: int, lhs: np.ndarray, reg: int | None) -> np.ndarray:
        if reg is not None:
            if (mxu, reg) not in self.staged:
                raise MosaicError(f"run_mosaic: {where(op)}: staging register {reg} of MXU {mxu} is empty")
            self.weights[mxu] = self.staged.pop((mxu, reg))
        w = self.weights.get(mxu)
        if w is None or w.shape[0] != lhs.shape[1]:
            have = "no weights" if w is None else f"weights of {w.shape[0]} rows"
            raise MosaicError(
                f"run_mosaic: {where(op)}: MXU {mxu} holds {have} for an lhs {lhs.shape[1]} deep"
            )
        if np.issubdtype(lhs.dtype, np.integer) or lhs.dtype.name in ("int4", "uint4", "int2", "uint2"):
            prod = lhs.astype(np.int64) @ w.astype(np.int64)
            return prod.astype(np.int32)
        return (lhs.astype(np.float64) @ w.astype(np.float64)).astype(np.float32)

    def fifo_push(self, mxu: int, out: np.ndarray) -> None:
        self.fifo[mxu].extend(out)

    def fifo_pop(self, op, mxu: int, rows: int, dtype) -> np.ndarray:
        q = self.fifo[mxu]
        if len(q) < rows:
            raise MosaicError(
                f"run_mosaic: {where(op)}: popping {rows} rows from MXU {mxu}'s result FIFO, which holds {len(q)}"
            )
        out = np.stack([q.popleft() for _ in range(rows)])
        if out.dtype != np.dtype(dtype):
            raise MosaicError(
                f"run_mosaic: {where(op)}: popping {np.dtype(dtype)} results from MXU {mxu}'s FIFO, which holds "
                f"{out.dtype} ones"
            )
        return out

    def _vregs(self, base: int, shape):
        m, k = int(np.prod(shape[:-1])), shape[-1]
        per_entry = k // 128
        for e in range(m // 8):
            for c in range(per_entry):
                yield base + e * per_entry + c, slice(8 * e, 8 * e + 8), slice(128 * c, 128 * c + 128)

    def accumulate(self, mxu: int, base: int, out: np.ndarray) -> None:
        for addr, rows, cols in self._vregs(base, out.shape):
            cur = self.acc.get((mxu, addr))
            part = out[rows, cols]
            self.acc[mxu, addr] = part.copy() if cur is None else (cur + part).astype(part.dtype)

    def pop(self, mxu: int, base: int, shape, dtype) -> np.ndarray:
        flat = (int(np.prod(shape[:-1])), shape[-1])
        out = np.zeros(flat, dtype)
        for addr, rows, cols in self._vregs(base, flat):
            v = self.acc.pop((mxu, addr), None)
            if v is not None:
                out[rows, cols] = v.astype(dtype) if v.dtype == np.dtype(dtype) else v.view(dtype)
        return out.reshape(shape)


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def of(executor) -> MxuState:
    """The MXUs of the core ``executor`` runs."""
    state = _STATES.get(executor)
    if state is None:
        state = _STATES[executor] = MxuState()
    return state
