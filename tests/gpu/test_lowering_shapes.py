"""Shape rules on loaded values (concatenate, pad, rev, slice, dynamic_slice,
split) and the reduction/scan/rounding rules, in several dtypes and in
non-power-of-two block shapes, run under Triton's interpreter against jnp;
plus a compile-to-cubin check of the same rules for sm_80 and sm_90."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import Runner, assert_close, random, whole, whole_multi
from jax import lax

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src.compile import compiler
from pallas_gpu._src.pallas_call_registration import lowered_kernel

R = Runner()
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.bool_]
# Power-of-two, non-power-of-two, and odd block shapes.
SHAPES = [(8, 16), (6, 12), (5, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("axis", [0, 1])
def test_concatenate(dtype, shape, axis):
    x, y = random(shape, dtype), random(shape, dtype)
    z = random((shape[0], 3) if axis == 1 else (7, shape[1]), dtype)

    def fn(a, b, c):
        return jnp.concatenate([a, c, b], axis=axis)

    assert_close(whole(fn, x, y, z), fn(x, y, z), dtype)


def test_concatenate_1d_and_blocked():
    x, y = random((13,), jnp.float32), random((6,), jnp.float32)
    assert_close(whole(lambda a, b: jnp.concatenate([b, a, b]), x, y), jnp.concatenate([y, x, y]))
    # Inside a gridded kernel with edge blocks.
    a = random((20, 12), jnp.float32)

    def kernel(x_ref, o_ref):
        v = x_ref[...]
        o_ref[...] = jnp.concatenate([v[:, 6:], v[:, :6]], axis=1)

    spec = pl.BlockSpec((8, 12), lambda i: (i, 0))
    out = R.call(kernel, jax.ShapeDtypeStruct(a.shape, a.dtype), grid=(3,), in_specs=[spec], out_specs=spec)(
        a
    )
    assert_close(out, jnp.roll(a, 6, axis=1))


PAD_CONFIGS = [
    [(1, 2, 0), (0, 3, 0)],
    [(2, 0, 1), (1, 1, 2)],  # interior padding
    [(-1, 2, 0), (3, -2, 1)],  # negative (cropping) padding
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", range(len(PAD_CONFIGS)))
def test_pad(dtype, shape, config):
    x = random(shape, dtype)
    value = random((), dtype)
    cfg = PAD_CONFIGS[config]

    def fn(a, v):
        return lax.pad(a, v, cfg)

    assert_close(whole(fn, x, value), fn(x, value), dtype)


def test_jnp_pad_modes():
    x = random((6, 10), jnp.float32)
    fn = lambda a: jnp.pad(a, ((1, 2), (3, 0)), constant_values=-7.0)  # noqa: E731
    assert_close(whole(fn, x), fn(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rev(dtype, shape):
    x = random(shape, dtype)
    fn = lambda a: (lax.rev(a, (0,)), lax.rev(a, (1,)), lax.rev(a, (0, 1)))  # noqa: E731
    for got, want in zip(whole_multi(fn, x), fn(x)):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 16), (7, 12), (13, 5)])
def test_static_slices(dtype, shape):
    x = random(shape, dtype)
    h, w = shape

    def fn(a):
        return (
            a[1 : h - 1, 2:w:3],
            lax.slice(a, (0, 1), (h, w), (2, 1)),
            a[h - 1 :, :],
            a[:, w - 2 : w - 1],
        )

    for got, want in zip(whole_multi(fn, x), fn(x)):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 16), (7, 12)])
def test_static_dynamic_slice(dtype, shape):
    x = random(shape, dtype)

    def fn(a):
        return (
            lax.dynamic_slice(a, (2, 1), (3, 5)),
            lax.dynamic_slice(a, (6, 20), (2, 4)),  # lax clamps starts that overrun
            lax.dynamic_slice_in_dim(a, 1, 4, axis=1),
        )

    for got, want in zip(whole_multi(fn, x), fn(x)):
        assert_close(got, want, dtype)


def test_dynamic_slice_traced_start():
    x = random((4, 8, 12), jnp.float32)

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        o_ref[...] = lax.dynamic_slice(x_ref[...], (i, 3), (5, 7))

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((4, 5, 7), jnp.float32),
        grid=(4,),
        in_specs=[pl.BlockSpec((None, 8, 12), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((None, 5, 7), lambda i: (i, 0, 0)),
    )(x)
    want = jnp.stack([lax.dynamic_slice(x[i], (i, 3), (5, 7)) for i in range(4)])
    assert_close(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 16), (6, 13)])
@pytest.mark.parametrize("axis", [0, 1])
def test_split(dtype, shape, axis):
    x = random(shape, dtype)
    n = shape[axis]
    fn = lambda a: tuple(jnp.split(a, [1, n // 2 + 1], axis=axis))  # noqa: E731
    for got, want in zip(whole_multi(fn, x), fn(x)):
        assert_close(got, want, dtype)


# ---------------------------------------------------------------------------
# Math and reductions in more dtypes and shapes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(8, 16), (5, 12)])
def test_erf_and_round(dtype, shape):
    x = random(shape, dtype) * 2.5
    # Exact halves exercise the tie rules of both rounding methods.
    halves = (jnp.round(random(shape, jnp.float32) * 4) / 2).astype(dtype)

    def fn(a, h):
        return (
            lax.erf(a),
            lax.round(h, lax.RoundingMethod.TO_NEAREST_EVEN),
            lax.round(h, lax.RoundingMethod.AWAY_FROM_ZERO),
            jnp.round(a),
        )

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in zip(whole_multi(fn, x, halves), fn(x, halves)):
        assert_close(got, want, dtype, **tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
@pytest.mark.parametrize("shape", [(8, 16), (5, 3)])
@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_prod_and_or(dtype, shape, axis):
    if dtype == jnp.bool_:
        x = random(shape, dtype)
        fn = lambda a: (jnp.all(a, axis=axis), jnp.any(a, axis=axis))  # noqa: E731
    elif jnp.issubdtype(dtype, jnp.integer):
        x = (
            random(shape, dtype, low=-1, high=1)
            if dtype != jnp.uint8
            else random(shape, dtype, low=0, high=1)
        )

        def fn(a):
            m = jnp.asarray(0x3F, dtype)
            return (
                jnp.prod(a % 3 + 1, axis=axis),
                lax.reduce_and(a | m, axes=(axis,)),
                lax.reduce_or(a & m, axes=(axis,)),
            )
    else:
        x = random(shape, dtype, low=0.5, high=1.5)
        fn = lambda a: (jnp.prod(a, axis=axis),)  # noqa: E731
    for got, want in zip(whole_multi(fn, x), fn(x)):
        assert_close(got, want, rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else assert_close(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("shape", [(8, 16), (6, 13)])
@pytest.mark.parametrize("axis", [0, 1])
def test_reverse_cumsum(dtype, shape, axis):
    x = random(shape, dtype)
    fn = lambda a: (  # noqa: E731
        lax.cumsum(a, axis=axis, reverse=True),
        lax.cumsum(a, axis=axis),
        lax.cummin(a, axis=axis, reverse=True),
    )
    tol = {} if dtype == jnp.int32 else dict(rtol=1e-5, atol=1e-4)
    if dtype == jnp.bfloat16:
        tol = dict(rtol=5e-2, atol=0.3)  # partial sums are rounded to bf16 in XLA, not here
    for got, want in zip(whole_multi(fn, x), fn(x)):
        assert_close(got, want, dtype, **tol)


# ---------------------------------------------------------------------------
# Compilation to cubins


def _shapes_fn(v, b):
    c = jnp.concatenate([v[:, 2:], lax.rev(v, (1,))[:, :2]], axis=1)
    d = lax.dynamic_slice(v, (1, 0), (5, 12))
    s0, s1 = jnp.split(v, [5], axis=1)
    out = (
        c
        + lax.pad(d, 0.0, [(0, 1, 0), (0, 0, 0)])
        + jnp.concatenate([s1, s0], axis=1)
        + lax.erf(v)
        + lax.round(v, lax.RoundingMethod.TO_NEAREST_EVEN)
        + lax.cumsum(v, axis=1, reverse=True)
        + jnp.prod(v, axis=1, keepdims=True)
    )
    return out, lax.pad(b, False, [(1, 0, 1), (0, 0, 0)])[:6] | jnp.any(b, axis=0, keepdims=True)


def _shapes_call(**kw):
    def kernel(x_ref, b_ref, o_ref, p_ref):
        o_ref[...], p_ref[...] = _shapes_fn(x_ref[...], b_ref[...])

    out_shape = (jax.ShapeDtypeStruct((6, 12), jnp.float32), jax.ShapeDtypeStruct((6, 12), jnp.bool_))
    return pl.pallas_call(kernel, out_shape, **kw)


@pytest.mark.parametrize("cc", [80, 90])
def test_shape_rules_compile(cc):
    args = (jax.ShapeDtypeStruct((6, 12), jnp.float32), jax.ShapeDtypeStruct((3, 12), jnp.bool_))
    jaxpr = jax.make_jaxpr(_shapes_call())(*args)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    lk = lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"])
    compiled = compiler.compile_kernel(
        lk, cc, tuple(sorted(plgpu.CompilerParams().compile_options().items()))
    )
    assert compiled.asm["cubin"][:4] == b"\x7fELF"


def test_shape_rules_kernel_runs():
    x, b = random((6, 12), jnp.float32, low=-1, high=1), random((3, 12), jnp.bool_)
    out, p = _shapes_call(interpret=plgpu.InterpretParams())(x, b)
    want, want_p = _shapes_fn(x, b)
    assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert_close(p, want_p)
