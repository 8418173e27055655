"""``emit_pipeline``: a software pipeline over HBM Refs, written inside a kernel.

``emit_pipeline(body, grid=..., in_specs=..., out_specs=...)(*hbm_refs)`` runs
``body(*block_refs)`` once per step of ``grid`` (lexicographic order), with
each operand's block copied between its HBM Ref and a VMEM buffer by DMAs, as
``pallas_call`` does for its own grid. It is traced into the kernel as plain
kernel code (``run_scoped`` buffers and DMA semaphores, a ``fori_loop``,
``pl.when`` and DMAs), so TPU interpret mode runs it like any other kernel.

The schedule, per operand (``n`` = its buffer count, ``pl.Buffered(n)``,
default 2; ``b_t`` = its block index at step ``t``; a *change* is a step whose
block index differs from the previous step's):

* inputs: the block of each change is DMA'd into slot ``change % n``, ``n - 1``
  steps ahead of its use (the prologue starts the first ``n - 1``); a step
  whose block changed waits for its DMA before the body runs. With ``n == 1``
  the copy is started and waited for at the step that needs it. Unchanged
  blocks are not copied again.
* outputs (``n`` of 1 or 2): the body writes slot ``run % n``; when the block
  index is about to change (and at the last step) the slot is DMA'd to HBM.
  With ``n == 2`` that copy is waited for one step later (after the next
  body), with ``n == 1`` at once. ``should_accumulate_out`` makes an output
  also an input: its block is loaded from HBM when the index changes, so the
  body accumulates into what the output held.
* a block that is the whole array gets one buffer (copied in before the
  first step and out after the last), unless ``pipeline_mode`` says otherwise;
  a spec in ``pl.ANY``/HBM, or in the memory space its Ref already lives in,
  gets no buffer: the body sees a view of the Ref.

Blocks that do not divide the array: a dimension whose block size does not
divide it is allowed where JAX allows it (the block size is a multiple of the
memory tiling of that dimension, from ``tpu_info.infer_tiling``); the last
block's DMA then copies, in interpret mode (which has no tile padding), only
the elements that exist, the rest of the buffer keeping stale data, and in
Mosaic whole memory tiles (its size rounded up to the tiling, into the edge
tile's padding, as JAX's pipeline copies it: Mosaic slices tiled dimensions by
whole tiles), from the last block's static start (the DMA's ``padded_shape``).
A Ref view (``ref.at[...]``) has no padding of its own: its edge is copied
exactly, which Mosaic takes only where the last block is whole tiles.

A ``pl.BoundedSlice(n)`` dimension is a window of traced size: its index map
returns ``pl.ds(start, size)``, ``size <= n``; the buffer has ``n`` along it and
the copy takes ``size`` clamped to the end of the array, rounded up to the
dimension's memory tiling as in JAX's pipeline (``_Operand.bounded_sizes``;
tiling 1 on leading dims), with the same interpret/Mosaic split at the edge.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

import pallas as pl
from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import primitives as tpu_prims
from pallas_tpu._src.language import tpu_info

VMEM, SMEM, HBM = tpu_core.VMEM, tpu_core.SMEM, tpu_core.HBM
_WHERE = "pltpu.emit_pipeline"


def _err(cls, msg):
    return plb.kernel_error(cls, msg)


class BufferType(enum.Enum):
    """What a pipeline operand is: read (``INPUT``), written (``OUTPUT``),
    both (``INPUT_OUTPUT``), or handled by the body itself (``MANUAL``)."""

    INPUT = 1
    OUTPUT = 2
    INPUT_OUTPUT = 3
    MANUAL = 4

    @property
    def is_input(self) -> bool:
        return self in (BufferType.INPUT, BufferType.INPUT_OUTPUT)

    @property
    def is_output(self) -> bool:
        return self in (BufferType.OUTPUT, BufferType.INPUT_OUTPUT)


class BufferedRefBase:
    """The interface of a pipeline operand (JAX's ``pltpu.BufferedRefBase``)."""

    @property
    def spec(self) -> pl.BlockSpec:
        raise NotImplementedError

    @property
    def buffer_type(self) -> BufferType:
        raise NotImplementedError

    @property
    def is_buffered(self) -> bool:
        return False

    @property
    def is_input(self) -> bool:
        return self.buffer_type.is_input

    @property
    def is_output(self) -> bool:
        return self.buffer_type.is_output

    @property
    def is_input_output(self) -> bool:
        return self.buffer_type is BufferType.INPUT_OUTPUT

    @property
    def is_manual(self) -> bool:
        return self.buffer_type is BufferType.MANUAL

    @property
    def block_shape(self):
        return self.spec.block_shape

    @property
    def compute_index(self):
        return self.spec.index_map

    def with_spec(self, spec: pl.BlockSpec) -> BufferedRefBase:
        raise NotImplementedError


def _dim_size(bd) -> int | None:
    """The buffer extent of one block dimension (None: squeezed)."""
    if bd is None or isinstance(bd, pl.Squeezed):
        return None
    if isinstance(bd, int):
        return bd
    if isinstance(bd, (pl.Blocked, pl.Element, pl.BoundedSlice)):
        return bd.block_size
    raise _err(ValueError, f"{_WHERE}: unsupported block dimension {bd!r}")


def _buffer_block_shape(block_shape) -> tuple[int, ...]:
    return tuple(s for s in map(_dim_size, block_shape) if s is not None)


@tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BufferedRef(BufferedRefBase):
    """A pipeline operand: its spec and, when it is copied, its ``n``-slot
    buffer (``window_ref``) and DMA semaphores.

    Made by ``emit_pipeline_with_allocations``'s ``make_allocations`` (or
    ``BufferedRef.input/output/input_output``), the buffer and semaphores are
    *types* (``pltpu.VMEM(...)``, ``SemaphoreType.DMA(...)``) until
    ``pl.run_scoped`` (or ``scratch_shapes``) allocates them; the pipeline
    then takes them through ``allocations=``.
    """

    _spec: Any = dataclasses.field(metadata=dict(static=True))
    _buffer_type: BufferType = dataclasses.field(metadata=dict(static=True))
    _buffer_count: int = dataclasses.field(metadata=dict(static=True))
    window_ref: Any
    sem_recvs: Any
    sem_sends: Any
    # The slot the body sees (set by the pipeline; a traced int32).
    current_slot: Any = None
    tiling: Any = dataclasses.field(default=None, metadata=dict(static=True))
    is_trivial_windowing: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        if self.is_output and self._buffer_count > 2:
            raise _err(
                NotImplementedError,
                f"{_WHERE}: outputs take at most 2 buffers (pl.Buffered(1) or (2)), got {self._buffer_count}",
            )

    @property
    def spec(self):
        return self._spec

    @property
    def buffer_type(self):
        return self._buffer_type

    @property
    def is_buffered(self) -> bool:
        return self._buffer_count > 0

    @property
    def buffer_count(self) -> int:
        if not self.is_buffered:
            raise ValueError("buffer_count is undefined for an unbuffered operand")
        return self._buffer_count

    @property
    def has_allocated_buffer(self) -> bool:
        return self.is_buffered

    @classmethod
    def create(
        cls,
        spec,
        dtype_or_type,
        buffer_type: BufferType,
        buffer_count: int = 2,
        *,
        source_memory_space=pl.ANY,
        tiling=None,
        is_trivial_windowing: bool = False,
        **unused,
    ) -> BufferedRef:
        """A BufferedRef whose buffer and semaphores are still types.

        Args:
          spec: the operand's ``pl.BlockSpec``.
          dtype_or_type: the element dtype (or an aval: its dtype is used).
          buffer_type: ``BufferType.INPUT``, ``OUTPUT`` or ``INPUT_OUTPUT``.
          buffer_count: slots of the buffer (1: no overlap, 2: double buffering).
          source_memory_space: where the operand's Ref lives; a spec in the
            same space (or in ``pl.ANY``/HBM) gets no buffer.
        """
        dtype = getattr(dtype_or_type, "dtype", dtype_or_type)
        space = VMEM if spec.memory_space is None else spec.memory_space
        if space is pl.ANY or space is HBM or space is source_memory_space:
            return cls(spec, buffer_type, 0, None, None, None, tiling=tiling)
        if space not in (VMEM, SMEM):
            raise _err(ValueError, f"{_WHERE}: blocks can be buffered in VMEM or SMEM, not {space}")
        if not isinstance(buffer_count, int) or buffer_count < 1:
            raise _err(ValueError, f"{_WHERE}: buffer_count must be a positive int, got {buffer_count!r}")
        block = _buffer_block_shape(spec.block_shape)
        dma = tpu_core.SemaphoreType.DMA((buffer_count,))
        return cls(
            spec,
            buffer_type,
            buffer_count,
            space((buffer_count, *block), dtype),
            dma if buffer_type.is_input else None,
            dma if buffer_type.is_output else None,
            tiling=tiling,
            is_trivial_windowing=is_trivial_windowing,
        )

    @classmethod
    def input(cls, spec, dtype_or_type, buffer_count=2, **kwargs):
        return cls.create(spec, dtype_or_type, BufferType.INPUT, buffer_count, **kwargs)

    @classmethod
    def output(cls, spec, dtype_or_type, buffer_count=2, **kwargs):
        return cls.create(spec, dtype_or_type, BufferType.OUTPUT, buffer_count, **kwargs)

    @classmethod
    def input_output(cls, spec, dtype_or_type, buffer_count=2, **kwargs):
        return cls.create(spec, dtype_or_type, BufferType.INPUT_OUTPUT, buffer_count, **kwargs)

    def with_spec(self, spec) -> BufferedRef:
        return dataclasses.replace(self, _spec=spec)

    def with_window_ref(self, window_ref) -> BufferedRef:
        return dataclasses.replace(self, window_ref=window_ref)

    def with_slot_index(self, slot) -> BufferedRef:
        return dataclasses.replace(self, current_slot=slot)

    @property
    def current_ref(self):
        """The block the body works on: the current slot of the buffer."""
        if self.window_ref is None:
            raise ValueError("this BufferedRef has no buffer bound (window_ref is None)")
        return self.window_ref.at[0 if self.current_slot is None else self.current_slot]

    def compute_slice(self, grid_indices):
        """The indexer of the block at ``grid_indices`` in the operand's Ref."""
        return _block_indexer(self.spec, _call_index_map(self.spec, grid_indices, "spec"))


# ---------------------------------------------------------------------------
# Block indexing.


def _call_index_map(spec, indices, origin: str):
    index_map = spec.index_map
    if index_map is None:
        return (0,) * len(spec.block_shape)
    try:
        out = index_map(*indices)
    except TypeError as e:
        raise _err(
            TypeError,
            f"{_WHERE}: {origin}.index_map failed on the {len(indices)} grid indices of the pipeline: {e}",
        ) from None
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) != len(spec.block_shape):
        raise _err(
            ValueError,
            f"{_WHERE}: {origin}.index_map returns {len(out)} indices but block_shape "
            f"{tuple(spec.block_shape)} has {len(spec.block_shape)} dimensions",
        )
    for d, (bd, b) in enumerate(zip(spec.block_shape, out)):
        if isinstance(bd, pl.BoundedSlice):
            _check_bounded_index(bd, b, d, origin)
    return out


def _check_bounded_index(bd, b, d, origin):
    """A ``pl.BoundedSlice(n)`` dimension's index is ``pl.ds(start, size)``, ``size <= n``
    (a traced size is checked by interpret mode as the copy runs: its window has ``n``)."""
    if not isinstance(b, pl.Slice):
        raise _err(
            ValueError,
            f"{_WHERE}: {origin}.index_map returns {type(b).__name__} at position {d}, a "
            f"{bd!r} dimension: it must return pl.ds(start, size) there (size <= {bd.block_size})",
        )
    if b.stride != 1:
        raise _err(
            ValueError, f"{_WHERE}: {origin}.index_map returns a strided pl.ds at position {d} ({bd!r})"
        )
    if isinstance(b.size, (int, np.integer)) and not 0 <= b.size <= bd.block_size:
        raise _err(
            ValueError,
            f"{_WHERE}: {origin}.index_map returns pl.ds(..., {int(b.size)}) at position {d}, a {bd!r} "
            f"dimension: the size must be at most {bd.block_size}",
        )


def _block_indexer(spec, block_indices, sizes=None):
    """The ``.at[...]`` indexer of a block (``sizes``: per-dim sizes, to cut
    the last block of a dimension that the block does not divide)."""
    idx = []
    for d, (bd, b) in enumerate(zip(spec.block_shape, block_indices)):
        size = _dim_size(bd)
        if size is None:
            idx.append(b)
            continue
        n = size if sizes is None else sizes[d]
        if isinstance(bd, pl.Element):
            idx.append(pl.ds(b, n))
        elif isinstance(bd, pl.BoundedSlice):
            idx.append(pl.ds(b.start, n))
        else:
            idx.append(pl.ds(b * size, n))
    return tuple(idx)


def _as_index(b):
    """A block index as an int or int32 scalar (a ``pl.ds``: its start and size)."""
    if isinstance(b, pl.Slice):
        return pl.ds(_as_index(b.start), _as_index(b.size))
    return b if isinstance(b, int) else jnp.asarray(b, jnp.int32)


def _index_leaves(xs):
    """Block indices with each ``pl.ds`` as its start and size."""
    out = []
    for x in xs:
        out += [x.start, x.size] if isinstance(x, pl.Slice) else [x]
    return out


def _differ(xs, ys):
    out = False
    for x, y in zip(_index_leaves(xs), _index_leaves(ys)):
        if x is y:
            continue
        ne = x != y
        out = ne if out is False else jnp.logical_or(out, ne)
    return out


def _when(pred, f):
    if isinstance(pred, (bool, np.bool_)):
        if pred:
            f()
        return
    lax.cond(pred, f, lambda: None)


def _unravel(t, grid):
    """Grid indices of linear step ``t`` (lexicographic order)."""
    out = []
    for g in reversed(grid):
        if isinstance(g, int) and g == 1:
            out.append(jnp.int32(0))
            continue
        out.append(lax.rem(t, jnp.asarray(g, jnp.int32)))
        t = lax.div(t, jnp.asarray(g, jnp.int32))
    return tuple(reversed(out))


# ---------------------------------------------------------------------------
# The plan: one _Operand per pipelined Ref, checked at trace time.


@dataclasses.dataclass
class _Operand:
    origin: str  # "in_specs[0]", for messages
    bref: BufferedRef
    ref: Any  # the Ref (or view) the blocks come from / go to
    shape: tuple[int, ...]
    # dim -> (number of blocks, size of the last block, that size rounded up to the tiling)
    partial: dict[int, tuple[int, int, int]]
    # whether the operand is a whole Ref (not a view): its edge tiles end in tile padding
    whole_ref: bool = False
    # pl.BoundedSlice dim -> the memory tiling its copies round up to (None: unknown)
    bounded: dict[int, int | None] = dataclasses.field(default_factory=dict)

    @property
    def spec(self):
        return self.bref.spec

    def sizes(self, combo, padded=False):
        """Per-dim DMA sizes for one choice of (full, last) per partial dim
        (``padded``: the last block's sizes rounded up to whole memory tiles)."""
        sizes = [_dim_size(bd) for bd in self.spec.block_shape]
        for (d, (_, last, rounded)), is_last in zip(self.partial.items(), combo):
            if is_last:
                sizes[d] = rounded if padded else last
        return sizes

    def bounded_sizes(self, block_indices) -> dict[int, Any]:
        """The copy sizes of the ``pl.BoundedSlice`` dims at these block indices, as JAX's
        pipeline computes them: the slice's size clamped to the end of the array, rounded up
        to the dim's memory tiling (a Mosaic copy slices tiled dims by whole tiles), and here
        also cut at the end of the array (interpret mode has no tile padding; the Mosaic
        lowering rounds it up again, ``_RoundUp``)."""
        out = {}
        for d, t in self.bounded.items():
            start, size = block_indices[d].start, block_indices[d].size
            if t is None:
                out[d] = size
                continue
            left = self.shape[d] - start
            out[d] = _minimum(_round_up(_minimum(size, left), t), left)
        return out

    def per_block(self, block_indices, fn):
        """Calls ``fn(hbm_view, window_indexer_tail, padded)`` for this
        block's shape: under ``pl.when`` per variant when the last block may be
        cut. A cut block is copied as its exact view in interpret mode and as
        whole memory tiles in Mosaic (``padded``, the DMA's shape there, as
        JAX's pipeline copies it: Mosaic slices tiled dims by whole tiles); its
        start is static (the last block's). ``pl.BoundedSlice`` dims are copied
        at their traced sizes (``bounded_sizes``); where one rounds to tiles,
        ``padded`` is a ``_RoundUp`` of the copy's sizes."""
        bounded = self.bounded_sizes(block_indices) if self.bounded else {}
        if not self.partial and not bounded:
            fn(self.ref.at[_block_indexer(self.spec, block_indices)], (), None)
            return
        conds = [block_indices[d] == nb - 1 for d, (nb, _, _) in self.partial.items()]
        for combo in itertools.product((False, True), repeat=len(self.partial)):
            sizes = self.sizes(combo)
            for d, n in bounded.items():
                sizes[d] = n
            tail = tuple(pl.ds(0, s) for s in sizes if s is not None)
            padded = None
            if bounded and self.whole_ref:
                # Round up the bounded dims and the cut ones (a cut block's size rounds up
                # to its rounded size); a leading dim (tiling 1) needs nothing.
                tiles = {d: t for d, t in self.bounded.items() if t is not None and t > 1}
                tiles.update(
                    (d, r) for (d, (_, _, r)), is_last in zip(self.partial.items(), combo) if is_last
                )
                if tiles:
                    dims = [d for d, s in enumerate(sizes) if s is not None]
                    padded = _RoundUp(tuple(tiles.get(d, 1) for d in dims))
            elif any(combo) and self.whole_ref:
                padded = tuple(s for s in self.sizes(combo, padded=True) if s is not None)
            indices = list(block_indices)
            pred = True
            for (d, (nb, _, _)), c, is_last in zip(self.partial.items(), conds, combo):
                if is_last:
                    indices[d] = nb - 1
                c = c if is_last else jnp.logical_not(c)
                pred = c if pred is True else jnp.logical_and(pred, c)

            def go(sizes=sizes, tail=tail, padded=padded, indices=tuple(indices)):
                fn(self.ref.at[_block_indexer(self.spec, indices, sizes)], tail, padded)

            _when(pred, go)

    def _copy(self, src, dst, sem, padded, start, wait):
        copy = tpu_prims.make_async_copy(src, dst, sem)
        if isinstance(padded, _RoundUp):
            copy.layout = dataclasses.replace(copy.layout, padded_tiling=padded.tiles)
        elif padded is not None and padded != copy.shape:
            copy.layout = dataclasses.replace(copy.layout, padded_shape=padded)
        if start:
            copy.start()
        if wait:
            copy.wait()

    def copy_in(self, block_indices, slot, *, start=True, wait=False):
        def fn(src, tail, padded):
            window = self.bref.window_ref.at[(slot, *tail)]
            self._copy(src, window, self.bref.sem_recvs.at[slot], padded, start, wait)

        self.per_block(block_indices, fn)

    def copy_out(self, block_indices, slot, *, start=True, wait=False):
        def fn(dst, tail, padded):
            window = self.bref.window_ref.at[(slot, *tail)]
            self._copy(window, dst, self.bref.sem_sends.at[slot], padded, start, wait)

        self.per_block(block_indices, fn)


@dataclasses.dataclass(frozen=True)
class _RoundUp:
    """A copy whose sizes Mosaic rounds up to these multiples (one per dim of the block
    that is not squeezed; 1: as is): a ``pl.BoundedSlice`` block's traced size copied as
    whole memory tiles, into the edge tile's padding (the DMA's ``padded_tiling``)."""

    tiles: tuple[int, ...]


def _minimum(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return min(int(a), int(b))
    return jnp.minimum(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _round_up(n, t: int):
    if t == 1:
        return n
    if isinstance(n, (int, np.integer)):
        return -(-int(n) // t) * t
    return pl.multiple_of(lax.div(n + (t - 1), jnp.int32(t)) * t, t)


def _ref_space_and_aval(ref, origin):
    try:
        base, leaves, tree = plb.flatten_ref(ref, f"{_WHERE}: {origin}")
    except TypeError:
        raise _err(
            TypeError,
            f"{_WHERE}: the operand of {origin} must be a Ref (e.g. a kernel argument in pl.ANY or "
            f"pltpu.HBM), got {type(ref).__name__}",
        ) from None
    base_aval = compat.get_aval(base)
    if plb.semaphore_kind(base_aval) is not None:
        raise _err(TypeError, f"{_WHERE}: the operand of {origin} is a semaphore; pipelines move data Refs")
    aval = plb.transformed_aval(base_aval, plb.unflatten_transforms(tree, leaves))
    space = getattr(base_aval, "memory_space", None)
    return (pl.ANY if space is None else space), aval


def _is_full_block(spec, shape) -> bool:
    bs = spec.block_shape
    if bs is None:
        return True
    if len(bs) != len(shape):
        return False
    for bd, n in zip(bs, shape):
        if isinstance(bd, pl.Blocked):
            bd = bd.block_size
        if not isinstance(bd, int) or bd != n:
            return False
    return True


def _normalize_spec(spec, aval, origin):
    if not isinstance(spec, pl.BlockSpec):
        raise _err(TypeError, f"{_WHERE}: {origin} must be a pl.BlockSpec, got {type(spec).__name__}")
    if spec.block_shape is None:
        spec = dataclasses.replace(spec, block_shape=tuple(aval.shape))
    block_shape = tuple(spec.block_shape)
    if len(block_shape) != len(aval.shape):
        raise _err(
            ValueError,
            f"{_WHERE}: {origin}: block_shape {block_shape} has {len(block_shape)} dimensions but the "
            f"operand has shape {tuple(aval.shape)}",
        )
    for bd in block_shape:
        if isinstance(bd, pl.Element) and tuple(bd.padding) != (0, 0):
            raise _err(NotImplementedError, f"{_WHERE}: {origin}: pl.Element with padding is not supported")
        size = _dim_size(bd)
        if size is not None and size <= 0:
            raise _err(ValueError, f"{_WHERE}: {origin}: block sizes must be positive, got {block_shape}")
    return dataclasses.replace(spec, block_shape=block_shape)


def _partial_dims(spec, aval, tiling, origin) -> dict[int, tuple[int, int, int]]:
    """Dims the block does not divide: dim -> (number of blocks, last size,
    last size rounded up to the memory tiling of the dim)."""
    out = {}
    tiles = None
    for d, (bd, n) in enumerate(zip(spec.block_shape, aval.shape)):
        if not isinstance(bd, (int, pl.Blocked)):
            continue
        b = _dim_size(bd)
        if n % b == 0:
            continue
        if tiles is None:
            tiles = _tiling_of(aval, tiling)
        t = tiles[d]
        if t is None or b % t:
            raise _err(
                ValueError,
                f"{_WHERE}: {origin}: block size {b} does not divide dimension {d} of the operand "
                f"(shape {tuple(aval.shape)}); that needs a block size that is a multiple of the "
                f"memory tiling of that dimension ({t}), as on a TPU",
            )
        last = n - (n // b) * b
        out[d] = (-(-n // b), last, -(-last // t) * t)
    return out


def _bounded_dims(spec, aval, tiling, origin) -> dict[int, int | None]:
    """The ``pl.BoundedSlice`` dims: dim -> the memory tiling their copies round up to
    (None: unknown, copied at the slice's size). The bound must be whole tiles, as JAX's
    pipeline requires."""
    dims = [d for d, bd in enumerate(spec.block_shape) if isinstance(bd, pl.BoundedSlice)]
    if not dims:
        return {}
    tiles = _tiling_of(aval, tiling)
    for d in dims:
        bd, t = spec.block_shape[d], tiles[d]
        if t is not None and bd.block_size % t:
            raise _err(
                ValueError,
                f"{_WHERE}: {origin}: {bd!r} at dimension {d} of the operand (shape {tuple(aval.shape)}): "
                f"the bound must be a multiple of the memory tiling of that dimension ({t}), as on a TPU",
            )
    return {d: tiles[d] for d in dims}


def _tiling_of(aval, tiling):
    try:
        return tuple(tpu_info.infer_tiling(aval, tiling))
    except ImportError:
        return (1,) * (len(aval.shape) - 2) + (8, 128)[-min(2, len(aval.shape)) :]
    except ValueError:
        return (None,) * len(aval.shape)


def _make_pipeline_allocations(
    *refs, in_specs=(), out_specs=(), tiling=None, grid=(), should_accumulate_out=False
):
    """One BufferedRef (buffer and semaphores as types) per pipelined Ref,
    None for ``pl.no_block_spec`` operands, in the order of ``refs``."""
    del grid
    plan, _ = _plan(refs, in_specs, out_specs, tiling, should_accumulate_out, None)
    return tuple(op.bref if op is not None else None for op in plan)


def _top(specs) -> tuple:
    return tuple(specs) if isinstance(specs, (list, tuple)) else (specs,)


def _is_spec_leaf(s) -> bool:
    return s is None or s is pl.no_block_spec or isinstance(s, pl.BlockSpec)


def _plan(refs, in_specs, out_specs, tiling, should_accumulate_out, allocations):
    """(one _Operand or None per spec leaf, a function from the flat block
    Refs to the body's arguments)."""
    in_top, out_top = _top(in_specs), _top(out_specs)
    if len(refs) != len(in_top) + len(out_top):
        raise _err(
            TypeError,
            f"{_WHERE}: the pipeline got {len(refs)} Refs but in_specs has {len(in_top)} and out_specs has "
            f"{len(out_top)} entries (one Ref per spec: inputs first, then outputs)",
        )
    in_leaves, in_tree = tree_util.tree_flatten(in_top, is_leaf=_is_spec_leaf)
    out_leaves, out_tree = tree_util.tree_flatten(out_top, is_leaf=_is_spec_leaf)
    try:
        in_refs = in_tree.flatten_up_to(tuple(refs[: len(in_top)]))
        out_refs = out_tree.flatten_up_to(tuple(refs[len(in_top) :]))
    except ValueError as e:
        raise _err(ValueError, f"{_WHERE}: the Refs do not have the structure of the specs: {e}") from None
    accumulate = should_accumulate_out
    if isinstance(accumulate, (bool, np.bool_)):
        accumulate = [bool(accumulate)] * len(out_leaves)
    else:
        accumulate = tree_util.tree_leaves(accumulate)
        if len(accumulate) != len(out_leaves):
            raise _err(
                ValueError,
                f"{_WHERE}: should_accumulate_out has {len(accumulate)} entries but out_specs has {len(out_leaves)}",
            )
    allocs = None if allocations is None else list(allocations)
    if allocs is not None and len(allocs) != len(in_leaves) + len(out_leaves):
        raise _err(
            ValueError,
            f"{_WHERE}: allocations has {len(allocs)} entries but there are {len(in_leaves) + len(out_leaves)} specs",
        )
    entries = [(f"in_specs[{i}]", s, r, BufferType.INPUT) for i, (s, r) in enumerate(zip(in_leaves, in_refs))]
    entries += [
        (f"out_specs[{i}]", s, r, BufferType.INPUT_OUTPUT if acc else BufferType.OUTPUT)
        for i, (s, r, acc) in enumerate(zip(out_leaves, out_refs, accumulate))
    ]
    plan = []
    for k, (origin, spec, ref, btype) in enumerate(entries):
        if spec is None or spec is pl.no_block_spec:
            plan.append(None)
            continue
        space, aval = _ref_space_and_aval(ref, origin)
        if space not in (pl.ANY, HBM, VMEM, SMEM):
            raise _err(
                ValueError,
                f"{_WHERE}: the operand of {origin} is in {space}; pipelines copy blocks of Refs in "
                "pl.ANY or pltpu.HBM (a Ref already in VMEM or SMEM is seen by the body as a view)",
            )
        spec = _normalize_spec(spec, aval, origin)
        full = _is_full_block(spec, aval.shape)
        mode = spec.pipeline_mode
        count = mode.buffer_count if mode is not None else (1 if full else 2)
        if allocs is not None and allocs[k] is not None:
            bref = allocs[k].with_spec(spec)
        else:
            bref = BufferedRef.create(
                spec,
                aval.dtype,
                btype,
                count,
                source_memory_space=space,
                tiling=tiling,
                is_trivial_windowing=full,
            )
        partial = _partial_dims(spec, aval, tiling, origin) if bref.is_buffered else {}
        bounded = _bounded_dims(spec, aval, tiling, origin) if bref.is_buffered else {}
        whole_ref = not isinstance(ref, compat.TransformedRef)
        plan.append(_Operand(origin, bref, ref, tuple(aval.shape), partial, whole_ref, bounded))

    n_in = len(in_leaves)

    def rebuild(flat):
        return [
            *tree_util.tree_unflatten(in_tree, flat[:n_in]),
            *tree_util.tree_unflatten(out_tree, flat[n_in:]),
        ]

    return plan, rebuild


# ---------------------------------------------------------------------------
# Core partitioning (core_axis / core_axis_name).


def _core_info(core_axis):
    if core_axis is None:
        return None, None
    if isinstance(core_axis, int):
        return pl.num_programs(core_axis), pl.program_id(core_axis)
    return lax.axis_size(core_axis), lax.axis_index(core_axis)


def _partition_grid(grid, semantics, num_cores, core_id):
    """(this core's grid, offsets of its indices): split the first parallel
    axis that the cores divide, else the largest parallel one unevenly."""
    if num_cores is None or (isinstance(num_cores, int) and num_cores == 1):
        return tuple(grid), (0,) * len(grid)
    if not isinstance(num_cores, int):
        raise _err(NotImplementedError, f"{_WHERE}: cannot split the grid over a dynamic number of cores")
    parallel = [i for i, s in enumerate(semantics) if s is tpu_core.PARALLEL]
    if not parallel:
        raise _err(
            NotImplementedError,
            f"{_WHERE}: splitting the grid over {num_cores} cores needs a 'parallel' axis in "
            f"dimension_semantics, got {tuple(s.value for s in semantics)}",
        )
    offsets = [0] * len(grid)
    grid = list(grid)
    for i in parallel:
        if isinstance(grid[i], int) and grid[i] % num_cores == 0:
            grid[i] //= num_cores
            offsets[i] = core_id * grid[i]
            return tuple(grid), tuple(offsets)
    static = [i for i in parallel if isinstance(grid[i], int)]
    if not static:
        raise _err(NotImplementedError, f"{_WHERE}: cannot split dynamic grid axes over cores")
    i = max(static, key=lambda j: grid[j])
    base, rem = divmod(grid[i], num_cores)
    grid[i] = jnp.where(core_id < rem, base + 1, base).astype(jnp.int32)
    offsets[i] = jnp.where(core_id < rem, core_id * (base + 1), core_id * base + rem)
    return tuple(grid), tuple(offsets)


# ---------------------------------------------------------------------------


@tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PipelineStep:
    """Where a pipeline body runs (given to the body with ``_explicit_indices``).

    Attributes:
      index: the grid indices of this step (offset by this core's share).
      local_index: the linear step counter of this core's loop.
    """

    index: tuple[Any, ...]
    local_index: Any

    def tree_flatten(self):
        vals = (*self.index, self.local_index)
        aux = tuple(v if isinstance(v, int) else None for v in vals)
        return [v for v in vals if not isinstance(v, int)], aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        it = iter(children)
        vals = [v if v is not None else next(it) for v in aux]
        return cls(index=tuple(vals[:-1]), local_index=vals[-1])


def emit_pipeline(
    body: Callable[..., None],
    *,
    grid: tuple[int | jax.Array, ...],
    in_specs=(),
    out_specs=(),
    tiling=None,
    core_axis: int | None = None,
    core_axis_name: str | None = None,
    dimension_semantics=None,
    trace_scopes: bool = True,
    no_pipelining: bool = False,
    should_accumulate_out: bool | Sequence[bool] = False,
    _explicit_indices: bool = False,
):
    """A pipeline to call inside a kernel: ``body`` over ``grid`` with blocks
    of HBM Refs double-buffered through VMEM (see the module docstring).

    Args:
      body: called as ``body(*block_refs, *scratches)`` once per grid step
        (``body(pipeline_step, ...)`` with ``_explicit_indices``);
        ``pl.program_id``/``pl.num_programs`` in it (and in the index maps)
        refer to the pipeline's grid.
      grid: the pipeline's grid (ints, or traced int32 scalars).
      in_specs, out_specs: one ``pl.BlockSpec`` per input / output Ref (or
        pytrees of them); ``pipeline_mode=pl.Buffered(n)`` sets the buffer count.
      tiling: the ``pltpu.Tiling`` assumed for blocks that do not divide their
        array (default: the TensorCore tiling of the modeled chip).
      core_axis, core_axis_name: split the grid's first ``parallel`` axis over
        the cores of this kernel grid axis / this named mesh axis.
      dimension_semantics: one ``"parallel"``/``"arbitrary"`` per grid axis.
      trace_scopes: accepted for compatibility (named scopes in profiles).
      no_pipelining: every copy synchronous (one buffer per operand).
      should_accumulate_out: per output (or one bool for all): load the output's
        block from HBM when it changes, so the body can accumulate into it.

    Returns:
      ``pipeline(*refs, scratches=None, allocations=None, body_prologue=None)``.
    """
    del trace_scopes
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    for g in grid:
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer, jax.Array)):
            raise _err(TypeError, f"{_WHERE}: grid entries must be ints or int32 scalars, got grid={grid!r}")
        if isinstance(g, (int, np.integer)) and g <= 0:
            raise _err(ValueError, f"{_WHERE}: grid entries must be strictly positive, got grid={grid!r}")
    grid = tuple(int(g) if isinstance(g, (int, np.integer)) else g for g in grid)
    if core_axis is not None and core_axis_name is not None:
        raise _err(ValueError, f"{_WHERE}: give core_axis or core_axis_name, not both")
    if dimension_semantics is None:
        semantics = (tpu_core.ARBITRARY,) * len(grid)
    else:
        semantics = tuple(
            tpu_core.normalize_semantics(s, f"{_WHERE} dimension_semantics[{i}]")
            for i, s in enumerate(dimension_semantics)
        )
        if len(semantics) != len(grid):
            raise _err(
                ValueError,
                f"{_WHERE}: dimension_semantics has {len(semantics)} entries but grid={grid} has {len(grid)} axes",
            )
    name = getattr(body, "__name__", "body")

    def pipeline(*refs, scratches=None, allocations=None, body_prologue=None):
        ispecs, ospecs = in_specs, out_specs
        if isinstance(allocations, PrefetchedInputs):
            allocations.check_for(refs[: len(jax.tree.leaves(ispecs))], ispecs)
            allocations = None  # the first input blocks are fetched at the start: see PrefetchedInputs
        if allocations is not None and not ispecs and not ospecs:
            # The specs come with the allocations (JAX allows this too).
            allocs = list(allocations)
            ispecs = tuple(b.spec for b in allocs if b is not None and b.buffer_type is BufferType.INPUT)
            ospecs = tuple(b.spec for b in allocs if b is not None and b.buffer_type is not BufferType.INPUT)
        plan, rebuild = _plan(refs, ispecs, ospecs, tiling, should_accumulate_out, allocations)
        if no_pipelining:
            for op in plan:
                if op is not None and op.bref.is_buffered:
                    op.bref = dataclasses.replace(op.bref, _buffer_count=1)
        run = functools.partial(
            _run_pipeline,
            body,
            plan,
            rebuild,
            grid=grid,
            semantics=semantics,
            core_axis=core_axis if core_axis is not None else core_axis_name,
            scratches=() if scratches is None else tuple(scratches),
            body_prologue=body_prologue,
            explicit_indices=_explicit_indices,
            name=name,
        )
        needs_alloc = [
            op for op in plan if op is not None and op.bref.is_buffered and _is_type(op.bref.window_ref)
        ]
        if not needs_alloc:
            run()
            return

        def scoped(brefs):
            for op, b in zip(needs_alloc, brefs):
                op.bref = b
            run()

        pl.run_scoped(scoped, [op.bref for op in needs_alloc])

    return pipeline


class _Group:
    """Buffered operands with the same index map, block shape, array shape,
    buffer count and type: their copies share predicates, slots and
    ``pl.when``s (fewer conditionals for the interpreter to compile)."""

    def __init__(self, members):
        self.members = members
        lead = members[0]
        self.bref, self.spec, self.origin = lead.bref, lead.spec, lead.origin

    def copy_in(self, block_indices, slot, **kw):
        for m in self.members:
            m.copy_in(block_indices, slot, **kw)

    def copy_out(self, block_indices, slot, **kw):
        for m in self.members:
            m.copy_out(block_indices, slot, **kw)


def _group(ops) -> list[_Group]:
    groups: dict[Any, list[_Operand]] = {}
    for op in ops:
        key = (
            id(op.spec.index_map),
            op.spec.block_shape,
            op.shape,
            op.bref.buffer_count,
            op.bref.buffer_type,
        )
        groups.setdefault(key, []).append(op)
    return [_Group(g) for g in groups.values()]


def _is_type(x) -> bool:
    return isinstance(x, pl.MemoryRef)


def _run_pipeline(
    body, plan, rebuild, *, grid, semantics, core_axis, scratches, body_prologue, explicit_indices, name
):
    num_cores, core_id = _core_info(core_axis)
    local_grid, offsets = _partition_grid(grid, semantics, num_cores, core_id)
    static = all(isinstance(g, int) for g in local_grid)
    num_steps = math.prod(local_grid) if static else functools.reduce(lambda a, b: a * b, local_grid)
    ops = [op for op in plan if op is not None]
    groups = _group([op for op in ops if op.bref.is_buffered])
    ins = [g for g in groups if g.bref.is_input]
    outs = [g for g in groups if g.bref.is_output]
    ctx_name = f"emit_pipeline body {name!r}"

    def indices_at(t):
        # The steps around this one wrap around the grid, as in JAX's pipeline: an index map
        # never sees grid indices outside the grid (step -1 of step 0, lookahead past the
        # last step), where a lookup in a scalar-prefetch table would read out of bounds.
        # Blocks at wrapped steps are only compared under predicates that are then false.
        t = lax.rem(jnp.asarray(t, jnp.int32) + num_steps, jnp.maximum(jnp.asarray(num_steps, jnp.int32), 1))
        return tuple(i + o for i, o in zip(_unravel(t, local_grid), offsets))

    class Steps:
        """Grid indices and block indices at the steps around one step,
        computed once (named by their offset from the step)."""

        def __init__(self, s):
            self.s = s
            self.idx: dict[int, tuple] = {}
            self.blocks: dict[tuple[int, int], tuple] = {}

        def indices(self, k):
            if k not in self.idx:
                self.idx[k] = indices_at(self.s + k)
            return self.idx[k]

        def block(self, op, k):
            key = (id(op), k)
            if key not in self.blocks:
                idx = self.indices(k)
                with plb.kernel_context(plb.KernelContext(local_grid, idx, ctx_name)):
                    self.blocks[key] = tuple(map(_as_index, _call_index_map(op.spec, idx, op.origin)))
            return self.blocks[key]

        def differ(self, op, k1, k2):
            return _differ(self.block(op, k1), self.block(op, k2))

    # Prologue: the first n - 1 fetches of every input with n buffers.
    prologue = Steps(jnp.int32(0))
    fetched0 = []
    for op in ins:
        n = op.bref.buffer_count
        count = jnp.int32(0)
        for t in range(n - 1):
            if static and t >= num_steps:
                break
            pred = True if t == 0 else prologue.differ(op, t, t - 1)
            if not static:
                pred = jnp.logical_and(t < num_steps, pred)
            _when(pred, functools.partial(op.copy_in, prologue.block(op, t), lax.rem(count, n)))
            count = count + jnp.asarray(pred, jnp.int32)
        fetched0.append(count)

    def step(s, carry):
        fetched, used, written = (list(c) for c in carry)
        at = Steps(s)
        first = s == 0
        not_first = jnp.logical_not(first)
        last = s == num_steps - 1

        def changed(op):  # the block differs from the previous step's
            return jnp.logical_or(first, at.differ(op, 0, -1))

        def will_change(op):  # the block differs from the next step's, or this is the last step
            return jnp.logical_or(last, at.differ(op, 0, 1))

        # In/out operands finish writing back their previous block before
        # their slots are refilled.
        for k, op in enumerate(outs):
            if op.bref.is_input and op.bref.buffer_count == 2:
                pred = jnp.logical_and(not_first, changed(op))
                prev = functools.partial(op.copy_out, at.block(op, -1), lax.rem(written[k] + 1, 2))
                _when(pred, functools.partial(prev, start=False, wait=True))
        # Inputs: fetch n - 1 steps ahead, then wait for this step's block.
        slots = {}
        for k, op in enumerate(ins):
            n = op.bref.buffer_count
            ch = changed(op)
            used[k] = used[k] + jnp.logical_and(ch, not_first).astype(jnp.int32)
            slot = lax.rem(used[k], n)
            if n == 1:
                _when(ch, functools.partial(op.copy_in, at.block(op, 0), slot, wait=True))
            else:
                pred = jnp.logical_and(s + (n - 1) < num_steps, at.differ(op, n - 1, n - 2))
                _when(pred, functools.partial(op.copy_in, at.block(op, n - 1), lax.rem(fetched[k], n)))
                fetched[k] = fetched[k] + pred.astype(jnp.int32)
                _when(ch, functools.partial(op.copy_in, at.block(op, 0), slot, start=False, wait=True))
            slots.update((id(m), slot) for m in op.members)
        for k, op in enumerate(outs):
            if not op.bref.is_input:
                slots.update((id(m), lax.rem(written[k], op.bref.buffer_count)) for m in op.members)

        block_refs = []
        for op in plan:
            if op is None:
                block_refs.append(None)
            elif op.bref.is_buffered:
                block_refs.append(op.bref.window_ref.at[slots[id(op)]])
            else:
                block_refs.append(op.ref.at[_block_indexer(op.spec, at.block(op, 0))])
        idx = at.indices(0)
        with plb.kernel_context(plb.KernelContext(local_grid, idx, ctx_name)):
            if body_prologue is not None:
                body_prologue()
            args = rebuild(block_refs)
            if explicit_indices:
                body(PipelineStep(idx, s), *args, *scratches)
            else:
                body(*args, *scratches)

        # Outputs: write back when the block is about to change.
        for k, op in enumerate(outs):
            slot = slots[id(op.members[0])]
            wc = will_change(op)
            if op.bref.buffer_count == 1:
                _when(wc, functools.partial(op.copy_out, at.block(op, 0), slot, wait=True))
            else:
                _when(wc, functools.partial(op.copy_out, at.block(op, 0), slot))
                if not op.bref.is_input:
                    pred = jnp.logical_and(not_first, changed(op))
                    prev = functools.partial(op.copy_out, at.block(op, -1), lax.rem(slot + 1, 2))
                    _when(pred, functools.partial(prev, start=False, wait=True))
            written[k] = written[k] + wc.astype(jnp.int32)
        return tuple(fetched), tuple(used), tuple(written)

    carry = (tuple(fetched0), tuple(jnp.int32(0) for _ in ins), tuple(jnp.int32(0) for _ in outs))
    _, _, written = lax.fori_loop(0, num_steps, step, carry)
    # Epilogue: wait for the last write-back of double-buffered outputs.
    at = Steps(jnp.asarray(num_steps - 1, jnp.int32))
    for k, op in enumerate(outs):
        if op.bref.buffer_count == 2:
            op.copy_out(at.block(op, 0), lax.rem(written[k] + 1, 2), start=False, wait=True)


def emit_pipeline_with_allocations(body, *, grid, in_specs=(), out_specs=(), should_accumulate_out=False):
    """``(pipeline, make_allocations)``: ``make_allocations(*refs)`` gives the
    pipeline's BufferedRefs (buffers as types) to allocate once, e.g. with
    ``pl.run_scoped``, and pass to several ``pipeline(..., allocations=...)``
    calls."""
    make_allocations = functools.partial(
        _make_pipeline_allocations,
        in_specs=in_specs,
        out_specs=out_specs,
        grid=grid,
        should_accumulate_out=should_accumulate_out,
    )
    pipeline = emit_pipeline(
        body, grid=grid, in_specs=in_specs, out_specs=out_specs, should_accumulate_out=should_accumulate_out
    )
    return pipeline, make_allocations


def emit_pipeline_with_async_prefetch(
    body,
    *,
    grid,
    in_specs=(),
    out_specs=(),
    mesh=None,
    tiling=None,
    core_axis=None,
    core_axis_name=None,
    dimension_semantics=None,
    trace_scopes: bool = True,
    no_pipelining: bool = False,
    _explicit_indices: bool = False,
):
    """``(pipeline, async_prefetch)`` (JAX's signature): ``pipeline`` is
    ``emit_pipeline(...)``; ``async_prefetch(*inputs)``, called outside the
    kernel, starts the DMAs of the inputs' first blocks and returns them as
    ``allocations`` for ``pipeline(..., allocations=...)`` in a later kernel
    over ``mesh``. In interpret mode the returned ``PrefetchedInputs`` stands
    for those in-flight blocks: the pipeline that takes it lands them when it
    starts (see ``PrefetchedInputs``)."""
    del mesh
    pipeline = emit_pipeline(
        body,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        tiling=tiling,
        core_axis=core_axis,
        core_axis_name=core_axis_name,
        dimension_semantics=dimension_semantics,
        trace_scopes=trace_scopes,
        no_pipelining=no_pipelining,
        _explicit_indices=_explicit_indices,
    )

    def async_prefetch(*inputs):
        specs = list(in_specs) if isinstance(in_specs, (list, tuple)) else [in_specs]
        if len(inputs) != len(specs) or any(
            jax.tree.structure(x) != jax.tree.structure(sp, is_leaf=lambda v: v is None)
            for x, sp in zip(inputs, specs)
        ):
            raise _err(
                ValueError,
                f"pltpu.emit_pipeline_with_async_prefetch: async_prefetch takes one input per in_spec "
                f"({len(specs)}), with the in_specs' structure; got {len(inputs)} inputs",
            )
        return PrefetchedInputs(tuple(_shape_dtype(x) for x in jax.tree.leaves(inputs)))

    return pipeline, async_prefetch


def _shape_dtype(x):
    return (tuple(x.shape), jnp.dtype(x.dtype))


@dataclasses.dataclass(frozen=True)
class PrefetchedInputs:
    """What ``async_prefetch`` returns: the first input blocks of a pipeline,
    fetched ahead of the kernel that runs it. On a TPU that overlaps the
    fetch with earlier work; the data are the inputs' first blocks either way
    (the inputs are immutable JAX arrays), so interpret mode fetches them when
    the pipeline starts, which gives the same results. The pipeline checks
    that it runs on inputs of the prefetched shapes and dtypes."""

    inputs: tuple[tuple[tuple[int, ...], Any], ...]

    def __len__(self) -> int:
        return len(self.inputs)

    def check_for(self, refs, ispecs) -> None:
        got = tuple(_shape_dtype(r) for r in jax.tree.leaves(refs))
        if got != self.inputs:
            raise _err(
                ValueError,
                f"{_WHERE}: allocations from async_prefetch were made for inputs {self._show(self.inputs)} "
                f"but the pipeline runs on {self._show(got)}",
            )

    @staticmethod
    def _show(items) -> str:
        return ", ".join(f"{d}{list(s)}" for s, d in items)
