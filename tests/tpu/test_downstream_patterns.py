"""Patterns met in other people's TPU kernels (issue 31: tokamax and ejkernel run on
our packages, ``tests/downstream``), each written here as a small kernel of our own and
run the ``three_way`` ways against plain jnp on fresh random data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas.tpu")

from three_way import MODES, run  # noqa: E402

jax.config.update("jax_enable_checks", True)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("mode", MODES)
def test_one_d_iota_masks_columns(mode):
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
    np.testing.assert_allclose(np.asarray(run(build, (x,), mode)), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_pipeline_index_map_reads_a_table_at_the_grid_index(mode):
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
    np.testing.assert_allclose(np.asarray(run(build, (ids, x), mode)), expect, rtol=1e-6, atol=1e-6)
