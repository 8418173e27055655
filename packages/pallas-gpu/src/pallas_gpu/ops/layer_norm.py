"""Layer norm over the last axis, forward and backward, with the API of JAX's
Pallas GPU op ``layer_norm`` (``layer_norm``,
``layer_norm_reference``)."""

from __future__ import annotations

import functools

import jax

from pallas_gpu.ops import _norm

layer_norm = _norm.make(
    "layer_norm",
    center=True,
    doc="""``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis of
    ``x`` (any leading shape), differentiable in x, weight and bias.
    ``num_warps=None`` picks one from the row length; ``backward_pass_impl``
    is ``"triton"`` (Pallas kernels) or ``"xla"``; ``interpret`` takes
    ``True`` or ``pallas_gpu.InterpretParams()`` to run on a CPU.""",
)


@functools.partial(jax.jit, static_argnames=["eps"])
def layer_norm_reference(x, weight, bias, *, eps: float = 1e-5):
    """Plain-JAX layer norm (computed in f32)."""
    return _norm.reference(x, weight, bias, eps=eps, center=True)
