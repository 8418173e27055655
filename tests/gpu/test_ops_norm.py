"""The memory-bound forward passes of pallas_gpu.ops: ``rms_norm``'s
single-pass forward kernel (the undifferentiated call) against plain jnp on
fresh random data, f32 and bf16, rows that are not powers of two, several
rows per program with a partial last block; every launch option; JAX's
Pallas ``rms_norm`` in interpret mode; the argument checks; and ``gpu``-marked
checks of softmax, layer norm and RMS norm forward at the benchmark size
(16384 x 8192, f32 and bf16). (``test_ops_norms.py`` covers the gradients.)"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import ON_DEVICE, assert_close, check_all_compile, fresh_key, triton_mode

import pallas_gpu as plgpu
from pallas_gpu.ops import _norm as norm_mod
from pallas_gpu.ops import layer_norm as ln_mod
from pallas_gpu.ops import rms_norm as rms_mod
from pallas_gpu.ops import softmax as softmax_mod


def data(shape, dtype):
    x = (2.0 + 3.0 * jax.random.normal(fresh_key(), shape, jnp.float32)).astype(dtype)
    w, b = (jax.random.normal(fresh_key(), shape[-1:], jnp.float32).astype(dtype) for _ in range(2))
    return x, w, b


def rms_norm_np(x, w, b, eps=1e-5):
    x, w, b = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, w, b))
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w + b


def tolerance(dtype):
    return dict(rtol=2e-2, atol=5e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((37, 768), jnp.float32),  # 5 rows a program, partial last block
        ((3, 5, 100), jnp.float32),  # leading dims, width not a power of two
        ((4, 8192), jnp.float32),  # one row a program
        ((19, 96), jnp.bfloat16),
        ((6, 3000), jnp.bfloat16),
    ],
)
def test_rms_norm_forward(shape, dtype):
    x, w, b = data(shape, dtype)
    f = lambda x, w, b: rms_mod.rms_norm(x, w, b, interpret=triton_mode())  # noqa: E731
    out = f(x, w, b)
    assert out.shape == shape and out.dtype == dtype
    assert_close(out.astype(jnp.float32), rms_norm_np(x, w, b).astype(np.float32), **tolerance(dtype))
    if not ON_DEVICE and shape == (37, 768):
        assert check_all_compile(f, [x, w, b], plgpu.CompilerParams(num_warps=8, num_stages=1)) == 1


def test_forward_reads_x_and_writes_y_only():
    # The undifferentiated call is one pallas_call with one output (no mean/rstd residuals);
    # under jax.vjp the residual-saving kernel runs instead.
    x, w, b = data((8, 256), jnp.float32)
    f = lambda x: rms_mod.rms_norm(x, w, b, interpret=triton_mode())  # noqa: E731
    calls = pallas_calls(jax.make_jaxpr(f)(x).jaxpr)
    assert [(c.params["grid_mapping"].kernel_name, len(c.outvars)) for c in calls] == [
        ("rms_norm_forward", 1)
    ]
    out, vjp = jax.vjp(f, x)
    dx_ref = jax.vjp(lambda x: rms_mod.rms_norm_reference(x, w, b), x)[1](out)[0]
    assert_close(vjp(out)[0], dx_ref, rtol=1e-4, atol=1e-4)


def pallas_calls(jaxpr):
    """The pallas_call equations in ``jaxpr`` and its sub-jaxprs."""
    from jax.extend import core as jex_core

    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
            continue
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    found += pallas_calls(getattr(sub, "jaxpr", sub))
    return found


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_rows=3),
        dict(block_rows=1, num_warps=1),
        dict(evict=None),
        dict(evict="evict_last", num_warps=8),
    ],
)
def test_forward_launch_options(kw):
    x, w, b = data((10, 200), jnp.float32)
    out = rms_mod.forward(x, w, b, eps=1e-3, interpret=triton_mode(), **kw)
    assert_close(out, rms_norm_np(x, w, b, eps=1e-3).astype(np.float32), rtol=1e-5, atol=1e-5)


def test_default_launch():
    assert rms_mod.forward_launch(16384, 8192, 4) == (1, 16)  # one f32 row of 32 KiB, 16 warps
    assert rms_mod.forward_launch(16384, 8192, 2) == (1, 8)
    assert rms_mod.forward_launch(16384, 1024, 4) == (4, 8)
    assert rms_mod.forward_launch(3, 100, 4) == (4, 1)
    assert rms_mod.forward_launch(100, 100, 4, num_warps=2, block_rows=7) == (7, 2)


def test_default_launch_of_softmax_and_layer_norm():
    # the measured defaults (H200, 16384 x 8192): softmax 16 warps, layer norm 16 (f32) or 4 (bf16)
    assert softmax_mod.launch(16384, 8192) == (1, 16)
    assert softmax_mod.launch(8192, 16384) == (1, 4)  # rows over 8192 elements keep JAX's 4
    assert softmax_mod.launch(131072, 1024) == (4, 8)
    assert softmax_mod.launch(3, 100, num_warps=2, block_rows=5) == (5, 2)
    assert norm_mod.forward_launch(16384, 8192, 4) == (1, 16)
    assert norm_mod.forward_launch(16384, 8192, 2) == (1, 4)
    assert norm_mod.forward_launch(131072, 1024, 4) == (4, 8)
    assert norm_mod.forward_launch(131072, 1024, 2) == (4, 4)
    assert norm_mod.forward_evict(2) == "evict_first" and norm_mod.forward_evict(4) is None


@pytest.mark.parametrize(
    "kw", [dict(block_rows=3), dict(block_rows=1, num_warps=1), dict(evict=None), dict(evict="evict_last")]
)
@pytest.mark.parametrize("op", ["softmax", "layer_norm"])
def test_softmax_and_layer_norm_launch_options(op, kw):
    x, w, b = data((10, 200), jnp.bfloat16)
    xf = x.astype(jnp.float32)
    if op == "softmax":
        out, ref = softmax_mod.forward(x, interpret=triton_mode(), **kw), jax.nn.softmax(xf, axis=-1)
    else:
        out = norm_mod.forward(x, w, b, eps=1e-5, center=True, num_warps=kw.get("num_warps"), num_stages=1,
                               interpret=triton_mode(), name="layer_norm",
                               **{k: v for k, v in kw.items() if k != "num_warps"})[0]  # fmt: skip
        ref = norm_mod.reference(x, w, b, eps=1e-5, center=True)
    assert out.dtype == jnp.bfloat16
    assert_close(out.astype(jnp.float32), ref.astype(jnp.float32), rtol=2e-2, atol=5e-2)


def test_softmax_forward_bad_arguments():
    with pytest.raises(ValueError, match=r"evict must be 'evict_first', 'evict_last' or None; got 'x'"):
        softmax_mod.forward(jnp.zeros((4, 8)), evict="x")
    with pytest.raises(ValueError, match=r"block_rows must be a positive int or None; got 0"):
        softmax_mod.forward(jnp.zeros((4, 8)), block_rows=0)


def test_pallas_core_interpreter():
    x, w, b = data((9, 130), jnp.float32)
    out = rms_mod.rms_norm(x, w, b, interpret=True)
    assert_close(out, rms_norm_np(x, w, b).astype(np.float32), rtol=1e-5, atol=1e-5)


def test_matches_jax_pallas_rms_norm_in_interpret_mode():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        upstream = pytest.importorskip("jax.experimental.pallas.ops.gpu.rms_norm")
    x, w, b = data((1, 6, 256), jnp.float32)  # JAX's takes [batch, seq, features]
    theirs = upstream.rms_norm(x, w, b, interpret=True)
    ours = rms_mod.rms_norm(x, w, b, interpret=triton_mode())
    assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: rms_mod.rms_norm(jnp.zeros((4, 8)), jnp.zeros(7), jnp.zeros(8)),
         r"rms_norm: weight must have shape \(8,\), the size of x's last axis; got \(7,\)"),
        (lambda: rms_mod.rms_norm(jnp.zeros(()), jnp.zeros(()), jnp.zeros(())), r"rms_norm: x must have a feature axis"),
        (lambda: rms_mod.rms_norm(jnp.zeros((4, 8)), jnp.zeros(8), jnp.zeros(8), backward_pass_impl="cuda"),
         r"rms_norm: backward_pass_impl must be 'triton' or 'xla', got 'cuda'"),
        (lambda: rms_mod.rms_norm(jnp.zeros((1, 70000)), jnp.zeros(70000), jnp.zeros(70000)),
         r"rms_norm: rows of 70000 features do not fit in one program"),
        (lambda: rms_mod.forward(jnp.zeros((4, 8)), jnp.zeros(8), jnp.zeros(8), evict="evict_normal"),
         r"evict must be 'evict_first', 'evict_last' or None; got 'evict_normal'"),
        (lambda: rms_mod.forward(jnp.zeros((4, 8)), jnp.zeros(8), jnp.zeros(8), block_rows=0),
         r"block_rows must be a positive int or None; got 0"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------
# On the GPU, at the benchmark size (compiled, default arguments)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm"])
def test_forward_at_benchmark_size_on_gpu(op, dtype):
    x, w, b = data((16384, 8192), dtype)
    xf = x.astype(jnp.float32)
    if op == "softmax":
        out, ref = softmax_mod.softmax(x), jax.nn.softmax(xf, axis=-1)
    elif op == "layer_norm":
        xc = xf - xf.mean(-1, keepdims=True)
        out = ln_mod.layer_norm(x, w, b)
        ref = xc / jnp.sqrt((xc * xc).mean(-1, keepdims=True) + 1e-5) * w.astype(jnp.float32) + b.astype(
            jnp.float32
        )
    else:
        out = rms_mod.rms_norm(x, w, b)
        ref = xf / jnp.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5) * w.astype(jnp.float32) + b.astype(
            jnp.float32
        )
    assert out.dtype == dtype and out.shape == x.shape
    tol = (
        dict(rtol=2e-2, atol=5e-2)
        if dtype == jnp.bfloat16
        else dict(rtol=1e-4, atol=1e-5 if op == "softmax" else 1e-4)
    )
    assert_close(out.astype(jnp.float32), ref, **tol)
