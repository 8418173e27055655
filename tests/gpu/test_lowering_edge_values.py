"""Values where hardware and XLA disagree, made to follow XLA in the generated
source (so the GPU and Triton's interpreter agree): integer division and
remainder by zero and INT_MIN / -1, and float -> int casts of NaN, infinities
and out-of-range values (XLA saturates). Each runs under Triton's interpreter
against jnp on the CPU and compiles for sm_80/sm_90; the ``gpu``-marked tests
run on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import assert_close, fresh_key, gpu, random, whole, whole_multi
from jax import lax

import pallas as pl

INTS = [jnp.int32, jnp.int8, jnp.int16, jnp.uint8, jnp.uint32]


def _operands(dtype):
    """Random x, y with zeros in y, and INT_MIN / -1 pairs for signed ints."""
    x, y = random((8, 32), dtype), random((8, 32), dtype)
    zeros = jax.random.bernoulli(fresh_key(), 0.3, y.shape)
    y = jnp.where(zeros, jnp.zeros_like(y), y)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        x = x.at[0, :4].set(jnp.iinfo(dtype).min)
        y = y.at[0, :4].set(-1)
    return x, y


@pytest.mark.parametrize("dtype", INTS)
def test_int_div_rem_by_zero(dtype):
    x, y = _operands(dtype)
    assert_close(whole(lax.div, x, y), lax.div(x, y))
    assert_close(whole(lax.rem, x, y), lax.rem(x, y))


@pytest.mark.parametrize("d", [3, -1, -7])
def test_int_div_rem_by_a_constant(d):
    x, _ = _operands(jnp.int32)
    fn = lambda v: (lax.div(v, jnp.int32(d)), lax.rem(v, jnp.int32(d)))  # noqa: E731
    q, r = whole_multi(fn, x)
    assert_close(q, fn(x)[0])
    assert_close(r, fn(x)[1])


SPECIAL = [np.nan, np.inf, -np.inf, 3e9, -3e9, 1e20, -1e20, 2.0**31, 300.0, -300.0, 65504.0, -0.5]


def _floats(dtype):
    x = random((8, 32), jnp.float32, low=-400, high=400)
    x = x.at[0, : len(SPECIAL)].set(jnp.array(SPECIAL, jnp.float32))
    return x.astype(dtype)


@pytest.mark.parametrize("to", INTS)
@pytest.mark.parametrize("src", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_float_to_int_saturates(src, to):
    x = _floats(src)
    fn = lambda v: v.astype(to)  # noqa: E731
    assert_close(whole(fn, x), fn(x))


def test_float_to_int_in_pallas_interpret_agrees():
    """The Triton interpreter path and pallas-core's interpret mode agree."""
    x = _floats(jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jnp.int32)

    f = lambda interpret: pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, jnp.int32), interpret=interpret
    )  # noqa: E731
    assert_close(whole(lambda v: v.astype(jnp.int32), x), f(True)(x))


@gpu
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint32])
def test_int_div_rem_by_zero_on_gpu(dtype):
    x, y = _operands(dtype)

    def kernel(x_ref, y_ref, q_ref, r_ref):
        q_ref[...] = lax.div(x_ref[...], y_ref[...])
        r_ref[...] = lax.rem(x_ref[...], y_ref[...])

    q, r = pl.pallas_call(kernel, [jax.ShapeDtypeStruct(x.shape, dtype)] * 2)(x, y)
    assert_close(q, lax.div(x, y))
    assert_close(r, lax.rem(x, y))


@gpu
@pytest.mark.parametrize("to", [jnp.int32, jnp.int8, jnp.uint8, jnp.uint32])
def test_float_to_int_saturates_on_gpu(to):
    x = _floats(jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(to)

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, to))(x)
    assert_close(out, x.astype(to))
