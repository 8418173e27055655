"""Shared helpers: run a kernel through pallas-gpu and compare with jnp.

``INTERPRET`` is the hook: on CPU the generated Triton kernel runs under
Triton's interpreter; the GPU subclass (marked ``gpu``) runs it compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_gpu as plgpu

_counter = [0]


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def fresh_key():
    _counter[0] += 1
    return jax.random.key(1000 + _counter[0])


def random(shape, dtype, key=None, low=-3, high=3):
    key = key if key is not None else fresh_key()
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return jax.random.bernoulli(key, 0.5, shape)
    if jnp.issubdtype(dtype, jnp.integer):
        lo = max(low * 10, int(jnp.iinfo(dtype).min))
        hi = min(high * 10, int(jnp.iinfo(dtype).max))
        return jax.random.randint(key, shape, lo, hi, dtype=jnp.int32).astype(dtype)
    return jax.random.uniform(key, shape, jnp.float32, low, high).astype(dtype)


def tol(dtype):
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.float16, jnp.bfloat16):
        return dict(rtol=2e-2, atol=2e-2)
    if dtype == jnp.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=0, atol=0)


def assert_close(actual, expected, dtype=None, **kw):
    dtype = dtype or jnp.asarray(expected).dtype
    t = {**tol(dtype), **kw}
    np.testing.assert_allclose(
        np.asarray(
            jnp.asarray(actual).astype(jnp.float32) if jnp.asarray(actual).dtype == jnp.bfloat16 else actual
        ),
        np.asarray(
            jnp.asarray(expected).astype(jnp.float32)
            if jnp.asarray(expected).dtype == jnp.bfloat16
            else expected
        ),
        **t,
    )


class Runner:
    """Calls pallas_call with the backend hook."""

    INTERPRET = True

    def call(self, kernel, out_shape, **kw):
        if self.INTERPRET:
            kw.setdefault("interpret", plgpu.InterpretParams())
        return pl.pallas_call(kernel, out_shape, **kw)


gpu = pytest.mark.gpu
