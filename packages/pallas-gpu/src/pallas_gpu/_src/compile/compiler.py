"""Generated source -> compiled kernel images, through the shared Triton
layer of jax_kernel_runtime (one module loader, one deterministic
``triton.compile``, one disk cache for pallas-gpu and jax-triton).

Compiled kernels are cached in memory and on disk: one file per (generated
source, compute capability, compile options, Triton and package versions)
holding the cubin and its launch fields. A process that finds a kernel there
neither imports the generated module nor calls ``triton.compile``.
``PALLAS_GPU_CACHE_DIR`` moves the cache (default ``~/.cache/pallas_gpu``);
``PALLAS_GPU_DISABLE_CACHE=1`` turns the disk cache off (compiled kernels are
then kept only in memory). A cache directory that cannot be written warns
once and the process runs uncached.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from typing import Any, cast

import jax_kernel_runtime as jkr
from jax_kernel_runtime import triton as jkr_triton
from pallas_gpu._src.language.core import CompilerParams
from pallas_gpu._src.lowering.lowering import LoweredKernel

# Bump when the meaning of a cached entry changes (compile flags we pass,
# the file layout), so stale entries are never read.
_CACHE_FORMAT = 3  # 3: cubins name their source files relative to sys.path

# Largest dynamic shared memory per block (the opt-in limit), by compute
# capability: the shared Triton layer's table. Unknown capabilities are not
# checked here; the runtime reports a failed launch instead.
SHARED_MEMORY_LIMITS = jkr_triton.SHARED_MEMORY_LIMITS

# fp8 types Triton needs sm_89+ for (cvt with .e4m3x2/.e5m2x2).
_FP8_TYPES = ("fp8e4nv", "fp8e5", "float8e4nv", "float8e5")


def cache_dir() -> str:
    return os.environ.get("PALLAS_GPU_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pallas_gpu"
    )


def disk_cache_enabled() -> bool:
    return os.environ.get("PALLAS_GPU_DISABLE_CACHE", "").lower() in ("", "0", "false", "no")


DISK = jkr_triton.DiskCache("pallas_gpu (PALLAS_GPU_CACHE_DIR)", cache_dir, disk_cache_enabled)


def load_kernel(lk: LoweredKernel, interpret: bool):
    """The ``@triton.jit`` function of ``lk`` (the interpreter's variant
    imports our numpy libdevice instead of Triton's)."""
    prefix = f"pallas_gpu_kernel_{lk.name}_{'interp' if interpret else 'gpu'}"
    module = jkr_triton.load_source(prefix, lk.module_source(interpret), DISK)
    return getattr(module, lk.name)


@functools.lru_cache(maxsize=512)
def compile_kernel(lk: LoweredKernel, cc: int, options: tuple[tuple[str, Any], ...]):
    """``triton.compile`` for ``sm_{cc}``; works without a GPU."""
    jkr.prepare_triton()  # waits for the background import started by ``import pallas_gpu``
    from triton.compiler import ASTSource

    fn = load_kernel(lk, interpret=False)
    names = fn.arg_names
    signature = dict(zip(names, lk.signature))
    # Pointers from XLA are at least 16-byte aligned (the runtime checks it).
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    src = ASTSource(fn=fn, signature=signature, constexprs={}, attrs=attrs)
    return jkr_triton.compile_triton(src, cc, dict(options))


@functools.cache
def toolchain_versions() -> str:
    return f"{jkr_triton.triton_versions('jax-pallas-gpu')}; format {_CACHE_FORMAT}"


def cache_key(lk: LoweredKernel, cc: int, options: tuple[tuple[str, Any], ...]) -> str:
    """sha256 of everything the compiled image depends on."""
    parts = [
        lk.module_source(interpret=False),
        repr(lk.signature),
        f"sm_{cc}",
        repr(options),
        toolchain_versions(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def compiled_config(lk: LoweredKernel, cc: int, cp: CompilerParams):
    """The ``jax_kernel_runtime.KernelConfig`` of ``lk`` for ``sm_{cc}`` and
    ``cp``: from memory, else from the disk cache, else ``triton.compile``."""
    options = tuple(sorted(cp.compile_options().items()))
    key = cache_key(lk, cc, options)
    return jkr_triton.cached_config(
        key, lambda: jkr.config_from_triton(compile_kernel(lk, cc, options)), DISK
    )


def clear_memory_cache() -> None:
    """Forgets the compiled kernels held in memory (the disk cache stays)."""
    jkr_triton.clear_configs()
    jkr_triton.clear_modules()
    compile_kernel.cache_clear()


# ---------------------------------------------------------------------------
# Checks against the target device


def _describe(cp: CompilerParams) -> str:
    fields = ", ".join(f"{k}={v!r}" for k, v in cp.compile_options().items())
    return f"plgpu.CompilerParams({fields})"


def check_fp8(lk: LoweredKernel, cc: int, where: str) -> None:
    if cc >= 89:
        return
    text = " ".join(lk.signature) + lk.body
    used = sorted({t for t in _FP8_TYPES if t in text})
    if used:
        raise ValueError(
            f"{where}: the kernel uses fp8 (float8_e4m3fn / float8_e5m2: Triton types "
            f"{', '.join(used)}), which needs a GPU with compute capability 8.9 or newer "
            f"(Ada, Hopper), but this GPU is sm_{cc}. Cast to bfloat16 or float16 outside "
            "the kernel, or run on an sm_89+ GPU."
        )


def check_warp_specialize(lk: LoweredKernel, cc: int, where: str) -> None:
    """Warp-specialized loops compile for Blackwell (sm_100+) only. Triton 3.6
    does specialize Hopper loops (``num_warps=4``), but on the H200 a plain
    Triton flash-attention forward so specialized gave wrong causal results
    (max error 0.87) and NaN with 128x64 tiles, and its data-partition pass
    aborts on the reshaped 4-D TMA blocks this backend loads
    (``benchmarks/hopper_warp_specialize.py``)."""
    if cc < 100 and dict(lk.source_options).get("warp_specialize"):
        import triton  # compiling needs it anyway

        raise ValueError(
            f"{where}: plgpu.CompilerParams(warp_specialize=True) needs a Blackwell GPU (sm_100 or "
            f"newer), but the kernel is being compiled for sm_{cc}: Triton {triton.__version__}'s "
            "warp specialization for earlier GPUs miscompiled kernels on the H200 (wrong results, "
            "NaN) or aborts in its data-partition pass. Drop warp_specialize on this GPU; "
            "use_tma=True and num_stages pipeline the loads on Hopper."
        )


def compiled_configs(
    lk: LoweredKernel, cc: int, cps: Sequence[CompilerParams], where: str = ""
) -> list[tuple[CompilerParams, Any]]:
    """``(compiler params, KernelConfig)`` for each of ``cps`` that fits on
    ``sm_{cc}``; works without a GPU.

    With one ``CompilerParams``, a kernel needing more shared memory than the
    device has raises; with several (autotuning) such configs are dropped and
    only all of them failing raises. ``where`` names the kernel in errors.
    """
    where = where or f"pallas_call '{lk.name}'"
    check_fp8(lk, cc, where)
    check_warp_specialize(lk, cc, where)
    limit = SHARED_MEMORY_LIMITS.get(cc)
    kept, too_big = [], []
    for cp in cps:
        cfg = compiled_config(lk, cc, cp)
        if limit is not None and cfg.shared_memory_bytes > limit:
            too_big.append((cp, cfg.shared_memory_bytes))
            continue
        kept.append((cp, cfg))
    if not kept:
        # Nothing kept means some config was too big, which needs a known limit.
        limit = cast(int, limit)
        which = "; ".join(f"{_describe(cp)} needs {n} bytes" for cp, n in too_big)
        raise ValueError(
            f"{where}: the kernel needs more shared memory per block than sm_{cc} allows "
            f"({limit} bytes = {limit // 1024} KiB): {which}. Use smaller block shapes or "
            "fewer num_stages (each pipelining stage keeps a copy of the loaded blocks)."
        )
    return kept
