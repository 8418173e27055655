"""Shared base class and helpers for the pallas-core tests.

Every test class derives from :class:`PallasTest`. The class attribute ``INTERPRET`` is
what the tests pass as ``interpret=`` to ``pallas_call`` (through ``self.pallas_call``),
so a backend package can rerun the same bodies by subclassing and overriding the hook,
and skipping in ``setup_method`` with a reason (for example "needs a GPU with sm80+").
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

import pallas as pl

# Tolerances per dtype for results computed with a different association order than the
# reference (reductions, dots). Elementwise kernels are compared with the same tolerances.
_TOLERANCES = {
    np.dtype(jnp.float32): {"rtol": 1e-5, "atol": 1e-5},
    np.dtype(jnp.bfloat16): {"rtol": 2e-2, "atol": 2e-2},
    np.dtype(jnp.float16): {"rtol": 2e-3, "atol": 2e-3},
    np.dtype(jnp.int32): {"rtol": 0, "atol": 0},
}

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ALL_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32]


def dtype_id(dtype) -> str:
    return np.dtype(dtype).name


def tolerance(dtype, scale: float = 1.0) -> dict:
    tol = _TOLERANCES.get(np.dtype(dtype), {"rtol": 1e-5, "atol": 1e-5})
    return {k: v * scale for k, v in tol.items()}


def random_array(key_or_seed, shape, dtype=jnp.float32, *, low=-4, high=4):
    """Fresh random data of ``dtype``: normal floats, uniform integers in [low, high)."""
    if isinstance(key_or_seed, (int, np.integer)):
        key = jax.random.key(int(key_or_seed))
    else:
        key = key_or_seed
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return jax.random.randint(key, shape, low, high, dtype=dtype)
    if dtype == np.bool_:
        return jax.random.bernoulli(key, 0.5, shape)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def assert_allclose(actual, expected, dtype=None, *, scale: float = 1.0, err_msg=""):
    """Compares ``actual`` to ``expected`` with a tolerance chosen by dtype."""
    actual = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    expected_arr = jnp.asarray(expected)
    if dtype is None:
        dtype = expected_arr.dtype
    expected = np.asarray(expected_arr.astype(jnp.float32))
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, err_msg=err_msg, **tolerance(dtype, scale))


def assert_tree_allclose(actual, expected, *, scale: float = 1.0):
    a_leaves, a_tree = jax.tree.flatten(actual)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert a_tree == e_tree, (a_tree, e_tree)
    for a, e in zip(a_leaves, e_leaves):
        assert jnp.asarray(a).dtype == jnp.asarray(e).dtype, (a.dtype, e.dtype)
        assert_allclose(a, e, scale=scale)


class PallasTest:
    """Base class: ``INTERPRET`` is the hook that selects how kernels run."""

    # What ``self.pallas_call`` passes as ``interpret=``. Backend subclasses override it.
    INTERPRET = True

    def setup_method(self, method):
        # A fresh, per-test, reproducible key: derived from the test's name (not Python's
        # randomized ``hash``), so each test sees different but repeatable data.
        name = f"{type(self).__name__}.{method.__name__}"
        self._key = jax.random.key(zlib.crc32(name.encode()))

    def next_key(self):
        self._key, key = jax.random.split(self._key)
        return key

    def rand(self, shape, dtype=jnp.float32, **kwargs):
        return random_array(self.next_key(), shape, dtype, **kwargs)

    def pallas_call(self, kernel, out_shape, **kwargs):
        kwargs.setdefault("interpret", self.INTERPRET)
        return pl.pallas_call(kernel, out_shape, **kwargs)
