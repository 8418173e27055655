"""The error catalog: each misuse raises a user-facing exception that says where and what.

Contract (CONTRIBUTING.md, "Errors speak to the user"): misuse raises ``ValueError``,
``TypeError`` or ``NotImplementedError`` (``TypeError`` for wrong types, ``ValueError`` for
wrong values or shapes) at trace time, and the message names
  (a) the kernel: the ``name=`` given to ``pallas_call``, else the kernel function's name,
  (b) the culprit argument where there is one (``in_specs[1]``, ``out_specs[0]``,
      ``out_shape['y']``, ``input_output_aliases``, ``grid``, ...),
  (c) the user's source location, ``test_errors.py:<line>``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import pytest
from pallas_test_base import PallasTest

import pallas as pl

USER_ERRORS = (ValueError, TypeError, NotImplementedError)
LOCATION = re.compile(r"test_errors\.py:\d+")

X = jax.ShapeDtypeStruct((16, 8), jnp.float32)


def _message(exc: BaseException) -> str:
    return "\n".join([str(exc), *getattr(exc, "__notes__", ())])


def check_message(exc: BaseException, kernel_name: str | None, culprit: str | None = None):
    msg = _message(exc)
    if kernel_name is not None:
        assert kernel_name in msg, f"kernel name {kernel_name!r} missing from: {msg}"
    if culprit is not None:
        assert culprit in msg, f"culprit {culprit!r} missing from: {msg}"
    assert LOCATION.search(msg), f"no test_errors.py:<line> location in: {msg}"


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


class TestErrors(PallasTest):
    def setup_method(self, method):
        super().setup_method(method)
        self.x = self.rand((16, 8))
        self.y = self.rand((16, 8))

    def expect(self, make_call, *args, exc=USER_ERRORS, name=None, culprit=None):
        """Builds the call with ``make_call()`` and calls it: either step may raise."""
        with pytest.raises(exc) as info:
            jax.block_until_ready(make_call()(*args))
        check_message(info.value, name, culprit)
        return info.value

    # -- specs ------------------------------------------------------------------------------

    def test_wrong_number_of_in_specs(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        f = lambda: self.pallas_call(add_kernel, X, grid=(4,), in_specs=[spec], out_specs=spec)
        self.expect(f, self.x, self.y, exc=ValueError, name="add_kernel", culprit="in_specs")

    def test_wrong_number_of_out_specs(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def two_out_kernel(x_ref, a_ref, b_ref):
            a_ref[...] = x_ref[...]
            b_ref[...] = x_ref[...]

        f = lambda: self.pallas_call(
            two_out_kernel, (X, X), grid=(4,), in_specs=[spec], out_specs=[spec, spec, spec]
        )
        self.expect(f, self.x, exc=ValueError, name="two_out_kernel", culprit="out_specs")

    def test_index_map_arity(self):
        good = pl.BlockSpec((4, 4), lambda i, j: (i, j))
        bad = pl.BlockSpec((4, 4), lambda i: (i, 0))
        f = lambda: self.pallas_call(add_kernel, X, grid=(4, 2), in_specs=[good, bad], out_specs=good)
        self.expect(f, self.x, self.y, name="add_kernel", culprit="in_specs[1]")

    def test_index_map_result_count(self):
        good = pl.BlockSpec((4, 8), lambda i: (i, 0))
        bad = pl.BlockSpec((4, 8), lambda i: (i,))
        f = lambda: self.pallas_call(add_kernel, X, grid=(4,), in_specs=[good, bad], out_specs=good)
        self.expect(f, self.x, self.y, exc=ValueError, name="add_kernel", culprit="in_specs[1]")

    def test_index_map_returns_float(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        bad = pl.BlockSpec((4, 8), lambda i: (i * 0.5, 0))
        f = lambda: self.pallas_call(copy_kernel, X, grid=(4,), in_specs=[spec], out_specs=bad)
        self.expect(f, self.x, name="copy_kernel", culprit="out_specs[0]")

    def test_block_rank_mismatch(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        bad = pl.BlockSpec((4,), lambda i: (i,))
        f = lambda: self.pallas_call(add_kernel, X, grid=(4,), in_specs=[spec, bad], out_specs=spec)
        self.expect(f, self.x, self.y, exc=ValueError, name="add_kernel", culprit="in_specs[1]")

    def test_block_shape_zero_entry(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        bad = pl.BlockSpec((0, 8), lambda i: (i, 0))
        f = lambda: self.pallas_call(copy_kernel, X, grid=(4,), in_specs=[bad], out_specs=spec)
        self.expect(f, self.x, exc=ValueError, name="copy_kernel", culprit="in_specs[0]")

    def test_block_shape_negative_entry(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        bad = pl.BlockSpec((4, -8), lambda i: (i, 0))
        f = lambda: self.pallas_call(copy_kernel, X, grid=(4,), in_specs=[spec], out_specs=bad)
        self.expect(f, self.x, exc=ValueError, name="copy_kernel", culprit="out_specs[0]")

    def test_blocked_zero_size(self):
        bad = pl.BlockSpec((pl.Blocked(0), 8), lambda i: (i, 0))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        f = lambda: self.pallas_call(copy_kernel, X, grid=(4,), in_specs=[bad], out_specs=spec)
        self.expect(f, self.x, exc=ValueError, name="copy_kernel", culprit="in_specs[0]")

    def test_element_negative_padding(self):
        bad = pl.BlockSpec((pl.Element(4, (-1, 0)), 8), lambda i: (4 * i, 0))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        f = lambda: self.pallas_call(copy_kernel, X, grid=(4,), in_specs=[bad], out_specs=spec)
        self.expect(f, self.x, exc=ValueError, name="copy_kernel", culprit="in_specs[0]")

    def test_element_padding_with_aliasing(self):
        padded = pl.BlockSpec((pl.Element(6, (1, 1)), 8), lambda i: (4 * i, 0))
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def stencil_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[1:5, :]

        f = lambda: self.pallas_call(
            stencil_kernel,
            X,
            grid=(4,),
            in_specs=[padded],
            out_specs=spec,
            input_output_aliases={0: 0},
        )
        self.expect(f, self.x, name="stencil_kernel", culprit="input_output_aliases")

    def test_in_spec_not_a_block_spec(self):
        f = lambda: self.pallas_call(copy_kernel, X, grid=(4,), in_specs=[(4, 8)])
        self.expect(f, self.x, name="copy_kernel", culprit="in_specs[0]")

    def test_unknown_memory_space(self):
        class Scratchpad:  # not a memory space any installed backend knows
            pass

        bad = pl.BlockSpec((4, 8), lambda i: (i, 0), memory_space=Scratchpad())
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        f = lambda: self.pallas_call(add_kernel, X, grid=(4,), in_specs=[spec, bad], out_specs=spec)
        self.expect(f, self.x, self.y, name="add_kernel", culprit="in_specs[1]")

    def test_unknown_memory_space_string(self):
        bad = pl.BlockSpec(memory_space="vmem_typo")
        f = lambda: self.pallas_call(copy_kernel, X, in_specs=[bad])
        self.expect(f, self.x, name="copy_kernel", culprit="in_specs[0]")

    def test_grid_spec_and_in_specs_both_given(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        grid_spec = pl.GridSpec(grid=(4,), in_specs=[spec], out_specs=spec)
        f = lambda: self.pallas_call(copy_kernel, X, grid_spec=grid_spec, in_specs=[spec])
        self.expect(f, self.x, exc=ValueError, name="copy_kernel", culprit="in_specs")

    def test_grid_spec_and_grid_both_given(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        grid_spec = pl.GridSpec(grid=(4,), in_specs=[spec], out_specs=spec)
        f = lambda: self.pallas_call(copy_kernel, X, grid_spec=grid_spec, grid=(2,))
        self.expect(f, self.x, exc=ValueError, name="copy_kernel", culprit="grid")

    # -- grid, out_shape, scratch, compiler params ------------------------------------------

    def test_grid_negative_entry(self):
        f = lambda: self.pallas_call(copy_kernel, X, grid=(2, -1))
        self.expect(f, self.x, exc=ValueError, name="copy_kernel", culprit="grid")

    def test_grid_non_int_entry(self):
        f = lambda: self.pallas_call(copy_kernel, X, grid=(2.5,))
        self.expect(f, self.x, name="copy_kernel", culprit="grid")

    def test_out_shape_not_a_struct(self):
        f = lambda: self.pallas_call(copy_kernel, 16, name="count_rows")
        self.expect(f, self.x, name="count_rows", culprit="out_shape")

    def test_out_shape_dict_entry_not_a_struct(self):
        def dict_kernel(x_ref, o_refs):
            o_refs["x"][...] = x_ref[...]

        f = lambda: self.pallas_call(dict_kernel, {"x": X, "y": "float32[16,8]"})
        self.expect(f, self.x, name="dict_kernel", culprit="out_shape['y']")

    def test_scratch_shapes_wrong_type(self):
        def scratch_kernel(x_ref, o_ref, s_ref):
            s_ref[...] = x_ref[...]
            o_ref[...] = s_ref[...]

        f = lambda: self.pallas_call(scratch_kernel, X, scratch_shapes=[(16, 8)])
        self.expect(f, self.x, exc=TypeError, name="scratch_kernel", culprit="scratch_shapes")

    def test_unknown_compiler_params_type(self):
        class MyParams:
            pass

        f = lambda: self.pallas_call(copy_kernel, X, compiler_params=MyParams(), name="tuned_copy")
        self.expect(f, self.x, exc=TypeError, name="tuned_copy", culprit="compiler_params")

    def test_dict_compiler_params(self):
        f = lambda: self.pallas_call(copy_kernel, X, compiler_params={"triton": {"num_warps": 4}})
        err = self.expect(f, self.x, exc=TypeError, name="copy_kernel", culprit="compiler_params")
        assert "old JAX form" in str(err)

    def test_compiler_params_list_of_mixed_backends(self):
        @dataclasses.dataclass(frozen=True)
        class ParamsA(pl.CompilerParams):
            PLATFORM = "cuda"

        @dataclasses.dataclass(frozen=True)
        class ParamsB(pl.CompilerParams):
            PLATFORM = "tpu"

        f = lambda: self.pallas_call(copy_kernel, X, compiler_params=[ParamsA(), ParamsB()])
        err = self.expect(f, self.x, exc=TypeError, name="copy_kernel", culprit="compiler_params")
        assert "one backend" in str(err)

    def test_non_array_input(self):
        f = lambda: self.pallas_call(copy_kernel, X, name="copy_strings")
        self.expect(f, "not an array", exc=TypeError, name="copy_strings")

    # -- input_output_aliases ---------------------------------------------------------------

    def test_alias_input_index_out_of_range(self):
        f = lambda: self.pallas_call(add_kernel, X, input_output_aliases={2: 0})
        self.expect(f, self.x, self.y, exc=ValueError, name="add_kernel", culprit="input_output_aliases")

    def test_alias_output_index_out_of_range(self):
        f = lambda: self.pallas_call(add_kernel, X, input_output_aliases={1: 1})
        self.expect(f, self.x, self.y, exc=ValueError, name="add_kernel", culprit="input_output_aliases")

    def test_alias_shape_mismatch(self):
        def transpose_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...].T

        f = lambda: self.pallas_call(
            transpose_kernel,
            jax.ShapeDtypeStruct((8, 16), jnp.float32),
            input_output_aliases={0: 0},
        )
        self.expect(f, self.x, exc=ValueError, name="transpose_kernel", culprit="input_output_aliases")

    def test_alias_dtype_mismatch(self):
        def cast_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...].astype(jnp.int32)

        f = lambda: self.pallas_call(
            cast_kernel, jax.ShapeDtypeStruct((16, 8), jnp.int32), input_output_aliases={0: 0}
        )
        self.expect(f, self.x, exc=ValueError, name="cast_kernel", culprit="input_output_aliases")

    def test_alias_not_a_mapping(self):
        f = lambda: self.pallas_call(copy_kernel, X, input_output_aliases=[0])
        self.expect(f, self.x, exc=TypeError, name="copy_kernel", culprit="input_output_aliases")

    # -- the kernel function ----------------------------------------------------------------

    def test_kernel_returns_value(self):
        def returning_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]
            return x_ref[...]

        f = lambda: self.pallas_call(returning_kernel, X)
        self.expect(f, self.x, exc=ValueError, name="returning_kernel")

    def test_kernel_wrong_arity(self):
        def three_ref_kernel(a_ref, b_ref, c_ref):
            c_ref[...] = a_ref[...] + b_ref[...]

        f = lambda: self.pallas_call(three_ref_kernel, X)
        self.expect(f, self.x, exc=TypeError, name="three_ref_kernel")

    def test_program_id_axis_out_of_range(self):
        def pid_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * pl.program_id(2)

        spec = pl.BlockSpec((4, 8), lambda i, j: (i, 0))
        f = lambda: self.pallas_call(pid_kernel, X, grid=(4, 1), in_specs=[spec], out_specs=spec)
        self.expect(f, self.x, exc=ValueError, name="pid_kernel", culprit="program_id")

    def test_num_programs_axis_out_of_range(self):
        def nprog_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * pl.num_programs(1)

        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        f = lambda: self.pallas_call(nprog_kernel, X, grid=(4,), in_specs=[spec], out_specs=spec)
        self.expect(f, self.x, exc=ValueError, name="nprog_kernel", culprit="num_programs")

    def test_program_id_outside_kernel(self):
        with pytest.raises(USER_ERRORS + (RuntimeError,)) as info:
            pl.program_id(0)
        check_message(info.value, None, "program_id")

    # -- Refs -------------------------------------------------------------------------------

    def test_store_wrong_shape(self):
        def row_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[0]

        self.expect(
            lambda: self.pallas_call(row_kernel, X, name="broadcast_row"),
            self.x,
            exc=ValueError,
            name="broadcast_row",
        )

    def test_store_wrong_dtype(self):
        def int_store_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...].astype(jnp.int32)

        self.expect(lambda: self.pallas_call(int_store_kernel, X), self.x, name="int_store_kernel")

    def test_static_index_beyond_block(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def oob_index_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + x_ref[4, 0]

        f = lambda: self.pallas_call(oob_index_kernel, X, grid=(4,), in_specs=[spec], out_specs=spec)
        self.expect(f, self.x, name="oob_index_kernel")

    def test_static_store_index_beyond_block(self):
        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))

        def oob_store_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]
            o_ref[0, 8] = 1.0

        f = lambda: self.pallas_call(oob_store_kernel, X, grid=(4,), in_specs=[spec], out_specs=spec)
        self.expect(f, self.x, name="oob_store_kernel")

    def test_static_ds_beyond_block(self):
        def oob_ds_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + jnp.sum(x_ref[pl.ds(12, 8), :])

        self.expect(lambda: self.pallas_call(oob_ds_kernel, X), self.x, name="oob_ds_kernel")

    def test_too_many_indices(self):
        def deep_index_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + x_ref[0, 0, 0]

        self.expect(lambda: self.pallas_call(deep_index_kernel, X), self.x, name="deep_index_kernel")

    def test_ds_negative_size(self):
        def negative_ds_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + jnp.sum(x_ref[pl.ds(0, -2), :])

        self.expect(lambda: self.pallas_call(negative_ds_kernel, X), self.x, name="negative_ds_kernel")


class TestNotErrors(PallasTest):
    """Things that look suspicious but are allowed (as upstream allows them)."""

    def test_block_larger_than_array(self):
        # A block larger than the array is padded like an edge block.
        x = self.rand((6, 8))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0

        spec = pl.BlockSpec((8, 8), lambda i: (i, 0))
        out = self.pallas_call(
            kernel,
            jax.ShapeDtypeStruct((6, 8), jnp.float32),
            grid=(1,),
            in_specs=[spec],
            out_specs=spec,
        )(x)
        assert jnp.allclose(out, x * 2.0)

    def test_name_argument_does_not_need_kernel_name(self):
        x = self.rand((4,))
        out = self.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1.0),
            jax.ShapeDtypeStruct((4,), jnp.float32),
            name="lambda_add",
        )(x)
        assert jnp.allclose(out, x + 1.0)


def _line_of(fn, marker: str) -> int:
    """The absolute line number of the first source line of ``fn`` containing ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if marker in line:
            return start + offset
    raise AssertionError(f"{marker!r} not in the source of {fn.__name__}")


class TestErrorLocations(PallasTest):
    """For a misuse inside the kernel body, the message points at the offending line."""

    def _expect_line(self, kernel, marker, **kwargs):
        x = self.rand((16, 8))
        with pytest.raises(USER_ERRORS) as info:
            self.pallas_call(kernel, X, **kwargs)(x)
        msg = _message(info.value)
        line = _line_of(kernel, marker)
        assert f"test_errors.py:{line}" in msg, f"expected test_errors.py:{line} in: {msg}"
        assert kernel.__name__ in msg

    def test_store_shape_line(self):
        def bad_store_kernel(x_ref, o_ref):
            v = x_ref[...] * 2.0
            o_ref[...] = v[:8]  # <- misuse

        self._expect_line(bad_store_kernel, "# <- misuse")

    def test_store_dtype_line(self):
        def bad_dtype_kernel(x_ref, o_ref):
            v = x_ref[...] + 1.0
            o_ref[...] = v.astype(jnp.int32)  # <- misuse

        self._expect_line(bad_dtype_kernel, "# <- misuse")

    def test_program_id_line(self):
        def bad_axis_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]
            o_ref[...] += pl.program_id(1).astype(jnp.float32)  # <- misuse

        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        self._expect_line(bad_axis_kernel, "# <- misuse", grid=(4,), in_specs=[spec], out_specs=spec)

    def test_static_index_line(self):
        def bad_index_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]
            o_ref[...] += x_ref[3, 9]  # <- misuse

        spec = pl.BlockSpec((4, 8), lambda i: (i, 0))
        self._expect_line(bad_index_kernel, "# <- misuse", grid=(4,), in_specs=[spec], out_specs=spec)

    def test_misuse_inside_loop_body_line(self):
        def bad_loop_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

            @pl.loop(0, 2)
            def _(i):
                o_ref[0:8] = x_ref[...]  # <- misuse

        self._expect_line(bad_loop_kernel, "# <- misuse")
