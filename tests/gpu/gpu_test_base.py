"""Shared helpers of the GPU suite: random data, tolerances and ``assert_close`` against jnp,
and ``Runner``: a kernel run by the GPU engine (tests/ways/gpu.py, the ``gpu`` way).

By default the generated Triton kernel runs under Triton's interpreter (any machine, CI) and is
compiled for sm_80/sm_90; with ``PALLAS_GPU_TESTS=gpu`` (set by scripts/gpu_check.sh on the GPU
machine) the same tests compile the kernel for the device and run it there. The engine's
helpers (``triton_mode``, ``check_compiles``, ``check_all_compile``, ``lowered``, ...) are
imported from there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import Way
from ways.gpu import (  # noqa: F401  (the GPU engine's helpers, as the suite imports them)
    COMPILE_TARGETS,
    ON_DEVICE,
    all_lowered,
    check_all_compile,
    check_compiles,
    eqns_outside_kernels,
    has_gpu,
    lowered,
    source_options,
    triton_mode,
)

_counter = [0]


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
    """Calls pallas_call the GPU engine's way (``Way("gpu")``): Triton's interpreter and a
    compile for each of ``COMPILE_TARGETS``, or (``PALLAS_GPU_TESTS=gpu``) the GPU."""

    INTERPRET = not ON_DEVICE
    WAY = Way("gpu")

    def call(self, kernel, out_shape, **kw):
        return self.WAY.pallas_call(kernel, out_shape, **kw)


def whole(fn, *xs, out_shape=None):
    """Runs ``fn`` over whole-array blocks (grid of one program)."""

    def kernel(*refs):
        *ins, o = refs
        o[...] = fn(*[r[...] for r in ins])

    out = out_shape or jax.eval_shape(fn, *xs)
    return Runner().call(kernel, jax.ShapeDtypeStruct(out.shape, out.dtype))(*xs)


def whole_multi(fn, *xs):
    """Like ``whole`` for a ``fn`` returning a tuple of arrays."""
    outs = jax.eval_shape(fn, *xs)

    def kernel(*refs):
        ins, os = refs[: len(xs)], refs[len(xs) :]
        for o, v in zip(os, fn(*[r[...] for r in ins])):
            o[...] = v

    return Runner().call(kernel, tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs))(*xs)


def ops_outside_kernels(f, *args) -> set[str]:
    """The primitives ``f`` runs outside its pallas_call kernels."""
    return {eqn.primitive.name for eqn in eqns_outside_kernels(f, *args)}


gpu = pytest.mark.gpu
