"""The kernel language: Refs and indexing, jnp/lax ops, control flow, generic primitives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from pallas_test_base import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    PallasTest,
    assert_allclose,
    dtype_id,
)
from ways import every_way

import pallas as pl


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@every_way()
class TestProgramIds(PallasTest):
    def test_program_id_and_num_programs(self):
        x = self.rand((3, 4, 8))
        spec = pl.BlockSpec((1, 2, 8), lambda i, j: (i, j, 0))

        def kernel(x_ref, o_ref):
            i, j = pl.program_id(0), pl.program_id(1)
            ni, nj = pl.num_programs(0), pl.num_programs(1)
            tag = (i * 1000 + j * 100 + ni * 10 + nj).astype(jnp.float32)
            o_ref[...] = x_ref[...] + tag

        out = self.pallas_call(kernel, _sds((3, 4, 8)), grid=(3, 2), in_specs=[spec], out_specs=spec)(x)
        i = np.arange(3)[:, None, None]
        j = (np.arange(4) // 2)[None, :, None]
        assert_allclose(out, x + (i * 1000 + j * 100 + 3 * 10 + 2).astype(np.float32))

    def test_negative_program_id_axis(self):
        x = self.rand((4, 6))
        spec = pl.BlockSpec((2, 3), lambda i, j: (i, j))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * (pl.program_id(-1) + 1).astype(jnp.float32)

        out = self.pallas_call(kernel, _sds((4, 6)), grid=(2, 2), in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, x * jnp.repeat(jnp.array([1.0, 2.0]), 3)[None, :])

    def test_program_id_in_index_computation(self):
        x = self.rand((16,))

        def kernel(x_ref, o_ref):
            i = pl.program_id(0)
            o_ref[...] = x_ref[pl.ds(i * 4, 4)][::-1]

        out = self.pallas_call(
            kernel,
            _sds((16,)),
            grid=(4,),
            in_specs=[pl.no_block_spec],
            out_specs=pl.BlockSpec((4,), lambda i: (i,)),
        )(x)
        assert_allclose(out, x.reshape(4, 4)[:, ::-1].reshape(16))


@every_way()
class TestRefIndexing(PallasTest):
    def _run(self, kernel, x, out_shape):
        return self.pallas_call(kernel, _sds(out_shape, x.dtype))(x)

    def test_int_index(self):
        x = self.rand((4, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[2] + x_ref[3, :]

        assert_allclose(self._run(kernel, x, (8,)), x[2] + x[3])

    def test_int_store(self):
        x = self.rand((4, 8))

        def kernel(x_ref, o_ref):
            for r in range(4):
                o_ref[r] = x_ref[3 - r] * float(r)

        expected = x[::-1] * jnp.arange(4.0)[:, None]
        assert_allclose(self._run(kernel, x, (4, 8)), expected)

    def test_static_slices(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref):
            o_ref[:4, :] = x_ref[4:, :]
            o_ref[4:, :] = x_ref[:4, :] * 2.0

        expected = jnp.concatenate([x[4:], x[:4] * 2.0])
        assert_allclose(self._run(kernel, x, (8, 8)), expected)

    def test_ellipsis(self):
        x = self.rand((2, 3, 8))

        def kernel(x_ref, o_ref):
            o_ref[..., 0:4] = x_ref[..., 4:8]
            o_ref[1, ...] = x_ref[0, ...]
            o_ref[0, ..., 4:] = x_ref[1, ..., :4]

        expected = np.array(x)
        expected[..., 0:4] = x[..., 4:8]
        expected[1, ...] = x[0, ...]
        expected[0, ..., 4:] = x[1, ..., :4]
        assert_allclose(self._run(kernel, x, (2, 3, 8)), expected)

    @pytest.mark.parametrize("ds", [pl.ds, pl.dslice], ids=["ds", "dslice"])
    def test_ds_static(self, ds):
        x = self.rand((16,))

        def kernel(x_ref, o_ref):
            o_ref[ds(0, 8)] = x_ref[ds(8, 8)]
            o_ref[ds(8, 8)] = x_ref[ds(0, 8)]

        assert_allclose(self._run(kernel, x, (16,)), jnp.roll(x, 8))

    def test_ds_dynamic_start_in_loop(self):
        x = self.rand((32, 4))

        def kernel(x_ref, o_ref):
            def body(i, acc):
                return acc + x_ref[pl.ds(i * 8, 8), :]

            o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((8, 4), jnp.float32))

        assert_allclose(self._run(kernel, x, (8, 4)), x.reshape(4, 8, 4).sum(0), scale=10)

    def test_ds_strided(self):
        x = self.rand((8, 16))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[:, pl.ds(1, 8, stride=2)] - x_ref[:, pl.ds(0, 8, stride=2)]

        assert_allclose(self._run(kernel, x, (8, 8)), x[:, 1::2] - x[:, 0::2])

    def test_ds_dynamic_start_with_stride(self):
        x = self.rand((4, 32))

        def kernel(x_ref, o_ref):
            i = pl.program_id(0)
            o_ref[...] = x_ref[:, pl.ds(i * 8 + 1, 4, stride=2)]

        out = self.pallas_call(
            kernel,
            _sds((4, 16)),
            grid=(4,),
            in_specs=[pl.no_block_spec],
            out_specs=pl.BlockSpec((4, 4), lambda i: (0, i)),
        )(x)
        expected = jnp.concatenate([x[:, i * 8 + 1 : i * 8 + 9 : 2] for i in range(4)], axis=1)
        assert_allclose(out, expected)

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
    def test_augmented_assignment_dtypes(self, dtype):
        x, y = self.rand((8, 8), dtype), self.rand((8, 8), dtype)
        spec = pl.BlockSpec((4, 8), lambda i, k: (i, 0))

        def kernel(x_ref, y_ref, o_ref):
            @pl.when(pl.program_id(1) == 0)
            def _():
                o_ref[...] = x_ref[...]

            o_ref[...] += y_ref[...]

        out = self.pallas_call(
            kernel, _sds((8, 8), dtype), grid=(2, 3), in_specs=[spec, spec], out_specs=spec
        )(x, y)
        assert out.dtype == dtype
        expected = x
        for _ in range(3):
            expected = expected + y
        assert_allclose(out, expected)

    def test_slice_object(self):
        x = self.rand((12, 4))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[pl.Slice(0, 4, 3), :] + x_ref[pl.Slice(2, 4), :]

        assert_allclose(self._run(kernel, x, (4, 4)), x[0:12:3] + x[2:6])

    def test_strided_store(self):
        x = self.rand((8,))

        def kernel(x_ref, o_ref):
            o_ref[pl.ds(0, 4, stride=2)] = x_ref[pl.ds(0, 4)]
            o_ref[pl.ds(1, 4, stride=2)] = x_ref[pl.ds(4, 4)]

        expected = jnp.stack([x[:4], x[4:]], axis=1).reshape(8)
        assert_allclose(self._run(kernel, x, (8,)), expected)

    def test_ref_at(self):
        x = self.rand((4, 16))

        def kernel(x_ref, o_ref):
            top = x_ref.at[0:2]
            out_right = o_ref.at[:, 8:]
            out_right[...] = top[...][:, :8] * 2.0
            o_ref.at[:, :8][...] = x_ref.at[2:4, 8:16][...]

        expected = jnp.concatenate([x[2:4, 8:], x[0:2, :8] * 2.0], axis=1)
        assert_allclose(self._run(kernel, x, (2, 16)), expected)

    def test_ref_at_nested_and_dynamic(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref):
            def body(i, carry):
                row = x_ref.at[pl.ds(i, 1)]
                o_ref.at[pl.ds(7 - i, 1)][...] = row[...] + 1.0
                return carry

            lax.fori_loop(0, 8, body, 0)

        assert_allclose(self._run(kernel, x, (8, 8)), x[::-1] + 1.0)

    def test_augmented_assignment(self):
        x = self.rand((4, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]
            o_ref[...] += x_ref[...] * 2.0
            o_ref[1:3, :] -= 1.0
            o_ref[0] *= 4.0

        expected = np.array(x * 3.0)
        expected[1:3] -= 1.0
        expected[0] *= 4.0
        assert_allclose(self._run(kernel, x, (4, 8)), expected)

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
    def test_ref_shape_and_dtype(self, dtype):
        x = self.rand((6, 10), dtype)
        spec = pl.BlockSpec((2, 5), lambda i, j: (i, j))
        seen = []

        def kernel(x_ref, o_ref):
            seen.append((x_ref.shape, x_ref.dtype, o_ref.shape, o_ref.dtype, x_ref.ndim))
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype) + x_ref[...].astype(o_ref.dtype)

        out = self.pallas_call(
            kernel, _sds((6, 10), jnp.float32), grid=(3, 2), in_specs=[spec], out_specs=spec
        )(x)
        assert seen[0] == ((2, 5), jnp.dtype(dtype), (2, 5), jnp.dtype(jnp.float32), 2)
        assert_allclose(out, x.astype(jnp.float32))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@every_way()
class TestFloatOps(PallasTest):
    def test_elementwise_unary(self, dtype):
        x = self.rand((8, 16), dtype)

        def kernel(x_ref, o_ref):
            v = x_ref[...]
            o_ref[...] = jnp.exp(v * 0.1) + jnp.sin(v) - jnp.abs(v) + lax.rsqrt(v * v + 1) + jnp.tanh(v)

        def ref(v):
            return jnp.exp(v * 0.1) + jnp.sin(v) - jnp.abs(v) + lax.rsqrt(v * v + 1) + jnp.tanh(v)

        out = self.pallas_call(kernel, _sds((8, 16), dtype))(x)
        assert out.dtype == dtype
        assert_allclose(out, ref(x), scale=4)

    def test_reductions(self, dtype):
        x = self.rand((8, 16), dtype)

        def kernel(x_ref, s_ref, m_ref, n_ref, a_ref):
            v = x_ref[...].astype(jnp.float32)
            s_ref[...] = jnp.sum(v, axis=1)
            m_ref[...] = jnp.max(v, axis=0)
            n_ref[...] = jnp.min(v)
            a_ref[...] = jnp.argmax(v, axis=1).astype(jnp.int32)

        s, m, n, a = self.pallas_call(kernel, (_sds((8,)), _sds((16,)), _sds(()), _sds((8,), jnp.int32)))(x)
        xf = x.astype(jnp.float32)
        assert_allclose(s, jnp.sum(xf, axis=1), jnp.float32, scale=10)
        assert_allclose(m, jnp.max(xf, axis=0), jnp.float32)
        assert_allclose(n, jnp.min(xf), jnp.float32)
        np.testing.assert_array_equal(a, jnp.argmax(xf, axis=1))

    def test_row_softmax(self, dtype):
        x = self.rand((16, 32), dtype)
        spec = pl.BlockSpec((4, 32), lambda i: (i, 0))

        def softmax(x_ref, o_ref):
            v = x_ref[...].astype(jnp.float32)
            v = v - jnp.max(v, axis=-1, keepdims=True)
            e = jnp.exp(v)
            o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)

        out = self.pallas_call(softmax, _sds((16, 32), dtype), grid=(4,), in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(dtype))

    def test_dot(self, dtype):
        a, b = self.rand((16, 32), dtype), self.rand((32, 8), dtype)

        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        out = self.pallas_call(kernel, _sds((16, 8)))(a, b)
        expected = jnp.dot(a, b, preferred_element_type=jnp.float32)
        assert_allclose(out, expected, jnp.float32, scale=100)

    def test_dot_transposed_operand(self, dtype):
        a, b = self.rand((8, 16), dtype), self.rand((8, 16), dtype)

        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = jnp.dot(a_ref[...], b_ref[...].T).astype(o_ref.dtype)

        out = self.pallas_call(kernel, _sds((8, 8), dtype))(a, b)
        assert_allclose(out, jnp.dot(a, b.T), scale=10)


@every_way()
class TestShapeOps(PallasTest):
    def test_broadcast_reshape_transpose(self):
        x, y = self.rand((4, 8)), self.rand((8,))

        def kernel(x_ref, y_ref, o_ref):
            v = x_ref[...] + jnp.broadcast_to(y_ref[...], (4, 8))
            v = v.reshape(2, 2, 8)
            v = jnp.transpose(v, (2, 0, 1))
            o_ref[...] = v + y_ref[...][:, None, None]

        out = self.pallas_call(kernel, _sds((8, 2, 2)))(x, y)
        expected = jnp.transpose((x + y).reshape(2, 2, 8), (2, 0, 1)) + y[:, None, None]
        assert_allclose(out, expected)

    def test_iota_where_astype(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref, i_ref):
            rows = lax.broadcasted_iota(jnp.int32, (8, 8), 0)
            cols = jnp.arange(8, dtype=jnp.int32)[None, :]
            v = jnp.where(rows >= cols, x_ref[...], -x_ref[...])
            o_ref[...] = v
            i_ref[...] = (v * 10).astype(jnp.int32) + rows

        out, ints = self.pallas_call(kernel, (_sds((8, 8)), _sds((8, 8), jnp.int32)))(x)
        rows = np.arange(8)[:, None]
        expected = jnp.where(rows >= np.arange(8)[None, :], x, -x)
        assert_allclose(out, expected)
        np.testing.assert_array_equal(ints, (expected * 10).astype(jnp.int32) + rows)

    def test_concatenate_and_stack(self):
        x = self.rand((4, 4))

        def kernel(x_ref, o_ref):
            v = x_ref[...]
            o_ref[...] = jnp.concatenate([v, v.T * 2.0], axis=1)

        out = self.pallas_call(kernel, _sds((4, 8)))(x)
        assert_allclose(out, jnp.concatenate([x, x.T * 2.0], axis=1))


@every_way()
class TestIntOps(PallasTest):
    def test_integer_arithmetic(self):
        x = self.rand((8, 16), jnp.int32, low=-1000, high=1000)
        y = self.rand((8, 16), jnp.int32, low=1, high=50)

        def kernel(x_ref, y_ref, o_ref):
            a, b = x_ref[...], y_ref[...]
            o_ref[...] = (a // b) + (a % b) * 3 + (a >> 2) - (a & b) + jnp.maximum(a, b * 10)

        out = self.pallas_call(kernel, _sds((8, 16), jnp.int32))(x, y)
        expected = (x // y) + (x % y) * 3 + (x >> 2) - (x & y) + jnp.maximum(x, y * 10)
        np.testing.assert_array_equal(out, expected)

    def test_integer_reduction_and_cumsum(self):
        x = self.rand((8, 16), jnp.int32, low=-100, high=100)

        def kernel(x_ref, s_ref, c_ref):
            s_ref[...] = jnp.sum(x_ref[...], axis=0)
            c_ref[...] = jnp.cumsum(x_ref[...], axis=1)

        s, c = self.pallas_call(kernel, (_sds((16,), jnp.int32), _sds((8, 16), jnp.int32)))(x)
        np.testing.assert_array_equal(s, jnp.sum(x, axis=0))
        np.testing.assert_array_equal(c, jnp.cumsum(x, axis=1))


@every_way()
class TestControlFlow(PallasTest):
    def test_fori_loop(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.zeros_like(o_ref)

            def body(i, carry):
                o_ref[...] += x_ref[...] * i.astype(jnp.float32)
                return carry + 1

            n = lax.fori_loop(0, 5, body, 0)
            o_ref[...] += n.astype(jnp.float32)

        out = self.pallas_call(kernel, _sds((8, 8)))(x)
        assert_allclose(out, x * 10.0 + 5.0, scale=10)

    def test_refs_in_a_loop_carry(self):
        # Refs carried through a fori_loop unchanged and read in its body, as JAX's Pallas
        # allows (its kernels trace with JAX's mutable-array checks off; jax_enable_checks is on).
        x, w = self.rand((8, 16)), self.rand((4, 16))

        def kernel(x_ref, w_ref, o_ref):
            def body(i, carry):
                acc, xr, wr = carry
                return acc + xr[...] * wr[i], xr, wr

            o_ref[...] = lax.fori_loop(0, 4, body, (jnp.zeros((8, 16), jnp.float32), x_ref, w_ref))[0]

        out = self.pallas_call(kernel, _sds((8, 16)))(x, w)
        assert_allclose(out, x * jnp.sum(w, axis=0), scale=4)

    def test_fori_loop_dynamic_bounds(self):
        x = self.rand((4, 8))
        spec = pl.BlockSpec((1, 8), lambda i: (i, 0))

        def kernel(x_ref, o_ref):
            # Loop trip count depends on the program id: row i is doubled i times.
            o_ref[...] = lax.fori_loop(0, pl.program_id(0), lambda _, v: v * 2.0, x_ref[...])

        out = self.pallas_call(kernel, _sds((4, 8)), grid=(4,), in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, x * (2.0 ** jnp.arange(4.0))[:, None])

    def test_while_loop(self):
        x = self.rand((8,))

        def kernel(x_ref, o_ref):
            def cond(c):
                i, v = c
                return jnp.logical_and(i < 20, jnp.max(jnp.abs(v)) < 100.0)

            def body(c):
                i, v = c
                return i + 1, v * 1.5 + 1.0

            _, v = lax.while_loop(cond, body, (0, x_ref[...]))
            o_ref[...] = v

        def ref(v):
            i = 0
            v = np.asarray(v)
            while i < 20 and np.max(np.abs(v)) < 100.0:
                v = v * np.float32(1.5) + np.float32(1.0)
                i += 1
            return v

        out = self.pallas_call(kernel, _sds((8,)))(x)
        assert_allclose(out, ref(x))

    def test_cond(self):
        x = self.rand((4, 8))
        spec = pl.BlockSpec((1, 8), lambda i: (i, 0))

        def kernel(x_ref, o_ref):
            o_ref[...] = lax.cond(
                pl.program_id(0) % 2 == 0,
                lambda v: jnp.exp(v),
                lambda v: -v,
                x_ref[...],
            )

        out = self.pallas_call(kernel, _sds((4, 8)), grid=(4,), in_specs=[spec], out_specs=spec)(x)
        expected = jnp.where((jnp.arange(4) % 2 == 0)[:, None], jnp.exp(x), -x)
        assert_allclose(out, expected)

    def test_cond_with_ref_effects(self):
        x = self.rand((8,))

        def kernel(x_ref, o_ref):
            def true_fn():
                o_ref[...] = x_ref[...] + 1.0

            def false_fn():
                o_ref[...] = x_ref[...] - 1.0

            lax.cond(x_ref[0] > 0, true_fn, false_fn)

        out = self.pallas_call(kernel, _sds((8,)))(x)
        assert_allclose(out, jnp.where(x[0] > 0, x + 1.0, x - 1.0))

    def test_switch(self):
        x = self.rand((6, 8))
        spec = pl.BlockSpec((1, 8), lambda i: (i, 0))
        branches = [lambda v: v * 2.0, lambda v: v + 10.0, lambda v: jnp.sin(v)]

        def kernel(x_ref, o_ref):
            o_ref[...] = lax.switch(pl.program_id(0) % 3, branches, x_ref[...])

        out = self.pallas_call(kernel, _sds((6, 8)), grid=(6,), in_specs=[spec], out_specs=spec)(x)
        expected = jnp.stack([branches[i % 3](x[i]) for i in range(6)])
        assert_allclose(out, expected)

    def test_when(self):
        x = self.rand((4, 8))
        spec = pl.BlockSpec((1, 8), lambda i: (i, 0))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

            @pl.when(pl.program_id(0) >= 2)
            def _():
                o_ref[...] = o_ref[...] * 3.0

            @pl.when(x_ref[0, 0] > 0)
            def _():
                o_ref[0, 1] = 0.5

        out = self.pallas_call(kernel, _sds((4, 8)), grid=(4,), in_specs=[spec], out_specs=spec)(x)
        expected = np.array(x) * np.array([1, 1, 3, 3], np.float32)[:, None]
        expected[:, 1] = np.where(np.asarray(x[:, 0]) > 0, 0.5, expected[:, 1])
        assert_allclose(out, expected)

    def test_pl_loop(self):
        x = self.rand((8, 4))

        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.zeros_like(o_ref)

            @pl.loop(0, 8, step=2)
            def _(i):
                o_ref[...] += x_ref[pl.ds(i, 1), :]

        out = self.pallas_call(kernel, _sds((1, 4)))(x)
        assert_allclose(out, x[0::2].sum(0, keepdims=True))

    def test_pl_loop_with_carry(self):
        x = self.rand((6,))

        def kernel(x_ref, o_ref):
            @pl.loop(0, 6, init_carry=jnp.float32(0.0))
            def total(i, acc):
                return acc + x_ref[i]

            o_ref[...] = jnp.full((1,), total, jnp.float32)

        out = self.pallas_call(kernel, _sds((1,)))(x)
        assert_allclose(out, jnp.sum(x)[None])

    def test_nested_loops(self):
        a, b = self.rand((8, 16)), self.rand((16, 8))

        def kernel(a_ref, b_ref, o_ref):
            # Blocked matmul written with explicit nested loops over 4x4 tiles.
            @pl.loop(0, 2)
            def _(i):
                @pl.loop(0, 2)
                def _(j):
                    def body(k, acc):
                        at = a_ref[pl.ds(i * 4, 4), pl.ds(k * 4, 4)]
                        bt = b_ref[pl.ds(k * 4, 4), pl.ds(j * 4, 4)]
                        return acc + jnp.dot(at, bt)

                    o_ref[pl.ds(i * 4, 4), pl.ds(j * 4, 4)] = lax.fori_loop(
                        0, 4, body, jnp.zeros((4, 4), jnp.float32)
                    )

        out = self.pallas_call(kernel, _sds((8, 8)))(a, b)
        assert_allclose(out, a @ b, scale=100)


class TestScopedAndHints(PallasTest):
    def test_run_scoped(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref):
            def body(tmp_ref):
                tmp_ref[...] = x_ref[...] * 2.0
                tmp_ref[...] += 1.0
                o_ref[...] = tmp_ref[...].T

            pl.run_scoped(body, pl.ANY((8, 8), jnp.float32))

        out = self.pallas_call(kernel, _sds((8, 8)))(x)
        assert_allclose(out, (x * 2.0 + 1.0).T)

    def test_run_scoped_returns_value_and_multiple_scratch(self):
        x = self.rand((4, 8))

        def kernel(x_ref, o_ref):
            def body(a_ref, b_ref):
                a_ref[...] = x_ref[...]
                b_ref[...] = jnp.sum(x_ref[...], axis=1)
                return jnp.max(a_ref[...]) + b_ref[0]

            r = pl.run_scoped(body, pl.ANY((4, 8), jnp.float32), pl.ANY((4,), jnp.float32))
            o_ref[...] = x_ref[...] - r

        out = self.pallas_call(kernel, _sds((4, 8)))(x)
        assert_allclose(out, x - (jnp.max(x) + jnp.sum(x[0])))

    def test_run_scoped_keyword_scratch(self):
        x = self.rand((8,))

        def kernel(x_ref, o_ref):
            def body(*, scratch):
                scratch[...] = jnp.flip(x_ref[...])
                o_ref[...] = scratch[...] * 3.0

            pl.run_scoped(body, scratch=pl.ANY((8,), jnp.float32))

        out = self.pallas_call(kernel, _sds((8,)))(x)
        assert_allclose(out, jnp.flip(x) * 3.0)

    def test_multiple_of(self):
        x = self.rand((32,))

        def kernel(x_ref, o_ref):
            i = pl.program_id(0)
            start = pl.multiple_of(i * 8, 8)
            o_ref[...] = x_ref[pl.ds(start, 8)] * 2.0

        out = self.pallas_call(
            kernel,
            _sds((32,)),
            grid=(4,),
            in_specs=[pl.no_block_spec],
            out_specs=pl.BlockSpec((8,), lambda i: (i,)),
        )(x)
        assert_allclose(out, x * 2.0)

    def test_debug_print(self, capfd):
        x = self.rand((4, 8))
        spec = pl.BlockSpec((2, 8), lambda i: (i, 0))

        def kernel(x_ref, o_ref):
            pl.debug_print("pallas step {} of {}", pl.program_id(0), pl.num_programs(0))
            o_ref[...] = x_ref[...] + 1.0

        out = self.pallas_call(kernel, _sds((4, 8)), grid=(2,), in_specs=[spec], out_specs=spec)(x)
        jax.block_until_ready(out)
        jax.effects_barrier()
        captured = capfd.readouterr()
        text = captured.out + captured.err
        assert "pallas step 0 of 2" in text
        assert "pallas step 1 of 2" in text
        assert_allclose(out, x + 1.0)


class TestHelpers:
    @pytest.mark.parametrize("a,b", [(1, 1), (7, 2), (8, 2), (1000, 128), (129, 128), (0, 5)])
    def test_cdiv(self, a, b):
        assert pl.cdiv(a, b) == -(-a // b)

    def test_cdiv_traced(self):
        a = jnp.arange(1, 40, dtype=jnp.int32)
        np.testing.assert_array_equal(jax.jit(lambda a: pl.cdiv(a, 8))(a), (np.asarray(a) + 7) // 8)

    @pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 1000, 1024])
    def test_next_power_of_2(self, n):
        p = pl.next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and p // 2 < n

    def test_empty_and_empty_like(self):
        e = pl.empty((3, 5), jnp.bfloat16)
        assert e.shape == (3, 5) and e.dtype == jnp.bfloat16
        tree = {"a": jax.ShapeDtypeStruct((2, 4), jnp.float32), "b": jnp.ones((7,), jnp.int32)}
        out = pl.empty_like(tree)
        assert set(out) == {"a", "b"}
        assert out["a"].shape == (2, 4) and out["a"].dtype == jnp.float32
        assert out["b"].shape == (7,) and out["b"].dtype == jnp.int32

    def test_empty_as_overwritten_buffer(self):
        # pl.empty gives unspecified values: only a buffer that is fully overwritten is observed.
        x = jax.random.normal(jax.random.key(3), (8, 8))

        def kernel(x_ref, buf_ref, o_ref):
            del buf_ref  # aliased to o_ref; never read
            o_ref[...] = x_ref[...] * 2.0

        out = jax.jit(
            lambda x: pl.pallas_call(
                kernel,
                jax.ShapeDtypeStruct((8, 8), jnp.float32),
                input_output_aliases={1: 0},
                interpret=PallasTest.INTERPRET,
            )(x, pl.empty((8, 8), jnp.float32))
        )(x)
        assert_allclose(out, x * 2.0)

    def test_cost_estimate_fields(self):
        ce = pl.CostEstimate(flops=10, transcendentals=2, bytes_accessed=64)
        assert (ce.flops, ce.transcendentals, ce.bytes_accessed) == (10, 2, 64)


def _checked_kernel(x_ref, o_ref):
    pl.delay(100)  # a wait: nothing to compute in interpret mode
    pl.debug_check(x_ref[0, 0] > 0, "the first element must be positive {as braces}")
    o_ref[...] = x_ref[...] * 2


@pytest.mark.parametrize("grid", [None, (4,)], ids=["one_block", "grid"])
def test_delay_and_debug_check_in_interpret_mode(grid):
    """pl.delay is a no-op and pl.debug_check checks its condition in interpret=True (JAX's
    interpret mode drops the check; ours raised NotImplementedError for both on the CPU)."""
    x = jax.random.uniform(jax.random.key(0), (32, 128), minval=0.5, maxval=2.0)
    kw = {}
    if grid:
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        kw = dict(grid=grid, in_specs=[spec], out_specs=spec)
    call = pl.pallas_call(_checked_kernel, out_shape=_sds(x.shape), interpret=True, **kw)
    jitted = jax.jit(call)
    bad = x.at[16 if grid else 0, 0].set(-1.0)  # one grid step's block fails
    np.testing.assert_array_equal(call(x), np.asarray(x) * 2)  # checks off: not checked
    np.testing.assert_array_equal(jitted(bad), np.asarray(bad) * 2)
    with pl.enable_debug_checks():
        np.testing.assert_array_equal(call(x), np.asarray(x) * 2)
        np.testing.assert_array_equal(jitted(x), np.asarray(x) * 2)
        # Traced before with the checks off: traced again (the switch is in the jit key).
        with pytest.raises(Exception, match="pl.debug_check failed: the first element"):
            jitted(bad)
        with pytest.raises(
            AssertionError,
            match=r"in kernel '_checked_kernel' at test_kernel_language.py:\d+: pl.debug_check failed: "
            r"the first element must be positive \{as braces\}",
        ):
            call(bad)
    np.testing.assert_array_equal(call(bad), np.asarray(bad) * 2)  # off again
    np.testing.assert_array_equal(jitted(bad), np.asarray(bad) * 2)
