"""The generated kernels compile to cubins for sm_80 and sm_90 without a GPU
(``triton.compile`` with an explicit ``GPUTarget``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import lowered
from jax import lax

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src.compile import compiler


def add_kernel():
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    x = jnp.zeros((1000,), jnp.float32)
    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(8,),
        in_specs=[pl.BlockSpec((128,), lambda i: (i,))] * 2,
        out_specs=pl.BlockSpec((128,), lambda i: (i,)),
    )
    return f, (x, x)


def softmax_kernel():
    def kernel(x_ref, o_ref):
        v = x_ref[...]
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    x = jnp.zeros((64, 100), jnp.float32)  # rows of 100: padded to 128
    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(16,),
        in_specs=[pl.BlockSpec((4, 100), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((4, 100), lambda i: (i, 0)),
    )
    return f, (x,)


def matmul_kernel(dtype=jnp.bfloat16):
    def kernel(a_ref, b_ref, o_ref):
        acc = jnp.zeros((64, 64), jnp.float32)

        def body(k, acc):
            a = a_ref[:, pl.ds(pl.multiple_of(k * 32, 32), 32)]
            b = b_ref[pl.ds(pl.multiple_of(k * 32, 32), 32), :]
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, 256 // 32, body, acc)
        o_ref[...] = acc.astype(o_ref.dtype)

    a = jnp.zeros((256, 256), dtype)
    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((256, 256), dtype),
        grid=(4, 4),
        in_specs=[pl.BlockSpec((64, 256), lambda i, j: (i, 0)), pl.BlockSpec((256, 64), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((64, 64), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
    )
    return f, (a, a)


def control_flow_kernel():
    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        v = x_ref[...]
        n, s = lax.while_loop(lambda c: c[0] < i + 3, lambda c: (c[0] + 1, c[1] * 0.5 + v), (0, v))
        o_ref[...] = lax.cond(i % 2 == 0, lambda: s, lambda: -s) + jnp.argmax(v, axis=1)[:, None].astype(
            jnp.float32
        )

        @pl.when(i == 1)
        def _():
            o_ref[...] += lax.cumsum(v, axis=1, reverse=True) + lax.rev(v, (0,))

    x = jnp.zeros((40, 24), jnp.float32)
    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(5,),
        in_specs=[pl.BlockSpec((8, 24), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 24), lambda i: (i, 0)),
    )
    return f, (x,)


def math_kernel():
    def kernel(x_ref, i_ref, o_ref, p_ref):
        v = x_ref[...]
        o_ref[...] = (
            jnp.tanh(v) + jnp.log1p(jnp.abs(v)) + lax.erf(v) + jnp.round(v) + jax.nn.sigmoid(v)
        ).astype(o_ref.dtype)
        w = i_ref[...]
        p_ref[...] = (w >> 2) ^ (w * 3) + jnp.max(w, axis=0, keepdims=True)
        plgpu.atomic_add(o_ref, (pl.ds(0, 1), slice(None)), jnp.ones((1, 32), o_ref.dtype))

    x = jnp.zeros((16, 32), jnp.bfloat16)
    w = jnp.zeros((16, 32), jnp.int32)
    f = pl.pallas_call(
        kernel, (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(w.shape, jnp.int32))
    )
    return f, (x, w)


KERNELS = {"add": add_kernel, "softmax": softmax_kernel, "matmul": matmul_kernel,
           "control_flow": control_flow_kernel, "math": math_kernel}  # fmt: skip


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_compiles_to_cubin(name, cc):
    f, args = KERNELS[name]()
    lk = lowered(f, *args)
    compiled = compiler.compile_kernel(
        lk, cc, tuple(sorted(plgpu.CompilerParams().compile_options().items()))
    )
    cubin = compiled.asm["cubin"]
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
    assert f"sm_{cc}" in compiled.asm["ptx"] or f"sm_{cc}a" in compiled.asm["ptx"]
    assert compiled.metadata.name == lk.name


def test_launch_config_from_runtime():
    import jax_kernel_runtime as jkr

    f, args = matmul_kernel()
    lk = lowered(f, *args)
    ((_, cfg),) = compiler.compiled_configs(lk, 90, [plgpu.CompilerParams(num_warps=8, num_stages=2)], "")
    assert isinstance(cfg, jkr.KernelConfig)
    assert cfg.block_dims == (256, 1, 1)
    assert lk.launch_grid == (16, 1, 1)
