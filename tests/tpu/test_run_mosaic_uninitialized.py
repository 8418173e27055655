"""``pltpu.run_mosaic`` fills memory nothing has written yet by pallas-core's
policy (docs/differences.md, "Uninitialized memory"; ``pallas.backend.uninitialized_fill``):
NaN for floats, ``iinfo.min`` for signed integers, 0 for unsigned ones, False
for bools. That is scratch operands, allocas, outputs before the kernel writes
them, and the padding past an array's edge that an edge block reads.

A Pallas bool scratch buffer is an ``i32`` memref in a Mosaic module (ours and
JAX's lowering), so run_mosaic, which sees only the module, fills it as int32;
a bool read of it compares with zero and gives True. An ``i1`` memref (and a
bool output, whose dtype ``out_shape`` gives) starts False."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_tpu as pltpu
from pallas import backend as plb

jax.config.update("jax_enable_checks", True)

SHAPE = (8, 128)


def test_scratch_reads_the_policy_values():
    def kernel(o_i, o_f, o_b, o_u, s_i, s_f, s_b):
        o_i[...] = s_i[...]
        o_f[...] = s_f[...]
        o_b[...] = s_b[...]  # an i32 memref: int32's fill, nonzero

    out_shape = (
        jax.ShapeDtypeStruct(SHAPE, jnp.int32),
        jax.ShapeDtypeStruct(SHAPE, jnp.float32),
        jax.ShapeDtypeStruct(SHAPE, jnp.bool_),
        jax.ShapeDtypeStruct(SHAPE, jnp.bool_),  # never written: the output's own fill
    )
    scratch = [pltpu.VMEM(SHAPE, jnp.int32), pltpu.VMEM(SHAPE, jnp.float32), pltpu.VMEM(SHAPE, jnp.bool_)]
    f = pl.pallas_call(kernel, out_shape=out_shape, scratch_shapes=scratch)
    (module,) = pltpu.mosaic_modules(f)
    o_i, o_f, o_b, o_u = pltpu.run_mosaic(module, out_shape=out_shape)
    np.testing.assert_array_equal(o_i, np.full(SHAPE, np.iinfo(np.int32).min, np.int32))
    np.testing.assert_array_equal(o_i, np.full(SHAPE, plb.uninitialized_fill(np.int32)))
    assert o_f.dtype == np.float32 and np.all(np.isnan(o_f))
    np.testing.assert_array_equal(o_b, np.ones(SHAPE, bool))
    np.testing.assert_array_equal(o_u, np.full(SHAPE, plb.uninitialized_fill(np.bool_)))
    assert not o_u.any()


_I1_MODULE = """
module {
  func.func @kernel(%o: memref<8x128xi32, #tpu.memory_space<vmem>>,
                    %s: memref<8x128xi1, #tpu.memory_space<vmem>>,
                    %u: memref<8x128xi16, #tpu.memory_space<vmem>>)
      attributes {dimension_semantics = [], scalar_prefetch = 0 : i64, scratch_operands = 2 : i64} {
    %c0 = arith.constant 0 : index
    %b = vector.load %s[%c0, %c0] : memref<8x128xi1, #tpu.memory_space<vmem>>, vector<8x128xi1>
    %bi = arith.extui %b : vector<8x128xi1> to vector<8x128xi32>
    %h = vector.load %u[%c0, %c0] : memref<8x128xi16, #tpu.memory_space<vmem>>, vector<8x128xi16>
    %hi = arith.extsi %h : vector<8x128xi16> to vector<8x128xi32>
    %two = arith.constant dense<2> : vector<8x128xi32>
    %hi2 = arith.muli %hi, %two : vector<8x128xi32>
    %r = arith.addi %bi, %hi2 : vector<8x128xi32>
    vector.store %r, %o[%c0, %c0] : memref<8x128xi32, #tpu.memory_space<vmem>>, vector<8x128xi32>
    return
  }
}
"""


def test_i1_and_i16_scratch():
    """An i1 memref starts False; an i16 one at int16's smallest value."""
    (out,) = pltpu.run_mosaic(_I1_MODULE, out_shape=(jax.ShapeDtypeStruct(SHAPE, jnp.int32),))
    np.testing.assert_array_equal(out, np.full(SHAPE, 2 * np.iinfo(np.int16).min, np.int32))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32, jnp.uint32, jnp.bfloat16])
def test_outputs_not_written(dtype):
    def kernel(x_ref, o_ref, p_ref):
        o_ref[...] = x_ref[...]  # p_ref is never written

    x = jax.random.randint(jax.random.key(0), SHAPE, 1, 100).astype(dtype)
    out_shape = (jax.ShapeDtypeStruct(SHAPE, dtype), jax.ShapeDtypeStruct(SHAPE, dtype))
    f = pl.pallas_call(kernel, out_shape=out_shape)
    (module,) = pltpu.mosaic_modules(f, x)
    o, p = pltpu.run_mosaic(module, x, out_shape=out_shape)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(x))
    fill = plb.uninitialized_fill(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        assert np.all(np.isnan(np.asarray(p, np.float32)))
    else:
        np.testing.assert_array_equal(p, np.full(SHAPE, fill))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_edge_block_padding(dtype):
    """Rows past the edge of a (12, 128) input, read by its second (8, 128) block."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    x = jax.random.randint(jax.random.key(1), (12, 128), -100, 100).astype(dtype)
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    out_shape = jax.ShapeDtypeStruct((16, 128), dtype)
    f = pl.pallas_call(kernel, out_shape=out_shape, grid=(2,), in_specs=[spec], out_specs=spec)
    (module,) = pltpu.mosaic_modules(f, x)
    out = np.asarray(pltpu.run_mosaic(module, x, out_shape=out_shape))
    np.testing.assert_array_equal(out[:12], np.asarray(x))
    if dtype == jnp.float32:
        assert np.all(np.isnan(out[12:]))
    else:
        np.testing.assert_array_equal(out[12:], np.full((4, 128), np.iinfo(np.int32).min, np.int32))


def _aliased_revisits(grid, index_map):
    """An output aliased to its input, whose blocks the kernel reads before it writes them:
    ``o = o + 1`` at every step, the grid visiting blocks by ``index_map``."""

    def kernel(x_ref, o_ref):
        o_ref[...] = o_ref[...] + 1

    x = jax.random.normal(jax.random.key(0), (16, 128), jnp.float32)
    block = pl.BlockSpec((8, 128), index_map)
    kw = dict(
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=grid,
        in_specs=[block],
        out_specs=block,
        input_output_aliases={0: 0},
    )
    (module,) = pltpu.mosaic_modules(pl.pallas_call(kernel, **kw), x)
    out = pltpu.run_mosaic(module, x, out_shape=kw["out_shape"], input_output_aliases={0: 0})
    interpreted = pl.pallas_call(kernel, **kw, interpret=pltpu.InterpretParams())(x)
    return np.asarray(out), np.asarray(interpreted)


def test_an_aliased_output_block_is_not_read_from_the_array():
    """A TPU never reads an output block from HBM (the pipeline's VMEM buffer holds an earlier
    block's data or nothing): a read before the first write of a block, even of an output
    aliased to the input, gives the uninitialized fill, not the input's data."""
    out, interpreted = _aliased_revisits((2,), lambda i: (i, 0))
    assert np.isnan(out).all() and np.isnan(interpreted).all()  # TPU interpret mode's too


def test_an_output_block_is_kept_between_consecutive_visits_only():
    """Consecutive steps on one output block share its VMEM buffer (an accumulator works);
    leaving the block writes it back, and coming back later starts a fresh buffer."""
    out, interpreted = _aliased_revisits((2, 2), lambda i, j: (i, 0))  # each block twice in a row
    assert np.isnan(out).all() and np.isnan(interpreted).all()  # first read uninitialized; NaN + 1 stays NaN


def test_an_accumulated_output_block_survives_its_revisits():
    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += x_ref[...]

    x = jax.random.normal(jax.random.key(1), (16, 384), jnp.float32)
    out_shape = jax.ShapeDtypeStruct((16, 128), x.dtype)
    f = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(2, 3),
        in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
    )
    (module,) = pltpu.mosaic_modules(f, x)
    out = pltpu.run_mosaic(module, x, out_shape=out_shape)
    ref = x.reshape(16, 3, 128).sum(1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_a_block_visited_again_later_starts_uninitialized():
    """Blocks 0, 1, 0: the third step's block was written back when the second began; its
    new buffer does not hold the first step's values (a TPU's holds block 1's or garbage)."""

    def kernel(o_ref):
        step = pl.program_id(0)

        @pl.when(step == 0)
        def _():
            o_ref[...] = jnp.full(o_ref.shape, 7.0, o_ref.dtype)

        @pl.when(step == 1)
        def _():
            o_ref[...] = jnp.full(o_ref.shape, 5.0, o_ref.dtype)

        @pl.when(step == 2)
        def _():
            o_ref[0:1, :] = o_ref[0:1, :] + 1  # reads a row of block 0 again

    out_shape = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    f = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(3,),
        out_specs=pl.BlockSpec((8, 128), lambda i: (i % 2, 0)),
    )
    (module,) = pltpu.mosaic_modules(f)
    out = np.asarray(pltpu.run_mosaic(module, out_shape=out_shape))
    assert np.isnan(out[0]).all()  # the revisit's row: its fresh buffer's, plus one
    assert np.isnan(out[1:8]).all()  # written back from the fresh buffer: the first visit's 7s are gone
    np.testing.assert_array_equal(out[8:], np.full((8, 128), 5.0, np.float32))
