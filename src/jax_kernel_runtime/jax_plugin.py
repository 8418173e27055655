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
    """Registers the FFI targets and their state type for platform CUDA."""
    from jax_kernel_runtime._call import register

    register()
