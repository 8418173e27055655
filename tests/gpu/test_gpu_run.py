"""The same kernels compiled by Triton and launched by jax_kernel_runtime on
a real GPU (skipped without one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import assert_close, random
from jax import lax

import pallas as pl
import pallas_gpu as plgpu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,block", [(4096, 1024), (1000, 128), (777, 100)])
def test_add(n, block):
    x, y = random((n,), jnp.float32), random((n,), jnp.float32)

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((n,), jnp.float32),
        grid=(pl.cdiv(n, block),),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))] * 2,
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
    )
    assert_close(jax.jit(f)(x, y), x + y)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax(dtype):
    x = random((64, 300), dtype)

    def kernel(x_ref, o_ref):
        v = x_ref[...].astype(jnp.float32)
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = (e / jnp.sum(e, axis=1, keepdims=True)).astype(o_ref.dtype)

    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, dtype),
        grid=(16,),
        in_specs=[pl.BlockSpec((4, 300), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((4, 300), lambda i: (i, 0)),
    )
    assert_close(f(x), jax.nn.softmax(x.astype(jnp.float32), axis=1).astype(dtype), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmul(dtype):
    m = k = n = 512
    a, b = random((m, k), dtype), random((k, n), dtype)

    def kernel(a_ref, b_ref, o_ref):
        def body(kk, acc):
            s = pl.multiple_of(kk * 64, 64)
            return acc + jnp.dot(
                a_ref[:, pl.ds(s, 64)],
                b_ref[pl.ds(s, 64), :],
                preferred_element_type=jnp.float32,
                precision=lax.Precision.HIGHEST,
            )

        o_ref[...] = lax.fori_loop(0, k // 64, body, jnp.zeros((128, 128), jnp.float32)).astype(o_ref.dtype)

    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((m, n), dtype),
        grid=(m // 128, n // 128),
        in_specs=[pl.BlockSpec((128, k), lambda i, j: (i, 0)), pl.BlockSpec((k, 128), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((128, 128), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=3),
    )
    ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    assert_close(f(a, b), ref.astype(dtype), dtype, rtol=2e-2, atol=0.5 if dtype == jnp.bfloat16 else 1e-2)


def test_control_flow_edge_blocks():
    x = random((40, 24), jnp.float32)

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        v = x_ref[...]
        acc = lax.fori_loop(0, 3, lambda j, c: c + v * j.astype(jnp.float32), jnp.zeros_like(v))
        o_ref[...] = lax.cond(i % 2 == 0, lambda: acc, lambda: -acc) + jnp.argmax(v, axis=1)[:, None].astype(
            jnp.float32
        )

    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(3,),
        in_specs=[pl.BlockSpec((16, 24), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, 24), lambda i: (i, 0)),
    )
    rows = jnp.arange(40) // 16
    acc = 3 * x
    ref = jnp.where((rows % 2 == 0)[:, None], acc, -acc) + jnp.argmax(x, axis=1)[:, None].astype(jnp.float32)
    assert_close(f(x), ref, rtol=1e-5, atol=1e-5)


def test_gpu_matches_interpreter():
    x = random((33, 70), jnp.float32)

    def kernel(x_ref, o_ref):
        v = x_ref[...]
        o_ref[...] = jnp.tanh(v) * lax.cumsum(v, axis=1) + jnp.sum(v, axis=0, keepdims=True)

    kw = dict(
        grid=(3,),
        in_specs=[pl.BlockSpec((16, 70), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, 70), lambda i: (i, 0)),
    )
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    gpu = pl.pallas_call(kernel, out_shape, **kw)(x)
    cpu = pl.pallas_call(kernel, out_shape, interpret=plgpu.InterpretParams(), **kw)(x)
    assert_close(gpu, cpu, rtol=1e-4, atol=1e-4)
