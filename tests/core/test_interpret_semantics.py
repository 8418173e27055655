"""Interpret-mode semantics: NaN-poisoned outputs and padding, sequential grid order; each
kernel run every way (tests/ways). A TPU way runs the kernels whose blocks a TPU takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_test_base import FLOAT_DTYPES, PallasTest, assert_allclose, dtype_id
from ways import every_way, skip_way

import pallas as pl


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@every_way()
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
class TestPoison(PallasTest):
    def test_unwritten_output_blocks_are_nan(self, dtype):
        x = self.rand((16, 8), dtype)
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def kernel(x_ref, o_ref):
            @pl.when(pl.program_id(0) % 2 == 0)
            def _():
                o_ref[...] = x_ref[...] * 2

        out = self.pallas_call(kernel, _sds((16, 8), dtype), grid=(4,), in_specs=[spec], out_specs=spec)(x)
        out = np.asarray(out.astype(jnp.float32)).reshape(4, 4, 8)
        xs = np.asarray((x * 2).astype(jnp.float32)).reshape(4, 4, 8)
        np.testing.assert_array_equal(out[0::2], xs[0::2])
        assert np.isnan(out[1::2]).all()

    def test_partially_written_block_is_nan_elsewhere(self, dtype):
        x = self.rand((8,), dtype)

        def kernel(x_ref, o_ref):
            o_ref[0:3] = x_ref[0:3]

        out = np.asarray(self.pallas_call(kernel, _sds((8,), dtype))(x).astype(jnp.float32))
        np.testing.assert_array_equal(out[:3], np.asarray(x[:3].astype(jnp.float32)))
        assert np.isnan(out[3:]).all()

    @skip_way(
        "triton",
        "a GPU's edge-block padding is unspecified (a masked load; Triton gives 0): NaN is interpret mode's",
    )
    def test_edge_block_padding_is_nan_only_beyond_array(self, dtype):
        n, b = 10, 4
        x = self.rand((n,), dtype)

        def kernel(x_ref, o_ref, nans_ref):
            o_ref[...] = x_ref[...]
            nans_ref[...] = jnp.sum(jnp.isnan(x_ref[...]).astype(jnp.int32), keepdims=True)

        out, nans = self.pallas_call(
            kernel,
            (_sds((n,), dtype), _sds((3,), jnp.int32)),
            grid=(3,),
            in_specs=[pl.BlockSpec((b,), lambda i: (i,))],
            out_specs=(pl.BlockSpec((b,), lambda i: (i,)), pl.BlockSpec((1,), lambda i: (i,))),
        )(x)
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)))
        np.testing.assert_array_equal(nans, [0, 0, 2])

    @skip_way(
        "triton",
        "a GPU's edge-block padding is unspecified (a masked load; Triton gives 0): NaN is interpret mode's",
    )
    def test_edge_block_2d_within_bounds_exact(self, dtype):
        x = self.rand((10, 6), dtype)
        spec = pl.BlockSpec((4, 4), lambda i, j: (i, j))

        def kernel(x_ref, o_ref, nans_ref):
            v = x_ref[...]
            # NaN padding must not leak into in-bounds results of row-wise ops.
            o_ref[...] = v * 3 + 1
            nans_ref[...] = jnp.sum(jnp.isnan(v).astype(jnp.int32), keepdims=True)

        out, nans = self.pallas_call(
            kernel,
            (_sds((10, 6), dtype), _sds((3, 2), jnp.int32)),
            grid=(3, 2),
            in_specs=[spec],
            out_specs=(spec, pl.BlockSpec((1, 1), lambda i, j: (i, j))),
        )(x)
        assert_allclose(out, x * 3 + 1)
        # Block (i, j) holds rows [4i, 4i+4) and columns [4j, 4j+4) of a 10x6 array.
        rows = np.array([4, 4, 2])[:, None]
        cols = np.array([4, 2])[None, :]
        np.testing.assert_array_equal(nans, 16 - rows * cols)

    @skip_way(
        "triton",
        "a GPU's edge-block padding is unspecified (a masked load; Triton gives 0): NaN is interpret mode's",
    )
    def test_element_padding_is_nan(self, dtype):
        x = self.rand((8,), dtype)

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        out = self.pallas_call(
            kernel,
            _sds((20,), dtype),
            grid=(2,),
            in_specs=[pl.BlockSpec((pl.Element(10, (1, 1)),), lambda i: (i * 0,))],
            out_specs=pl.BlockSpec((10,), lambda i: (i,)),
        )(x)
        out = np.asarray(out.astype(jnp.float32))
        # The window starts one element before the array: element 0 and element 9 are padding.
        for half in (out[:10], out[10:]):
            assert np.isnan(half[0]) and np.isnan(half[9])
            np.testing.assert_array_equal(half[1:9], np.asarray(x.astype(jnp.float32)))


@every_way()
class TestSequentialOrder(PallasTest):
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32], ids=dtype_id)
    def test_blocked_matmul_k_accumulation(self, dtype):
        m, n, k = 128, 128, 192  # a (2, 2, 3) grid: each output block revisited along k
        bm = bn = bk = 64
        a, b = self.rand((m, k), dtype), self.rand((k, n), dtype)

        def matmul(a_ref, b_ref, o_ref):
            @pl.when(pl.program_id(2) == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=o_ref.dtype)

        out_dtype = jnp.int32 if dtype == jnp.int32 else jnp.float32
        out = self.pallas_call(
            matmul,
            _sds((m, n), out_dtype),
            grid=(m // bm, n // bn, k // bk),
            in_specs=[
                pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        )(a, b)
        expected = jnp.dot(a, b, preferred_element_type=out_dtype)
        if dtype == jnp.int32:
            np.testing.assert_array_equal(out, expected)
        else:
            assert_allclose(out, expected, jnp.float32, scale=100)

    def test_matmul_with_non_dividing_shapes_and_masked_k(self):
        m, n, k, blk = 40, 24, 36, 16
        a, b = self.rand((m, k)), self.rand((k, n))

        def matmul(a_ref, b_ref, o_ref):
            kk = pl.program_id(2)

            @pl.when(kk == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            # The last k block reaches past the array: mask its NaN padding out of the sum.
            kidx = kk * blk + jnp.arange(blk)
            av = jnp.where((kidx < k)[None, :], a_ref[...], 0.0)
            bv = jnp.where((kidx < k)[:, None], b_ref[...], 0.0)
            o_ref[...] += jnp.dot(av, bv)

        out = self.pallas_call(
            matmul,
            _sds((m, n)),
            grid=(pl.cdiv(m, blk), pl.cdiv(n, blk), pl.cdiv(k, blk)),
            in_specs=[
                pl.BlockSpec((blk, blk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((blk, blk), lambda i, j, kk: (kk, j)),
            ],
            out_specs=pl.BlockSpec((blk, blk), lambda i, j, kk: (i, j)),
        )(a, b)
        assert_allclose(out, a @ b, scale=100)

    def test_reduction_axis_first(self):
        # The revisited (reduction) axis is the outer one: every output block is revisited
        # non-consecutively; sequential semantics still sum every contribution.
        x = self.rand((4, 12, 8))

        def kernel(x_ref, o_ref):
            @pl.when(pl.program_id(0) == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            o_ref[...] += x_ref[...]

        out = self.pallas_call(
            kernel,
            _sds((12, 8)),
            grid=(4, 3),
            in_specs=[pl.BlockSpec((None, 4, 8), lambda r, i: (r, i, 0))],
            out_specs=pl.BlockSpec((4, 8), lambda r, i: (i, 0)),
        )(x)
        assert_allclose(out, jnp.sum(x, axis=0), scale=10)

    def test_grid_order_is_row_major(self):
        # A single output block revisited by every step records the last step that wrote it,
        # and a running counter in it records how many steps ran before.
        def kernel(o_ref, last_ref):
            i, j = pl.program_id(0), pl.program_id(1)

            @pl.when((i == 0) & (j == 0))
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            step = o_ref[0]
            o_ref[pl.ds(step + 1, 1)] = jnp.full((1,), i * 10 + j, jnp.int32)
            o_ref[0] = step + 1
            last_ref[...] = jnp.full((1,), i * 10 + j, jnp.int32)

        order, last = self.pallas_call(
            kernel,
            (_sds((7,), jnp.int32), _sds((1,), jnp.int32)),
            grid=(2, 3),
            out_specs=(
                pl.BlockSpec((7,), lambda i, j: (0,)),
                pl.BlockSpec((1,), lambda i, j: (0,)),
            ),
        )()
        np.testing.assert_array_equal(order, [6, 0, 1, 2, 10, 11, 12])
        np.testing.assert_array_equal(last, [12])

    def test_any_space_output_accumulates_sequentially(self):
        x = self.rand((6, 8))

        def kernel(x_ref, o_ref):
            i = pl.program_id(0)

            @pl.when(i == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            # Every step adds its row into row 0 and writes a running total into row i + 1.
            o_ref[0:1, :] += x_ref[...]
            o_ref[pl.ds(i + 1, 1), :] = o_ref[0:1, :]

        out = self.pallas_call(
            kernel,
            _sds((7, 8)),
            grid=(6,),
            in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
        )(x)
        cums = jnp.cumsum(x, axis=0)
        assert_allclose(out[1:], cums, scale=10)
        assert_allclose(out[0], cums[-1], scale=10)

    @skip_way("triton", "a GPU's scratch lives in one program (grid step): no state carries across steps")
    def test_scratch_carries_state_across_steps(self):
        # An online max over blocks kept in scratch, written out at every step.
        x = self.rand((32,))

        def kernel(x_ref, o_ref, m_ref):
            @pl.when(pl.program_id(0) == 0)
            def _():
                m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)

            m_ref[...] = jnp.maximum(m_ref[...], jnp.max(x_ref[...], keepdims=True))
            o_ref[...] = jnp.broadcast_to(m_ref[...], o_ref.shape)

        out = self.pallas_call(
            kernel,
            _sds((32,)),
            grid_spec=pl.GridSpec(
                grid=(4,),
                in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                scratch_shapes=[pl.ANY((1,), jnp.float32)],
            ),
        )(x)
        expected = jnp.repeat(jax.lax.cummax(jnp.max(x.reshape(4, 8), axis=1)), 8)
        assert_allclose(out, expected)

    def test_input_block_revisit_reads_aliased_updates(self):
        # Aliased input and output: step i reads the output written by step i-1.
        x = self.rand((5, 4))

        def kernel(x_ref, o_ref):
            i = pl.program_id(0)

            @pl.when(i > 0)
            def _():
                o_ref[pl.ds(i, 1), :] = o_ref[pl.ds(i - 1, 1), :] + x_ref[pl.ds(i, 1), :]

        out = self.pallas_call(
            kernel,
            _sds((5, 4)),
            grid=(5,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            input_output_aliases={0: 0},
        )(x)
        assert_allclose(out, jnp.cumsum(x, axis=0), scale=10)

    def test_blocked_aliased_input_sees_earlier_output_writes(self):
        # Upstream interpret semantics: an aliased input and its output are one buffer, so a
        # block read through the input's index map sees what earlier grid steps wrote.
        x = self.rand((6,))

        def running_sum_kernel(a_ref, x_ref, o_ref):
            o_ref[...] = a_ref[...] + x_ref[...]

        init = self.rand((6,))
        out = self.pallas_call(
            running_sum_kernel,
            _sds((6,)),
            grid=(6,),
            in_specs=[
                pl.BlockSpec((1,), lambda i: (jnp.maximum(i - 1, 0),)),
                pl.BlockSpec((1,), lambda i: (i,)),
            ],
            out_specs=pl.BlockSpec((1,), lambda i: (i,)),
            input_output_aliases={0: 0},
        )(init, x)
        expected = init[0] + jnp.cumsum(x)
        assert_allclose(out, expected, scale=10)
