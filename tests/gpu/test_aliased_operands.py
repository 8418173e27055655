"""Chained ``pallas_call``s that accumulate through ``input_output_aliases``, fed
slices that XLA can pass as addresses (a flash-attention backward's dK came out
wrong on the H200, with one batch).

The pattern: ``acc_a, acc_b = call(x[rows], acc_a, acc_b)`` over chunks of rows,
both accumulators aliased to outputs, the first call given one zeros array for
both. With a batch of one, ``x[:, rows]`` is a contiguous, aligned slice, and XLA's
dynamic-slice fusion wrapped the kernel's custom call to pass it as an address; it
then lost the copy that one value passed as two aliased operands needs, so both
outputs shared a buffer and a chunk's contribution went missing (relative error
0.7). jax-kernel-runtime's lowering keeps aliased launches out of that fusion. Checked
against jnp on fresh random data: under Triton's interpreter anywhere, compiled on the
GPU (``gpu``) too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import fresh_key

import pallas as pl
import pallas_gpu as plgpu

CHUNK, COLS = 64, 128


def _kernel(x_ref, a_prev, b_prev, a_ref, b_ref):
    x = x_ref[...]
    a_ref[...] = a_prev[...] + x
    b_ref[...] = b_prev[...] + 2.0 * x


def accumulate(x, *, batch, distinct, interpret):
    """Sum over chunks of rows of x (batch, rows, COLS): (sum, 2 * sum), accumulated
    by one aliased pallas_call per chunk."""
    block = pl.BlockSpec((None, CHUNK, COLS), lambda b: (b, 0, 0))
    call = pl.pallas_call(
        _kernel,
        out_shape=[jax.ShapeDtypeStruct((batch, CHUNK, COLS), jnp.float32)] * 2,
        grid=(batch,),
        in_specs=[block] * 3,
        out_specs=[block] * 2,
        input_output_aliases={1: 0, 2: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="aliased_accumulate",
    )

    @jax.jit
    def run(x):
        a = jnp.zeros((batch, CHUNK, COLS), jnp.float32)
        b = x[:, :CHUNK] * 0.0 if distinct else a  # zeros XLA cannot fold into a's value
        for c in range(x.shape[1] // CHUNK):
            a, b = call(x[:, c * CHUNK : (c + 1) * CHUNK], a, b)
        return a, b

    return run(x)


def check(batch, distinct, interpret):
    x = jax.random.normal(fresh_key(), (batch, 4 * CHUNK, COLS), jnp.float32)
    a, b = accumulate(x, batch=batch, distinct=distinct, interpret=interpret)
    ref = x.reshape(batch, 4, CHUNK, COLS).sum(axis=1)
    np.testing.assert_allclose(np.asarray(a), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(b), np.asarray(2.0 * ref), rtol=1e-5, atol=1e-5)


CASES = pytest.mark.parametrize(
    "batch,distinct",
    [(1, False), (1, True), (2, False)],
    ids=["one_batch_same_zeros", "one_batch", "two_batches"],
)


@CASES
def test_aliased_accumulation_in_the_interpreter(batch, distinct):
    with jax.default_device(jax.devices("cpu")[0]):
        check(batch, distinct, plgpu.InterpretParams())


@pytest.mark.gpu
@CASES
def test_aliased_accumulation_on_the_gpu(batch, distinct):
    check(batch, distinct, False)
