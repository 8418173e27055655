"""Every package imports and lowers on the JAX it is tested with (CI runs the
suite at both ends of the supported range and at the reference between them,
ARCHITECTURE.md "Versions").

A fresh process per package: a JAX release that moves an internal breaks the
import of that package's compat module, which a process that already imported
it would not see.
"""

import subprocess
import sys

import jax
import pytest

PACKAGES = ["pallas", "pallas_gpu", "pallas_tpu", "jax_triton", "jax_kernel_runtime"]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_in_a_fresh_process(package):
    r = subprocess.run(
        [sys.executable, "-c", f"import {package}; print({package}.__name__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"import {package} failed on jax {jax.__version__}:\n{r.stderr}"


def test_jax_is_in_the_supported_range():
    # The packages declare jax>=0.10.2,<0.13; a newer JAX must first be validated here.
    version = tuple(int(p) for p in jax.__version__.split(".")[:3])
    assert (0, 10, 2) <= version < (0, 13), jax.__version__
