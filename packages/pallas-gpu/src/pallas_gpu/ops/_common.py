"""Helpers shared by the kernels of ``pallas_gpu.ops``."""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
from typing import Any

import jax

from pallas import next_power_of_2 as next_power_of_2  # re-exported for the ops
from pallas_gpu._src.language.core import CompilerParams

# Triton releases (major.minor) the Gluon kernels (``_attention_sm90_kernel``,
# ``_matmul_sm90_kernel``) were run and checked on, on the H200: Gluon's API
# still changes between releases.
GLUON_VALIDATED_TRITON = ("3.6",)


def interpreted(interpret: Any) -> bool:
    """Whether an op's ``interpret`` argument asks for an interpreter
    (``True`` or ``plgpu.InterpretParams()``) rather than the GPU."""
    return interpret is not False and interpret is not None


def call_params(interpret: Any, num_warps: int, num_stages: int | None) -> dict[str, Any]:
    """``pallas_call`` keyword arguments: ``interpret`` when asked for
    (``True`` for pallas-core's interpreter, ``plgpu.InterpretParams()`` for
    Triton's), else ``CompilerParams(num_warps, num_stages)``."""
    if interpreted(interpret):
        return {"interpret": interpret}
    kw: dict[str, Any] = {"num_warps": num_warps}
    if num_stages is not None:
        kw["num_stages"] = num_stages
    return {"compiler_params": CompilerParams(**kw)}


def compute_capability() -> int | None:
    """The compute capability of JAX's first GPU as an int (90 for sm_90),
    ``PALLAS_GPU_COMPUTE_CAPABILITY`` when set (compiling for a GPU from a
    CPU machine), None without a GPU."""
    forced = os.environ.get("PALLAS_GPU_COMPUTE_CAPABILITY", "")
    if forced:
        try:
            return int(forced.replace(".", "").removeprefix("sm_"))
        except ValueError:
            return None
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    cc = getattr(devices[0], "compute_capability", None) if devices else None
    if cc is None:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major) * 10 + int(minor)


def pipeline_stages(bytes_per_stage: int, most: int, cc: int | None) -> int:
    """The most software-pipelining stages, up to ``most``, whose buffers of
    ``bytes_per_stage`` each fit in the shared memory of a GPU of compute
    capability ``cc`` (sm_90's when None: no GPU; the smallest known when the
    table lacks ``cc``) with 16 KiB to spare for the kernel's other buffers;
    at least 1."""
    from jax_kernel_runtime.triton import SHARED_MEMORY_LIMITS

    limit = (
        SHARED_MEMORY_LIMITS[90]
        if cc is None
        else SHARED_MEMORY_LIMITS.get(cc, min(SHARED_MEMORY_LIMITS.values()))
    )
    budget = limit - 16 * 1024
    return max(1, min(most, budget // max(1, bytes_per_stage)))


def multiprocessor_count() -> int:
    """Multiprocessors of JAX's first GPU; 132 (H100/H200 SXM) when compiling
    without one (``PALLAS_GPU_COMPUTE_CAPABILITY``)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    count = getattr(devices[0], "core_count", None) if devices else None
    return int(count) if count else 132


@functools.cache
def triton_release() -> str:
    """The installed Triton's major.minor ("" if none)."""
    from importlib import metadata

    try:
        return ".".join(metadata.version("triton").split(".")[:2])
    except metadata.PackageNotFoundError:
        return ""


@functools.cache
def _module_digest(module: str) -> str:
    return hashlib.sha256(inspect.getsource(importlib.import_module(module)).encode()).hexdigest()


def gluon_kernel_config(module: str, kernel: str, signature: dict[str, str], constexprs: dict[str, Any]):
    """The ``jax_kernel_runtime.KernelConfig`` of the ``@gluon.jit`` function
    ``kernel`` of ``module`` (imported on first use: it imports Triton),
    compiled for sm_90 with 4 warps (its first partition) for ``signature``
    and ``constexprs``: from pallas-gpu's disk cache (``PALLAS_GPU_CACHE_DIR``;
    keyed by the module's source, the constexprs and the Triton and package
    versions), else compiled by the shared Triton layer."""
    import jax_kernel_runtime as jkr
    from jax_kernel_runtime import triton as jkr_triton
    from pallas_gpu._src.compile import compiler

    parts = [
        kernel,
        repr(sorted(signature.items())),
        repr(sorted(constexprs.items())),
        _module_digest(module),
    ]
    key = hashlib.sha256("\0".join([*parts, compiler.toolchain_versions()]).encode()).hexdigest()

    def compile_config():
        fn = getattr(importlib.import_module(module), kernel)
        compiled = jkr_triton.compile_gluon(fn, signature, constexprs, 90, {"num_warps": 4})
        return jkr.config_from_triton(compiled)

    return jkr_triton.cached_config(key, compile_config, compiler.DISK)
