"""``pltpu.run_mosaic`` executes the Mosaic modules that JAX's own Pallas TPU
lowering emits (exported for TPU on this CPU), against plain jnp on fresh
random data: a check that the executor follows Mosaic, not our lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

import pallas_tpu as pltpu
from pallas_tpu._src import executor

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


def test_matmul_with_vmem_accumulator_and_revisits():
    x, y = rand(0, (256, 384)), rand(1, (384, 256))

    def kernel(x_ref, y_ref, o_ref, acc):
        @jpl.when(jpl.program_id(2) == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        acc[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @jpl.when(jpl.program_id(2) == jpl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc[...]

    out = run_jax_kernel(
        kernel,
        (x, y),
        jax.ShapeDtypeStruct((256, 256), jnp.float32),
        grid=(2, 2, 3),
        in_specs=[
            jpl.BlockSpec((128, 128), lambda i, j, k: (i, k)),
            jpl.BlockSpec((128, 128), lambda i, j, k: (k, j)),
        ],
        out_specs=jpl.BlockSpec((128, 128), lambda i, j, k: (i, j)),
        scratch_shapes=[jtpu.VMEM((128, 128), jnp.float32)],
        compiler_params=jtpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )
    close(out, jnp.dot(x, y, precision="highest"), 1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_elementwise_compare_select_cast(dtype):
    x, y = rand(2, (16, 256), dtype), rand(3, (16, 256), dtype)

    def kernel(x_ref, y_ref, o_ref, p_ref):
        a, b = x_ref[...], y_ref[...]
        if jnp.issubdtype(dtype, jnp.integer):
            r = jnp.where(a > b, a * b - 3, jnp.maximum(a, b) // 7) ^ (a & 12)
        else:
            r = jnp.where(a > b, jnp.exp(a) * b, jnp.maximum(a, b) - jnp.tanh(b)) / (1.0 + jnp.abs(a))
        o_ref[...] = r
        p_ref[...] = (a.astype(jnp.float32) * 2.5).astype(jnp.int32)

    outs = (jax.ShapeDtypeStruct(x.shape, dtype), jax.ShapeDtypeStruct(x.shape, jnp.int32))
    spec = jpl.BlockSpec((8, 128), lambda i, j: (i, j))
    got = run_jax_kernel(kernel, (x, y), outs, grid=(2, 2), in_specs=[spec, spec], out_specs=(spec, spec))
    a, b = x, y
    if jnp.issubdtype(dtype, jnp.integer):
        want = jnp.where(a > b, a * b - 3, jnp.maximum(a, b) // 7) ^ (a & 12)
    else:
        want = jnp.where(a > b, jnp.exp(a) * b, jnp.maximum(a, b) - jnp.tanh(b)) / (1.0 + jnp.abs(a))
    close(got[0], want, 2e-2 if dtype == jnp.bfloat16 else 1e-5)
    close(got[1], (a.astype(jnp.float32) * 2.5).astype(jnp.int32), 0)


def test_reductions_iota_broadcast_transpose():
    x = rand(4, (8, 256))

    def kernel(x_ref, s_ref, m_ref, t_ref):
        v = x_ref[...]
        col = lax.broadcasted_iota(jnp.int32, v.shape, 1)
        s_ref[...] = jnp.broadcast_to(jnp.sum(v * (col % 3 == 0), axis=1, keepdims=True), (8, 128))
        m_ref[...] = jnp.broadcast_to(jnp.max(v, axis=0, keepdims=True), (8, 256))
        t_ref[...] = v[:, :128].T

    outs = (
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        jax.ShapeDtypeStruct((8, 256), jnp.float32),
        jax.ShapeDtypeStruct((128, 8), jnp.float32),
    )
    s, m, t = run_jax_kernel(kernel, (x,), outs)
    col = jnp.arange(256)[None]
    close(s, jnp.broadcast_to(jnp.sum(x * (col % 3 == 0), axis=1, keepdims=True), (8, 128)), 1e-4)
    close(m, jnp.broadcast_to(jnp.max(x, axis=0, keepdims=True), (8, 256)))
    close(t, x[:, :128].T)


def test_fori_loop_while_and_dynamic_slices():
    x = rand(5, (64, 128))

    def kernel(x_ref, o_ref):
        def body(i, acc):
            return acc + x_ref[jpl.ds(i * 8, 8), :]

        acc = lax.fori_loop(0, 8, body, jnp.zeros((8, 128), jnp.float32))

        def cond(c):
            return c[0] < 5

        def wbody(c):
            return c[0] + 1, c[1] * 0.5 + x_ref[jpl.ds(c[0] * 8, 8), :]

        _, w = lax.while_loop(cond, wbody, (0, acc))
        o_ref[...] = w

    out = run_jax_kernel(kernel, (x,), jax.ShapeDtypeStruct((8, 128), jnp.float32))
    acc = x.reshape(8, 8, 128).sum(0)
    for i in range(5):
        acc = acc * 0.5 + x[i * 8 : i * 8 + 8]
    close(out, acc, 1e-5)


def test_scalar_prefetch_and_smem():
    idx = jnp.array([3, 0, 2, 1], jnp.int32)
    x = rand(6, (4, 8, 128))

    def kernel(idx_ref, x_ref, s_ref, o_ref):
        i = jpl.program_id(0)
        o_ref[...] = x_ref[...] * s_ref[0] + idx_ref[i].astype(jnp.float32)

    s = jnp.array([2.5], jnp.float32)
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    gs = jtpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(4,),
        in_specs=[
            jpl.BlockSpec((None, 8, 128), lambda i, idx: (idx[i], 0, 0)),
            jpl.BlockSpec(memory_space=jtpu.SMEM),
        ],
        out_specs=jpl.BlockSpec((None, 8, 128), lambda i, idx: (i, 0, 0)),
    )
    out = run_jax_kernel(kernel, (idx, x, s), out_shape, grid_spec=gs)
    close(out, x[idx] * 2.5 + idx[:, None, None].astype(jnp.float32))


def test_manual_double_buffered_dma():
    x = rand(7, (8 * 8, 128))

    def kernel(x_hbm, o_ref, buf, sems):
        def copy(i, slot):
            return jtpu.make_async_copy(x_hbm.at[jpl.ds(i * 8, 8)], buf.at[slot], sems.at[slot])

        copy(0, 0).start()

        def body(i, acc):
            slot = i % 2

            @jpl.when(i + 1 < 8)
            def _():
                copy(i + 1, 1 - slot).start()

            copy(i, slot).wait()
            return acc + buf[slot]

        o_ref[...] = lax.fori_loop(0, 8, body, jnp.zeros((8, 128), jnp.float32))

    out = run_jax_kernel(
        kernel,
        (x,),
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[jpl.BlockSpec(memory_space=jpl.ANY)],
        scratch_shapes=[jtpu.VMEM((2, 8, 128), jnp.float32), jtpu.SemaphoreType.DMA((2,))],
    )
    close(out, x.reshape(8, 8, 128).sum(0), 1e-5)


def test_run_scoped_roll_and_partial_blocks():
    x = rand(8, (20, 256))

    def kernel(x_ref, o_ref):
        def scoped(tmp):
            tmp[...] = jtpu.roll(x_ref[...], 3, 1)
            o_ref[...] = tmp[...] + 1.0

        jpl.run_scoped(scoped, jtpu.VMEM((8, 128), jnp.float32))

    spec = jpl.BlockSpec((8, 128), lambda i, j: (i, j))
    out = run_jax_kernel(
        kernel, (x,), jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(3, 2), in_specs=[spec], out_specs=spec
    )
    blocks = jnp.pad(x, ((0, 4), (0, 0))).reshape(3, 8, 2, 128)
    want = (jnp.roll(blocks, 3, axis=3) + 1.0).reshape(24, 256)[:20]
    close(out, want)


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
