"""pallas-core's lowering kit (``pallas._src.lowering_kit``) and composite math
(``pallas._src.math``), as backends see them through ``pallas.backend``: each
shared function against a plain jnp/scipy reference on fresh random data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.special as sp
from jax import lax

import pallas as pl
from pallas import backend as plb

_RNG = np.random.default_rng()


def _close(got, want, rtol, atol):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# Composite math


@pytest.mark.parametrize("xp", [jnp, np], ids=["jnp", "numpy"])
def test_erf_inv_f32(xp):
    x = _RNG.uniform(-1, 1, (4, 1000)).astype(np.float32)
    x[0, :4] = [0.0, 0.999999, -0.999, 0.5]
    with np.errstate(invalid="ignore"):  # numpy computes both sides of the where (0 * inf)
        got = plb.erf_inv_f32(jnp.asarray(x) if xp is jnp else x, xp=xp)
    assert np.asarray(got).dtype == np.float32
    want = sp.erfinv(x.astype(np.float64))
    _close(got, want, rtol=2e-5, atol=2e-6)
    if xp is jnp:  # XLA's own float32 erf_inv: the same polynomial on jaxlib 0.11.2, a more
        # accurate one on jaxlib 0.12.1 (1.3e-7 relative), so within ours' error of it
        _close(got, np.asarray(lax.erf_inv(jnp.asarray(x)), np.float64), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("xp", [jnp, np], ids=["jnp", "numpy"])
def test_erf_inv_f32_ends(xp):
    x = np.array([1.0, -1.0], np.float32)
    with np.errstate(all="ignore"):
        got = np.asarray(plb.erf_inv_f32(jnp.asarray(x) if xp is jnp else x, xp=xp))
    np.testing.assert_array_equal(got, [np.inf, -np.inf])


def test_erf_inv_f32_jitted():
    x = jnp.asarray(_RNG.uniform(-0.99, 0.99, (256,)).astype(np.float32))
    _close(jax.jit(plb.erf_inv_f32)(x), sp.erfinv(np.asarray(x, np.float64)), rtol=2e-5, atol=2e-6)


def _away_from_poles(x):
    return np.where(np.abs(x - np.round(x)) < 1e-2, x + 0.25, x)


def test_lgamma_f32():
    x = _away_from_poles(_RNG.uniform(-8, 30, (2000,))).astype(np.float32)
    got = jax.jit(plb.lgamma_f32)(jnp.asarray(x))
    _close(got, sp.gammaln(x.astype(np.float64)), rtol=1e-4, atol=1e-4)


def test_lgamma_f32_special_values():
    got = np.asarray(plb.lgamma_f32(jnp.asarray([np.inf, -np.inf, 1.0, 2.0, -3.0], np.float32)))
    np.testing.assert_allclose(got[:4], [np.inf, np.inf, 0.0, 0.0], atol=1e-6)
    assert got[4] == np.inf  # a pole


def test_digamma_f32():
    x = _away_from_poles(_RNG.uniform(-8, 30, (2000,))).astype(np.float32)
    got = jax.jit(plb.digamma_f32)(jnp.asarray(x))
    _close(got, sp.digamma(x.astype(np.float64)), rtol=1e-4, atol=1e-3)


def test_digamma_f32_special_values():
    got = np.asarray(plb.digamma_f32(jnp.asarray([0.0, -2.0, 1.0], np.float32)))
    assert got[0] == -np.inf and np.isnan(got[1])
    np.testing.assert_allclose(got[2], -np.euler_gamma, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_in_float32(dtype):
    x = jnp.asarray(_RNG.uniform(0.5, 20, (128,)), dtype)
    got = plb.in_float32(plb.lgamma_f32)(x)
    assert got.dtype == dtype
    want = sp.gammaln(np.asarray(x, np.float64))
    _close(got, want, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------
# The rule table, the jaxpr walk and composite tracing


def test_rule_table_registers_each_primitive():
    table = plb.RuleTable("test backend")

    @table.register(lax.exp_p, lax.log_p)
    def rule(ctx, x):
        return x

    assert table.backend == "test backend"
    assert table[lax.exp_p] is rule and table[lax.log_p] is rule
    assert table.get(lax.sin_p) is None


def _numpy_backend():
    """A toy backend whose "lowering" evaluates each equation with numpy: the walk,
    driven by a rule table, must compute what JAX computes."""
    table = plb.RuleTable("numpy")
    table.register(lax.add_p)(lambda x, y, **_: np.add(x, y))
    table.register(lax.mul_p)(lambda x, y, **_: np.multiply(x, y))
    table.register(lax.exp_p)(lambda x, **_: np.exp(x))
    table.register(lax.sin_p)(lambda x, **_: np.sin(x))
    table.register(lax.sort_p)(lambda *xs, **p: list(np.sort(np.stack(xs), axis=-1)))

    def lower(closed, *args):
        def literal(v):
            return np.asarray(v.val, v.aval.dtype)

        def lower_eqn(eqn, read):
            return table[eqn.primitive](*map(read, eqn.invars), **eqn.params)

        return plb.walk_jaxpr(closed.jaxpr, [*closed.consts, *args], literal=literal, lower_eqn=lower_eqn)

    return lower


def test_walk_jaxpr_computes_what_jax_computes():
    def f(x, y):
        return jnp.exp(x) * y + 2.0, jnp.sin(y)

    x, y = (_RNG.standard_normal((3, 5)).astype(np.float32) for _ in range(2))
    closed = jax.make_jaxpr(f)(x, y)
    got = _numpy_backend()(closed, x, y)
    for g, w in zip(got, f(x, y), strict=True):  # numpy's and XLA's exp/sin differ in the last bits
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_walk_jaxpr_multiple_results_and_dropped_outputs():
    x = _RNG.standard_normal((8,)).astype(np.float32)
    closed = jax.make_jaxpr(lambda x: lax.sort((x, x * 2.0), num_keys=1)[1])(x)
    (got,) = _numpy_backend()(closed, x)
    np.testing.assert_allclose(got, np.sort(x) * 2.0, rtol=1e-6)


def test_walk_jaxpr_skip():
    x = _RNG.standard_normal((4,)).astype(np.float32)
    jaxpr = jax.make_jaxpr(lambda x: (jnp.exp(x), x + x))(x).jaxpr
    seen = []

    def lower_eqn(eqn, read):
        seen.append(eqn.primitive)
        return plb.SKIP if eqn.primitive is lax.exp_p else np.add(*map(read, eqn.invars))

    with pytest.raises(KeyError):  # nothing bound the skipped equation's result
        plb.walk_jaxpr(jaxpr, [x], literal=None, lower_eqn=lower_eqn)
    assert seen == [lax.exp_p, lax.add_p]


def test_walk_jaxpr_checks_the_number_of_arguments():
    jaxpr = jax.make_jaxpr(lambda x, y: x + y)(1.0, 2.0).jaxpr
    with pytest.raises(ValueError):
        plb.walk_jaxpr(jaxpr, [1.0], literal=None, lower_eqn=None)


def test_trace_composite():
    avals = [jax.ShapeDtypeStruct((4, 8), jnp.float32)]
    jaxpr = plb.trace_composite(lambda x, *, k: x * k, avals, "mul", k=3.0)
    x = _RNG.standard_normal((4, 8)).astype(np.float32)
    (got,) = jax.core.eval_jaxpr(jaxpr, [], x)
    np.testing.assert_allclose(got, x * 3.0, rtol=1e-6)


def test_trace_composite_refuses_closed_over_arrays():
    table = jnp.asarray(_RNG.standard_normal((4, 8)).astype(np.float32))
    avals = [jax.ShapeDtypeStruct((4, 8), jnp.float32)]
    with pytest.raises(NotImplementedError, match="jnp definition of 'my_op' closes over arrays"):
        plb.trace_composite(lambda x: x + table, avals, "my_op")


# ---------------------------------------------------------------------------
# Uninitialized memory and next_power_of_2

_DTYPES = [
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.int8,
    np.int32,
    np.uint8,
    np.uint32,
    ml_dtypes.int4,
    np.bool_,
    np.complex64,
]


@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: np.dtype(d).name)
def test_uninitialized_fill_is_interpret_modes_value(dtype):
    got = plb.uninitialized_fill(dtype)
    assert got.shape == () and got.dtype == np.dtype(dtype)
    want = np.asarray(plb.uninitialized_value((), dtype))
    # compared as float64: NumPy 2.5 no longer takes bfloat16 NaNs as equal
    np.testing.assert_array_equal(np.float64(got), np.asarray(want, np.float64))


def test_uninitialized_fill_values():
    assert np.isnan(plb.uninitialized_fill(np.float32))
    assert plb.uninitialized_fill(np.int16) == np.iinfo(np.int16).min
    assert plb.uninitialized_fill(np.int64) == np.iinfo(np.int64).min  # 64-bit too, without jax_enable_x64
    assert np.isnan(plb.uninitialized_fill(np.float64))
    assert plb.uninitialized_fill(np.uint16) == 0
    assert not plb.uninitialized_fill(np.bool_)


@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: np.dtype(d).name)
def test_uninitialized_zero_mode(dtype):
    # An interpreter's uninitialized="zero" option: the numpy fill and the jnp value agree.
    got = plb.uninitialized_fill(dtype, "zero")
    assert got.shape == () and got.dtype == np.dtype(dtype) and not got
    want = plb.uninitialized_value((2, 3), dtype, "zero")
    assert want.dtype == np.dtype(dtype) and not np.any(np.asarray(want))


def test_grid_mapping_where_names_the_kernel():
    def scale(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    f = pl.pallas_call(scale, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)
    (eqn,) = [e for e in jax.make_jaxpr(f)(jnp.ones(8)).eqns if e.primitive.name == "pallas_call"]
    gm = eqn.params["grid_mapping"]
    assert gm.where == f"pallas_call 'scale' at {gm.source}" and "test_lowering_kit.py:" in gm.where


def test_next_power_of_2():
    xs = [0, 1, 2, 3, *map(int, _RNG.integers(4, 2**40, 200))]
    for x in xs:
        want = 1
        while want < x:
            want *= 2
        assert pl.next_power_of_2(x) == want, x
