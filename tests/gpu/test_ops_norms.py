"""pallas_gpu.ops.layer_norm / rms_norm / softmax against plain-jnp formulas
(forward, and the gradients of x, weight and bias), through Triton's
interpreter on the CPU (also compiled for sm_80 and sm_90), or on the GPU
with PALLAS_GPU_TESTS=gpu; the argument checks; the APIs of JAX's
``jax.experimental.pallas.ops.gpu`` modules."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import ON_DEVICE, assert_close, check_all_compile, fresh_key, triton_mode

import pallas_gpu as plgpu
from pallas_gpu.ops import layer_norm as ln_mod
from pallas_gpu.ops import rms_norm as rms_mod
from pallas_gpu.ops import softmax as softmax_mod


def layer_norm_jnp(x, w, b, eps=1e-5):
    x = x.astype(jnp.float32)
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + eps) * w + b


def rms_norm_jnp(x, w, b, eps=1e-5):
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w + b


NORMS = {"layer_norm": (ln_mod.layer_norm, layer_norm_jnp), "rms_norm": (rms_mod.rms_norm, rms_norm_jnp)}


def data(shape, dtype):
    n = shape[-1]
    x, dy = (jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype) for _ in range(2))
    w, b = (jax.random.normal(fresh_key(), (n,), jnp.float32).astype(dtype) for _ in range(2))
    return x, w, b, dy


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((3, 5, 100), jnp.float32),
        ((37, 768), jnp.float32),
        ((2, 4096), jnp.float32),
        ((19, 96), jnp.bfloat16),
    ],
)
def test_norm_forward_and_backward(name, shape, dtype):
    fn, formula = NORMS[name]
    x, w, b, dy = data(shape, dtype)
    f = lambda x, w, b: fn(x, w, b, interpret=triton_mode())  # noqa: E731
    out, vjp = jax.vjp(f, x, w, b)
    up = lambda a: a.astype(jnp.float32)  # noqa: E731
    ref, ref_vjp = jax.vjp(lambda x, w, b: formula(x, w, b), up(x), up(w), up(b))
    grads, ref_grads = vjp(dy), ref_vjp(up(dy))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
    if dtype == jnp.bfloat16:  # weight and bias gradients sum over all rows in bf16 output
        tol_wb = dict(rtol=3e-2, atol=3e-2 * shape[0])
    else:
        tol_wb = dict(rtol=1e-4, atol=1e-4 * shape[0])
    assert out.dtype == dtype and out.shape == shape
    assert_close(up(out), ref, **tol)
    assert_close(up(grads[0]), ref_grads[0], err_msg="dx", **tol)
    assert_close(up(grads[1]), ref_grads[1], err_msg="dweight", **tol_wb)
    assert_close(up(grads[2]), ref_grads[2], err_msg="dbias", **tol_wb)
    if not ON_DEVICE:
        n = check_all_compile(lambda x, w, b, dy: jax.vjp(f, x, w, b)[1](dy), [x, w, b, dy],
                              plgpu.CompilerParams(num_warps=4, num_stages=3))  # fmt: skip
        assert n == 2  # forward, backward


@pytest.mark.parametrize("name", sorted(NORMS))
def test_xla_backward_and_pallas_core_interpreter(name):
    fn, _ = NORMS[name]
    x, w, b, dy = data((6, 48), jnp.float32)
    results = {}
    for label, kw in (("triton", {"interpret": triton_mode()}), ("xla", {"interpret": triton_mode(),
                      "backward_pass_impl": "xla"}), ("core", {"interpret": True})):  # fmt: skip
        out, vjp = jax.vjp(lambda x, w, b, kw=kw: fn(x, w, b, **kw), x, w, b)
        results[label] = (out, *vjp(dy))
    tol = 2e-2 if ON_DEVICE else 1e-5
    for label in ("xla", "core"):
        for a, r in zip(results[label], results["triton"]):
            assert_close(a, r, rtol=tol, atol=tol, err_msg=label)


def test_references_match_the_formulas():
    x, w, b, _ = data((4, 40), jnp.float32)
    assert_close(ln_mod.layer_norm_reference(x, w, b), layer_norm_jnp(x, w, b), rtol=1e-5, atol=1e-5)
    assert_close(rms_mod.rms_norm_reference(x, w, b), rms_norm_jnp(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape,dtype", [((8, 100), jnp.float32), ((3, 7, 1024), jnp.float32), ((33, 64), jnp.bfloat16)]
)
def test_softmax(shape, dtype):
    x = (jax.random.normal(fresh_key(), shape, jnp.float32) * 3).astype(dtype)
    f = lambda x: softmax_mod.softmax(x, interpret=triton_mode())  # noqa: E731
    out = f(x)
    ref = jax.nn.softmax(x.astype(jnp.float32), axis=-1)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-3)
    assert out.dtype == dtype
    assert_close(out.astype(jnp.float32), ref, **tol)
    if not ON_DEVICE:
        assert check_all_compile(f, [x], plgpu.CompilerParams(num_warps=4)) == 1


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: ln_mod.layer_norm(jnp.zeros((4, 8)), jnp.zeros(7), jnp.zeros(8)), ValueError,
         r"layer_norm: weight must have shape \(8,\).*got \(7,\)"),
        (lambda: rms_mod.rms_norm(jnp.zeros((4, 8)), jnp.zeros(8), jnp.zeros((1, 8))), ValueError,
         r"rms_norm: bias must have shape \(8,\)"),
        (lambda: ln_mod.layer_norm(jnp.zeros((4, 8)), jnp.zeros(8), jnp.zeros(8), backward_pass_impl="cuda"),
         ValueError, r"backward_pass_impl must be 'triton' or 'xla'"),
        (lambda: ln_mod.layer_norm(jnp.zeros((1, 70000)), jnp.zeros(70000), jnp.zeros(70000)), ValueError,
         r"rows of 70000 features do not fit in one program \(at most 65536\)"),
        (lambda: softmax_mod.softmax(jnp.zeros((4, 8)), axis=0), NotImplementedError, r"only the last axis"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_same_signatures_as_jax():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        up_ln = pytest.importorskip("jax.experimental.pallas.ops.gpu.layer_norm")
        up_rms = pytest.importorskip("jax.experimental.pallas.ops.gpu.rms_norm")
        up_sm = pytest.importorskip("jax.experimental.pallas.ops.gpu.softmax")
    for ours, theirs in ((ln_mod.layer_norm, up_ln.layer_norm), (rms_mod.rms_norm, up_rms.rms_norm),
                         (softmax_mod.softmax, up_sm.softmax)):  # fmt: skip
        expected = params(theirs)
        if ours is softmax_mod.softmax:  # ours picks the warps from the row length (None) for JAX's 4
            expected = [(n, k, None if n == "num_warps" else d) for n, k, d in expected]
        assert params(ours) == expected, ours


def params(fn):
    """Names, kinds and defaults of ``fn``'s parameters (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_lowering_errors_inside_ops_name_the_ops_line():
    # Frames in pallas_gpu/_src are hidden from error locations, the ops' own kernels are not.
    with pytest.raises(Exception, match=r"in kernel 'softmax' at .*ops/softmax\.py:\d+.*complex64"):
        softmax_mod.softmax(jnp.ones((4, 8), jnp.complex64), interpret=plgpu.InterpretParams())
