"""Every lowering rule, run as generated Triton code under Triton's
interpreter (``interpret=plgpu.InterpretParams()``), against jnp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import Runner, assert_close, fresh_key, lowered, random, whole
from jax import lax

import pallas as pl
import pallas_gpu as plgpu

R = Runner()
FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]
INTS = [jnp.int32, jnp.int8, jnp.uint8, jnp.int64]


def elementwise(fn, *xs, block=None, out_dtype=None):
    """Runs ``fn`` elementwise over blocks of 2-d inputs."""
    shape = xs[0].shape
    block = block or (8, 16)
    grid = tuple(pl.cdiv(s, b) for s, b in zip(shape, block))
    spec = pl.BlockSpec(block, lambda i, j: (i, j))

    def kernel(*refs):
        *ins, o = refs
        o[...] = fn(*[r[...] for r in ins])

    out = jax.ShapeDtypeStruct(shape, out_dtype or jax.eval_shape(fn, *xs).dtype)
    return R.call(kernel, out, grid=grid, in_specs=[spec] * len(xs), out_specs=spec)(*xs)


# Shapes: dividing, non-dividing edge blocks, and non-power-of-two blocks.
SHAPES_BLOCKS = [((16, 32), (8, 16)), ((13, 37), (8, 16)), ((10, 20), (5, 12))]


@pytest.mark.parametrize("dtype", FLOATS + [jnp.int32, jnp.int8, jnp.uint32])
@pytest.mark.parametrize("shape,block", SHAPES_BLOCKS)
def test_binary_arith(dtype, shape, block):
    x, y = random(shape, dtype), random(shape, dtype)
    fn = lambda a, b: (a + b) * a - jnp.maximum(a, b) + jnp.minimum(a, b)  # noqa: E731
    # 16-bit: XLA's reference keeps f32 between fused ops; we round each op.
    extra = dict(atol=0.3) if dtype in (jnp.bfloat16, jnp.float16) else {}
    assert_close(elementwise(fn, x, y, block=block), fn(x, y), dtype, **extra)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.int16])
def test_div_rem(dtype):
    x = random((16, 24), dtype)
    y = random((16, 24), dtype)
    y = jnp.where(y == 0, jnp.ones_like(y), y)
    assert_close(elementwise(lax.div, x, y), lax.div(x, y), dtype)
    assert_close(elementwise(lax.rem, x, y), lax.rem(x, y), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_comparisons_and_where(dtype):
    x, y = random((13, 20), dtype), random((13, 20), dtype)

    def fn(a, b):
        lt, le, gt, ge, eq, ne = a < b, a <= b, a > b, a >= b, a == b, a != b
        c = (lt & ~eq) | (ge ^ ne)
        return jnp.where(c | le | gt, a, b)

    assert_close(elementwise(fn, x, y), fn(x, y), dtype)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.int64])
def test_bitwise_and_shifts(dtype):
    x = random((8, 32), dtype)
    s = jnp.full((8, 32), 3, dtype)

    def fn(a, b):
        return (
            (a & 0x5A) ^ (a | b) ^ (a << b) ^ lax.shift_right_logical(a, b) ^ lax.shift_right_arithmetic(a, b)
        )

    assert_close(elementwise(fn, x, s), fn(x, s), dtype)


UNARY = {
    "exp": jnp.exp,
    "exp2": jnp.exp2,
    "log2": lambda x: jnp.log2(jnp.abs(x) + 0.5),
    "log": lambda x: jnp.log(jnp.abs(x) + 0.5),
    "log1p": lambda x: jnp.log1p(jnp.abs(x)),
    "expm1": jnp.expm1,
    "sqrt": lambda x: jnp.sqrt(jnp.abs(x)),
    "rsqrt": lambda x: lax.rsqrt(jnp.abs(x) + 0.5),
    "sin_cos": lambda x: jnp.sin(x) + jnp.cos(x),
    "tan_tanh": lambda x: jnp.tanh(x) + jnp.tan(x * 0.3),
    "atan_asin": lambda x: jnp.arctan(x) + jnp.arcsin(x / 4),
    "erf": lax.erf,
    "floor_ceil": lambda x: jnp.floor(x) + jnp.ceil(x),
    "round": lambda x: (
        lax.round(x * 3, lax.RoundingMethod.TO_NEAREST_EVEN) + lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO)
    ),
    "logistic": jax.nn.sigmoid,
    "abs_neg_sign": lambda x: jnp.abs(x) - x + jnp.sign(x),
    "integer_pow": lambda x: x**3 + lax.integer_pow(x, 2),
    "pow": lambda x: jnp.power(jnp.abs(x) + 0.1, 1.7),
    "atan2": lambda x: jnp.arctan2(x, x * x + 0.5),
    "is_finite": lambda x: jnp.where(jnp.isfinite(jnp.log(x) / (x + 1.0)), x, 0.0),
    "clamp": lambda x: jnp.clip(x, -1.0, 0.5),
    "square": lax.square,
    "erfc": lax.erfc,
    "lgamma": lambda x: lax.lgamma(jnp.abs(x) + 0.25),
    "digamma": lambda x: lax.digamma(jnp.abs(x) + 0.25),  # pallas-core's jnp definition
    "erf_inv": lambda x: lax.erf_inv(jnp.tanh(x) * 0.99),
    "tanh_grad": jax.vmap(jax.vmap(jax.grad(jnp.tanh))),  # one_minus_square
}


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_float(name, dtype):
    if dtype != jnp.float32 and name in ("atan_asin", "atan2", "tan_tanh", "pow", "round", "is_finite"):
        pytest.skip("covered in f32; 16-bit goes through the same f32 path")
    fn = UNARY[name]
    x = random((12, 20), dtype)
    rtol = 1e-5 if dtype == jnp.float32 else 3e-2
    assert_close(elementwise(fn, x, block=(8, 16)), fn(x), dtype, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32])
def test_bit_counts_and_mulhi(dtype):
    big = jnp.iinfo(dtype).max
    x, y = (jax.random.bits(fresh_key(), (8, 32), jnp.uint32).astype(dtype) for _ in range(2))
    x = x.at[0, :4].set(jnp.array([0, 1, big, 1 << 20], dtype))  # zero, one, all ones, one high bit
    fn = lambda a, b: lax.clz(a) * 1000 + lax.population_count(a) + lax.mulhi(a, b)  # noqa: E731
    assert_close(elementwise(fn, x, y), fn(x, y), dtype)


def test_bit_counts_reject_small_ints():
    x = random((8, 16), jnp.int8)
    with pytest.raises(Exception, match=r"lax.clz takes 32- or 64-bit integers"):
        elementwise(lax.clz, x)


@pytest.mark.parametrize(
    "src,dst",
    [(jnp.float32, jnp.int32), (jnp.int32, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
     (jnp.float16, jnp.float32), (jnp.int32, jnp.int8), (jnp.uint8, jnp.int32), (jnp.float32, jnp.bool_),
     (jnp.bool_, jnp.float32), (jnp.int32, jnp.bool_)],
)  # fmt: skip
def test_convert(src, dst):
    x = random((16, 16), src)
    fn = lambda a: a.astype(dst)  # noqa: E731
    assert_close(elementwise(fn, x), fn(x), dst)


@pytest.mark.parametrize("shape", [(8, 16), (6, 12)])
def test_slice_rev_dynamic_slice(shape):
    x = random(shape, jnp.float32)

    def fn(a):
        s = a[1:5, 2:10:3]
        r = lax.rev(a, (1,))[0:4, 0:3]
        d = lax.dynamic_slice(a, (2, 1), (4, 3))
        return s + r * 2 + d * 3

    assert_close(whole(fn, x), fn(x))


def test_bitcast():
    x = random((8, 16), jnp.float32)
    fn = lambda a: lax.bitcast_convert_type(a, jnp.int32) >> 3  # noqa: E731
    assert_close(elementwise(fn, x), fn(x), jnp.int32)


def test_bool_refs():
    x = random((8, 24), jnp.bool_)
    y = random((8, 24), jnp.bool_)
    fn = lambda a, b: (a & ~b) | (b ^ a)  # noqa: E731
    assert_close(elementwise(fn, x, y, block=(8, 8)), fn(x, y), jnp.bool_)


# ---------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("shape", [(8, 16), (6, 10)])
def test_iota_broadcast(shape):
    x = random(shape, jnp.float32)

    def fn(a):
        r = lax.broadcasted_iota(jnp.int32, shape, 0) * 100 + lax.broadcasted_iota(jnp.int32, shape, 1)
        row = jnp.sum(a, axis=1, keepdims=True)
        return r.astype(jnp.float32) + row + a[0:1, :] * 0 + 2.0

    assert_close(whole(fn, x), fn(x), jnp.float32)


def test_transpose_reshape():
    x = random((8, 32), jnp.float32)
    assert_close(whole(lambda a: a.T * 2, x), x.T * 2)
    assert_close(whole(lambda a: a.reshape(16, 16) + 1, x), x.reshape(16, 16) + 1)
    assert_close(
        whole(lambda a: a.reshape(2, 4, 32).transpose(1, 0, 2), x), x.reshape(2, 4, 32).transpose(1, 0, 2)
    )
    y = random((6, 10), jnp.float32)  # squeeze/expand reshapes work at any size
    assert_close(whole(lambda a: a.reshape(6, 1, 10)[:, 0, :] - 1, y), y - 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8])
@pytest.mark.parametrize("shape", [(8, 16), (6, 12), (5, 3)])
@pytest.mark.parametrize("axis", [0, 1, None])
def test_reductions(dtype, shape, axis):
    x = random(shape, dtype)

    def fn(a):
        s = jnp.sum(a, axis=axis).astype(jnp.float32)
        mx = jnp.max(a, axis=axis).astype(jnp.float32)
        mn = jnp.min(a, axis=axis).astype(jnp.float32)
        return s + 2 * mx - 3 * mn

    out = whole(fn, x)
    assert_close(
        out,
        fn(x),
        jnp.float32,
        rtol=3e-2 if dtype == jnp.bfloat16 else 1e-5,
        atol=1e-1 if dtype == jnp.bfloat16 else 1e-4,
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.float16])
@pytest.mark.parametrize("shape", [(8, 16), (5, 12)])
def test_argmax_argmin(dtype, shape):
    x = random(shape, dtype, low=-100, high=100)
    for ax in (0, 1):
        fn = lambda a: (
            jnp.argmax(a, axis=ax).astype(jnp.int32) * 100 + jnp.argmin(a, axis=ax).astype(jnp.int32)
        )  # noqa: E731
        assert_close(whole(fn, x), fn(x), jnp.int32)


def test_prod_any_all():
    x = random((4, 6), jnp.float32, low=0.5, high=1.5)
    assert_close(whole(lambda a: jnp.prod(a, axis=1), x), jnp.prod(x, axis=1), rtol=1e-5)
    b = random((8, 5), jnp.bool_)
    fn = lambda a: jnp.any(a, axis=1) & ~jnp.all(a, axis=1)  # noqa: E731
    assert_close(whole(fn, b), fn(b), jnp.bool_)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape", [(8, 16), (6, 12)])
def test_cumsum(reverse, shape):
    x = random(shape, jnp.float32)
    fn = lambda a: lax.cumsum(a, axis=1, reverse=reverse) + lax.cummax(a, axis=0, reverse=reverse)  # noqa: E731
    assert_close(whole(fn, x), fn(x), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------
# Dot


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mkn", [(16, 32, 16), (32, 24, 48), (20, 16, 16)])
def test_dot(dtype, mkn):
    m, k, n = mkn
    a, b = random((m, k), dtype), random((k, n), dtype)
    fn = lambda x, y: jnp.dot(x, y, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)  # noqa: E731
    assert_close(
        whole(fn, a, b),
        fn(a, b),
        jnp.float32,
        rtol=1e-2 if dtype != jnp.float32 else 1e-5,
        atol=1e-2 if dtype != jnp.float32 else 1e-4,
    )


def test_dot_transposed_and_batched():
    a, b = random((32, 16), jnp.float32), random((32, 16), jnp.float32)
    fn = lambda x, y: lax.dot_general(x, y, (((0,), (0,)), ((), ())), precision=lax.Precision.HIGHEST)  # noqa: E731
    assert_close(whole(fn, a, b), fn(a, b), rtol=1e-5, atol=1e-4)
    fn2 = lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)  # noqa: E731
    assert_close(whole(fn2, a, b), fn2(a, b), rtol=1e-5, atol=1e-4)
    c, d = random((2, 16, 32), jnp.float32), random((2, 32, 16), jnp.float32)
    fn3 = lambda x, y: jnp.einsum("bij,bjk->bik", x, y, precision=lax.Precision.HIGHEST)  # noqa: E731
    assert_close(whole(fn3, c, d), fn3(c, d), rtol=1e-5, atol=1e-4)
    fn4 = lambda x, y: plgpu.dot(x, y, trans_b=True, allow_tf32=False)  # noqa: E731
    assert_close(whole(fn4, a, b), jnp.dot(a, b.T, precision=lax.Precision.HIGHEST), rtol=1e-5, atol=1e-4)


def test_int8_dot():
    a, b = random((16, 32), jnp.int8), random((32, 16), jnp.int8)
    fn = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.int32)  # noqa: E731
    assert_close(whole(fn, a, b), fn(a, b), jnp.int32)


def test_blocked_matmul_k_accumulation():
    if not R.INTERPRET:
        pytest.skip("accumulating over a grid axis needs grid order; GPU programs run concurrently")
    m, k, n, bm, bk, bn = 48, 80, 40, 16, 32, 16  # edge blocks on every axis
    a, b = random((m, k), jnp.float32), random((k, n), jnp.float32)

    def kernel(a_ref, b_ref, o_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        kk = pl.program_id(2)
        # Mask the K tail: edge blocks along K hold garbage past the array.
        valid = (kk * bk + lax.broadcasted_iota(jnp.int32, (bm, bk), 1)) < k
        x = jnp.where(valid, a_ref[...], 0.0)
        valid_b = (kk * bk + lax.broadcasted_iota(jnp.int32, (bk, bn), 0)) < k
        y = jnp.where(valid_b, b_ref[...], 0.0)
        o_ref[...] += jnp.dot(x, y, precision=lax.Precision.HIGHEST)

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
    )(a, b)
    assert_close(out, jnp.dot(a, b, precision=lax.Precision.HIGHEST), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------
# Control flow


def test_fori_loop_and_while():
    x = random((8, 16), jnp.float32)

    def fn(a):
        acc = lax.fori_loop(0, 5, lambda i, c: c * 0.5 + a * i.astype(jnp.float32), jnp.zeros_like(a))

        def cond(c):
            return c[0] < 7

        def body(c):
            return c[0] + 2, c[1] + a

        n, s = lax.while_loop(cond, body, (jnp.int32(0), acc))
        return s * n.astype(jnp.float32)

    assert_close(whole(fn, x), fn(x), rtol=1e-5, atol=1e-4)


def test_dynamic_fori_bounds():
    x = random((4, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        n = pl.program_id(0) + 3  # traced bounds -> while loop
        o_ref[...] = lax.fori_loop(0, n, lambda i, c: c + x_ref[...], jnp.zeros((4, 16), jnp.float32))

    out = R.call(kernel, jax.ShapeDtypeStruct((4, 16), jnp.float32), grid=(1,))(x)
    assert_close(out, 3 * x, rtol=1e-5, atol=1e-5)


def test_dynamic_fori_bounds_become_a_pipelined_for_loop():
    # Program p sums rows [p - 1, 2p - 1) of x (empty for p = 0 and 1), with the
    # loop index used in the body and the carry returned; lo > hi for p = 0.
    x = random((16, 8), jnp.float32)

    def kernel(x_ref, o_ref):
        p = pl.program_id(0)

        def body(i, c):
            return c + x_ref[pl.ds(i, 1), :] * (i + 1).astype(jnp.float32)

        o_ref[...] = lax.fori_loop(p - 1, 2 * p - 1, body, jnp.zeros((1, 8), jnp.float32))

    f = R.call(
        kernel,
        jax.ShapeDtypeStruct((8, 8), jnp.float32),
        grid=(8,),
        in_specs=[pl.BlockSpec((16, 8), lambda p: (0, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda p: (p, 0)),
    )
    rows = jnp.arange(16)[:, None]
    ref = jnp.stack(
        [
            jnp.sum(jnp.where((rows >= p - 1) & (rows < 2 * p - 1), x * (rows + 1), 0), axis=0)
            for p in range(8)
        ]
    )
    assert_close(f(x), ref, rtol=1e-5, atol=1e-5)
    src = lowered(f, x).module_source(interpret=False)
    assert "for it" in src and "while" not in src


def test_cond_switch_when():
    x = random((16, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        v = x_ref[...]
        o_ref[...] = lax.cond(i % 2 == 0, lambda: v * 2, lambda: v - 1)
        w = lax.switch(i, [lambda: v + 10, lambda: v + 20, lambda: v + 30, lambda: v + 40])
        o_ref[...] += w

        @pl.when(i == 3)
        def _():
            o_ref[...] = -o_ref[...]

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((16, 16), jnp.float32),
        grid=(4,),
        in_specs=[pl.BlockSpec((4, 16), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((4, 16), lambda i: (i, 0)),
    )(x)
    rows = np.arange(16) // 4
    ref = np.where((rows % 2 == 0)[:, None], x * 2, x - 1) + (x + 10 * (rows[:, None] + 1))
    ref = np.where((rows == 3)[:, None], -ref, ref)
    assert_close(out, ref)


def test_pl_loop_and_dynamic_slices():
    x = random((64, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)

        @pl.loop(0, 8)
        def _(i):
            start = pl.multiple_of(i * 8, 8)
            o_ref[...] += x_ref[pl.ds(start, 8), :]

    out = R.call(kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32))(x)
    assert_close(out, x.reshape(8, 8, 16).sum(0), rtol=1e-5, atol=1e-5)


def test_ref_indexing_views():
    x = random((16, 32), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[0, :] = x_ref[3, :]  # scalar index
        o_ref.at[1][4:12] = x_ref[5, pl.ds(2, 8)]  # view + static slice
        o_ref[2:4, pl.ds(0, 16, stride=2)] = x_ref[6:8, 0:16]  # strided store
        o_ref[4, 0] = jnp.sum(x_ref[...])  # scalar store
        i = pl.program_id(0) + 7  # dynamic scalar index
        o_ref[5, :] = x_ref[i, :]

    out = R.call(kernel, jax.ShapeDtypeStruct((16, 32), jnp.float32), grid=(1,))(x)
    ref = np.zeros((16, 32), np.float32)
    ref[0] = x[3]
    ref[1, 4:12] = x[5, 2:10]
    ref[2:4, 0:32:2] = x[6:8, 0:16]
    ref[4, 0] = np.sum(x)
    ref[5] = x[7]
    assert_close(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("grid", [(2, 3), (2, 3, 2), (2, 2, 2, 3)])
def test_program_ids_any_rank(grid):
    def kernel(o_ref):
        val = 0
        for ax in range(len(grid)):
            val = val * 10 + pl.program_id(ax)
        o_ref[...] = jnp.full((1, 8), val + 1000 * pl.num_programs(len(grid) - 1), jnp.int32)

    n = int(np.prod(grid))

    def index_map(*ids):
        flat = 0
        for g, i in zip(grid, ids):
            flat = flat * g + i
        return flat, 0

    out = R.call(
        kernel, jax.ShapeDtypeStruct((n, 8), jnp.int32), grid=grid, out_specs=pl.BlockSpec((1, 8), index_map)
    )()
    ref = []
    for idx in np.ndindex(*grid):
        v = 0
        for i in idx:
            v = v * 10 + i
        ref.append(v + 1000 * grid[-1])
    assert_close(out[:, 0], np.array(ref, np.int32))


def test_squeezed_and_element_dims():
    x = random((4, 10, 24), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 3

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((4, 10, 24), jnp.float32),
        grid=(4, 3),
        in_specs=[pl.BlockSpec((None, 10, pl.Element(8)), lambda b, j: (b, 0, j * 8))],
        out_specs=pl.BlockSpec((pl.squeezed, 10, 8), lambda b, j: (b, 0, j)),
    )(x)
    assert_close(out, x * 3)


def test_input_output_aliases():
    x = random((16, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    f = R.call(
        kernel,
        jax.ShapeDtypeStruct((16, 16), jnp.float32),
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)),
        input_output_aliases={0: 0},
    )
    assert_close(jax.jit(f)(x), x + 1)


def test_scratch_and_run_scoped():
    x = random((8, 16), jnp.float32)

    def kernel(x_ref, o_ref, acc_ref):
        acc_ref[...] = jnp.zeros_like(acc_ref)

        def body(i, c):
            acc_ref[...] += x_ref[...] * i.astype(jnp.float32)
            return c

        lax.fori_loop(0, 4, body, 0)

        def scoped(tmp_ref):
            tmp_ref[...] = acc_ref[...] * 2
            return tmp_ref[...] + 1

        o_ref[...] = pl.run_scoped(scoped, jax.ShapeDtypeStruct((8, 16), jnp.float32))

    out = R.call(
        kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32), scratch_shapes=[pl.ANY((8, 16), jnp.float32)]
    )(x)
    assert_close(out, x * 6 * 2 + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_scratch_starts_uninitialized(dtype):
    """Scratch and run_scoped Refs read before any write hold pallas-core's
    uninitialized value (NaN, the smallest int, False), as in every interpreter."""
    x = random((8, 16), dtype)

    def kernel(x_ref, o_ref, p_ref, acc_ref):
        o_ref[...] = acc_ref[...]  # never written

        def scoped(tmp_ref):
            p_ref[...] = tmp_ref[...]
            tmp_ref[...] = x_ref[...]  # written after the read
            return 0

        pl.run_scoped(scoped, jax.ShapeDtypeStruct((8, 16), dtype))

    out = jax.ShapeDtypeStruct((8, 16), dtype)
    o, p = R.call(kernel, (out, out), scratch_shapes=[pl.ANY((8, 16), dtype)])(x)
    want = np.full((8, 16), pl.backend.uninitialized_fill(dtype)).astype(np.float64)
    # compared as float64: NumPy 2.5 no longer takes bfloat16 NaNs as equal
    np.testing.assert_array_equal(np.asarray(o).astype(np.float64), want)
    np.testing.assert_array_equal(np.asarray(p).astype(np.float64), want)


@pytest.mark.parametrize("mode", ["nan", "zero"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8, jnp.bool_])
def test_unwritten_output_under_triton_interpreter(dtype, mode):
    """Output rows the kernel never writes hold pallas-core's uninitialized value
    (``plb.uninitialized_fill``), or zeros with ``InterpretParams(uninitialized="zero")``."""
    x = random((8, 16), dtype)

    def kernel(x_ref, o_ref):
        o_ref[:4, :] = x_ref[:4, :]

    f = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 16), dtype),
        interpret=plgpu.InterpretParams(uninitialized=mode),
    )
    o = np.asarray(f(x)).astype(np.float64)
    np.testing.assert_array_equal(o[:4], np.asarray(x[:4]).astype(np.float64))
    fill = 0 if mode == "zero" else pl.backend.uninitialized_fill(dtype)
    # compared as float64: NumPy 2.5 no longer takes bfloat16 NaNs as equal
    np.testing.assert_array_equal(o[4:], np.full((4, 16), fill).astype(np.float64))


def test_nested_jit_and_custom_jvp():
    x = random((8, 16), jnp.float32)

    @jax.jit
    def inner(a):
        return jax.nn.relu(a) * 2 + jax.nn.softplus(a)

    assert_close(whole(inner, x), inner(x), rtol=1e-5, atol=1e-5)


def test_jvp_with_tangents_for_both_inputs():
    # The JVP kernel sums the two tangent terms with add_any.
    x, y = random((300,), jnp.float32), random((300,), jnp.float32)
    tx, ty = random((300,), jnp.float32), random((300,), jnp.float32)

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.sin(x_ref[...]) * y_ref[...]

    f = R.call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(3,),
        in_specs=[pl.BlockSpec((128,), lambda i: (i,))] * 2,
        out_specs=pl.BlockSpec((128,), lambda i: (i,)),
    )
    out, tangent = jax.jvp(f, (x, y), (tx, ty))
    ref, ref_tangent = jax.jvp(lambda a, b: jnp.sin(a) * b, (x, y), (tx, ty))
    assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert_close(tangent, ref_tangent, rtol=1e-5, atol=1e-5)


def test_fp32_to_bf16_rounds_to_nearest_even():
    # The GPU rounds; Triton 3.6's interpreter truncates unless pallas-gpu fixes it.
    x = random((32, 64), jnp.float32)
    out = whole(lambda a: a.astype(jnp.bfloat16), x)
    np.testing.assert_array_equal(
        np.asarray(out).view(np.uint16), np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)
    )


def test_softmax_rows():
    x = random((10, 50), jnp.float32)

    def kernel(x_ref, o_ref):
        v = x_ref[...]
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(5,),
        in_specs=[pl.BlockSpec((2, 50), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((2, 50), lambda i: (i, 0)),
    )(x)
    assert_close(out, jax.nn.softmax(x, axis=1), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# GPU-only primitives


def test_plgpu_load_store_masks():
    x = random((64,), jnp.float32)

    def kernel(x_ref, o_ref):
        idx = lax.broadcasted_iota(jnp.int32, (64,), 0)
        v = plgpu.load(x_ref, None, mask=idx % 3 != 0, other=-1.0)
        plgpu.store(o_ref, None, v * 2, mask=idx < 50)
        plgpu.store(o_ref, pl.ds(50, 14), jnp.full((14,), 7.0, jnp.float32))

    out = R.call(kernel, jax.ShapeDtypeStruct((64,), jnp.float32))(x)
    idx = np.arange(64)
    ref = np.where(idx % 3 != 0, x, -1.0) * 2
    ref[50:] = 7.0
    assert_close(out, ref)


def test_atomic_add_histogram():
    x = random((8, 32), jnp.float32)

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        plgpu.atomic_add(o_ref, None, jnp.sum(x_ref[...], axis=0))

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((32,), jnp.float32),
        grid=(4,),
        in_specs=[pl.BlockSpec((2, 32), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((32,), lambda i: (0,)),
    )(x)
    assert_close(out, x.sum(0), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Transformations


def test_vmap_and_jit():
    x = random((3, 16, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.sin(x_ref[...]) * 2

    f = R.call(kernel, jax.ShapeDtypeStruct((16, 16), jnp.float32))
    assert_close(jax.jit(jax.vmap(f))(x), jnp.sin(x) * 2, rtol=1e-5, atol=1e-6)


def test_debug_prints_triton_source(capsys):
    x = random((8, 16), jnp.float32)
    R.call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
        jax.ShapeDtypeStruct((8, 16), jnp.float32),
        debug=True,
        name="add_one",
    )(x)
    out = capsys.readouterr().out
    assert "@triton.jit" in out and "def add_one(" in out and "tl.load(" in out


# ---------------------------------------------------------------------------
# Errors


def test_unsupported_primitive_names_primitive_and_line():
    x = random((8, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.sort(x_ref[...], axis=1)  # the offending line

    with pytest.raises(
        NotImplementedError,
        match=r"(?s)pallas_gpu.*kernel 'kernel' at .*test_lowering.py:\d+.*primitive 'sort'",
    ):
        R.call(kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32))(x)


@pytest.mark.parametrize(
    "m,k,n,dtype",
    [
        (8, 8, 8, jnp.float32),  # K below tl.dot's 16: widened to 16 (_widen_k)
        (1, 64, 64, jnp.bfloat16),  # tokamax's attention at block_q=1: M=1 goes to tl.dot
        (2, 64, 64, jnp.float32),
        (16, 4, 32, jnp.bfloat16),
        (5, 3, 7, jnp.float32),  # padded dims
        (16, 16, 16, jnp.int8),  # 8-bit: tl.dot needs K >= 32
    ],
)
def test_small_dots(m, k, n, dtype):
    if dtype == jnp.int8:
        a = jax.random.randint(fresh_key(), (m, k), -8, 8, jnp.int8)
        b = jax.random.randint(fresh_key(), (k, n), -8, 8, jnp.int8)
        out = whole(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.int32), a, b)
        np.testing.assert_array_equal(out, np.asarray(a, np.int32) @ np.asarray(b, np.int32))
        return
    a, b = random((m, k), dtype), random((k, n), dtype)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None  # IEEE f32, not the GPU's TF32
    out = whole(lambda x, y: jnp.dot(x, y, precision=precision, preferred_element_type=jnp.float32), a, b)
    want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    np.testing.assert_allclose(out, want, rtol=2e-2 if dtype == jnp.bfloat16 else 2e-3, atol=1e-2)


def test_small_dot_accumulates_and_batches():
    # small integers: exact in TF32 too, so every product and sum is exact on the GPU as on the CPU
    rng = np.random.default_rng(7)
    a, b, c = (jnp.asarray(rng.integers(-4, 5, s), jnp.float32) for s in [(4, 2, 8), (4, 8, 16), (2, 16)])

    def kernel(a_ref, b_ref, c_ref, o_ref):
        acc = c_ref[...]
        for i in range(4):  # acc + dot(...) with K = 8: the small-K path inside the accumulation
            acc = acc + jnp.dot(a_ref[i], b_ref[i], preferred_element_type=jnp.float32)
        o_ref[...] = acc + jnp.einsum("bmk,bkn->bmn", a_ref[...], b_ref[...]).sum(0)

    out = R.call(kernel, jax.ShapeDtypeStruct((2, 16), jnp.float32))(a, b, c)
    want = np.asarray(c) + 2 * np.einsum("bmk,bkn->mn", np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(out, want)


def test_non_pow2_reshape_error():
    x = random((6, 10), jnp.float32)
    with pytest.raises(NotImplementedError, match="powers of two"):
        whole(lambda a: a.reshape(10, 6), x)


def test_bad_compiler_params():
    with pytest.raises(ValueError, match="num_warps"):
        plgpu.CompilerParams(num_warps=64)
    with pytest.raises(ValueError, match="num_warps"):
        plgpu.CompilerParams(num_warps=3)


def test_scratch_partial_index_error():
    x = random((8, 16), jnp.float32)

    def kernel(x_ref, o_ref, s_ref):
        s_ref[0:4, :] = x_ref[0:4, :]
        o_ref[...] = x_ref[...]

    with pytest.raises(NotImplementedError, match="whole"):
        R.call(
            kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32), scratch_shapes=[pl.ANY((8, 16), jnp.float32)]
        )(x)


_ = functools


def test_block_too_large_names_kernel_line_and_fix():
    x = jax.ShapeDtypeStruct((1024, 1536), jnp.float32)  # pads to 1024 x 2048 = 2**21

    def big_block(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2  # the offending line

    with pytest.raises(
        NotImplementedError,
        match=r"(?s)pallas_gpu \(Triton\).*kernel 'big_block' at .*test_lowering.py:\d+.*"
        r"\(1024, 1536\) \(padded to \(1024, 2048\)\).*at most 2\*\*20.*smaller block shape",
    ):
        R.call(big_block, x)(jnp.zeros(x.shape, x.dtype))


def test_unsupported_primitive_names_backend_kernel_line():
    x = random((8, 16), jnp.float32)

    def uses_igamma(x_ref, o_ref):
        o_ref[...] = lax.igamma(x_ref[...], x_ref[...])  # the offending line: libdevice has no igamma

    with pytest.raises(NotImplementedError) as e:
        R.call(uses_igamma, jax.ShapeDtypeStruct((8, 16), jnp.float32))(x)
    msg = str(e.value)
    assert "pallas_gpu (Triton)" in msg and "kernel 'uses_igamma'" in msg
    assert "primitive 'igamma'" in msg and "has no Triton lowering" in msg
    assert "test_lowering.py:" in msg

    def uses_complex(x_ref, o_ref):
        o_ref[...] = jnp.fft.fft(x_ref[...]).real

    with pytest.raises(
        NotImplementedError, match=r"(?s)kernel 'uses_complex' at .*test_lowering.py:\d+.*complex64"
    ):
        R.call(uses_complex, jax.ShapeDtypeStruct((8, 16), jnp.float32))(x)
