"""``run_mosaic(..., mxu_rounding=True)``: float matmuls computed as a TPU's MXU does
(bfloat16 passes chosen by the contract precision), by our lowering and by JAX's.

On the v5e a float32 ``jnp.dot`` at the default precision equals the float64 product
of its operands rounded to bf16 (seen on the chip, 2026-12-06); TPU interpret mode
and run_mosaic's default multiply float32 exactly, so a float32 kernel checked on
the CPU against a float32 reference can pass there and miss on the chip. These
tests check the model against references written from that rule with NumPy and
ml_dtypes, and that the default stays exact."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export, lax
from jaxlib.mosaic.python import tpu
from ways.mosaic import TPU_V5E  # the abstract v5e JAX's lowering asks for

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.executor import run as executor

jax.config.update("jax_enable_checks", True)

# jaxlib < 0.11.2's Mosaic has no bf16x3 contract precision (lax.Precision.HIGH)
NO_BF16X3 = not hasattr(getattr(tpu, "ContractPrecision", None), "kBF16x3")
M, K, N = 16, 384, 256  # K of several MXU passes: the rounding shows well above f32's


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def operands(seed, dtypes=(np.float32, np.float32)):
    kx, ky = jax.random.split(jax.random.key(seed))
    # Values with many mantissa bits below bf16's, so each model differs from the others.
    x = np.asarray(jax.random.normal(kx, (M, K), jnp.float32) * 3.7).astype(dtypes[0])
    y = np.asarray(jax.random.normal(ky, (K, N), jnp.float32) * 1.3).astype(dtypes[1])
    return x, y


def want(x, y, precision):
    """The MXU's sum for ``precision``, in float64 (written from the rule, not from run_mosaic)."""
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if precision == "HIGHEST":
        return x64 @ y64
    xh, yh = bf16(x), bf16(y)
    if precision == "HIGH":  # three passes: hi*hi + hi*lo + lo*hi, lo rounded to bf16 too
        return xh @ yh + xh @ bf16(y64 - yh) + bf16(x64 - xh) @ yh
    return xh @ yh


OUT = jax.ShapeDtypeStruct((M, N), jnp.float32)


def run(lowering, precision, x, y, **kw):
    """A whole-block ``jnp.dot`` kernel of ``precision``, lowered by us or by JAX, run by run_mosaic."""
    prec = None if precision == "DEFAULT" else getattr(lax.Precision, precision)

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], precision=prec, preferred_element_type=jnp.float32)

    if lowering == "ours":
        [module] = pltpu.mosaic_modules(lambda a, b: pl.pallas_call(kernel, out_shape=OUT)(a, b), x, y)
    else:
        jpl = pytest.importorskip("jax.experimental.pallas")
        call = functools.partial(jpl.pallas_call, kernel, out_shape=OUT)
        with jax.sharding.use_abstract_mesh(TPU_V5E):
            txt = export.export(jax.jit(lambda a, b: call()(a, b)), platforms=["tpu"])(x, y).mlir_module()
        [module] = executor.custom_call_bodies(txt)
    return np.asarray(pltpu.run_mosaic(module, x, y, out_shape=OUT, **kw), np.float64)


def err(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("lowering", ["ours", "jax"])
@pytest.mark.parametrize("precision", ["DEFAULT", "HIGH", "HIGHEST"])
def test_mxu_rounding_follows_the_contract_precision(lowering, precision):
    x, y = operands(1)
    if precision == "HIGH" and NO_BF16X3:
        if lowering == "jax":
            pytest.skip("JAX's lowering refuses precision HIGH on jaxlib < 0.11.2 (no bf16x3)")
        with pytest.raises(NotImplementedError, match=r"precision HIGH .*bf16x3.* >= 0\.11\.2"):
            run(lowering, precision, x, y, mxu_rounding=True)
        return
    got = run(lowering, precision, x, y, mxu_rounding=True)
    # float32 accumulation of the model's products: under 1e-6 of the largest output
    assert err(got, want(x, y, precision)) < 1e-6
    others = [p for p in ("DEFAULT", "HIGH", "HIGHEST") if p != precision]
    for other in others:  # the models differ by more (HIGH from HIGHEST by ~4e-6): it can fail
        assert err(got, want(x, y, other)) > 2e-6, other


@pytest.mark.parametrize("lowering", ["ours", "jax"])
def test_default_multiplies_float32_exactly(lowering):
    x, y = operands(2)
    got = run(lowering, "DEFAULT", x, y)
    assert err(got, want(x, y, "HIGHEST")) < 1e-6
    assert err(got, want(x, y, "DEFAULT")) > 1e-4


def test_bf16_operands_are_exact_either_way():
    x, y = operands(3, (ml_dtypes.bfloat16, ml_dtypes.bfloat16))
    exact = np.asarray(x, np.float64) @ np.asarray(y, np.float64)
    for rounding in (False, True):
        assert err(run("ours", "DEFAULT", x, y, mxu_rounding=rounding), exact) < 1e-6


def test_mixed_operands_round_the_float32_one():
    x, y = operands(4, (ml_dtypes.bfloat16, np.float32))
    got = run("ours", "DEFAULT", x, y, mxu_rounding=True)
    assert err(got, np.asarray(x, np.float64) @ bf16(y)) < 1e-6
    assert err(got, np.asarray(x, np.float64) @ np.asarray(y, np.float64)) > 1e-4


ON_TPU = jax.default_backend() == "tpu"


@pytest.mark.parametrize("precision", ["DEFAULT", "HIGHEST"])
@pytest.mark.parametrize("shape", [(16, 384, 256), (128, 1024, 128)])
def test_compiled_chip_equals_the_model(precision, shape):
    """The compiled way on a TPU: our lowering of float32 dots run on the chip equals
    run_mosaic(mxu_rounding=True) of the same module (on the host's CPU)."""
    if not ON_TPU:
        pytest.skip("the chip way: needs a TPU (tests/tpu's compiled way on the chip)")
    m, k, n = shape
    prec = None if precision == "DEFAULT" else lax.Precision.HIGHEST
    out = jax.ShapeDtypeStruct((m, n), jnp.float32)

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], precision=prec, preferred_element_type=jnp.float32)

    def fn(a, b):
        return pl.pallas_call(kernel, out_shape=out)(a, b)

    cpu, tpu_dev = jax.devices("cpu")[0], jax.devices("tpu")[0]
    with jax.default_device(cpu):
        kx, ky = jax.random.split(jax.random.key(7))
        x = np.asarray(jax.random.normal(kx, (m, k), jnp.float32) * 3.7)
        y = np.asarray(jax.random.normal(ky, (k, n), jnp.float32) * 1.3)
        [module] = pltpu.mosaic_modules(fn, x, y)
        model = np.asarray(pltpu.run_mosaic(module, x, y, out_shape=out, mxu_rounding=True), np.float64)
    chip = np.asarray(jax.jit(fn)(jax.device_put(x, tpu_dev), jax.device_put(y, tpu_dev)), np.float64)
    # the chip's f32 accumulation order is its own: agree to f32 sums, and far closer than
    # the other model (exact vs bf16 differ by ~2e-3 here)
    assert err(chip, model) < 1e-5, err(chip, model)
    other = want(x, y, "HIGHEST" if precision == "DEFAULT" else "DEFAULT")
    assert err(chip, other) > 1e-4
