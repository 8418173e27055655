"""Helpers shared by the kernels of ``pallas_gpu.ops``."""

from __future__ import annotations

from typing import Any

from pallas_gpu._src.core import CompilerParams


def call_params(interpret: Any, num_warps: int, num_stages: int | None) -> dict[str, Any]:
    """``pallas_call`` keyword arguments: ``interpret`` when asked for
    (``True`` for pallas-core's interpreter, ``plgpu.InterpretParams()`` for
    Triton's), else ``CompilerParams(num_warps, num_stages)``."""
    if interpret is not False and interpret is not None:
        return {"interpret": interpret}
    kw = {"num_warps": num_warps}
    if num_stages is not None:
        kw["num_stages"] = num_stages
    return {"compiler_params": CompilerParams(**kw)}


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
