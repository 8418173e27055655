"""GPU-only primitives (``plgpu.atomic_and/or/xor/xchg/cas``, ``max_contiguous``,
``approx_tanh``, ``elementwise_inline_asm``, ``debug_barrier``): run under
Triton's interpreter and under Pallas' interpret mode against jnp, and
compiled to cubins for sm_80/sm_90."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import assert_close, lowered, random, triton_mode
from jax import lax

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src.compile import compiler

# The generated kernel under Triton's interpreter (compiled on the GPU with
# PALLAS_GPU_TESTS=gpu), and pallas-core's
# interpret mode (the primitives' discharge rules).
MODES = {"triton": triton_mode(), "pallas_interpret": True}


def compile_for(f, args, cc):
    lk = lowered(f, *args)
    return lk, compiler.compile_kernel(
        lk, cc, tuple(sorted(plgpu.CompilerParams().compile_options().items()))
    )


ATOMICS = {
    "and": (plgpu.atomic_and, np.bitwise_and),
    "or": (plgpu.atomic_or, np.bitwise_or),
    "xor": (plgpu.atomic_xor, np.bitwise_xor),
    "xchg": (plgpu.atomic_xchg, lambda old, val: val),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32])
@pytest.mark.parametrize("shape,block", [((16, 32), (8, 32)), ((13, 20), (5, 20))])
@pytest.mark.parametrize("op", sorted(ATOMICS))
def test_atomic_rmw(op, shape, block, dtype, mode):
    fn, ref_fn = ATOMICS[op]
    x, init = random(shape, dtype, low=0, high=12), random(shape, dtype, low=0, high=12)

    def kernel(x_ref, o_in, o_ref, old_ref):
        v = x_ref[...]
        keep = (v % 3) != 0
        old_ref[...] = fn(o_ref, None, v, mask=keep)

    spec = pl.BlockSpec(block, lambda i: (i, 0))
    out, old = pl.pallas_call(
        kernel,
        (jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape, dtype)),
        grid=(pl.cdiv(shape[0], block[0]),),
        in_specs=[spec, spec],
        out_specs=(spec, spec),
        input_output_aliases={1: 0},
        interpret=MODES[mode],
    )(x, init)
    x_np, init_np = np.asarray(x), np.asarray(init)
    want = np.where(x_np % 3 != 0, ref_fn(init_np, x_np), init_np)
    assert_close(out, want)
    # Masked-off lanes of the returned values are undefined on the GPU.
    assert_close(np.where(x_np % 3 != 0, old, 0), np.where(x_np % 3 != 0, init_np, 0))


def test_atomic_bitwise_rejects_floats():
    def kernel(o_ref):
        plgpu.atomic_or(o_ref, None, jnp.ones((8,), jnp.float32))

    with pytest.raises(TypeError, match="atomic_or needs a Ref of integers"):
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), interpret=MODES["triton"])()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_atomic_cas_scalar_counter(mode):
    if MODES[mode] is False:
        pytest.skip("relies on programs running in grid order; on a GPU they run concurrently")
    n = 7

    def kernel(o_in, o_ref, seen_ref):
        i = pl.program_id(0)
        # Sequential programs: each finds i where the previous one left it.
        seen_ref[0] = plgpu.atomic_cas(o_ref.at[0], i, i + 1)

    out, seen = pl.pallas_call(
        kernel,
        (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32)),
        grid=(n,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=(pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((1,), lambda i: (i,))),
        input_output_aliases={0: 0},
        interpret=MODES[mode],
    )(jnp.zeros((1,), jnp.int32))
    assert int(out[0]) == n
    assert_close(seen, np.arange(n, dtype=np.int32))


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
@pytest.mark.parametrize("shape,block", [((16, 16), (8, 16)), ((10, 6), (4, 6))])
def test_atomic_cas_blocks(shape, block, dtype, mode):
    init = random(shape, jnp.int32, low=0, high=1).astype(dtype)
    cmp = random(shape, jnp.int32, low=0, high=1).astype(dtype)  # about a third match
    val = random(shape, dtype)

    def kernel(init_ref, cmp_ref, val_ref, o_ref, old_ref):
        old_ref[...] = plgpu.atomic_cas(o_ref, cmp_ref[...], val_ref[...])

    spec = pl.BlockSpec(block, lambda i: (i, 0))
    out, old = pl.pallas_call(
        kernel,
        (jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape, dtype)),
        grid=(pl.cdiv(shape[0], block[0]),),
        in_specs=[spec] * 3,
        out_specs=(spec, spec),
        input_output_aliases={0: 0},
        interpret=MODES[mode],
    )(init, cmp, val)
    assert_close(out, jnp.where(init == cmp, val, init))
    assert_close(old, init)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("shape", [(8, 16), (6, 12)])
def test_max_contiguous_and_debug_barrier(shape, mode):
    x = random(shape, jnp.float32)

    def kernel(x_ref, o_ref):
        cols = plgpu.max_contiguous(lax.broadcasted_iota(jnp.int32, shape, 1), (1, shape[1]))
        plgpu.debug_barrier()
        o_ref[...] = x_ref[...] + cols.astype(jnp.float32)

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(shape, jnp.float32), interpret=MODES[mode])(x)
    assert_close(out, x + jnp.arange(shape[1], dtype=jnp.float32)[None, :])


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(8, 16), (5, 12)])
def test_approx_tanh(dtype, shape, mode):
    x = random(shape, dtype)

    def kernel(x_ref, o_ref):
        o_ref[...] = plgpu.approx_tanh(x_ref[...])

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(shape, dtype), interpret=MODES[mode])(x)
    assert_close(out, jnp.tanh(x), dtype, rtol=1e-2, atol=1e-2)


def test_approx_tanh_rejects_ints():
    with pytest.raises(TypeError, match="approx_tanh accepts float16, bfloat16 and float32"):
        plgpu.approx_tanh(jnp.ones((4,), jnp.int32))


def _asm_kernel(x_ref, o_ref, h_ref):
    v = x_ref[...]
    (o,) = plgpu.elementwise_inline_asm(
        "shf.l.wrap.b32 $0, $1, $1, 3;",  # rotate left by 3
        args=[v],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, v.dtype)],
    )
    o_ref[...] = o
    h_ref[...] = plgpu.approx_tanh(x_ref[...].astype(jnp.float32))


def _asm_call(**kw):
    out = (jax.ShapeDtypeStruct((8, 32), jnp.uint32), jax.ShapeDtypeStruct((8, 32), jnp.float32))
    return pl.pallas_call(_asm_kernel, out, **kw)


@pytest.mark.parametrize("cc", [80, 90])
def test_gpu_only_primitives_compile(cc):
    x = jax.ShapeDtypeStruct((8, 32), jnp.uint32)
    lk, compiled = compile_for(_asm_call(), (x,), cc)
    ptx = compiled.asm["ptx"]
    assert "shf.l.wrap.b32" in ptx and "tanh.approx.f32" in ptx
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    assert "_approx_tanh" in lk.module_source(interpret=False)


@pytest.mark.parametrize("cc", [80, 90])
def test_hints_and_cas_compile(cc):
    def kernel(x_ref, o_ref, old_ref):
        cols = plgpu.max_contiguous(lax.broadcasted_iota(jnp.int32, (6, 12), 1), (1, 12))
        plgpu.debug_barrier()
        old_ref[...] = plgpu.atomic_cas(o_ref, x_ref[...], x_ref[...] + cols)
        plgpu.atomic_xor(o_ref, None, cols)
        plgpu.atomic_xchg(o_ref.at[0], pl.ds(0, 12), cols[0])

    out = (jax.ShapeDtypeStruct((6, 12), jnp.int32),) * 2
    f = pl.pallas_call(kernel, out)
    lk, compiled = compile_for(f, (jax.ShapeDtypeStruct((6, 12), jnp.int32),), cc)
    ptx = compiled.asm["ptx"]
    assert "atom" in ptx and "cas" in ptx and "bar.sync" in ptx
    assert "tl.max_contiguous(" in lk.body and "tl.debug_barrier()" in lk.body


def test_inline_asm_under_interpreter_says_run_on_gpu():
    x = random((8, 32), jnp.uint32)
    with pytest.raises(
        Exception,
        match=r"(?s)kernel '_asm_kernel'.*elementwise_inline_asm at .*test_lowering_primitives.py:\d+.*GPU",
    ):
        _asm_call(interpret=plgpu.InterpretParams())(x)
    with pytest.raises(NotImplementedError, match="elementwise_inline_asm.*run the kernel on the GPU"):
        _asm_call(interpret=True)(x)
