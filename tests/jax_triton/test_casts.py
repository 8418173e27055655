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
