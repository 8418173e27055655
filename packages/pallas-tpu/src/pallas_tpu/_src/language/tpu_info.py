"""TPU hardware facts: ``get_tpu_info()`` and friends, with JAX's names.

On a machine with a TPU, ``get_tpu_info()`` describes the attached chip (or
the chip of an abstract device set by ``jax.sharding.use_abstract_mesh``,
as in JAX). Elsewhere it describes the *modeled* chip: TPU interpret mode
runs kernels for one TPU generation, chosen by

* ``with modeled_chip(ChipVersion.TPU_V6E): ...`` (the interpret engine sets
  it from its parameters), or ``set_modeled_chip(...)`` for the process;
* otherwise ``DEFAULT_MODELED_CHIP``: **TPU v5e** (single TensorCore, 128
  MiB VMEM, (8, 128) tiles), the common single-core development TPU.

JAX's ``get_tpu_info()`` raises on a CPU; ours answers for the modeled chip,
so that kernels that size their blocks from ``get_tpu_info()`` run in
interpret mode unchanged. ``is_tpu_device()`` still says whether a real TPU
is attached.

All figures are per TensorCore (multiply by ``num_cores`` for a megacore
device), the same figures JAX publishes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pallas_tpu._src import compat


class ChipVersionBase:
    if TYPE_CHECKING:
        # What ``TpuInfo`` and its readers ask of a chip (``ChipVersion`` has them).
        @property
        def value(self) -> str: ...
        @property
        def is_lite(self) -> bool: ...
        @property
        def num_physical_tensor_cores_per_chip(self) -> int: ...


class ChipVersion(ChipVersionBase, enum.Enum):
    """A TPU chip generation."""

    TPU_V2 = "v2"
    TPU_V3 = "v3"
    TPU_V4I = "v4i"
    TPU_V4 = "v4"
    TPU_V5E = "v5e"
    TPU_V5P = "v5p"
    TPU_V6E = "v6e"
    TPU_7 = "7"
    TPU_7X = "7x"
    TPU_8I = "8i"
    TPU_8T = "8t"

    def __str__(self) -> str:
        return self.value

    @property
    def num_physical_tensor_cores_per_chip(self) -> int:
        return _CHIPS[self].physical_cores

    @property
    def supports_megacore(self) -> bool:
        return self in (ChipVersion.TPU_V4, ChipVersion.TPU_V5P)

    @property
    def is_lite(self) -> bool:
        return self in (ChipVersion.TPU_V4I, ChipVersion.TPU_V5E, ChipVersion.TPU_V6E)


_DEVICE_KINDS = {
    "TPU v2": ChipVersion.TPU_V2,
    "TPU v3": ChipVersion.TPU_V3,
    "TPU v4": ChipVersion.TPU_V4,
    "TPU v4 lite": ChipVersion.TPU_V4I,
    "TPU v5e": ChipVersion.TPU_V5E,
    "TPU v5 lite": ChipVersion.TPU_V5E,
    "TPU v5": ChipVersion.TPU_V5P,
    "TPU v5p": ChipVersion.TPU_V5P,
    "TPU v6e": ChipVersion.TPU_V6E,
    "TPU v6 lite": ChipVersion.TPU_V6E,
    "TPU7": ChipVersion.TPU_7,
    "TPU7x": ChipVersion.TPU_7X,
    "TPU8i": ChipVersion.TPU_8I,
    "TPU8t": ChipVersion.TPU_8T,
}


def chip_version_from_device_kind(device_kind: str) -> ChipVersion | None:
    """The chip of a JAX ``device_kind`` string (``"TPU v5 lite"``), or None."""
    return _DEVICE_KINDS.get(device_kind)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseCoreInfo:
    """SparseCore facts (per SparseCore)."""

    num_cores: int
    num_subcores: int
    num_lanes: int
    vmem_capacity_bytes: int
    dma_granule_size_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuInfo:
    """TPU hardware facts, per TensorCore."""

    chip_version: ChipVersionBase
    generation: int
    num_cores: int
    num_lanes: int
    num_sublanes: int
    mxu_column_size: int
    num_mxus: int  # per core
    num_accumulators: int  # (num_sublanes, mxu_column_size) 32-bit buffers per MXU
    vmem_capacity_bytes: int
    cmem_capacity_bytes: int
    smem_capacity_bytes: int
    hbm_capacity_bytes: int
    mem_bw_bytes_per_second: int
    bf16_ops_per_second: int
    int8_ops_per_second: int
    fp8_ops_per_second: int
    int4_ops_per_second: int
    sparse_core: SparseCoreInfo | None = None

    @property
    def is_lite(self) -> bool:
        return self.chip_version.is_lite

    @property
    def is_split_chip(self) -> bool:
        """A multi-core chip used one TensorCore per device."""
        return self.num_cores == 1 and self.chip_version.num_physical_tensor_cores_per_chip > 1

    @property
    def is_megacore(self) -> bool:
        """The chip's TensorCores form one device."""
        return self.num_cores > 1

    def is_matmul_supported(self, lhs_dtype, rhs_dtype) -> bool:
        """Whether the MXU takes these operand dtypes without a cast."""
        lhs, rhs = np.dtype(lhs_dtype), np.dtype(rhs_dtype)
        for lhs_ok, rhs_ok in _MATMUL_DTYPES.get(self.chip_version, ()):
            if lhs in _dtypes(lhs_ok) and rhs in _dtypes(rhs_ok):
                return True
        return False

    def get_sublane_tiling(self, dtype) -> int:
        """The second-minor tile size XLA uses for ``dtype`` (a heuristic: it
        depends on XLA flags before TPU7x)."""
        bits = jax.dtypes.itemsize_bits(np.dtype(dtype))
        if self.generation < 7 and bits in (16, 32):
            return self.num_sublanes
        if self.generation <= 8:
            return self.num_sublanes * (32 // bits)
        raise NotImplementedError(f"TPU generation {self.generation} is not supported")


def _dtypes(names: str) -> set[np.dtype]:
    return {np.dtype(getattr(jax.numpy, n)) for n in names.split()}


_FP = "float32 bfloat16"
_F8_OLD = "float8_e5m2 float8_e4m3b11fnuz"
_F8 = "float8_e5m2 float8_e4m3fn"
_MATMUL_DTYPES: dict[Any, tuple[tuple[str, str], ...]] = {
    ChipVersion.TPU_V2: (("float32", "float32"),),
    ChipVersion.TPU_V3: (("float32", "float32"),),
    ChipVersion.TPU_V4I: ((_FP, _FP + " int8"),),
    ChipVersion.TPU_V4: ((_FP, _FP + " int8"),),
    **dict.fromkeys(
        (ChipVersion.TPU_V5E, ChipVersion.TPU_V5P, ChipVersion.TPU_V6E),
        (
            (f"{_FP} {_F8_OLD}", f"{_FP} {_F8_OLD}"),
            ("uint8 int8", "uint8 int8"),
            ("uint4 int4", "uint4 int4"),
        ),
    ),
    **dict.fromkeys((ChipVersion.TPU_7, ChipVersion.TPU_7X), ((_FP, f"{_FP} {_F8}"), (_F8, _F8))),
    ChipVersion.TPU_8I: ((_FP, f"{_FP} {_F8} uint4 int4"), (_F8, f"{_F8} uint4 int4")),
    ChipVersion.TPU_8T: ((_FP, f"{_FP} int4"), (f"{_FP} {_F8}", f"{_F8} int4")),
}


@dataclasses.dataclass(frozen=True)
class _Chip:
    """Facts of one chip. ``*_chip`` figures are for the whole chip and are
    split evenly between its physical TensorCores."""

    generation: int
    physical_cores: int
    num_sublanes: int
    mxu_column_size: int
    num_mxus: int
    num_accumulators: int
    vmem_mib: int
    cmem_chip: float
    smem_kib: int
    hbm_chip: float
    bw_chip: float
    bf16_chip: float
    int8_chip: float
    fp8_chip: float
    int4_chip: float
    sparse_core: SparseCoreInfo | None = None


def _sc(cores, subcores, lanes, vmem_kib, granule):
    return SparseCoreInfo(
        num_cores=cores,
        num_subcores=subcores,
        num_lanes=lanes,
        vmem_capacity_bytes=vmem_kib * 1024,
        dma_granule_size_bytes=granule,
    )


# Published per-chip figures (the ones JAX's tpu_info uses). 0 = not available. TPU7 and TPU7x
# (its product name) share one set.
_TPU7 = _Chip(
    7,
    2,
    8,
    256,
    2,
    128,
    64,
    0,
    1024,
    206_000_000_000,
    7.40e12,
    2.31e15,
    0,
    4.60e15,
    0,
    _sc(2, 16, 16, 512, 32),
)


_CHIPS: dict[ChipVersion, _Chip] = {
    ChipVersion.TPU_V2: _Chip(2, 2, 8, 128, 1, 0, 16, 0, 16, 16_000_000_000, 7.16e11, 4.6e13, 0, 0, 0),
    ChipVersion.TPU_V3: _Chip(3, 2, 8, 128, 2, 0, 16, 0, 16, 34_400_000_000, 8.25e11, 1.40e14, 0, 0, 0),
    ChipVersion.TPU_V4I: _Chip(
        4, 1, 8, 128, 4, 0, 16, 134_000_000, 1024, 8_590_000_000, 6.14e11, 1.37e14, 0, 0, 0
    ),
    ChipVersion.TPU_V4: _Chip(
        4, 2, 8, 128, 4, 0, 16, 134_000_000, 1024, 34_400_000_000, 1.23e12, 2.75e14, 0, 0, 0
    ),
    ChipVersion.TPU_V5E: _Chip(
        5, 1, 8, 128, 4, 0, 128, 0, 1024, 17_200_000_000, 8.20e11, 1.97e14, 3.94e14, 0, 7.88e14
    ),
    ChipVersion.TPU_V5P: _Chip(
        5,
        2,
        8,
        128,
        4,
        0,
        64,
        0,
        1024,
        103_000_000_000,
        2.46e12,
        4.59e14,
        9.18e14,
        0,
        1.84e15,
        _sc(4, 16, 8, 512, 32),
    ),
    ChipVersion.TPU_V6E: _Chip(
        6,
        1,
        8,
        256,
        2,
        0,
        128,
        0,
        1024,
        34_400_000_000,
        1.64e12,
        9.20e14,
        1.84e15,
        9.20e14,
        3.68e15,
        _sc(2, 16, 8, 256, 32),
    ),
    ChipVersion.TPU_7: _TPU7,
    ChipVersion.TPU_7X: _TPU7,  # the same chip under its product name
    ChipVersion.TPU_8I: _Chip(
        8,
        2,
        8,
        256,
        2,
        256,
        192,
        0,
        1024,
        309_000_000_000,
        8.60e12,
        1.101e15,
        0,
        8.808e15,
        0,
        _sc(1, 4, 16, 512, 64),
    ),
    ChipVersion.TPU_8T: _Chip(
        8,
        1,
        16,
        256,
        2,
        256,
        128,
        0,
        1024,
        231_000_000_000,
        6.4e12,
        0.9961e15,
        0.9961e15,
        5.9769e15,
        11.9538e15,
        _sc(2, 16, 16, 256, 64),
    ),
}


@functools.cache
def _tpu_info(chip_version: ChipVersion, num_cores: int) -> TpuInfo:
    c = _CHIPS[chip_version]

    def per_core(x) -> int:
        return int(x // c.physical_cores)

    return TpuInfo(
        chip_version=chip_version,
        generation=c.generation,
        num_cores=num_cores,
        num_lanes=128,
        num_sublanes=c.num_sublanes,
        mxu_column_size=c.mxu_column_size,
        num_mxus=c.num_mxus,
        num_accumulators=c.num_accumulators,
        vmem_capacity_bytes=c.vmem_mib * 1024 * 1024,
        cmem_capacity_bytes=per_core(c.cmem_chip),
        smem_capacity_bytes=c.smem_kib * 1024,
        hbm_capacity_bytes=per_core(c.hbm_chip),
        mem_bw_bytes_per_second=per_core(c.bw_chip),
        bf16_ops_per_second=per_core(c.bf16_chip),
        int8_ops_per_second=per_core(c.int8_chip),
        fp8_ops_per_second=per_core(c.fp8_chip),
        int4_ops_per_second=per_core(c.int4_chip),
        sparse_core=c.sparse_core,
    )


def as_chip(chip_version) -> ChipVersion:
    if isinstance(chip_version, ChipVersion):
        return chip_version
    try:
        return ChipVersion(str(chip_version).lower().removeprefix("tpu").removeprefix("_").strip())
    except ValueError:
        known = ", ".join(v.value for v in ChipVersion)
        raise ValueError(f"unknown TPU chip version {chip_version!r}; known: {known}") from None


def get_tpu_info_for_chip(chip_version: ChipVersion, num_tensor_cores_per_logical_device: int) -> TpuInfo:
    """The facts of ``chip_version`` with that many TensorCores per device.

    Args:
      chip_version: the chip (a ``ChipVersion`` or its value, e.g. ``"v5e"``).
      num_tensor_cores_per_logical_device: 2 for a megacore device (v4, v5p),
        otherwise 1.

    Returns:
      A ``TpuInfo`` (per-TensorCore figures).
    """
    chip = as_chip(chip_version)
    if num_tensor_cores_per_logical_device != 1 and not chip.supports_megacore:
        raise ValueError(
            f"TPU {chip} has no megacore mode: num_tensor_cores_per_logical_device must be 1, "
            f"got {num_tensor_cores_per_logical_device}"
        )
    if num_tensor_cores_per_logical_device not in (1, 2):
        raise ValueError(
            f"num_tensor_cores_per_logical_device must be 1 or 2, got {num_tensor_cores_per_logical_device}"
        )
    return _tpu_info(chip, num_tensor_cores_per_logical_device)


# ------------------------------------------------------------- the modeled chip

DEFAULT_MODELED_CHIP = ChipVersion.TPU_V5E
_modeled: contextvars.ContextVar[tuple[ChipVersion, int] | None] = contextvars.ContextVar(
    "pallas_tpu_modeled_chip", default=None
)
_process_modeled: tuple[ChipVersion, int] | None = None


def _default_cores(chip: ChipVersion) -> int:
    return 2 if chip.supports_megacore else 1


def set_modeled_chip(chip_version: ChipVersion | str | None, num_cores: int | None = None) -> None:
    """Sets, for the whole process, the chip that interpret mode models when
    no TPU is attached (None restores ``DEFAULT_MODELED_CHIP``)."""
    global _process_modeled
    if chip_version is None:
        _process_modeled = None
        return
    chip = as_chip(chip_version)
    cores = _default_cores(chip) if num_cores is None else num_cores
    get_tpu_info_for_chip(chip, cores)  # validate
    _process_modeled = (chip, cores)


@contextlib.contextmanager
def modeled_chip(chip_version: ChipVersion | str, num_cores: int | None = None) -> Iterator[TpuInfo]:
    """Within the block, ``get_tpu_info()`` describes ``chip_version`` on a
    machine with no TPU (megacore chips default to 2 cores per device).

    Yields:
      The modeled chip's ``TpuInfo``.
    """
    chip = as_chip(chip_version)
    cores = _default_cores(chip) if num_cores is None else num_cores
    info = get_tpu_info_for_chip(chip, cores)
    token = _modeled.set((chip, cores))
    try:
        yield info
    finally:
        _modeled.reset(token)


def get_modeled_chip() -> tuple[ChipVersion, int]:
    """(chip, TensorCores per device) modeled when no TPU is attached."""
    current = _modeled.get() or _process_modeled
    if current is None:
        return DEFAULT_MODELED_CHIP, _default_cores(DEFAULT_MODELED_CHIP)
    return current


# ------------------------------------------------------------------ the device

# Device kinds that are not TPUs JAX knows, with their facts (as in JAX).
registry: dict[str, Callable[[], TpuInfo]] = {}


# The TPU a lowering compiles for (``target_device``): ahead of every other answer.
_target: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "pallas_tpu_target_device", default=None
)


@contextlib.contextmanager
def target_device(device_kind: str, num_cores: int = 1) -> Iterator[None]:
    """Within the block, ``get_tpu_info()`` describes the device of ``device_kind``
    (with ``num_cores`` TensorCores): the lowering sets it to the TPU it compiles for
    (a compile-only v6e's facts, not those of the chip attached or modeled)."""
    token = _target.set((device_kind, num_cores))
    try:
        yield
    finally:
        _target.reset(token)


def get_device_kind() -> str:
    """The ``device_kind`` of the device a lowering targets (``target_device``), the
    abstract device (``use_abstract_mesh``) or the default device."""
    if (target := _target.get()) is not None:
        return target[0]
    if (dev := compat.abstract_device()) is not None:
        return dev.device_kind
    return compat.default_device().device_kind


def get_num_device_cores() -> int:
    if (target := _target.get()) is not None:
        return target[1]
    if (dev := compat.abstract_device()) is not None:
        return dev.num_cores
    return getattr(compat.default_device(), "num_cores", 1)


def is_tpu_device() -> bool:
    """Whether the default (or abstract) device is a TPU; False when
    interpret mode only models one."""
    return chip_version_from_device_kind(get_device_kind()) is not None


def get_tpu_info(chip_version: ChipVersion | str | None = None) -> TpuInfo:
    """The facts of the TPU that kernels run on.

    Args:
      chip_version: ask about this chip instead (default TensorCores per
        device). None: the attached TPU, or the abstract device of
        ``jax.sharding.use_abstract_mesh``, or a ``registry`` entry for the
        device kind, or else the modeled chip (``modeled_chip``; TPU v5e by
        default).

    Returns:
      A ``TpuInfo`` (per-TensorCore figures).
    """
    if chip_version is not None:
        chip = as_chip(chip_version)
        return get_tpu_info_for_chip(chip, _default_cores(chip))
    kind = get_device_kind()
    attached = chip_version_from_device_kind(kind)
    if attached is not None:
        return _tpu_info(attached, get_num_device_cores())
    if kind in registry:
        return registry[kind]()
    return get_tpu_info_for_chip(*get_modeled_chip())


# --------------------------------------------------------------------- tiling


class Tiling(enum.Enum):
    """Native tile shapes: ``COMPACT`` (TensorCore (sublanes, lanes)) and
    ``SPARSE_CORE`` (SparseCore lanes)."""

    COMPACT = enum.auto()
    SPARSE_CORE = enum.auto()

    @property
    def shape(self) -> tuple[int, ...]:
        info = get_tpu_info()
        if self is Tiling.COMPACT:
            return (info.num_sublanes, info.num_lanes)
        return (info.sparse_core.num_lanes,) if info.sparse_core else (8,)


def infer_tiling(ty, tiling: Tiling | None = None) -> tuple[int | None, ...]:
    """The memory tiling of an array type: 1 for leading dims, the native
    tile (scaled for packed dtypes) for the last one or two.

    Args:
      ty: anything with ``shape`` (and ``dtype``; without it the tiling is
        unknown: all None).
      tiling: ``Tiling.COMPACT`` (default) or ``Tiling.SPARSE_CORE``.

    Returns:
      One tile size per dimension.
    """
    shape = tuple(ty.shape)
    if not hasattr(ty, "dtype"):
        return (None,) * len(shape)
    dtype = np.dtype(ty.dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    if bits > 32:
        raise ValueError(f"TPUs have no {dtype} arrays (at most 32 bits per element)")
    packing = 32 // max(bits, 4) if bits < 8 else 4 // dtype.itemsize
    tiling = Tiling.COMPACT if tiling is None else tiling
    tile = tiling.shape
    generation = get_tpu_info().generation
    if tiling is Tiling.COMPACT and len(shape) == 1:
        return ((1 + int(generation < 4)) * packing * tile[1],)
    if len(shape) < len(tile):
        raise ValueError(f"shape {shape} needs at least {len(tile)} dimensions for {tiling}")
    lead = (1,) * (len(shape) - len(tile))
    if tiling is Tiling.SPARSE_CORE:
        return (*lead, tile[0] * packing)
    factor = (1 + int(generation < 4)) * packing
    while factor < min(shape[-2], tile[0]):
        factor *= 2
    return (*lead, factor, tile[1])
