"""User-facing specification types (BlockSpec, GridSpec, memory spaces) and
the internal grid mapping that pallas_call builds from them."""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pallas._src import compat, errors


class MemorySpace(enum.Enum):
    """Where a kernel operand lives. ``ANY`` means: wherever the backend keeps
    whole arrays; the kernel gets an unblocked Ref to the whole array."""

    ANY = "any"
    HOST = "host"

    def __call__(self, shape, dtype) -> MemoryRef:
        return MemoryRef(tuple(shape), np.dtype(dtype), self)

    def __str__(self) -> str:
        return self.value


#: Whole-array operands left where they are (HBM on a TPU, global memory on a GPU): the
#: kernel gets a Ref of the array and copies parts itself (DMAs, ``plgpu.load``).
ANY = MemorySpace.ANY
#: Host memory (a TPU's pinned host buffers).
HOST = MemorySpace.HOST

# Backends (pallas-tpu's VMEM/SMEM, ...) register their memory-space types so
# that BlockSpec validation accepts them.
_memory_space_types: set[type] = {MemorySpace}


def register_memory_space_type(cls: type) -> None:
    """Makes ``cls`` (a backend's memory space enum) a memory space that
    ``BlockSpec(memory_space=...)`` and scratch shapes accept."""
    _memory_space_types.add(cls)
    compat.register_neutral_memory_space(cls)


def is_whole_array_space(ms: Any) -> bool:
    """``pl.ANY`` and backend spaces such as ``pltpu.HBM``: the kernel gets the
    whole, unblocked array."""
    return ms is ANY or bool(getattr(ms, "whole_array", False))


def is_memory_space(obj: Any) -> bool:
    return obj is None or isinstance(obj, tuple(_memory_space_types))


for _ms in MemorySpace:
    compat.register_neutral_memory_space(_ms)

# Memory spaces asked for by a backend's ``with_memory_space_constraint`` (JAX's
# ``pltpu.with_memory_space_constraint``), keyed by the id of the traced value it
# returned and kept while that tracer lives. ``pl.kernel`` places such an operand in
# that space (as JAX's ``pl.kernel`` does from the operand's type). The value's type
# is left alone, so the constraint never leaves the kernel call: jit outputs and
# other ops see a plain array. A concrete (eager) value carries no constraint.
_memory_space_constraints: dict[int, tuple[weakref.ref, Any]] = {}


def constrain_memory_space(x: Any, memory_space: Any) -> Any:
    """Records that traced value ``x`` should be placed in ``memory_space`` when
    it is an operand of ``pl.kernel``; returns ``x``."""
    if isinstance(x, jax.core.Tracer):
        key = id(x)

        def forget(ref, key=key):
            if _memory_space_constraints.get(key, (None,))[0] is ref:
                del _memory_space_constraints[key]

        _memory_space_constraints[key] = (weakref.ref(x, forget), memory_space)
    return x


def constrained_memory_space(x: Any) -> Any:
    """The memory space ``constrain_memory_space`` recorded for ``x``, else None."""
    entry = _memory_space_constraints.get(id(x))
    return entry[1] if entry is not None and entry[0]() is x else None


@dataclasses.dataclass(frozen=True)
class MemoryRef:
    """A shape, dtype and memory space: the type of a scratch buffer."""

    shape: tuple[int, ...]
    dtype: Any
    memory_space: Any = None

    def get_array_aval(self):
        return compat.shaped_array(self.shape, self.dtype)

    def get_ref_aval(self):
        return compat.ref_aval(self.shape, self.dtype, _aval_memory_space(self.memory_space))


@dataclasses.dataclass(frozen=True)
class Blocked:
    """A block dimension indexed by block number (the default)."""

    block_size: int

    def __str__(self):
        return f"Blocked({self.block_size})"


@dataclasses.dataclass(frozen=True)
class Element:
    """A block dimension whose index_map result is an element offset into the
    array padded by ``padding=(low, high)``."""

    block_size: int
    padding: tuple[int, int] = (0, 0)

    def __str__(self):
        if self.padding == (0, 0):
            return f"Element({self.block_size})"
        return f"Element({self.block_size}, padding={self.padding})"


@dataclasses.dataclass(frozen=True)
class Squeezed:
    """A block dimension of size 1 that the kernel does not see."""

    def __str__(self):
        return "squeezed"


#: The ``Squeezed`` block dimension (``None`` in a ``block_shape`` means the same).
squeezed = Squeezed()
#: The type of one entry of a ``BlockSpec``'s block shape after normalization.
BlockDim = Blocked | Element | Squeezed


class DynamicGridDim:
    """A grid axis whose size is a traced value (``grid=(n_tiles, ...)`` with
    ``n_tiles`` a tracer). Its size is an extra operand of ``pallas_call_p``."""

    def __repr__(self):
        return "dynamic"


#: The size recorded in a ``GridMapping``'s grid for an axis whose size is traced.
dynamic_grid_dim: Any = DynamicGridDim()


class _NoBlockSpec:
    def __repr__(self):
        return "no_block_spec"


#: The default ``in_specs``/``out_specs``: the whole array, as one block.
no_block_spec: Any = _NoBlockSpec()


class RevisitMode(enum.Enum):
    """How an output block revisited at a later grid step is handled by a
    pipelining backend: ``IMMEDIATE`` (the default) allows revisits only on
    consecutive steps; ``ANY`` at any step (costs extra copies)."""

    IMMEDIATE = "immediate"
    ANY = "any"


@dataclasses.dataclass(frozen=True)
class Buffered:
    """A BlockSpec ``pipeline_mode``: how many buffers the pipeline keeps for
    the operand (2 is double buffering, 1 is no overlap).

    Args:
      buffer_count: the number of buffers (>= 1).
      use_lookahead: fetch the next *changed* block as soon as a slot frees.
      revisit: a ``RevisitMode`` for outputs.
      prefetched_count: slots filled before the pipeline starts.
    """

    buffer_count: int
    use_lookahead: bool = False
    revisit: RevisitMode | None = None
    prefetched_count: int = 0

    def __post_init__(self):
        if not isinstance(self.buffer_count, int) or self.buffer_count < 1:
            raise ValueError(f"pl.Buffered: buffer_count must be a positive int, got {self.buffer_count!r}")


@dataclasses.dataclass(frozen=True)
class BoundedSlice:
    """A block dimension whose index_map returns a ``pl.ds(start, size)`` with
    a dynamic size of at most ``block_size``."""

    block_size: int

    def __repr__(self):
        return f"BoundedSlice({self.block_size})"


@dataclasses.dataclass(frozen=True)
class Indirect:
    """A block dimension indexed by an array of indices (JAX 0.12): a gather
    for inputs and a scatter for outputs, of ``block_size`` rows.

    JAX reads it in ``emit_pipeline`` of SparseCore kernels, whose indirect
    DMAs do the gather; ours lowers no SparseCore kernel, so ``pallas_call``
    and ``pltpu.emit_pipeline`` refuse a block shape that holds one."""

    block_size: int

    def __repr__(self):
        return f"Indirect({self.block_size})"


class semaphore:  # noqa: N801  (JAX's name for the regular semaphore dtype)
    """The element type of regular semaphores (``pltpu.SemaphoreType.REGULAR``).

    A name for code written against JAX's API; never instantiated. Our
    semaphore Refs hold int32 counters in a ``SemaphoreSpace`` memory space:
    ask ``semaphore_kind(ref_aval)`` what a Ref is."""


class SemaphoreKind(enum.Enum):
    """The kinds of semaphore a kernel can allocate (``pltpu.SemaphoreType``)."""

    REGULAR = "regular"
    DMA = "dma"
    BARRIER = "barrier"


@dataclasses.dataclass(frozen=True)
class SemaphoreSpace:
    """The memory space of a semaphore Ref: counters of one ``SemaphoreKind``,
    stored as int32 (reading them is only possible with
    ``pl.semaphore_read``)."""

    kind: SemaphoreKind

    def __str__(self):
        return f"semaphore[{self.kind.value}]"


def semaphore_kind(aval) -> SemaphoreKind | None:
    """The kind of a semaphore Ref aval, None for other Refs."""
    ms = getattr(aval, "memory_space", None)
    return ms.kind if isinstance(ms, SemaphoreSpace) else None


class Mesh:
    """Base class of the meshes ``pl.kernel`` runs a body over (e.g.
    ``pltpu.TensorCoreMesh``): ``shape`` maps axis names to sizes."""

    @property
    def shape(self) -> dict[str, int]:
        raise NotImplementedError

    @property
    def default_memory_space(self):
        return ANY

    def compiler_params(self, given):
        """The backend CompilerParams for a body over this mesh."""
        return given


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """How one operand is split into blocks.

    Args:
      block_shape: one entry per array dimension: an int (block size), ``None``
        or ``pl.squeezed`` (size-1 dimension removed in the kernel),
        ``pl.Blocked(n)`` or ``pl.Element(n, padding)``. ``None`` for the
        whole array.
      index_map: maps the grid indices to block indices (one per dimension;
        element offsets for ``Element`` dimensions).
      memory_space: ``None`` (the backend's default) or e.g. ``pl.ANY``.
    """

    block_shape: Sequence[Any] | None = None
    index_map: Callable[..., Any] | None = None
    memory_space: Any = None
    pipeline_mode: Any = None


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """The grid, the operands' block specs and the scratch buffers."""

    grid: Any = ()
    in_specs: Any = no_block_spec
    out_specs: Any = no_block_spec
    scratch_shapes: Any = ()


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """Cost of one call, passed to XLA's scheduler by backends that use it."""

    flops: int
    transcendentals: int
    bytes_accessed: int
    remote_bytes_transferred: int = 0


class CompilerParams:
    """Base class of the backends' frozen ``CompilerParams`` dataclasses.

    Subclasses set ``PLATFORM`` (e.g. ``"cuda"``, ``"tpu"``): it selects the
    backend that lowers the kernel.
    """

    PLATFORM: str = ""


# ---------------------------------------------------------------------------
# Internal: what pallas_call hands to backends.


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMapping:
    """One operand's blocking, resolved against its array."""

    origin: str  # "in_specs[1]", "out_specs['y']": used in messages
    block_shape: tuple[BlockDim, ...]
    index_map: Any  # closed jaxpr: G int32 scalars -> one int32 per dim
    array_shape: tuple[int, ...]
    dtype: Any
    memory_space: Any

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(block_dim_size(d) for d in self.block_shape)

    @property
    def kernel_block_shape(self) -> tuple[int, ...]:
        """The shape of the Ref the kernel sees (squeezed dims removed)."""
        return tuple(block_dim_size(d) for d in self.block_shape if not isinstance(d, Squeezed))

    @property
    def is_whole_array(self) -> bool:
        return is_whole_array_space(self.memory_space)

    def ref_aval(self) -> Any:
        return compat.ref_aval(self.kernel_block_shape, self.dtype, _aval_memory_space(self.memory_space))

    def __str__(self):
        dims = ", ".join(str(d) for d in self.block_shape)
        return (
            f"{self.origin}: array {self.dtype}{list(self.array_shape)} "
            f"block ({dims}) memory_space={self.memory_space} "
            f"index_map={{ {_pp_index_map(self.index_map)} }}"
        )


def _aval_memory_space(ms):
    """pallas-core's own memory spaces stay out of avals: values read from an
    ANY Ref are ordinary arrays. Backend memory spaces are kept."""
    return None if isinstance(ms, MemorySpace) else ms


def block_dim_size(d: BlockDim) -> int:
    return 1 if isinstance(d, Squeezed) else d.block_size


def _pp_index_map(jaxpr) -> str:
    return " ".join(str(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr).split())


@dataclasses.dataclass(frozen=True, eq=False)
class GridMapping:
    """The grid and every operand's block mapping (inputs, then outputs)."""

    grid: tuple[Any, ...]  # ints, or dynamic_grid_dim for a traced size
    block_mappings: tuple[BlockMapping, ...]
    num_inputs: int
    num_outputs: int
    scratch_avals: tuple[Any, ...]  # AbstractRef per scratch buffer
    kernel_name: str
    source: str  # "file.py:42" of the pallas_call
    # Named grid axes (grid=(("i", 4),)): one name or None per axis, for lax.axis_index.
    grid_names: tuple[str | None, ...] = ()
    # PrefetchScalarGridSpec: the first operands are scalar-prefetch arrays; index
    # maps take them (as Refs) after the grid indices, and so does the kernel, first.
    num_scalar_prefetch: int = 0
    prefetch_avals: tuple[Any, ...] = ()  # their Ref avals

    @property
    def dynamic_axes(self) -> tuple[int, ...]:
        """The grid axes whose sizes are traced: their sizes are the first
        operands of ``pallas_call_p`` and, after the grid indices, inputs of
        the kernel jaxpr."""
        return tuple(a for a, g in enumerate(self.grid) if g is dynamic_grid_dim)

    @property
    def num_dynamic_grid_bounds(self) -> int:
        return len(self.dynamic_axes)

    @property
    def where(self) -> str:
        """``pallas_call 'name' at file.py:12``: how errors name the kernel."""
        return errors.describe(self.kernel_name, self.source)

    @property
    def in_block_mappings(self):
        return self.block_mappings[: self.num_inputs]

    @property
    def out_block_mappings(self):
        return self.block_mappings[self.num_inputs :]

    @property
    def out_avals(self):
        return tuple(jax.core.ShapedArray(bm.array_shape, bm.dtype) for bm in self.out_block_mappings)

    def replace(self, **kw) -> GridMapping:
        return dataclasses.replace(self, **kw)

    def __str__(self):
        lines = [f"GridMapping of '{self.kernel_name}' ({self.source}):"]
        lines.append(f"  grid={self.grid}")
        if any(self.grid_names):
            lines.append(f"  grid_names={self.grid_names}")
        for i, a in enumerate(self.prefetch_avals):
            lines.append(f"  scalar_prefetch[{i}]: {a}")
        lines += [f"  {bm}" for bm in self.block_mappings]
        for i, a in enumerate(self.scratch_avals):
            lines.append(f"  scratch_shapes[{i}]: {a}")
        return "\n".join(lines)


register_memory_space_type(SemaphoreSpace)
