"""Turning a ``triton.compile`` result into a ``KernelConfig``, and making
a process's first ``triton.compile`` cheaper (``prepare_triton``).

Kept in its own module so that importing jax_kernel_runtime never imports
Triton: only callers that compile Triton kernels pay for it.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import os
import sys
import tempfile
import threading
from typing import Any

from jax_kernel_runtime._config import KernelConfig


def config_from_triton(compiled: Any) -> KernelConfig:
    """Describes a ``triton.compile(...)`` result (a ``CompiledKernel``).

    Reads only the compiled artifacts and their metadata (the cubin, the
    function name, warps, CTAs per cluster, shared memory and Triton's scratch
    sizes), so it works on machines with no GPU.
    """
    md = compiled.metadata
    asm = compiled.asm
    if "cubin" not in asm:
        raise ValueError(
            f"Triton kernel {md.name!r} was compiled for {md.target!r}; "
            "jax-kernel-runtime launches CUDA cubins only"
        )
    warp_size = getattr(md, "warp_size", 32)
    num_ctas = int(getattr(md, "num_ctas", 1))
    return KernelConfig(
        image=bytes(asm["cubin"]),
        function=md.name,
        block_dims=(int(md.num_warps) * int(warp_size), 1, 1),
        shared_memory_bytes=int(md.shared),
        cluster_dims=(num_ctas, 1, 1),
        global_scratch_bytes=int(getattr(md, "global_scratch_size", 0) or 0),
        profile_scratch_bytes=int(getattr(md, "profile_scratch_size", 0) or 0),
        # Triton >= 3.3 always appends the two scratch pointers to the kernel.
        triton_scratch_params=True,
        cooperative=bool(getattr(md, "launch_cooperative_grid", False)),
        pdl=bool(getattr(md, "launch_pdl", False)),
    )


# ---------------------------------------------------------------------------
# Making a process's first ``triton.compile`` cheaper
#
# A fresh process pays three one-off costs before its first Triton compile:
# importing Triton (~0.2-0.4 s), importing the code generator on first use
# (~0.1 s), and ``triton.runtime.cache.triton_key()``, which reads and hashes
# Triton's sources and the ~400 MB ``libtriton`` for the key of Triton's own
# cache (~0.5-0.7 s). ``prepare_triton`` pays the imports (in a background
# thread if asked, so they overlap with whatever the process does next) and
# memoizes ``triton_key()`` on disk, keyed by the path, size and mtime of
# every file it reads: the key is the one Triton computes, computed once per
# installation instead of once per process.

_prepare_lock = threading.Lock()  # held while preparing
_start_lock = threading.Lock()  # held while starting the background thread
_prepared = False
_background: threading.Thread | None = None


def key_memo_dir() -> str:
    """Where the memoized Triton key lives (``JAX_KERNEL_RUNTIME_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/jax-kernel-runtime``, else ``~/.cache/...``)."""
    env = os.environ.get("JAX_KERNEL_RUNTIME_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-kernel-runtime")


def _key_inputs(triton_mod: Any, cache_mod: Any) -> list[str]:
    """The files ``triton_key()`` reads: the cache module, the Python files
    under ``compiler/``, ``backends/`` and ``language/``, and ``libtriton``."""
    root = os.path.dirname(os.path.abspath(triton_mod.__file__))
    files = [os.path.abspath(cache_mod.__file__)]
    for sub in ("compiler", "backends", "language"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, sub)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    c_dir = os.path.join(root, "_C")
    files += sorted(os.path.join(c_dir, f) for f in os.listdir(c_dir) if f.startswith("libtriton."))
    return files


def _fingerprint(triton_mod: Any, cache_mod: Any) -> str:
    h = hashlib.sha256(f"triton {triton_mod.__version__}\0".encode())
    for path in _key_inputs(triton_mod, cache_mod):
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0".encode())
    return h.hexdigest()


def memoize_triton_key() -> bool:
    """Replaces ``triton.runtime.cache.triton_key`` by a function returning
    the same string, read from disk when Triton's files are unchanged.

    Returns False (and changes nothing) if this Triton has no such function:
    a later Triton only loses the speed-up.
    """
    import triton
    from triton.runtime import cache as tcache

    original = getattr(tcache, "triton_key", None)
    if original is None or getattr(original, "_jkr_memoized", False):
        return original is not None
    try:
        fingerprint = _fingerprint(triton, tcache)
    except (OSError, TypeError, AttributeError):  # an unusual install: no memo, same key
        return False
    path = os.path.join(key_memo_dir(), f"triton-key-{fingerprint}.txt")
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read()
    except (OSError, ValueError):  # missing, unreadable, or not UTF-8 (UnicodeDecodeError)
        key = ""
    if not key.startswith(f"{triton.__version__}"):  # missing, truncated or foreign
        key = original()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(key)
            os.replace(tmp, path)
        except OSError:  # a read-only home only loses the memo
            pass

    def triton_key() -> str:
        return key

    triton_key._jkr_memoized = True  # type: ignore[attr-defined]
    triton_key.__wrapped__ = original  # type: ignore[attr-defined]
    tcache.triton_key = triton_key
    # Modules that imported the function by name before we replaced it.
    for mod in list(sys.modules.values()):
        if (
            mod is not None
            and mod.__name__.startswith("triton")
            and getattr(mod, "triton_key", None) is original
        ):
            mod.triton_key = triton_key  # type: ignore[attr-defined]
    return True


def prepare_triton(background: bool = False) -> threading.Thread | None:
    """Imports Triton and its code generator and memoizes its cache key
    (``memoize_triton_key``), once per process; later calls return at once.

    With ``background=True`` the work runs in a daemon thread, returned to the
    caller; a later synchronous call (the first compile) waits for it. A fork
    waits for it too, so a child never inherits a half-done import, and so
    does the interpreter's exit (it must not finalize under the thread).
    ``JAX_KERNEL_RUNTIME_BACKGROUND_PREPARE=0`` turns the background thread
    off (the work then happens at the first compile).
    """
    global _background
    if background:
        if os.environ.get("JAX_KERNEL_RUNTIME_BACKGROUND_PREPARE", "1") == "0":
            return None
        with _start_lock:
            if _prepared or _background is not None:
                return _background
            _background = threading.Thread(
                target=_prepare_quietly, name="jax-kernel-runtime-prepare-triton", daemon=True
            )
            _background.start()
            return _background
    _prepare()
    return None


def _prepare_quietly() -> None:
    try:
        _prepare()
    except Exception:  # the synchronous call at the first compile reports it
        pass


def _prepare() -> None:
    global _prepared
    with _prepare_lock:
        if _prepared:
            return
        import triton  # noqa: F401
        import triton.compiler.code_generator  # noqa: F401  imported by the first compile otherwise

        memoize_triton_key()
        _prepared = True
    if threading.current_thread() is _background:
        # Importing Triton leaves the collector a full collection due (many
        # new long-lived objects); run it here rather than at a random
        # allocation of the main thread, such as inside the first lowering.
        gc.collect()


def _wait_for_background() -> None:
    t = _background
    if t is not None and t is not threading.current_thread():
        t.join()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_wait_for_background)

# A script that ends while the thread is still inside Triton (hashing
# libtriton for a cold memo) must not finalize the interpreter under it: the
# daemon thread then touched Python objects without the GIL and the process
# aborted (pybind11 "dec_ref() PyGILState_Check() failure", exit 134).
# atexit handlers run before finalization starts, so the exit waits for it.
atexit.register(_wait_for_background)
