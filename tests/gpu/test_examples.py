"""The Pallas kernels of examples/ through pallas-gpu: the generated Triton kernel runs under
Triton's interpreter (compiled on the GPU with PALLAS_GPU_TESTS=gpu) against jnp, in several
dtypes and shapes (including ones the blocks do not divide), and compiles for sm_80 and sm_90."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import ON_DEVICE, assert_close, check_compiles, random

import pallas_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

import add as add_example  # noqa: E402
import flash_attention as attention_example  # noqa: E402
import layer_norm as layer_norm_example  # noqa: E402
import matmul as matmul_example  # noqa: E402
import softmax as softmax_example  # noqa: E402


class TritonBackend:
    """The examples' `backend` hook: pallas-gpu, interpreted on the CPU."""

    def __init__(self):
        self.compiler_params = None

    def call_kwargs(self, **gpu_params):
        self.compiler_params = plgpu.CompilerParams(**gpu_params)
        kw = {"compiler_params": self.compiler_params}
        if not ON_DEVICE:
            kw["interpret"] = plgpu.InterpretParams()
        return kw


def run_and_compile(fn, *args, **kw):
    """``fn(*args, backend=..., **kw)``, then compiles its kernel for the COMPILE_TARGETS."""
    backend = TritonBackend()
    out = fn(*args, backend=backend, **kw)
    if not ON_DEVICE:
        check_compiles(lambda *a: fn(*a, backend=TritonBackend(), **kw), args, backend.compiler_params)
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("n,block", [(4096, 1024), (1000, 256), (300, 96)])
def test_add(n, block, dtype):
    x, y = random((n,), dtype), random((n,), dtype)
    assert_close(run_and_compile(add_example.add, x, y, block=block), x + y)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,block_rows", [((64, 128), 8), ((50, 100), 16)])
def test_softmax(shape, block_rows, dtype):
    x = random(shape, dtype)
    out = run_and_compile(softmax_example.softmax, x, block_rows=block_rows)
    assert_close(
        out,
        jax.nn.softmax(x.astype(jnp.float32), axis=1).astype(dtype),
        atol=1e-2 if dtype != jnp.float32 else 1e-6,
    )


@pytest.mark.parametrize("shape,block_rows", [((64, 256), 8), ((37, 96), 4)])
def test_layer_norm(shape, block_rows):
    x = random(shape, jnp.float32)
    w, b = random(shape[1:], jnp.float32), random(shape[1:], jnp.float32)
    out = run_and_compile(layer_norm_example.layer_norm, x, w, b, block_rows=block_rows)
    assert_close(out, layer_norm_example.layer_norm_reference(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n,k,bm,bn,bk", [(128, 128, 128, 64, 64, 32), (96, 160, 64, 32, 32, 16)])
def test_matmul_k_loop(m, n, k, bm, bn, bk):
    x, y = random((m, k), jnp.bfloat16), random((k, n), jnp.bfloat16)
    out = run_and_compile(matmul_example.matmul_k_loop, x, y, bm=bm, bn=bn, bk=bk)
    assert_close(out, jnp.dot(x, y, preferred_element_type=jnp.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m,n,k,programs", [(384, 256, 128, 4), (256, 384, 64, 5), (128, 128, 64, 8)])
def test_matmul_persistent(m, n, k, programs):
    """Fewer programs than tiles (each walks several, some one more than others) and more."""
    x, y = random((m, k), jnp.bfloat16), random((k, n), jnp.bfloat16)
    out = run_and_compile(matmul_example.matmul_persistent, x, y, bm=64, bn=64, bk=32, programs=programs)
    assert_close(out, jnp.dot(x, y, preferred_element_type=jnp.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("seq,block_q,block_k", [(128, 32, 32), (192, 64, 32)])
def test_flash_attention(seq, block_q, block_k):
    q, k, v = (random((1, 2, seq, 32), jnp.float32, low=-1, high=1) for _ in range(3))
    out = run_and_compile(attention_example.flash_attention, q, k, v, block_q=block_q, block_k=block_k)
    tol = 2e-2 if ON_DEVICE else 1e-3  # the GPU's f32 dots use TF32
    assert_close(out, attention_example.attention_reference(q, k, v), rtol=tol, atol=tol)
