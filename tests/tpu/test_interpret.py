"""TPU interpret mode: TPU-style kernels against plain jnp on fresh random data,
and the same kernel source run by JAX's own TPU interpret mode as a reference.

Each kernel is built by a function of ``(pl, pltpu)``, so one source runs with
our modules and with JAX's (``jax.experimental.pallas``): moving a kernel over
is an import change. Every kernel that computes a result also runs every TPU
way (tests/ways, ``every_way(tpu=True)``: the ``way`` parameter); tests of what
only the interpreter does carry ``interpret_only``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ways import every_way
from ways.jax_mosaic import tensorcore_mesh

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.mosaic.lowering import LoweringException

interpret_only = pytest.mark.interpret_only

jax.config.update("jax_enable_checks", True)

try:
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu
except ImportError:  # pragma: no cover
    jpl = jpltpu = None

OURS = (pl, pltpu)
JAXS = (jpl, jpltpu)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------
# Kernels, each a function of the two modules.


def matmul(pl, pltpu, x, y, *, bm=128, bn=128, bk=128, interpret):
    M, K = x.shape
    N = y.shape[1]

    def kernel(x_ref, y_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(M // bm, N // bn, K // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
            pl.BlockSpec((bk, bn), lambda i, j, k: (k, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(x, y)


def dma_loop(pl, pltpu, x, *, chunk, interpret):
    n = x.shape[0] // chunk

    def kernel(x_hbm, o_ref, buf, sem):
        def copy(i, slot):
            return pltpu.make_async_copy(x_hbm.at[pl.ds(i * chunk, chunk)], buf.at[slot], sem.at[slot])

        copy(0, 0).start()

        def body(i, acc):
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < n)
            def _():
                copy(i + 1, 1 - slot).start()

            copy(i, slot).wait()
            return acc + jnp.sum(buf[slot] * 2.0, axis=0, keepdims=True)

        o_ref[...] = lax.fori_loop(0, n, body, jnp.zeros((1, x.shape[1]), jnp.float32))

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((1, x.shape[1]), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((2, chunk, x.shape[1]), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
        interpret=interpret,
    )(x)


def gather_rows(pl, pltpu, idx, x, *, interpret):
    """Scalar prefetch: the block index of the input comes from an SMEM table."""
    n = idx.shape[0]

    def kernel(idx_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + idx_ref[pl.program_id(0)].astype(jnp.float32)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n * 8, x.shape[1]), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n,),
            in_specs=[pl.BlockSpec((8, x.shape[1]), lambda i, idx_ref: (idx_ref[i], 0))],
            out_specs=pl.BlockSpec((8, x.shape[1]), lambda i, idx_ref: (i, 0)),
        ),
        interpret=interpret,
    )(idx, x)


def accumulate_into_output(pl, pltpu, x, *, interpret):
    """The output block is revisited along the k axis and accumulated in place."""
    M, K = x.shape

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += x_ref[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, 128), x.dtype),
        grid=(M // 8, K // 128),
        in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(x)


def semaphore_counts(pl, pltpu, x, *, interpret):
    def kernel(x_ref, o_ref, sems):
        pl.semaphore_signal(sems.at[0], 2)
        pl.semaphore_signal(sems.at[1])
        pl.semaphore_signal(sems.at[0], 3)
        v0 = pl.semaphore_read(sems.at[0])
        v1 = pl.semaphore_read(sems.at[1])
        pl.semaphore_wait(sems.at[0], 5)
        pl.semaphore_wait(sems.at[1])
        o_ref[...] = x_ref[...] * v0.astype(jnp.float32) + v1.astype(jnp.float32)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.SemaphoreType.REGULAR((2,))],
        interpret=interpret,
    )(x)


def smem_scalars(pl, pltpu, s, x, *, interpret):
    def kernel(s_ref, x_ref, o_ref, acc):
        acc[0] = s_ref[0] * s_ref[1]
        acc[1] = s_ref[2] + 1.0
        o_ref[...] = x_ref[...] * acc[0] + acc[1]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(x.shape, lambda: (0, 0))],
        scratch_shapes=[pltpu.SMEM((2,), jnp.float32)],
        interpret=interpret,
    )(s, x)


# ---------------------------------------------------------------------------


@every_way(tpu=True)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_vmem_accumulator(dtype, way):
    x, y = rand(0, (256, 384), dtype), rand(1, (384, 256), dtype)
    out = way.call(matmul, x, y)
    ref = jnp.dot(
        way.mxu_operand(x).astype(jnp.float32),
        way.mxu_operand(y).astype(jnp.float32),
        precision="highest",
    )
    close(out, ref, 1e-4 if dtype == jnp.float32 else 5e-2 * float(jnp.abs(ref).max()))
    if way.name == "tpu_interpret":
        theirs = matmul(*JAXS, x, y, interpret=jpltpu.InterpretParams())
        close(out, theirs, 1e-4 if dtype == jnp.float32 else 1e-2)


@every_way(tpu=True, dma=True)
def test_double_buffered_dma(way):
    x = rand(2, (16 * 64, 128))
    out = way.call(dma_loop, x, chunk=64)
    close(out, 2 * x.sum(0, keepdims=True), 1e-3)
    if way.dma:
        theirs = dma_loop(*JAXS, x, chunk=64, interpret=jpltpu.InterpretParams(dma_execution_mode=way.dma))
        close(out, theirs, 1e-4)


@every_way(tpu=True)
def test_scalar_prefetch_index_map(way):
    x = rand(3, (64, 128))
    idx = jax.random.randint(jax.random.key(4), (6,), 0, 8, jnp.int32)
    out = way.call(gather_rows, idx, x)
    ref = jnp.concatenate([x[8 * i : 8 * i + 8] * 2.0 + i for i in np.asarray(idx)])
    close(out, ref)
    if way.name == "tpu_interpret":
        close(out, gather_rows(*JAXS, idx, x, interpret=jpltpu.InterpretParams()))


@every_way(tpu=True)
def test_output_revisited_along_arbitrary_axis(way):
    x = rand(5, (32, 512))
    out = way.call(accumulate_into_output, x)
    close(out, x.reshape(32, 4, 128).sum(1), 1e-5)
    if way.name == "tpu_interpret":
        close(out, accumulate_into_output(*JAXS, x, interpret=jpltpu.InterpretParams()))


@every_way(tpu=True)
def test_semaphore_signal_wait_read(way):
    x = rand(6, (8, 128))
    out = way.call(semaphore_counts, x)
    close(out, x * 5 + 1)  # JAX's TPU interpret mode has no rule for semaphore_read: jnp only


@every_way(tpu=True)
def test_smem_scalars(way):
    s = rand(7, (3,))
    x = rand(8, (8, 128))
    out = way.call(smem_scalars, s, x)
    close(out, x * (s[0] * s[1]) + (s[2] + 1.0))
    if way.name == "tpu_interpret":
        close(out, smem_scalars(*JAXS, s, x, interpret=jpltpu.InterpretParams()))


@interpret_only(reason="interpret=True routing to the TPU interpreter")
def test_interpret_true_runs_tpu_kernels():
    """interpret=True hands a TPU kernel (VMEM scratch, DMAs) to the TPU interpreter."""
    x = rand(9, (4 * 32, 128))
    close(dma_loop(*OURS, x, chunk=32, interpret=True), 2 * x.sum(0, keepdims=True), 1e-3)


@every_way(tpu=True)
def test_vmap_and_jit_of_a_tpu_kernel(way):
    x, y = rand(10, (3, 128, 256)), rand(11, (3, 256, 128))
    build = lambda pl, pltpu: jax.vmap(lambda a, b: matmul(pl, pltpu, a, b, interpret=False))  # noqa: E731
    want = jnp.einsum("bij,bjk->bik", way.mxu_operand(x), way.mxu_operand(y))
    close(way.jit(build(*way.modules()))(x, y), want, 1e-4)


@interpret_only(reason="DMA execution order: uninitialized data before the wait")
def test_read_before_wait_shows_uninitialized_on_wait():
    """on_wait (the default) copies when the DMA is waited on: reading the
    destination before the wait sees uninitialized (NaN) data."""

    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    x = rand(12, (8, 128))
    call = lambda mode: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(dma_execution_mode=mode),
    )(x)
    assert np.isnan(np.asarray(call("on_wait"))).all()
    close(call("eager"), x)


@interpret_only(reason="uninitialized-memory poisoning")
@pytest.mark.parametrize("mode,expect", [("nan", np.nan), ("zero", 0.0)])
def test_uninitialized_memory(mode, expect):
    def kernel(x_ref, o_ref, scratch):
        o_ref[...] = scratch[...] + x_ref[...] * 0

    x = rand(13, (8, 128))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)],
        interpret=pltpu.InterpretParams(uninitialized_memory=mode),
    )(x)
    np.testing.assert_array_equal(np.asarray(out), np.full(x.shape, expect, np.float32))


@interpret_only(reason="InterpretParams knobs: random_seed, grid_point_recorder")
def test_random_order_of_parallel_axes_and_recorder():
    seen = []
    x = rand(14, (64, 256))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)

    def run(seed):
        seen.clear()
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(8, 2),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
            interpret=pltpu.InterpretParams(
                random_seed=seed, grid_point_recorder=lambda p, c: seen.append(tuple(np.asarray(p)))
            ),
        )(x)
        jax.effects_barrier()
        return out, list(seen)

    ref = x + jnp.repeat(jnp.arange(8.0), 8)[:, None]
    out0, order0 = run(None)
    out1, order1 = run(1234)
    close(out0, ref)
    close(out1, ref)
    assert order0 == [(i, j) for i in range(8) for j in range(2)]
    assert sorted(order1) == order0 and order1 != order0
    assert all(order1[2 * k][0] == order1[2 * k + 1][0] for k in range(8))  # arbitrary axis stays inner


@interpret_only(reason="InterpretParams knobs: num_cores_or_threads, grid_point_recorder")
def test_core_parallel_axis_runs_on_separate_cores():
    cores = []
    x = rand(15, (4 * 8, 128))

    def kernel(x_ref, o_ref, acc):
        # acc is per-core scratch: each core's first step finds it uninitialized (NaN).
        @pl.when(pl.program_id(1) == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        acc[...] += x_ref[...]
        o_ref[...] = acc[...]

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((2 * 8, 128), x.dtype),
        grid=(2, 2),
        in_specs=[pl.BlockSpec((8, 128), lambda c, i: (2 * c + i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda c, i: (c, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("core_parallel", "arbitrary")),
        interpret=pltpu.InterpretParams(
            num_cores_or_threads=2,
            grid_point_recorder=lambda p, c: cores.append((tuple(np.asarray(p)), int(c))),
        ),
    )(x)
    jax.effects_barrier()
    blocks = x.reshape(4, 8, 128)
    close(out, jnp.concatenate([blocks[0] + blocks[1], blocks[2] + blocks[3]]))
    assert sorted(cores) == [((0, 0), 0), ((0, 1), 0), ((1, 0), 1), ((1, 1), 1)]


@every_way(tpu=True)
def test_pl_kernel_over_tensorcore_mesh(way):
    x = rand(16, (2 * 8, 128))

    def build(pl, pltpu):
        mesh = tensorcore_mesh(pltpu)

        def copy(x_hbm, o_hbm):
            c = lax.axis_index("core")
            pltpu.sync_copy(x_hbm.at[pl.ds(c * 8, 8)], o_hbm.at[pl.ds(c * 8, 8)])

        return pl.kernel(copy, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh)

    close(way.with_params(num_cores=2).jit(build(*way.modules()))(x), x)


@every_way(tpu=True)
def test_named_grid_axis_index(way):
    x = rand(17, (4 * 8, 2 * 128))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 10.0 + lax.axis_index("i").astype(jnp.float32) + 0.5 * lax.axis_index("j")

    build = lambda pl, pltpu: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(("i", 4), ("j", 2)),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
    )
    out = way.jit(build(*way.modules()))(x)
    ii = jnp.repeat(jnp.arange(4.0), 8)[:, None]
    jj = jnp.repeat(jnp.arange(2.0), 128)[None, :]
    close(out, x * 10 + ii + 0.5 * jj)


@every_way(tpu=True)
def test_out_shape_list_and_no_outputs(way):
    x = rand(18, (8, 128))

    def two(x_ref, a_ref, b_ref):
        a_ref[...] = x_ref[...] + 1
        b_ref[...] = x_ref[...] * 3

    build = lambda pl, pltpu: pl.pallas_call(two, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2)  # noqa: E731
    outs = way.jit(build(*way.modules()))(x)
    assert isinstance(outs, tuple) and len(outs) == 2  # out_shape=[...] gives a tuple, as in JAX
    close(outs[0], x + 1)
    close(outs[1], x * 3)
    if way.name != "tpu_interpret":
        return

    def nothing(x_ref):
        pl.semaphore_read  # noqa: B018  (the kernel has no outputs to write)

    assert pl.pallas_call(nothing, out_shape=(), interpret=pltpu.InterpretParams())(x) == ()


def aliased_hbm(pl, pltpu, x, *, interpret):
    def kernel(x_hbm, o_hbm, buf, sem):
        pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], buf, sem).start()
        pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], buf, sem).wait()
        buf[...] = buf[...] * 2
        copy = pltpu.make_async_copy(buf, o_hbm.at[pl.ds(0, 8)], sem)
        copy.start()
        copy.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((8, 128), x.dtype), pltpu.SemaphoreType.DMA],
        input_output_aliases={0: 0},
        interpret=interpret,
    )(x)


@every_way(tpu=True)
def test_input_output_aliases_in_hbm(way):
    x = rand(19, (16, 128))
    close(way.call(aliased_hbm, x), x.at[:8].set(2 * x[8:]))


# ---------------------------------------------------------------------------
# Errors: run time (bounds, deadlocks) and trace time (TPU rules).


def _raises(match, fn):
    with pytest.raises(Exception) as info:
        jax.block_until_ready(fn())
    assert re.search(match, str(info.value)), str(info.value)[-2000:]
    return str(info.value)


@interpret_only(reason="interpret-mode error message")
def test_out_of_bounds_dynamic_ref_read_names_kernel_line_and_ref():
    x = rand(20, (16, 128))

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        o_ref[...] = x_ref[pl.ds(i * 8, 16), :]  # step 0 is fine, step 1 reads rows 8..24

    call = lambda: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct((16, 128), x.dtype),
        grid=(2,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((16, 128), lambda i: (0, 0)),
        interpret=pltpu.InterpretParams(),
    )(x)
    msg = _raises(r"Out-of-bounds read", call)
    assert "kernel 'kernel'" in msg and "test_interpret.py" in msg and "in_specs[0] block" in msg
    assert "[8, 8 + 16)" in msg


@interpret_only(reason="interpret-mode error message")
def test_out_of_bounds_dma_and_store():
    x = rand(21, (64, 128))

    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(pl.program_id(0) * 40, 32)], buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = buf[...]

    call = lambda: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct((32, 128), x.dtype),
        grid=(2,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((32, 128), lambda i: (0, 0)),
        scratch_shapes=[pltpu.VMEM((32, 128), x.dtype), pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(),
    )(x)
    _raises(r"Out-of-bounds read \(DMA read\) of in_specs\[0\] \(HBM\).*\[40, 40 \+ 32\)", call)

    def store(x_ref, o_ref):
        o_ref[pl.ds(pl.program_id(0) + 1, 8), :] = x_ref[...]

    call = (
        lambda: pl.pallas_call(  # noqa: E731
            store,
            out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
            grid=(1,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
            interpret=pltpu.InterpretParams(),
        )(x[:8])
    )
    _raises(r"Out-of-bounds write of out_specs\[0\] block.*dimension 0 writes \[1, 1 \+ 8\)", call)


@interpret_only(reason="interpret-mode error message")
def test_index_map_out_of_range():
    x = rand(22, (16, 128))
    call = lambda: pl.pallas_call(  # noqa: E731
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i + 1, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        interpret=pltpu.InterpretParams(),
    )(x)
    _raises(r"in_specs\[0\]\.index_map returned block index 2 for dimension 0", call)


@interpret_only(reason="interpret-mode error message")
def test_wait_that_never_completes_is_a_deadlock_error():
    def kernel(x_ref, o_ref, sem):
        pl.semaphore_signal(sem, 1)
        pl.semaphore_wait(sem, 2)
        o_ref[...] = x_ref[...]

    x = rand(23, (8, 128))
    call = lambda: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.SemaphoreType.REGULAR],
        interpret=pltpu.InterpretParams(),
    )(x)
    _raises(r"for 2 but it holds 1.*deadlock", call)


@interpret_only(reason="interpret-mode error message")
def test_dma_never_waited_is_an_error():
    def kernel(x_hbm, o_ref, buf, sem):
        pltpu.make_async_copy(x_hbm, buf, sem).start()
        o_ref[...] = jnp.zeros_like(o_ref)

    x = rand(24, (8, 128))
    call = lambda: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(),
    )(x)
    _raises(r"semaphore scratch_shapes\[1\] is not zero when the kernel ends", call)


def _simple(kernel, x, **kw):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=pltpu.InterpretParams(), **kw
    )(x)


@interpret_only(reason="interpret-mode error message")
def test_block_shape_must_fit_the_tpu_tile():
    x = rand(25, (64, 256))
    with pytest.raises(
        ValueError, match=r"in_specs\[0\].*dimension 1 of the block is 64.*multiples of 8 and 128"
    ):
        _simple(
            lambda x_ref, o_ref: None,
            x,
            grid=(4,),
            in_specs=[pl.BlockSpec((16, 64), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((16, 256), lambda i: (i, 0)),
        )
    with pytest.raises(ValueError, match=r"dimension 0 of the block is 4.*multiples of 8 and 128"):
        _simple(
            lambda x_ref, o_ref: None,
            x,
            grid=(16,),
            in_specs=[pl.BlockSpec((4, 256), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((64, 256), lambda i: (0, 0)),
        )


@interpret_only(reason="interpret-mode error message")
def test_smem_holds_scalars_of_at_most_32_bits():
    x = rand(26, (8, 128))
    with (
        jax.enable_x64(),
        pytest.raises(
            TypeError, match=r"scratch_shapes\[0\].*SMEM holds scalars of at most 32 bits, got int64"
        ),
    ):
        _simple(lambda x_ref, o_ref, s: None, x, scratch_shapes=[pltpu.SMEM((4,), jnp.int64)])


@interpret_only(reason="interpret-mode error message")
def test_scratch_over_vmem_limit():
    x = rand(27, (8, 128))
    with pytest.raises(
        ValueError, match=r"139264 bytes .* of VMEM.*more than compiler_params.vmem_limit_bytes \(65536 bytes"
    ):
        _simple(
            lambda x_ref, o_ref, s: None,
            x,
            scratch_shapes=[pltpu.VMEM((128, 256), jnp.float32)],
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=65536),
        )


@interpret_only(reason="interpret-mode error message")
def test_dma_between_refs_of_different_shapes_or_dtypes():
    x = rand(28, (8, 128))

    def shapes(x_hbm, o_ref, buf, sem):
        pltpu.make_async_copy(x_hbm, buf, sem).start()

    with pytest.raises(
        ValueError,
        match=r"make_async_copy: src_ref and dst_ref must have the same shape.*\[8, 128\].*\[16, 128\]",
    ):
        _simple(
            shapes,
            x,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((16, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        )
    with pytest.raises(ValueError, match=r"float32\[8, 128\] and dst bfloat16\[8, 128\]"):
        _simple(
            shapes,
            x,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.bfloat16), pltpu.SemaphoreType.DMA],
        )


@interpret_only(reason="interpret-mode error message")
def test_semaphore_of_the_wrong_type():
    x = rand(29, (8, 128))

    def dma_on_regular(x_hbm, o_ref, buf, sem):
        pltpu.make_async_copy(x_hbm, buf, sem).start()

    with pytest.raises(
        TypeError,
        match=r"in kernel 'dma_on_regular' at test_interpret.py:\d+: .*DMA semaphores.*got a REGULAR semaphore",
    ):
        _simple(
            dma_on_regular,
            x,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.REGULAR],
        )

    def wait_on_dma(x_ref, o_ref, sem):
        pl.semaphore_wait(sem)

    with pytest.raises(TypeError, match=r"expected a REGULAR or BARRIER semaphore, got a DMA semaphore"):
        _simple(wait_on_dma, x, scratch_shapes=[pltpu.SemaphoreType.DMA])

    def signal_data(x_ref, o_ref):
        pl.semaphore_signal(o_ref)

    with pytest.raises(TypeError, match=r"expected a semaphore Ref"):
        _simple(signal_data, x)


@interpret_only(reason="interpret-mode error message")
def test_dimension_semantics_validation():
    with pytest.raises(ValueError, match=r"unknown dimension semantics 'parallell'"):
        pltpu.CompilerParams(dimension_semantics=("parallell",))
    x = rand(30, (8, 128))
    with pytest.raises(ValueError, match=r"got 2 entries for a grid of 1 axes"):
        _simple(
            lambda x_ref, o_ref: None,
            x,
            grid=(1,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        )


@interpret_only(reason="force_tpu_interpret_mode itself")
def test_force_tpu_interpret_mode():
    x = rand(31, (8, 128))

    def kernel(x_ref, o_ref, scratch):
        scratch[...] = x_ref[...] * 3
        o_ref[...] = scratch[...]

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)],
    )
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        close(call(x), x * 3)
    with pytest.raises(ValueError, match="kernel is being lowered for the CPU|no Pallas backend|interpret"):
        jax.block_until_ready(
            pl.pallas_call(
                kernel,
                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)],
                compiler_params=pltpu.CompilerParams(),
            )(x)
        )


@interpret_only(reason="force_tpu_interpret_mode itself")
def test_force_tpu_interpret_mode_is_part_of_the_jit_key():
    """A function jitted outside the ``with`` block is traced again inside it, and the block's
    mode does not stay in the cache after it (as JAX's, a config state in the jit key): an
    uninitialized scratch reads NaN by default and zeros under ``uninitialized_memory="zero"``."""
    x = rand(32, (8, 128))

    def kernel(x_ref, o_ref, scratch):
        o_ref[...] = scratch[...] + x_ref[...]

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)],
    )
    f = jax.jit(call)
    zero = pltpu.InterpretParams(uninitialized_memory="zero")
    assert np.isnan(np.asarray(f(x))).all()
    with pltpu.force_tpu_interpret_mode(zero):
        close(f(x), x)
        with pltpu.force_tpu_interpret_mode(None):  # JAX's: None forces nothing in its block
            assert np.isnan(np.asarray(f(x))).all()
        close(f(x), x)
    assert np.isnan(np.asarray(f(x))).all()
    pltpu.set_tpu_interpret_mode(zero)
    try:
        close(f(x), x)
    finally:
        pltpu.set_tpu_interpret_mode(None)
    assert np.isnan(np.asarray(f(x))).all()


def test_forced_interpret_mode_is_no_absl_flag():
    """The forced mode set globally survives ``jax.config.parse_flags_with_absl()`` (tokamax's
    tests call it at import): as a flag-defining config state it became an absl string flag
    whose object value absl refused. In a child process: absl's flags are process-wide."""
    pytest.importorskip("absl.flags")
    code = textwrap.dedent(
        """
        import jax
        import pallas_tpu as pltpu
        pltpu.set_tpu_interpret_mode(pltpu.InterpretParams())
        jax.config.parse_flags_with_absl()
        from pallas import backend as plb
        assert isinstance(plb.forced_interpret().value, pltpu.InterpretParams)
        pltpu.set_tpu_interpret_mode(None)
        assert plb.forced_interpret().value is None
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def masked_load_store(pl, pltpu, x, y, mask, *, interpret):
    def kernel(x_ref, y_ref, m_ref, a_ref, b_ref):
        m = m_ref[...] != 0
        a_ref[...] = pltpu.load(x_ref, mask=m)
        b_ref[...] = y_ref[...]
        pltpu.store(b_ref, x_ref[...] * 2, mask=m)

    return pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2, interpret=interpret
    )(x, y, mask)


@every_way(
    tpu=True,
    skip={
        "jax_mosaic": "JAX's Mosaic lowering: masked load (pltpu.load with mask) raises NotImplementedError"
    },
)
def test_masked_load_and_store(way):
    x = rand(32, (8, 128))
    y = rand(33, (8, 128))
    mask = jax.random.bernoulli(jax.random.key(34), 0.5, (8, 128))
    a, b = way.call(masked_load_store, x, y, mask.astype(jnp.int32))
    close(a, jnp.where(mask, x, 0))
    close(b, jnp.where(mask, 2 * x, y))
    if way.name != "tpu_interpret":
        return

    def bad(x_ref, o_ref):
        o_ref[...] = pltpu.load(x_ref, mask=jnp.ones((8, 64), bool))

    with pytest.raises(
        ValueError, match=r"pltpu.load: mask must be a bool array of the Ref's shape \(8, 128\)"
    ):
        _simple(bad, x)


@every_way(tpu=True)
def test_pytree_scratch_shapes(way):
    x = rand(35, (8, 128))

    def kernel(x_ref, o_ref, scratch):
        scratch["a"][...] = x_ref[...] * 2
        scratch["b"][0][...] = scratch["a"][...] + 1
        o_ref[...] = scratch["b"][0][...]

    build = lambda pl, pltpu: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[{"a": pltpu.VMEM(x.shape, x.dtype), "b": [pltpu.VMEM(x.shape, x.dtype)]}],
    )
    close(way.jit(build(*way.modules()))(x), 2 * x + 1)


@interpret_only(reason="pl.debug_check is checked by the interpreter")
def test_debug_check():
    x = rand(36, (16, 128))

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        pl.debug_check(i < 1, "only one step expected")
        o_ref[...] = x_ref[...]

    def call():
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(2,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
            interpret=pltpu.InterpretParams(),
        )(x)

    close(call(), x)  # debug checks are off by default: the call runs
    with pl.enable_debug_checks():
        _raises(
            r"kernel 'kernel'.*test_interpret.py:\d+: pl.debug_check failed: only one step expected", call
        )


@interpret_only(reason="InterpretParams knob: chip_version")
@pytest.mark.parametrize("chip,generation", [("v4", 4), ("v5e", 5), ("v6e", 6)])
def test_chip_version_is_what_get_tpu_info_sees(chip, generation):
    x = rand(37, (8, 128))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + pltpu.get_tpu_info().generation

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=pltpu.InterpretParams(chip_version=chip),
    )(x)
    close(out, x + generation)
    with pytest.raises(ValueError, match="unknown TPU chip version 'v99'"):
        pltpu.InterpretParams(chip_version="v99")


def dma_that_adds(pl, pltpu, x, *, interpret):
    def kernel(x_hbm, o_ref, acc, sem):
        acc[...] = jnp.ones_like(acc)
        pltpu.async_copy(x_hbm.at[pl.ds(0, 8)], acc, sem, add=True).wait()
        pltpu.sync_copy(x_hbm.at[pl.ds(8, 8)], acc, add=True)
        o_ref[...] = acc[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), x.dtype), pltpu.SemaphoreType.DMA],
        interpret=interpret,
    )(x)


_NO_ADDING_DMA = "Mosaic has no adding DMA (tpu.enqueue_dma has no add): lowering dma_start(add=True) raises"


@every_way(
    tpu=True,
    dma=True,
    xfail={"mosaic": _NO_ADDING_DMA, "compiled": _NO_ADDING_DMA},
    raises=LoweringException,
    skip={"jax_mosaic": "JAX's Mosaic lowering: DMA with add=True is not supported"},
)
def test_dma_that_adds(way):
    x = rand(38, (16, 128))
    close(way.call(dma_that_adds, x), 1 + x[:8] + x[8:])


@interpret_only(reason="InterpretParams knobs: num_cores_or_threads, grid_point_recorder")
def test_megacore_splits_leading_parallel_axes_over_cores():
    """Without core_parallel axes, a megacore chip splits the leading 'parallel'
    axes over its cores (as JAX's interpreter does); each core has its own SMEM
    copy of the scalar-prefetch operands, which a kernel may write."""
    cores = []
    x = rand(39, (4 * 8, 128))

    def kernel(flag_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] + flag_ref[0].astype(jnp.float32)
        flag_ref[0] = 0  # the next step on this core sees 0; the other core still sees 1

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(2, 2),
            in_specs=[pl.BlockSpec((8, 128), lambda c, i, f: (2 * c + i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda c, i, f: (2 * c + i, 0)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams(
            num_cores_or_threads=2,
            grid_point_recorder=lambda p, c: cores.append((tuple(np.asarray(p)), int(c))),
        ),
    )(jnp.ones((1,), jnp.int32), x)
    jax.effects_barrier()
    first = jnp.repeat(jnp.array([1.0, 0.0, 1.0, 0.0]), 8)[:, None]
    close(out, x + first)
    assert sorted(cores) == [((0, 0), 0), ((0, 1), 0), ((1, 0), 1), ((1, 1), 1)]


def wait_with_another_descriptor(pl, pltpu, pages, x, *, interpret):
    def kernel(pages_ref, x_hbm, o_ref, buf, sem):
        for i in range(4):
            pltpu.make_async_copy(x_hbm.at[pages_ref[i]], buf.at[i], sem).start()
        o_ref[0] = buf[0] * 0 + 1  # before the wait: not landed yet (on_wait) - overwritten below
        pltpu.make_async_copy(buf, buf, sem).wait()
        o_ref[...] = buf[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((4, 8, 128), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((4, 8, 128), x.dtype), pltpu.SemaphoreType.DMA],
        ),
        interpret=interpret,
    )(pages, x)


@every_way(tpu=True, dma=True)
def test_wait_with_another_descriptor_on_the_same_semaphore(way):
    """JAX's paged attention starts one DMA per page into slices of a buffer and
    waits once with a whole-buffer descriptor on the same semaphore: the wait
    lands every DMA that semaphore counts, whatever descriptor it is given."""
    x = rand(40, (8, 8, 128))
    pages = jnp.array([5, 2, 7, 0], jnp.int32)
    close(way.call(wait_with_another_descriptor, pages, x), x[pages])


@pytest.mark.parametrize("skip", [False, True])
def test_skip_floating_point_ops(skip):
    # float-only operations are not run (their results are infinities, as in JAX's interpret
    # mode): the dot leaves the program; integer work, loops and Ref traffic still run
    x, y = rand(30, (8, 128)), rand(31, (128, 128))
    ints = jax.random.randint(jax.random.key(32), (8, 128), -9, 9, jnp.int32)

    def kernel(x_ref, y_ref, i_ref, z_ref, o_ref, c_ref):
        z_ref[...] = x_ref[...] @ y_ref[...]
        o_ref[...] = i_ref[...] * 2 + lax.fori_loop(0, 3, lambda k, c: c + k, jnp.zeros((8, 128), jnp.int32))
        c_ref[...] = x_ref[...]  # a copy computes nothing: the data moves

    def f(x, y, ints):
        return pl.pallas_call(
            kernel,
            out_shape=(
                jax.ShapeDtypeStruct((8, 128), jnp.float32),
                jax.ShapeDtypeStruct((8, 128), jnp.int32),
                jax.ShapeDtypeStruct((8, 128), jnp.float32),
            ),
            interpret=pltpu.InterpretParams(skip_floating_point_ops=skip),
        )(x, y, ints)

    z, o, c = jax.jit(f)(x, y, ints)
    np.testing.assert_array_equal(o, ints * 2 + 3)
    close(c, x)
    if skip:
        np.testing.assert_array_equal(z, np.full((8, 128), np.inf, np.float32))
    else:
        close(z, jnp.dot(x, y, precision="highest"), tol=1e-3)
    assert ("dot_general" in jax.jit(f).lower(x, y, ints).as_text()) != skip
