"""pallas_gpu kernels under JAX transformations on a real GPU: shard_map
over every local GPU, vmap, jvp, and a jax.export round trip through a
fresh process (skipped without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import assert_close, random
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kernel_runtime as jkr
import pallas as pl

pytestmark = pytest.mark.gpu

BLOCK = 256


def sin_mul_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) * y_ref[...]


def sin_mul(x, y):
    """o = sin(x) * y on 1-d arrays, blocks of 256 (edge block masked)."""
    n = x.shape[0]
    return pl.pallas_call(
        sin_mul_kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(n, BLOCK),),
        in_specs=[pl.BlockSpec((BLOCK,), lambda i: (i,))] * 2,
        out_specs=pl.BlockSpec((BLOCK,), lambda i: (i,)),
    )(x, y)


def reference(x, y):
    return jnp.sin(x) * y


def test_shard_map_over_all_gpus():
    gpus = jax.devices("gpu")
    n = len(gpus)
    mesh = jax.make_mesh((n,), ("x",), devices=gpus)
    f = jax.jit(jax.shard_map(sin_mul, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x, y = random((n * 3000,), jnp.float32), random((n * 3000,), jnp.float32)
    sharding = NamedSharding(mesh, P("x"))
    out = f(jax.device_put(x, sharding), jax.device_put(y, sharding))
    assert_close(out, reference(x, y))
    assert len(out.addressable_shards) == n
    for shard in out.addressable_shards:
        assert_close(shard.data, reference(x, y)[shard.index])


def test_vmap_on_gpu():
    x, y = random((5, 1000), jnp.float32), random((5, 1000), jnp.float32)
    assert_close(jax.jit(jax.vmap(sin_mul))(x, y), reference(x, y))
    # Batched on the second axis of one operand only.
    yt = random((1000, 3), jnp.float32)
    out = jax.vmap(sin_mul, in_axes=(None, 1))(x[0], yt)
    assert_close(out, jax.vmap(reference, in_axes=(None, 1))(x[0], yt))


def test_jvp_on_gpu():
    x, y = random((3000,), jnp.float32), random((3000,), jnp.float32)
    tx = random((3000,), jnp.float32)
    out, tangent = jax.jit(lambda x, tx: jax.jvp(lambda x: sin_mul(x, y), (x,), (tx,)))(x, tx)
    ref, ref_tangent = jax.jvp(lambda x: reference(x, y), (x,), (tx,))
    assert_close(out, ref)
    assert_close(tangent, ref_tangent, rtol=1e-5, atol=1e-5)


def test_jvp_both_inputs_on_gpu():
    x, y = random((3000,), jnp.float32), random((3000,), jnp.float32)
    tx, ty = random((3000,), jnp.float32), random((3000,), jnp.float32)
    out, tangent = jax.jit(lambda *a: jax.jvp(sin_mul, a[:2], a[2:]))(x, y, tx, ty)
    ref, ref_tangent = jax.jvp(reference, (x, y), (tx, ty))
    assert_close(out, ref)
    assert_close(tangent, ref_tangent, rtol=1e-5, atol=1e-5)


def test_export_round_trip_in_fresh_process(tmp_path):
    x, y = random((2000,), jnp.float32), random((2000,), jnp.float32)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    exp = jax.export.export(
        jax.jit(sin_mul), platforms=["cuda"], disabled_checks=jkr.export_disabled_checks()
    )(spec, spec)
    (tmp_path / "f.bin").write_bytes(exp.serialize())
    np.save(tmp_path / "x.npy", np.asarray(x))
    np.save(tmp_path / "y.npy", np.asarray(y))
    # The fresh process imports neither pallas nor pallas_gpu: the exported
    # module holds the compiled kernel.
    script = textwrap.dedent(
        f"""
        import sys
        import jax, numpy as np, jax_kernel_runtime
        jax_kernel_runtime.register()
        exp = jax.export.deserialize(open({str(tmp_path / "f.bin")!r}, "rb").read())
        x, y = np.load({str(tmp_path / "x.npy")!r}), np.load({str(tmp_path / "y.npy")!r})
        np.save({str(tmp_path / "out.npy")!r}, np.asarray(exp.call(x, y)))
        assert "pallas_gpu" not in sys.modules
        """
    )
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    assert_close(np.load(tmp_path / "out.npy"), reference(x, y))
