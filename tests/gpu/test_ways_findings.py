"""What moving the suites onto tests/ways found in pallas-gpu, fixed and checked
against plain jnp/numpy on fresh random data: under Triton's interpreter anywhere,
compiled on the GPU with ``PALLAS_GPU_TESTS=gpu``.

* A whole-array block of an empty array divided by its zero block size (lowering).
* An integer ``jnp.dot`` other than int8 went to ``tl.dot``, which takes int8 only:
  it is now split into int8 digit dots (exact modulo 2**32, as XLA wraps).
* Steps that read what earlier steps stored (an aliased input read back, an output
  block shared by programs) saw another step order's values: outputs aliased to a
  read input were kept in registers across the sequential steps, and the sequential
  loops reordered steps that other programs' steps depend on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import ON_DEVICE, triton_mode

import pallas as pl
from pallas_gpu._src.pallas_call_registration import lowered_kernel

_sds = jax.ShapeDtypeStruct


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence().entropy if seed < 0 else seed)


def _source(f, *args) -> str:
    """The generated Triton source of the one pallas_call in ``f(*args)``."""
    jaxpr = jax.make_jaxpr(f)(*args)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    p = eqn.params
    aliases = tuple(p.get("input_output_aliases", ()))
    return lowered_kernel(p["jaxpr"], p["grid_mapping"], (), aliases).module_source(interpret=True)


# ---------------------------------------------------------------------------
# Empty arrays


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


class TestEmptyArrays:
    def test_whole_array_block(self):
        z = jnp.zeros((0, 128), jnp.float32)
        f = pl.pallas_call(_add_one, out_shape=z, interpret=triton_mode())
        assert f(z).shape == (0, 128)
        assert jax.jit(f)(z).shape == (0, 128)
        assert jax.vmap(f)(jnp.zeros((3, 0, 128))).shape == (3, 0, 128)

    def test_empty_input_non_empty_output(self):
        """The kernel still runs: an empty block reads nothing (its sum is 0)."""
        x = jnp.zeros((0, 128), jnp.float32)
        y = jnp.asarray(_rng(-1).standard_normal(16), jnp.float32)

        def kernel(x_ref, y_ref, o_ref):
            o_ref[...] = y_ref[...] * 2 + jnp.sum(x_ref[...])

        out = pl.pallas_call(kernel, out_shape=y, interpret=triton_mode())(x, y)
        np.testing.assert_allclose(out, y * 2 + jnp.sum(x), rtol=1e-6)

    def test_empty_block_on_a_grid(self):
        x = jnp.zeros((0, 128), jnp.float32)
        y = jnp.asarray(_rng(-1).standard_normal(16), jnp.float32)

        def kernel(x_ref, y_ref, o_ref):
            o_ref[...] = y_ref[...] - jnp.sum(x_ref[...]) + pl.program_id(0).astype(jnp.float32)

        out = pl.pallas_call(
            kernel,
            out_shape=y,
            grid=(2,),
            in_specs=[pl.BlockSpec((0, 128), lambda i: (i, 0)), pl.BlockSpec((8,), lambda i: (i,))],
            out_specs=pl.BlockSpec((8,), lambda i: (i,)),
            interpret=triton_mode(),
        )(x, y)
        np.testing.assert_allclose(out, y + jnp.repeat(jnp.arange(2.0), 8), rtol=1e-6)


# ---------------------------------------------------------------------------
# Integer dots


def _ints(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return jnp.asarray(rng.random(shape) < 0.2)
    info = np.iinfo(dtype)
    return jnp.asarray(rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype))


_INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32"]


class TestIntegerDot:
    @pytest.mark.parametrize("preferred", [None, "int32"])
    @pytest.mark.parametrize("dtype", [*_INT_DTYPES, "bool"])
    def test_full_range_wraps_as_xla(self, dtype, preferred):
        """Full-range values: the products and sums wrap, as XLA's integer dots do."""
        if dtype == "bool" and preferred:
            pytest.skip("a bool dot with an int32 result is not a jnp.dot JAX lowers either")
        rng = _rng(-1)
        a, b = _ints(rng, (32, 48), dtype), _ints(rng, (48, 16), dtype)

        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=preferred)

        expected = jnp.dot(a, b, preferred_element_type=preferred)
        out = pl.pallas_call(kernel, out_shape=expected, interpret=triton_mode())(a, b)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))

    @pytest.mark.parametrize("k", [4, 24])
    def test_small_k_and_batched(self, k):
        """K below tl.dot's minimum (widened), and a batch dimension."""
        rng = _rng(-1)
        a, b = _ints(rng, (2, 16, k), "int32"), _ints(rng, (2, k, 8), "int32")

        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = jnp.einsum("bmk,bkn->bmn", a_ref[...], b_ref[...])

        expected = jnp.einsum("bmk,bkn->bmn", a, b)
        out = pl.pallas_call(kernel, out_shape=expected, interpret=triton_mode())(a, b)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))

    def test_blocked_matmul_k_accumulation(self):
        m, n, k, bm, bn, bk = 128, 128, 192, 64, 64, 64
        rng = _rng(-1)
        a = jnp.asarray(rng.integers(-3000, 3000, (m, k)), jnp.int32)
        b = jnp.asarray(rng.integers(-3000, 3000, (k, n)), jnp.int32)

        def matmul(a_ref, b_ref, o_ref):
            @pl.when(pl.program_id(2) == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.int32)

        out = pl.pallas_call(
            matmul,
            out_shape=_sds((m, n), jnp.int32),
            grid=(m // bm, n // bn, k // bk),
            in_specs=[
                pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
            interpret=triton_mode(),
        )(a, b)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.dot(a, b)))


# ---------------------------------------------------------------------------
# Steps that read what earlier steps stored


class TestStepOrder:
    def test_aliased_input_read_within_a_program(self):
        """The aliased input is read back through the output's own index map along a
        sequential axis: each step sees the previous step's store."""
        rng = _rng(-1)
        a = jnp.asarray(rng.standard_normal(3), jnp.float32)
        x = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)

        def kernel(a_ref, x_ref, o_ref):
            o_ref[...] = a_ref[...] * 0.5 + x_ref[...]

        def f(a, x):
            return pl.pallas_call(
                kernel,
                out_shape=_sds((3,), jnp.float32),
                grid=(3, 4),
                in_specs=[
                    pl.BlockSpec((1,), lambda i, j: (i,)),
                    pl.BlockSpec((None, 1), lambda i, j: (i, j)),
                ],
                out_specs=pl.BlockSpec((1,), lambda i, j: (i,)),
                input_output_aliases={0: 0},
                interpret=triton_mode(),
            )(a, x)

        expected = np.asarray(a).copy()
        xn = np.asarray(x)
        for i, j in np.ndindex(3, 4):
            expected[i] = np.float32(expected[i] * np.float32(0.5) + xn[i, j])
        np.testing.assert_allclose(np.asarray(f(a, x)), expected, rtol=1e-6)
        src = _source(f, a, x)
        assert "for step" in src, "axis 1 should still run as a loop inside each program"
        assert "tl.debug_barrier()" in src, "the aliased output should stay in memory between steps"

    def test_aliased_input_read_across_programs(self):
        """grid (2, 2, 5), output block (i1,), the aliased input's block constant (1,): a
        program reads what another stores, so the steps keep their grid order."""
        rng = _rng(-1)
        init = jnp.asarray(rng.standard_normal(2), jnp.float32)
        x = jnp.asarray(rng.standard_normal((2, 2, 5)), jnp.float32)

        def kernel(a_ref, x_ref, o_ref):
            o_ref[...] = a_ref[...] * 0.5 + x_ref[...].reshape(1)

        out = pl.pallas_call(
            kernel,
            out_shape=_sds((2,), jnp.float32),
            grid=(2, 2, 5),
            in_specs=[
                pl.BlockSpec((1,), lambda i, j, k: (1,)),
                pl.BlockSpec((None, None, 1), lambda i, j, k: (i, j, k)),
            ],
            out_specs=pl.BlockSpec((1,), lambda i, j, k: (j,)),
            input_output_aliases={0: 0},
            interpret=triton_mode(),
        )(init, x)
        expected = np.asarray(init).copy()
        xn = np.asarray(x)
        for i, j, k in np.ndindex(2, 2, 5):
            expected[j] = np.float32(expected[1] * np.float32(0.5) + xn[i, j, k])
        if ON_DEVICE:
            pytest.skip("programs reading each other's stores race on a GPU")
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)

    def test_output_block_shared_by_programs(self):
        """Output 0 ignores grid axis 2, which output 1 reads (so axis 2 is parallel): its
        block is shared by programs, and the steps keep their grid order."""
        rng = _rng(-1)
        init = jnp.asarray(rng.standard_normal(2), jnp.float32)
        x = jnp.asarray(rng.standard_normal((2, 2, 3)), jnp.float32)

        def kernel(x_ref, a_ref, o_ref, p_ref):
            o_ref[...] = o_ref[...] * 0.5 + x_ref[...].reshape(1)
            p_ref[...] = o_ref[...].reshape(1, 1) - 1.0

        out, p = pl.pallas_call(
            kernel,
            out_shape=(_sds((2,), jnp.float32), _sds((2, 3), jnp.float32)),
            grid=(2, 2, 3),
            in_specs=[
                pl.BlockSpec((None, None, 1), lambda i, j, k: (i, j, k)),
                pl.BlockSpec((1,), lambda i, j, k: (i,)),
            ],
            out_specs=(
                pl.BlockSpec((1,), lambda i, j, k: (i,)),
                pl.BlockSpec((1, 1), lambda i, j, k: (i, k)),
            ),
            input_output_aliases={1: 0},
            interpret=triton_mode(),
        )(x, init)
        o_exp = np.asarray(init).copy()
        p_exp = np.zeros((2, 3), np.float32)
        xn = np.asarray(x)
        for i, j, k in np.ndindex(2, 2, 3):
            o_exp[i] = np.float32(o_exp[i] * np.float32(0.5) + xn[i, j, k])
            p_exp[i, k] = o_exp[i] - np.float32(1.0)
        if ON_DEVICE:
            pytest.skip("programs writing one output block race on a GPU")
        np.testing.assert_allclose(np.asarray(out), o_exp, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(p), p_exp, rtol=1e-6)

    def test_race_free_reorder_keeps_the_loop(self):
        """grid (b, k, h), output block (b, h): the k loop runs inside each (b, h) program
        (out of grid order, which no other program can see), and the sums are right."""
        rng = _rng(-1)
        x = jnp.asarray(rng.standard_normal((2, 4, 3, 8)), jnp.float32)

        def kernel(x_ref, o_ref):
            @pl.when(pl.program_id(1) == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            o_ref[...] = o_ref[...] * 0.5 + x_ref[...]

        def f(x):
            return pl.pallas_call(
                kernel,
                out_shape=_sds((2, 3, 8), jnp.float32),
                grid=(2, 4, 3),
                in_specs=[pl.BlockSpec((None, None, None, 8), lambda b, k, h: (b, k, h, 0))],
                out_specs=pl.BlockSpec((None, None, 8), lambda b, k, h: (b, h, 0)),
                interpret=triton_mode(),
            )(x)

        expected = np.zeros((2, 3, 8), np.float32)
        xn = np.asarray(x)
        for k in range(4):
            expected = expected * np.float32(0.5) + xn[:, k]
        np.testing.assert_allclose(np.asarray(f(x)), expected, rtol=1e-6)
        assert "for step" in _source(f, x)
