"""``plgpu.CompilerParams(use_tma=True, warp_specialize=True)``: block Ref
accesses through TMA tensor descriptors, warp-specialized loops.

Each kernel runs (Triton's interpreter here, the GPU with
``PALLAS_GPU_TESTS=gpu``) against jnp on random data, with partial edge
blocks, so the descriptors' zero fill and clipped stores are exercised; the
generated source and the sm_90 PTX show which accesses took the TMA path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import ON_DEVICE, Runner, assert_close, lowered, random
from jax import lax

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src.compile import compiler

F32 = jnp.float32


def matmul(a, b, *, bm=64, bn=64, bk=32, use_tma=True, warp_specialize=False, out_dtype=None, call=None):
    (m, k), n = a.shape, b.shape[1]

    def kernel(a_ref, b_ref, o_ref):
        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            return acc + jnp.dot(a_ref[:, pl.ds(k0, bk)], b_ref[pl.ds(k0, bk), :], preferred_element_type=F32)

        o_ref[...] = lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), F32)).astype(o_ref.dtype)

    return (call or Runner().call)(
        kernel,
        jax.ShapeDtypeStruct((m, n), out_dtype or a.dtype),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(use_tma=use_tma, warp_specialize=warp_specialize),
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_with_partial_edge_blocks(dtype):
    a, b = random((200, 128), dtype), random((128, 176), dtype)  # 200 = 3 blocks + 8 rows; 176 = 2 + 48
    out = matmul(a, b, out_dtype=F32)(a, b)
    assert_close(
        out, jnp.dot(a, b, preferred_element_type=F32), rtol=2e-2 if dtype != F32 else 1e-4, atol=0.5
    )


def test_source_uses_descriptors_only_where_tma_fits():
    a, b = random((256, 128), jnp.bfloat16), random((128, 128), jnp.bfloat16)
    src = lowered(matmul(a, b, call=pl.pallas_call), a, b).body
    assert src.count("tl.make_tensor_descriptor(") == 3  # a, b and the output: one each
    assert ".load([" in src and ".store([" in src and "tl.load(" not in src and "tl.store(" not in src
    plain = lowered(matmul(a, b, use_tma=False, call=pl.pallas_call), a, b).body
    assert "make_tensor_descriptor" not in plain and "tl.load(" in plain

    # A strided slice and a 1-element-wide inner dim (4 bytes < 16) keep pointer arithmetic.
    def kernel(x_ref, o_ref, c_ref):
        o_ref[...] = x_ref[pl.ds(0, 32, stride=2), :] * 2
        c_ref[...] = x_ref[:, 0:1] + 1

    x = random((64, 128), F32)
    f = Runner().call(
        kernel,
        (jax.ShapeDtypeStruct((32, 128), F32), jax.ShapeDtypeStruct((64, 1), F32)),
        compiler_params=plgpu.CompilerParams(use_tma=True),
    )
    o, c = f(x)
    assert_close(o, x[::2] * 2)
    assert_close(c, x[:, :1] + 1)
    src = lowered(
        pl.pallas_call(kernel, f_shapes(), compiler_params=plgpu.CompilerParams(use_tma=True)), x
    ).body
    assert "tl.load(" in src and ".store([" in src  # the (32, 128) store fits TMA; the loads do not


def f_shapes():
    return (jax.ShapeDtypeStruct((32, 128), F32), jax.ShapeDtypeStruct((64, 1), F32))


def test_squeezed_dims_3d_into_a_bf16_output():
    # A (batch, rows, cols) array read with the batch dim squeezed: the descriptor box is
    # (1, 32, 64), reshaped to (32, 64); the result is stored into a bf16 output.
    x = random((3, 96, 64), F32)

    def kernel(x_ref, o_ref):
        o_ref[...] = (jnp.tanh(x_ref[...]) * 3).astype(o_ref.dtype)

    out = Runner().call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
        grid=(3, 3),
        in_specs=[pl.BlockSpec((None, 32, 64), lambda b, i: (b, i, 0))],
        out_specs=pl.BlockSpec((None, 32, 64), lambda b, i: (b, i, 0)),
        compiler_params=plgpu.CompilerParams(use_tma=True),
    )(x)
    assert_close(out, (jnp.tanh(x) * 3).astype(jnp.bfloat16))


def test_revisited_output_block_in_registers():
    # The k axis is sequential (the output block is revisited): the output is loaded
    # once before the loop and stored once after it, both as TMA tiles.
    a, b = random((128, 256), F32), random((256, 64), F32)

    def kernel(a_ref, b_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=F32)

    kw = dict(
        grid=(2, 4),
        in_specs=[pl.BlockSpec((64, 64), lambda i, k: (i, k)), pl.BlockSpec((64, 64), lambda i, k: (k, 0))],
        out_specs=pl.BlockSpec((64, 64), lambda i, k: (i, 0)),
        compiler_params=plgpu.CompilerParams(use_tma=True),
    )
    out = Runner().call(kernel, jax.ShapeDtypeStruct((128, 64), F32), **kw)(a, b)
    # On the GPU the f32 dot runs in TF32 (JAX's default precision there).
    tol = dict(rtol=5e-3, atol=0.2) if ON_DEVICE else dict(rtol=1e-4, atol=1e-3)
    assert_close(out, jnp.dot(a, b, precision="highest"), **tol)
    src = lowered(pl.pallas_call(kernel, jax.ShapeDtypeStruct((128, 64), F32), **kw), a, b).body
    assert src.count("tl.make_tensor_descriptor(") == 3 and "tl.load(" not in src


def test_sm90_ptx_has_tma_copies():
    a, b = jnp.zeros((1024, 1024), jnp.bfloat16), jnp.zeros((1024, 1024), jnp.bfloat16)
    cp = plgpu.CompilerParams(use_tma=True, num_warps=8)
    lk = lowered(matmul(a, b, bm=128, bn=128, bk=64, call=pl.pallas_call), a, b)
    compiled = compiler.compile_kernel(lk, 90, tuple(sorted(cp.compile_options().items())))
    assert compiled.asm["ptx"].count("cp.async.bulk.tensor") >= 3
    assert compiled.metadata.global_scratch_size >= 3 * 128  # one 128-byte descriptor per array


def test_warp_specialize_marks_the_outermost_loop_only():
    def kernel(x_ref, o_ref):
        def outer(i, acc):
            return lax.fori_loop(0, 2, lambda j, c: c + x_ref[...] * (i + j).astype(F32), acc)

        o_ref[...] = lax.fori_loop(0, 3, outer, jnp.zeros_like(x_ref))

    x = random((16, 128), F32)
    kw = dict(compiler_params=plgpu.CompilerParams(warp_specialize=True))
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), interpret=plgpu.InterpretParams(), **kw)(
        x
    )
    assert_close(out, x * sum(i + j for i in range(3) for j in range(2)))
    src = lowered(pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, F32), **kw), x).body
    assert src.count("warp_specialize=True") == 1


def test_warp_specialize_compiles_for_blackwell_and_is_refused_before():
    a, b = jnp.zeros((512, 512), jnp.bfloat16), jnp.zeros((512, 512), jnp.bfloat16)
    cp = plgpu.CompilerParams(use_tma=True, warp_specialize=True, num_warps=4)
    lk = lowered(
        matmul(a, b, bm=128, bn=128, bk=64, use_tma=True, warp_specialize=True, call=pl.pallas_call), a, b
    )
    ((_, cfg),) = compiler.compiled_configs(lk, 100, [cp], "pallas_call 'mm'")
    assert cfg.block_dims[0] > 4 * 32  # the specialized partitions add warps beyond num_warps
    for cc in (80, 90):
        with pytest.raises(ValueError, match=rf"pallas_call 'mm'.*warp_specialize=True.*sm_100.*sm_{cc}"):
            compiler.compiled_configs(lk, cc, [cp], "pallas_call 'mm'")


def test_configs_of_one_call_must_agree_on_source_options():
    a = random((64, 64), F32)
    f = pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
        jax.ShapeDtypeStruct(a.shape, F32),
        compiler_params=[plgpu.CompilerParams(), plgpu.CompilerParams(use_tma=True)],
        interpret=plgpu.InterpretParams(),
        name="agree",
    )
    with pytest.raises(
        ValueError, match=r"pallas_call 'agree'.*compiler_params\[1\] has use_tma=True.*autotune"
    ):
        f(a)


def test_use_tma_must_be_a_bool():
    with pytest.raises(ValueError, match="use_tma must be True or False, got 'yes'"):
        plgpu.CompilerParams(use_tma="yes")
