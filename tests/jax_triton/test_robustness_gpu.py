"""The cases of test_robustness.py that only a GPU shows: what the CUDA path
launches (or does not launch) for odd input, checked against numpy/jnp."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernels import add_kernel
from test_robustness import (
    add,
    add_const_kernel,
    annotated_kernel,
    assert_kernel,
    flag_kernel,
    scale_by_ref_kernel,
)

import jax_triton as jt


def _gpus():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpus(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_64_bit_numpy_inputs_without_x64_on_the_gpu(dtype):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(10_000) * 100).astype(dtype)
    y = (rng.standard_normal(10_000) * 100).astype(dtype)
    canonical = jax.dtypes.canonicalize_dtype(dtype)
    with jax.enable_x64(False):
        out = jax.jit(add)(x, y)
    assert out.dtype == canonical
    np.testing.assert_array_equal(out, x.astype(canonical) + y.astype(canonical))


def test_zero_size_and_empty_grid_on_the_gpu():
    empty = jnp.zeros((0,), jnp.float32)
    assert jax.jit(add)(empty, empty).shape == (0,)
    assert jax.jit(lambda a: add(a, a, grid=(2,)))(empty).shape == (0,)
    x, y = jax.random.normal(jax.random.key(0), (2, 512))
    aliased = jax.jit(lambda a, b: add(a, b, grid=(0,), input_output_aliases={1: 0}))(x, y)
    np.testing.assert_array_equal(aliased, y)


def test_0d_pointer_and_annotated_scalar_on_the_gpu():
    x, s = jax.random.normal(jax.random.key(1), (64,)), jax.random.normal(jax.random.key(2), ())
    out = jax.jit(
        lambda x, s: jt.triton_call(x, s, kernel=scale_by_ref_kernel, out_shape=x, grid=1, BLOCK=64)
    )(x, s)
    np.testing.assert_allclose(out, np.asarray(x) * np.asarray(s), rtol=1e-6)
    out = jt.triton_call(x, 50, kernel=annotated_kernel, out_shape=x, grid=1, BLOCK=64)
    # only the first 50 elements are stored (the rest of the output is not written)
    np.testing.assert_array_equal(out[:50], 2 * x[:50])


def test_debug_kernel_runs_when_its_asserts_hold():
    # A firing device assert would leave the CUDA context unusable for the
    # rest of the process, so only the passing side runs here.
    x = jax.random.normal(jax.random.key(3), (64,))
    out = jt.triton_call(x, kernel=assert_kernel, out_shape=x, grid=1, BLOCK=64, debug=True)
    np.testing.assert_array_equal(out, x)


_FIRE_ASSERT = """
import jax
from test_robustness import assert_kernel, rand

import jax_triton as jt

x = rand((64,), 10).at[17].set(1000.0)
try:
    jt.triton_call(x, kernel=assert_kernel, out_shape=x, grid=1, BLOCK=64, debug=True).block_until_ready()
    jax.effects_barrier()
except Exception as e:
    print("RAISED", type(e).__name__, str(e).splitlines()[0])
else:
    print("NO ERROR")
"""


def test_device_assert_fires_on_the_gpu_in_a_subprocess():
    # A firing device assert leaves the CUDA context unusable for the rest of the
    # process (every later launch fails), so it fires in a child process.
    here = Path(__file__).parent
    path = os.pathsep.join([str(here), str(here.parents[1] / "examples"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    r = subprocess.run(
        [sys.executable, "-c", _FIRE_ASSERT], env=env, capture_output=True, text=True, timeout=300
    )
    out = r.stdout + r.stderr
    assert "NO ERROR" not in r.stdout, out[-3000:]
    assert "RAISED" in r.stdout or r.returncode != 0, out[-3000:]
    assert "x must stay below 100" in out or "device-side assert" in out, out[-3000:]


def test_eager_and_jitted_calls_agree():
    x, y = jax.random.normal(jax.random.key(4), (2, 3000))
    kw = dict(kernel=add_kernel, out_shape=x, grid=(jt.cdiv(x.size, 64),), BLOCK_SIZE=64)
    np.testing.assert_array_equal(jt.triton_call(x, y, x.size, **kw), x + y)
    np.testing.assert_array_equal(jax.jit(lambda a, b: jt.triton_call(a, b, a.size, **kw))(x, y), x + y)


@pytest.mark.parametrize("flag", [True, False])
def test_bool_scalar_on_the_gpu(flag):
    x = jax.random.normal(jax.random.key(5), (64,))
    out = jt.triton_call(x, flag, kernel=flag_kernel, out_shape=x, grid=1, BLOCK=64)
    np.testing.assert_array_equal(out, x * 2 if flag else x)


def test_bf16_plus_python_float_on_the_gpu():
    """The GPU's answer for the interpreter test of the same name: the Python
    float becomes a bf16 constant, the sum is rounded to bf16."""
    x = jax.random.normal(jax.random.key(12), (64,), jnp.float32).astype(jnp.bfloat16)
    out = jt.triton_call(x, kernel=add_const_kernel, out_shape=x, grid=1, BLOCK=64)
    c = np.float32(jnp.asarray(0.1, jnp.bfloat16))
    np.testing.assert_array_equal(out, (x.astype(jnp.float32) + c).astype(jnp.bfloat16))
