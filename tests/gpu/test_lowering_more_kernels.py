"""Kernels JAX's Pallas runs on the GPU that the Triton backend used to
refuse: integer-array (gather/scatter) Ref indexing, dots with a
``lax.DotAlgorithmPreset``, 4-bit integer casts, ``lax.scan`` over arrays, and
``vmap`` of a kernel with ``input_output_aliases``. Each runs under Triton's
interpreter against jnp and compiles for sm_80/sm_90 (``Runner``); the
``gpu``-marked tests run on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gpu_test_base import Runner, assert_close, fresh_key, gpu, random
from jax import lax

import pallas as pl
import pallas_gpu as plgpu

R = Runner()

# ---------------------------------------------------------------------------
# Integer-array indexing of Refs


def _gather_call(call=R.call):
    def kernel(x_ref, i_ref, o_ref, s_ref):
        idx = i_ref[...]
        o_ref[...] = x_ref[idx, :] * 2  # gather rows
        s_ref[...] = jnp.zeros_like(s_ref)
        s_ref[:, idx] = x_ref[pl.ds(0, 8), pl.ds(0, 16)]  # scatter columns

    return call(
        kernel,
        (jax.ShapeDtypeStruct((16, 24), jnp.float32), jax.ShapeDtypeStruct((8, 40), jnp.float32)),
    )


def _clipped(idx, n):
    idx = np.where(idx < 0, idx + n, idx)
    return np.clip(idx, 0, n - 1)


@pytest.mark.parametrize("in_range", [True, False])
def test_gather_and_scatter_with_integer_array_index(in_range):
    x = random((32, 24), jnp.float32)
    if in_range:
        idx = jax.random.permutation(fresh_key(), 32)[:16].astype(jnp.int32)
    else:
        idx = jax.random.randint(fresh_key(), (16,), -40, 70, jnp.int32)
    g, s = _gather_call()(x, idx)
    rows = _clipped(np.asarray(idx), 32)
    assert_close(g, np.asarray(x)[rows] * 2)
    if in_range:  # (out-of-range scatters collide: their order is not defined)
        ref = np.zeros((8, 40), np.float32)
        ref[:, _clipped(np.asarray(idx), 40)] = np.asarray(x)[:8, :16]
        assert_close(s, ref)


def test_gather_errors_name_the_kernel_and_line():
    # (Index arrays of any rank are supported: tests/gpu/test_gather_nd.py.)
    x = random((32, 24), jnp.float32)

    def twice(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref.at[i_ref[...], :][pl.ds(0, 2), :]

    f = R.call(twice, jax.ShapeDtypeStruct((2, 24), jnp.float32))
    with pytest.raises(NotImplementedError, match=r"kernel 'twice' at .*: .*index once"):
        f(x, jnp.zeros((8,), jnp.int32))


def test_jvp_of_a_strided_read():
    x, t = random((32, 16), jnp.float32), random((32, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.sin(x_ref[pl.ds(1, 16, stride=2), :])

    f = R.call(kernel, jax.ShapeDtypeStruct((16, 16), jnp.float32))
    out, tan = jax.jvp(f, (x,), (t,))
    assert_close(out, jnp.sin(x[1::2]))
    assert_close(tan, jnp.cos(x[1::2]) * t[1::2], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# plgpu.load/store: JAX's signatures, and masks past the end of the Ref


@pytest.mark.parametrize("interpret", ["triton", "pallas"])
def test_plgpu_masked_access_past_the_end(interpret):
    """The Triton idiom: pl.ds(i * 32, 32) runs past the end, the mask keeps
    the access inside; pallas-core's interpret mode must not clamp the window."""
    x = random((100,), jnp.float32)

    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        offs = i * 32 + jnp.arange(32)
        v = plgpu.load(x_ref.at[pl.ds(i * 32, 32)], mask=offs < 100, other=-1.0)
        plgpu.store(o_ref.at[pl.ds(i * 32, 32)], v * 2, mask=offs < 100)  # JAX's (ref, val) form
        plgpu.atomic_add(o_ref, pl.ds(i * 32, 32), jnp.ones((32,)), mask=offs < 100)

    call = R.call if interpret == "triton" else functools.partial(pl.pallas_call, interpret=True)
    out = call(kernel, jax.ShapeDtypeStruct((100,), jnp.float32), grid=(4,))(x)
    assert_close(out, x * 2 + 1)


def test_plgpu_store_bad_arguments():
    def kernel(o_ref):
        plgpu.store(o_ref, None, jnp.zeros((8,)), jnp.zeros((8,)))

    f = R.call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32))
    with pytest.raises(
        TypeError, match=r"kernel 'kernel' at .*plgpu.store takes \(ref, val\) or \(ref, idx, val\)"
    ):
        f()


# ---------------------------------------------------------------------------
# Dot algorithm presets


def _rounded(x, dtype):
    return np.asarray(x).astype(dtype).astype(np.float64)


@pytest.mark.parametrize(
    "preset,tol",
    [("F16_F16_F32", None), ("BF16_BF16_F32", None), ("BF16_BF16_F32_X3", 2e-3), ("BF16_BF16_F32_X6", 2e-5),
     ("TF32_TF32_F32", 5e-2), ("TF32_TF32_F32_X3", 2e-4)],
)  # fmt: skip
def test_dot_algorithm_presets(preset, tol):
    a, b = random((32, 64), jnp.float32), random((64, 32), jnp.float32)
    algorithm = getattr(lax.DotAlgorithmPreset, preset)

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], precision=algorithm, preferred_element_type=jnp.float32)

    out = np.asarray(R.call(kernel, jax.ShapeDtypeStruct((32, 32), jnp.float32))(a, b))
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    if tol is None:  # one product of 16-bit operands, accumulated in f32
        t = np.float16 if preset.startswith("F16") else ml_dtypes.bfloat16
        assert_close(out, _rounded(a, t) @ _rounded(b, t), rtol=1e-5, atol=1e-4)
        assert np.abs(out - exact).max() > 1e-4  # the operands were rounded
    else:
        assert np.abs(out - exact).max() < tol * np.abs(exact).max()


def test_unsupported_dot_preset_error_lists_the_supported_ones():
    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], precision=lax.DotAlgorithmPreset.F16_F16_F16)

    a = random((32, 32), jnp.float32)
    f = R.call(kernel, jax.ShapeDtypeStruct((32, 32), jnp.float32))
    with pytest.raises(
        NotImplementedError, match=r"kernel 'kernel' at .*F16_F16_F16 is not supported.*BF16_BF16_F32"
    ):
        f(a, a)


# ---------------------------------------------------------------------------
# 4-bit integers (in registers; Triton has no 4-bit memory type)


@pytest.mark.parametrize("int4", [jnp.int4, jnp.uint4])
def test_int4_casts(int4):
    i = random((8, 32), jnp.int32, low=-3, high=3)  # -30..30: wraps
    f = random((8, 32), jnp.float32, low=-20, high=20)
    f = f.at[0, :4].set(jnp.array([np.nan, np.inf, -np.inf, 7.9]))

    def kernel(i_ref, f_ref, a_ref, b_ref, c_ref):
        a_ref[...] = i_ref[...].astype(int4).astype(jnp.int32)
        b_ref[...] = f_ref[...].astype(int4).astype(jnp.float32)
        c_ref[...] = jnp.where(i_ref[...] > 0, i_ref[...].astype(int4), f_ref[...].astype(int4)).astype(
            jnp.int8
        )

    a, b, c = R.call(
        kernel,
        (
            jax.ShapeDtypeStruct(i.shape, jnp.int32),
            jax.ShapeDtypeStruct(i.shape, jnp.float32),
            jax.ShapeDtypeStruct(i.shape, jnp.int8),
        ),
    )(i, f)
    assert_close(a, i.astype(int4).astype(jnp.int32))
    assert_close(b, f.astype(int4).astype(jnp.float32))
    assert_close(c, jnp.where(i > 0, i.astype(int4), f.astype(int4)).astype(jnp.int8))


@pytest.mark.parametrize("int4", [jnp.int4, jnp.uint4])
@pytest.mark.parametrize("shape,block", [((16, 32), (8, 16)), ((13, 37), (8, 16)), ((7, 5), (7, 5))])
def test_int4_operands_are_read_packed(int4, shape, block):
    x = random(shape, jnp.int32, low=-1, high=2).astype(int4)  # -10..19: wraps into 4 bits
    grid = tuple(pl.cdiv(s, b) for s, b in zip(shape, block))

    def kernel(x_ref, o_ref, r_ref):
        o_ref[...] = x_ref[...].astype(jnp.float32) * 2
        r_ref[...] = x_ref[pl.ds(1, 3), :].astype(jnp.int32)

    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    o, r = R.call(
        kernel,
        (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct((grid[0] * 3, shape[1]), jnp.int32)),
        grid=grid,
        in_specs=[spec],
        out_specs=(spec, pl.BlockSpec((3, block[1]), lambda i, j: (i, j))),
    )(x)
    assert_close(o, x.astype(jnp.float32) * 2)
    rows = np.concatenate([np.arange(1, 4) + i * block[0] for i in range(grid[0])])
    valid = rows < shape[0]
    assert_close(np.asarray(r)[valid], np.asarray(x.astype(jnp.int32))[rows[valid]])


@pytest.mark.parametrize("int4", [jnp.int4, jnp.uint4])
def test_int4_plgpu_load_with_mask_and_other(int4):
    # tokamax's int4-quantized attention reads K/V through plgpu.load (was refused on the GPU).
    x = random((16, 40), jnp.int32, low=-1, high=2).astype(int4)

    def kernel(x_ref, o_ref, p_ref):
        o_ref[...] = plgpu.load(x_ref.at[pl.ds(4, 8), :]).astype(jnp.float32) * 0.5
        cols = jnp.arange(40)[None, :]
        p_ref[...] = plgpu.load(x_ref, mask=cols < 23, other=3).astype(jnp.int32)

    o, p = R.call(
        kernel, (jax.ShapeDtypeStruct((8, 40), jnp.float32), jax.ShapeDtypeStruct((16, 40), jnp.int32))
    )(x)
    xi = np.asarray(x.astype(jnp.int32))
    assert_close(o, xi[4:12].astype(np.float32) * 0.5)
    np.testing.assert_array_equal(p, np.where(np.arange(40)[None, :] < 23, xi, 3))


def test_int4_output_error_names_the_operand():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jnp.int4)

    f = R.call(kernel, jax.ShapeDtypeStruct((8, 8), jnp.int4))
    with pytest.raises(
        NotImplementedError, match=r"out_specs\[0\] of pallas_call 'kernel' at .*: outputs of dtype int4"
    ):
        f(jnp.zeros((8, 8), jnp.int32))


def test_int4_arithmetic_error_says_to_cast():
    def kernel(x_ref, o_ref):
        v = x_ref[...].astype(jnp.int4)
        o_ref[...] = (v + v).astype(jnp.int32)

    f = R.call(kernel, jax.ShapeDtypeStruct((8, 8), jnp.int32))
    with pytest.raises(NotImplementedError, match=r"primitive 'add'.*cast them to int8"):
        f(jnp.zeros((8, 8), jnp.int32))


# ---------------------------------------------------------------------------
# lax.scan over arrays


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_with_xs_and_ys(reverse):
    x = random((12, 32), jnp.float32)
    w = random((12,), jnp.int32)

    def step(c, xs):
        row, k = xs
        c = c * 0.5 + row * k.astype(jnp.float32)
        return c, (c.sum(), c > 0)

    def fn(x, w):
        return lax.scan(step, jnp.zeros((32,), jnp.float32), (x, w), reverse=reverse)

    def kernel(x_ref, w_ref, c_ref, s_ref, p_ref):
        c, (s, p) = fn(x_ref[...], w_ref[...])
        c_ref[...], s_ref[...], p_ref[...] = c, s, p

    c, s, p = R.call(
        kernel,
        (
            jax.ShapeDtypeStruct((32,), jnp.float32),
            jax.ShapeDtypeStruct((12,), jnp.float32),
            jax.ShapeDtypeStruct((12, 32), jnp.bool_),
        ),
    )(x, w)
    c_ref, (s_ref, p_ref) = fn(x, w)
    assert_close(c, c_ref, rtol=1e-5, atol=1e-4)
    assert_close(s, s_ref, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(p, p_ref)


# ---------------------------------------------------------------------------
# vmap of a kernel with input_output_aliases


def test_vmap_of_aliased_kernel():
    x, y = random((3, 40), jnp.float32), random((3, 40), jnp.float32)

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * 2 + y_ref[...]

    f = R.call(
        kernel,
        jax.ShapeDtypeStruct((40,), jnp.float32),
        grid=(5,),
        in_specs=[pl.BlockSpec((8,), lambda i: (i,))] * 2,
        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
        input_output_aliases={0: 0},
    )
    assert_close(jax.vmap(f)(x, y), x * 2 + y)


# ---------------------------------------------------------------------------
# JAX's pl.broadcast_to (a state primitive; pallas-core does not export it yet)


@pytest.mark.parametrize("shape", [(24,), (1, 24), (5, 1)])
def test_state_broadcast_to(shape):
    from jax.experimental import pallas as jpl

    x = random(shape, jnp.float32)
    out_shape = (5, 24)

    def kernel(x_ref, o_ref):
        o_ref[...] = jpl.broadcast_to(x_ref[...], out_shape) * 2

    out = R.call(kernel, jax.ShapeDtypeStruct(out_shape, jnp.float32))(x)
    assert_close(out, jnp.broadcast_to(x, out_shape) * 2)


# ---------------------------------------------------------------------------
# Kernels that close over constants (pallas-core hoists arrays to inputs)


def test_kernel_closing_over_array_constants():
    x = random((8, 32), jnp.float32)
    row, table = np.asarray(random((32,), jnp.float32)), random((8, 32), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * row + table

    out = R.call(kernel, jax.ShapeDtypeStruct(x.shape, jnp.float32))(x)
    assert_close(out, x * row + table)


def test_kernel_closing_over_scalar_constants():
    x = random((8, 32), jnp.float32)
    scale, shift, n = (
        jnp.float32(np.asarray(random((), jnp.float32))),
        np.float32(0.25),
        jnp.array(3, jnp.int32),
    )

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * scale + shift + n

    out = jax.jit(R.call(kernel, jax.ShapeDtypeStruct(x.shape, jnp.float32)))(x)
    assert_close(out, x * scale + shift + n)


# ---------------------------------------------------------------------------
# On the GPU


@gpu
def test_more_kernels_on_gpu():
    x = random((32, 24), jnp.float32)
    idx = jax.random.randint(fresh_key(), (16,), 0, 32, jnp.int32)
    g, _ = jax.jit(_gather_call(call=pl.pallas_call))(x, idx)
    assert_close(g, x[idx] * 2)

    a, b = random((64, 64), jnp.float32), random((64, 64), jnp.float32)

    def dot_kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(
            a_ref[...],
            b_ref[...],
            precision=lax.DotAlgorithmPreset.BF16_BF16_F32,
            preferred_element_type=jnp.float32,
        )

    out = pl.pallas_call(dot_kernel, jax.ShapeDtypeStruct((64, 64), jnp.float32))(a, b)
    ref = _rounded(a, ml_dtypes.bfloat16) @ _rounded(b, ml_dtypes.bfloat16)
    assert_close(out, ref, rtol=1e-4, atol=1e-3)

    xs = random((12, 32), jnp.float32)

    def scan_kernel(x_ref, o_ref):
        o_ref[...] = lax.scan(lambda c, r: (c + r, c * r), jnp.zeros((32,)), x_ref[...])[1]

    out = pl.pallas_call(scan_kernel, jax.ShapeDtypeStruct((12, 32), jnp.float32))(xs)
    assert_close(out, lax.scan(lambda c, r: (c + r, c * r), jnp.zeros((32,)), xs)[1], rtol=1e-5, atol=1e-4)

    i = random((8, 32), jnp.int32)

    def int4_kernel(i_ref, p_ref, o_ref, q_ref):
        o_ref[...] = i_ref[...].astype(jnp.int4).astype(jnp.int32)
        q_ref[...] = p_ref[...].astype(jnp.int32)

    packed = random((13, 37), jnp.int32).astype(jnp.int4)  # read from XLA's packed layout
    out, q = pl.pallas_call(
        int4_kernel, (jax.ShapeDtypeStruct(i.shape, jnp.int32), jax.ShapeDtypeStruct(packed.shape, jnp.int32))
    )(i, packed)
    assert_close(out, i.astype(jnp.int4).astype(jnp.int32))
    assert_close(q, packed.astype(jnp.int32))

    a, b = random((3, 40), jnp.float32), random((3, 40), jnp.float32)

    def alias_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * 2 + y_ref[...]

    f = pl.pallas_call(
        alias_kernel,
        jax.ShapeDtypeStruct((40,), jnp.float32),
        grid=(5,),
        in_specs=[pl.BlockSpec((8,), lambda i: (i,))] * 2,
        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
        input_output_aliases={0: 0},
    )
    assert_close(jax.jit(jax.vmap(f))(a, b), a * 2 + b)
