"""TPU kernels run every TPU way (tests/ways, ``every_way(tpu=True)``): our TPU
interpret mode, our Mosaic lowering executed by ``run_mosaic``, JAX's Mosaic lowering
of the same kernel body executed by ``run_mosaic``, and our lowering compiled by libtpu;
each against plain jnp on fresh random data."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ways import every_way
from ways.jax_mosaic import load_example


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


@every_way(tpu=True)
def test_add_blocks(way):
    x, y = rand(0, (256, 512)), rand(1, (256, 512))
    pl, _ = way.modules()

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...] * 2.0

    spec = pl.BlockSpec((128, 128), lambda i, j: (i, j))
    out = way.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2, 4),
        in_specs=[spec, spec],
        out_specs=spec,
    )(x, y)
    close(out, x + y * 2.0)


@every_way(tpu=True)
def test_softmax_rows(way):
    x = rand(2, (64, 256))
    pl, _ = way.modules()

    def kernel(x_ref, o_ref):
        v = x_ref[...]
        e = jnp.exp(v - jnp.max(v, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    spec = pl.BlockSpec((8, 256), lambda i: (i, 0))
    out = way.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(8,),
        in_specs=[spec],
        out_specs=spec,
    )(x)
    close(out, jax.nn.softmax(x, axis=1))


@every_way(tpu=True)
def test_fori_loop_with_dynamic_slices(way):
    x = rand(3, (64, 128))
    pl, _ = way.modules()

    def kernel(x_ref, o_ref):
        def body(i, acc):
            return acc + x_ref[pl.ds(i * 8, 8), :] * (i + 1).astype(jnp.float32)

        o_ref[...] = lax.fori_loop(0, 8, body, jnp.zeros((8, 128), jnp.float32))

    out = way.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(x)
    want = sum(x[i * 8 : i * 8 + 8] * (i + 1) for i in range(8))
    close(out, want, 1e-4)


@every_way(tpu=True)
def test_manual_dma_double_buffer(way):
    x = rand(4, (8 * 8, 128))
    pl, pltpu = way.modules()

    def kernel(x_hbm, o_ref, buf, sems):
        def copy(i, slot):
            return pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], buf.at[slot], sems.at[slot])

        copy(0, 0).start()

        def body(i, acc):
            slot = i % 2

            @pl.when(i + 1 < 8)
            def _():
                copy(i + 1, 1 - slot).start()

            copy(i, slot).wait()
            return acc + buf[slot]

        o_ref[...] = lax.fori_loop(0, 8, body, jnp.zeros((8, 128), jnp.float32))

    out = way.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
    )(x)
    close(out, x.reshape(8, 8, 128).sum(0), 1e-5)


@every_way(tpu=True)
def test_scalar_prefetch_gather_blocks(way):
    idx = jnp.array([2, 0, 3, 1], jnp.int32)
    x = rand(5, (4, 8, 128))
    pl, pltpu = way.modules()

    def kernel(idx_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + idx_ref[pl.program_id(0)].astype(jnp.float32)

    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(4,),
        in_specs=[pl.BlockSpec((None, 8, 128), lambda i, idx: (idx[i], 0, 0))],
        out_specs=pl.BlockSpec((None, 8, 128), lambda i, idx: (i, 0, 0)),
    )
    out = way.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=gs)(idx, x)
    close(out, x[idx] * 2.0 + idx[:, None, None].astype(jnp.float32))


# -- the TPU examples ----------------------------------------------------------


def _example(name, way):
    """``examples/<name>.py``, its Pallas imports JAX's where the way traces with JAX's."""
    return load_example(name, "jax" if way.jax_lowering else "ours")


@every_way(tpu=True)
def test_example_tpu_matmul(way):
    ex = _example("tpu_matmul", way)
    x, y = rand(6, (256, 384)), rand(7, (384, 256))
    f = functools.partial(ex.matmul, bm=128, bn=128, bk=128, call_kwargs=way.call_kwargs())
    mx, my = way.mxu_operand(x), way.mxu_operand(y)
    close(way.jit(f)(x, y), jnp.dot(mx, my, precision="highest"), 1e-3)


@pytest.mark.parametrize("causal", [False, True])
@every_way(tpu=True)
def test_example_tpu_flash_attention(way, causal):
    ex = _example("tpu_flash_attention", way)
    q, k, v = (rand(8 + i, (1, 2, 256, 128)) for i in range(3))
    f = functools.partial(
        ex.flash_attention, block_q=128, block_k=128, causal=causal, call_kwargs=way.call_kwargs()
    )
    out = way.jit(f)(q, k, v)
    close(out, ex.attention_reference(q, k, v, causal=causal), way.dot_tol(2e-4))


@every_way(tpu=True)
def test_example_tpu_ring_allgather(way):
    """Remote DMAs and barrier semaphores over 4 devices."""
    ex = _example("tpu_ring_allgather", way)
    x = rand(11, (4 * 8, 128))
    f = functools.partial(ex.allgather, interpret=way.call_kwargs().get("interpret", False))
    out = way.run_sharded(f, x, 4)
    close(out.reshape(4, 4 * 8, 128), jnp.broadcast_to(x, (4, *x.shape)), 0)


@every_way(only=("tpu_interpret", "jax_mosaic"))
def test_multi_device_deadlock_is_an_error(way):
    """Each device waits for three signals on its barrier semaphore but gets two:
    a deadlock on a TPU, an error naming the wait here (never a hang)."""
    x = rand(12, (4 * 8, 128))
    pl, pltpu = way.modules()

    def kernel(x_ref, o_ref):
        me = lax.axis_index("x")
        barrier = pltpu.get_barrier_semaphore()
        for nb in (lax.rem(me + 1, 4), lax.rem(me + 3, 4)):
            pl.semaphore_signal(barrier, 1, device_id=(nb,), device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(barrier, 3)
        o_ref[...] = x_ref[...]

    f = way.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        compiler_params=pltpu.CompilerParams(collective_id=0),
    )
    with pytest.raises(Exception, match="deadlock"):
        jax.block_until_ready(way.run_sharded(f, x, 4))


# -- kernels that exercise the lowering and the executor op by op -------------


@every_way(tpu=True)
def test_matmul_with_vmem_accumulator_and_revisits(way):
    x, y = rand(20, (256, 384)), rand(21, (384, 256))
    pl, pltpu = way.modules()

    def kernel(x_ref, y_ref, o_ref, acc):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        acc[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc[...]

    out = way.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32),
        grid=(2, 2, 3),
        in_specs=[
            pl.BlockSpec((128, 128), lambda i, j, k: (i, k)),
            pl.BlockSpec((128, 128), lambda i, j, k: (k, j)),
        ],
        out_specs=pl.BlockSpec((128, 128), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((128, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, y)
    mx, my = way.mxu_operand(x), way.mxu_operand(y)
    close(out, jnp.dot(mx, my, precision="highest"), 1e-3)


def _elementwise(a, b, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.where(a > b, a * b - 3, jnp.maximum(a, b) // 7) ^ (a & 12)
    return jnp.where(a > b, jnp.exp(a) * b, jnp.maximum(a, b) - jnp.tanh(b)) / (1.0 + jnp.abs(a))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@every_way(tpu=True)
def test_elementwise_compare_select_cast(way, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        x, y = (jax.random.randint(jax.random.key(s), (32, 256), -100, 100, dtype) for s in (22, 23))
    else:
        x, y = rand(22, (32, 256), dtype), rand(23, (32, 256), dtype)
    pl, _ = way.modules()

    def kernel(x_ref, y_ref, o_ref, p_ref):
        a, b = x_ref[...], y_ref[...]
        o_ref[...] = _elementwise(a, b, dtype)
        p_ref[...] = (a.astype(jnp.float32) * 2.5).astype(jnp.int32)

    spec = pl.BlockSpec((16, 128), lambda i, j: (i, j))  # the bf16 tile is (16, 128)
    outs = (jax.ShapeDtypeStruct(x.shape, dtype), jax.ShapeDtypeStruct(x.shape, jnp.int32))
    got, conv = way.pallas_call(
        kernel, out_shape=outs, grid=(2, 2), in_specs=[spec, spec], out_specs=(spec, spec)
    )(x, y)
    assert np.asarray(got).dtype == jnp.dtype(dtype)
    # exp and tanh on the chip: a few hundred ulp from the host's (way.chip_tol)
    close(got, _elementwise(x, y, dtype), 2e-2 if dtype == jnp.bfloat16 else way.chip_tol(1e-5, 1e-4))
    close(conv, (x.astype(jnp.float32) * 2.5).astype(jnp.int32), 0)


@every_way(tpu=True)
def test_reductions_iota_broadcast_transpose(way):
    x = rand(24, (8, 256))

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
    s, m, t = way.pallas_call(kernel, out_shape=outs)(x)
    col = jnp.arange(256)[None]
    close(s, jnp.broadcast_to(jnp.sum(x * (col % 3 == 0), axis=1, keepdims=True), (8, 128)), 1e-4)
    close(m, jnp.broadcast_to(jnp.max(x, axis=0, keepdims=True), (8, 256)))
    close(t, x[:, :128].T)


@every_way(tpu=True)
def test_while_loop_carrying_vectors(way):
    x = rand(25, (64, 128))
    pl, _ = way.modules()

    def kernel(x_ref, o_ref):
        def wbody(c):
            return c[0] + 1, c[1] * 0.5 + x_ref[pl.ds(c[0] * 8, 8), :]

        _, w = lax.while_loop(lambda c: c[0] < 5, wbody, (0, x_ref[pl.ds(56, 8), :]))
        o_ref[...] = w

    out = way.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(x)
    acc = x[56:]
    for i in range(5):
        acc = acc * 0.5 + x[i * 8 : i * 8 + 8]
    close(out, acc, 1e-5)


@every_way(tpu=True)
def test_scalar_prefetch_and_smem_operand(way):
    idx = jnp.array([3, 0, 2, 1], jnp.int32)
    x = rand(26, (4, 8, 128))
    s = jnp.array([2.5], jnp.float32)
    pl, pltpu = way.modules()

    def kernel(idx_ref, x_ref, s_ref, o_ref):
        o_ref[...] = x_ref[...] * s_ref[0] + idx_ref[pl.program_id(0)].astype(jnp.float32)

    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(4,),
        in_specs=[
            pl.BlockSpec((None, 8, 128), lambda i, idx: (idx[i], 0, 0)),
            pl.BlockSpec(memory_space=pltpu.SMEM),
        ],
        out_specs=pl.BlockSpec((None, 8, 128), lambda i, idx: (i, 0, 0)),
    )
    out = way.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=gs)(idx, x, s)
    close(out, x[idx] * 2.5 + idx[:, None, None].astype(jnp.float32))


@every_way(tpu=True)
def test_run_scoped_roll_and_partial_blocks(way):
    x = rand(27, (20, 256))
    pl, pltpu = way.modules()

    def kernel(x_ref, o_ref):
        def scoped(tmp):
            tmp[...] = pltpu.roll(x_ref[...], 3, 1)
            o_ref[...] = tmp[...] + 1.0

        pl.run_scoped(scoped, pltpu.VMEM((8, 128), jnp.float32))

    spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    out = way.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(3, 2),
        in_specs=[spec],
        out_specs=spec,
    )(x)
    blocks = jnp.pad(x, ((0, 4), (0, 0))).reshape(3, 8, 2, 128)
    want = (jnp.roll(blocks, 3, axis=3) + 1.0).reshape(24, 256)[:20]
    close(out, want)


@pytest.mark.parametrize("name", ["tpu_matmul", "tpu_flash_attention", "tpu_ring_allgather"])
def test_example_export_round_trip(name):
    """Each TPU example, with our lowering, exported for TPU on this CPU:
    serialized, deserialized, its tpu_custom_call present, and the module in
    the deserialized artifact computes the right numbers under run_mosaic."""
    from jax import export
    from jax.sharding import PartitionSpec as P
    from ways.mosaic import TPU_V5E

    import pallas_tpu as pltpu
    from pallas_tpu._src.executor import run as executor

    ex = load_example(name, "ours")
    n_dev = 1
    if name == "tpu_matmul":
        args = (rand(30, (256, 256)), rand(31, (256, 256)))
        f = functools.partial(ex.matmul, bm=128, bn=128, bk=128, call_kwargs={})
        want = jnp.dot(*args, precision="highest")
        mesh = TPU_V5E
    elif name == "tpu_flash_attention":
        args = tuple(rand(32 + i, (1, 2, 256, 128)) for i in range(3))
        f = functools.partial(ex.flash_attention, block_q=128, block_k=128, causal=True, call_kwargs={})
        want = ex.attention_reference(*args, causal=True)
        mesh = TPU_V5E
    else:
        n_dev = 4
        args = (rand(35, (4 * 8, 128)),)
        mesh = jax.sharding.AbstractMesh(
            (4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=TPU_V5E.abstract_device
        )
        f = jax.shard_map(
            functools.partial(ex.allgather, interpret=False),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
            check_vma=False,
        )
        want = jnp.broadcast_to(args[0], (4, *args[0].shape))
    with jax.sharding.use_abstract_mesh(mesh):
        blob = export.export(jax.jit(f), platforms=["tpu"])(*args).serialize()
    again = export.deserialize(blob)
    assert again.platforms == ("tpu",)
    text = again.mlir_module()
    assert "tpu_custom_call" in text
    (body,) = executor.custom_call_bodies(text)
    if name == "tpu_matmul":
        out = pltpu.run_mosaic(body, *args, out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32))
        close(out, want, 1e-3)
    elif name == "tpu_flash_attention":
        b, h, s, d = args[0].shape
        flat = [a.reshape(b * h, s, d) for a in args]
        out = pltpu.run_mosaic(body, *flat, out_shape=jax.ShapeDtypeStruct((b * h, s, d), jnp.float32))
        close(np.asarray(out).reshape(b, h, s, d), want, 2e-4)
    else:
        x = args[0].reshape(4, 8, 128)
        out = pltpu.run_mosaic(
            body, x, out_shape=jax.ShapeDtypeStruct((4, 8, 128), jnp.float32), num_devices=n_dev
        )
        close(np.asarray(out).reshape(4, 32, 128), want, 0)


@every_way(only=("tpu_interpret", "mosaic"))
def test_broadcast_to(way):
    """``pl.broadcast_to`` (numpy broadcasting of a value). JAX's Mosaic
    lowering refuses it ("a Triton-specific primitive"); ours lowers it."""
    x = rand(40, (8, 1))
    pl, _ = way.modules()

    def kernel(x_ref, o_ref):
        o_ref[...] = pl.broadcast_to(x_ref[...], (8, 128)) * 3.0

    out = way.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(x)
    close(out, jnp.broadcast_to(x, (8, 128)) * 3.0)
