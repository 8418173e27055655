"""pallas_gpu.ops.attention_fp8: ``mha_fp8`` (fp8 e4m3 q, k, v with per-tensor
scales, a 16-bit output) against an f32 reference on fresh random data: in
pallas-core's interpret mode and under Triton's interpreter on the CPU (and
compiled for sm_90: fp8 needs sm_89+), compiled and run on the GPU with
PALLAS_GPU_TESTS=gpu or in the gpu-marked test; its argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import ON_DEVICE, check_all_compile, fresh_key, has_gpu, triton_mode

import pallas_gpu as plgpu
from jax_kernel_runtime.triton import SHARED_MEMORY_LIMITS
from pallas_gpu.ops import _attention_sm90, _common
from pallas_gpu.ops import attention_fp8 as af


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def quantized(shape, spread=1.0):
    """Random q, k, v (normal, times ``spread``) quantized to e4m3, with the f32 originals."""
    xs = [jax.random.normal(fresh_key(), shape, jnp.float32) * spread for _ in range(3)]
    return xs, [af.quantize(x) for x in xs]


# Relative (Frobenius) error of mha_fp8 against attention of the dequantized inputs in f32:
# measured 0.018-0.024 (the probabilities rounded to e4m3, 3 mantissa bits); twice that is
# the bound. Against the unquantized f32 inputs the inputs' own rounding adds as much again.
BOUND = 0.05


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["pallas", "triton"])
def test_mha_fp8_matches_the_f32_reference(causal, mode):
    shape = (2, 128, 2, 64)
    xs, ((q8, qs), (k8, ks), (v8, vs)) = quantized(shape, spread=2.0)
    interpret = True if mode == "pallas" else triton_mode()
    if mode == "pallas" and ON_DEVICE:
        pytest.skip("pallas-core's interpret mode is covered on the CPU")
    sm_scale = shape[-1] ** -0.5
    out = af.mha_fp8(q8, k8, v8, qs, ks, vs, sm_scale=sm_scale, causal=causal, interpret=interpret,
                     block_q=32, block_k=64)  # fmt: skip
    ref = af.mha_fp8_reference(
        q8, k8, v8, qs, ks, vs, sm_scale=sm_scale, causal=causal, out_dtype=jnp.float32
    )
    assert out.dtype == jnp.bfloat16 and out.shape == shape
    assert rel_err(out, ref) < BOUND
    from pallas_gpu.ops.attention import mha_reference

    unquantized = mha_reference(*xs, None, sm_scale=sm_scale, causal=causal)
    assert rel_err(out, unquantized) < 2 * BOUND
    if mode == "triton" and not ON_DEVICE:
        f = lambda q, k, v: af.mha_fp8(q, k, v, qs, ks, vs, causal=causal, block_q=32, block_k=64)  # noqa: E731
        assert check_all_compile(f, [q8, k8, v8], plgpu.CompilerParams(num_warps=4, num_stages=2), (90,)) == 1


def test_v_transposed_and_residuals():
    shape = (1, 64, 3, 32)
    _, ((q8, qs), (k8, ks), (v8, vs)) = quantized(shape)
    vt = jnp.transpose(v8, (0, 2, 3, 1))
    out, lse = af.mha_fp8(q8, k8, vt, qs, ks, vs, v_transposed=True, out_dtype=jnp.float32, interpret=True,
                          return_residuals=True)  # fmt: skip
    ref = af.mha_fp8_reference(q8, k8, v8, qs, ks, vs, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32 and rel_err(out, ref) < BOUND
    qf, kf = q8.astype(jnp.float32) * qs, k8.astype(jnp.float32) * ks
    logits = jnp.einsum("bqhc,bkhc->bhqk", qf, kf, precision="highest")
    np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, axis=-1), rtol=1e-4, atol=1e-4)


def test_traced_scales_under_jit():
    shape = (1, 64, 2, 32)
    _, ((q8, qs), (k8, ks), (v8, vs)) = quantized(shape)
    f = jax.jit(lambda q, k, v, a, b, c: af.mha_fp8(q, k, v, a, b, c, causal=True, interpret=True))
    ref = af.mha_fp8_reference(q8, k8, v8, qs, ks, vs, causal=True, out_dtype=jnp.float32)
    assert rel_err(f(q8, k8, v8, qs, ks, vs), ref) < BOUND
    # A different scale is a different result, not a cached constant.
    assert rel_err(f(q8, k8, v8, qs, ks, 2 * vs), 2 * ref) < BOUND


def test_quantize_round_trips_within_e4m3():
    x = jax.random.normal(fresh_key(), (4096,), jnp.float32) * 37.0
    x8, s = af.quantize(x)
    assert x8.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(x8.astype(jnp.float32)))) == 448.0  # the largest finite e4m3
    assert rel_err(x8.astype(jnp.float32) * s, x) < 0.04  # 3 mantissa bits
    z8, zs = af.quantize(jnp.zeros(8))
    assert float(zs) == 1.0 and not jnp.any(z8.astype(jnp.float32))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q=jnp.bfloat16), TypeError, "q must be float8_e4m3fn"),
        (dict(v_shape=(1, 64, 2, 16)), ValueError, "must agree in batch, heads and head_dim"),
        (dict(scale=jnp.ones(2)), ValueError, "q_scale must be a scalar"),
        (dict(out_dtype=jnp.int32), TypeError, "out_dtype must be bfloat16"),
        (dict(block_q=48), ValueError, "block_q=48 must divide seq_len 64"),
    ],
)
def test_bad_arguments_are_named(change, error, match):
    q8 = jnp.zeros((1, 64, 2, 32), change.get("q", jnp.float8_e4m3fn))
    k8 = jnp.zeros((1, 64, 2, 32), jnp.float8_e4m3fn)
    v8 = jnp.zeros(change.get("v_shape", (1, 64, 2, 32)), jnp.float8_e4m3fn)
    kw = {k: change[k] for k in ("out_dtype", "block_q") if k in change}
    with pytest.raises(error, match=match):
        af.mha_fp8(q8, k8, v8, change.get("scale", 1.0), 1.0, 1.0, interpret=True, **kw)


def test_grad_says_forward_only():
    _, ((q8, qs), (k8, ks), (v8, vs)) = quantized((1, 32, 1, 16))
    f = lambda s: af.mha_fp8(q8, k8, v8, s, ks, vs, out_dtype=jnp.float32, interpret=True).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="forward .inference. kernel"):
        jax.grad(f)(qs)


def test_gluon_form_compiles_for_sm90_on_any_machine():
    # The fp8 form of mha's Hopper Gluon kernel (FP8=True): e4m3 wgmmas, V read k-major.
    for causal in (False, True):
        cfg = _attention_sm90.fp8_kernel_config("bfloat16", 2, 256, 512, 2, 128, causal)
        assert cfg.function == "mha_forward_sm90" and cfg.block_dims == (384, 1, 1)
        assert 0 < cfg.shared_memory_bytes <= SHARED_MEMORY_LIMITS[90]


def test_fp8_slots_are_read_at_every_call(monkeypatch):
    # FP8_NUM_BUFFERS was read inside a custom_vmap whose trace JAX caches: every slot count after
    # the first lowered the first one's kernel (benchmarks/gpu_attention_fp8.py timed one kernel thrice).
    f8 = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.float8_e4m3fn)
    vt = jax.ShapeDtypeStruct((1, 2, 128, 256), jnp.float8_e4m3fn)
    sc = jax.ShapeDtypeStruct((2,), jnp.float32)
    texts = []
    for nbuf in (3, 5, 3):
        monkeypatch.setattr(_attention_sm90, "FP8_NUM_BUFFERS", nbuf)
        f = lambda q, k, v, s: _attention_sm90.forward_fp8(q, k, v, s, False, jnp.bfloat16)  # noqa: E731
        texts.append(jax.jit(f).trace(f8, f8, vt, sc).lower(lowering_platforms=("cuda",)).as_text())
    assert texts[0] != texts[1] and texts[0] == texts[2]


def test_implementation_choice(monkeypatch):
    x = jnp.zeros((1, 128, 1, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="implementation must be None, 'pallas' or 'gluon'"):
        af.mha_fp8(x, x, x, 1.0, 1.0, 1.0, implementation="cudnn", interpret=True)
    with pytest.raises(ValueError, match="implementation='gluon' does not apply here: interpret mode"):
        af.mha_fp8(x, x, x, 1.0, 1.0, 1.0, implementation="gluon", interpret=True)
    monkeypatch.setattr(af, "compute_capability", lambda: 80)
    with pytest.raises(ValueError, match="does not apply here: compute capability 80"):
        af.mha_fp8(x, x, x, 1.0, 1.0, 1.0, implementation="gluon")
    monkeypatch.setattr(af, "compute_capability", lambda: 90)
    if _common.triton_release() in _common.GLUON_VALIDATED_TRITON:
        assert af._implementation("gluon", x, x, 0.1, None, None, None, None, False) == "gluon"
    else:  # a Triton release the Gluon kernels were not run on: refused with the reason
        with pytest.raises(ValueError, match="does not apply here: Triton"):
            af._implementation("gluon", x, x, 0.1, None, None, None, None, False)
    assert af._implementation(None, x, x, 0.1, 64, None, None, None, False) == "pallas"  # a launch given
    y = jnp.zeros((1, 128, 1, 64), jnp.float8_e4m3fn)
    assert af._implementation(None, y, y, 0.1, None, None, None, None, False) == "pallas"  # head_dim 64


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("implementation", ["pallas", "gluon"])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_fp8_default_launch_on_gpu(causal, implementation):
    shape = (2, 1024, 4, 128)
    xs, ((q8, qs), (k8, ks), (v8, vs)) = quantized(shape)
    out = af.mha_fp8(q8, k8, v8, qs, ks, vs, sm_scale=128**-0.5, causal=causal, implementation=implementation)
    ref = af.mha_fp8_reference(
        q8, k8, v8, qs, ks, vs, sm_scale=128**-0.5, causal=causal, out_dtype=jnp.float32
    )
    assert rel_err(out, ref) < BOUND


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_gluon_form_under_vmap_on_gpu():
    shape = (2, 1, 256, 2, 128)
    _, ((q8, qs), (k8, ks), (v8, vs)) = quantized(shape)
    f = lambda q, k, v: af.mha_fp8(q, k, v, qs, ks, vs, sm_scale=0.1, causal=True, implementation="gluon")  # noqa: E731
    out = jax.vmap(f)(q8, k8, v8)
    for i in range(2):
        ref = af.mha_fp8_reference(q8[i], k8[i], v8[i], qs, ks, vs, sm_scale=0.1, causal=True)
        assert rel_err(out[i], ref) < BOUND
