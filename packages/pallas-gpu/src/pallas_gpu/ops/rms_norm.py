"""RMS norm over the last axis, forward and backward, with the API of JAX's
Pallas GPU op ``rms_norm`` (``rms_norm``,
``rms_norm_reference``; like JAX's, it takes a bias)."""

from __future__ import annotations

import functools

import jax

from pallas_gpu.ops import _norm

rms_norm = _norm.make(
    "rms_norm",
    center=False,
    doc="""``x / sqrt(mean(x**2) + eps) * weight + bias`` over the last axis of
    ``x`` (any leading shape), differentiable in x, weight and bias; the
    other arguments as in ``layer_norm``.""",
)


@functools.partial(jax.jit, static_argnames=["eps"])
def rms_norm_reference(x, weight, bias, *, eps: float = 1e-5):
    """Plain-JAX RMS norm (computed in f32)."""
    return _norm.reference(x, weight, bias, eps=eps, center=False)
