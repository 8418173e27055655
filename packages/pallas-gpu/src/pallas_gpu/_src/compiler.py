"""Generated source -> importable module -> compiled Triton kernel, cached.

``triton.jit`` reads a kernel's source with ``inspect``, so the generated
module is written to a file in the cache directory and imported from there.
The same text is imported twice: once as a ``JITFunction`` for
``triton.compile`` and once as an ``InterpretedFunction`` for the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import threading
from typing import Any

import triton

from pallas_gpu._src.lowering import LoweredKernel

_lock = threading.Lock()
_modules: dict[tuple[str, bool], Any] = {}


def cache_dir() -> str:
    d = os.environ.get("PALLAS_GPU_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pallas_gpu"
    )
    os.makedirs(os.path.join(d, "src"), exist_ok=True)
    return d


@contextlib.contextmanager
def _interpret_knob(on: bool):
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
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        with _interpret_knob(interpret):
            spec.loader.exec_module(module)
        _modules[key] = module
        return getattr(module, lk.name)


@functools.lru_cache(maxsize=512)
def compile_kernel(lk: LoweredKernel, cc: int, options: tuple[tuple[str, Any], ...]):
    """``triton.compile`` for ``sm_{cc}``; works without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load_kernel(lk, interpret=False)
    names = fn.arg_names
    signature = dict(zip(names, lk.signature))
    # Pointers from XLA are at least 16-byte aligned (the runtime checks it).
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    src = ASTSource(fn=fn, signature=signature, constexprs={}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(options))
