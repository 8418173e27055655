"""``pl.select_ref``: a DMA whose source or destination is chosen by a value known when
the kernel runs (JAX 0.11's API). Each kernel runs every TPU way (tests/ways: both
DMA modes of TPU interpret mode; our Mosaic lowering and JAX's under ``run_mosaic``;
libtpu's compiler) against jnp on fresh random data. JAX's own TPU interpret mode does
not run ``select_ref`` ("Cannot resolve attribute aval"); its lowering does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from ways import every_way
from ways.compare import close

import pallas as pl
import pallas_tpu as pltpu


def rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _smem(pl, pltpu):
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def select_source(pl, pltpu, idx, x0, x1, *, interpret):
    """o = 2 * (x0[8:16], x1)[idx]: the source of one DMA, a view among the choices."""

    def kernel(idx_ref, x0_hbm, x1_hbm, o_ref, buf, sem):
        src = pl.select_ref(idx_ref[0], x0_hbm.at[pl.ds(8, 8)], x1_hbm)
        pltpu.async_copy(src, buf, sem).wait()
        o_ref[...] = buf[...] * 2.0

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[_smem(pl, pltpu), any_, any_],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        interpret=interpret,
    )(idx, x0, x1)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("i", [0, 1, 7, -1])
def test_a_selected_source(i, way):
    x0, x1 = rand(1, (16, 128)), rand(2, (8, 128))
    got = way.call(select_source, jnp.array([i], jnp.int32), x0, x1)
    close(got, 2.0 * (x0[8:] if i == 0 else x1))  # JAX's lowering: any index but 0 takes the last


def select_destination(pl, pltpu, idx, x, a0, a1, *, interpret):
    """Outputs aliased to a0 and a1 (HBM); one DMA of x lands in the one idx names,
    the other keeps its contents."""

    def kernel(idx_ref, x_ref, a0_hbm, a1_hbm, o0_hbm, o1_hbm, sem):
        del a0_hbm, a1_hbm  # the same buffers as the outputs
        pltpu.async_copy(x_ref, pl.select_ref(idx_ref[0], o0_hbm, o1_hbm), sem).wait()

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=(shape, shape),
        in_specs=[_smem(pl, pltpu), pl.BlockSpec(memory_space=pltpu.VMEM), any_, any_],
        out_specs=(any_, any_),
        scratch_shapes=[pltpu.SemaphoreType.DMA],
        input_output_aliases={2: 0, 3: 1},
        interpret=interpret,
    )(idx, x, a0, a1)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("i", [0, 1])
def test_a_selected_destination(i, way):
    x, a0, a1 = rand(3, (8, 128)), rand(4, (8, 128)), rand(5, (8, 128))
    o0, o1 = way.call(select_destination, jnp.array([i], jnp.int32), x, a0, a1)
    close(o0, x if i == 0 else a0)
    close(o1, x if i == 1 else a1)


def sync_copy_rows(pl, pltpu, idx, x0, x1, *, interpret):
    """pltpu.sync_copy from a selected HBM Ref into the output block, one row block per step."""

    def kernel(idx_ref, x0_hbm, x1_hbm, o_ref):
        r = pl.program_id(0)
        src = pl.select_ref(idx_ref[r], x0_hbm.at[pl.ds(r * 8, 8)], x1_hbm.at[pl.ds(r * 8, 8)])
        pltpu.sync_copy(src, o_ref)

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32),
        grid=(4,),
        in_specs=[_smem(pl, pltpu), any_, any_],
        out_specs=pl.BlockSpec((8, 128), lambda r: (r, 0)),
        interpret=interpret,
    )(idx, x0, x1)


@every_way(tpu=True, dma=True)
def test_sync_copy_of_a_selected_view_per_grid_step(way):
    x0, x1 = rand(6, (32, 128)), rand(7, (32, 128))
    idx = jnp.array([1, 0, 0, 1], jnp.int32)
    got = way.call(sync_copy_rows, idx, x0, x1)
    close(got, jnp.where(jnp.repeat(idx, 8)[:, None] == 1, x1, x0))


def _trace(kernel, *args):
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[any_] * len(args),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(),
    )(*args)


def test_choices_of_different_shapes_are_refused():
    def kernel(x0_hbm, x1_hbm, o_ref, buf, sem):
        pltpu.async_copy(pl.select_ref(0, x0_hbm, x1_hbm), buf, sem).wait()
        o_ref[...] = buf[...]

    with pytest.raises(
        TypeError,
        match=r"in kernel 'kernel' at test_select_ref.py:\d+: .*Cannot select from Refs of different types",
    ):
        _trace(kernel, jnp.ones((8, 128)), jnp.ones((16, 128)))


def test_one_ref_is_refused_in_jax_words():
    def kernel(x0_hbm, o_ref, buf, sem):
        pltpu.async_copy(pl.select_ref(0, x0_hbm), buf, sem).wait()
        o_ref[...] = buf[...]

    with pytest.raises(
        ValueError, match=r"test_select_ref.py:\d+: At least two refs are required for pl.select_ref"
    ):
        _trace(kernel, jnp.ones((8, 128)))
