"""``pltpu.run_mosaic`` itself: its errors, and the module forms it takes.
Kernels run through it (our lowering and JAX's) in ``test_three_way.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_tpu as pltpu
from pallas_tpu._src.executor import run as executor

jpl = pytest.importorskip("jax.experimental.pallas")
jtpu = pytest.importorskip("jax.experimental.pallas.tpu")

jax.config.update("jax_enable_checks", True)


def rand(seed, shape, dtype=jnp.float32):
    k = jax.random.key(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(k, shape, -100, 100, dtype)
    return jax.random.normal(k, shape, jnp.float32).astype(dtype)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


# JAX's lowering asks the device for its TPU generation for some ops: name one.
_TPU_V5E = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
)


def jax_modules(f, *args):
    """The serialized Mosaic modules of JAX's lowering of ``f(*args)`` for TPU."""
    with jax.sharding.use_abstract_mesh(_TPU_V5E):
        txt = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    return executor.custom_call_bodies(txt)


def run_jax_kernel(kernel, args, out_shape, **call_kw):
    """JAX's pallas_call of ``kernel`` lowered for TPU, run by run_mosaic."""
    f = functools.partial(jpl.pallas_call, kernel, out_shape=out_shape, **call_kw)
    (body,) = jax_modules(lambda *a: f()(*a), *args)
    return pltpu.run_mosaic(body, *args, out_shape=out_shape)


def test_errors_name_the_op():
    x = rand(9, (64, 128))

    def kernel(x_hbm, o_ref, buf, sem):
        jtpu.make_async_copy(x_hbm.at[jpl.ds(0, 8)], buf, sem).start()
        o_ref[...] = buf[...]  # never waited: the kernel ends with the semaphore nonzero

    call = dict(
        in_specs=[jpl.BlockSpec(memory_space=jpl.ANY)],
        scratch_shapes=[jtpu.VMEM((8, 128), jnp.float32), jtpu.SemaphoreType.DMA(())],
    )
    with pytest.raises(pltpu.MosaicError, match="not waited for"):
        run_jax_kernel(kernel, (x,), jax.ShapeDtypeStruct((8, 128), jnp.float32), **call)

    def oob(x_ref, o_ref):
        o_ref[...] = x_ref[jpl.ds(jpl.program_id(0) * 8 + 60, 8), :]

    with pytest.raises(pltpu.MosaicError, match=r"out of bounds.*vector\.load|vector\.load.*out of bounds"):
        run_jax_kernel(oob, (x,), jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(1,))

    with pytest.raises(ValueError, match="expects 0 scalar-prefetch \\+ 1 operands; got 2"):
        (body,) = jax_modules(
            lambda a: jpl.pallas_call(
                lambda x_ref, o_ref: None, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32)
            )(a),
            x[:8],
        )
        pltpu.run_mosaic(body, x, x, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))


def test_module_as_text_and_bytecode():
    """The same module given as MLIR text (as debug=True prints it) runs the same."""
    x = rand(10, (16, 128))

    def f(a):
        return jpl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., jnp.sin(x_ref[...]) * 2.0),
            out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
            grid=(2,),
            in_specs=[jpl.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=jpl.BlockSpec((8, 128), lambda i: (i, 0)),
        )(a)

    (body,) = jax_modules(f, x)
    text = str(executor.parse_module(body))
    assert "func.func @" in text and "window_params" in text
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    close(pltpu.run_mosaic(text, x, out_shape=out_shape), jnp.sin(x) * 2.0)
    close(pltpu.run_mosaic(body, x, out_shape=out_shape), jnp.sin(x) * 2.0)


def _hbm_rows_kernel(start, rows):
    """A kernel copying rows ``[start, start + rows)`` of an HBM operand to its
    output by a DMA (the start is dynamic, so JAX does not check it)."""

    def kernel(x_hbm, o_ref, sem):
        begin = jpl.program_id(0) * 0 + start
        copy = jtpu.make_async_copy(x_hbm.at[jpl.ds(begin, rows)], o_ref, sem)
        copy.start()
        copy.wait()

    return kernel


_HBM_CALL = dict(
    grid=(1,),
    in_specs=[jpl.BlockSpec(memory_space=jpl.ANY)],
    out_specs=jpl.BlockSpec(memory_space=jtpu.VMEM),
    scratch_shapes=[jtpu.SemaphoreType.DMA(())],
)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_hbm_tile_padding_reads_are_poisoned(dtype):
    """An HBM array of 100 rows is stored as 104 (whole (8, 128) tiles), as Mosaic lays it
    out: a slice may reach into the 4 padding rows, which hold no plausible values (NaN, the
    most negative integer), so a kernel that lets them into its output shows it."""
    x = rand(11, (100, 128), dtype)
    out = run_jax_kernel(_hbm_rows_kernel(96, 8), (x,), jax.ShapeDtypeStruct((8, 128), dtype), **_HBM_CALL)
    close(out[:4], x[96:])
    pad = np.asarray(out[4:]).astype(np.float64)
    assert np.all(np.isnan(pad)) if dtype != jnp.int32 else np.all(pad == np.iinfo(np.int32).min)


def test_hbm_slice_beyond_tile_padding_is_an_error():
    x = rand(12, (100, 128))
    with pytest.raises(
        pltpu.MosaicError,
        match=r"'tpu\.memref_slice' at .*slice at \[96, 0\] of shape \[16, 128\] is out of bounds of a memref "
        r"of shape \[100, 128\] in memory space any \(stored padded to \[104, 128\]",
    ):
        run_jax_kernel(
            _hbm_rows_kernel(96, 16), (x,), jax.ShapeDtypeStruct((16, 128), jnp.float32), **_HBM_CALL
        )


def test_dynamic_grid_sizes_come_first():
    """A grid with a traced size: its size is the first operand (as the custom call's)."""
    x = rand(13, (32, 128))

    def f(n, a):
        spec = jpl.BlockSpec((8, 128), lambda i: (i, 0))
        return jpl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + jpl.num_programs(0).astype(jnp.float32)),
            out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
            grid=(n,),
            in_specs=[spec],
            out_specs=spec,
            input_output_aliases={0: 0},
        )(a)

    (body,) = jax_modules(f, jnp.int32(3), x)
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out = pltpu.run_mosaic(body, np.int32(3), x, out_shape=out_shape, input_output_aliases={0: 0})
    close(out, x.at[:24].add(3.0))
    with pytest.raises(ValueError, match=r"expects 1 grid-size \+ 0 scalar-prefetch \+ 1 operands; got 1"):
        pltpu.run_mosaic(body, x, out_shape=out_shape, input_output_aliases={0: 0})


def _two_core_module(body, x):
    """Our lowering of ``body`` over the two TensorCores of a chip (a
    semaphore scratch operand), as the Mosaic ways export it."""
    import ways.mosaic

    import pallas as pl

    f = pl.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        mesh=pltpu.TensorCoreMesh(axis_name="core", num_cores=2),
        scratch_types=[pltpu.SemaphoreType.REGULAR],
    )
    (module,) = ways.mosaic.tpu_modules(f, x, num_cores=2)
    return module


def test_two_cores_signal_to_a_core_that_does_not_exist():
    from jax import lax

    import pallas as pl

    x = rand(20, (16, 128))

    def body(x_hbm, o_hbm, sem):
        @pl.when(lax.axis_index("core") == 1)
        def _():
            pl.semaphore_signal(sem, 1, core_index=2)

    module = _two_core_module(body, x)
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with pytest.raises(pltpu.MosaicError, match=r"'tpu\.sem_signal' at .*: core_id 2 is outside the 2 cores"):
        pltpu.run_mosaic(module, x, out_shape=out_shape, num_cores=2)
    with pytest.raises(pltpu.MosaicError, match=r"core_id 2 is outside the 1 core of a device"):
        pltpu.run_mosaic(module, x, out_shape=out_shape)
    with pytest.raises(ValueError, match="num_cores must be a positive int"):
        pltpu.run_mosaic(module, x, out_shape=out_shape, num_cores=0)


def test_two_cores_wait_that_no_core_signals_is_a_deadlock_naming_the_core():
    from jax import lax

    import pallas as pl

    x = rand(21, (16, 128))

    def body(x_hbm, o_hbm, sem):
        @pl.when(lax.axis_index("core") == 0)
        def _():
            pl.semaphore_wait(sem, 1)

    module = _two_core_module(body, x)
    with pytest.raises(
        pltpu.MosaicError, match=r"deadlock: core 0 waits at 'tpu\.sem_wait'.*core 1 finished"
    ):
        pltpu.run_mosaic(module, x, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), num_cores=2)


def test_two_cores_share_hbm_and_split_a_core_parallel_grid():
    """Each core runs its half of a core_parallel grid axis; both write the one
    HBM output (what a signal of one core makes visible to the other)."""
    from jax import lax

    import pallas as pl

    x = rand(22, (16, 128))

    def body(x_hbm, o_hbm, sem):
        c = lax.axis_index("core")
        pltpu.sync_copy(x_hbm.at[pl.ds(c * 8, 8)], o_hbm.at[pl.ds((1 - c) * 8, 8)])

    module = _two_core_module(body, x)
    out = pltpu.run_mosaic(module, x, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), num_cores=2)
    close(out, jnp.concatenate([x[8:], x[:8]]))


def test_errors_name_the_users_line_of_our_module():
    # Every op of our Mosaic module carries the location of the kernel line that made it,
    # so run_mosaic's errors (and libtpu's, tests/tpu/test_compile_check.py) name it.
    import inspect

    import ways.mosaic

    import pallas as pl

    def oob(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(pl.program_id(0) * 8 + 60, 8), :]  # reads rows 60..67 of 64

    line = inspect.getsourcelines(oob)[1] + 1
    f = lambda x: pl.pallas_call(oob, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(1,))(x)
    with pytest.raises(
        pltpu.MosaicError, match=rf'vector\.load.*test_run_mosaic\.py":{line}:.*out of bounds'
    ):
        ways.mosaic.run_with_mosaic(f, rand(10, (64, 128)))
