"""Without jax-kernel-runtime's native extension (a broken or missing build):
``import jax_triton`` works, Triton's interpreter on the CPU still runs
``triton_call``, JAX's start says so in one warning line (no plugin
traceback), and a GPU launch raises one ImportError naming the wheel.

Each check runs in a fresh process whose import system hides the extension.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

# Refuses to import the extension, as a missing or broken build would.
HIDE = """
import sys
class _HideNative:
    def find_spec(self, name, path=None, target=None):
        if name == "jax_kernel_runtime._jax_kernel_runtime":
            raise ImportError("no module named jax_kernel_runtime._jax_kernel_runtime (hidden by the test)")
sys.meta_path.insert(0, _HideNative())
"""


def run_without_native(tmp_path, script: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"  # a file: @triton.jit needs the kernel's source
    path.write_text(HIDE + textwrap.dedent(script))
    r = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},  # the CPU paths: Triton's interpreter
    )
    assert r.returncode == 0, f"process failed:\n{r.stdout}\n{r.stderr}"
    return r


def _our_lines(stderr: str) -> list[str]:
    return [
        line for line in stderr.splitlines() if "jax_kernel_runtime" in line or "jax-kernel-runtime" in line
    ]


def test_triton_call_on_the_cpu_without_the_extension(tmp_path):
    r = run_without_native(
        tmp_path,
        """
        import jax, jax.numpy as jnp, numpy as np
        import jax_triton as jt
        import triton, triton.language as tl

        @triton.jit
        def add_kernel(x_ptr, y_ptr, o_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

        x = jax.random.normal(jax.random.key(0), (100,))
        y = jax.random.normal(jax.random.key(1), (100,))
        out = jt.triton_call(x, y, kernel=add_kernel, out_shape=x, grid=(4,), n=100, BLOCK=32)
        np.testing.assert_allclose(out, x + y, rtol=1e-6)
        print("ran")
        """,
    )
    assert "ran" in r.stdout
    assert "circular import" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = _our_lines(r.stderr)
    assert len(lines) == 1, r.stderr  # one warning when JAX starts, not a 23-line traceback
    assert "native extension" in lines[0] and "pip install --force-reinstall jax-kernel-runtime" in lines[0]


def test_gpu_launch_without_the_extension_raises_one_import_error(tmp_path):
    r = run_without_native(
        tmp_path,
        """
        import jax_kernel_runtime as jkr
        from jax_kernel_runtime import _call
        for fn in (_call.native, jkr.register):
            try:
                fn()
            except ImportError as e:
                print("ImportError:", e)
            else:
                raise AssertionError(f"{fn} did not raise")
        print("driver_error:", _call.driver_error())
        print("counts:", _call.launch_counts(), _call.tune_records())
        """,
    )
    errors = [line for line in r.stdout.splitlines() if line.startswith("ImportError:")]
    assert len(errors) == 2, r.stdout
    for line in errors:
        assert "jax-kernel-runtime's native extension" in line and "cannot be launched on a GPU" in line
        assert "hidden by the test" in line and "Reinstall the jax-kernel-runtime wheel" in line
    assert "driver_error: jax-kernel-runtime's native extension" in r.stdout
    assert "counts: (0, 0) []" in r.stdout
