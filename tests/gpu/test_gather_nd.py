"""Ref indexing with integer arrays of any rank: a 2-d gather
``plgpu.load(x_ref.at[rows[:, None], cols[None, :]])`` as JAX's Triton backend
allows, index arrays that broadcast together (NumPy's advanced indexing: two
1-d arrays pair up), a 2-d index array beside a slice, integer indices that
are not adjacent (their axes come first), scatters through ``plgpu.store`` and
``ref[...] =``. Each runs under Triton's interpreter and compiles for
sm_80/sm_90 (``Runner``), against NumPy indexing of the same data; the ``gpu``
tests run the kernels compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import Runner, assert_close, fresh_key, gpu, random

import pallas as pl
import pallas_gpu as plgpu


def _perm(n, k):
    return jax.random.permutation(fresh_key(), n)[:k].astype(jnp.int32)


def _ints(shape, lo, hi):
    return jax.random.randint(fresh_key(), shape, lo, hi, jnp.int32)


def _clipped(idx, n):
    idx = np.where(idx < 0, idx + n, idx)
    return np.clip(idx, 0, n - 1)


def _outer_gather(call):
    def kernel(x_ref, r_ref, c_ref, o_ref):
        rows, cols = r_ref[...], c_ref[...]
        o_ref[...] = plgpu.load(x_ref.at[rows[:, None], cols[None, :]]) * 2

    def f(x, rows, cols):
        out = jax.ShapeDtypeStruct((rows.shape[0], cols.shape[0]), x.dtype)
        return call(kernel, out)(x, rows, cols)

    return f


@pytest.mark.parametrize("nr,nc", [(16, 8), (5, 12), (1, 7)])
def test_outer_gather_with_plgpu_load(nr, nc):
    x = random((40, 24), jnp.float32)
    rows, cols = _ints((nr,), 0, 40), _ints((nc,), 0, 24)
    out = _outer_gather(Runner().call)(x, rows, cols)
    assert out.shape == (nr, nc)
    assert_close(out, np.asarray(x)[np.asarray(rows)[:, None], np.asarray(cols)[None, :]] * 2)


def test_outer_gather_masks_indices_outside_the_array():
    # plgpu.load masks (as Triton code does): elements outside read as `other`.
    x = random((16, 8), jnp.float32)
    rows, cols = _ints((8,), -4, 20), _ints((4,), 0, 12)

    def kernel(x_ref, r_ref, c_ref, o_ref):
        o_ref[...] = plgpu.load(x_ref.at[r_ref[...][:, None], c_ref[...][None, :]], other=-1.0)

    out = Runner().call(kernel, jax.ShapeDtypeStruct((8, 4), jnp.float32))(x, rows, cols)
    r, c = np.asarray(rows)[:, None], np.asarray(cols)[None, :]
    inside = (r >= 0) & (r < 16) & (c >= 0) & (c < 8)
    want = np.where(inside, np.asarray(x)[np.clip(r, 0, 15), np.clip(c, 0, 7)], -1.0)
    assert_close(out, want)


def test_paired_1d_indices_gather_pointwise():
    x = random((32, 24), jnp.float32)
    rows, cols = _ints((12,), 0, 32), _ints((12,), 0, 24)

    def kernel(x_ref, r_ref, c_ref, o_ref):
        o_ref[...] = x_ref[r_ref[...], c_ref[...]] + 1

    out = Runner().call(kernel, jax.ShapeDtypeStruct((12,), jnp.float32))(x, rows, cols)
    assert_close(out, np.asarray(x)[np.asarray(rows), np.asarray(cols)] + 1)


@pytest.mark.parametrize("in_range", [True, False])
def test_2d_index_array_beside_a_slice(in_range):
    # Ref indexing clamps as interpret mode does: indices wrap once, then clamp.
    x = random((32, 24), jnp.float32)
    idx = _ints((3, 6), 0, 32) if in_range else _ints((3, 6), -40, 70)

    def kernel(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref[i_ref[...], pl.ds(4, 16)]

    out = Runner().call(kernel, jax.ShapeDtypeStruct((3, 6, 16), jnp.float32))(x, idx)
    assert_close(out, np.asarray(x)[_clipped(np.asarray(idx), 32), 4:20])


def test_integer_indices_not_adjacent_lead_the_result():
    x = random((8, 12, 6), jnp.float32)
    idx = _ints((5,), 0, 8)

    def kernel(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref[i_ref[...], :, 3]  # ints at dims 0 and 2: NumPy puts (5,) first

    out = Runner().call(kernel, jax.ShapeDtypeStruct((5, 12), jnp.float32))(x, idx)
    assert_close(out, np.asarray(x)[np.asarray(idx), :, 3])

    def middle(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref[:, 2, i_ref[...]]  # adjacent: (5,) stands at dim 1

    idx = _ints((5,), 0, 6)
    out = Runner().call(middle, jax.ShapeDtypeStruct((8, 5), jnp.float32))(x, idx)
    assert_close(out, np.asarray(x)[:, 2, np.asarray(idx)])


def _outer_scatter(call):
    def kernel(v_ref, r_ref, c_ref, o_ref, p_ref):
        rows, cols = r_ref[...], c_ref[...]
        o_ref[...] = jnp.zeros_like(o_ref)
        plgpu.store(o_ref.at[rows[:, None], cols[None, :]], v_ref[...])
        p_ref[...] = jnp.zeros_like(p_ref)
        p_ref[rows[:, None], cols[None, :]] = v_ref[...] * 3

    return lambda v, rows, cols: call(
        kernel, (jax.ShapeDtypeStruct((24, 16), jnp.float32), jax.ShapeDtypeStruct((24, 16), jnp.float32))
    )(v, rows, cols)


def test_outer_scatter_with_plgpu_store_and_ref_assignment():
    v = random((6, 5), jnp.float32)
    rows, cols = _perm(24, 6), _perm(16, 5)  # distinct: no two writes collide
    o, p = _outer_scatter(Runner().call)(v, rows, cols)
    want = np.zeros((24, 16), np.float32)
    want[np.asarray(rows)[:, None], np.asarray(cols)[None, :]] = np.asarray(v)
    assert_close(o, want)
    assert_close(p, want * 3)


def test_indexing_after_a_gather_is_refused_clearly():
    x, idx = random((32, 24), jnp.float32), jnp.zeros((4, 4), jnp.int32)

    def twice(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref.at[i_ref[...], :][pl.ds(0, 2), :]

    f = Runner().call(twice, jax.ShapeDtypeStruct((2, 4, 24), jnp.float32))
    with pytest.raises(NotImplementedError, match=r"kernel 'twice' at .*test_gather_nd.py.*index once"):
        f(x, idx)


@gpu
def test_nd_gathers_and_scatters_on_the_gpu():
    x = random((40, 24), jnp.float32)
    rows, cols = _ints((5,), 0, 40), _ints((12,), 0, 24)
    out = jax.jit(_outer_gather(pl.pallas_call))(x, rows, cols)
    assert_close(out, x[rows[:, None], cols[None, :]] * 2)

    v = random((6, 5), jnp.float32)
    rows, cols = _perm(24, 6), _perm(16, 5)
    o, p = jax.jit(_outer_scatter(pl.pallas_call))(v, rows, cols)
    want = jnp.zeros((24, 16), jnp.float32).at[rows[:, None], cols[None, :]].set(v)
    assert_close(o, want)
    assert_close(p, want * 3)

    idx = _ints((3, 6), -40, 70)

    def kernel(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref[i_ref[...], pl.ds(4, 16)]

    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((3, 6, 16), jnp.float32))(x, idx)
    assert_close(out, np.asarray(x)[_clipped(np.asarray(idx), 40), 4:20])
