"""Generated source -> compiled kernel images, cached in memory and on disk.

``triton.jit`` reads a kernel's source with ``inspect``, so the generated
module is written to a file in the cache directory and imported from there.
The same text is imported twice: once as a ``JITFunction`` for
``triton.compile`` and once as an ``InterpretedFunction`` for the CPU.

Compiled kernels are kept by ``compiled_configs`` in our own cache: one file
per (generated source, compute capability, compile options, Triton version,
pallas-gpu version) holding the cubin and its launch fields. A process that
finds a kernel there neither imports the generated module nor calls
``triton.compile``. ``PALLAS_GPU_CACHE_DIR`` moves the cache (default
``~/.cache/pallas_gpu``); ``PALLAS_GPU_DISABLE_CACHE=1`` turns the disk cache
off (compiled kernels are then kept only in memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import jax_kernel_runtime as jkr
from pallas_gpu._src.core import CompilerParams
from pallas_gpu._src.lowering import LoweredKernel

_lock = threading.Lock()
_modules: dict[tuple[str, bool], Any] = {}
_configs: dict[str, Any] = {}  # cache key -> jax_kernel_runtime.KernelConfig

# Bump when the meaning of a cached entry changes (compile flags we pass,
# the file layout), so stale entries are never read.
_CACHE_FORMAT = 1
_MAGIC = b"pallas_gpu kernel v1\n"

# Largest dynamic shared memory per block (the opt-in limit), by compute
# capability. Unknown capabilities are not checked here; the runtime reports
# a failed launch instead.
SHARED_MEMORY_LIMITS = {
    70: 98304, 72: 98304, 75: 65536,
    80: 166912, 86: 101376, 87: 166912, 89: 101376,
    90: 232448, 100: 232448, 103: 232448, 120: 101376, 121: 101376,
}  # fmt: skip

# fp8 types Triton needs sm_89+ for (cvt with .e4m3x2/.e5m2x2).
_FP8_TYPES = ("fp8e4nv", "fp8e5", "float8e4nv", "float8e5")


def cache_dir() -> str:
    d = os.environ.get("PALLAS_GPU_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pallas_gpu"
    )
    os.makedirs(os.path.join(d, "src"), exist_ok=True)
    return d


def disk_cache_enabled() -> bool:
    return os.environ.get("PALLAS_GPU_DISABLE_CACHE", "").lower() in ("", "0", "false", "no")


def write_atomically(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that readers see all of it or nothing."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# Triton is imported on first use, not with this module: a process whose
# kernels are all in the disk cache never imports it.


@contextlib.contextmanager
def _interpret_knob(on: bool):
    import triton

    knobs = triton.knobs.runtime
    old = knobs.interpret
    knobs.interpret = on
    try:
        yield
    finally:
        knobs.interpret = old


def load_kernel(lk: LoweredKernel, interpret: bool):
    """The ``@triton.jit`` function of ``lk`` (interpreted or compilable)."""
    source = lk.module_source(interpret)
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    key = (digest, interpret)
    with _lock:
        if key in _modules:
            return getattr(_modules[key], lk.name)
        mod_name = f"pallas_gpu_kernel_{lk.name}_{digest}_{'interp' if interpret else 'gpu'}"
        path = os.path.join(cache_dir(), "src", mod_name + ".py")
        if not os.path.exists(path):
            write_atomically(path, source.encode())
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        with _interpret_knob(interpret):
            spec.loader.exec_module(module)
        _modules[key] = module
        return getattr(module, lk.name)


@functools.lru_cache(maxsize=512)
def compile_kernel(lk: LoweredKernel, cc: int, options: tuple[tuple[str, Any], ...]):
    """``triton.compile`` for ``sm_{cc}``; works without a GPU."""
    jkr.prepare_triton()  # waits for the background import started by ``import pallas_gpu``
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load_kernel(lk, interpret=False)
    names = fn.arg_names
    signature = dict(zip(names, lk.signature))
    # Pointers from XLA are at least 16-byte aligned (the runtime checks it).
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    src = ASTSource(fn=fn, signature=signature, constexprs={}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(options))


# ---------------------------------------------------------------------------
# Our cache of compiled kernels


@functools.cache
def _versions() -> str:
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return f"triton {version('triton')}; pallas-gpu {version('pallas-gpu')}; format {_CACHE_FORMAT}"


def cache_key(lk: LoweredKernel, cc: int, options: tuple[tuple[str, Any], ...]) -> str:
    """sha256 of everything the compiled image depends on."""
    parts = [lk.module_source(interpret=False), repr(lk.signature), f"sm_{cc}", repr(options), _versions()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _entry_path(key: str) -> str:
    return os.path.join(cache_dir(), "kernels", key[:2], key + ".bin")


def _encode(cfg) -> bytes:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "image"}
    fields["image_sha256"] = hashlib.sha256(cfg.image).hexdigest()
    return _MAGIC + json.dumps(fields, sort_keys=True).encode() + b"\n" + cfg.image


def _decode(data: bytes):
    """The ``KernelConfig`` in a cache file, or None if it is not a whole,
    valid entry (a truncated or foreign file is a cache miss)."""

    if not data.startswith(_MAGIC):
        return None
    header, sep, image = data[len(_MAGIC) :].partition(b"\n")
    if not sep:
        return None
    try:
        fields = json.loads(header)
        if fields.pop("image_sha256") != hashlib.sha256(image).hexdigest():
            return None
        for name in ("block_dims", "cluster_dims"):
            fields[name] = tuple(fields[name])
        return jkr.KernelConfig(image=image, **fields)
    except (ValueError, TypeError, KeyError):
        return None


def compiled_config(lk: LoweredKernel, cc: int, cp: CompilerParams):
    """The ``jax_kernel_runtime.KernelConfig`` of ``lk`` for ``sm_{cc}`` and
    ``cp``: from memory, else from the disk cache, else ``triton.compile``."""

    options = tuple(sorted(cp.compile_options().items()))
    key = cache_key(lk, cc, options)
    with _lock:
        cfg = _configs.get(key)
    if cfg is not None:
        return cfg
    use_disk = disk_cache_enabled()
    path = _entry_path(key) if use_disk else ""
    if use_disk:
        try:
            with open(path, "rb") as f:
                cfg = _decode(f.read())
        except OSError:
            cfg = None
    if cfg is None:
        cfg = jkr.config_from_triton(compile_kernel(lk, cc, options))
        if use_disk:
            with contextlib.suppress(OSError):  # a read-only home only loses the disk cache
                write_atomically(path, _encode(cfg))
    with _lock:
        _configs[key] = cfg
    return cfg


def clear_memory_cache() -> None:
    """Forgets the compiled kernels held in memory (the disk cache stays)."""
    with _lock:
        _configs.clear()
        _modules.clear()
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
    limit = SHARED_MEMORY_LIMITS.get(cc)
    kept, too_big = [], []
    for cp in cps:
        cfg = compiled_config(lk, cc, cp)
        if limit is not None and cfg.shared_memory_bytes > limit:
            too_big.append((cp, cfg.shared_memory_bytes))
            continue
        kept.append((cp, cfg))
    if not kept:
        which = "; ".join(f"{_describe(cp)} needs {n} bytes" for cp, n in too_big)
        raise ValueError(
            f"{where}: the kernel needs more shared memory per block than sm_{cc} allows "
            f"({limit} bytes = {limit // 1024} KiB): {which}. Use smaller block shapes or "
            "fewer num_stages (each pipelining stage keeps a copy of the loaded blocks)."
        )
    return kept
