"""``triton.autotune`` / ``triton.heuristics`` kernels and the winner cache.

A decorated kernel is expanded at trace time into variants (metaparams +
compile options). On the GPU the runtime times every variant on the first
execution and keeps the fastest; the winner is then cached per process and on
disk, keyed by kernel, configs, shapes, dtypes, scalars, grid and device, so
later compilations (and later processes) compile only the winner.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import jax_kernel_runtime as jkr
from jax_triton._src.compile import CompileOptions
from jax_triton._src.triton_compat import Autotuner, Heuristics, JITFunction


@dataclasses.dataclass(frozen=True)
class Variant:
    metaparams: tuple[tuple[str, Any], ...]
    options: CompileOptions
    reset_to_zero: tuple[str, ...] = ()

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.metaparams)


def base_function(kernel) -> JITFunction:
    """The ``@triton.jit`` function under any autotune/heuristics wrappers."""
    k = kernel
    while isinstance(k, (Autotuner, Heuristics)):
        k = k.fn
    if not isinstance(k, JITFunction):
        raise TypeError(
            f"triton_call needs a @triton.jit kernel (optionally wrapped in "
            f"triton.autotune / triton.heuristics), got {kernel!r} of type "
            f"{type(kernel).__name__}"
        )
    return k


def expand(kernel, named_args: dict, metaparams: dict, options: CompileOptions):
    """All variants of ``kernel`` for these arguments, in config order."""
    if isinstance(kernel, JITFunction):
        return [Variant(tuple(sorted(metaparams.items())), options)]
    if isinstance(kernel, Heuristics):
        meta = dict(metaparams)
        for name, heuristic in kernel.values.items():
            meta[name] = heuristic({**named_args, **meta})
        return expand(kernel.fn, named_args, meta, options)
    if isinstance(kernel, Autotuner):
        configs = list(kernel.configs)
        if kernel.early_config_prune is not None:
            configs = list(kernel.early_config_prune(configs, {**named_args, **metaparams}))
        out = []
        for cfg in configs:
            extra = tuple((k, v) for k, v in (("maxnreg", cfg.maxnreg),) if v is not None)
            opts = dataclasses.replace(
                options,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                num_ctas=cfg.num_ctas,
                extra=extra,
            )
            for v in expand(kernel.fn, named_args, {**metaparams, **cfg.kwargs}, opts):
                zero = tuple(kernel.reset_to_zero) + v.reset_to_zero
                out.append(dataclasses.replace(v, reset_to_zero=zero))
        return out
    base_function(kernel)  # raises the TypeError
    return []


def tune_key(fn: JITFunction, variant_keys, avals, scalars, grids, device: str) -> str:
    """Stable identity of one autotuned call site (hex sha256).

    ``variant_keys`` identifies each config (its metaparams and options).
    """
    parts = [
        fn.cache_key,
        repr(list(variant_keys)),
        repr([(tuple(a.shape), str(a.dtype)) for a in avals]),
        repr(scalars),
        repr(grids),
        device,
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _cache_dir() -> Path:
    d = os.environ.get("JAX_TRITON_AUTOTUNE_DIR")
    if d:
        return Path(d)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jax_triton"


_winners: dict[str, int] = {}
_pending: set[str] = set()
_seen_records = 0
_lock = threading.Lock()


def lookup_winner(key: str) -> int | None:
    """The recorded winning config index for ``key`` (memory, then disk)."""
    flush_records()
    with _lock:
        if key in _winners:
            return _winners[key]
    path = _cache_dir() / f"{key}.json"
    try:
        chosen = int(json.loads(path.read_text())["chosen"])
    except (OSError, ValueError, KeyError):
        return None
    with _lock:
        _winners[key] = chosen
    return chosen


def expect_tuning(key: str) -> None:
    with _lock:
        _pending.add(key)


def record_winner(key: str, chosen: int, times_ms=()) -> None:
    with _lock:
        _winners[key] = chosen
    try:
        d = _cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{key}.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"chosen": chosen, "times_ms": list(times_ms)}))
        tmp.replace(d / f"{key}.json")  # atomic: concurrent processes are safe
    except OSError:
        pass  # a read-only home only loses the cross-process cache


def flush_records() -> None:
    """Moves new runtime tuning results into the caches."""
    global _seen_records
    records = jkr.tune_records()
    with _lock:
        new, _seen_records = records[_seen_records:], len(records)
    for key, _device, chosen, times in new:
        if key:
            record_winner(key, chosen, times)
