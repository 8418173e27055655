"""``jax.export`` with symbolic shapes (shape polymorphism) of a ``pallas_call`` whose grid
follows the array: the exported function runs at sizes chosen after export, in
pallas-core's interpret mode, as JAX's Pallas allows. (The TPU lowering of the same
export: ``tests/tpu/test_export_symbolic_tpu.py``.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl

B = 8  # rows per block


def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + y_ref[...] + pl.program_id(0).astype(jnp.float32) / 4


def call(x, y, interpret=True, floor=False):
    spec = pl.BlockSpec((B, 128), lambda i, j: (i, j))
    # x.shape[0] // B is a symbolic dimension; pl.cdiv of one is a traced value
    rows = x.shape[0] // B if floor else pl.cdiv(x.shape[0], B)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows, x.shape[1] // 128),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=interpret,
    )(x, y)


def reference(x, y):
    return x * 2.0 + y + (jnp.arange(x.shape[0]) // B)[:, None] / 4


def _exported(spec: str, platforms=("cpu",), interpret=True, floor=False):
    rows, cols = jax.export.symbolic_shape(spec)
    arg = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    f = jax.jit(lambda x, y: call(x, y, interpret, floor))
    return jax.export.export(f, platforms=platforms)(arg, arg)


@pytest.mark.parametrize(
    "spec,floor", [("8*n, 128", True), ("8*n, 128", False), ("n, 128", False), ("n, 128*k", False)]
)
def test_one_export_runs_at_every_size(spec, floor):
    exported = jax.export.deserialize(_exported(spec, floor=floor).serialize())  # as a server loads it
    for seed, shape in enumerate([(1, 128), (5, 128), (16, 128), (43, 256), (64, 384)]):
        if "8*n" in spec and shape[0] % 8 or "k" not in spec and shape[1] != 128:
            continue
        x, y = (jax.random.normal(k, shape) for k in jax.random.split(jax.random.key(seed), 2))
        np.testing.assert_allclose(exported.call(x, y), reference(x, y), rtol=1e-6, atol=1e-6)


def test_several_platforms_with_symbolic_shapes_run_the_cpu_part():
    exported = _exported("n, 128", platforms=("cpu", "tpu"), interpret=False)
    assert exported.platforms == ("cpu", "tpu")
    x, y = (jax.random.normal(k, (43, 128)) for k in jax.random.split(jax.random.key(7), 2))
    np.testing.assert_allclose(exported.call(x, y), reference(x, y), rtol=1e-6, atol=1e-6)


def test_shapes_that_break_the_polymorphic_spec_are_refused_by_jax():
    exported = _exported("8*n, 128", floor=True)
    x = jnp.ones((12, 128))
    with pytest.raises(ValueError, match="Division had remainder 4"):
        exported.call(x, x)
