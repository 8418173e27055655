"""Behaviours that JAX's own Pallas tests expect of pallas_call's specs and grid.

Each test mirrors one of JAX's (``pallas_test.py``, ``tpu_pallas_test.py`` of JAX 0.12)
on random data against a plain ``jnp`` reference:
  * a spec tree that does not match the inputs' tree is a ValueError in JAX's words
    (``test_pallas_call_in_specs_mismatch_inputs``);
  * ``pl.num_programs`` works in an index map and is static for a static grid
    (``test_can_query_grid_statically_via_num_programs_in_block_spec``);
  * specs given as nested lists match inputs given as lists (``test_with_unhashable_grid_spec``).

Each kernel runs every way (tests/ways).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_test_base import PallasTest, assert_allclose, random_array
from ways import every_way

import pallas as pl


def _copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]


class TestSpecTreeMismatch(PallasTest):
    def test_blockspec_against_a_dict_input_is_a_value_error(self):
        x = random_array(0, (64,))
        spec = pl.BlockSpec((8,), lambda i: (i,))

        def mismatched(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...]

        f = self.pallas_call(mismatched, out_shape=x, grid=(8,), in_specs=[spec, spec], out_specs=spec)
        with pytest.raises(ValueError) as info:
            f(x, dict(a=x))
        msg = str(info.value)
        assert re.search(
            r"Pytree for `in_specs` and `inputs` do not match. There are 1 mismatches, including:"
            r".* at \[1\], `in_specs` is a pytree leaf but `inputs` is a",
            msg,
            re.DOTALL,
        ), msg
        # Ours too: the kernel, the culprit, the user's line, expected vs given.
        for part in ("'mismatched'", "in_specs[1]", "test_jax_conformance_core.py:", "{'a': *}"):
            assert part in msg, (part, msg)

    @every_way()
    def test_matching_dict_specs_and_none_still_work(self):
        x, y = random_array(1, (64,)), random_array(2, (64,))
        spec = pl.BlockSpec((8,), lambda i: (i,))

        def add(a_ref, d_ref, o_ref):
            o_ref[...] = a_ref[...] + d_ref["a"][...] + d_ref["b"][...]

        f = self.pallas_call(
            add, out_shape=x, grid=(8,), in_specs=[spec, dict(a=spec, b=spec)], out_specs=spec
        )
        assert_allclose(f(x, dict(a=y, b=x)), x + y + x)
        # None (the whole array) stands for a whole subtree.
        g = self.pallas_call(add, out_shape=x, in_specs=[None, None])
        assert_allclose(g(x, dict(a=y, b=x)), x + y + x)


@every_way()
class TestNumProgramsInIndexMap(PallasTest):
    def test_static_num_programs_in_index_map(self):
        x = random_array(3, (32, 16))
        seen = []

        def reversed_blocks(i):
            n = pl.num_programs(0)
            seen.append(n)
            return n - 1 - i, 0

        out = self.pallas_call(
            _copy,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(4,),
            in_specs=[pl.BlockSpec((8, 16), reversed_blocks)],
            out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)),
        )(x)
        assert seen and all(isinstance(n, int) and n == 4 for n in seen), seen
        assert_allclose(out, jnp.concatenate([x[24:], x[16:24], x[8:16], x[:8]]))


def test_num_programs_still_refused_outside_pallas_call():
    with pytest.raises(RuntimeError, match="inside a kernel traced by pallas_call"):
        pl.num_programs(0)


@every_way()
class TestNestedListSpecs(PallasTest):
    def test_nested_list_specs_inputs_and_outputs(self):
        x = random_array(4, (8, 128), jnp.int32)
        spec = pl.BlockSpec((8, 128), lambda i: (0, 0))

        def kernel(x_ref, o_ref):
            assert isinstance(x_ref, list) and isinstance(o_ref, list)
            o_ref[0][...] = x_ref[0][...] * 2

        f = self.pallas_call(
            kernel,
            out_shape=[[jax.ShapeDtypeStruct(x.shape, x.dtype)]],
            grid_spec=pl.GridSpec(grid=(1,), in_specs=[[spec]], out_specs=[[spec]]),
        )
        res = f([x])
        assert isinstance(res, tuple)  # a list out_shape comes back a tuple, as in JAX
        np.testing.assert_array_equal(np.asarray(res[0][0]), np.asarray(x) * 2)
