"""JAX plugin hook: registers the runtime's FFI targets when JAX starts.

JAX imports every module named in the ``jax_plugins`` entry-point group (see
the root ``pyproject.toml``) when it first initializes its backends
(``jax.devices()``, the first computation, deserializing and calling an
export) and calls its ``initialize()``. Registering there means a process that
imports none of our packages, say one that only runs a ``jax.export`` artifact
holding our custom call, finds the target without calling
``jax_kernel_runtime.register()`` first.

This module provides no PJRT backend: ``initialize`` only registers FFI
targets, which is cheap (no CUDA, no Triton).
"""

from __future__ import annotations


def initialize() -> None:
    """Registers the FFI targets and their state type for platform CUDA.
    Without the native extension: one warning line (JAX would print the
    ImportError's whole traceback); a GPU launch raises it."""
    from jax_kernel_runtime import _call

    missing = _call.native_missing()
    if missing:
        import logging

        logging.getLogger("jax_kernel_runtime").warning("%s", missing)
        return
    _call.register()
