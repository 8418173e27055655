"""Bad inputs on the GPU side that were once accepted (or failed deep inside) get our
usual sentence: the kernel, the user's line, what was expected and what was given. All of these are refused before anything runs, so they
need no GPU (nothing here is GPU-only):

* boolean options given strings: ``plgpu.CompilerParams(enable_fp_fusion="False")``,
  ``triton_call(enable_fp_fusion="False", debug="False")`` (jax-triton);
* ``pallas_gpu.ops.matmul``: ``config=`` a dict, block sizes of ``-16`` and ``0``,
  ``group_m=0``, ``autotune`` beside ``config=``;
* an export for ``["cpu", "rocm"]`` with pallas-gpu installed (it lowers for CUDA only).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu.ops import matmul as mm

HERE = re.compile(r"test_errors_bad_options\.py:\d+")


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


# -- plgpu.CompilerParams ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["enable_fp_fusion", "debug", "use_tma", "warp_specialize"])
@pytest.mark.parametrize("value", ["False", 0, None])
def test_compiler_params_bools(field, value):
    with pytest.raises((TypeError, ValueError)) as info:
        plgpu.CompilerParams(**{field: value})
    assert isinstance(info.value, TypeError)  # and a ValueError, as use_tma's has been
    assert f"plgpu.CompilerParams: {field} must be True or False, got {value!r}" in str(info.value)


def test_compiler_params_bools_accepted():
    params = plgpu.CompilerParams(enable_fp_fusion=False, debug=True)
    assert params.compile_options()["enable_fp_fusion"] is False and params.compile_options()["debug"] is True


# -- jax-triton's triton_call ----------------------------------------------------------------------


def _scale_kernel():
    triton = pytest.importorskip("triton")
    tl = triton.language

    @triton.jit
    def scale_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) * 2.0)

    return scale_kernel


@pytest.mark.parametrize("option", ["enable_fp_fusion", "debug", "has_side_effect"])
def test_triton_call_bool_options(option):
    jt = pytest.importorskip("jax_triton")
    kernel = _scale_kernel()
    x = rand(0, (256,))
    with pytest.raises(TypeError) as info:
        jt.triton_call(x, kernel=kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,), BLOCK=64,
                       **{option: "False"})  # fmt: skip
    msg = str(info.value)
    assert "triton_call 'scale_kernel'" in msg and HERE.search(msg), msg
    assert f"{option} must be True" in msg and "got 'False' (str)" in msg


def test_triton_call_bool_options_run():
    jt = pytest.importorskip("jax_triton")
    kernel = _scale_kernel()
    x = rand(1, (256,))
    out = jt.triton_call(
        x, kernel=kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,), BLOCK=64,
        enable_fp_fusion=False, debug=np.bool_(False),
    )  # fmt: skip
    np.testing.assert_allclose(out, x * 2.0)


# -- pallas_gpu.ops.matmul --------------------------------------------------------------------------


def test_matmul_config_as_a_dict():
    a, b = rand(2, (64, 32)), rand(3, (32, 64))
    with pytest.raises(TypeError, match=r"config must be a MatmulConfig .*got a dict .*MatmulConfig\(\*\*"):
        mm.matmul(a, b, config={"block_m": 32}, interpret=True)
    with pytest.raises(TypeError, match=r"config must be a MatmulConfig .*or None, got tuple"):
        mm.matmul(a, b, config=(32, 32, 32), interpret=True)


@pytest.mark.parametrize(
    "kw,what",
    [
        (dict(block_m=-16), "block_m must be a positive power of two, got -16"),
        (dict(block_m=0), "block_m must be a positive power of two, got 0"),
        (dict(block_n=48), "block_n must be a positive power of two, got 48"),
        (dict(group_m=0), "group_m must be a positive int, got 0"),
        (dict(num_stages=0), "num_stages must be a positive int, got 0"),
        (dict(num_warps=3), "num_warps must be a positive power of two, got 3"),
    ],
)
def test_matmul_config_values(kw, what):
    with pytest.raises(ValueError, match=re.escape(f"pallas_gpu.ops.MatmulConfig: {what}")):
        mm.MatmulConfig(**kw)


def test_matmul_config_flags():
    with pytest.raises(TypeError, match="persistent must be True or False, got 'yes'"):
        mm.MatmulConfig(persistent="yes")


@pytest.mark.parametrize("autotune", [True, "background", "yes"])
def test_matmul_autotune_beside_config(autotune):
    a, b = rand(4, (64, 32)), rand(5, (32, 64))
    match = (
        "autotune must be False"
        if autotune == "yes"
        else r"config=.* chooses one configuration.*needs config=None"
    )
    with pytest.raises(ValueError, match=match):
        mm.matmul(a, b, config=mm.MatmulConfig(32, 32, 32), autotune=autotune, interpret=True)


def test_matmul_with_a_config_runs():
    a, b = rand(6, (64, 32)), rand(7, (32, 64))
    out = mm.matmul(a, b, config=mm.MatmulConfig(32, 32, 32, group_m=2, num_warps=4), interpret=True)
    ref = jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


# -- export for ROCm -----------------------------------------------------------------------------


@pytest.mark.parametrize("platforms", [["cpu", "rocm"], ["rocm"]])
def test_export_for_rocm_says_pallas_gpu_is_installed(platforms):
    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    f = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))
    with pytest.raises(ValueError) as info:
        jax.export.export(jax.jit(f), platforms=platforms)(jax.ShapeDtypeStruct((8, 128), jnp.float32))
    msg = str(info.value)
    assert "pallas_call 'add_one'" in msg and HERE.search(msg), msg
    assert (
        "jax-pallas-gpu is installed, but its backend 'gpu' lowers for cuda, not for platform 'rocm'" in msg
    )
    assert "pip install" not in msg
