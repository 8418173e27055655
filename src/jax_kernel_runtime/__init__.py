"""jax-kernel-runtime: launch compiled GPU kernel images from JAX via the XLA FFI.

The public API is small and meant to be shared by every GPU kernel package
(jax-triton today, pallas-gpu next): describe each compiled configuration with
``KernelConfig`` (``config_from_triton`` builds one from ``triton.compile``),
describe the parameters with ``Buffer``/``Scalar``, and call ``kernel_call``.

``jax_kernel_runtime.triton`` is the Triton layer the two GPU packages share
(compiling, caches, Triton's interpreter). Three of its names are also here:
``config_from_triton``, ``prepare_triton`` and ``memoize_triton_key``.
"""

from typing import Any

from jax_kernel_runtime._call import TARGET_NAME as TARGET_NAME
from jax_kernel_runtime._call import driver_error as driver_error
from jax_kernel_runtime._call import export_disabled_checks as export_disabled_checks
from jax_kernel_runtime._call import kernel_call as kernel_call
from jax_kernel_runtime._call import kernel_primitive as kernel_primitive
from jax_kernel_runtime._call import launch_counts as launch_counts
from jax_kernel_runtime._call import register as register
from jax_kernel_runtime._call import tune_records as tune_records
from jax_kernel_runtime._config import Buffer as Buffer
from jax_kernel_runtime._config import KernelConfig as KernelConfig
from jax_kernel_runtime._config import Param as Param
from jax_kernel_runtime._config import Scalar as Scalar
from jax_kernel_runtime._config import normalize_grid as normalize_grid
from jax_kernel_runtime._version import __version__ as __version__

# Reached here without importing the Triton layer at ``import
# jax_kernel_runtime``, which JAX does in every process at startup
# (jax_plugin): most never compile a Triton kernel. The layer never imports
# Triton itself until it is used.
_TRITON_NAMES = ("config_from_triton", "memoize_triton_key", "prepare_triton")


def __getattr__(name: str) -> Any:
    if name in _TRITON_NAMES:
        from jax_kernel_runtime import triton

        return getattr(triton, name)
    raise AttributeError(f"module 'jax_kernel_runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_TRITON_NAMES})


def _register_on_import() -> None:
    # Importing any package of ours registers the FFI targets (so does JAX's
    # plugin discovery, jax_plugin.py): a process that deserializes an export
    # holding our custom call needs no register() ritual. On a machine without
    # a CUDA backend the registration waits in jaxlib until one starts. A failure
    # (a build whose FFI API this jaxlib refuses) must not break importing: it
    # is reported here and raised again by register() at the first kernel call.
    from jax_kernel_runtime import _call

    if _call.native_missing():  # said once, when JAX starts (jax_plugin); raised at a GPU launch
        return
    try:
        register()
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(
            f"jax_kernel_runtime: registering the FFI targets failed: {e}", RuntimeWarning, stacklevel=2
        )


_register_on_import()
