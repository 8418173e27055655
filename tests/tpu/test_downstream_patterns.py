"""Patterns met in other people's TPU kernels (tokamax and ejkernel run on
our packages: ``tests/downstream``), each written here as a small kernel of our own and
run every TPU way (tests/ways) against plain jnp on fresh random data."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas.tpu")

from ways import every_way  # noqa: E402
from ways.chip import ON_CHIP  # noqa: E402

import pallas as pl  # noqa: E402
import pallas_tpu as pltpu  # noqa: E402

jax.config.update("jax_enable_checks", True)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@every_way(tpu=True)
def test_one_d_iota_masks_columns(way):
    # ejkernel's fused cross entropy: ``offsets = jnp.arange(block_v)`` compared with a
    # bound to mask a vocabulary tile (a 1-D iota, then broadcast against the block).
    x = rand(0, (16, 256))
    bound = 200

    def build(pl, pltpu):
        def kernel(x_ref, o_ref):
            j = pl.program_id(0)
            cols = jnp.arange(128) + j * 128
            keep = (cols < bound)[None, :]
            o_ref[...] = jnp.where(keep, x_ref[...] * 2.0, 0.0) + jnp.arange(128).astype(jnp.float32)

        spec = pl.BlockSpec((16, 128), lambda j: (0, j))
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(2,),
            in_specs=[spec],
            out_specs=spec,
        )

    cols = np.arange(256)
    expect = np.where(cols[None, :] < bound, np.asarray(x) * 2.0, 0.0) + (cols % 128)[None, :]
    np.testing.assert_allclose(np.asarray(way.jit(build(*way.modules()))(x)), expect, rtol=1e-6, atol=1e-6)


@every_way(tpu=True)
def test_pipeline_index_map_reads_a_table_at_the_grid_index(way):
    # ejkernel's grouped matmul (through its buffered_pallas_call): emit_pipeline's index
    # maps look up an SMEM table at the grid index (``m_tile_ids[grid_id]``), a table with
    # exactly one entry per step. The pipeline must not evaluate them outside the grid
    # (step -1 before the first step, lookahead past the last).
    x = rand(1, (32, 128))
    ids = jnp.array([3, 0, 2, 1, 3], jnp.int32)

    def build(pl, pltpu):
        def kernel(ids_ref, x_hbm, o_hbm):
            def body(x_ref, o_ref):
                o_ref[...] = x_ref[...] * 2.0

            pltpu.emit_pipeline(
                body,
                grid=(ids.shape[0],),
                in_specs=[pl.BlockSpec((8, 128), lambda i: (ids_ref[i], 0))],
                out_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
            )(x_hbm, o_hbm)

        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8 * ids.shape[0], 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
        )

    expect = np.concatenate([np.asarray(x)[8 * int(i) : 8 * int(i) + 8] * 2.0 for i in ids])
    np.testing.assert_allclose(
        np.asarray(way.jit(build(*way.modules()))(ids, x)), expect, rtol=1e-6, atol=1e-6
    )


# --- BufferedRef subclasses as emit_pipeline allocations -------------------------------
# tokamax's routing matmul (routing_moe/gmm) subclasses pltpu.BufferedRef, replaces some of
# the methods JAX's pipeline scheduler calls (copy_in, wait_in, ...) with its own DMAs,
# and passes instances as ``allocations`` in a pytree mirroring the Refs. The pipeline
# keeps its predicates and slot registers; the subclass's methods do the copies.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pair:
    a: object
    b: object


def build_subclassed_allocations(pl, pltpu, *, grid, interpret=None):
    rows = 8

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Flipped(pltpu.BufferedRef):
        """Fetches the block of step ``grid - 1 - i`` where step ``i``'s is asked for."""

        def copy_in(self, src_ref, grid_indices):
            (i,) = grid_indices
            r, _ = self.compute_index(grid - 1 - i)
            slot = self.current_copy_in_slot
            pltpu.make_async_copy(
                src_ref.at[pl.ds(r * rows, rows)], self._window_ref_at(slot), self.sem_recvs.at[slot]
            ).start()

        def wait_in(self, src_ref, grid_indices):
            del grid_indices
            slot = self.current_wait_in_slot
            block = src_ref.at[pl.ds(0, rows)]  # only the byte count matters to the wait
            pltpu.make_async_copy(block, self._window_ref_at(slot), self.sem_recvs.at[slot]).wait()

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Inherited(pltpu.BufferedRef):
        """Keeps every method of pltpu.BufferedRef."""

    def body(ins, o_ref):
        o_ref[...] = ins.a[...] * 2.0 + ins.b[...]

    def kernel(x_hbm, y_hbm, o_hbm):
        spec = pl.BlockSpec((rows, 128), lambda i: (i, 0))
        y_spec = pl.BlockSpec((rows, 128), lambda i: (i // 2, 0), pipeline_mode=pl.Buffered(3))
        allocations = (
            Pair(Flipped.input(spec, x_hbm.dtype, 2), Inherited.input(y_spec, y_hbm.dtype, 3)),
            Inherited.output(spec, o_hbm.dtype, 2),
        )
        pipeline = pltpu.emit_pipeline(body, grid=(grid,), in_specs=(Pair(spec, y_spec),), out_specs=spec)
        pl.run_scoped(lambda allocs: pipeline(Pair(x_hbm, y_hbm), o_hbm, allocations=allocs), allocations)

    def f(x, y):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            interpret=interpret,
        )(x, y)

    return f


def subclassed_allocations_expected(x, y, grid):
    xb = np.asarray(x).reshape(grid, 8, 128)[::-1]
    yb = np.repeat(np.asarray(y).reshape(-1, 8, 128), 2, axis=0)[:grid]
    return (xb * 2.0 + yb).reshape(grid * 8, 128)


@every_way(tpu=True)
def test_buffered_ref_subclasses_as_allocations(way):
    grid = 6
    x, y = rand(2, (8 * grid, 128)), rand(3, (8 * grid // 2, 128))
    got = way.jit(build_subclassed_allocations(*way.modules(), grid=grid))(x, y)
    np.testing.assert_allclose(np.asarray(got), subclassed_allocations_expected(x, y, grid), rtol=1e-6)


def test_buffered_ref_subclasses_as_allocations_as_jax_interprets_them():
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu

    grid = 6
    x, y = rand(4, (8 * grid, 128)), rand(5, (8 * grid // 2, 128))
    f = build_subclassed_allocations(jpl, jpltpu, grid=grid, interpret=jpltpu.InterpretParams())
    v5e = jax.sharding.AbstractDevice(device_kind="TPU v5e", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=v5e)):
        # (JAX's pipeline asks for the TPU generation)
        theirs = jax.jit(f)(x, y)
    np.testing.assert_allclose(np.asarray(theirs), subclassed_allocations_expected(x, y, grid), rtol=1e-6)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        ours = jax.jit(build_subclassed_allocations(pl, pltpu, grid=grid))(x, y)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def build_guarded_static_index(pl, pltpu, *, num_slots, slack=0, interpret=None):
    # tokamax's fused MoE decode: a ring of ``num_slots`` slots primed from a table of
    # the active experts (4 entries) under ``pl.when(units > slot)``: slots 4 and 5 index
    # the table past its end where ``units <= 4`` keeps them from running.
    def kernel(active_ref, x_ref, o_ref, ids_ref):
        def compact(e, count):
            @pl.when(active_ref[e] != 0)
            def _():
                ids_ref[count] = e

            return count + (active_ref[e] != 0).astype(jnp.int32)

        units = jax.lax.fori_loop(0, 4, compact, jnp.int32(0))
        o_ref[...] = x_ref[...]
        for slot in range(num_slots):

            @pl.when(units + slack > slot)
            def _(slot=slot):
                o_ref[...] += ids_ref[jnp.int32(slot)].astype(jnp.float32)

    def f(active, x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
                out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
                scratch_shapes=[pltpu.SMEM((4,), jnp.int32)],
            ),
            interpret=interpret,
        )(active, x)

    return f


@every_way(tpu=True)
def test_static_index_past_the_end_under_a_condition_that_never_holds(way):
    x = rand(6, (8, 128))
    active = jnp.array([1, 0, 1, 1], jnp.int32)
    got = way.jit(build_guarded_static_index(*way.modules(), num_slots=6))(active, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) + (0 + 2 + 3), rtol=1e-6)


@pytest.mark.interpret_only(reason="the interpreter's bounds check of an access that runs")
def test_static_index_past_the_end_that_runs_is_an_error():
    x = rand(7, (8, 128))
    active = jnp.ones((4,), jnp.int32)
    f = build_guarded_static_index(pl, pltpu, num_slots=5, slack=1, interpret=pltpu.InterpretParams())
    with pytest.raises(Exception, match=r"Out-of-bounds read of scratch_shapes\[0\] \(shape \(4,\)\)"):
        jax.block_until_ready(jax.jit(f)(active, x))


@every_way(tpu=True)
def test_pipeline_block_larger_than_the_array(way):
    # tokamax's gmm_v2 with k smaller than its tile_k: an emit_pipeline block of 128 rows
    # over a dimension of 64. The one block is the last block: 64 rows are copied (whole
    # memory tiles), the rest of the buffer is never written back.
    x = rand(8, (4, 64, 128))

    def build(pl, pltpu):
        def kernel(x_hbm, o_hbm):
            spec = pl.BlockSpec((None, 128, 128), lambda g: (g, 0, 0))

            def body(x_ref, o_ref):
                o_ref[...] = x_ref[...] * 2.0

            pltpu.emit_pipeline(body, grid=(x.shape[0],), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
        )

    np.testing.assert_allclose(np.asarray(way.jit(build(*way.modules()))(x)), np.asarray(x) * 2.0, rtol=1e-6)


@pytest.mark.parametrize("n", [3, 4, 5])
def test_static_index_under_a_condition_in_pallas_core_interpret_mode_as_jax(n):
    # The same pattern in pallas-core's interpret mode (interpret=True), against JAX's:
    # refused by neither; where the branch reading past the end runs, both read the
    # block clamped to its end.
    from jax.experimental import pallas as jpl

    def build(pl):
        def kernel(n_ref, x_ref, o_ref):
            o_ref[...] = jnp.zeros_like(o_ref)
            for i in range(6):

                @pl.when(n_ref[0] > i)
                def _(i=i):
                    o_ref[0] += x_ref[i]

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.float32), interpret=True)

    x = rand(9, (4,))
    count = jnp.array([n], jnp.int32)
    np.testing.assert_array_equal(np.asarray(build(pl)(count, x)), np.asarray(build(jpl)(count, x)))


def build_reshaped_view_block_past_the_lanes(pl, pltpu):
    # tokamax's gmm_v2 pipelines ``lhs.reshape(-1, 8, k)`` with ``tile_k`` 128 > ``k`` 64: the
    # block's 128 lanes over a view of 64. A reshape keeping the minor dimension ends where
    # the array's memory tiles end, so the copy rounds up into their padding as JAX's
    # pipeline copies it (Mosaic refuses an exact 64-lane bf16 DMA: "The contiguous inner
    # slice in the DMA transfer must be divisible by 512 bytes").
    def kernel(x_hbm, o_hbm):
        spec = pl.BlockSpec((None, 16, 128), lambda g: (g, 0, 0))

        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2

        views = (x_hbm.reshape(8, 16, 64), o_hbm.reshape(8, 16, 64))
        pltpu.emit_pipeline(body, grid=(8,), in_specs=[spec], out_specs=[spec])(*views)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((128, 64), jnp.bfloat16),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
    )


_PADDING_OF_A_RESHAPE = (
    "run_mosaic refuses a memref_slice into the tile padding of a reshaped memref, "
    "which libtpu's Mosaic compiles (JAX's module too)"
)


@every_way(
    tpu=True,
    # the chip runs libtpu's module
    xfail={
        w: _PADDING_OF_A_RESHAPE
        for w in ("mosaic", "jax_mosaic", "compiled")
        if not (w == "compiled" and ON_CHIP)
    },
)
def test_pipeline_block_past_the_lanes_of_a_reshaped_view(way):
    x = rand(10, (128, 64), jnp.bfloat16)
    got = way.jit(build_reshaped_view_block_past_the_lanes(*way.modules()))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x) * 2)


def test_pipeline_block_past_the_lanes_of_a_reshaped_view_compiles():
    from ways.compiled import COMPILE_CHIPS, compile_both

    x = rand(10, (128, 64), jnp.bfloat16)
    compile_both(build_reshaped_view_block_past_the_lanes, (x,), COMPILE_CHIPS)  # raises if ours is refused
