"""GPU facts (``plgpu.GpuInfo``, ``plgpu.get_gpu_info``...): JAX 0.12's
Triton-backend names for the GPU a kernel is compiled for, and the custom call
target kernels lower to.

The device is the abstract mesh's when one names a device kind other than the
local device's (compiling ahead of time for another GPU), else JAX's default
device. A known GPU (``GpuVersion``) gets its architecture from the table
below (NVIDIA's published compute capabilities); another NVIDIA GPU present
on the machine gets the one the device reports; an AMD GPU (a ``gfx...``
kind) gets its kind as the architecture name and compute capability 0.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re

import jax

import jax_kernel_runtime as jkr

#: The XLA custom call a kernel compiled for a GPU becomes (the runtime's launcher, through the
#: public XLA FFI; JAX's Triton backend names its own, ``__gpu$xla.gpu.triton``): what
#: ``jax.export.DisabledSafetyCheck.custom_call`` takes, or what to look for in lowered HLO.
CUSTOM_CALL_TARGET_NAME: str = jkr.TARGET_NAME


class GpuVersion(enum.Enum):
    """GPU models, valued by the device kind JAX reports for them."""

    A10 = "NVIDIA A10"
    A30 = "NVIDIA A30"
    A100 = "NVIDIA A100"
    H100 = "NVIDIA H100"
    H200 = "NVIDIA H200"
    GH200 = "NVIDIA GH200"
    B200 = "NVIDIA B200"
    GB200 = "NVIDIA GB200"
    B300 = "NVIDIA B300"
    GB300 = "NVIDIA GB300"
    GB10 = "NVIDIA GB10"
    L4 = "NVIDIA L4"
    L40 = "NVIDIA L40"
    T4 = "Tesla T4"
    RTX_4090 = "NVIDIA GeForce RTX 4090"
    RTX_PRO_4500 = "NVIDIA RTX PRO 4500"
    RTX_PRO_5000 = "NVIDIA RTX PRO 5000"
    RTX_PRO_6000 = "NVIDIA RTX PRO 6000"
    THOR = "NVIDIA Thor"
    VR200 = "NVIDIA VR200"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuInfo:
    """What a kernel needs to know of a GPU.

    Attributes:
      gpu_version: the model, or None for a GPU outside ``GpuVersion`` (an AMD GPU,
        a newer NVIDIA one).
      arch_name: the architecture: ``"9.0"`` for an H100 (compute capability
        major.minor), the ``gfx...`` name of an AMD GPU.
      compute_capability: major * 10 + minor (90 for an H100); 0 for an AMD GPU.
    """

    gpu_version: GpuVersion | None
    arch_name: str
    compute_capability: int


# GpuVersion -> compute capability (https://developer.nvidia.com/cuda/gpus).
_COMPUTE_CAPABILITY = {
    GpuVersion.T4: 75,
    GpuVersion.A100: 80,
    GpuVersion.A30: 80,
    GpuVersion.A10: 86,
    GpuVersion.L4: 89,
    GpuVersion.L40: 89,
    GpuVersion.RTX_4090: 89,
    GpuVersion.H100: 90,
    GpuVersion.H200: 90,
    GpuVersion.GH200: 90,
    GpuVersion.B200: 100,
    GpuVersion.GB200: 100,
    GpuVersion.B300: 103,
    GpuVersion.GB300: 103,
    GpuVersion.VR200: 107,
    GpuVersion.THOR: 110,
    GpuVersion.RTX_PRO_4500: 120,
    GpuVersion.RTX_PRO_5000: 120,
    GpuVersion.RTX_PRO_6000: 120,
    GpuVersion.GB10: 121,
}

# The longest names first, so "NVIDIA GH200" is not read as "NVIDIA H200".
_KIND = re.compile(
    r"\b(" + "|".join(re.escape(v.value) for v in sorted(GpuVersion, key=lambda v: -len(v.value))) + r")\b"
)
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _default_device():
    dev = jax.config.jax_default_device
    if isinstance(dev, str):
        return jax.devices(dev)[0]
    return dev if dev is not None else jax.devices()[0]


def _abstract_device():
    return jax.sharding.get_abstract_mesh().abstract_device


def _platform() -> str:
    abstract = _abstract_device()
    platform = abstract.platform if abstract is not None else _default_device().platform
    return "gpu" if platform in _GPU_PLATFORMS else platform


def _device_kind() -> str:
    device, abstract = _default_device(), _abstract_device()
    if abstract is not None and (
        abstract.device_kind.startswith("gfx") or abstract.device_kind != device.device_kind
    ):
        return abstract.device_kind  # compiling ahead of time for another GPU
    cc = getattr(device, "compute_capability", None)
    if isinstance(cc, str) and cc.startswith("gfx"):
        return cc
    return device.device_kind


def is_gpu_device() -> bool:
    """Whether the device kernels are compiled for is a GPU (CUDA or ROCm)."""
    return _platform() == "gpu"


@functools.cache
def get_gpu_info_from_version(gpu_version: GpuVersion) -> GpuInfo:
    """The facts of a GPU model.

    Args:
      gpu_version: a ``GpuVersion``.
    """
    if not isinstance(gpu_version, GpuVersion):
        raise TypeError(f"plgpu.get_gpu_info_from_version: expected a plgpu.GpuVersion, got {gpu_version!r}")
    cc = _COMPUTE_CAPABILITY[gpu_version]
    return GpuInfo(gpu_version=gpu_version, arch_name=f"{cc // 10}.{cc % 10}", compute_capability=cc)


def get_gpu_info() -> GpuInfo:
    """The facts of the GPU kernels are compiled for (see the module docstring)."""
    kind = _device_kind()
    if m := _KIND.search(kind):
        return get_gpu_info_from_version(GpuVersion(m.group(1)))
    if _platform() == "gpu" and kind.startswith("gfx"):
        return GpuInfo(gpu_version=None, arch_name=kind, compute_capability=0)
    if _platform() == "gpu" and kind.startswith("NVIDIA"):
        device = _default_device()
        if device.device_kind != kind:
            raise ValueError(
                f"plgpu.get_gpu_info: cannot tell the architecture of the abstract GPU {kind!r}: it is "
                f"not a plgpu.GpuVersion and not the local device ({device.device_kind!r})"
            )
        arch = str(device.compute_capability)
        return GpuInfo(gpu_version=None, arch_name=arch, compute_capability=int(arch.replace(".", "")))
    raise ValueError(
        f"plgpu.get_gpu_info: unsupported GPU device kind {kind!r} (platform {_platform()!r}); "
        "on a machine without a GPU, name one with jax.sharding.use_abstract_mesh(...AbstractDevice("
        "device_kind='NVIDIA H100', platform='gpu')) or use plgpu.get_gpu_info_from_version"
    )
