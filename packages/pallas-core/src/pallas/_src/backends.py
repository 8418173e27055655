"""The backend contract and registry, filled from the ``pallas.backends`` entry points.

A backend is an object (usually a module) implementing ``Backend``. It
receives one ``PallasCall`` record (the kernel, its grid mapping, every option
and the kernel's facts) and never re-derives what pallas-core already knows:
``interpret`` is resolved once, by pallas-core's lowering rule, before a
backend sees the call.

pallas-core never imports a backend by name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

from pallas._src.call import PallasCall


@runtime_checkable
class Backend(Protocol):
    """What pallas-core asks of a backend (pallas-gpu and pallas-tpu implement it).

    Attributes:
      PLATFORMS: the JAX platforms it lowers for (``("cuda",)``).
      COMPILER_PARAMS: its ``CompilerParams`` type (selects it among the backends
        of a platform).
      INTERPRET_PARAMS: the type of its interpreter's options
        (``interpret=plgpu.InterpretParams()``); default-constructed when pallas-core
        hands it a kernel it claims (``claims_interpret``).
      DYNAMIC_GRID: whether ``lower`` and ``interpret`` take grids with traced sizes
        (pallas-core refuses them for a backend that does not, before it sees the call).
    """

    # Read-only members: a backend module's constants satisfy them (their types narrower).
    @property
    def PLATFORMS(self) -> tuple[str, ...]: ...
    @property
    def COMPILER_PARAMS(self) -> type: ...
    @property
    def INTERPRET_PARAMS(self) -> type: ...
    @property
    def DYNAMIC_GRID(self) -> bool: ...

    def describe(self) -> str:
        """The backend's name in messages (its import name: ``pallas_gpu``)."""

    def check_compiler_params(self, call: PallasCall) -> Any:
        """The call's compiler params for this backend (defaults filled in), or
        an error naming the kernel; run before ``lower``."""

    def lower(self, ctx: Any, call: PallasCall, *args: Any) -> Sequence[Any]:
        """The MLIR lowering of ``call`` for the hardware (``call.interpret`` is false)."""

    def interpret(self, ctx: Any, call: PallasCall, params: Any, *args: Any) -> Sequence[Any]:
        """The MLIR lowering of ``call`` run by the backend's interpreter with
        ``params`` (an ``INTERPRET_PARAMS``): ``call.interpret`` itself when the
        user chose this interpreter, else (``True``, ``pl.InterpretParams``, or
        ``False`` on the CPU) the default ``INTERPRET_PARAMS()`` of a backend that
        claimed the kernel."""

    def claims_interpret(self, call: PallasCall) -> bool:
        """Whether its interpreter runs a kernel that pallas-core's interpret
        mode cannot (``call.needs_backend_interpreter``)."""


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
_backends: dict[str, Backend] | None = None
_load_errors: dict[str, str] = {}
# Backends that registered themselves when imported: found without scanning
# the installed distributions' entry points (a scan costs tens of ms).
_registered: dict[str, Backend] = {}


def _load() -> dict[str, Backend]:
    global _backends
    with _lock:
        if _backends is None:
            found: dict[str, Backend] = {}
            for ep in metadata.entry_points(group="pallas.backends"):
                try:
                    found[ep.name] = ep.load()
                except Exception as e:  # a broken backend must not break the others
                    _load_errors[ep.name] = f"{type(e).__name__}: {e}"
            _backends = found
        return _backends


def register_backend(name: str, backend: Backend) -> None:
    """Registers a backend directly, e.g. from the backend package's
    ``__init__``. Entry points still find backends that were not imported."""
    with _lock:
        _registered[name] = backend


def backends() -> dict[str, Backend]:
    return {**_load(), **_registered}


def _platform_candidates(
    found: dict[str, Backend], platform: str, compiler_params: Any, name: str | None
) -> list[Backend]:
    candidates = [b for n, b in found.items() if platform in b.PLATFORMS and (name is None or n == name)]
    if compiler_params is not None:
        typed = [b for b in candidates if isinstance(compiler_params, b.COMPILER_PARAMS)]
        candidates = typed or ([] if found is _registered else candidates)
    return candidates


def for_platform(platform: str, compiler_params: Any = None, name: str | None = None) -> Backend | None:
    candidates = _platform_candidates(_registered, platform, compiler_params, name)
    if not candidates:
        candidates = _platform_candidates(backends(), platform, compiler_params, name)
    return candidates[0] if candidates else None


def for_interpret_params(params: Any) -> Backend | None:
    for found in (_registered, None):
        for b in (found if found is not None else backends()).values():
            if isinstance(params, b.INTERPRET_PARAMS):
                return b
    return None


def interpreter_for(call: PallasCall) -> Backend | None:
    """The backend whose interpreter runs a kernel pallas-core's interpret mode
    cannot (TPU memory spaces, DMAs, semaphores, scalar prefetch): the first
    backend whose ``claims_interpret(call)`` is true."""
    for found in (_registered, None):
        for b in (found if found is not None else backends()).values():
            if b.claims_interpret(call):
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
