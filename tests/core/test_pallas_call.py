"""pallas_call: pytrees, out_shape forms, BlockSpec/GridSpec, block dims, grids, memory spaces."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_test_base import ALL_DTYPES, PallasTest, assert_allclose, dtype_id
from ways import every_way, skip_way

import pallas as pl


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@every_way()
class TestOutShapeAndPytrees(PallasTest):
    def test_single_struct(self):
        x = self.rand((8, 16))

        def add_one(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        out = self.pallas_call(add_one, _sds(x.shape))(x)
        assert isinstance(out, jax.Array)
        assert_allclose(out, x + 1.0)

    def test_tuple_out_shape(self):
        x, y = self.rand((8, 16)), self.rand((8, 16))

        def sum_and_diff(x_ref, y_ref, s_ref, d_ref):
            s_ref[...] = x_ref[...] + y_ref[...]
            d_ref[...] = x_ref[...] - y_ref[...]

        out = self.pallas_call(sum_and_diff, (_sds(x.shape), _sds(x.shape)))(x, y)
        assert isinstance(out, tuple) and len(out) == 2
        assert_allclose(out[0], x + y)
        assert_allclose(out[1], x - y)

    def test_list_out_shape(self):
        x = self.rand((4, 8))

        def kernel(x_ref, a_ref, b_ref, c_ref):
            a_ref[...] = x_ref[...] * 2.0
            b_ref[...] = jnp.sum(x_ref[...], axis=1)
            c_ref[...] = x_ref[...].astype(jnp.int32)

        out = self.pallas_call(kernel, [_sds((4, 8)), _sds((4,)), _sds((4, 8), jnp.int32)])(x)
        # Upstream returns a tuple for a list out_shape; either sequence is accepted.
        assert isinstance(out, (list, tuple)) and len(out) == 3
        assert_allclose(out[0], x * 2.0)
        assert_allclose(out[1], jnp.sum(x, axis=1))
        assert out[2].dtype == jnp.int32
        np.testing.assert_array_equal(out[2], x.astype(jnp.int32))

    def test_dict_out_shape(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_refs):
            o_refs["exp"][...] = jnp.exp(x_ref[...])
            o_refs["neg"][...] = -x_ref[...]

        out = self.pallas_call(kernel, {"exp": _sds((8, 8)), "neg": _sds((8, 8))})(x)
        assert set(out) == {"exp", "neg"}
        assert_allclose(out["exp"], jnp.exp(x))
        assert_allclose(out["neg"], -x)

    def test_pytree_inputs_and_outputs(self):
        a, b, c = self.rand((8, 4)), self.rand((8, 4)), self.rand((4,))

        # A tuple out_shape is splatted into separate output arguments; each keeps its tree.
        def kernel(inputs, out_ref, out_tree):
            pair, vec = inputs["pair"], inputs["vec"]
            out_ref[...] = pair[0][...] * pair[1][...] + vec[...][None, :]
            out_tree["m"][...] = jnp.max(pair[0][...], axis=0)

        def call(tree):
            return self.pallas_call(kernel, (_sds((8, 4)), {"m": _sds((4,))}))(tree)

        out = call({"pair": (a, b), "vec": c})
        assert_allclose(out[0], a * b + c[None, :])
        assert_allclose(out[1]["m"], jnp.max(a, axis=0))

    def test_pytree_inputs_with_pytree_in_specs(self):
        a, b = self.rand((16, 8)), self.rand((16, 8))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def kernel(tree_ref, o_ref):
            o_ref[...] = tree_ref["a"][...] * 3.0 - tree_ref["b"][...]

        out = self.pallas_call(
            kernel,
            _sds((16, 8)),
            grid=(4,),
            in_specs=[{"a": spec, "b": spec}],
            out_specs=spec,
        )({"a": a, "b": b})
        assert_allclose(out, a * 3.0 - b)

    def test_out_shape_from_array(self):
        # out_shape may be any object with .shape and .dtype, such as an array.
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.tanh(x_ref[...])

        out = self.pallas_call(kernel, x)(x)
        assert_allclose(out, jnp.tanh(x))

    def test_name_and_cost_estimate_do_not_change_results(self):
        x = self.rand((16, 16))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * x_ref[...]

        out = self.pallas_call(
            kernel,
            _sds(x.shape),
            name="square_kernel",
            cost_estimate=pl.CostEstimate(flops=256, transcendentals=0, bytes_accessed=2048),
            debug=False,
        )(x)
        assert_allclose(out, x * x)

    def test_scalar_output(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.sum(x_ref[...])

        out = self.pallas_call(kernel, _sds(()))(x)
        assert out.shape == ()
        assert_allclose(out, jnp.sum(x), scale=10)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape,block",
    [((16, 32), (8, 16)), ((13, 20), (8, 8)), ((7, 5), (4, 4)), ((64,), (16,))],
    ids=["divides", "edge", "small_edge", "1d"],
)
@every_way()
class TestBlockedElementwise(PallasTest):
    def test_add_mul(self, dtype, shape, block):
        x, y = self.rand(shape, dtype), self.rand(shape, dtype)
        grid = tuple(pl.cdiv(s, b) for s, b in zip(shape, block))
        spec = pl.BlockSpec(block, lambda *idx: idx)

        def kernel(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...] * y_ref[...] + x_ref[...]

        out = self.pallas_call(kernel, _sds(shape, dtype), grid=grid, in_specs=[spec, spec], out_specs=spec)(
            x, y
        )
        assert out.dtype == dtype
        assert_allclose(out, x * y + x)

    def test_grid_spec_object(self, dtype, shape, block):
        x = self.rand(shape, dtype)
        grid = tuple(pl.cdiv(s, b) for s, b in zip(shape, block))
        spec = pl.BlockSpec(block, lambda *idx: idx)

        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.maximum(x_ref[...], x_ref[...] * 2)

        grid_spec = pl.GridSpec(grid=grid, in_specs=[spec], out_specs=spec)
        out = self.pallas_call(kernel, _sds(shape, dtype), grid_spec=grid_spec)(x)
        assert_allclose(out, jnp.maximum(x, x * 2))


@every_way()
class TestBlockSpecs(PallasTest):
    def test_no_block_spec_whole_array(self):
        x, y = self.rand((8, 16)), self.rand((16,))

        def kernel(x_ref, y_ref, o_ref):
            i = pl.program_id(0)
            o_ref[...] = x_ref[pl.ds(i * 2, 2), :] + y_ref[...]

        out = self.pallas_call(
            kernel,
            _sds((8, 16)),
            grid=(4,),
            in_specs=[pl.no_block_spec, pl.no_block_spec],
            out_specs=pl.BlockSpec((2, 16), lambda i: (i, 0)),
        )(x, y)
        assert_allclose(out, x + y)

    def test_blockspec_without_block_shape_is_whole_array(self):
        x = self.rand((8, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...].T

        out = self.pallas_call(kernel, _sds((8, 8)), in_specs=[pl.BlockSpec()], out_specs=pl.BlockSpec())(x)
        assert_allclose(out, x.T)

    def test_default_specs_with_grid_see_whole_array(self):
        x = self.rand((6, 5))

        def kernel(x_ref, o_ref):
            # Every grid step writes the whole output; the last one wins.
            o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)

        out = self.pallas_call(kernel, _sds((6, 5)), grid=(3,))(x)
        assert_allclose(out, x + 2.0)

    @pytest.mark.parametrize("squeeze", [None, pl.squeezed], ids=["None", "squeezed"])
    def test_squeezed_leading_dim(self, squeeze):
        x = self.rand((4, 8, 16))

        def kernel(x_ref, o_ref):
            assert x_ref.shape == (8, 16), x_ref.shape
            assert o_ref.shape == (16,), o_ref.shape
            o_ref[...] = jnp.sum(x_ref[...], axis=0)

        out = self.pallas_call(
            kernel,
            _sds((4, 16)),
            grid=(4,),
            in_specs=[pl.BlockSpec((squeeze, 8, 16), lambda b: (b, 0, 0))],
            out_specs=pl.BlockSpec((squeeze, 16), lambda b: (b, 0)),
        )(x)
        assert_allclose(out, jnp.sum(x, axis=1))

    def test_squeezed_middle_dim(self):
        x = self.rand((8, 3, 16))

        def kernel(x_ref, o_ref):
            assert x_ref.shape == (4, 16)
            o_ref[...] = x_ref[...] * 2.0

        out = self.pallas_call(
            kernel,
            _sds((8, 3, 16)),
            grid=(2, 3),
            in_specs=[pl.BlockSpec((4, pl.squeezed, 16), lambda i, j: (i, j, 0))],
            out_specs=pl.BlockSpec((4, None, 16), lambda i, j: (i, j, 0)),
        )(x)
        assert_allclose(out, x * 2.0)

    def test_blocked_dims(self):
        x = self.rand((16, 24))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] - 1.0

        spec = pl.BlockSpec((pl.Blocked(8), pl.Blocked(12)), lambda i, j: (i, j))
        out = self.pallas_call(kernel, _sds((16, 24)), grid=(2, 2), in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, x - 1.0)

    def test_mixed_blocked_and_int_dims(self):
        x = self.rand((12, 10))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * x_ref[...]

        spec = pl.BlockSpec((pl.Blocked(4), 5), lambda i, j: (i, j))
        out = self.pallas_call(kernel, _sds((12, 10)), grid=(3, 2), in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, x * x)

    def test_element_dim_offsets(self):
        # With pl.Element the index_map returns element offsets, not block indices:
        # overlapping windows x[2i : 2i+4].
        x = self.rand((10,))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[0:2] + x_ref[2:4]

        out = self.pallas_call(
            kernel,
            _sds((8,)),
            grid=(4,),
            in_specs=[pl.BlockSpec((pl.Element(4),), lambda i: (2 * i,))],
            out_specs=pl.BlockSpec((2,), lambda i: (i,)),
        )(x)
        assert_allclose(out, x[0:8] + x[2:10])

    def test_element_with_padding_stencil(self):
        # A 3-point stencil: window [iB-1, iB+B+1) over x padded by one element each side.
        n, b = 32, 8
        x = self.rand((n,))

        def stencil(x_ref, o_ref):
            o_ref[...] = x_ref[0:b] + 2.0 * x_ref[1 : b + 1] + x_ref[2 : b + 2]

        out = self.pallas_call(
            stencil,
            _sds((n,)),
            grid=(n // b,),
            in_specs=[pl.BlockSpec((pl.Element(b + 2, (1, 1)),), lambda i: (i * b,))],
            out_specs=pl.BlockSpec((b,), lambda i: (i,)),
        )(x)
        expected = x[:-2] + 2.0 * x[1:-1] + x[2:]
        # The first and last outputs read the padding; everything else is exact.
        assert_allclose(out[1:-1], expected)

    def test_element_second_dim_with_blocked_first(self):
        x = self.rand((8, 12))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[:, 1:5] - x_ref[:, 0:4]

        out = self.pallas_call(
            kernel,
            _sds((8, 8)),
            grid=(2, 2),
            in_specs=[pl.BlockSpec((4, pl.Element(6)), lambda i, j: (i, 4 * j))],
            out_specs=pl.BlockSpec((4, 4), lambda i, j: (i, j)),
        )(x)
        assert_allclose(out, x[:, 1:9] - x[:, 0:8])

    def test_index_map_reverses_blocks(self):
        x = self.rand((32, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...][::-1]

        out = self.pallas_call(
            kernel,
            _sds((32, 8)),
            grid=(4,),
            in_specs=[pl.BlockSpec((8, 8), lambda i: (3 - i, 0))],
            out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)),
        )(x)
        assert_allclose(out, x[::-1])

    def test_index_map_transposes_blocks(self):
        x = self.rand((16, 16))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...].T

        out = self.pallas_call(
            kernel,
            _sds((16, 16)),
            grid=(2, 2),
            in_specs=[pl.BlockSpec((8, 8), lambda i, j: (j, i))],
            out_specs=pl.BlockSpec((8, 8), lambda i, j: (i, j)),
        )(x)
        assert_allclose(out, x.T)

    @pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
    def test_edge_blocks_non_dividing(self, dtype):
        # 19x13 with 8x8 blocks: the last row/column blocks are partial.
        x = self.rand((19, 13), dtype)
        spec = pl.BlockSpec((8, 8), lambda i, j: (i, j))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + x_ref[...]

        out = self.pallas_call(kernel, _sds((19, 13), dtype), grid=(3, 2), in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, x + x)


@every_way()
class TestGridRanks(PallasTest):
    def test_grid_rank0(self):
        x = self.rand((4, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.cos(x_ref[...])

        out = self.pallas_call(kernel, _sds((4, 8)), grid=())(x)
        assert_allclose(out, jnp.cos(x))

    def test_grid_int_is_rank1(self):
        x = self.rand((24,))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 4.0

        spec = pl.BlockSpec((8,), lambda i: (i,))
        out = self.pallas_call(kernel, _sds((24,)), grid=3, in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, x * 4.0)

    @pytest.mark.parametrize("rank", [1, 2, 3, 4])
    def test_grid_rank_n(self, rank):
        grid = (3, 2, 2, 2)[:rank]
        block = (4, 2, 3, 2)[:rank]
        shape = tuple(g * b for g, b in zip(grid, block))
        x = self.rand(shape)
        spec = pl.BlockSpec(block, lambda *idx: idx)

        def kernel(x_ref, o_ref):
            # Tag each block with its linearized program id to check the grid iteration.
            pid = 0
            for axis in range(rank):
                pid = pid * pl.num_programs(axis) + pl.program_id(axis)
            o_ref[...] = x_ref[...] + pid.astype(jnp.float32) * 100.0

        out = self.pallas_call(kernel, _sds(shape), grid=grid, in_specs=[spec], out_specs=spec)(x)
        pid = np.arange(int(np.prod(grid))).reshape(grid)
        expected_tag = pid
        for axis, b in enumerate(block):
            expected_tag = np.repeat(expected_tag, b, axis=axis)
        assert_allclose(out, x + expected_tag.astype(np.float32) * 100.0)

    def test_grid_rank3_batched_matmul(self):
        a, b = self.rand((3, 16, 8)), self.rand((3, 8, 16))

        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

        out = self.pallas_call(
            kernel,
            _sds((3, 16, 16)),
            grid=(3, 2, 2),
            in_specs=[
                pl.BlockSpec((None, 8, 8), lambda bt, i, j: (bt, i, 0)),
                pl.BlockSpec((None, 8, 8), lambda bt, i, j: (bt, 0, j)),
            ],
            out_specs=pl.BlockSpec((None, 8, 8), lambda bt, i, j: (bt, i, j)),
        )(a, b)
        assert_allclose(out, jnp.einsum("bik,bkj->bij", a, b), scale=10)


@every_way()
class TestMemorySpacesAndScratch(PallasTest):
    def test_any_memory_space_input_is_whole_array(self):
        x = self.rand((8, 16))

        def kernel(x_ref, o_ref):
            assert x_ref.shape == (8, 16)
            i = pl.program_id(0)
            o_ref[...] = x_ref[pl.ds(7 - 2 * i - 1, 2), :]

        out = self.pallas_call(
            kernel,
            _sds((8, 16)),
            grid=(4,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((2, 16), lambda i: (i, 0)),
        )(x)
        expected = jnp.concatenate([x[6:8], x[4:6], x[2:4], x[0:2]])
        assert_allclose(out, expected)

    def test_any_memory_space_output(self):
        x = self.rand((4, 8))

        def kernel(x_ref, o_ref):
            i = pl.program_id(0)
            o_ref[pl.ds(i, 1), :] = x_ref[...] * 2.0

        out = self.pallas_call(
            kernel,
            _sds((4, 8)),
            grid=(4,),
            in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
        )(x)
        assert_allclose(out, x * 2.0)

    def test_scratch_shapes_argument(self):
        x = self.rand((8, 16))

        def kernel(x_ref, o_ref, acc_ref):
            acc_ref[...] = x_ref[...] * 2.0
            acc_ref[...] += 1.0
            o_ref[...] = acc_ref[...]

        out = self.pallas_call(kernel, _sds((8, 16)), scratch_shapes=[pl.ANY((8, 16), jnp.float32)])(x)
        assert_allclose(out, x * 2.0 + 1.0)

    @skip_way(
        "triton", "the scratch carries a value from grid step to grid step: GPU programs run concurrently"
    )
    def test_scratch_persists_across_grid_steps(self):
        # Running prefix sum over row blocks, carried in a scratch buffer.
        x = self.rand((32, 8))

        def kernel(x_ref, o_ref, carry_ref):
            @pl.when(pl.program_id(0) == 0)
            def _():
                carry_ref[...] = jnp.zeros_like(carry_ref)

            carry_ref[...] += jnp.sum(x_ref[...], axis=0, keepdims=True)
            o_ref[...] = carry_ref[...]

        grid_spec = pl.GridSpec(
            grid=(4,),
            in_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((1, 8), lambda i: (i, 0)),
            scratch_shapes=[pl.ANY((1, 8), jnp.float32)],
        )
        out = self.pallas_call(kernel, _sds((4, 8)), grid_spec=grid_spec)(x)
        expected = jnp.cumsum(x.reshape(4, 8, 8).sum(axis=1), axis=0)
        assert_allclose(out, expected, scale=10)


@every_way()
class TestInputOutputAliases(PallasTest):
    def test_alias_in_place_update(self):
        x, y = self.rand((16, 8)), self.rand((16, 8))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def kernel(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...] + y_ref[...]

        out = self.pallas_call(
            kernel,
            _sds((16, 8)),
            grid=(4,),
            in_specs=[spec, spec],
            out_specs=spec,
            input_output_aliases={1: 0},
        )(x, y)
        assert_allclose(out, x + y)

    def test_alias_partial_write_keeps_input(self):
        # Only even blocks are written; odd blocks keep the aliased input's values.
        x = self.rand((16, 8))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def kernel(x_ref, o_ref):
            @pl.when(pl.program_id(0) % 2 == 0)
            def _():
                o_ref[...] = x_ref[...] * 10.0

        out = jax.jit(
            self.pallas_call(
                kernel,
                _sds((16, 8)),
                grid=(4,),
                in_specs=[spec],
                out_specs=spec,
                input_output_aliases={0: 0},
            )
        )(x)
        scale = jnp.repeat(jnp.array([10.0, 1.0, 10.0, 1.0]), 4)[:, None]
        assert_allclose(out, x * scale)

    def test_alias_any_space_accumulate(self):
        x = self.rand((8, 8))
        d = self.rand((8,))

        def kernel(x_ref, d_ref, o_ref):
            del x_ref
            o_ref[...] += d_ref[...][None, :]

        out = self.pallas_call(
            kernel,
            _sds((8, 8)),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec()],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            input_output_aliases={0: 0},
        )(x, d)
        assert_allclose(out, x + d[None, :])

    def test_alias_with_multiple_outputs(self):
        x, y = self.rand((8,)), self.rand((8,))

        def kernel(x_ref, y_ref, a_ref, b_ref):
            a_ref[...] = x_ref[...] * y_ref[...]
            b_ref[...] = y_ref[...] + 1.0

        a, b = self.pallas_call(kernel, (_sds((8,)), _sds((8,))), input_output_aliases={0: 1})(x, y)
        assert_allclose(a, x * y)
        assert_allclose(b, y + 1.0)


@every_way()
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_dtype_round_trip_through_grid(dtype, way):
    """A copy kernel preserves every dtype bit for bit, including edge blocks."""
    x = np.asarray(jax.random.randint(jax.random.key(7), (10, 7), -100, 100)).astype(dtype)
    spec = pl.BlockSpec((4, 4), lambda i, j: (i, j))

    @functools.partial(
        way.pallas_call, out_shape=_sds((10, 7), dtype), grid=(3, 2), in_specs=[spec], out_specs=spec
    )
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    np.testing.assert_array_equal(np.asarray(copy(x)), x)


class TestDebugAndPlatform(PallasTest):
    def test_debug_prints_jaxpr_and_grid_mapping(self, capsys):
        x = self.rand((8, 8))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def debugged_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        out = self.pallas_call(
            debugged_kernel, _sds((8, 8)), grid=(2,), in_specs=[spec], out_specs=spec, debug=True
        )(x)
        assert_allclose(out, x + 1.0)
        printed = capsys.readouterr().out
        assert "debugged_kernel" in printed
        assert "add" in printed  # the kernel jaxpr
        assert "grid" in printed.lower()  # the grid mapping

    @pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU platform path")
    def test_cpu_platform_runs_without_interpret_flag(self):
        # On the CPU platform pallas-core runs kernels in interpret mode (upstream refuses).
        x = self.rand((16, 8))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 3.0

        out = pl.pallas_call(kernel, _sds((16, 8)), grid=(4,), in_specs=[spec], out_specs=spec)(x)
        assert_allclose(out, x * 3.0)
