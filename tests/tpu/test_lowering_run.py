"""Our Mosaic modules, executed on the CPU by ``pltpu.run_mosaic``, compute
what the kernel means: each kernel's output is compared with a plain ``jnp``
reference (or with the TPU interpret mode) on fresh random data.

This checks the lowering's semantics (operand order of ``select``, branch
order of ``cond``, signedness of integer ops, casts, windows and index maps),
which the structural tests of ``test_lowering.py`` cannot.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas as pl
import pallas_tpu as pltpu


def run_ours(fn, *args):
    """``fn(*args)`` (one pallas_call) lowered by us, executed by run_mosaic."""
    [module] = pltpu.mosaic_modules(fn, *args)
    return pltpu.run_mosaic(module, *args, out_shape=jax.eval_shape(fn, *args))


def whole(f, out_shape=None):
    """A kernel applying ``f`` to whole-array blocks of its inputs."""

    def kernel(*refs):
        refs[-1][...] = f(*(r[...] for r in refs[:-1]))

    def fn(*xs):
        out = out_shape or jax.eval_shape(f, *xs)
        return pl.pallas_call(kernel, out_shape=out)(*xs)

    return fn


def rand(shape, dtype, seed, lo=None, hi=None):
    k = jax.random.key(seed)
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.random.normal(k, shape, jnp.float32).astype(dtype)
    info = jnp.iinfo(dtype)
    lo = max(info.min, -1000) if lo is None else lo
    hi = min(info.max, 1000) if hi is None else hi
    return jax.random.randint(k, shape, lo, hi, jnp.int32 if info.bits <= 32 else jnp.int64).astype(dtype)


SHAPE = (16, 128)
FLOATS = (jnp.float32, jnp.bfloat16)
INTS = (jnp.int32, jnp.uint32, jnp.int16, jnp.int8, jnp.uint8)

BINARY_CASES = [
    ("add", lambda a, b: a + b, FLOATS + INTS),
    ("sub", lambda a, b: a - b, FLOATS + INTS),
    ("mul", lambda a, b: a * b, FLOATS + INTS),
    ("div", lax.div, FLOATS + INTS),
    ("rem", lax.rem, (jnp.float32, jnp.int32, jnp.uint32)),
    ("max", jnp.maximum, FLOATS + INTS),
    ("min", jnp.minimum, FLOATS + INTS),
    ("and", lambda a, b: a & b, INTS),
    ("or", lambda a, b: a | b, INTS),
    ("xor", lambda a, b: a ^ b, INTS),
    ("lt", lambda a, b: (a < b).astype(jnp.int32), FLOATS + INTS),
    ("ge", lambda a, b: (a >= b).astype(jnp.int32), FLOATS + INTS),
    ("eq", lambda a, b: (a == b).astype(jnp.int32), (jnp.int32,)),
    ("ne", lambda a, b: (a != b).astype(jnp.int32), (jnp.float32,)),
    ("where", lambda a, b: jnp.where(a > b, a, b * 2), (jnp.float32, jnp.int32)),
    ("pow", lambda a, b: jnp.abs(a) ** b, (jnp.float32,)),
]


@pytest.mark.parametrize(
    "name,f,dtype",
    [(n, f, d) for n, f, ds in BINARY_CASES for d in ds],
    ids=[f"{n}-{np.dtype(d).name}" for n, _, ds in BINARY_CASES for d in ds],
)
def test_binary(name, f, dtype):
    a = rand(SHAPE, dtype, 0)
    b = rand(SHAPE, dtype, 1, lo=1, hi=100) if name in ("div", "rem") else rand(SHAPE, dtype, 1)
    if name == "pow":
        b = jnp.round(b)
    got = run_ours(whole(f), a, b)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(f(a, b), np.float64), rtol=2e-2, atol=1e-5
    )


def test_shifts():
    a = rand(SHAPE, jnp.int32, 0)
    s = rand(SHAPE, jnp.int32, 1, lo=0, hi=31)
    for f in (lax.shift_left, lax.shift_right_arithmetic, lax.shift_right_logical):
        np.testing.assert_array_equal(run_ours(whole(f), a, s), f(a, s))
    u = rand(SHAPE, jnp.uint32, 2)
    np.testing.assert_array_equal(
        run_ours(whole(lambda x, y: x >> y), u, s.astype(jnp.uint32)), u >> s.astype(jnp.uint32)
    )


UNARY_CASES = [
    ("exp", jnp.exp),
    ("log", lambda x: jnp.log(jnp.abs(x) + 1)),
    ("tanh", jnp.tanh),
    ("rsqrt", lambda x: lax.rsqrt(jnp.abs(x) + 1)),
    ("sin", jnp.sin),
    ("sigmoid", jax.nn.sigmoid),
    ("abs", jnp.abs),
    ("neg", lambda x: -x),
    ("cube", lambda x: x**3),
    ("inverse_square", lambda x: 1.0 / (x * x + 1)),
    ("floor", jnp.floor),
    ("round", jnp.round),
    ("sign", jnp.sign),
    ("clip", lambda x: jnp.clip(x, -0.5, 0.5)),
    ("erf", lax.erf),
]


@pytest.mark.parametrize("name,f", UNARY_CASES, ids=[n for n, _ in UNARY_CASES])
def test_unary_float(name, f):
    x = rand(SHAPE, jnp.float32, 3)
    np.testing.assert_allclose(run_ours(whole(f), x), f(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("f", [jnp.abs, lambda x: -x, lambda x: ~x, jnp.sign, lambda x: x * x])
def test_unary_int(f):
    x = rand(SHAPE, jnp.int32, 4)
    np.testing.assert_array_equal(run_ours(whole(f), x), f(x))


CASTS = [
    (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32),
    (jnp.float32, jnp.int32),
    (jnp.int32, jnp.float32),
    (jnp.uint32, jnp.float32),
    (jnp.int8, jnp.int32),
    (jnp.uint8, jnp.int32),
    (jnp.int32, jnp.int16),
    (jnp.int32, jnp.uint32),
    (jnp.float32, jnp.bool_),
]


@pytest.mark.parametrize("src,dst", CASTS, ids=[f"{np.dtype(s).name}-{np.dtype(d).name}" for s, d in CASTS])
def test_casts(src, dst):
    x = rand(SHAPE, src, 5) * (10 if jnp.issubdtype(src, jnp.floating) else 1)
    f = (lambda v: v.astype(dst).astype(jnp.int32)) if dst == jnp.bool_ else (lambda v: v.astype(dst))
    np.testing.assert_array_equal(np.asarray(run_ours(whole(f), x)), np.asarray(f(x)))


def test_shapes_reductions_iota_broadcast():
    def f(x):
        row = jnp.sum(x, axis=0, keepdims=True)
        col = jnp.max(x, axis=1, keepdims=True)
        io = lax.broadcasted_iota(jnp.int32, SHAPE, 1).astype(jnp.float32)
        t = jnp.swapaxes(x.reshape(16, 8, 16), 1, 2).reshape(SHAPE)
        return row + col + io + t + jnp.min(x) + jnp.sum(x)

    x = rand(SHAPE, jnp.float32, 6)
    np.testing.assert_allclose(run_ours(whole(f), x), f(x), rtol=1e-5, atol=1e-3)


def test_slice_concatenate_bool_reductions():
    def f(x):
        both = jnp.concatenate([x[:, 64:], x[:, :64]], axis=1)
        anyp = jnp.any(x > 1.0, axis=0, keepdims=True).astype(jnp.float32)
        allp = jnp.all(x > -1.0, axis=1, keepdims=True).astype(jnp.float32)
        return both + anyp + allp * 10

    x = rand(SHAPE, jnp.float32, 19)
    np.testing.assert_allclose(run_ours(whole(f), x), f(x))


@pytest.mark.parametrize(
    "dtype",
    [
        jnp.int32,
        jnp.uint32,
    ],
)
def test_int_reductions(dtype):
    f = lambda x: (
        jnp.max(x, axis=0, keepdims=True) - jnp.min(x, axis=0, keepdims=True) + jnp.sum(x, 0, keepdims=True)
    )
    x = rand(SHAPE, dtype, 7, lo=0)
    np.testing.assert_array_equal(run_ours(whole(f), x), f(x))


@pytest.mark.parametrize(
    "dims",
    [(((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ()))],
    ids=["nn", "nt", "tn"],
)
def test_dot_general(dims):
    f = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    a, b = rand((128, 128), jnp.bfloat16, 8), rand((128, 128), jnp.bfloat16, 9)
    np.testing.assert_allclose(run_ours(whole(f), a, b), f(a, b), rtol=1e-2, atol=1e-2)


def test_batched_dot():
    f = lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32)
    a, b = rand((2, 16, 128), jnp.float32, 17), rand((2, 128, 128), jnp.float32, 18)
    np.testing.assert_allclose(run_ours(whole(f), a, b), f(a, b), rtol=1e-4, atol=1e-3)


def test_matmul_grid_with_accumulator():
    from test_lowering import matmul

    x, y = rand((256, 256), jnp.bfloat16, 10), rand((256, 256), jnp.bfloat16, 11)
    got = run_ours(lambda a, b: matmul(pl, pltpu, a, b), x, y)
    np.testing.assert_allclose(got, x.astype(jnp.float32) @ y.astype(jnp.float32), rtol=1e-2, atol=1e-2)


def test_blocks_index_maps_squeezed_dims():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * (pl.program_id(0) + 1).astype(jnp.float32)

    def fn(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((3, 16, 128), jnp.float32),
            grid=(3, 2),
            in_specs=[pl.BlockSpec((None, 8, 128), lambda i, j: (2 - i, j, 0))],
            out_specs=pl.BlockSpec((None, 8, 128), lambda i, j: (i, j, 0)),
        )(x)

    x = rand((3, 16, 128), jnp.float32, 12)
    ref = x[::-1] * jnp.arange(1, 4, dtype=jnp.float32)[:, None, None]
    np.testing.assert_allclose(run_ours(fn, x), ref)


def test_cond_switch_and_loops():
    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        v = lax.switch(i, [lambda v: v, lambda v: v * 2.0, lambda v: v + 1.0], x_ref[...])

        @pl.when(i == 1)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        v = lax.fori_loop(0, 3, lambda k, c: c + k.astype(jnp.float32), v)
        n = lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2), (i, 1))[1]
        o_ref[...] = v + n.astype(jnp.float32)

    def fn(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((24, 128), jnp.float32),
            grid=(3,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        )(x)

    x = rand((24, 128), jnp.float32, 13)
    got = run_ours(fn, x)
    parts = [x[0:8], x[8:16] * 2.0, x[16:24] + 1.0]
    expect = jnp.concatenate([p + 3.0 + 2.0 ** (5 - i) for i, p in enumerate(parts)])
    np.testing.assert_allclose(got, expect, rtol=1e-6)


def test_prefetch_smem_semaphores():
    from test_lowering import prefetch

    idx, x = jnp.array([1, 0], jnp.int32), rand((16, 128), jnp.float32, 14)
    got = run_ours(lambda i, a: prefetch(pl, pltpu, i, a), idx, x)
    ref = prefetch(pl, pltpu, idx, x, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(got, ref)


def test_dynamic_slices():
    from test_lowering import dyn

    x = rand((16, 128), jnp.float32, 15)
    got = run_ours(lambda a: dyn(pl, pltpu, a), x)
    np.testing.assert_allclose(got, dyn(pl, pltpu, x, interpret=pltpu.InterpretParams()))


def test_dma_run_scoped_roll():
    def kernel(x_hbm, o_ref, buf, sem):
        c = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 8)], buf, sem)
        c.start()
        c.wait()

        def inner(sems, tmp):
            copy = pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], tmp, sems.at[1])
            copy.start()
            copy.wait()
            return tmp[...]

        z = pl.run_scoped(inner, pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((8, 128), jnp.float32))
        o_ref[...] = buf[...] * z + pltpu.roll(buf[...], 3, 1)

    def fn(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        )(x)

    x = rand((16, 128), jnp.float32, 16)
    np.testing.assert_allclose(run_ours(fn, x), x[:8] * x[8:] + jnp.roll(x[:8], 3, 1), rtol=1e-6)


def test_bool_operands_outputs_and_scratch():
    def kernel(m_ref, x_ref, o_ref, pos_ref, flag_ref):
        flag_ref[...] = x_ref[...] > 0.0
        pos_ref[...] = flag_ref[...] & m_ref[...]
        o_ref[...] = jnp.where(pos_ref[...], x_ref[...], -1.0)

    def fn(m, x):
        return pl.pallas_call(
            kernel,
            out_shape=(jax.ShapeDtypeStruct(SHAPE, jnp.float32), jax.ShapeDtypeStruct(SHAPE, jnp.bool_)),
            scratch_shapes=[pltpu.VMEM(SHAPE, jnp.bool_)],
        )(m, x)

    m, x = rand(SHAPE, jnp.float32, 20) > 0.5, rand(SHAPE, jnp.float32, 21)
    [module] = pltpu.mosaic_modules(fn, m, x)
    assert "memref<16x128xi32" in module and "xi1, #tpu" not in module  # bools are int32 in memory
    i32 = lambda a: np.asarray(a, np.int32)
    out = pltpu.run_mosaic(
        module,
        i32(m),
        x,
        out_shape=(jax.ShapeDtypeStruct(SHAPE, jnp.float32), jax.ShapeDtypeStruct(SHAPE, jnp.int32)),
    )
    pos = (x > 0) & m
    np.testing.assert_array_equal(out[0], jnp.where(pos, x, -1.0))
    np.testing.assert_array_equal(out[1], i32(pos))
    # the custom call takes and returns int32 in place of bool
    text = jax.jit(fn).trace(m, x).lower(lowering_platforms=("tpu",)).as_text()
    call = re.search(r"tpu_custom_call\(.*", text).group(0)
    assert "tensor<16x128xi32>" in call and "i1>" not in call.split("->")[0]


def test_einshape():
    f = lambda x: pltpu.einshape("(ab)c->(ba)c", x, a=2)  # swaps the two row halves' interleaving
    x = rand(SHAPE, jnp.float32, 22)
    np.testing.assert_array_equal(
        run_ours(whole(f), x), x.reshape(2, 8, 128).transpose(1, 0, 2).reshape(SHAPE)
    )


def test_argmax_argmin():
    f = lambda x: (jnp.argmax(x, axis=1)[:, None] + jnp.argmin(x, axis=0)[None, :]).astype(jnp.int32)
    x = rand(SHAPE, jnp.float32, 23)
    np.testing.assert_array_equal(run_ours(whole(f), x), f(x))
