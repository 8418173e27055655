"""TPU backend types: memory spaces, semaphore types, ``CompilerParams``,
``PrefetchScalarGridSpec`` and ``TensorCoreMesh`` (the names and fields of
JAX's Pallas TPU module)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

import pallas as pl
from pallas import backend as plb


class CoreType(enum.Enum):
    """The core a kernel runs on: a TensorCore or a SparseCore's scalar or vector subcore."""

    TC = "tc"
    SC_SCALAR_SUBCORE = "sc_scalar_subcore"
    SC_VECTOR_SUBCORE = "sc_vector_subcore"

    def __str__(self) -> str:
        return self.value


class GridDimensionSemantics(enum.Enum):
    """How the grid steps along an axis may run: in any order (``PARALLEL``),
    split over the TensorCores of a chip (``CORE_PARALLEL``) or subcores
    (``SUBCORE_PARALLEL``), or in order (``ARBITRARY``)."""

    PARALLEL = "parallel"
    CORE_PARALLEL = "core_parallel"
    SUBCORE_PARALLEL = "subcore_parallel"
    ARBITRARY = "arbitrary"


#: A grid axis whose steps are independent (a megacore chip may split it over its cores).
PARALLEL = GridDimensionSemantics.PARALLEL
#: A grid axis split over the TensorCores (``num_cores_or_threads`` in interpret mode).
CORE_PARALLEL = GridDimensionSemantics.CORE_PARALLEL
#: A grid axis split over a SparseCore's subcores.
SUBCORE_PARALLEL = GridDimensionSemantics.SUBCORE_PARALLEL
#: A grid axis whose steps run in order (e.g. one that revisits an output block).
ARBITRARY = GridDimensionSemantics.ARBITRARY
DimensionSemantics = (
    GridDimensionSemantics | Literal["parallel", "core_parallel", "subcore_parallel", "arbitrary"]
)


class SideEffectType(enum.Enum):
    """Whether XLA may remove or reorder a kernel: pure, or with side effects."""

    PURE = "pure"
    DATAFLOW_SIDE_EFFECTING = "dataflow_side_effecting"
    SIDE_EFFECTING = "side_effecting"


def normalize_semantics(sem: Any, where: str) -> GridDimensionSemantics:
    if isinstance(sem, GridDimensionSemantics):
        return sem
    try:
        return GridDimensionSemantics(sem)
    except ValueError:
        names = ", ".join(repr(s.value) for s in GridDimensionSemantics)
        raise ValueError(f"{where}: unknown dimension semantics {sem!r}; expected one of {names}") from None


_BOOL_FIELDS = (
    "disable_bounds_checks",
    "disable_semaphore_checks",
    "skip_device_barrier",
    "allow_collective_id_without_custom_barrier",
    "shape_invariant_numerics",
    "needs_layout_passes",
    "fuse_transposed_lhs_in_matmul",
)


@dataclasses.dataclass(frozen=True, init=False)
class CompilerParams(pl.CompilerParams):
    """Mosaic TPU compiler parameters (the fields of JAX's ``pltpu.CompilerParams``).

    Attributes:
      dimension_semantics: one per grid axis: ``"parallel"``, ``"arbitrary"``,
        ``"core_parallel"``, ``"subcore_parallel"`` (or the enum members).
      allow_input_fusion: one bool per input: may XLA fuse its producer in.
      vmem_limit_bytes: the VMEM the kernel may use (a kernel needing more is
        refused; a limit above the chip's VMEM is accepted, as libtpu accepts it).
      collective_id: which barrier semaphore ``get_barrier_semaphore`` uses.
      has_side_effects: keep the call even if its outputs are unused.
      flags, internal_scratch_in_bytes, serialization_format, ...: passed to
        Mosaic unchanged.
    """

    PLATFORM = "tpu"

    dimension_semantics: tuple[GridDimensionSemantics, ...] | None = None
    allow_input_fusion: tuple[bool, ...] | None = None
    vmem_limit_bytes: int | None = None
    collective_id: int | None = None
    has_side_effects: bool | SideEffectType = False
    flags: tuple[tuple[str, Any], ...] | None = None
    internal_scratch_in_bytes: int | None = None
    serialization_format: int = 1
    disable_bounds_checks: bool = False
    disable_semaphore_checks: bool = False
    skip_device_barrier: bool = False
    allow_collective_id_without_custom_barrier: bool = False
    shape_invariant_numerics: bool = True
    use_tc_tiling_on_sc: bool | None = None
    needs_layout_passes: bool = True
    fuse_transposed_lhs_in_matmul: bool = False
    opt_level: Any = None

    def __init__(
        self,
        dimension_semantics: Sequence[DimensionSemantics] | None = None,
        allow_input_fusion: Sequence[bool] | None = None,
        vmem_limit_bytes: int | None = None,
        collective_id: int | None = None,
        has_side_effects: bool | SideEffectType = False,
        flags: Mapping[str, Any] | None = None,
        internal_scratch_in_bytes: int | None = None,
        serialization_format: int = 1,
        disable_bounds_checks: bool = False,
        disable_semaphore_checks: bool = False,
        skip_device_barrier: bool = False,
        allow_collective_id_without_custom_barrier: bool = False,
        shape_invariant_numerics: bool = True,
        use_tc_tiling_on_sc: bool | None = None,
        needs_layout_passes: bool = True,
        fuse_transposed_lhs_in_matmul: bool = False,
        opt_level: Any = None,
    ):
        sems = None
        if dimension_semantics is not None:
            sems = tuple(
                normalize_semantics(s, f"pltpu.CompilerParams dimension_semantics[{i}]")
                for i, s in enumerate(dimension_semantics)
            )
        if not isinstance(has_side_effects, (bool, np.bool_, SideEffectType)):
            raise TypeError(
                "pltpu.CompilerParams: has_side_effects must be True, False or a pltpu.SideEffectType, got "
                f"{has_side_effects!r} ({type(has_side_effects).__name__})"
            )
        if isinstance(has_side_effects, np.bool_):
            has_side_effects = bool(has_side_effects)
        if use_tc_tiling_on_sc is not None and not isinstance(use_tc_tiling_on_sc, (bool, np.bool_)):
            raise TypeError(
                "pltpu.CompilerParams: use_tc_tiling_on_sc must be True, False or None, got "
                f"{use_tc_tiling_on_sc!r} ({type(use_tc_tiling_on_sc).__name__})"
            )
        if vmem_limit_bytes is not None and (
            not isinstance(vmem_limit_bytes, int)
            or isinstance(vmem_limit_bytes, bool)
            or vmem_limit_bytes <= 0
        ):
            raise ValueError(
                f"pltpu.CompilerParams: vmem_limit_bytes must be a positive int, got {vmem_limit_bytes!r}"
            )
        if allow_input_fusion is not None:
            allow_input_fusion = tuple(allow_input_fusion)
            bad = [b for b in allow_input_fusion if not isinstance(b, (bool, np.bool_))]
            if bad:
                raise TypeError(
                    "pltpu.CompilerParams: allow_input_fusion takes one True/False per input of the "
                    f"pallas_call, got {bad[0]!r} in {allow_input_fusion!r}"
                )
            allow_input_fusion = tuple(bool(b) for b in allow_input_fusion)
        values = dict(
            dimension_semantics=sems,
            allow_input_fusion=allow_input_fusion,
            vmem_limit_bytes=vmem_limit_bytes,
            collective_id=collective_id,
            has_side_effects=has_side_effects,
            flags=None if flags is None else tuple(sorted(dict(flags).items())),
            internal_scratch_in_bytes=internal_scratch_in_bytes,
            serialization_format=serialization_format,
            disable_bounds_checks=disable_bounds_checks,
            disable_semaphore_checks=disable_semaphore_checks,
            skip_device_barrier=skip_device_barrier,
            allow_collective_id_without_custom_barrier=allow_collective_id_without_custom_barrier,
            shape_invariant_numerics=shape_invariant_numerics,
            use_tc_tiling_on_sc=use_tc_tiling_on_sc,
            needs_layout_passes=needs_layout_passes,
            fuse_transposed_lhs_in_matmul=fuse_transposed_lhs_in_matmul,
            opt_level=opt_level,
        )
        for k, v in values.items():
            object.__setattr__(self, k, v)
        plb.check_bool_fields("pltpu.CompilerParams", self, _BOOL_FIELDS)

    def replace(self, **changes) -> CompilerParams:
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if kw["flags"] is not None:
            kw["flags"] = dict(kw["flags"])
        kw.update(changes)
        return CompilerParams(**kw)

    def batched(self) -> CompilerParams:
        """For jax.vmap of the kernel: the new leading grid axis is parallel."""
        if self.dimension_semantics is None:
            return self
        return self.replace(dimension_semantics=(PARALLEL, *self.dimension_semantics))


class MemorySpace(enum.Enum):
    """TPU memory spaces. ``VMEM`` (vector memory, the default for blocks),
    ``SMEM`` (scalar memory: scalars of up to 32 bits), ``HBM`` (device memory: whole
    arrays, reached by DMAs), ``SEMAPHORE``, ``VMEM_SHARED``, ``CMEM``."""

    VMEM = "vmem"
    VMEM_SHARED = "vmem_shared"
    SMEM = "smem"
    CMEM = "cmem"
    SEMAPHORE = "semaphore_mem"
    HBM = "hbm"

    @property
    def memory_kind(self) -> str:
        return "device"

    @property
    def whole_array(self) -> bool:
        """Operands in this space are not blocked: the kernel gets the whole array."""
        return self in (MemorySpace.HBM, MemorySpace.SEMAPHORE, MemorySpace.VMEM_SHARED)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return self.name

    def __call__(self, shape: Sequence[int], dtype: Any) -> pl.MemoryRef:
        if self is MemorySpace.SEMAPHORE:
            raise TypeError(
                "pltpu.SEMAPHORE((...)) is not a scratch shape; use pltpu.SemaphoreType.REGULAR((...))"
            )
        symbolic = plb.symbolic_shape_message(shape, f"pltpu.{self.name}(...)")
        if symbolic is not None:
            raise ValueError(f"at {plb.user_source()}: {symbolic}")
        return pl.MemoryRef(tuple(int(d) for d in shape), np.dtype(dtype), self)

    def like(self, x: Any) -> pl.MemoryRef:
        return self(x.shape, x.dtype)


plb.register_memory_space_type(MemorySpace)

#: Vector memory: the default for blocks; ``VMEM(shape, dtype)`` makes a scratch buffer.
VMEM = MemorySpace.VMEM
#: Scalar memory (scalars of up to 32 bits): scalar prefetch and ``SMEM(shape, dtype)`` scratch.
SMEM = MemorySpace.SMEM
#: High-bandwidth memory: the whole array, reached by DMA.
HBM = MemorySpace.HBM
#: Common memory of TPU v4 and v5p.
CMEM = MemorySpace.CMEM
#: VMEM shared by a SparseCore's subcores.
VMEM_SHARED = MemorySpace.VMEM_SHARED
#: Semaphore memory: ``SemaphoreType`` scratch lives there.
SEMAPHORE = MemorySpace.SEMAPHORE


class SemaphoreType(enum.Enum):
    """Semaphore scratch: ``SemaphoreType.DMA((2,))`` is two DMA semaphores;
    the bare member is one (``scratch_shapes=[pltpu.SemaphoreType.REGULAR]``)."""

    REGULAR = "regular"
    DMA = "dma"
    BARRIER = "barrier"

    @property
    def kind(self) -> plb.SemaphoreKind:
        return plb.SemaphoreKind(self.value)

    def __call__(self, shape: Sequence[int] = ()) -> pl.MemoryRef:
        if isinstance(shape, int):
            shape = (shape,)
        return pl.MemoryRef(tuple(shape), np.dtype(np.int32), plb.SemaphoreSpace(self.kind))

    def get_ref_aval(self):
        return self(()).get_ref_aval()

    def get_array_aval(self):
        return jax.core.ShapedArray((), jnp.int32)


class dma_semaphore:  # noqa: N801  (JAX's name for the DMA semaphore dtype)
    """The element type of DMA semaphores (``pltpu.SemaphoreType.DMA``)."""


@dataclasses.dataclass(frozen=True, init=False)
class PrefetchScalarGridSpec(pl.GridSpec):
    """A ``GridSpec`` whose first ``num_scalar_prefetch`` operands are copied
    to SMEM before the grid starts and passed, as Refs, to every index map
    (after the grid indices) and to the kernel (before the other Refs)."""

    num_scalar_prefetch: int = 0

    def __init__(
        self,
        num_scalar_prefetch: int,
        grid=(),
        in_specs=pl.no_block_spec,
        out_specs=pl.no_block_spec,
        scratch_shapes=(),
    ):
        if not isinstance(num_scalar_prefetch, int) or num_scalar_prefetch < 0:
            raise ValueError(
                f"PrefetchScalarGridSpec: num_scalar_prefetch must be a non-negative int, got {num_scalar_prefetch!r}"
            )
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "in_specs", in_specs)
        object.__setattr__(self, "out_specs", out_specs)
        object.__setattr__(self, "scratch_shapes", tuple(scratch_shapes))
        object.__setattr__(self, "num_scalar_prefetch", num_scalar_prefetch)

    def scalar_prefetch_ref_aval(self, aval):
        return pl.MemoryRef(tuple(aval.shape), aval.dtype, SMEM).get_ref_aval()


def _default_num_cores() -> int:
    try:
        return int(getattr(jax.devices()[0], "num_cores", 1) or 1)
    except Exception:
        return 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorCoreMesh(pl.Mesh):
    """The TensorCores of one chip, as a mesh with one axis ``axis_name``:
    ``pl.kernel(body, mesh=pltpu.TensorCoreMesh(axis_name="core"))`` runs
    ``body`` once per core; ``lax.axis_index("core")`` is the core's index."""

    axis_name: str
    num_cores: int = dataclasses.field(default_factory=_default_num_cores)

    @property
    def core_type(self) -> CoreType:
        return CoreType.TC

    @property
    def shape(self) -> dict[str, int]:
        return {self.axis_name: self.num_cores}

    @property
    def default_memory_space(self):
        return pl.ANY

    def compiler_params(self, given):
        if given is None:
            given = CompilerParams()
        if not isinstance(given, CompilerParams):
            raise TypeError(f"pl.kernel over a TensorCoreMesh takes pltpu.CompilerParams, got {given!r}")
        # "parallel", as JAX's lowering marks a TensorCoreMesh's axis: a chip with two
        # TensorCores (v4, v5p) splits it over them, a one-core chip (v5e, v6e) runs both
        # steps in turn. Mosaic refuses "core_parallel" with more steps than the chip's cores.
        # The mesh's cores travel with the params: TPU interpret mode runs one core per
        # mesh point, as JAX's does (its pallas_call carries the mesh itself).
        return MeshCompilerParams.of(given.replace(dimension_semantics=(PARALLEL,)), self.num_cores)


@dataclasses.dataclass(frozen=True, init=False)
class MeshCompilerParams(CompilerParams):
    """The ``CompilerParams`` of a body over a ``TensorCoreMesh`` (``pl.kernel``,
    ``pl.core_map``): the user's, plus the mesh's number of cores, which TPU
    interpret mode runs (``num_cores_or_threads``); the lowering reads the user's fields."""

    mesh_num_cores: int = 1

    @classmethod
    def of(cls, params: CompilerParams, mesh_num_cores: int) -> MeshCompilerParams:
        out = cls.__new__(cls)
        for f in dataclasses.fields(CompilerParams):
            object.__setattr__(out, f.name, getattr(params, f.name))
        object.__setattr__(out, "mesh_num_cores", int(mesh_num_cores))
        return out

    def replace(self, **changes) -> MeshCompilerParams:
        cores = changes.pop("mesh_num_cores", self.mesh_num_cores)
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(CompilerParams)}
        if kw["flags"] is not None:
            kw["flags"] = dict(kw["flags"])
        kw.update(changes)
        return MeshCompilerParams.of(CompilerParams(**kw), cores)


def create_tensorcore_mesh(axis_name: str, num_cores: int | None = None) -> TensorCoreMesh:
    """Deprecated: use ``pltpu.TensorCoreMesh(axis_name=...)``. JAX 0.12.1 removed this name;
    ours keeps it (with a ``DeprecationWarning`` on access) for code written for JAX 0.10,
    which has no ``TensorCoreMesh``."""
    return TensorCoreMesh(axis_name=axis_name, num_cores=num_cores or _default_num_cores())
