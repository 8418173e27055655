"""``triton.autotune`` / ``triton.heuristics`` kernels and the winner cache.

A decorated kernel is expanded at trace time into variants (metaparams +
compile options). On the GPU the runtime times every variant on the first
execution and keeps the fastest; the winner is then cached per process and on
disk, keyed by kernel, configs, shapes, dtypes, scalars, grid and device, so
later compilations (and later processes) compile only the winner. The winner
cache is jax_kernel_runtime's shared one (also used by pallas-gpu).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from jax_kernel_runtime import triton as jkr_triton
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
            extra = dict(options.extra)  # backend_options, under the config's own
            if cfg.maxnreg is not None:
                extra["maxnreg"] = cfg.maxnreg
            opts = dataclasses.replace(
                options,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
                num_ctas=cfg.num_ctas,
                extra=tuple(sorted(extra.items())),
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


def _cache_dir() -> str:
    d = os.environ.get("JAX_TRITON_AUTOTUNE_DIR")
    if d:
        return d
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jax_triton")


# The shared winner cache of jax_kernel_runtime, in jax-triton's directory.
WINNERS = jkr_triton.WinnerCache(
    jkr_triton.DiskCache("jax_triton (JAX_TRITON_AUTOTUNE_DIR)", _cache_dir), subdir=""
)


def lookup_winner(key: str, num_configs: int | None = None) -> int | None:
    """The recorded winning config index for ``key`` (memory, then disk)."""
    return WINNERS.lookup(key, num_configs)


def expect_tuning(key: str) -> None:
    WINNERS.expect(key)


def record_winner(key: str, chosen: int, times_ms=()) -> None:
    WINNERS.record(key, chosen, times_ms)


flush_records = jkr_triton.flush_records
