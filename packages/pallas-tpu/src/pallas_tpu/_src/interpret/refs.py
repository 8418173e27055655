"""Refs as views of state cells in TPU interpret mode.

A Ref the kernel holds is a ``RefView``: a cell of the interpreter's state and
the transforms (indexers, reshapes, bitcasts...) applied to it. ``RefAccess``,
a part of the ``Interpreter`` (``interpreter.py``), reads and writes through those
transforms: static indices become plain slices, traced ones dynamic slices,
and every dynamic index is bounds-checked (``Checks.check``, in ``errors.py``), with
JAX's words ("Out-of-bounds read") first in the message."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret.errors import Checks
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.language.vector_primitives import bitcast_impl as tpu_bitcast


@dataclasses.dataclass(frozen=True)
class RefView:
    """A Ref seen by the kernel: a state cell and the transforms applied to it."""

    cell: int
    transforms: tuple[Any, ...] = ()

    def with_transforms(self, more: Sequence[Any]) -> RefView:
        return RefView(self.cell, self.transforms + tuple(more))


def is_slice(x) -> bool:
    return hasattr(x, "start") and hasattr(x, "size") and hasattr(x, "stride")


def has_traced_sizes(transform) -> bool:
    """True if ``transform`` is an indexer with a slice whose size is traced."""
    return any(is_slice(ix) and not is_static_int(ix.size) for ix in getattr(transform, "indices", ()))


@dataclasses.dataclass(frozen=True)
class _Window:
    """A strided window of a cell's flat elements: element ``(i_0, i_1, ...)`` of the
    window is ``base + sum(i_k * strides[k])``, ``i_k < counts[k]``; ``shape`` the
    view's shape (a traced size where one is traced), ``masks`` for those dimensions
    whose positions past the traced size are not part of the view."""

    base: Any
    strides: list
    counts: list
    shape: list
    masks: dict

    @classmethod
    def of(cls, shape) -> _Window:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        return cls(0, strides, list(shape), list(shape), {})

    def indices(self):
        """(flat indices in the window's shape, validity or None)."""
        const = np.zeros(self.counts, np.int32)
        for d, (stride, count) in enumerate(zip(self.strides, self.counts)):
            at = [-1 if k == d else 1 for k in range(len(self.counts))]
            const = const + (np.arange(count, dtype=np.int32) * np.int32(stride)).reshape(at)
        if is_static_int(self.base):
            idx = jnp.asarray(const + np.int32(self.base))
        else:
            idx = lax.add(lax.broadcast(self.base, tuple(self.counts)), const)
        valid = None
        for d, m in self.masks.items():
            m = lax.broadcast_in_dim(m, tuple(self.counts), (d,))
            valid = m if valid is None else lax.bitwise_and(valid, m)
        return idx, valid


def _add_scaled(base, x, k: int):
    """``base + x * k``: a Python int while both are known, else traced int32."""
    if is_static_int(x):
        if int(x) == 0 or k == 0:
            return base
        if is_static_int(base):
            return int(base) + int(x) * k
        return lax.add(base, np.int32(int(x) * k))
    term = _i32(x) if k == 1 else lax.mul(_i32(x), np.int32(k))
    if is_static_int(base):
        return term if int(base) == 0 else lax.add(term, np.int32(base))
    return lax.add(base, term)


def _i32(x):
    if getattr(x, "dtype", None) == np.int32 and not getattr(x, "weak_type", False):
        return x
    return lax.convert_element_type(x, np.int32)


def _plain_indexer(t) -> bool:
    """An NDIndexer of slices and scalar indices (no index arrays)."""
    return hasattr(t, "indices") and all(is_slice(ix) or jnp.ndim(ix) == 0 for ix in t.indices)


def is_static_int(x) -> bool:
    return isinstance(x, (int, np.integer))


def _index_value(x):
    """An index as a Python int when it is known while tracing, else traced int32:
    static indices need no bounds check and no dynamic slice in the program."""
    if is_static_int(x):
        return int(x)
    if isinstance(x, np.ndarray) and x.shape == () and np.issubdtype(x.dtype, np.integer):
        return int(x)
    return jnp.asarray(x, jnp.int32)


def clip_index(x, lo: int, hi: int):
    if is_static_int(x):
        return min(max(int(x), lo), hi)
    return lax.clamp(np.int32(lo), jnp.asarray(x, jnp.int32), np.int32(hi))


def _statically_inside(starts, ext, shape, arrays) -> bool:
    """Whether a window (``starts``, extents ``ext``) lies inside ``shape`` as far as
    is known while tracing (a traced start or an index array: not known)."""
    for d, (st, e, n) in enumerate(zip(starts, ext, shape)):
        if d in arrays or not is_static_int(st) or not (0 <= st and st + e <= n):
            return False
    return True


def _is_bitcast(t) -> bool:
    return isinstance(t, compat.BitcastTransform)


def _changes_width(t, dtype) -> bool:
    """True if ``t``, a bitcast of an array of ``dtype``, changes the element width
    (a TPU bitcast then packs or unpacks along the second-to-last dimension)."""
    return jax.dtypes.itemsize_bits(np.dtype(t.dtype)) != jax.dtypes.itemsize_bits(np.dtype(dtype))


def _oob(what: str) -> str:
    """JAX's interpreter's words first ("Out-of-bounds read"/"Out-of-bounds write"),
    so code matching JAX's messages matches ours; then what the access was."""
    kind = "write" if "write" in what else "read"
    return f"Out-of-bounds {kind}" + (f" ({what})" if what != kind else "")


class RefAccess:
    """Reads and writes of ``RefView``s (see the module docstring): a part of the
    ``Interpreter``, over its ``memory`` (``memory.Memory``), recording bounds
    errors in its ``checks`` (``errors.Checks``). ``where(eqn)`` names an equation
    in messages; ``on_access(view, eqn, write)`` sees every access (race
    detection); ``size_bounds``: the static bounds of traced DMA sizes
    (``facts.dma_size_bounds``)."""

    def __init__(
        self,
        memory: Memory,
        checks: Checks,
        params: Any,
        where: Callable[[Any], str],
        on_access: Callable[[RefView, Any, bool], None],
        size_bounds: dict | None = None,
    ):
        self.memory = memory
        self.checks = checks
        self.params = params
        self.where = where
        self.on_access = on_access
        self.size_bounds = size_bounds or {}

    def describe_ref(self, view: RefView) -> str:
        return self.memory.describe(view.cell)

    def index_parts(self, shape, indexer, eqn, view, what):
        """(starts, sizes, strides, squeezed dims, advanced index arrays) of one NDIndexer."""
        starts, sizes, strides, squeeze, arrays = [], [], [], [], {}
        raw = [ix.start if is_slice(ix) else ix for ix in indexer.indices]
        for d, (n, ix) in enumerate(zip(shape, indexer.indices)):
            if is_slice(ix):
                starts.append(_index_value(ix.start))
                sizes.append(int(ix.size))
                strides.append(int(ix.stride))
            else:
                if is_static_int(ix):
                    starts.append(int(ix))
                    sizes.append(1)
                    strides.append(1)
                    squeeze.append(d)
                    continue
                ix = jnp.asarray(ix)
                if ix.shape == ():
                    starts.append(ix.astype(jnp.int32))
                    sizes.append(1)
                    strides.append(1)
                    squeeze.append(d)
                else:
                    arrays[d] = ix.astype(jnp.int32)
                    starts.append(jnp.zeros((), jnp.int32))
                    sizes.append(n)
                    strides.append(1)
        if not self.fills_oob(what):
            for d, n in enumerate(shape):
                if d in arrays:
                    a = arrays[d]
                    ok = jnp.logical_and(jnp.all(a >= 0), jnp.all(a < n))
                    lo = jnp.min(a) if a.size else 0
                    hi = jnp.max(a) if a.size else 0
                    self.checks.check(
                        ok,
                        f"{self.where(eqn)}: {_oob(what)} of {self.describe_ref(view)}: index array "
                        f"with values in [{{0}}, {{1}}] along dimension {d} of size {n}",
                        [lo, hi],
                    )
                    continue
                extent = (sizes[d] - 1) * strides[d] + 1 if sizes[d] else 0
                st = starts[d]
                if is_static_int(st):  # known while tracing: no check in the program
                    if 0 <= st and st + extent <= n:
                        continue
                    ok = False
                elif self.checks.bounds_checked(raw[d], extent, n):
                    continue
                else:  # lax, not jnp's operators: each of those is a jitted call to trace
                    ok = lax.bitwise_and(
                        lax.ge(st, np.int32(0)), lax.le(lax.add(st, np.int32(extent)), np.int32(n))
                    )
                self.checks.check(
                    ok,
                    f"{self.where(eqn)}: {_oob(what)} of {self.describe_ref(view)} "
                    f"(shape {tuple(shape)}): dimension {d} {'writes' if 'write' in what else 'reads'} "
                    f"[{{0}}, {{0}} + {extent}) "
                    f"but its size is {n}",
                    [starts[d]],
                )
        return starts, sizes, strides, squeeze, arrays

    def fills_oob(self, what: str) -> bool:
        """Whether a read (``what``: ``"read"`` or ``"DMA read"``) past a buffer's edge
        gives the uninitialized-memory value there instead of an error
        (``InterpretParams(out_of_bounds_reads="uninitialized")``, as in JAX's)."""
        return self.params.out_of_bounds_reads == "uninitialized" and what in ("read", "DMA read")

    def _read1(self, x, indexer, eqn, view, what):
        if not hasattr(indexer, "indices"):
            return self._transform_other(x, indexer, eqn)
        starts, sizes, strides, squeeze, arrays = self.index_parts(x.shape, indexer, eqn, view, what)
        ext = [(s - 1) * k + 1 if s else 0 for s, k in zip(sizes, strides)]
        if self.fills_oob(what) and x.ndim and not _statically_inside(starts, ext, x.shape, arrays):
            # Past the edge reads the uninitialized value: read from the buffer padded
            # with it by a window's length on both sides.
            fill = plb.uninitialized_fill(x.dtype, self.memory.uninitialized)[()]
            x = lax.pad(x, fill, [(e, e, 0) for e in ext])
            starts = [lax.add(jnp.asarray(s, jnp.int32), np.int32(e)) for s, e in zip(starts, ext)]
        starts_c = [clip_index(s, 0, max(n - e, 0)) for s, n, e in zip(starts, x.shape, ext)]
        if not x.ndim:
            y = x
        elif all(is_static_int(s) for s in starts_c):
            y = x if tuple(ext) == x.shape else lax.slice(x, starts_c, [s + e for s, e in zip(starts_c, ext)])
        else:
            y = lax.dynamic_slice(x, starts_c, ext, allow_negative_indices=False)  # clipped above
        if any(k != 1 for k in strides):
            y = lax.slice(y, [0] * y.ndim, y.shape, strides)
        if arrays:
            idx = tuple(arrays.get(d, slice(None)) if d not in squeeze else 0 for d in range(x.ndim))
            if self.fills_oob(what):
                fill = plb.uninitialized_fill(x.dtype, self.memory.uninitialized)[()]
                return y.at[idx].get(mode="fill", fill_value=fill)
            return y[idx]
        if squeeze:
            y = lax.squeeze(y, squeeze)
        return y

    def _write1(self, x, indexer, val, eqn, view):
        if isinstance(indexer, compat.ReshapeTransform):  # ``ref.reshape(...)``: row-major, as the array
            return jnp.asarray(val, x.dtype).reshape(x.shape)
        if _is_bitcast(indexer):  # ``ref.bitcast(dtype)``: the view's bits back in the cell's dtype
            return tpu_bitcast(jnp.asarray(val, indexer.dtype), ty=x.dtype).reshape(x.shape)
        if isinstance(indexer, plb.PadTransform):  # ``pl.pad_ref``: what falls in the padding is dropped
            return lax.slice(jnp.asarray(val, x.dtype), (0,) * x.ndim, x.shape)
        if not hasattr(indexer, "indices"):
            raise NotImplementedError(
                f"{self.where(eqn)}: writing through a {type(indexer).__name__} view is not supported "
                "by the TPU interpreter yet"
            )
        starts, sizes, strides, squeeze, arrays = self.index_parts(x.shape, indexer, eqn, view, "write")
        if arrays:
            idx = []
            for d in range(x.ndim):
                if d in arrays:
                    idx.append(arrays[d])
                elif d in squeeze:
                    idx.append(jnp.clip(starts[d], 0, x.shape[d] - 1))
                else:
                    idx.append(jnp.clip(starts[d], 0, x.shape[d] - 1) + strides[d] * jnp.arange(sizes[d]))
            # Basic dims become broadcastable aranges, as numpy's mixed indexing.
            return x.at[tuple(idx)].set(val.astype(x.dtype), mode="drop")
        ext = [(s - 1) * k + 1 if s else 0 for s, k in zip(sizes, strides)]
        starts_c = [clip_index(s, 0, max(n - e, 0)) for s, n, e in zip(starts, x.shape, ext)]
        blk_shape = [s for d, s in enumerate(sizes)]
        val = jnp.asarray(val, x.dtype).reshape(blk_shape)
        if tuple(ext) == x.shape and all(is_static_int(s) and s == 0 for s in starts_c):
            if all(k == 1 for k in strides):
                return val  # the whole buffer
        if any(k != 1 for k in strides):
            old = lax.dynamic_slice(x, starts_c, ext, allow_negative_indices=False)
            idx = tuple(slice(None, None, k) for k in strides)
            val = old.at[idx].set(val)
        if not x.ndim:
            return val.reshape(())
        return lax.dynamic_update_slice(x, val, starts_c, allow_negative_indices=False)

    def _transform_other(self, x, t, eqn):
        if isinstance(t, compat.ReshapeTransform):  # JAX's class has no transform_array
            return x.reshape(t.shape)
        if _is_bitcast(t):  # JAX's class has no transform_array either; its shape rule is the TPU's
            return tpu_bitcast(x, ty=t.dtype)
        try:
            return t.transform_array(x)
        except Exception as e:
            raise NotImplementedError(
                f"{self.where(eqn)}: the TPU interpreter cannot apply the Ref transform {t!r}: {e}"
            ) from None

    def read_view(self, view: RefView, eqn, what="read"):
        x = self.memory.state[view.cell]
        self.on_access(view, eqn, False)  # a read
        for t in view.transforms:
            x = self._read1(x, t, eqn, view, what)
        return x

    def flat_index(self, view: RefView, eqn):
        """The flat position of the one element a view selects (semaphores)."""
        shape = self.memory.state[view.cell].shape
        if len(view.transforms) == 1 and hasattr(view.transforms[0], "indices"):
            # One indexer: the position by arithmetic (no iota to slice), checked and
            # clamped as a read of the element is.
            starts, sizes, _, _, arrays = self.index_parts(shape, view.transforms[0], eqn, view, "read")
            if not arrays and all(n == 1 for n in sizes):
                flat: jax.Array | np.int32 = np.int32(0)
                mult = 1
                for st, n in reversed(list(zip(starts, shape))):
                    flat = lax.add(
                        lax.mul(jnp.asarray(clip_index(st, 0, max(n - 1, 0)), jnp.int32), np.int32(mult)),
                        flat,
                    )
                    mult *= n
                return flat
        x = jnp.arange(math.prod(self.memory.state[view.cell].shape), dtype=jnp.int32).reshape(
            self.memory.state[view.cell].shape
        )
        for t in view.transforms:
            x = self._read1(x, t, eqn, view, "read")
        return x.reshape(())

    def view_indices(self, view: RefView, eqn, what: str):
        """(flat element indices of the cell that ``view`` covers, the view's
        shape). A slice whose size is traced (``pl.ds(i, n)``, in DMAs) takes
        the dimension's whole length, or the size's static upper bound when the
        kernel's jaxpr gives one (``facts.dma_size_bounds``); its positions past
        ``n`` hold the cell's size (out of range, so a scatter drops them), and
        its entry of the shape is ``n`` (traced). Indexers without index arrays
        compose as a ``_Window`` (an offset and strides: scalar arithmetic);
        other transforms gather from the window's indices."""
        x = self.memory.state[view.cell]
        bounds = self._size_bounds(view, eqn, what)
        win: _Window | None = _Window.of(x.shape)
        idx: Any = None
        valid: Any = None
        shape, dtype = list(x.shape), x.dtype
        for t in view.transforms:
            if _is_bitcast(t) and not _changes_width(t, dtype):
                dtype = t.dtype  # the same elements, read as another dtype: the same indices
                continue
            if _is_bitcast(t):
                raise NotImplementedError(
                    f"{self.where(eqn)}: the TPU interpreter cannot take the flat elements of a view "
                    f"through a bitcast from {np.dtype(dtype).name} to {np.dtype(t.dtype).name} (a change "
                    "of element width) here (a DMA with a traced size): bitcast to a type of the same "
                    "width, or give the DMA static sizes"
                )
            if win is not None and not win.masks and _plain_indexer(t):
                win = self._window_index(win, t, eqn, view, what, bounds)
                continue
            if win is not None:
                (idx, valid), shape, win = win.indices(), list(win.shape), None
            if valid is None and not has_traced_sizes(t):
                idx = (
                    self._read1(idx, t, eqn, view, what)
                    if hasattr(t, "indices")
                    else self._transform_other(idx, t, eqn)
                )
                shape = list(idx.shape)
            elif hasattr(t, "indices"):
                idx, valid, shape = self._index_traced(idx, valid, shape, t, eqn, view, what, bounds)
            else:
                raise NotImplementedError(
                    f"{self.where(eqn)}: the TPU interpreter cannot apply {type(t).__name__} after a slice "
                    "whose size is traced (pl.ds(start, n) with n traced); apply it before that slice"
                )
        if win is not None:
            (idx, valid), shape = win.indices(), list(win.shape)
        if valid is not None:
            idx = jnp.where(valid, idx, x.size)
        return idx, tuple(shape)

    def _size_bounds(self, view: RefView, eqn, what: str) -> dict[int, tuple]:
        """``id(leaf) -> (low, high)`` for the traced leaves of ``view``'s
        transforms that the kernel's jaxpr bounds (``facts.dma_size_bounds``,
        noted by ``pallas_call`` as ``size_bounds``): the DMA's own transforms are
        the last of the view's."""
        rec = self.size_bounds.get(id(eqn))
        if rec is None or rec[0] is not eqn:
            return {}
        layout = eqn.params["layout"]
        end = "dst" if "write" in what else "src"
        tree, per_leaf = getattr(layout, f"{end}_tree"), rec[1].get(end)
        n = len(tree.children())
        if not per_leaf or len(view.transforms) < n:
            return {}
        mine = tuple(view.transforms[len(view.transforms) - n :])
        if jax.tree_util.tree_structure(mine) != tree:
            return {}
        leaves = jax.tree_util.tree_leaves(mine)
        return {id(leaf): b for leaf, b in zip(leaves, per_leaf) if not is_static_int(leaf)}

    def _window_index(self, win: _Window, indexer, eqn, view, what, bounds) -> _Window:
        """``win`` indexed by an NDIndexer of slices and scalar indices, checked as
        a read or write through it is (``index_parts``, or ``_traced_dim`` for a
        size that is traced)."""
        base, strides, counts, shape = win.base, [], [], []
        masks: dict[int, Any] = {}
        if not has_traced_sizes(indexer):
            starts, sizes, steps, squeeze, _ = self.index_parts(tuple(win.shape), indexer, eqn, view, what)
            for d, (st, size, step, n) in enumerate(zip(starts, sizes, steps, win.shape)):
                ext = (size - 1) * step + 1 if size else 0
                base = _add_scaled(base, clip_index(st, 0, max(n - ext, 0)), win.strides[d])
                if d not in squeeze:
                    strides.append(win.strides[d] * step)
                    counts.append(size)
                    shape.append(size)
            return _Window(base, strides, counts, shape, masks)
        for d, ix in enumerate(indexer.indices):
            start, size, step, count, entry, scalar = self._traced_dim(
                ix, d, win.shape[d], eqn, view, what, bounds
            )
            base = _add_scaled(base, clip_index(start, 0, max(win.shape[d] - 1, 0)), win.strides[d])
            if scalar:
                continue
            if not is_static_int(size):
                masks[len(counts)] = lax.lt(np.arange(count, dtype=np.int32), lax.broadcast(size, (count,)))
            strides.append(win.strides[d] * step)
            counts.append(count)
            shape.append(entry)
        return _Window(base, strides, counts, shape, masks)

    def _traced_dim(self, ix, d, n, eqn, view, what, bounds):
        """One dimension of an NDIndexer with a traced size: (start, size as int32
        or int, stride, the window's static count, the view's shape entry, whether
        the dimension is indexed away). The count is the dimension's length, or the
        size's static bound (checked as the kernel runs); the window is
        bounds-checked unless the static intervals show it in range."""
        if is_slice(ix):
            start, size, stride = _index_value(ix.start), ix.size, int(ix.stride)
            s_lo, s_hi = bounds.get(id(ix.start), (None, None))
        else:
            start, size, stride = _index_value(ix), 1, 1
            s_lo, s_hi = bounds.get(id(ix), (None, None))
        if is_static_int(start):
            s_lo = s_hi = start
        static = is_static_int(size)
        count = int(size) if static else -(-n // stride)
        n_lo, n_hi = (int(size), int(size)) if static else bounds.get(id(size), (None, None))
        if not static:
            size = lax.convert_element_type(size, np.int32)
            if n_hi is not None and n_hi < count:
                count = max(n_hi, 0)
                self.checks.check(
                    lax.le(size, np.int32(count)),
                    f"{self.where(eqn)}: internal error of the TPU interpreter: the traced size {{0}} of "
                    f"dimension {d} of a DMA view of {self.describe_ref(view)} exceeds {count}, the bound "
                    "the kernel's jaxpr gave it",
                    [size],
                )
        self._check_window(eqn, view, what, d, start, size, stride, n, (s_lo, s_hi, n_lo, n_hi))
        entry = count if static else size
        return start, size, stride, count, entry, not is_slice(ix)

    def _index_traced(self, idx, valid, shape, indexer, eqn, view, what, bounds):
        """``view_indices`` of one NDIndexer when a size is traced, on gathered
        indices ``idx`` (and their validity)."""
        if valid is None:
            valid = jnp.ones(idx.shape, jnp.bool_)
        out_shape, squeeze = [], []
        for d, ix in enumerate(indexer.indices):
            if not is_slice(ix) and jnp.ndim(ix) > 0:
                raise NotImplementedError(
                    f"{self.where(eqn)}: a DMA view with a traced size cannot also be indexed with an "
                    "array of indices"
                )
            extent = idx.shape[d]
            start, size, stride, count, entry, scalar = self._traced_dim(
                ix, d, shape[d], eqn, view, what, bounds
            )
            if scalar:
                squeeze.append(d)
            out_shape.append(entry)
            offs = np.arange(count, dtype=np.int32) * np.int32(stride)
            top = np.int32(max(extent - 1, 0))
            if is_static_int(start):
                pos = np.clip(start + offs, 0, top).astype(np.int32)
            else:
                pos = lax.clamp(np.int32(0), lax.add(lax.broadcast(start, (count,)), offs), top)
            idx, valid = jnp.take(idx, pos, axis=d), jnp.take(valid, pos, axis=d)
            if not is_static_int(size):
                inside = lax.lt(np.arange(count, dtype=np.int32), lax.broadcast(size, (count,)))
                valid = lax.bitwise_and(valid, lax.broadcast_in_dim(inside, valid.shape, (d,)))
        keep = [d for d in range(idx.ndim) if d not in squeeze]
        if squeeze:
            idx, valid = lax.squeeze(idx, squeeze), lax.squeeze(valid, squeeze)
        return idx, valid, [out_shape[d] for d in keep]

    def _check_window(self, eqn, view, what, d, start, size, stride, n, intervals):
        """The bounds check of one dimension of a DMA view with a traced size:
        ``size`` elements from ``start`` by ``stride`` within ``n``; an empty view
        touches nothing, wherever it starts (tokamax's routing gmm moves a dead row
        with a DMA of size 0 from a sentinel index). None where the static intervals
        (start low/high, size low/high) show it holds."""
        s_lo, s_hi, n_lo, n_hi = intervals
        if n_lo is not None and n_lo == n_hi == 0:
            return
        if is_static_int(n) and None not in intervals:
            if s_lo >= 0 and n_lo >= 0 and (n_hi == 0 or s_hi + (n_hi - 1) * stride < n):
                return
        size = jnp.asarray(size, jnp.int32)
        st = jnp.asarray(start, jnp.int32)
        zero = np.int32(0)
        last = lax.lt(
            lax.add(st, lax.mul(lax.sub(size, np.int32(1)), np.int32(stride))), jnp.asarray(n, jnp.int32)
        )
        ok = lax.bitwise_or(
            lax.eq(size, zero), lax.bitwise_and(lax.bitwise_and(lax.gt(size, zero), lax.ge(st, zero)), last)
        )
        self.checks.check(
            ok,
            f"{self.where(eqn)}: {_oob(what)} of {self.describe_ref(view)}: dimension {d} "
            f"takes {{1}} elements from {{0}} (stride {stride}) but its size is {{2}}",
            [start, size, n],
        )

    def write_view(self, view: RefView, val, eqn):
        self.on_access(view, eqn, True)  # a write

        def go(x, ts):
            if not ts:
                return jnp.asarray(val, x.dtype).reshape(x.shape)
            inner = self._read1(x, ts[0], eqn, view, "write") if len(ts) > 1 else None
            new_inner = go(inner, ts[1:]) if len(ts) > 1 else val
            return self._write1(x, ts[0], new_inner, eqn, view)

        self.memory.state[view.cell] = go(self.memory.state[view.cell], list(view.transforms))
