"""``emit_pipeline``'s operands: ``BufferType``, ``BufferedRef`` (a spec, its
buffer and DMA semaphores) and block indexing (index maps, ``pl.BoundedSlice``
windows, the ``.at[...]`` indexer of a block). The schedule is ``pipeline.py``'s (its loop
``pipeline_schedule.py``'s)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

import pallas as pl
from pallas import backend as plb
from pallas_tpu._src.language import core as tpu_core

VMEM, SMEM, HBM = tpu_core.VMEM, tpu_core.SMEM, tpu_core.HBM
WHERE = "pltpu.emit_pipeline"


def pipeline_error(cls, msg):
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

    @property
    def is_trivial_windowing(self) -> bool:
        return False

    @property
    def prefetched_count(self) -> int:
        return 0

    @property
    def await_prefetch(self) -> bool:
        return False

    @property
    def use_lookahead(self) -> bool:
        return False

    def with_spec(self, spec: pl.BlockSpec) -> BufferedRefBase:
        raise NotImplementedError

    # The protocol JAX's pipeline scheduler speaks to an operand (see pipeline_protocol.py):
    # a subclass passed in ``allocations`` gets these calls from ours too.

    def initialize_slots(self) -> BufferedRefBase:
        raise NotImplementedError

    def advance_copy_in_slot(self, predicate=True) -> BufferedRefBase:
        raise NotImplementedError

    def advance_wait_in_slot(self, predicate=True) -> BufferedRefBase:
        raise NotImplementedError

    def advance_copy_out_slot(self, predicate=True) -> BufferedRefBase:
        raise NotImplementedError

    def advance_wait_out_slot(self, predicate=True) -> BufferedRefBase:
        raise NotImplementedError


def dim_size(bd) -> int | None:
    """The buffer extent of one block dimension (None: squeezed)."""
    if bd is None or isinstance(bd, pl.Squeezed):
        return None
    if isinstance(bd, int):
        return bd
    if isinstance(bd, (pl.Blocked, pl.Element, pl.BoundedSlice)):
        return bd.block_size
    raise pipeline_error(ValueError, f"{WHERE}: unsupported block dimension {bd!r}")


def _buffer_block_shape(block_shape) -> tuple[int, ...]:
    return tuple(s for s in map(dim_size, block_shape) if s is not None)


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
    # JAX's slot registers (uint32 counts of the copies and waits issued), set when the
    # pipeline schedules this operand through its methods (a subclass in ``allocations``:
    # pipeline_protocol.py); None otherwise.
    copy_in_slot: Any = None
    wait_in_slot: Any = None
    copy_out_slot: Any = None
    wait_out_slot: Any = None
    next_fetch: Any = None
    _grid_rank: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if self.is_output and self._buffer_count > 2:
            raise pipeline_error(
                NotImplementedError,
                f"{WHERE}: outputs take at most 2 buffers (pl.Buffered(1) or (2)), got {self._buffer_count}",
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
        grid_rank: int | None = None,
        use_lookahead: bool = False,
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
          grid_rank, use_lookahead: the pipeline grid's rank, recorded when
            ``use_lookahead`` (JAX's fetch-ahead schedule; ours fetches
            ``buffer_count - 1`` steps ahead either way).
          source_memory_space: where the operand's Ref lives; a spec in the
            same space (or in ``pl.ANY``/HBM) gets no buffer.

        The buffer is ``(buffer_count, *block)``; a 1-D block's is
        ``(buffer_count * block,)``, its slots one after the other, as JAX's.
        """
        dtype = getattr(dtype_or_type, "dtype", dtype_or_type)
        space = VMEM if spec.memory_space is None else spec.memory_space
        if space is pl.ANY or space is HBM or space is source_memory_space:
            return cls(spec, buffer_type, 0, None, None, None, tiling=tiling)
        if space not in (VMEM, SMEM):
            raise pipeline_error(ValueError, f"{WHERE}: blocks can be buffered in VMEM or SMEM, not {space}")
        if not isinstance(buffer_count, int) or buffer_count < 1:
            raise pipeline_error(
                ValueError, f"{WHERE}: buffer_count must be a positive int, got {buffer_count!r}"
            )
        block = _buffer_block_shape(spec.block_shape)
        dma = tpu_core.SemaphoreType.DMA((buffer_count,))
        shape = (buffer_count * block[0],) if len(block) == 1 else (buffer_count, *block)
        return cls(
            spec,
            buffer_type,
            buffer_count,
            space(shape, dtype),
            dma if buffer_type.is_input else None,
            dma if buffer_type.is_output else None,
            tiling=tiling,
            is_trivial_windowing=is_trivial_windowing,
            _grid_rank=grid_rank if use_lookahead else None,
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

    def with_slot_index(
        self, slot=None, *, copy_in_slot=None, copy_out_slot=None, wait_in_slot=None, wait_out_slot=None
    ) -> BufferedRef:
        """This operand with the slot the body sees (``slot``) or JAX's slot registers set
        (those given)."""
        regs = dict(
            current_slot=slot,
            copy_in_slot=copy_in_slot,
            copy_out_slot=copy_out_slot,
            wait_in_slot=wait_in_slot,
            wait_out_slot=wait_out_slot,
        )
        return dataclasses.replace(self, **{k: v for k, v in regs.items() if v is not None})

    @property
    def current_ref(self):
        """The block the body works on: the current slot of the buffer (with JAX's slot
        registers set: the slot of the last wait_in for an input, of the next copy_out
        for an output)."""
        if self.window_ref is None:
            raise ValueError("this BufferedRef has no buffer bound (window_ref is None)")
        if self.current_slot is None and self.copy_out_slot is not None and self.is_output:
            return self._window_ref_at(self.current_copy_out_slot)
        if self.current_slot is None and self.wait_in_slot is not None:
            return self._window_ref_at(self.current_wait_in_slot)
        return self._window_ref_at(0 if self.current_slot is None else self.current_slot)

    def _window_ref_at(self, slot, window_slice=None):
        """The buffer's ``slot`` (``window_slice``: per-dim ``pl.ds`` within the block);
        a 1-D buffer holds its slots one after the other."""
        tail = tuple(window_slice or ())
        if len(self.window_ref.shape) > 1:
            return self.window_ref.at[(slot, *tail)]
        n = self.window_ref.shape[0] // self._buffer_count
        if not tail:
            return self.window_ref.at[pl.ds(slot * n, n)]
        (w,) = tail
        return self.window_ref.at[pl.ds(slot * n + w.start, w.size)]

    # JAX's slot registers (pipeline_protocol.py): uint32 counts of the copies and waits.

    @property
    def use_lookahead(self) -> bool:
        return self._grid_rank is not None

    @property
    def cumulative_copy_in(self):
        return self.copy_in_slot

    @property
    def cumulative_wait_in(self):
        return self.wait_in_slot

    @property
    def cumulative_copy_out(self):
        return self.copy_out_slot

    @property
    def cumulative_wait_out(self):
        return self.wait_out_slot

    def _slot_of(self, count):
        return lax.rem(count, jnp.uint32(self.buffer_count))

    @property
    def current_copy_in_slot(self):
        return self._slot_of(self.copy_in_slot)

    @property
    def current_wait_in_slot(self):
        return self._slot_of(self.wait_in_slot)

    @property
    def current_copy_out_slot(self):
        return self._slot_of(self.copy_out_slot)

    @property
    def current_wait_out_slot(self):
        return self._slot_of(self.wait_out_slot)

    def initialize_slots(self) -> BufferedRef:
        zero_in = jnp.uint32(0) if self.is_input else None
        zero_out = jnp.uint32(0) if self.is_output else None
        return dataclasses.replace(
            self, copy_in_slot=zero_in, wait_in_slot=zero_in, copy_out_slot=zero_out, wait_out_slot=zero_out
        )

    def _advanced(self, name, predicate, applies) -> BufferedRef:
        if not (self.is_buffered and applies):
            return self
        count = getattr(self, name)
        if isinstance(predicate, (bool, np.bool_)):
            new = count + 1 if predicate else count
        else:
            new = lax.select(predicate, count + 1, count)
        return dataclasses.replace(self, **{name: new})

    def advance_copy_in_slot(self, predicate=True) -> BufferedRef:
        return self._advanced("copy_in_slot", predicate, self.is_input)

    def advance_wait_in_slot(self, predicate=True) -> BufferedRef:
        return self._advanced("wait_in_slot", predicate, self.is_input)

    def advance_copy_out_slot(self, predicate=True) -> BufferedRef:
        return self._advanced("copy_out_slot", predicate, self.is_output)

    def advance_wait_out_slot(self, predicate=True) -> BufferedRef:
        return self._advanced("wait_out_slot", predicate, self.is_output)

    def copy_in(self, src_ref, grid_indices):
        """Starts the copy of the block at ``grid_indices`` of ``src_ref`` into the
        copy-in slot."""
        if self.is_buffered:
            _copy_block(self, src_ref, grid_indices, self.current_copy_in_slot, True, False, True)

    def wait_in(self, src_ref, grid_indices):
        """Waits for the copy of the block at ``grid_indices`` into the wait-in slot."""
        if self.is_buffered:
            _copy_block(self, src_ref, grid_indices, self.current_wait_in_slot, False, True, True)

    def copy_out(self, dst_ref, grid_indices):
        """Starts the copy of the copy-out slot to the block at ``grid_indices`` of
        ``dst_ref`` (one buffer: and waits for it)."""
        if self.is_buffered:
            sync = self._buffer_count == 1
            _copy_block(self, dst_ref, grid_indices, self.current_copy_out_slot, True, sync, False)

    def wait_out(self, dst_ref, grid_indices):
        """Waits for the copy of the wait-out slot to the block at ``grid_indices``
        (nothing with one buffer: its copy_out waited)."""
        if self.is_buffered and self._buffer_count > 1:
            _copy_block(self, dst_ref, grid_indices, self.current_wait_out_slot, False, True, False)

    def compute_slice(self, grid_indices):
        """The indexer of the block at ``grid_indices`` in the operand's Ref."""
        return block_indexer(self.spec, call_index_map(self.spec, grid_indices, "spec"))


# The copy behind BufferedRef's copy methods: pipeline_protocol.copy_block, registered
# when that module loads (it needs pipeline_plan's _Operand, and pipeline_plan imports
# this module, so this module cannot import it).
_COPY_BLOCK: list[Any] = []


def register_copy_block(fn) -> None:
    _COPY_BLOCK[:] = [fn]


def _copy_block(*args) -> None:
    _COPY_BLOCK[0](*args)


# ---------------------------------------------------------------------------
# Block indexing.


def call_index_map(spec, indices, origin: str):
    index_map = spec.index_map
    if index_map is None:
        return (0,) * len(spec.block_shape)
    try:
        out = index_map(*indices)
    except TypeError as e:
        raise pipeline_error(
            TypeError,
            f"{WHERE}: {origin}.index_map failed on the {len(indices)} grid indices of the pipeline: {e}",
        ) from None
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) != len(spec.block_shape):
        raise pipeline_error(
            ValueError,
            f"{WHERE}: {origin}.index_map returns {len(out)} indices but block_shape "
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
        raise pipeline_error(
            ValueError,
            f"{WHERE}: {origin}.index_map returns {type(b).__name__} at position {d}, a "
            f"{bd!r} dimension: it must return pl.ds(start, size) there (size <= {bd.block_size})",
        )
    if b.stride != 1:
        raise pipeline_error(
            ValueError, f"{WHERE}: {origin}.index_map returns a strided pl.ds at position {d} ({bd!r})"
        )
    if isinstance(b.size, (int, np.integer)) and not 0 <= b.size <= bd.block_size:
        raise pipeline_error(
            ValueError,
            f"{WHERE}: {origin}.index_map returns pl.ds(..., {int(b.size)}) at position {d}, a {bd!r} "
            f"dimension: the size must be at most {bd.block_size}",
        )


def block_indexer(spec, block_indices, sizes=None):
    """The ``.at[...]`` indexer of a block (``sizes``: per-dim sizes, to cut
    the last block of a dimension that the block does not divide)."""
    idx = []
    for d, (bd, b) in enumerate(zip(spec.block_shape, block_indices)):
        size = dim_size(bd)
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


def as_index(b):
    """A block index as an int or int32 scalar (a ``pl.ds``: its start and size)."""
    if isinstance(b, pl.Slice):
        return pl.ds(as_index(b.start), as_index(b.size))
    return b if isinstance(b, int) else jnp.asarray(b, jnp.int32)


def _index_leaves(xs):
    """Block indices with each ``pl.ds`` as its start and size."""
    out = []
    for x in xs:
        out += [x.start, x.size] if isinstance(x, pl.Slice) else [x]
    return out


def any_differ(xs, ys):
    out = False
    for x, y in zip(_index_leaves(xs), _index_leaves(ys)):
        if x is y:
            continue
        ne = x != y
        out = ne if out is False else jnp.logical_or(out, ne)
    return out


def run_when(pred, f):
    if isinstance(pred, (bool, np.bool_)):
        if pred:
            f()
        return
    lax.cond(pred, f, lambda: None)


def unravel(t, grid):
    """Grid indices of linear step ``t`` (lexicographic order)."""
    out = []
    for g in reversed(grid):
        if isinstance(g, int) and g == 1:
            out.append(jnp.int32(0))
            continue
        out.append(lax.rem(t, jnp.asarray(g, jnp.int32)))
        t = lax.div(t, jnp.asarray(g, jnp.int32))
    return tuple(reversed(out))
