"""``pl.BoundedSlice`` block dimensions in ``pltpu.emit_pipeline`` (ejkernel's
grouped matmul v3 and tokamax's gmm_v2 pipeline the rows of each group of a ragged batch
this way).

A ``pl.BoundedSlice(n)`` dimension's index map returns ``pl.ds(start, size)`` with a size
that may be traced, at most ``n``; the body sees a buffer of ``n`` along it, of which the
first ``size`` elements were copied (the rest is stale). As in JAX's pipeline, the copy's
size is rounded up to the memory tiling of the dimension (1 for leading dimensions, so only
the last two and 1-D arrays round) and clamped to the end of the array before rounding; in
interpret mode, which has no tile padding, the copy stops at the end of the array.

Each kernel is written once as a function of ``(pl, pltpu)``, run every TPU way (tests/ways:
our interpret mode in both DMA modes, our Mosaic lowering and JAX's executed by
``run_mosaic``, and compiled by libtpu), compared with plain numpy on fresh random data
and, where JAX's TPU interpret mode runs it, with that too. ``pallas_call`` grid specs take
no ``pl.BoundedSlice`` (JAX refuses it there as well): a test checks our error.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import every_way

import pallas as pl
import pallas_tpu as pltpu

jax.config.update("jax_enable_checks", True)

try:
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu
except ImportError:  # pragma: no cover
    jpl = jpltpu = None


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def group_offsets(seed, rows, max_size, align=1):
    """Random group boundaries ``0 = o_0 < o_1 < ... = rows``: sizes in [align, max_size],
    multiples of ``align`` except possibly the last."""
    rng = np.random.default_rng(seed)
    offs = [0]
    while offs[-1] < rows:
        offs.append(min(rows, offs[-1] + align * int(rng.integers(1, max_size // align + 1))))
    return np.asarray(offs, np.int32)


def simulated_tpu():
    """JAX's pipeline asks the device for its TPU generation (the memory tiling), which
    fails on a CPU: its side runs inside an abstract mesh naming a TPU v5e."""
    if jax.default_backend() == "tpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="TPU v5e", num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def run_jax_interpret(make, args, **kw):
    """``make``'s kernel on JAX's Pallas in JAX's TPU interpret mode (the reference)."""
    if jpl is None:
        pytest.skip("jax.experimental.pallas is not importable")
    fn = jax.jit(make(jpl, jpltpu, interpret=jpltpu.InterpretParams(), **kw))
    with simulated_tpu():
        return fn(*args)


def run(way, make, *args, **kw):
    """``make(pl, pltpu, interpret=..., **kw)``'s function of ``args`` run the ``way`` way
    (tests/ways)."""
    return way.call(lambda pl, pltpu, *a, interpret: make(pl, pltpu, interpret=interpret, **kw)(*a), *args)


def smem_hbm_call(pl, pltpu, kernel, out_shape, n_smem, n_hbm, interpret):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * n_smem
        + [pl.BlockSpec(memory_space=pl.ANY)] * n_hbm,
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        interpret=interpret,
    )


# ---------------------------------------------------------------------------
# Kernels, each a function of the two modules.


def build_grouped_rows(pl, pltpu, *, bound, num_groups, interpret, buffers=None):
    """out[o_g:o_{g+1}] = x[o_g:o_{g+1}] * scale[g] + g, over row tiles of (8, 128): the
    bounded dimension leads (tiling 1), as in tokamax's gmm_v2."""

    def kernel(offs_ref, scale_ref, x_hbm, o_hbm):
        def body(x_ref, o_ref):
            g = pl.program_id(0)
            o_ref[...] = x_ref[...] * scale_ref[g] + g.astype(jnp.float32)

        def rows(g):
            return (pl.ds(offs_ref[g], offs_ref[g + 1] - offs_ref[g]), 0, 0)

        mode = {} if buffers is None else dict(pipeline_mode=pl.Buffered(buffers))
        pltpu.emit_pipeline(
            body,
            grid=(num_groups,),
            in_specs=[pl.BlockSpec((pl.BoundedSlice(bound), 8, 128), rows, **mode)],
            out_specs=[pl.BlockSpec((pl.BoundedSlice(bound), 8, 128), rows)],
        )(x_hbm, o_hbm)

    def f(offs, scale, x):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return smem_hbm_call(pl, pltpu, kernel, out, 2, 1, interpret)(offs, scale, x)

    return f


def expect_grouped_rows(offs, scale, x):
    x = np.asarray(x)
    return np.concatenate([x[offs[g] : offs[g + 1]] * scale[g] + g for g in range(len(offs) - 1)])


def build_grouped_sum(pl, pltpu, *, bound, num_groups, num_k, interpret, buffers=None):
    """A second grid axis over column blocks: the bounded input block changes every step,
    the bounded output block only with the group (it is written once per group, after the
    body summed the group's column blocks into it), as a grouped matmul's K loop does."""

    def kernel(offs_ref, scale_ref, x_hbm, o_hbm):
        def body(x_ref, o_ref):
            g, k = pl.program_id(0), pl.program_id(1)

            @pl.when(k == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            o_ref[...] += x_ref[...] * scale_ref[g]

        def x_rows(g, k):
            return (pl.ds(offs_ref[g], offs_ref[g + 1] - offs_ref[g]), 0, k)

        def o_rows(g, k):
            return (pl.ds(offs_ref[g], offs_ref[g + 1] - offs_ref[g]), 0, 0)

        mode = {} if buffers is None else dict(pipeline_mode=pl.Buffered(buffers))
        pltpu.emit_pipeline(
            body,
            grid=(num_groups, num_k),
            in_specs=[pl.BlockSpec((pl.BoundedSlice(bound), 8, 128), x_rows, **mode)],
            out_specs=[pl.BlockSpec((pl.BoundedSlice(bound), 8, 128), o_rows)],
        )(x_hbm, o_hbm)

    def f(offs, scale, x):
        out = jax.ShapeDtypeStruct((x.shape[0], 8, 128), x.dtype)
        return smem_hbm_call(pl, pltpu, kernel, out, 2, 1, interpret)(offs, scale, x)

    return f


def build_grouped_rows_of_a_view(pl, pltpu, *, bound, num_groups, interpret):
    """tokamax's gmm_v2: the rows of a 2-D array in HBM pipelined as tiles of 8 rows
    through a reshaped view (``ref.reshape(-1, 8, 128)``), whose leading dim is bounded."""

    def kernel(offs_ref, x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 0.5 + pl.program_id(0).astype(jnp.float32)

        def tiles(g):
            return (pl.ds(offs_ref[g], offs_ref[g + 1] - offs_ref[g]), 0, 0)

        spec = pl.BlockSpec((pl.BoundedSlice(bound), 8, 128), tiles)
        x3, o3 = x_hbm.reshape(-1, 8, 128), o_hbm.reshape(-1, 8, 128)
        pltpu.emit_pipeline(body, grid=(num_groups,), in_specs=[spec], out_specs=[spec])(x3, o3)

    def f(offs, x):
        return smem_hbm_call(pl, pltpu, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1, 1, interpret)(
            offs, x
        )

    return f


def build_sublane_rows(pl, pltpu, *, bound, num_groups, interpret):
    """The bounded dimension is the second-minor one of a 2-D array (tiling 8 for f32):
    copies are whole tiles, the last group's reaching into the edge tile's padding."""

    def kernel(offs_ref, x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 3.0 - pl.program_id(0).astype(jnp.float32)

        def rows(g):
            return (pl.ds(offs_ref[g], offs_ref[g + 1] - offs_ref[g]), 0)

        spec = pl.BlockSpec((pl.BoundedSlice(bound), 128), rows)
        pltpu.emit_pipeline(body, grid=(num_groups,), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

    def f(offs, x):
        return smem_hbm_call(pl, pltpu, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1, 1, interpret)(
            offs, x
        )

    return f


def build_one_d(pl, pltpu, *, n, block, interpret):
    """tokamax's linear softmax cross entropy: a 1-D array in blocks of ``block`` whose last
    one is ``pl.ds(i * block, n - i * block)``, rounded up to the 1-D tiling."""

    def kernel(x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0 + 1.0

        def blocks(i):
            return (pl.ds(i * block, jnp.minimum(block, n - i * block)),)

        spec = pl.BlockSpec((pl.BoundedSlice(block),), blocks)
        pltpu.emit_pipeline(body, grid=(pl.cdiv(n, block),), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

    def f(x):
        return smem_hbm_call(pl, pltpu, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 0, 1, interpret)(x)

    return f


# ---------------------------------------------------------------------------


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("buffers", [None, 1, 3])
def test_grouped_rows(way, buffers):
    offs = group_offsets(0, 40, 6)
    scale = rand(1, (len(offs) - 1,))
    x = rand(2, (40, 8, 128))
    kw = dict(bound=6, num_groups=len(offs) - 1, buffers=buffers)
    out = run(way, build_grouped_rows, jnp.asarray(offs), scale, x, **kw)
    np.testing.assert_allclose(
        np.asarray(out), expect_grouped_rows(offs, np.asarray(scale), x), rtol=1e-6, atol=1e-6
    )


def test_grouped_rows_as_jax_interprets_it():
    offs = group_offsets(3, 40, 6)
    scale = rand(4, (len(offs) - 1,))
    x = rand(5, (40, 8, 128))
    args = (jnp.asarray(offs), scale, x)
    kw = dict(bound=6, num_groups=len(offs) - 1)
    theirs = run_jax_interpret(build_grouped_rows, args, **kw)
    ours = build_grouped_rows(pl, pltpu, interpret=pltpu.InterpretParams(), **kw)(*args)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    np.testing.assert_allclose(
        np.asarray(ours), expect_grouped_rows(offs, np.asarray(scale), x), rtol=1e-6, atol=1e-6
    )


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("buffers", [None, 3])
def test_grouped_sum_over_a_second_axis(way, buffers):
    offs = group_offsets(6, 36, 8)
    g = len(offs) - 1
    scale = rand(7, (g,))
    x = rand(8, (36, 8, 3 * 128))
    out = run(
        way, build_grouped_sum, jnp.asarray(offs), scale, x, bound=8, num_groups=g, num_k=3, buffers=buffers
    )
    summed = np.asarray(x).reshape(36, 8, 3, 128).sum(2)
    expect = np.concatenate([summed[offs[i] : offs[i + 1]] * np.asarray(scale)[i] for i in range(g)])
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-5, atol=1e-5)
    kw = dict(bound=8, num_groups=g, num_k=3, buffers=buffers)
    if way.dma == "on_wait":
        theirs = run_jax_interpret(build_grouped_sum, (jnp.asarray(offs), scale, x), **kw)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(theirs))


@every_way(tpu=True, dma=True)
def test_grouped_rows_of_a_reshaped_view(way):
    # Not compared with JAX's interpret mode: it cannot copy through a reshaped Ref
    # ("'ReshapeTransform' object has no attribute 'indices'"); its Mosaic lowering can (the jax way).
    offs = group_offsets(14, 12, 4)
    x = rand(15, (12 * 8, 128))
    out = run(way, build_grouped_rows_of_a_view, jnp.asarray(offs), x, bound=4, num_groups=len(offs) - 1)
    g = np.repeat(np.arange(len(offs) - 1), np.diff(offs) * 8)[:, None]
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * 0.5 + g, rtol=1e-6, atol=1e-6)


@every_way(tpu=True, dma=True)
def test_sublane_rows_round_to_the_tiling(way):
    # Groups of 8 or 16 rows, then 4 rows at the end of a 44-row array: Mosaic copies that
    # group as one tile of 8 (into the edge tile's padding), interpret mode its 4 rows.
    offs = np.asarray([0, 16, 24, 40, 44], np.int32)
    x = rand(9, (44, 128))
    out = run(way, build_sublane_rows, jnp.asarray(offs), x, bound=16, num_groups=4)
    g = np.repeat(np.arange(4), np.diff(offs))[:, None]
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * 3.0 - g, rtol=1e-6, atol=1e-6)


def test_sublane_rows_as_jax_interprets_them():
    # Whole tiles only: JAX's interpret mode reads rounded copies past the end of the array
    # (it has no tile padding) and refuses them ("Out-of-bounds read").
    offs = np.asarray([0, 8, 24, 32, 48], np.int32)
    x = rand(10, (48, 128))
    args = (jnp.asarray(offs), x)
    theirs = run_jax_interpret(build_sublane_rows, args, bound=16, num_groups=4)
    ours = build_sublane_rows(pl, pltpu, bound=16, num_groups=4, interpret=pltpu.InterpretParams())(*args)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@every_way(tpu=True, dma=True)
def test_one_d_last_block_rounds_to_the_tiling(way):
    x = rand(11, (300,))
    out = run(way, build_one_d, x, n=300, block=128)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * 2.0 + 1.0, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Errors.


def _trace_pipeline(spec, shape=(40, 8, 128), table=None):
    table = np.asarray([0, 3, 9, 12] if table is None else table, np.int32)

    def bounded_kernel(t_ref, x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        pltpu.emit_pipeline(body, grid=(len(table) - 1,), in_specs=[spec(t_ref)], out_specs=[spec(t_ref)])(
            x_hbm, o_hbm
        )

    x = rand(12, shape)
    out = jax.ShapeDtypeStruct(shape, x.dtype)
    return smem_hbm_call(pl, pltpu, bounded_kernel, out, 1, 1, pltpu.InterpretParams())(jnp.asarray(table), x)


def test_error_static_size_beyond_the_bound():
    spec = lambda t: pl.BlockSpec((pl.BoundedSlice(4), 8, 128), lambda g: (pl.ds(4 * g, 6), 0, 0))  # noqa: E731
    with pytest.raises(
        ValueError, match=r"'bounded_kernel'.*in_specs\[0\].*pl\.ds\(\.\.\., 6\).*BoundedSlice\(4\)"
    ):
        _trace_pipeline(spec)


def test_error_traced_size_beyond_the_bound():
    # The third group has 6 rows: more than the window of 4 rows the pipeline copies them to.
    # A traced size is known as the copy runs: interpret mode refuses the copy into the window
    # (JAX's says "Out-of-bounds write" too; a TPU would write past the buffer).
    spec = lambda t: pl.BlockSpec(  # noqa: E731
        (pl.BoundedSlice(4), 8, 128), lambda g: (pl.ds(t[g], t[g + 1] - t[g]), 0, 0)
    )
    match = r"'bounded_kernel'.*Out-of-bounds write \(DMA write\).*takes 6 elements from 0.*its size is 4"
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_trace_pipeline(spec, table=[0, 3, 6, 12]))


def test_error_index_map_returns_an_index_for_a_bounded_dim():
    spec = lambda t: pl.BlockSpec((pl.BoundedSlice(4), 8, 128), lambda g: (g, 0, 0))  # noqa: E731
    with pytest.raises(ValueError, match=r"'bounded_kernel'.*in_specs\[0\].*BoundedSlice\(4\).*pl\.ds"):
        _trace_pipeline(spec)


def test_error_bound_not_a_multiple_of_the_tiling():
    spec = lambda t: pl.BlockSpec((pl.BoundedSlice(12), 128), lambda g: (pl.ds(t[g], t[g + 1] - t[g]), 0))  # noqa: E731
    with pytest.raises(ValueError, match=r"in_specs\[0\].*BoundedSlice\(12\).*tiling.*\(8\)"):
        _trace_pipeline(spec, shape=(40, 128))


@pytest.mark.parametrize("ns", ["ours", "jax"])
def test_pallas_call_grid_specs_take_no_bounded_slice(ns):
    # JAX refuses pl.BoundedSlice outside emit_pipeline too ("Unsupported block dim type").
    if ns == "jax" and jpl is None:
        pytest.skip("jax.experimental.pallas is not importable")
    p, tpu = (pl, pltpu) if ns == "ours" else (jpl, jpltpu)

    def grid_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    call = p.pallas_call(
        grid_kernel,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid=(2,),
        in_specs=[p.BlockSpec((p.BoundedSlice(8), 128), lambda i: (p.ds(i * 8, 8), 0))],
        out_specs=p.BlockSpec((8, 128), lambda i: (i, 0)),
        interpret=tpu.InterpretParams(),
    )
    match = (
        "BoundedSlice" if ns == "jax" else re.escape("'grid_kernel'") + r".*in_specs\[0\].*BoundedSlice\(8\)"
    )
    with pytest.raises((TypeError, ValueError), match=match):
        call(rand(13, (16, 128)))
