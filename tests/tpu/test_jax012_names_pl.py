"""JAX 0.12's newest ``pl`` names on TPU kernels:
``pl.enable_poison_buffers`` (every TPU way of tests/ways, and pallas-core's
``interpret=True``), ``pl.get_global`` (refused everywhere, as JAX refuses it
outside Mosaic GPU), ``pl.Indirect`` (refused by ``pallas_call`` and
``emit_pipeline``: JAX reads it in SparseCore pipelines only) and ``pl.semaphore``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.jax_mosaic
import ways.mosaic
from ways import Way, every_way

import pallas as pl
import pallas_tpu as pltpu

jpl, jtpu = ways.jax_mosaic.jax_namespaces()


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture
def poison():
    """Poisoning on, ours and (where JAX has it) JAX's switch, for the jax way."""
    has_jax_flag = hasattr(jax.config, "jax_pallas_poison_buffers")
    if has_jax_flag:
        jax.config.update("jax_pallas_poison_buffers", True)
    with pl.enable_poison_buffers():
        yield
    if has_jax_flag:
        jax.config.update("jax_pallas_poison_buffers", False)


POISON = {
    np.dtype(np.float32): np.float32(np.nan),
    np.dtype(np.int32): np.int32(-(2**31)),
    np.dtype(np.uint32): np.uint32(2**31),
}


def _poison_build(dtype):
    def build(pl, pltpu):
        def kernel(x_ref, seen_ref, o_ref):
            def body(scratch):
                seen_ref[...] = scratch[...]  # read before any write: the poison
                scratch[...] = x_ref[...]
                o_ref[...] = scratch[...] + x_ref[...]

            pl.run_scoped(body, pltpu.VMEM((8, 128), dtype))

        shape = jax.ShapeDtypeStruct((8, 128), dtype)
        return lambda x: pl.pallas_call(kernel, out_shape=(shape, shape))(x)

    return build


@every_way(
    tpu=True,
    skip={}
    if hasattr(jax.config, "jax_pallas_poison_buffers")
    else {
        "jax_mosaic": f"JAX's Mosaic lowering: JAX {jax.__version__} has no jax_pallas_poison_buffers (JAX 0.12)"
    },
)
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint32])
def test_poisoned_run_scoped_buffer(way, dtype, rng, poison):
    x = jnp.asarray(rng.integers(-1000, 1000, (8, 128)), dtype)
    seen, out = way.jit(_poison_build(dtype)(*way.modules()))(x)
    np.testing.assert_array_equal(out, np.asarray(x) * 2)
    np.testing.assert_array_equal(seen, np.full((8, 128), POISON[np.dtype(dtype)]))


def test_poison_in_smem_scalars_every_element(poison):
    def kernel(x_ref, o_ref):
        def body(s):
            o_ref[0] = s[1, 2]
            o_ref[1] = s[0, 0] + x_ref[0]

        pl.run_scoped(body, pltpu.SMEM((2, 3), jnp.int32))

    def build(pl, pltpu):
        return lambda x: pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((2,), jnp.int32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
        )(x)

    x = jnp.asarray([5], jnp.int32)
    for way in (Way("tpu_interpret"), Way("mosaic")):
        np.testing.assert_array_equal(way.jit(build(*way.modules()))(x), [-(2**31), -(2**31) + 5])


def _core_interpret():
    def kernel(x_ref, seen_ref, o_ref):
        def body(scratch, flags):
            seen_ref[...] = scratch[...]
            o_ref[...] = jnp.where(flags[...], x_ref[...], -x_ref[...])

        pl.run_scoped(body, pl.ANY((8, 128), jnp.float32), pl.ANY((8, 128), jnp.bool_))

    shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    return lambda x: pl.pallas_call(kernel, out_shape=(shape, shape), interpret=True)(x)


def test_poison_in_core_interpret_mode(rng):
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    with pl.enable_poison_buffers():
        seen, out = jax.jit(_core_interpret())(x)
    assert np.isnan(np.asarray(seen)).all()
    np.testing.assert_array_equal(out, x)  # the bool flags read as poison: True
    _, out = jax.jit(_core_interpret())(x)
    np.testing.assert_array_equal(out, -x)  # off: uninitialized bools read False


def test_enable_poison_buffers_errors_and_scope():
    with pytest.raises(TypeError, match=r"pl.enable_poison_buffers: enabled must be a bool, got 'yes'"):
        pl.enable_poison_buffers("yes")
    from pallas import backend as plb

    assert not plb.poison_buffers_enabled()
    with pl.enable_poison_buffers():
        assert plb.poison_buffers_enabled()
        with pl.enable_poison_buffers(False):
            assert not plb.poison_buffers_enabled()
        assert plb.poison_buffers_enabled()
    assert not plb.poison_buffers_enabled()
    assert np.isnan(plb.poison_value(jnp.bfloat16))
    assert plb.poison_value(jnp.int8) == -128 and plb.poison_value(jnp.uint8) == 128
    assert plb.poison_value(jnp.int4) == -8


# ------------------------------------------------------------------------- get_global


def _global_kernel(x_ref, o_ref):
    sem = pl.get_global(pltpu.SemaphoreType.REGULAR)
    pl.semaphore_signal(sem)
    pl.semaphore_wait(sem)
    o_ref[...] = x_ref[...]


@pytest.mark.parametrize("interpret", [pltpu.InterpretParams(), True, False])
def test_get_global_refused_where_the_kernel_calls_it(interpret):
    x = jnp.zeros((8, 128), jnp.float32)
    call = pl.pallas_call(
        _global_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret
    )
    with pytest.raises(
        NotImplementedError,
        match=r"_global_kernel.*test_jax012_names_pl.py:\d+.*pl.get_global\(SemaphoreType.REGULAR\) is not supported: "
        r"JAX lowers it only for Mosaic GPU",
    ):
        if interpret is False:
            ways.mosaic.tpu_modules(call, x)
        else:
            call(x)


def test_get_global_checks_what():
    with pytest.raises(TypeError, match=r"pl.get_global: what must be a Ref type"):
        pl.get_global((8, 128))


# ------------------------------------------------------------------- Indirect, semaphore


def test_indirect_is_a_block_dim_that_pallas_call_refuses():
    assert pl.Indirect(8).block_size == 8 and repr(pl.Indirect(8)) == "Indirect(8)"
    assert pl.Indirect(8) == pl.Indirect(8) and hash(pl.Indirect(8)) == hash(pl.Indirect(8))
    x = jnp.zeros((16, 128), jnp.float32)
    with pytest.raises(TypeError, match=r"block_shape.*got Indirect\(8\)"):
        pl.pallas_call(
            lambda x_ref, o_ref: None,
            grid=(2,),
            in_specs=[pl.BlockSpec((pl.Indirect(8), 128), lambda i: (i, 0))],
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=True,
        )(x)


def test_indirect_refused_by_emit_pipeline():
    def kernel(x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        pltpu.emit_pipeline(
            body,
            grid=(2,),
            in_specs=[pl.BlockSpec((pl.Indirect(8), 128), lambda i: (i, 0))],
            out_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        )(x_hbm, o_hbm)

    x = jnp.zeros((16, 128), jnp.float32)
    with pytest.raises(ValueError, match=r"unsupported block dimension Indirect\(8\)"):
        pl.pallas_call(
            kernel,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=pltpu.InterpretParams(),
        )(x)


def test_semaphore_dtype_name():
    assert isinstance(pl.semaphore, type) and pl.semaphore.__name__ == "semaphore"
    assert pl.semaphore is not pltpu.dma_semaphore
