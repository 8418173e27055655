"""With every cache directory unusable (each a path through a file: Triton's
``TRITON_CACHE_DIR``, pallas-gpu's, jax-triton's winners, the Triton-key
memo), pallas-gpu and jax-triton still compile and interpret: one warning
per directory, then the process runs uncached."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("always")
    import jax, jax.numpy as jnp, numpy as np
    import triton, triton.language as tl
    import jax_triton as jt
    import pallas as pl, pallas_gpu as plgpu
    from jax_triton._src import autotune as jt_autotune

    @triton.jit
    def add_one(x_ptr, n, o_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def pallas(block, interpret=False):
        return pl.pallas_call(
            kernel, jax.ShapeDtypeStruct((1024,), jnp.float32), grid=(1024 // block,),
            in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
            out_specs=pl.BlockSpec((block,), lambda i: (i,)), interpret=interpret,
        )

    x = jnp.arange(1000, dtype=jnp.float32)
    y = jnp.arange(1024, dtype=jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        for block in (128, 256):
            tc = jax.jit(lambda x: jt.triton_call(x, x.size, kernel=add_one, out_shape=x, grid=8, BLOCK=block))
            np.testing.assert_array_equal(np.asarray(tc(x)), np.asarray(x) + 1.0)  # interpreted
            assert "jax_kernel_runtime" in tc.trace(x).lower(lowering_platforms=("cuda",)).as_text()
            out = pallas(block, plgpu.InterpretParams())(y)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(y) * 2.0)
            lowered = jax.jit(pallas(block)).trace(y).lower(lowering_platforms=("cuda",))
            assert "jax_kernel_runtime" in lowered.as_text()
            jt_autotune.record_winner(f"key{block}", 0)
    msgs = sorted({str(w.message)[:60] for w in caught if "cannot be written" in str(w.message)
                   or "cannot write to the cache directory" in str(w.message)})
    print(len([w for w in caught if "cannot" in str(w.message)]), msgs)
    """
)


def test_everything_runs_with_unusable_cache_dirs(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PALLAS_GPU_COMPUTE_CAPABILITY": "90",
        "TRITON_CACHE_DIR": str(blocker / "triton"),
        "PALLAS_GPU_CACHE_DIR": str(blocker / "pallas_gpu"),
        "JAX_TRITON_AUTOTUNE_DIR": str(blocker / "jax_triton"),
        "JAX_KERNEL_RUNTIME_CACHE_DIR": str(blocker / "memo"),
    }
    env.pop("PALLAS_GPU_DISABLE_CACHE", None)
    path = tmp_path / "script.py"  # @triton.jit reads its source from a file
    path.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    count, _, msgs = r.stdout.strip().splitlines()[-1].partition(" ")
    assert count == "3", r.stdout  # one per directory that is written to
    assert "Triton's cache directory" in msgs and "jax_triton (JAX_TRITON_AUTOTUNE_DIR)" in msgs
    assert "pallas_gpu (PALLAS_GPU_CACHE_DIR)" in msgs
