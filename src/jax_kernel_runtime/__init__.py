"""jax-kernel-runtime: launch compiled GPU kernel images from JAX via the XLA FFI.

The public API is small and meant to be shared by every GPU kernel package
(jax-triton today, pallas-gpu next): describe each compiled configuration with
``KernelConfig`` (``config_from_triton`` builds one from ``triton.compile``),
describe the parameters with ``Buffer``/``Scalar``, and call ``kernel_call``.
"""

from jax_kernel_runtime._call import TARGET_NAME as TARGET_NAME
from jax_kernel_runtime._call import driver_error as driver_error
from jax_kernel_runtime._call import export_disabled_checks as export_disabled_checks
from jax_kernel_runtime._call import kernel_call as kernel_call
from jax_kernel_runtime._call import launch_counts as launch_counts
from jax_kernel_runtime._call import register as register
from jax_kernel_runtime._call import tune_records as tune_records
from jax_kernel_runtime._config import Buffer as Buffer
from jax_kernel_runtime._config import KernelConfig as KernelConfig
from jax_kernel_runtime._config import Param as Param
from jax_kernel_runtime._config import Scalar as Scalar
from jax_kernel_runtime._config import normalize_grid as normalize_grid
from jax_kernel_runtime._triton import config_from_triton as config_from_triton
from jax_kernel_runtime._triton import memoize_triton_key as memoize_triton_key
from jax_kernel_runtime._triton import prepare_triton as prepare_triton
from jax_kernel_runtime._version import __version__ as __version__


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
