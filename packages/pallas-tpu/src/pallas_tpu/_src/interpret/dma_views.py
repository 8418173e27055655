"""The ends of the DMAs of an interpreted TPU kernel (``dma.py``, ``remote_dma.py``):
``DmaView``, one end (a view of a cell, with its shape, and its flat element indices
when its size is traced), and ``DmaViews``, which makes them from Refs' views and
reads and writes them, also in the flat companion cells where on_wait DMAs land
(``Memory.shadows``), and as 1-d runs of the flattened cells (``flat_region``)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret.errors import Checks
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.interpret.refs import (
    RefAccess,
    RefView,
    clip_index,
    has_traced_sizes,
    is_slice,
    is_static_int,
)


@dataclasses.dataclass(frozen=True)
class DmaView:
    """One end of a DMA: a view of a cell, its dtype and shape (ints, or traced
    sizes), and for a view whose size is traced its flat element indices
    (``RefAccess.view_indices``; None for a static view)."""

    view: RefView
    dtype: Any
    shape: tuple
    idx: Any = None

    @property
    def cell(self) -> int:
        return self.view.cell

    def on(self, cell: int) -> DmaView:
        """The same region of a companion cell of the same shape (shadow, marks)."""
        return dataclasses.replace(self, view=RefView(cell, self.view.transforms))

    @property
    def nbytes(self):
        """The byte count: an int, or a traced int32 when the size is traced."""
        return _as_count(math.prod(self.shape) * np.dtype(self.dtype).itemsize)


def _as_count(n):
    return n if isinstance(n, (int, np.integer)) else jnp.asarray(n, jnp.int32)


def _run(flat, region):
    offset, n = region
    if is_static_int(offset):
        return flat if (offset, n) == (0, flat.size) else lax.slice(flat, (offset,), (offset + n,))
    return lax.dynamic_slice(flat, (offset,), (n,), allow_negative_indices=False)  # clamped


def _put_run(flat, region, val):
    offset, n = region
    val = lax.reshape(jnp.asarray(val, flat.dtype), (n,))
    if is_static_int(offset) and (offset, n) == (0, flat.size):
        return val
    return lax.dynamic_update_slice(
        flat, val, (jnp.asarray(offset, jnp.int32),), allow_negative_indices=False
    )


class DmaViews:
    """DMA ends over ``memory``'s cells, read and written through ``refs``; checks
    (bounds, equal sizes) recorded in ``checks``; ``where(eqn)`` names an equation."""

    def __init__(self, memory: Memory, refs: RefAccess, checks: Checks, where: Callable[[Any], str]):
        self.memory = memory
        self.refs = refs
        self.checks = checks
        self.where = where

    def dma_view(self, view: RefView, eqn, what: str) -> DmaView:
        x = self.memory.state[view.cell]
        if not any(has_traced_sizes(t) for t in view.transforms):
            aval = plb.transformed_aval(compat.shaped_array(x.shape, x.dtype), view.transforms)
            return DmaView(view, aval.dtype, tuple(aval.shape))
        idx, shape = self.refs.view_indices(view, eqn, what)
        return DmaView(view, x.dtype, shape, idx)

    def dma_nbytes(self, view: RefView, eqn):
        """The byte count of a descriptor's view: what a wait on it takes off its semaphore."""
        x = self.memory.state[view.cell]
        aval = plb.transformed_aval(compat.shaped_array(x.shape, x.dtype), view.transforms)
        return _as_count(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)

    def endpoints(self, eqn, src_view: RefView, dst_view: RefView) -> tuple[DmaView, DmaView]:
        """The two ends of a DMA. When a size is traced, both as flat indices of
        one static shape (position i of one is position i of the other)."""
        src = self.dma_view(src_view, eqn, "DMA read")
        dst = self.dma_view(dst_view, eqn, "DMA write")
        if src.idx is None and dst.idx is None:
            return src, dst
        if src.idx is None:
            src = dataclasses.replace(src, idx=self.refs.view_indices(src_view, eqn, "DMA read")[0])
        if dst.idx is None:
            dst = dataclasses.replace(dst, idx=self.refs.view_indices(dst_view, eqn, "DMA write")[0])
        common = tuple(slice(0, min(a, b)) for a, b in zip(src.idx.shape, dst.idx.shape))
        src = dataclasses.replace(src, idx=src.idx[common])
        dst = dataclasses.replace(dst, idx=dst.idx[common])
        for d, (a, b) in enumerate(zip(src.shape, dst.shape)):
            if not (isinstance(a, int) and isinstance(b, int)):
                self.checks.check(
                    jnp.asarray(a) == jnp.asarray(b),
                    f"{self.where(eqn)}: the DMA's source has {{0}} elements along dimension {d} "
                    "and its destination {1}; they must be equal",
                    [a, b],
                )
        return src, dst

    def flat_region(self, dv: DmaView, eqn, what: str):
        """(flat offset, element count) of the elements of ``dv``'s cell that a static
        view covers, when they are one contiguous run (row-major: a view such as
        ``buf.at[slot]`` or ``x.at[pl.ds(i, 128)]``); None otherwise. The offset's
        indices are bounds-checked and clamped as a read of the view is.

        DMAs move such regions as 1-d runs of the flattened cells (a bitcast to XLA):
        the kernels XLA compiles for them then depend on the run's length only, so
        buffers of one size and different shapes share them (XLA's CPU compile time
        goes mostly by distinct kernels)."""
        if dv.idx is not None:
            return None
        x = self.memory.state[dv.cell]
        ts = dv.view.transforms
        if not ts:
            return (0, x.size) if x.size else None
        if len(ts) != 1 or not hasattr(ts[0], "indices") or len(ts[0].indices) != x.ndim:
            return None
        sizes = []
        for ix in ts[0].indices:
            if is_slice(ix):
                if not (is_static_int(ix.size) and is_static_int(ix.stride) and int(ix.stride) == 1):
                    return None
                sizes.append(int(ix.size))
            elif jnp.ndim(ix) == 0:
                sizes.append(1)
            else:
                return None
        if not all(sizes):
            return None
        partial = [d for d, (k, n) in enumerate(zip(sizes, x.shape)) if k < n]
        if partial and any(k > 1 for k in sizes[: partial[-1]]):
            return None  # rows of a block narrower than the buffer: not one run
        starts = self.refs.index_parts(x.shape, ts[0], eqn, dv.view, what)[0]
        if self.refs.fills_oob(what) and not all(
            isinstance(st, (int, np.integer)) and 0 <= st and st + k <= n
            for st, k, n in zip(starts, sizes, x.shape)
        ):
            return (
                None  # a read that may pass the edge reads the uninitialized value there (RefAccess._read1)
            )
        fixed, terms, step = 0, [], 1
        for d in reversed(range(x.ndim)):
            if sizes[d] < x.shape[d]:
                st = clip_index(starts[d], 0, x.shape[d] - sizes[d])
                if is_static_int(st):
                    fixed += int(st) * step
                else:
                    terms.append(lax.mul(st, np.int32(step)) if step != 1 else st)
            step *= x.shape[d]
        if not terms:
            return fixed, math.prod(sizes)
        offset = terms[0]
        for t in terms[1:]:
            offset = lax.add(offset, t)
        return (lax.add(offset, np.int32(fixed)) if fixed else offset), math.prod(sizes)

    def read(self, dv: DmaView, eqn, what: str, cell: int | None = None, region=None):
        """The view's elements in ``cell``: by default its own data cell, else a flat
        companion of it (``Memory.shadows``). With ``region`` (``flat_region``'s
        answer), as a 1-d run."""
        x = self.memory.state[dv.cell if cell is None else cell]
        if region is not None:
            return _run(lax.reshape(x, (x.size,)), region)
        with self._shaped(dv, cell):
            dv = dv if cell is None else dv.on(cell)
            if dv.idx is None:
                return self.refs.read_view(dv.view, eqn, what=what)
            x = self.memory.state[dv.cell]
            return x.reshape(-1)[jnp.clip(dv.idx, 0, max(x.size - 1, 0))]

    def write(self, dv: DmaView, val, eqn, cell: int | None = None, region=None) -> None:
        """Writes ``val`` (the view's shape, or a 1-d run with ``region``) as ``read`` reads."""
        if region is not None:
            c = dv.cell if cell is None else cell
            x = self.memory.state[c]
            self.memory.state[c] = lax.reshape(_put_run(lax.reshape(x, (x.size,)), region, val), x.shape)
            return
        with self._shaped(dv, cell):
            dv = dv if cell is None else dv.on(cell)
            if dv.idx is None:
                self.refs.write_view(dv.view, val, eqn)
                return
            x = self.memory.state[dv.cell]
            val = jnp.asarray(val, x.dtype).reshape(-1)
            self.memory.state[dv.cell] = (
                x.reshape(-1).at[dv.idx.reshape(-1)].set(val, mode="drop").reshape(x.shape)
            )

    @contextlib.contextmanager
    def _shaped(self, dv: DmaView, cell: int | None):
        """A flat companion cell of ``dv``'s data cell seen in the data cell's shape
        meanwhile, for views that are not one run (strided, bitcast, traced sizes)."""
        if cell is None or cell == dv.cell:
            yield
            return
        flat = self.memory.state[cell].shape
        self.memory.state[cell] = lax.reshape(self.memory.state[cell], self.memory.state[dv.cell].shape)
        try:
            yield
        finally:
            self.memory.state[cell] = lax.reshape(self.memory.state[cell], flat)

    def valid(self, dv: DmaView):
        return None if dv.idx is None else dv.idx < self.memory.state[dv.cell].size
