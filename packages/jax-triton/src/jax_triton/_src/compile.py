"""Compiling a bound kernel with the pinned Triton for a CUDA target,
through jax_kernel_runtime's shared ``compile_triton`` (deterministic cubins:
the same kernel gives the same image, hence the same HLO, on every machine).

Two cache levels: an in-process dict (so re-lowering is free) and Triton's own
on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), which we
use and never delete.
"""

from __future__ import annotations

import dataclasses
import threading

import jax_kernel_runtime as jkr
from jax_kernel_runtime import triton as jkr_triton
from jax_triton._src.signature import BoundCall
from jax_triton._src.triton_compat import ASTSource, JITFunction


class TritonCompilationError(RuntimeError):
    """A kernel failed to compile; the message carries Triton's diagnostic."""


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    enable_fp_fusion: bool = True
    debug: bool = False
    extra: tuple = ()  # (name, value) pairs of other triton.Config options

    def as_dict(self) -> dict:
        d = dict(
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            num_ctas=self.num_ctas,
            enable_fp_fusion=self.enable_fp_fusion,
            debug=self.debug,
        )
        d.update(dict(self.extra))
        return d


_cache: dict = {}
_cache_lock = threading.Lock()


def compile_kernel(
    fn: JITFunction,
    bound: BoundCall,
    options: CompileOptions,
    compute_capability: int,
    debug_print: bool = False,
):
    """Returns ``(KernelConfig, CompiledKernel)`` for one configuration."""
    key = (fn.cache_key, bound.key(), options, compute_capability)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    src = ASTSource(fn, bound.signature(), constexprs=bound.constexprs(), attrs=bound.attrs())
    try:
        compiled = jkr_triton.compile_triton(src, compute_capability, options.as_dict())
    except Exception as e:  # Triton raises CompilationError and plain errors
        raise TritonCompilationError(
            f"Triton failed to compile kernel {bound.kernel_name!r} for "
            f"sm_{compute_capability} with {options.as_dict()}:\n{e}"
        ) from e
    config = jkr.config_from_triton(compiled)
    if debug_print:
        print(
            f"[jax_triton] compiled {bound.kernel_name} for sm_{compute_capability}: "
            f"signature={bound.signature()} constexprs={bound.constexprs()} "
            f"options={options.as_dict()} shared={config.shared_memory_bytes} "
            f"block={config.block_dims}\n{compiled.asm.get('ttir', '')}"
        )
    with _cache_lock:
        _cache[key] = (config, compiled)
    return config, compiled
