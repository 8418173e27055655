"""``pl.estimate_cost``: a ``CostEstimate`` for a plain JAX function, from XLA's
own cost analysis of it (kernels pass it as ``pallas_call(cost_estimate=...)``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas._src.core import CostEstimate


def estimate_cost(fun: Callable, *args, **kwargs) -> CostEstimate:
    """Estimates the cost of ``fun(*args, **kwargs)``.

    Args:
      fun: a JAX function.
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` (pytrees allowed).
      **kwargs: static keyword arguments, bound before tracing.

    Returns:
      A ``pl.CostEstimate`` with XLA's flop, transcendental and byte counts of
      the unoptimized function (its inputs and outputs included in the bytes).
    """
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), args)
    analysis = jax.jit(functools.partial(fun, **kwargs)).lower(*specs).cost_analysis() or {}
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else {}
    return CostEstimate(
        flops=int(analysis.get("flops", 0)),
        transcendentals=int(analysis.get("transcendentals", 0)),
        bytes_accessed=int(analysis.get("bytes accessed", 0)),
    )
