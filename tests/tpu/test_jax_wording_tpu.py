"""What JAX's own TPU Pallas tests (``scripts/jax_pallas_tests.py``) expect of TPU interpret mode: SMEM
operands of 8- and 16-bit types, and the words of JAX's interpreter ("Out-of-bounds
read"/"Out-of-bounds write") first in the Python exception of a bad access."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_tpu as pltpu


@pytest.mark.interpret_only(reason="SMEM of 8/16-bit types: what TPU interpret mode accepts (as JAX's)")
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.bfloat16, jnp.float16, jnp.bool_])
def test_smem_operands_of_8_and_16_bit_types(dtype):
    rng = np.random.default_rng(7)
    s = jnp.asarray(rng.integers(0, 2 if dtype == jnp.bool_ else 50, (5,)).astype(dtype))
    x = jax.random.normal(jax.random.key(1), (8, 128), jnp.float32)

    def kernel(s_ref, x_ref, o_ref, t_ref):
        t_ref[0] = s_ref[1]
        t_ref[1] = s_ref[3]
        o_ref[...] = x_ref[...] * t_ref[0].astype(jnp.float32) + t_ref[1].astype(jnp.float32)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
        scratch_shapes=[pltpu.SMEM((2,), dtype)],
        interpret=pltpu.InterpretParams(),
    )(s, x)
    f32 = s.astype(jnp.float32)
    np.testing.assert_allclose(out, x * f32[1] + f32[3], rtol=1e-6, atol=1e-4)


@pytest.mark.interpret_only(reason="an error raised as the kernel runs: TPU interpret mode's bounds checks")
@pytest.mark.parametrize("access", ["read", "write"])
def test_out_of_bounds_access_arrives_as_kernel_error_message_first(access):
    x = jax.random.normal(jax.random.key(2), (16, 128), jnp.float32)

    def kernel(x_ref, o_ref):
        start = pl.program_id(0) * 8 + 8  # step 1 reaches rows [16, 24) of 16
        if access == "read":
            o_ref[...] = x_ref[pl.ds(start, 8), :]
        else:
            o_ref[pl.ds(start, 8), :] = x_ref[pl.ds(0, 8), :]

    out_rows = 8 if access == "read" else 16
    f = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((out_rows, 128), jnp.float32),
        grid=(2,),
        interpret=pltpu.InterpretParams(),
    )
    with pytest.raises(pltpu.KernelError) as info:
        jax.block_until_ready(f(x))
    first = str(info.value).splitlines()[0]
    assert f"Out-of-bounds {access}" in first, first
    assert "in TPU kernel 'kernel'" in first and "test_jax_wording_tpu.py:" in first, first
    # A kernel that stays in bounds runs as jnp says.
    g = pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[pl.ds(pl.program_id(0) * 8, 8), :] * 2),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(2,),
        interpret=pltpu.InterpretParams(),
    )
    np.testing.assert_allclose(g(x), x[8:] * 2, rtol=1e-6)


def _dma_through(sem_type, index_sem: bool = False):
    def kernel(x_hbm_ref, y_hbm_ref):
        def body(x_ref, sem):
            pltpu.async_copy(x_hbm_ref, x_ref, sem.at[0] if index_sem else sem).wait()
            pltpu.async_copy(x_ref, y_hbm_ref, sem.at[0] if index_sem else sem).wait()

        pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32), sem_type)

    return pl.pallas_call(
        kernel,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=pltpu.InterpretParams(),
    )


@pytest.mark.interpret_only(reason="DMA semaphore checks at trace time, worded as JAX's TPU interpret mode")
def test_dma_semaphore_misuse_says_what_jax_says():
    x = jax.random.normal(jax.random.key(3), (8, 128), jnp.float32)
    np.testing.assert_array_equal(_dma_through(pltpu.SemaphoreType.DMA((1,)), index_sem=True)(x), x)
    with pytest.raises(
        ValueError, match=r"Cannot signal on a non-\(\)-shaped semaphore: \(1,\).*sem\.at\[i\]"
    ):
        _dma_through(pltpu.SemaphoreType.DMA((1,)))(x)
    for exc in (ValueError, TypeError):  # JAX: ValueError; pallas-tpu raised TypeError
        with pytest.raises(
            exc, match=r"DMAs signal DMA semaphores.*dma_wait requires a DMA semaphore.*semaphore_wait"
        ):
            _dma_through(pltpu.SemaphoreType.REGULAR)(x)


# -- the grid's blocks: out of bounds, revisited (checked while tracing, in JAX's words) ----


def _copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _shifted_copy(x, in_off, out_off, block=(8, 128), mode="raise", rows=32):
    return pl.pallas_call(
        _copy,
        out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32),
        in_specs=[pl.BlockSpec(block, lambda i: (i + in_off, 0))],
        out_specs=pl.BlockSpec(block, lambda i: (i + out_off, 0)),
        grid=(rows // block[0],),
        interpret=pltpu.InterpretParams(out_of_bounds_reads=mode),
    )(x)


@pytest.mark.interpret_only(reason="TPU interpret mode's checks of the grid's blocks")
@pytest.mark.parametrize("block", [(8, 128), (4, 128)])  # (4, 128): a block a TPU refuses, reported after
def test_out_of_bounds_block_index_says_what_jax_says(block):
    x = jax.random.normal(jax.random.key(4), (32, 128), jnp.float32)
    with pytest.raises(
        IndexError, match=r"Out-of-bounds block index \(\d+, 0\) for input 0 in iteration"
    ) as e:
        _shifted_copy(x, 1, 0, block)
    assert "in_specs[0].index_map returned block index" in str(e.value) and "test_jax_wording_tpu.py:" in str(
        e.value
    )
    with pytest.raises(IndexError, match=r"Out-of-bounds block index \(\d+, 0\) for output 0 in iteration"):
        _shifted_copy(x, 0, 2, block)
    np.testing.assert_array_equal(_shifted_copy(x, 0, 0), x)


@pytest.mark.interpret_only(reason="TPU interpret mode's out_of_bounds_reads")
def test_input_block_past_the_edge_reads_uninitialized_when_asked():
    """``out_of_bounds_reads="uninitialized"`` (as JAX's): an input block past the array reads NaN."""
    x = jax.random.normal(jax.random.key(5), (32, 128), jnp.float32)
    out = np.asarray(_shifted_copy(x, 1, 0, mode="uninitialized"))
    np.testing.assert_array_equal(out[:24], np.asarray(x)[8:])
    assert np.isnan(out[24:]).all()


@pytest.mark.interpret_only(reason="TPU interpret mode's runtime check of block indices")
def test_out_of_bounds_block_index_from_scalar_prefetch_says_what_jax_says():
    x = jax.random.normal(jax.random.key(6), (32, 128), jnp.float32)

    def run(s):
        return pl.pallas_call(
            lambda s_ref, x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(1,),
                in_specs=[pl.BlockSpec((8, 128), lambda i, s_ref: (s_ref[0], 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i, s_ref: (0, 0)),
            ),
            interpret=pltpu.InterpretParams(),
        )(s, x)

    np.testing.assert_array_equal(run(jnp.array([2], jnp.int32)), x[16:24])
    with pytest.raises(
        Exception, match=r"Out-of-bounds block index 4 \(dimension 0\) for input 0 in iteration \(0,\)"
    ) as e:
        jax.block_until_ready(run(jnp.array([4], jnp.int32)))
    assert ".index_map returned block index 4 for dimension 0, outside the array float32[32, 128]" in str(
        e.value
    )


def _two_outputs(block_rows):
    return pl.pallas_call(
        lambda x_ref, o1_ref, o2_ref: None,
        out_shape=[jax.ShapeDtypeStruct((4 * block_rows, 256), jnp.float32)] * 2,
        grid=(4, 4),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[
            pl.BlockSpec((block_rows, 128), lambda i, j: (i, j // 2)),
            pl.BlockSpec((block_rows, 128), lambda i, j: (j // 2, i % 2)),
        ],
        interpret=pltpu.InterpretParams(),
    )


@pytest.mark.interpret_only(reason="TPU interpret mode's check of revisited output blocks")
@pytest.mark.parametrize("block_rows", [8, 4])  # 4: a block a TPU refuses, reported after
def test_revisited_output_block_says_what_jax_says(block_rows):
    with pytest.raises(
        RuntimeError, match=r"Revisited block \(0, 0\) of output 1 in iteration \(2, 0\)"
    ) as e:
        _two_outputs(block_rows)(jnp.zeros((8, 128)))
    msg = str(e.value)
    assert "previously visited in iterations (0, 0) through (0, 1)" in msg, msg
    assert "out_specs[1].index_map returns to an output block" in msg and "test_jax_wording_tpu.py:" in msg


@pytest.mark.interpret_only(reason="TPU interpret mode's check of revisited output blocks")
def test_output_blocks_visited_in_consecutive_steps_or_aliased_are_not_revisits():
    x = jax.random.normal(jax.random.key(7), (16, 128), jnp.float32)

    def acc(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += x_ref[...]

    out = pl.pallas_call(  # a reduction over the inner axis: each block in consecutive steps
        acc,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(1, 2),
        in_specs=[pl.BlockSpec((8, 128), lambda i, k: (k, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
        interpret=pltpu.InterpretParams(),
    )(x)
    np.testing.assert_allclose(out, x[:8] + x[8:], rtol=1e-6)
    y = pl.pallas_call(  # aliased to its input: JAX's interpreter does not check it either
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + 1),
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid=(2, 2),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i, j: (j, 0)),
        input_output_aliases={0: 0},
        interpret=pltpu.InterpretParams(),
    )(x)
    assert y.shape == x.shape


# -- HBM Refs read or written directly ----------------------------------------------------


@pytest.mark.interpret_only(reason="TPU interpret mode's refusal of HBM accesses (the lowering's too)")
@pytest.mark.parametrize(
    "load, space_in, space_out, prim",
    [
        ("jnp", pltpu.HBM, pltpu.VMEM, "get_p"),
        ("pltpu", pl.ANY, pltpu.VMEM, "load_p"),
        ("jnp", pltpu.VMEM, pltpu.HBM, "swap_p"),
        ("pltpu", pltpu.VMEM, pl.ANY, "swap_p"),
    ],
)
def test_hbm_ref_accessed_directly_says_what_jax_says(load, space_in, space_out, prim):
    def kernel(in_ref, o_ref):
        if load == "jnp":
            o_ref[...] = in_ref[...]
        else:
            pltpu.store(o_ref, pltpu.load(in_ref))

    f = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(1,),
        in_specs=[pl.BlockSpec(memory_space=space_in)],
        out_specs=pl.BlockSpec(memory_space=space_out),
        interpret=pltpu.InterpretParams(),
    )
    jax_words = (
        rf"{prim}: Buffers with a memory space of HBM or ANY cannot be referenced directly\. Instead, use "
        r"`pltpu\.sync_copy` or `pltpu\.async_copy`\."
    )
    for exc in (ValueError, TypeError):  # JAX: ValueError; ours raised TypeError
        with pytest.raises(exc, match=jax_words) as e:
            f(jnp.zeros((8, 128), jnp.float32))
        assert "a TPU reaches HBM by DMAs only" in str(e.value) and "test_jax_wording_tpu.py:" in str(e.value)


# -- reads past a buffer with out_of_bounds_reads="uninitialized" ---------------------------


@pytest.mark.interpret_only(reason="TPU interpret mode's out_of_bounds_reads")
def test_scalar_read_past_the_end_reads_uninitialized_when_asked():
    def kernel(i_ref, x_ref, o_ref):
        o_ref[0] = x_ref[i_ref[0]]

    def run(i, mode):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * 2,
            out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
            interpret=pltpu.InterpretParams(out_of_bounds_reads=mode),
        )(jnp.array([i], jnp.int32), jnp.arange(10, 15, dtype=jnp.int32))

    assert int(run(3, "uninitialized")[0]) == 13
    assert int(run(5, "uninitialized")[0]) == np.iinfo(np.int32).min  # ours' uninitialized int (docs)
    with pytest.raises(Exception, match=r"Out-of-bounds read"):
        jax.block_until_ready(run(5, "raise"))


@pytest.mark.interpret_only(reason="TPU interpret mode's out_of_bounds_reads")
def test_dma_read_past_the_end_reads_uninitialized_when_asked():
    x = jax.random.normal(jax.random.key(8), (8, 4, 128), jnp.float32)

    def run(mode):
        return pl.pallas_call(
            lambda x_ref, o_ref, sem: pltpu.async_copy(
                x_ref.at[pl.ds(jnp.int32(4), 8), 1], o_ref, sem
            ).wait(),
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.SemaphoreType.DMA],
            interpret=pltpu.InterpretParams(out_of_bounds_reads=mode),
        )(x)

    out = np.asarray(run("uninitialized"))
    np.testing.assert_array_equal(out[:4], np.asarray(x)[4:, 1])
    assert np.isnan(out[4:]).all()
    with pytest.raises(Exception, match=r"Out-of-bounds read \(DMA read\)"):
        jax.block_until_ready(run("raise"))


# -- random_seed and force_tpu_interpret_mode as in JAX --------------------------------------


def _recorded_order(pl_, pltpu_, seed, sems):
    points = []

    def record(*args):  # (grid point, core); JAX 0.11's interpreter passes a token first and wants it back
        points.append(tuple(int(v) for v in args[-2]))
        return args[0] if len(args) == 3 else None

    def kernel(o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)

    pl_.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((3 * 8, 5 * 128), jnp.float32),
        grid=(3, 5),
        out_specs=pl_.BlockSpec((8, 128), lambda i, j: (i, j)),
        interpret=pltpu_.InterpretParams(random_seed=seed, grid_point_recorder=record),
        compiler_params=pltpu_.CompilerParams(dimension_semantics=sems),
    )()
    jax.effects_barrier()
    return points


@pytest.mark.interpret_only(reason="TPU interpret mode's random_seed")
@pytest.mark.parametrize("seed", [0, 12345])
@pytest.mark.parametrize("sems", [("parallel", "arbitrary"), ("parallel", "parallel")])
def test_random_seed_orders_parallel_axes_as_jax_does(seed, sems):
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu

    ours = _recorded_order(pl, pltpu, seed, sems)
    assert sorted(ours) == [(i, j) for i in range(3) for j in range(5)]
    assert ours == _recorded_order(jpl, jpltpu, seed, sems)


@pytest.mark.interpret_only(reason="pltpu.force_tpu_interpret_mode")
def test_forced_interpret_params_override_the_calls_own():
    """As JAX's: the forced parameters win over a call's ``interpret=`` (here: its race
    detection and core count)."""
    from pallas_tpu._src.interpret import multi as interpret_multi

    x = jnp.ones((8, 128), jnp.float32)

    @jax.jit
    def f(x):
        return pl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
            grid=(2,),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
            interpret=pltpu.InterpretParams(num_cores_or_threads=2, detect_races=False),
        )(x)

    np.testing.assert_array_equal(f(x), 2 * x)
    assert not interpret_multi.races.races_found
    forced = pltpu.InterpretParams(num_cores_or_threads=2, detect_races=True, on_race="warn")
    with pltpu.force_tpu_interpret_mode(forced):
        np.testing.assert_array_equal(jax.block_until_ready(f(x)), 2 * x)
    jax.effects_barrier()
    assert interpret_multi.races.races_found  # both cores write the one output block back


@pytest.mark.interpret_only(reason="interpret=True of a kernel with TPU DMAs")
def test_interpret_true_runs_dmas_in_the_tpu_interpreter():
    """A kernel whose only TPU feature is a DMA in a scoped buffer (no TPU operand spec):
    ``interpret=True`` runs it in TPU interpret mode, not in pallas-core's state discharge."""

    def kernel(o):
        def outer(sem, x):
            x[...] = jnp.full_like(x, 3.0)

            def inner(y):
                pltpu.async_copy(x, y.at[0], sem).wait()
                o[...] = y[0]

            pl.run_scoped(inner, pltpu.VMEM((1, 1), jnp.float32))

        pl.run_scoped(outer, pltpu.SemaphoreType.DMA, pltpu.VMEM((1,), jnp.float32))

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.float32), interpret=True)()
    np.testing.assert_array_equal(out, np.full((1,), 3.0, np.float32))
