"""The runtime's FFI targets register under every supported jaxlib, and without
any ritual: on import of our packages and through JAX's plugin discovery.

Each check runs in a fresh process: registration is process state.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import jax_kernel_runtime as jkr
from jax_kernel_runtime import _jax_kernel_runtime as native

# The XLA FFI API of the oldest supported jaxlib (0.10.2). jaxlib refuses handlers
# built against a newer API than its own, so the extension is built against this.
OLDEST_FFI_API = (0, 3)

# Whether a fresh process has our target registered for CUDA. Without a CUDA
# backend (a CPU machine) jaxlib keeps CUDA registrations in
# xla_client._custom_callback until a CUDA plugin installs its handler, which
# then registers them all; with one running they go straight to it.
PRELUDE = f"""
def cuda_target_registered():
    from jaxlib import xla_client
    if "CUDA" in xla_client._custom_callback_handler:
        return "cuda-backend-up"
    return {jkr.TARGET_NAME!r} in [n for n, *_ in xla_client._custom_callback.get("CUDA", [])]
"""


def run_fresh(script: str, **env) -> str:
    r = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert r.returncode == 0, f"fresh process failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_extension_is_built_against_the_oldest_ffi_api():
    # A build against jaxlib 0.12's headers (API 0.5) is refused by jaxlib 0.11.2.
    assert native.ffi_api_version() == OLDEST_FFI_API, (
        f"the extension was built against XLA FFI API {native.ffi_api_version()}, "
        f"not the oldest supported jaxlib's {OLDEST_FFI_API}; see CMakeLists.txt"
    )


def test_handlers_register_with_this_jaxlib():
    # jaxlib checks a handler's FFI API version when it is registered with a live
    # backend. There is no CUDA backend here, so register the same handlers for the
    # host platform under probe names: the same check, on the jaxlib under test.
    out = run_fresh(
        """
        import jax
        from jax_kernel_runtime import _jax_kernel_runtime as native
        jax.devices()  # the host platform's handler registry is live from here on
        for type_name, registration in native.type_registrations().items():
            jax.ffi.register_ffi_type(type_name, registration, platform="cpu")
        for name, stages in native.registrations().items():
            jax.ffi.register_ffi_target("probe_" + name, stages, platform="cpu", api_version=1)
        print("registered", jax.__version__, native.ffi_api_version())
        """
    )
    assert out.startswith("registered")


@pytest.mark.parametrize("package", ["jax_kernel_runtime", "jax_triton", "pallas_gpu"])
def test_importing_a_package_registers_the_targets(package):
    pytest.importorskip(package)
    out = run_fresh(
        f"""
        import {package}
        print(cuda_target_registered())
        """
    )
    assert out.split()[-1] in ("True", "cuda-backend-up")


def test_jax_plugin_discovery_registers_the_targets_without_importing_them():
    # Only jax is imported; JAX's backend start-up imports jax_kernel_runtime's
    # plugin module (entry-point group jax_plugins) and calls initialize().
    out = run_fresh(
        """
        import sys, jax
        before = cuda_target_registered()
        jax.devices()
        print(before, "jax_kernel_runtime" in sys.modules, cuda_target_registered())
        """
    )
    before, imported, after = out.split()
    assert (before, imported) == ("False", "True")
    assert after in ("True", "cuda-backend-up")


def test_plugin_initialize_is_idempotent():
    from jax_kernel_runtime import jax_plugin

    jax_plugin.initialize()
    jax_plugin.initialize()
    jkr.register()
