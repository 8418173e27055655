"""``pltpu.emit_pipeline``: kernels that pipeline blocks of HBM Refs through
VMEM, against plain jnp on fresh random data, run every TPU way (tests/ways,
``every_way(tpu=True)``; the ``tpu_interpret`` way in both DMA execution modes), and the same
kernel source run by JAX's ``emit_pipeline`` under JAX's TPU interpret mode as a reference.

Each kernel is built by a function of ``(pl, pltpu)``, so one source runs with
our modules and with JAX's. JAX's pipeline asks the device for its TPU
generation, which fails on a CPU; JAX's side runs inside
``jax.sharding.use_abstract_mesh`` naming a simulated TPU v5e.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ways import every_way
from ways.jax_mosaic import OLD_JAX, tensorcore_mesh

import pallas as pl
import pallas_tpu as pltpu

interpret_only = pytest.mark.interpret_only

jax.config.update("jax_enable_checks", True)

try:
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu
except ImportError:  # pragma: no cover
    jpl = jpltpu = None

OURS = (pl, pltpu)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def simulated_tpu():
    """What JAX's emit_pipeline needs to trace on a CPU (see the module docstring)."""
    if jax.default_backend() == "tpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="TPU v5e", num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def run_jax(build, *args, **kw):
    if jpl is None:
        pytest.skip("jax.experimental.pallas is not importable")
    fn = jax.jit(build(jpl, jpltpu, interpret=jpltpu.InterpretParams(), **kw))
    with simulated_tpu():
        return fn(*args)


def run(way, make, *args, **kw):
    """``make(pl, pltpu, interpret=..., **kw)``'s function of ``args`` run the ``way`` way
    (tests/ways)."""
    return way.call(lambda pl, pltpu, *a, interpret: make(pl, pltpu, interpret=interpret, **kw)(*a), *args)


def hbm_call(pl, kernel, out_shape, n_in, interpret, **kw):
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        in_specs=[hbm] * n_in,
        out_specs=jax.tree.map(lambda _: hbm, out_shape),
        interpret=interpret,
        **kw,
    )


# ---------------------------------------------------------------------------
# Kernels, each a function of the two modules.


def build_add(pl, pltpu, *, block, interpret, buffers=None):
    def kernel(x_hbm, y_hbm, o_hbm):
        def add(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...] + y_ref[...]

        rows, cols = x_hbm.shape
        mode = {} if buffers is None else dict(pipeline_mode=pl.Buffered(buffers))
        in_spec = pl.BlockSpec(block, lambda i, j: (i, j), **mode)
        pltpu.emit_pipeline(
            add,
            grid=(pl.cdiv(rows, block[0]), pl.cdiv(cols, block[1])),
            in_specs=[in_spec, in_spec],
            out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
        )(x_hbm, y_hbm, o_hbm)

    return lambda x, y: hbm_call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 2, interpret)(x, y)


def build_matmul_scratch(pl, pltpu, *, bm, bn, bk, interpret):
    """x @ y with an inner (m, n, k) pipeline and an f32 VMEM accumulator passed as a scratch."""

    def kernel(x_hbm, y_hbm, o_hbm):
        def body(x_ref, y_ref, o_ref, acc_ref):
            @pl.when(pl.program_id(2) == 0)
            def _():
                acc_ref[...] = jnp.zeros_like(acc_ref)

            acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

            @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
            def _():
                o_ref[...] = acc_ref[...].astype(o_ref.dtype)

        (m, k), n = x_hbm.shape, y_hbm.shape[1]
        pipeline = pltpu.emit_pipeline(
            body,
            grid=(m // bm, n // bn, k // bk),
            in_specs=[
                pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        )
        pl.run_scoped(
            lambda acc: pipeline(x_hbm, y_hbm, o_hbm, scratches=[acc]), pltpu.VMEM((bm, bn), jnp.float32)
        )

    def matmul(x, y):
        out = jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype)
        return hbm_call(pl, kernel, out, 2, interpret)(x, y)

    return matmul


def build_revisit(pl, pltpu, *, interpret):
    """An input block that stays the same along j is not copied again: the
    body's writes to it are seen by the next step (as on a TPU)."""

    def kernel(x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...]
            x_ref[...] += 1.0

        pltpu.emit_pipeline(
            body,
            grid=(2, 3),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)),
        )(x_hbm, o_hbm)

    return lambda x: hbm_call(pl, kernel, jax.ShapeDtypeStruct((16, 384), x.dtype), 1, interpret)(x)


# ---------------------------------------------------------------------------


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("buffers", [None, 1, 2, 3])
def test_add(way, buffers):
    x, y = rand(0, (512, 256)), rand(1, (512, 256))
    out = run(way, build_add, x, y, block=(128, 128), buffers=buffers)
    close(out, x + y, 0)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize(
    "shape,dtype",
    [
        pytest.param(shape, dtype, id=f"{shape[0]}x{shape[1]}{suffix}")
        for shape, dtype, suffix in [
            ((600, 384), jnp.float32, ""),
            ((520, 200), jnp.float32, ""),
            ((100, 256), jnp.float32, ""),
            ((100, 200), jnp.bfloat16, "-bf16"),  # edge blocks of 36 rows (tiles of 16) and 72 columns
        ]
    ],
)
def test_add_blocks_not_dividing(way, shape, dtype):
    """The last block of a dimension is cut: interpret mode copies the elements
    that exist, Mosaic whole memory tiles (into the edge tile's padding, as JAX's
    pipeline copies them)."""
    x, y = rand(2, shape, dtype), rand(3, shape, dtype)
    block = (128, 128) if shape == (520, 200) else (64, 128)
    out = run(way, build_add, x, y, block=block)
    close(out, x + y, 0)


@every_way(tpu=True, dma=True)
def test_matmul_vmem_accumulator(way):
    x, y = rand(4, (256, 384)), rand(5, (384, 256))
    out = run(way, build_matmul_scratch, x, y, bm=128, bn=128, bk=128)
    close(out, jnp.dot(way.mxu_operand(x), way.mxu_operand(y), precision="highest"), 1e-4)


def build_accumulate_out(pl, pltpu, *, k_outer, interpret):
    b = 128

    def kernel(x_hbm, y_hbm, c_hbm, o_hbm):
        del c_hbm

        def body(x_ref, y_ref, o_ref):
            o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        if k_outer:
            grid = (2, 1, 2)
            xs = pl.BlockSpec((b, b), lambda kk, i, j: (i, kk))
            ys = pl.BlockSpec((b, b), lambda kk, i, j: (kk, j))
            os = pl.BlockSpec((b, b), lambda kk, i, j: (i, j))
        else:
            grid = (1, 2, 2)
            xs = pl.BlockSpec((b, b), lambda i, j, kk: (i, kk))
            ys = pl.BlockSpec((b, b), lambda i, j, kk: (kk, j))
            os = pl.BlockSpec((b, b), lambda i, j, kk: (i, j))
        pltpu.emit_pipeline(body, grid=grid, in_specs=[xs, ys], out_specs=os, should_accumulate_out=True)(
            x_hbm, y_hbm, o_hbm
        )

    def f(x, y, c):
        out = jax.ShapeDtypeStruct(c.shape, c.dtype)
        return hbm_call(pl, kernel, out, 3, interpret, input_output_aliases={2: 0})(x, y, c)

    return f


@every_way(
    tpu=True,
    dma=True,
    skip={"jax_mosaic": "JAX's Mosaic lowering: emit_pipeline has no should_accumulate_out"},
)
@pytest.mark.parametrize("k_outer", [False, True])
def test_matmul_should_accumulate_out(way, k_outer):
    """out = c + x @ y: the output (aliased to c) is loaded when its block changes
    and the body adds into it, over a k axis inner or outer to the output's."""
    x, y, c = rand(6, (128, 256)), rand(7, (256, 256)), rand(8, (128, 256))
    out = run(way, build_accumulate_out, x, y, c, k_outer=k_outer)
    close(out, c + jnp.dot(way.mxu_operand(x), way.mxu_operand(y), precision="highest"), 1e-4)


@every_way(tpu=True, dma=True)
def test_unchanged_input_block_is_not_copied_again(way):
    x = rand(9, (16, 128))
    out = run(way, build_revisit, x)
    expected = jnp.concatenate(
        [jnp.concatenate([x[8 * i : 8 * i + 8] + j for j in range(3)], 1) for i in range(2)]
    )
    close(out, expected, 1e-6)


def build_nested(pl, pltpu, *, interpret):
    def kernel(x_hbm, o_hbm):
        i = pl.program_id(0)
        band = pl.ds(i * 64, 64)

        def body(x_ref, o_ref):
            o_ref[...] = jnp.sin(x_ref[...]) * 2.0 + i.astype(jnp.float32)

        spec = pl.BlockSpec((16, 128), lambda r, c: (r, c))
        pltpu.emit_pipeline(body, grid=(4, 2), in_specs=[spec], out_specs=[spec])(
            x_hbm.at[band], o_hbm.at[band]
        )

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return lambda x: pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(4,),
        in_specs=[hbm],
        out_specs=hbm,
        interpret=interpret,
    )(x)


@every_way(tpu=True, dma=True)
def test_nested_in_outer_grid(way):
    """An outer pallas_call grid over row bands; each step pipelines its band."""
    x = rand(10, (4 * 64, 256))
    out = run(way, build_nested, x)
    close(out, jnp.sin(x) * 2.0 + jnp.repeat(jnp.arange(4.0), 64)[:, None], 1e-6)


def build_program_ids(pl, pltpu, *, interpret):
    def kernel(x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = (
                x_ref[...] + 100.0 * pl.program_id(0) + pl.program_id(1) + 1000.0 * pl.num_programs(0)
            )

        spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
        pltpu.emit_pipeline(body, grid=(4, 2), in_specs=spec, out_specs=spec)(x_hbm, o_hbm)

    return lambda x: hbm_call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1, interpret)(x)


@every_way(tpu=True)
def test_program_id_in_body_is_the_pipelines(way):
    x = rand(11, (32, 256))
    out = run(way, build_program_ids, x)
    ii = jnp.repeat(jnp.arange(4.0), 8)[:, None]
    jj = jnp.repeat(jnp.arange(2.0), 128)[None, :]
    close(out, x + 100 * ii + jj + 4000.0)


def build_squeezed(pl, pltpu, *, interpret):
    def kernel(x_hbm, y_hbm, o_hbm):
        def body(refs, o_ref):
            o_ref[...] = refs["x"][...] * refs["y"][...]

        xs = pl.BlockSpec((pl.squeezed, 8, 128), lambda b, r: (b, r, 0))
        ys = pl.BlockSpec((8, 128), lambda b, r: (r, 0))
        os = pl.BlockSpec((None, 8, 128), lambda b, r: (b, r, 0))
        for no_pipelining in (False, True):
            pltpu.emit_pipeline(
                body, grid=(3, 2), in_specs=[{"x": xs, "y": ys}], out_specs=os, no_pipelining=no_pipelining
            )({"x": x_hbm, "y": y_hbm}, o_hbm)

    return lambda x, y: hbm_call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 2, interpret)(x, y)


@every_way(tpu=True, dma=True)
def test_squeezed_dims_pytree_specs_and_no_pipelining(way):
    x, y = rand(12, (3, 16, 128)), rand(13, (16, 128))
    close(run(way, build_squeezed, x, y), x * y[None], 0)


def build_reused_allocations(pl, pltpu, *, interpret):
    def kernel(x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 3.0

        spec = pl.BlockSpec((16, 128), lambda i: (i, 0))
        pipeline, make_allocations = pltpu.emit_pipeline_with_allocations(
            body, grid=(4,), in_specs=[spec], out_specs=[spec]
        )

        def run(allocs):
            pipeline(x_hbm, o_hbm, allocations=allocs)
            pipeline(o_hbm, o_hbm, allocations=allocs)  # 9 * x, reusing the buffers

        pl.run_scoped(run, make_allocations(x_hbm, o_hbm))

    return lambda x: hbm_call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1, interpret)(x)


@every_way(tpu=True)
def test_with_allocations_reused_and_explicit_step(way):
    x = rand(14, (64, 128))
    close(run(way, build_reused_allocations, x), 9.0 * x, 1e-6)


def async_prefetch_pipeline(pl, pltpu):
    """(mesh, pipeline, async_prefetch) of a 2-input elementwise pipeline over one core."""
    mesh = pltpu.TensorCoreMesh(axis_name="core", num_cores=1)
    spec = pl.BlockSpec((16, 128), lambda i, j: (i, j))

    def body(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * y_ref[...] + 1.0

    pipeline, async_prefetch = pltpu.emit_pipeline_with_async_prefetch(
        body, grid=(4, 2), in_specs=[spec, spec], out_specs=[spec], mesh=mesh
    )
    return mesh, pipeline, async_prefetch


def later_kernel(pl, mesh, pipeline, allocations, out, **kw):
    @pl.kernel(out_type=out, mesh=mesh, **kw)
    def k(x_hbm, y_hbm, o_hbm):
        pipeline(x_hbm, y_hbm, o_hbm, allocations=allocations)

    return k


def build_async_prefetch(pl, pltpu, *, interpret):
    del interpret

    def f(x, y):
        # Made when traced: JAX 0.10's pltpu (compiled beside ours) has neither
        # TensorCoreMesh nor emit_pipeline_with_async_prefetch, which its lowering then records.
        mesh, pipeline, async_prefetch = async_prefetch_pipeline(pl, pltpu)
        allocations = async_prefetch(x, y)  # outside the kernel, before it
        return later_kernel(pl, mesh, pipeline, allocations, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)

    return f


@every_way(
    tpu=True,
    skip={"jax_mosaic": "JAX 0.10's Pallas: no emit_pipeline_with_async_prefetch (nor pltpu.TensorCoreMesh)"}
    if OLD_JAX
    else {},
    xfail={}
    if OLD_JAX
    else {
        "jax_mosaic": "the Mosaic ways' harness: JAX's async_prefetch allocates the VMEM buffers and DMA "
        "semaphores in XLA (empty_ref, AllocateBuffer) and passes them between two kernels; the "
        "harness evaluates one kernel's state at a time"
    },
)
def test_async_prefetch_then_pipeline_in_a_later_kernel(way):
    """async_prefetch runs outside the kernel; the pipeline of a later kernel over the mesh
    takes its allocations (JAX's usage). Ours lowers async_prefetch to nothing: the pipeline
    fetches its first blocks when it starts (same data; no overlap with earlier work)."""
    x, y = rand(16, (64, 256)), rand(17, (64, 256))
    close(run(way, build_async_prefetch, x, y), x * y + 1.0, 1e-6)


@pytest.mark.interpret_only(reason="interpret-mode error messages")
def test_async_prefetch_allocations_for_other_inputs_are_refused():
    x, y = rand(16, (64, 256)), rand(17, (64, 256))
    mesh, pipeline, async_prefetch = async_prefetch_pipeline(pl, pltpu)
    allocations = async_prefetch(x[:32], y[:32])
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    wrong = later_kernel(pl, mesh, pipeline, allocations, out, interpret=pltpu.InterpretParams())
    with pytest.raises(ValueError, match=r"made for inputs float32\[32, 256\].*runs on float32\[64, 256\]"):
        wrong(x, y)
    with pytest.raises(ValueError, match="one input per in_spec"):
        async_prefetch(x)


def test_buffered_ref_public_fields():
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    b = pltpu.BufferedRef.input(spec, jnp.float32, buffer_count=2)
    assert b.is_buffered and b.is_input and not b.is_output and b.buffer_count == 2
    assert b.buffer_type is pltpu.BufferType.INPUT
    assert b.window_ref.shape == (2, 8, 128)
    assert isinstance(b, pltpu.BufferedRefBase)
    o = pltpu.BufferedRef.output(pl.BlockSpec((8, 128), lambda i: (i, 0), memory_space=pl.ANY), jnp.float32)
    assert not o.is_buffered
    step = pltpu.PipelineStep(index=(1, jnp.int32(2)), local_index=jnp.int32(3))
    again = jax.tree.unflatten(*reversed(jax.tree.flatten(step)))
    assert again.index[0] == 1 and int(again.local_index) == 3


@every_way(tpu=True)
def test_core_axis_name_splits_the_grid(way):
    x = rand(15, (8 * 8, 128))

    def build(pl, pltpu):
        mesh = tensorcore_mesh(pltpu)

        def double(x_hbm, o_hbm):
            def body(x_ref, o_ref):
                o_ref[...] = x_ref[...] * 2.0

            spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
            pltpu.emit_pipeline(
                body,
                grid=(8,),
                in_specs=[spec],
                out_specs=[spec],
                core_axis_name="core",
                dimension_semantics=(pltpu.PARALLEL,),
            )(x_hbm, o_hbm)

        return pl.kernel(double, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), mesh=mesh)

    close(way.with_params(num_cores=2).jit(build(*way.modules()))(x), 2.0 * x, 0)


# ---------------------------------------------------------------------------
# The same kernels under JAX's emit_pipeline.


@pytest.mark.parametrize("shape,block", [((512, 256), (128, 128)), ((600, 384), (64, 128))])
def test_add_matches_jax(shape, block):
    x, y = rand(20, shape), rand(21, shape)
    ours = jax.jit(build_add(*OURS, block=block, interpret=pltpu.InterpretParams()))(x, y)
    theirs = run_jax(build_add, x, y, block=block)
    close(ours, theirs, 0)


def test_matmul_matches_jax():
    x, y = rand(22, (256, 256)), rand(23, (256, 256))
    ours = jax.jit(build_matmul_scratch(*OURS, bm=128, bn=128, bk=128, interpret=pltpu.InterpretParams()))(
        x, y
    )
    theirs = run_jax(build_matmul_scratch, x, y, bm=128, bn=128, bk=128)
    close(ours, theirs, 1e-5)


def test_revisit_matches_jax():
    x = rand(24, (16, 128))
    ours = jax.jit(build_revisit(*OURS, interpret=pltpu.InterpretParams()))(x)
    close(ours, run_jax(build_revisit, x), 1e-6)


# ---------------------------------------------------------------------------
# Errors name the argument.


def _trace(kernel, n_in=1, shape=(64, 256)):
    x = rand(30, shape)
    return hbm_call(pl, kernel, jax.ShapeDtypeStruct(shape, x.dtype), n_in, pltpu.InterpretParams())(
        *[x] * n_in
    )


def _copy_body(x_ref, o_ref):
    o_ref[...] = x_ref[...]


SPEC = pl.BlockSpec((8, 128), lambda i, j: (i, j))


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda x, o: pltpu.emit_pipeline(_copy_body, grid=(0, 2), in_specs=[SPEC], out_specs=[SPEC])(
                x, o
            ),
            r"grid entries must be strictly positive",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(_copy_body, grid=(2.0,), in_specs=[SPEC], out_specs=[SPEC])(
                x, o
            ),
            r"grid entries must be ints",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(
                _copy_body, grid=(8, 2), in_specs=[SPEC, SPEC], out_specs=[SPEC]
            )(x, o),
            r"got 2 Refs but in_specs has 2 and out_specs has 1",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(_copy_body, grid=(8, 2), in_specs=[SPEC], out_specs=[SPEC])(
                x[...], o
            ),
            r"in_specs\[0\] must be a Ref",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(
                _copy_body,
                grid=(8, 2),
                in_specs=[pl.BlockSpec((8, 128, 1), lambda i, j: (i, j, 0))],
                out_specs=[SPEC],
            )(x, o),
            r"in_specs\[0\]: block_shape \(8, 128, 1\) has 3 dimensions",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(
                _copy_body, grid=(8, 2), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))], out_specs=[SPEC]
            )(x, o),
            r"in_specs\[0\]\.index_map",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(
                _copy_body,
                grid=(8, 2),
                in_specs=[SPEC],
                out_specs=[pl.BlockSpec((8, 96), lambda i, j: (i, j))],
            )(x, o),
            r"out_specs\[0\]: block size 96 does not divide dimension 1 .* multiple of the memory tiling .*\(128\)",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(
                _copy_body,
                grid=(8, 2),
                in_specs=[SPEC],
                out_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j), pipeline_mode=pl.Buffered(3))],
            )(x, o),
            r"outputs take at most 2 buffers",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(
                _copy_body, grid=(8, 2), in_specs=[SPEC], out_specs=[SPEC], dimension_semantics=("parallel",)
            )(x, o),
            r"dimension_semantics has 1 entries but grid=\(8, 2\) has 2 axes",
        ),
        (
            lambda x, o: pltpu.emit_pipeline(
                _copy_body,
                grid=(8, 2),
                in_specs=[SPEC],
                out_specs=[SPEC],
                should_accumulate_out=[True, False],
            )(x, o),
            r"should_accumulate_out has 2 entries but out_specs has 1",
        ),
    ],
)
def test_errors(make, match):
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
        _trace(make)


def test_error_semaphore_operand():
    def kernel(x_hbm, o_hbm):
        def go(sem):
            pltpu.emit_pipeline(_copy_body, grid=(8, 2), in_specs=[SPEC], out_specs=[SPEC])(sem, o_hbm)

        pl.run_scoped(go, pltpu.SemaphoreType.DMA((64, 256)))

    with pytest.raises(TypeError, match=re.escape("in_specs[0] is a semaphore")):
        _trace(kernel)


def build_vmem_view(pl, pltpu, *, interpret):
    def kernel(x_ref, o_ref):
        def body(xb, ob):
            ob[...] = xb[...] + 1.0

        spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
        pltpu.emit_pipeline(body, grid=(2, 2), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    return lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret
    )(x)


@every_way(tpu=True)
def test_vmem_operand_is_a_view(way):
    """A Ref already in VMEM with a VMEM spec is not copied: the body gets a view (as in JAX)."""
    x = rand(31, (16, 256))
    close(run(way, build_vmem_view, x), x + 1.0, 0)


def build_loop_around_pipeline(pl, pltpu, *, interpret):
    def kernel(x_hbm, o_hbm):
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))

        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        pipeline, make_allocations = pltpu.emit_pipeline_with_allocations(
            body, grid=(4,), in_specs=[spec], out_specs=[spec]
        )

        def run(allocs):
            pipeline(x_hbm, o_hbm, allocations=allocs)
            lax.fori_loop(0, 3, lambda _, c: (pipeline(o_hbm, o_hbm, allocations=allocs), c)[1], 0)

        pl.run_scoped(run, make_allocations(x_hbm, o_hbm))

    return lambda x: hbm_call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1, interpret)(x)


@every_way(tpu=True)
def test_lax_loop_around_pipeline(way):
    """A pipeline inside a fori_loop (its buffers allocated once outside)."""
    x = rand(32, (32, 128))
    close(run(way, build_loop_around_pipeline, x), x + 4.0, 1e-6)
