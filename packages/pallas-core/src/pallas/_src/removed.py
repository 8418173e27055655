"""Names JAX's Pallas removed or moved, for a module ``__getattr__``: code
written for an older JAX gets JAX's words and where the name went (an
``AttributeError``, as JAX 0.11 raises), not a bare "has no attribute"."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

# name -> (message, where it moved: "module:attr", or None when it is gone)
RemovedNames = dict[str, tuple[str, str | None]]

#: ``pallas`` (JAX's ``pl`` module, 0.11).
PALLAS: RemovedNames = {
    "dot": (
        "pl.dot was deprecated in JAX v0.11.0, and removed in JAX v0.12.0. Use jax.numpy.dot, "
        "jax.numpy.einsum or the @ operator instead in TPU or MGPU kernels. In Triton kernels: pallas_gpu.dot.",
        None,
    ),
    "debug_checks_enabled": (
        "pl.debug_checks_enabled was deprecated in JAX v0.11.0, and removed in JAX v0.12.0. "
        "Use pl.enable_debug_checks instead.",
        None,
    ),
    "reciprocal": (
        "pl.reciprocal was moved to pltpu (pallas_tpu.reciprocal). Accessing it via pl is deprecated, "
        "as in JAX 0.11.",
        "pallas_tpu:reciprocal",
    ),
}


def module_getattr(module: str, table: RemovedNames) -> Callable[[str], Any]:
    """A module ``__getattr__`` answering ``table``'s names: the moved ones
    with a ``DeprecationWarning`` (as JAX), the removed ones with an
    ``AttributeError`` in JAX's words."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        message, moved = table[name]
        if moved is not None:
            where, attr = moved.split(":")
            try:
                target = getattr(importlib.import_module(where), attr)
            except ImportError:
                raise AttributeError(f"{message} ({where} is not installed)") from None
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return target
        raise AttributeError(message)

    return __getattr__
