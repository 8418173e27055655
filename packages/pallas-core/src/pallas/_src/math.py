"""Composite math defined once, in ``jnp``, for every backend.

A backend without a native instruction for one of these lowers the primitive
from the definition here (pallas-tpu's Mosaic lowering through ``lower_fun``,
pallas-gpu's Triton lowering through its own ``lower_fun``); an engine that
computes on host arrays (pallas-gpu's ``libdevice`` for Triton's interpreter)
calls the same definition with ``xp=numpy``. The float32 approximations are
the ones XLA uses, so a kernel agrees with the same math outside a kernel.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

# Giles, "Approximating the erfinv function" (2010), single precision: the
# coefficients XLA uses for float32 erf_inv (central region w < 5, then the tail).
_ERFINV_CENTRAL = (
    2.81022636e-08,
    3.43273939e-07,
    -3.5233877e-06,
    -4.39150654e-06,
    0.00021858087,
    -0.00125372503,
    -0.00417768164,
    0.246640727,
    1.50140941,
)
_ERFINV_TAIL = (
    -0.000200214257,
    0.000100950558,
    0.00134934322,
    -0.00367342844,
    0.00573950773,
    -0.0076224613,
    0.00943887047,
    1.00167406,
    2.83297682,
)


def erf_inv_f32(x, xp: Any = jnp):
    """``lax.erf_inv`` of float32 ``x`` by Giles' polynomial (``+-inf`` at ``+-1``).

    Args:
      x: float32 values in [-1, 1] (a traced ``jnp`` array, or a numpy array
        with ``xp=numpy``).
      xp: the array namespace to compute with (``jax.numpy`` or ``numpy``).

    Returns:
      ``erf_inv(x)`` to about float32 precision, in ``x``'s dtype.
    """
    w = -xp.log1p(-x * x)
    central = w < 5.0
    w = xp.where(central, w - 2.5, xp.sqrt(w) - 3.0)
    p = xp.where(central, np.float32(_ERFINV_CENTRAL[0]), np.float32(_ERFINV_TAIL[0]))
    for a, b in zip(_ERFINV_CENTRAL[1:], _ERFINV_TAIL[1:]):
        p = xp.where(central, np.float32(a), np.float32(b)) + p * w
    return xp.where(xp.abs(x) == 1.0, x * np.float32(np.inf), p * x)


# lgamma and digamma: XLA's Lanczos approximation (g = 7, 8 terms; Press et al.,
# "Numerical Recipes"), with the reflection formula below 1/2, in float32.
_LANCZOS_G = 7.0
_LANCZOS_BASE = 0.99999999999980993227684700473478
_LANCZOS = (
    676.520368121885098567009190444019,
    -1259.13921672240287047156078755283,
    771.3234287776530788486528258894,
    -176.61502916214059906584551354,
    12.507343278686904814458936853,
    -0.13857109526572011689554707,
    9.984369578019570859563e-6,
    1.50563273514931155834e-7,
)


def _lanczos(x):
    """(reflect, z, t, log_t): the Lanczos argument of ``x`` (``-x`` where ``x < 1/2``)."""
    reflect = x < 0.5
    z = jnp.where(reflect, -x, x - 1.0)
    t = z + np.float32(_LANCZOS_G + 0.5)
    log_t = np.float32(np.log(_LANCZOS_G + 0.5)) + jnp.log1p(z / np.float32(_LANCZOS_G + 0.5))
    return reflect, z, t, log_t


def lgamma_f32(x):
    """``lax.lgamma`` of float32 ``x``: ``log|Gamma(x)|`` (``inf`` at the poles and at ``+-inf``)."""
    reflect, z, t, log_t = _lanczos(x)
    a = np.float32(_LANCZOS_BASE)
    for i, c in enumerate(_LANCZOS):
        a = a + np.float32(c) / (z + np.float32(i + 1))
    log_y = np.float32(0.5 * np.log(2 * np.pi)) + (z + 0.5) * log_t - t + jnp.log(a)
    frac = jnp.abs(x) - jnp.floor(jnp.abs(x))
    frac = jnp.where(frac > 0.5, 1.0 - frac, frac)
    denom = jnp.log(jnp.sin(np.float32(np.pi) * frac))
    reflection = jnp.where(jnp.isfinite(denom), np.float32(np.log(np.pi)) - denom - log_y, -denom)
    return jnp.where(jnp.isinf(x), np.float32(np.inf), jnp.where(reflect, reflection, log_y))


def digamma_f32(x):
    """``lax.digamma`` of float32 ``x`` (NaN at the negative poles, ``-inf`` at 0)."""
    reflect, z, t, log_t = _lanczos(x)
    num, denom = np.float32(0.0), np.float32(_LANCZOS_BASE)
    for i, c in enumerate(_LANCZOS):
        zi = z + np.float32(i + 1)
        num = num - np.float32(c) / (zi * zi)
        denom = denom + np.float32(c) / zi
    y = log_t + num / denom - np.float32(_LANCZOS_G) / t
    reduced = x + jnp.abs(jnp.floor(x + 0.5))
    pi = np.float32(np.pi)
    reflection = y - pi * jnp.cos(pi * reduced) / jnp.sin(pi * reduced)
    out = jnp.where(reflect, reflection, y)
    out = jnp.where((x < 0) & (x == jnp.floor(x)), np.float32(np.nan), out)  # poles
    return jnp.where(x == 0, np.float32(-np.inf), out)


def in_float32(fn):
    """``fn`` computed in float32 and cast back (for 16-bit float operands)."""

    def f(x):
        return fn(x.astype(jnp.float32)).astype(x.dtype)

    return f
