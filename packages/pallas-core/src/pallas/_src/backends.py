"""The backend registry, filled from the ``pallas.backends`` entry points.

A backend is an object (usually a module) with:

* ``PLATFORMS``: the JAX platforms it lowers for (``("cuda", "rocm")``);
* ``lower(ctx, *args, jaxpr, grid_mapping, **params)``: an MLIR lowering rule
  for ``pallas_call_p``;
* optionally ``COMPILER_PARAMS``: its ``CompilerParams`` type, and
  ``INTERPRET_PARAMS``: the type of its own interpret-mode options.

pallas-core never imports a backend by name.
"""

from __future__ import annotations

import threading
from importlib import metadata
from typing import Any

# Which distribution provides each platform, for the "not installed" error.
PACKAGE_FOR_PLATFORM = {"cuda": "jax-pallas-gpu", "rocm": "jax-pallas-gpu", "tpu": "jax-pallas-tpu"}

# pallas_call(backend=...): our backends' names, and JAX's names for the same backends.
PACKAGE_FOR_BACKEND = {"gpu": PACKAGE_FOR_PLATFORM["cuda"], "tpu": PACKAGE_FOR_PLATFORM["tpu"]}
BACKEND_ALIASES = {"triton": "gpu", "mosaic_tpu": "tpu", "mosaic": "tpu"}
# JAX backends this stack does not provide, with what to use instead.
UNAVAILABLE_BACKENDS = {
    "mosaic_gpu": "'mosaic_gpu' is JAX's Mosaic GPU backend, which is not part of this stack; "
    "pallas-gpu lowers through Triton: use backend='triton' (or 'gpu')",
}

# Re-entrant: loading an entry point imports a backend, which calls register_backend.
_lock = threading.RLock()
_backends: dict[str, Any] | None = None
_load_errors: dict[str, str] = {}
# Backends that registered themselves when imported: found without scanning
# the installed distributions' entry points (a scan costs tens of ms).
_registered: dict[str, Any] = {}


def _load() -> dict[str, Any]:
    global _backends
    with _lock:
        if _backends is None:
            found: dict[str, Any] = {}
            for ep in metadata.entry_points(group="pallas.backends"):
                try:
                    found[ep.name] = ep.load()
                except Exception as e:  # a broken backend must not break the others
                    _load_errors[ep.name] = f"{type(e).__name__}: {e}"
            _backends = found
        return _backends


def register_backend(name: str, backend: Any) -> None:
    """Registers a backend directly, e.g. from the backend package's
    ``__init__``. Entry points still find backends that were not imported."""
    with _lock:
        _registered[name] = backend


def backends() -> dict[str, Any]:
    return {**_load(), **_registered}


def _platform_candidates(found: dict[str, Any], platform: str, compiler_params: Any, name: str | None):
    candidates = [
        b for n, b in found.items() if platform in getattr(b, "PLATFORMS", ()) and (name is None or n == name)
    ]
    if compiler_params is not None:
        typed = [b for b in candidates if isinstance(compiler_params, getattr(b, "COMPILER_PARAMS", ()))]
        candidates = typed or ([] if found is _registered else candidates)
    return candidates


def for_platform(platform: str, compiler_params: Any = None, name: str | None = None) -> Any | None:
    candidates = _platform_candidates(_registered, platform, compiler_params, name)
    if not candidates:
        candidates = _platform_candidates(backends(), platform, compiler_params, name)
    return candidates[0] if candidates else None


def for_interpret_params(params: Any) -> Any | None:
    for found in (_registered, None):
        for b in (found if found is not None else backends()).values():
            t = getattr(b, "INTERPRET_PARAMS", None)
            if t is not None and isinstance(params, t):
                return b
    return None


def interpreter_for(jaxpr, grid_mapping) -> Any | None:
    """The backend whose interpreter runs a kernel pallas-core's interpret mode
    cannot (TPU memory spaces, DMAs, semaphores, scalar prefetch): the first
    backend whose ``claims_interpret(jaxpr, grid_mapping)`` is true."""
    for found in (_registered, None):
        for b in (found if found is not None else backends()).values():
            claims = getattr(b, "claims_interpret", None)
            if claims is not None and claims(jaxpr, grid_mapping):
                return b
    return None


def load_errors() -> dict[str, str]:
    _load()
    return dict(_load_errors)


def resolve_name(name: Any) -> str | None:
    """The registered backend name ``pallas_call(backend=name)`` selects;
    a ValueError naming the valid values for an unknown name."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"expected a backend name (a str) or None, got {name!r}")
    if name in UNAVAILABLE_BACKENDS:
        raise ValueError(UNAVAILABLE_BACKENDS[name])
    resolved = BACKEND_ALIASES.get(name, name)
    known = set(backends()) | set(PACKAGE_FOR_BACKEND)
    if resolved not in known:
        valid = sorted(known | set(BACKEND_ALIASES))
        raise ValueError(
            f"unknown backend {name!r}; expected None (choose by platform) or one of "
            + ", ".join(repr(v) for v in valid)
        )
    return resolved
