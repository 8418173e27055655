"""Fresh compiles of the same kernel give the same cubin and the same lowered
HLO, whatever the cache directories, the working directory or the mtime of
the kernel's file (the shared ``compile_triton`` of jax_kernel_runtime).
Compiled for sm_90 on the CPU; each compile runs in a fresh process with
fresh pallas-gpu and Triton caches."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("triton")

PALLAS_SCRIPT = textwrap.dedent(
    """
    import hashlib, jax, jax.numpy as jnp
    import jax_kernel_runtime as jkr
    import pallas as pl, pallas_gpu as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.exp(x_ref[...]) * 3.0

    x = jnp.ones((4096,), jnp.float32)
    f = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
        in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
        out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
    )
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=jkr.export_disabled_checks())(x)
    open("module.txt", "w").write(exp.mlir_module())
    print(hashlib.sha256(exp.mlir_module().encode()).hexdigest())
    """
)

KERNEL_FILE = textwrap.dedent(
    """
    import triton
    import triton.language as tl

    @triton.jit
    def scale_kernel(x_ptr, n, o_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)
    """
)

TRITON_CALL_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys, jax, jax.numpy as jnp
    import jax_triton as jt
    sys.path.insert(0, sys.argv[1])
    from scale_kernel_file import scale_kernel

    x = jax.ShapeDtypeStruct((1000,), jnp.float32)
    f = jax.jit(lambda x: jt.triton_call(x, x.size, kernel=scale_kernel, out_shape=x, grid=4, BLOCK=256))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "jax_kernel_runtime" in text
    open("module.txt", "w").write(text)
    print(hashlib.sha256(text.encode()).hexdigest())
    """
)


def _fresh_run(tmp_path, tag: str, script: str, *argv: str, **env: str) -> str:
    work = tmp_path / tag
    work.mkdir()
    environ = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PALLAS_GPU_CACHE_DIR": str(work / "pallas_gpu"),
        "TRITON_CACHE_DIR": str(work / "triton"),
        "PALLAS_GPU_COMPUTE_CAPABILITY": "90",
        **env,
    }
    environ.pop("PALLAS_GPU_DISABLE_CACHE", None)
    r = subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=work,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_pallas_gpu_hlo_is_the_same_in_fresh_cache_dirs(tmp_path):
    first = _fresh_run(tmp_path, "a", PALLAS_SCRIPT)
    time.sleep(1.1)  # a later mtime of the generated source, had it mattered
    assert _fresh_run(tmp_path, "b", PALLAS_SCRIPT) == first


def test_triton_call_hlo_does_not_depend_on_the_kernel_files_mtime(tmp_path):
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "scale_kernel_file.py").write_text(KERNEL_FILE)
    first = _fresh_run(tmp_path, "a", TRITON_CALL_SCRIPT, str(src))
    os.utime(src / "scale_kernel_file.py", (1_000_000_000, 1_000_000_000))  # same text, another mtime
    assert _fresh_run(tmp_path, "b", TRITON_CALL_SCRIPT, str(src)) == first


def test_stable_ptx_rewrites_only_file_directives_without_a_timestamp():
    from jax_kernel_runtime.triton._compile import stable_ptx

    ptx = '\t.file\t1 "k.py"\n\t.file\t2 "/a b/c.py", 5, 6\n\t.loc\t1 3 0\n'
    assert stable_ptx(ptx) == '\t.file\t1 "k.py", 1, 0\n\t.file\t2 "/a b/c.py", 5, 6\n\t.loc\t1 3 0\n'


def test_stable_ptx_names_files_relative_to_their_sys_path_entry():
    from jax_kernel_runtime.triton._compile import relative_source_path, stable_ptx

    roots = ["/opt/venv/lib/python3.12/site-packages", "/home/me/project/src", "/home/me"]
    assert relative_source_path(
        "/opt/venv/lib/python3.12/site-packages/triton/language/standard.py", roots
    ) == ("triton/language/standard.py")
    assert relative_source_path("/home/me/project/src/pkg/k.py", roots) == "pkg/k.py"  # the longest root
    assert relative_source_path("/elsewhere/k.py", roots) == "/elsewhere/k.py"
    assert relative_source_path("/opt/venv/lib/python3.12/site-packages-other/k.py", roots) == (
        "/opt/venv/lib/python3.12/site-packages-other/k.py"  # a prefix of the name is not a parent
    )
    import triton

    standard = os.path.join(os.path.dirname(triton.__file__), "language", "standard.py")
    assert stable_ptx(f'\t.file\t3 "{standard}"\n') == '\t.file\t3 "triton/language/standard.py", 1, 0\n'
