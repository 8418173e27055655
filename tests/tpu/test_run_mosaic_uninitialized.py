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
