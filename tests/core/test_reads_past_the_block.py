"""A kernel that reads past its block gets JAX's interpret mode's
answer in every mode, the installed JAX's. With JAX 0.11 a dynamic integer
index (``x_ref[i]``) at the kernel's top level past the block's end reads the
array there, clamped to the array's last element (inside a loop or cond it is
clamped into the block); with JAX 0.12+ it is clamped into the block; slices
(``pl.ds``) and integer-array indices are clamped into the block; writes are
clamped into the block. Each kernel runs every way (tests/ways) against JAX's
interpret mode, but for the TPU ways: a TPU has no such semantics, and both TPU ways
report the access (TPU interpret mode checks bounds, ``run_mosaic`` checks its loads).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jax_pl
from ways import TPU_WAYS, every_way

import pallas as pl


def row_past(m, x_ref, o_ref):  # a row of the next block
    o_ref[...] = jnp.broadcast_to(x_ref[m.program_id(0) + 8], o_ref.shape)


def element_past(m, x_ref, o_ref):
    o_ref[...] = jnp.full(o_ref.shape, x_ref[m.program_id(0) + 8, 1])


def element_past_in_a_loop(m, x_ref, o_ref):
    i = m.program_id(0)  # outside the loop: JAX's interpret mode has no program_id inside one

    def body(j, acc):
        return acc + x_ref[i + 6 + j, 2]

    o_ref[...] = jnp.full(o_ref.shape, jax.lax.fori_loop(0, 3, body, jnp.float32(0)))


def element_past_in_a_cond(m, x_ref, o_ref):
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    i = m.program_id(0)  # outside the cond: JAX's interpret mode has no program_id inside one

    @m.when(i < 3)
    def _():
        o_ref[...] = jnp.full(o_ref.shape, x_ref[i + 8, 3])


def negative_index(m, x_ref, o_ref):  # counts from the end of the block
    o_ref[...] = jnp.broadcast_to(x_ref[m.program_id(0) - 1], o_ref.shape)


def slice_past(m, x_ref, o_ref):  # pl.ds is clamped into the block
    o_ref[...] = x_ref[m.ds(m.program_id(0) + 4, 8), :]


def index_array_past(m, x_ref, o_ref):  # so is an integer-array index
    o_ref[...] = x_ref[jnp.arange(8) + 3 + m.program_id(0), :]


def write_past(m, x_ref, o_ref):  # a write is clamped into the block
    o_ref[...] = x_ref[...]
    o_ref[m.program_id(0) + 8] = jnp.full((x_ref.shape[1],), -1.0, jnp.float32)


KERNELS = [
    row_past,
    element_past,
    element_past_in_a_loop,
    element_past_in_a_cond,
    negative_index,
    slice_past,
    index_array_past,
    write_past,
]


def _call(module, pallas_call, kernel, x):
    spec = module.BlockSpec((8, 16), lambda i: (i, 0))
    return pallas_call(
        lambda x_ref, o_ref: kernel(module, x_ref, o_ref),
        grid=(4,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )(x)


def _jax_interpret(*args, **kwargs):
    return jax_pl.pallas_call(*args, interpret=True, **kwargs)


# What a TPU does instead: report it (test_tpu_ways_report_the_read).
_NOT_ON_A_TPU = dict.fromkeys(
    TPU_WAYS, "a TPU reads no data past a block: TPU interpret mode and run_mosaic report the access"
)


@every_way(skip=_NOT_ON_A_TPU)
@pytest.mark.parametrize("kernel", KERNELS, ids=[k.__name__ for k in KERNELS])
def test_reads_past_the_block_as_jax(kernel, way):
    x = jax.random.normal(jax.random.key(30), (32, 16), jnp.float32)
    want = _call(jax_pl, _jax_interpret, kernel, x)
    got = _call(pl, way.pallas_call, kernel, x)
    np.testing.assert_array_equal(got, want)


@every_way(skip=_NOT_ON_A_TPU)
def test_row_past_the_block_spelled_out(way):
    """What the semantics is, spelled out against jnp: with JAX 0.11 a top-level
    read past the block reads the array there (XLA folds the block's slice and the
    read's into one, clamped to the array); with JAX 0.12+ the index is clamped
    into the block (``dynamic_slice``'s semantics). Every mode follows the
    installed JAX."""
    x = jax.random.normal(jax.random.key(31), (32, 16), jnp.float32)
    got = _call(pl, way.pallas_call, row_past, x)
    if jax.__version_info__ < (0, 12):
        rows = np.minimum(np.arange(4) * 8 + np.arange(4) + 8, 31)  # block start + index, clamped
    else:
        rows = np.arange(4) * 8 + 7  # the index clamped to the block's last row
    np.testing.assert_array_equal(got, np.repeat(np.asarray(x)[rows], 8, axis=0))


@every_way(only=TPU_WAYS)
def test_tpu_ways_report_the_read(way):
    x = jax.random.normal(jax.random.key(32), (32, 128), jnp.float32)
    wpl, _ = way.modules()  # JAX's in the jax_mosaic way
    spec = wpl.BlockSpec((8, 128), lambda i: (i, 0))
    f = way.pallas_call(
        lambda x_ref, o_ref: row_past(wpl, x_ref, o_ref),
        grid=(4,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
    reported = (
        r"Out-of-bounds read of in_specs\[0\] block|access at \[8, 0\] .* out of bounds of a vmem memref"
    )
    with pytest.raises(Exception, match=reported):
        jax.block_until_ready(f(x))
