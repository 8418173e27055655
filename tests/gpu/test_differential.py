"""Differential test (hypothesis): small generated kernels run by pallas-core's
interpret mode and by pallas-gpu (Triton's interpreter here; compiled on the GPU
with ``PALLAS_GPU_TESTS=gpu``) agree with a NumPy model of Pallas' semantics.

Generated: grids of one or two axes, block shapes, input index maps in range
and out of range (``i - 1``, ``i + 1``, ``i + 100000``: the block start is
that of ``lax.dynamic_slice`` on the array, a negative start counting once
from the end, then clamped so the block lies inside the array), and kernels:
elementwise, a row reduction, and an output block revisited along the last
grid axis (initialised under ``pl.when(k == 0)``, accumulated every step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from gpu_test_base import triton_mode  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pallas as pl  # noqa: E402

KINDS = ("elementwise", "rowsum", "accumulate")
SHIFTS = (0, 0, -1, 1, 100000)


@st.composite
def cases(draw):
    return dict(
        kind=draw(st.sampled_from(KINDS)),
        bm=draw(st.sampled_from([8, 16])),
        bn=draw(st.sampled_from([16, 32])),
        ni=draw(st.integers(1, 3)),
        nj=draw(st.integers(1, 3)),
        shift=draw(st.sampled_from(SHIFTS)),
        seed=draw(st.integers(0, 2**16)),
    )


def _block_start(idx, block, n):
    """The first row/column a block index selects (model of the semantics)."""
    start = idx * block
    if start < 0:
        start += n
    return min(max(start, 0), n - block)


def model(c, x):
    bm, bn, ni, nj, shift = c["bm"], c["bn"], c["ni"], c["nj"], c["shift"]
    x = np.asarray(x, np.float64)

    def xblock(i, j):
        r = _block_start(i + shift, bm, x.shape[0])
        return x[r : r + bm, j * bn : (j + 1) * bn]

    if c["kind"] == "accumulate":
        out = np.zeros((ni * bm, bn))
        for i in range(ni):
            out[i * bm : (i + 1) * bm] = sum(xblock(i, k) for k in range(nj))
        return out
    out = np.zeros_like(x)
    for i in range(ni):
        for j in range(nj):
            b = xblock(i, j)
            if c["kind"] == "elementwise":
                b = np.exp(b * 0.5) * 2.0 - b
            else:
                b = np.broadcast_to(b.sum(axis=1, keepdims=True), b.shape)
            out[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = b
    return out


def pallas(c, x, interpret):
    bm, bn, ni, nj, shift, kind = c["bm"], c["bn"], c["ni"], c["nj"], c["shift"], c["kind"]
    in_spec = pl.BlockSpec((bm, bn), lambda i, j: (i + shift, j))
    if kind == "accumulate":

        def kernel(x_ref, o_ref):
            @pl.when(pl.program_id(1) == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            o_ref[...] += x_ref[...]

        out_spec = pl.BlockSpec((bm, bn), lambda i, k: (i, 0))
        out_shape = jax.ShapeDtypeStruct((ni * bm, bn), jnp.float32)
    else:

        def kernel(x_ref, o_ref):
            b = x_ref[...]
            if kind == "elementwise":
                o_ref[...] = jnp.exp(b * 0.5) * 2.0 - b
            else:
                o_ref[...] = jnp.broadcast_to(jnp.sum(b, axis=1, keepdims=True), b.shape)

        out_spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
        out_shape = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(ni, nj),
        in_specs=[in_spec],
        out_specs=out_spec,
        interpret=interpret,
    )(x)


@pytest.mark.parametrize("mode", ["interpret", "triton"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(c=cases())
def test_generated_kernels_agree_with_the_model(mode, c):
    x = jax.random.normal(jax.random.key(c["seed"]), (c["ni"] * c["bm"], c["nj"] * c["bn"]), jnp.float32)
    out = pallas(c, x, True if mode == "interpret" else triton_mode())
    np.testing.assert_allclose(np.asarray(out), model(c, x), rtol=1e-5, atol=1e-4, err_msg=str(c))
