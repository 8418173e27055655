"""A jax.export artifact holding our custom call runs in a fresh process that
imports only jax: no jax_kernel_runtime.register() ritual (JAX's plugin
discovery registers the target)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_registration import run_fresh  # tests/runtime is on sys.path (conftest.py)

import jax_kernel_runtime as jkr

jt = pytest.importorskip("jax_triton")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def add_kernel(x_ptr, y_ptr, length, output_ptr, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < length
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(output_ptr + offsets, x + tl.load(y_ptr + offsets, mask=mask), mask=mask)


def _export_add(tmp_path):
    """Exports a triton_call for platform cuda (works on a CPU: Triton compiles
    the cubin without a GPU) and writes the serialized artifact."""

    def add(x, y):
        return jt.triton_call(
            x, y, x.size, kernel=add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(jt.cdiv(x.size, 256),), BLOCK_SIZE=256,
        )  # fmt: skip

    x = jax.ShapeDtypeStruct((1000,), jnp.float32)
    exp = jax.export.export(jax.jit(add), platforms=["cuda"], disabled_checks=jkr.export_disabled_checks())(
        x, x
    )
    path = tmp_path / "add.jax_export"
    path.write_bytes(exp.serialize())
    return path


def test_exported_triton_call_loads_and_lowers_in_a_process_that_imports_only_jax(tmp_path):
    # Made here on a CPU for platform cuda; the fresh process neither imports our
    # packages nor calls register(). Without a GPU it cannot run the call, but it
    # can deserialize it, lower it for CUDA, and have the target registered.
    path = _export_add(tmp_path)
    out = run_fresh(
        f"""
        import sys, jax, jax.numpy as jnp
        exp = jax.export.deserialize(open({str(path)!r}, "rb").read())
        x = jax.ShapeDtypeStruct((1000,), jnp.float32)
        hlo = jax.jit(exp.call).trace(x, x).lower(lowering_platforms=("cuda",)).as_text()
        assert {jkr.TARGET_NAME!r} in hlo, hlo
        ours = sorted(m for m in sys.modules if m.split(".")[0] in ("jax_triton", "pallas_gpu", "pallas"))
        print(exp.platforms, ours, cuda_target_registered())
        """
    )
    assert out.strip() in ("('cuda',) [] True", "('cuda',) [] cuda-backend-up")


@pytest.mark.gpu
def test_exported_triton_call_runs_in_a_process_that_imports_only_jax(tmp_path):
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs a CUDA GPU")
    path = _export_add(tmp_path)
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    run_fresh(
        f"""
        import jax, numpy as np
        exp = jax.export.deserialize(open({str(path)!r}, "rb").read())
        out = exp.call(np.load({str(tmp_path / "x.npy")!r}), np.load({str(tmp_path / "y.npy")!r}))
        np.save({str(tmp_path / "out.npy")!r}, np.asarray(out))
        """,
        XLA_PYTHON_CLIENT_MEM_FRACTION="0.1",
    )
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), x + y)
