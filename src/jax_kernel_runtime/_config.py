"""Launch descriptors: one compiled configuration and the parameter layout.

These are plain frozen dataclasses so that they hash, compare and pickle, and
so that encoding them as XLA FFI attributes is deterministic: the same
descriptor always gives byte-identical HLO (no pointers, no timestamps).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import cast

import numpy as np

# Mirrors kScratchAlign in cpp/kernel_runtime.cc.
SCRATCH_ALIGN = 256
# Largest grid CUDA accepts per axis.
GRID_LIMITS = (2**31 - 1, 65535, 65535)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compiled configuration of a kernel.

    A call may carry several (autotuning): they share the parameter layout and
    grid; the runtime times each on its first execution on a device and keeps
    the fastest.

    Attributes:
      image: the kernel image (cubin bytes).
      function: the symbol of the kernel inside ``image``.
      block_dims: threads per block (x, y, z).
      shared_memory_bytes: dynamic shared memory per block; above 48 KB the
        runtime opts in through the function attribute.
      cluster_dims: CTAs per cluster (x, y, z). The launch grid is
        ``grid * cluster_dims``, matching Triton's ``num_ctas``.
      global_scratch_bytes: Triton global scratch per program (CTA).
      profile_scratch_bytes: Triton profile scratch per program (CTA).
      triton_scratch_params: append Triton's two trailing scratch pointer
        parameters (global, profile) after the declared ones.
      cooperative: launch as a cooperative grid.
      pdl: allow programmatic dependent launch.
    """

    image: bytes
    function: str
    block_dims: tuple[int, int, int] = (128, 1, 1)
    shared_memory_bytes: int = 0
    cluster_dims: tuple[int, int, int] = (1, 1, 1)
    global_scratch_bytes: int = 0
    profile_scratch_bytes: int = 0
    triton_scratch_params: bool = False
    cooperative: bool = False
    pdl: bool = False

    def __post_init__(self):
        if not isinstance(self.image, bytes) or not self.image:
            raise ValueError("KernelConfig.image must be non-empty bytes (a cubin)")
        if not isinstance(self.function, str) or not self.function:
            raise ValueError(f"KernelConfig.function must be the kernel's symbol name, got {self.function!r}")
        for field in ("shared_memory_bytes", "global_scratch_bytes", "profile_scratch_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"KernelConfig.{field} must be an int >= 0, got {value!r}")
        for field in ("block_dims", "cluster_dims"):
            dims = getattr(self, field)
            if len(dims) != 3 or any(int(d) < 1 for d in dims):
                raise ValueError(f"KernelConfig.{field} must be 3 positive ints, got {dims}")

    def scratch_bytes(self, grid: tuple[int, int, int]) -> int:
        """Bytes of scratch this config needs for ``grid`` (0 if none)."""
        ctas = int(np.prod(grid)) * int(np.prod(self.cluster_dims))
        return _align(ctas * self.global_scratch_bytes) + _align(ctas * self.profile_scratch_bytes)

    def launch_fields(self) -> np.ndarray:
        """The 12 int64 launch fields, in the order cpp/ffi_handlers.cc reads."""
        return np.array(
            [
                *self.block_dims,
                self.shared_memory_bytes,
                *self.cluster_dims,
                self.global_scratch_bytes,
                self.profile_scratch_bytes,
                int(self.triton_scratch_params),
                int(self.cooperative),
                int(self.pdl),
            ],
            dtype=np.int64,
        )


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A kernel parameter bound to an operand: element ``operand`` of ``inputs ++ outputs``.

    ``alignment`` is what the kernel was specialized for (Triton's
    ``tt.divisibility`` of 16); the runtime checks it at every launch.
    """

    operand: int
    alignment: int = 16

    def __post_init__(self):
        for field in ("operand", "alignment"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(
                    f"Buffer.{field} must be an int, got {value!r} of type {type(value).__name__}"
                )
        if self.operand < 0:
            raise ValueError(
                f"Buffer.operand is {self.operand}; it indexes the operands "
                f"(inputs, then outputs) and must be >= 0"
            )
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ValueError(f"Buffer.alignment is {self.alignment}; it must be a power of 2 (1: unchecked)")


# Scalar dtypes the runtime can pass, by Triton's names; value = struct code.
_SCALAR_FORMATS = {
    "i1": "<B", "u1": "<B", "i8": "<b", "u8": "<B", "i16": "<h", "u16": "<H",
    "i32": "<i", "u32": "<I", "i64": "<q", "u64": "<Q",
    "fp16": "<e", "fp32": "<f", "fp64": "<d",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar kernel parameter whose value is baked into the call."""

    dtype: str
    value: int | float | bool

    def __post_init__(self):
        if self.dtype not in _SCALAR_FORMATS and self.dtype != "bf16":
            raise TypeError(
                f"unsupported scalar parameter dtype {self.dtype!r}; supported: "
                f"{sorted([*_SCALAR_FORMATS, 'bf16'])}"
            )
        value = self.value
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, (bool, int, float)):
            raise TypeError(
                f"Scalar({self.dtype!r}, {value!r}): the value must be a Python or "
                f"numpy bool/int/float, got {type(self.value).__name__}"
            )
        if self.dtype in ("bf16", "fp16", "fp32", "fp64"):
            try:
                self._raw(float(value))
            except OverflowError:
                raise ValueError(
                    f"Scalar({self.dtype!r}, {value!r}): the value overflows {self.dtype}"
                ) from None
            return
        if isinstance(value, float):
            raise TypeError(f"Scalar({self.dtype!r}, {value!r}): an integer dtype needs an int value")
        lo, hi = (0, 1) if self.dtype in ("i1", "u1") else _int_range(self.dtype)
        if not lo <= value <= hi:
            raise ValueError(
                f"Scalar({self.dtype!r}, {value!r}): the value is out of range [{lo}, {hi}] of {self.dtype}"
            )

    def _raw(self, value) -> bytes:
        if self.dtype == "bf16":  # fp32 rounded to nearest even, as the GPU converts
            bits = struct.unpack("<I", struct.pack("<f", value))[0]
            if value == value:  # not NaN
                bits += 0x7FFF + ((bits >> 16) & 1)
            if bits >> 16 in (0x7F80, 0xFF80) and abs(value) != float("inf"):
                raise OverflowError("bf16")
            return struct.pack("<H", (bits >> 16) & 0xFFFF)
        fmt = _SCALAR_FORMATS[self.dtype]
        return struct.pack(fmt, value)

    def encode(self) -> tuple[int, int]:
        """(byte width, value bits as a signed int64)."""
        is_float = self.dtype in ("bf16", "fp16", "fp32", "fp64")
        raw = self._raw(float(self.value) if is_float else int(self.value))
        bits = int.from_bytes(raw.ljust(8, b"\0"), "little", signed=True)
        return len(raw), bits


def _int_range(dtype: str) -> tuple[int, int]:
    bits = int(dtype[1:])
    return (0, 2**bits - 1) if dtype[0] == "u" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


#: One kernel parameter: a ``Buffer`` or a ``Scalar``.
Param = Buffer | Scalar


def _align(n: int) -> int:
    return (n + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN


def normalize_grid(grid, name: str) -> tuple[int, int, int]:
    """Checks a grid (int or 1-3 ints) and pads it to 3 axes."""
    if isinstance(grid, (int, np.integer)) and not isinstance(grid, bool):
        grid = (grid,)
    if not isinstance(grid, (tuple, list)) or not 1 <= len(grid) <= 3:
        raise TypeError(f"grid of kernel {name!r} must be an int or a tuple of 1-3 ints, got {grid!r}")
    out = []
    for axis, g in enumerate(grid):
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
            raise TypeError(
                f"grid of kernel {name!r}: entry {axis} is {g!r} of type "
                f"{type(g).__name__}; grid entries must be Python ints (static)"
            )
        if not 1 <= int(g) <= GRID_LIMITS[axis]:
            raise ValueError(
                f"grid of kernel {name!r}: entry {axis} is {int(g)}, but CUDA "
                f"needs 1 <= grid[{axis}] <= {GRID_LIMITS[axis]}"
            )
        out.append(int(g))
    return cast(tuple[int, int, int], tuple(out + [1] * (3 - len(out))))


def encode_attributes(
    *,
    name: str,
    configs: Sequence[KernelConfig],
    grids: Sequence[tuple[int, int, int]],
    params: Sequence[Param],
    zeroed_outputs: Sequence[int],
    aliased_inputs: Sequence[int],
    scratch_output: bool,
    tune_key: str,
) -> dict[str, object]:
    """The FFI attribute dictionary read by cpp/ffi_handlers.cc."""
    kinds, values, aligns = [], [], []
    for p in params:
        if isinstance(p, Buffer):
            kinds.append(0)
            values.append(p.operand)
            aligns.append(p.alignment)
        else:
            size, bits = p.encode()
            kinds.append(size)
            values.append(bits)
            aligns.append(1)
    attrs: dict[str, object] = {
        "name": name,
        "param_kinds": np.array(kinds, np.int64),
        "param_values": np.array(values, np.int64),
        "param_align": np.array(aligns, np.int64),
        "num_configs": np.int64(len(configs)),
        "scratch_output": np.int64(int(scratch_output)),
    }
    # Empty arrays are left out rather than encoded as zero-length attributes.
    if zeroed_outputs:
        attrs["zeroed_outputs"] = np.array(sorted(zeroed_outputs), np.int64)
    if aliased_inputs:
        attrs["aliased_inputs"] = np.array(sorted(aliased_inputs), np.int64)
    if tune_key:
        attrs["tune_key"] = tune_key
    # One shared grid unless configs differ (autotuned block sizes).
    if all(g == grids[0] for g in grids):
        attrs["grid"] = np.array(grids[0], np.int64)
    else:
        for i, g in enumerate(grids):
            attrs[f"grid_{i}"] = np.array(g, np.int64)
    for i, cfg in enumerate(configs):
        attrs[f"image_{i}"] = np.frombuffer(cfg.image, np.uint8)
        attrs[f"function_{i}"] = cfg.function
        attrs[f"launch_{i}"] = cfg.launch_fields()
    return attrs
