"""How the TPU tests compare a kernel's outputs with their reference, in every way: ``close``
(to a tolerance, in float64) and ``equal`` (bit for bit); both check shape and dtype first."""

from __future__ import annotations

import numpy as np


def close(a, b, tol=1e-5):
    """Same shape and dtype, and equal to ``tol`` (relative and absolute) in float64."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


def equal(a, b):
    """Same shape and dtype, and bit-for-bit equal values."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a, b)
