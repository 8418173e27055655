"""Reads through ``pl.ds(start, n, 0)`` (stride 0: the element at ``start``, ``n`` times),
as tokamax's quantized matmuls read a scale row (``scale[:, pl.ds(0, n, 0), :]``): the
four TPU ways of tests/ways (JAX's own Mosaic lowering, run by ``run_mosaic``, is
the JAX reference: JAX's interpret modes cannot discharge a zero stride), pallas-core's
interpret mode and pallas-gpu's (Triton's interpreter), each against ``jnp.broadcast_to``
of the row on fresh random data. A write through a zero stride is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import every_way

import pallas as pl

jax.config.update("jax_enable_checks", True)


def rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def scale_rows(pl, pltpu, x, s, *, interpret):
    """The tokamax pattern: a (G, 1, N) scale's row read 8 times, times a (G, 8, N) block."""

    def kernel(x_ref, s_ref, o_ref):
        o_ref[...] = x_ref[...] * s_ref[:, pl.ds(0, 8, 0), :]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, s)


@every_way(tpu=True, dma=True)
def test_scale_row_broadcast(way):
    x, s = rand(0, (2, 8, 128)), rand(1, (2, 1, 128))
    np.testing.assert_allclose(way.call(scale_rows, x, s), x * s, rtol=1e-6, atol=1e-6)


def row_at_step(pl, pltpu, x, *, interpret):
    """A dynamic start (the grid index) and the read inside a loop body."""

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)

        def body(j, acc):
            return acc + x_ref[pl.ds(i + j, 8, 0), :]

        o_ref[...] = jax.lax.fori_loop(0, 2, body, jnp.zeros((8, 128), jnp.float32))

    return pl.pallas_call(
        kernel,
        grid=(3,),
        in_specs=[pl.BlockSpec((16, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((24, 128), jnp.float32),
        interpret=interpret,
    )(x)


@every_way(tpu=True, dma=True)
def test_dynamic_start_in_a_loop(way):
    x = rand(2, (16, 128))
    want = jnp.concatenate([jnp.broadcast_to(x[i] + x[i + 1], (8, 128)) for i in range(3)])
    np.testing.assert_allclose(way.call(row_at_step, x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["core_interpret", "gpu_interpret"])
def test_other_interpreters(mode):
    """pallas-core's interpret mode and pallas-gpu's (Triton's interpreter on the CPU)."""
    if mode == "core_interpret":
        kw = {"interpret": True}
    else:
        plgpu = pytest.importorskip("pallas_gpu")
        kw = {"interpret": plgpu.InterpretParams()}
    x, s = rand(3, (4, 16, 32)), rand(4, (4, 3, 32))

    def kernel(x_ref, s_ref, o_ref):
        o_ref[...] = x_ref[...] + s_ref[:, pl.ds(2, 16, 0), :]

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **kw)
    np.testing.assert_allclose(f(x, s), x + s[:, 2:3, :], rtol=1e-6, atol=1e-6)


def test_write_through_a_zero_stride_is_refused():
    def kernel(x_ref, o_ref):
        o_ref[pl.ds(0, 8, 0), :] = x_ref[...]

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)
    with pytest.raises(
        NotImplementedError, match=r"pallas_call 'kernel'.* at test_zero_stride.py:\d+: a write "
    ):
        f(rand(5, (8, 128)))


def test_negative_stride_is_refused():
    with pytest.raises(ValueError, match="stride must be an int >= 0, got -1"):
        pl.ds(0, 8, -1)
