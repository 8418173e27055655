"""Casts to and from bf16 in Triton's interpreter (triton_call on the CPU) give
what the GPU and ``jnp.astype`` give: through fp32, rounded to nearest even.

Triton's interpreter keeps bf16 as its raw ``uint16`` bits, so a cast that
applies NumPy's ``astype`` to them (an int, bool or fp64 to bf16) or decodes
them by hand (bf16 subnormals) is wrong; the shared layer's patches
(``jax_kernel_runtime.triton``) route every bf16 cast through fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_triton as jt

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def cast_kernel(x_ptr, o_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(o_ptr + r, tl.load(x_ptr + r).to(o_ptr.dtype.element_ty))


@triton.jit
def via_bf16_kernel(x_ptr, o_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(o_ptr + r, tl.load(x_ptr + r).to(tl.bfloat16).to(o_ptr.dtype.element_ty))


N = 1024


def floats(rng, dtype, narrowest) -> np.ndarray:
    """Random values over the range of ``dtype`` (subnormals, overflow to
    inf in a narrower type, exact bf16 ties) and the special values, within
    the range of ``narrowest`` when that is fp16."""
    x = rng.standard_normal(N) * np.exp2(rng.integers(-140, 128, N).astype(np.float64))
    bits = rng.integers(0, 1 << 16, N // 8).astype(np.uint32) << 16 | 0x8000  # halfway between two bf16s
    with np.errstate(invalid="ignore"):  # signaling NaNs among them
        x[: N // 8] = bits.view(np.float32)
    x[N // 8 : N // 8 + 7] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]
    if jnp.float16 in (dtype, narrowest):
        x = np.clip(x, -7e4, 7e4)  # f32 -> f16 overflow is not what this file tests
    with np.errstate(over="ignore"):
        return jnp.asarray(np.asarray(x, np.float64).astype(dtype))


def ints(rng, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    lo, hi = max(int(info.min), -(1 << 24)), min(int(info.max), 1 << 24)  # exact in fp32
    return jnp.asarray(rng.integers(lo, hi, N, endpoint=True).astype(dtype))


def cast(kernel, x, dst):
    return jt.triton_call(x, kernel=kernel, out_shape=jax.ShapeDtypeStruct(x.shape, dst), grid=1, N=N)


PAIRS = [
    (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.float16),
    (jnp.float16, jnp.bfloat16),
    (jnp.float64, jnp.bfloat16),
    (jnp.bfloat16, jnp.float64),
    (jnp.int32, jnp.bfloat16),
    (jnp.int8, jnp.bfloat16),
    (jnp.uint8, jnp.bfloat16),
    (jnp.int64, jnp.bfloat16),
    (jnp.bool_, jnp.bfloat16),
    (jnp.bfloat16, jnp.int32),
    (jnp.bfloat16, jnp.int16),
    (jnp.bfloat16, jnp.uint8),
]


def data(rng, src, dst):
    if src == jnp.bool_:
        return jnp.asarray(rng.integers(0, 2, N).astype(bool))
    if jnp.issubdtype(src, jnp.integer):
        return ints(rng, src)
    x = floats(rng, src, dst)
    if jnp.issubdtype(dst, jnp.integer):  # fp -> int: in range (otherwise undefined on a GPU)
        info = jnp.iinfo(dst)  # halved: the clipped bounds are rounded to bf16
        x = jnp.where(jnp.isfinite(x), x, 0).clip(int(info.min) // 2, int(info.max) // 2).astype(src)
    return x


@pytest.mark.parametrize("src, dst", PAIRS, ids=lambda d: jnp.dtype(d).name)
def test_cast_matches_jnp(src, dst):
    wide = jnp.float64 in (src, dst) or jnp.int64 in (src, dst)
    with jax.enable_x64(wide):
        x = data(np.random.default_rng(), src, dst)
        out = cast(cast_kernel, x, dst)
        want = x.astype(dst)
        assert out.dtype == want.dtype
        np.testing.assert_array_equal(
            np.asarray(out, np.float64), np.asarray(want, np.float64), err_msg=f"{x=}"
        )


@pytest.mark.parametrize("src, dst", [(jnp.float32, jnp.float32), (jnp.float32, jnp.float16),
                                      (jnp.float16, jnp.float32), (jnp.int32, jnp.float32)],
                         ids=lambda d: jnp.dtype(d).name)  # fmt: skip
def test_cast_through_bf16_matches_jnp(src, dst):
    x = data(np.random.default_rng(), src, dst)
    out = cast(via_bf16_kernel, x, dst)
    want = x.astype(jnp.bfloat16).astype(dst)
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(want, np.float64), err_msg=f"{x=}")


# ---------------------------------------------------------------------------
# fp8: Triton's NVIDIA types (float8_e4m3fn, float8_e5m2). On the GPU Triton converts
# to them with cvt.rn.satfinite (round to nearest even, saturate to the largest finite
# value, NaN stays NaN) and from them exactly. Triton 3.6's interpreter rounded without
# carrying into the exponent (0.49 -> 0.25 in e4m3), and saturated nothing; the shared layer's patches convert through ml_dtypes instead.

FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def to_fp8_reference(x, dst):
    """The GPU's conversion, written with NumPy: saturate, then round to nearest even."""
    big = float(jnp.finfo(dst).max)
    wide = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore"):
        wide = np.where(np.isnan(wide), wide, np.clip(wide, -big, big))
    return np.asarray(jnp.asarray(wide.astype(np.float32)).astype(dst), np.float64)


def fp8_data(rng, src, dst) -> jax.Array:
    """Values around every fp8 binade (both ends of the range, subnormals, above the
    largest finite value, exact ties) and the special values."""
    big = float(jnp.finfo(dst).max)
    x = rng.uniform(-1, 1, N) * np.exp2(rng.integers(-20, 18, N).astype(np.float64))
    grid = np.asarray(jnp.arange(256, dtype=jnp.uint8).view(dst), np.float64)  # every fp8 value
    grid = grid[np.isfinite(grid)]
    ties = np.sort(np.concatenate([grid, -grid]))
    ties = ((ties[1:] + ties[:-1]) / 2)[: N // 4]
    x[: len(ties)] = ties
    x[N // 2 : N // 2 + 8] = [0.0, -0.0, np.inf, -np.inf, np.nan, big, big * 1.01, -big * 2]
    if src == jnp.float16:
        x = np.clip(x, -6e4, 6e4)
    with np.errstate(over="ignore"):
        return jnp.asarray(x.astype(src))


@pytest.mark.parametrize("src", [jnp.float32, jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dst", FP8, ids=lambda d: jnp.dtype(d).name)
def test_cast_to_fp8_rounds_to_nearest_even_and_saturates(src, dst):
    x = fp8_data(np.random.default_rng(), src, dst)
    out = cast(cast_kernel, x, dst)
    assert out.dtype == dst
    np.testing.assert_array_equal(np.asarray(out, np.float64), to_fp8_reference(x, dst), err_msg=f"{x=}")


@pytest.mark.parametrize("dst", [jnp.float32, jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("src", FP8, ids=lambda d: jnp.dtype(d).name)
def test_cast_from_fp8_is_exact(src, dst):
    x = jnp.tile(jnp.arange(256, dtype=jnp.uint8).view(src), N // 256)  # every fp8 bit pattern
    out = cast(cast_kernel, x, dst)
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(x.astype(dst), np.float64))


@triton.jit
def fp8_dot_kernel(a_ptr, b_ptr, o_ptr, M: tl.constexpr):
    r = tl.arange(0, M)
    a = tl.load(a_ptr + r[:, None] * M + r[None, :])
    b = tl.load(b_ptr + r[:, None] * M + r[None, :])
    tl.store(o_ptr + r[:, None] * M + r[None, :], tl.dot(a, tl.trans(b)))


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: jnp.dtype(d).name)
def test_fp8_dot_matches_jnp(dtype):
    """fp8 operands of tl.dot are their values (the interpreter decoded NaN patterns
    by hand): a @ b.T of every fp8 magnitude pattern up to 8, accumulated in f32."""
    rng = np.random.default_rng()
    M = 32
    a, b = (jnp.asarray(rng.uniform(-8, 8, (M, M))).astype(dtype) for _ in range(2))
    out = jt.triton_call(a, b, kernel=fp8_dot_kernel, out_shape=jax.ShapeDtypeStruct((M, M), jnp.float32),
                         grid=1, M=M)  # fmt: skip
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-5)
