"""``jax.export`` for TPU with symbolic shapes (shape polymorphism): the grid sizes that
follow the array become operands of the ``tpu_custom_call`` (dynamic grid bounds). The
exported Mosaic module runs at several sizes under ``run_mosaic`` and compiles with
libtpu for a v5e at a size chosen after export; TPU interpret mode, which needs static
shapes, says so. (pallas-core's interpret mode: ``tests/core/test_export_symbolic.py``.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.executor import run as executor
from pallas_tpu._src.mosaic import compile_check

B = 8


def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + pl.program_id(0).astype(jnp.float32) + pl.program_id(1) * 100.0


def call(x, interpret=False, floor=True):
    spec = pl.BlockSpec((B, 128), lambda i, j: (i, j))
    rows = x.shape[0] // B if floor else pl.cdiv(x.shape[0], B)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows, x.shape[1] // 128),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
    )(x)


def reference(x):
    rows = (jnp.arange(x.shape[0]) // B)[:, None]
    cols = (jnp.arange(x.shape[1]) // 128)[None, :]
    return x * 2.0 + rows + cols * 100.0


def _export(spec, floor):
    shape = jax.export.symbolic_shape(spec)
    return jax.export.export(jax.jit(lambda x: call(x, floor=floor)), platforms=["tpu"])(
        jax.ShapeDtypeStruct(shape, jnp.float32)
    )


@pytest.mark.parametrize("spec,floor", [("8*n, 128*k", True), ("n, 128*k", False)])
def test_the_exported_module_runs_at_every_size(spec, floor):
    [module] = executor.custom_call_bodies(_export(spec, floor).mlir_module())
    for seed, shape in enumerate([(16, 128), (40, 256), (8, 384)]):
        x = jax.random.normal(jax.random.key(seed), shape)
        bounds = (jnp.int32(-(-shape[0] // B)), jnp.int32(shape[1] // 128))  # the dynamic grid sizes first
        [out] = pltpu.run_mosaic(module, *bounds, x, out_shape=[jax.ShapeDtypeStruct(shape, x.dtype)])
        np.testing.assert_allclose(out, reference(x), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not compile_check.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]"')
def test_libtpu_compiles_the_export_at_a_size_chosen_later():
    exported = _export("8*n, 128", True)
    device = compile_check.tpu_devices("v5e")[0]
    arg = jax.ShapeDtypeStruct((40, 128), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    compiled = jax.jit(exported.call).lower(arg).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_tpu_interpret_mode_says_it_needs_static_shapes():
    shape = jax.export.symbolic_shape("8*n, 128")
    f = jax.jit(lambda x: call(x, interpret=pltpu.InterpretParams()))
    with pytest.raises(
        NotImplementedError, match=r"pallas_call 'kernel' at .*TPU interpret mode takes static shapes"
    ):
        jax.export.export(f, platforms=["cpu"])(jax.ShapeDtypeStruct(shape, jnp.float32))


def test_lower_as_mlir_gives_the_export_for_tpu():
    shape = jax.export.symbolic_shape("8*n, 128")
    arg = jax.ShapeDtypeStruct(shape, jnp.float32)
    text = pl.lower_as_mlir(call, arg)
    assert "jax.uses_shape_polymorphism = true" in text  # the export's module, for TPU
    [module] = executor.custom_call_bodies(text)
    x = jax.random.normal(jax.random.key(3), (24, 128))
    # Only the row count is symbolic: one dynamic grid size (128 // 128 columns is static).
    [out] = pltpu.run_mosaic(module, jnp.int32(3), x, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    np.testing.assert_allclose(out, reference(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(NotImplementedError, match="blocks of symbolic shape are not supported"):
        pl.lower_as_mlir(call, arg, dynamic_shapes=True)
