"""Generated Triton source -> module, and ``triton.compile`` with
deterministic output, for pallas-gpu and jax-triton.

Deterministic: two fresh compiles of the same kernel give the same cubin, so
the lowered HLO (which holds it) is the same on every machine and in every
cache directory. Two things made them differ: the path of the generated
source (it was a file in the cache directory) and the mtime and size of the
source file, which ``ptxas`` reads for the debug line table. Generated
modules therefore get a fixed file name with no directory (their text is
served from ``linecache``, not read from disk), and the PTX handed to
``ptxas`` states a timestamp (1) and size (0) for every ``.file`` (with 0,
or none, ``ptxas`` reads the file's), so line info stays (names and line
numbers) without anything of the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import inspect
import linecache
import os
import re
import shutil
import sys
import tempfile
import threading
import types
import warnings
from typing import Any

from jax_kernel_runtime.triton import _versions
from jax_kernel_runtime.triton._cache import DiskCache
from jax_kernel_runtime.triton._prepare import prepare_triton
from jax_kernel_runtime.triton._state import lock as interpreter_lock

#: Largest dynamic shared memory per block (the opt-in limit) in bytes, by
#: compute capability (CUDA programming guide), for pallas-gpu and jax-triton alike.
SHARED_MEMORY_LIMITS = {
    70: 98304, 72: 98304, 75: 65536,
    80: 166912, 86: 101376, 87: 166912, 89: 101376,
    90: 232448, 100: 232448, 103: 232448, 120: 101376, 121: 101376,
}  # fmt: skip

_modules: dict[str, types.ModuleType] = {}
_modules_lock = threading.Lock()


def load_source(prefix: str, source: str, disk: DiskCache | None = None) -> types.ModuleType:
    """Executes generated ``source`` as module ``<prefix>_<digest>``.

    The text comes from memory; a copy goes to ``<disk>/src/`` for people to
    read, checked against its digest on every load (an edited or truncated
    copy is rewritten, never run).
    """
    digest = hashlib.sha256(source.encode()).hexdigest()
    name = f"{prefix}_{digest[:20]}"
    with _modules_lock:
        module = _modules.get(name)
        if module is not None:
            return module
        if disk is not None:
            data = disk.read("src", name + ".py")
            if data is None or hashlib.sha256(data).hexdigest() != digest:
                disk.write(source.encode(), "src", name + ".py")
        filename = name + ".py"  # no directory: it would end up in the cubin
        lines = source.splitlines(keepends=True)
        linecache.cache[filename] = (len(source), None, lines, filename)  # mtime None: never evicted
        module = types.ModuleType(name)
        module.__file__ = filename
        # linecache reloads from it if cleared; it needs only get_source, typeshed wants load_module.
        module.__loader__ = _SourceLoader(source)  # type: ignore[assignment]
        sys.modules[name] = module  # so inspect finds the loader if linecache is cleared
        exec(compile(source, filename, "exec"), module.__dict__)
        _modules[name] = module
        return module


class _SourceLoader:
    def __init__(self, source: str):
        self.source = source

    def get_source(self, name: str) -> str:
        return self.source


def clear_modules() -> None:
    """Forgets the modules ``load_source`` made (the copies on disk stay)."""
    with _modules_lock:
        _modules.clear()


# ---------------------------------------------------------------------------
# triton.compile with a stable PTX

_FILE_DIRECTIVE = re.compile(r'^([ \t]*\.file[ \t]+\d+[ \t]+)"((?:[^"\\]|\\.)*)"[ \t]*$', re.MULTILINE)
# Keeps our cubins apart in Triton's cache; "2": source paths relative to their sys.path entry.
_STABLE_ENV = ("JAX_KERNEL_RUNTIME_STABLE_PTX", "2")
_hook_state = threading.local()
_installed_hook: Any = None
_hook_lock = threading.Lock()


def stable_ptx(ptx: str) -> str:
    """``ptx`` with timestamp 1 and size 0 on each ``.file`` directive that has
    none, so ``ptxas`` does not read them from the file system (it does for
    timestamp 0), and each such file named relative to the ``sys.path`` entry
    it lies under (``triton/language/standard.py``, not the path of a
    site-packages), so the cubin does not depend on where packages are
    installed."""
    roots = _path_roots()

    def stable(m: re.Match) -> str:
        return f'{m.group(1)}"{relative_source_path(m.group(2), roots)}", 1, 0'

    return _FILE_DIRECTIVE.sub(stable, ptx)


def _path_roots() -> list[str]:
    """The absolute ``sys.path`` entries, longest first."""
    roots = {os.path.normpath(p) for p in sys.path if p and os.path.isabs(p)}
    return sorted(roots, key=len, reverse=True)


def relative_source_path(path: str, roots: list[str]) -> str:
    """``path`` relative to the longest of ``roots`` it lies under, else unchanged."""
    for root in roots:
        prefix = root.rstrip(os.sep) + os.sep
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def _install_stage_hook() -> None:
    """Chains our hook in front of whatever ``add_stages_inspection_hook``
    holds; it acts only inside ``compile_triton`` (a thread-local flag)."""
    global _installed_hook
    from triton import knobs

    with _hook_lock:
        current = knobs.runtime.add_stages_inspection_hook
        if current is not None and current is _installed_hook:
            return
        previous = current

        def on_stages(backend, stages, options, language, capability):
            if getattr(_hook_state, "active", False) and "ptx" in stages:
                make_ptx = stages["ptx"]
                stages["ptx"] = lambda src, metadata: stable_ptx(make_ptx(src, metadata))

        hook = _versions.stages_hook(previous, on_stages)

        knobs.runtime.add_stages_inspection_hook = hook
        _installed_hook = hook


def compile_triton(src: Any, cc: int, options: dict[str, Any]) -> Any:
    """``triton.compile(src)`` for ``sm_{cc}`` (works without a GPU), with a
    stable PTX. Returns Triton's ``CompiledKernel``."""
    prepare_triton()  # waits for the background import started by the packages
    import triton
    from triton.backends.compiler import GPUTarget

    _install_stage_hook()
    kwargs: dict[str, Any] = {}
    if "_env_vars" in inspect.signature(triton.compile).parameters:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        kwargs["_env_vars"] = {**get_cache_invalidating_env_vars(), _STABLE_ENV[0]: _STABLE_ENV[1]}
    # While a kernel is interpreted (in a host-callback thread) triton.language
    # is patched with the interpreter's functions: compile with the real one.
    with interpreter_lock, _usable_triton_cache_dir():
        _hook_state.active = True
        try:
            return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(options), **kwargs)
        finally:
            _hook_state.active = False


def compile_gluon(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], cc: int, options: dict[str, Any]
) -> Any:
    """``compile_triton`` of a ``@gluon.jit`` kernel (Triton's lower-level
    language, ``triton.experimental.gluon``) with ``signature`` (the runtime
    parameters' Triton types) and ``constexprs``. Pointer parameters are
    specialized 16-byte aligned, as XLA's buffers are (the runtime checks it)."""
    prepare_triton()
    from triton.experimental.gluon._runtime import GluonASTSource  # no public name in Triton 3.6

    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    full = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    return compile_triton(GluonASTSource(fn, full, constexprs, attrs), cc, options)


_cache_dir_checked: dict[str, str | None] = {}  # Triton's cache dir -> replacement (None: usable)


@contextlib.contextmanager
def _usable_triton_cache_dir():
    """Triton's cache directory while compiling, or, if it cannot be written
    (``TRITON_CACHE_DIR`` read-only or through a file: ``triton.compile``
    would raise), a private temporary one, with one warning per directory."""
    from triton import knobs

    configured = knobs.cache.dir
    if configured not in _cache_dir_checked:
        try:
            os.makedirs(configured, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=configured, prefix=".jkr-probe-")
            os.close(fd)
            os.unlink(probe)
            _cache_dir_checked[configured] = None
        except OSError as e:
            replacement = tempfile.mkdtemp(prefix="jax-kernel-runtime-triton-cache-")
            atexit.register(shutil.rmtree, replacement, ignore_errors=True)
            _cache_dir_checked[configured] = replacement
            warnings.warn(
                f"Triton's cache directory {configured!r} (TRITON_CACHE_DIR) cannot be written "
                f"({type(e).__name__}: {e.strerror or e}); compiling with a temporary one for this "
                "process. Point TRITON_CACHE_DIR at a writable directory to keep compiled kernels.",
                RuntimeWarning,
                stacklevel=4,
            )
    replacement = _cache_dir_checked[configured]
    if replacement is None:
        yield
        return
    knobs.cache.dir = replacement
    try:
        yield
    finally:
        knobs.cache.dir = configured


def triton_versions(*dists: str) -> str:
    """``"triton 3.6.0; <dist> <version>..."``: part of every cache key."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return "; ".join(f"{d} {version(d)}" for d in ("triton", "jax-kernel-runtime", *dists))
