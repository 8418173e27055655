"""What both kernel lowerings share (pallas-gpu's Triton source, pallas-tpu's Mosaic).

* ``RuleTable``: a backend's ``primitive -> rule`` table and its
  ``register_lowering(*prims)`` decorator.
* ``walk_jaxpr``: the walk over a jaxpr's equations (bind the inputs, lower
  each equation, bind its results, read the outputs); the backend says how a
  literal becomes a value and how one equation is lowered.
* ``trace_composite``: the jaxpr of a composite op's ``jnp`` definition, which
  a backend's ``lower_fun`` lowers with its own rules (``pallas._src.math``
  holds the definitions both backends use).
* ``uninitialized_fill``: what every engine puts in memory that nothing has
  written yet (the policy: docs/differences.md, "Uninitialized memory").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

Rule = Callable[..., Any]


class RuleTable(dict):
    """One backend's lowering rules: ``table[primitive] -> rule``.

    A rule is ``rule(ctx, *args, **params)``; ``register`` (a backend's
    ``register_lowering``) fills the table::

        lowering_rules = RuleTable("pallas_tpu (Mosaic)")
        register_lowering = lowering_rules.register

        @register_lowering(lax.exp_p, lax.exp2_p)
        def _exp(ctx, x, **params): ...
    """

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def register(self, *prims) -> Callable[[Rule], Rule]:
        """Decorator: the rule lowers each of ``prims`` (a None, a primitive the
        installed JAX lacks: ``pallas.backend.lax_primitive``, is skipped)."""

        def decorator(rule: Rule) -> Rule:
            for p in prims:
                if p is not None:
                    self[p] = rule
            return rule

        return decorator


#: What ``walk_jaxpr``'s ``lower_eqn`` returns for an equation that another
#: equation's rule lowers (its results are never read on their own): the walk
#: binds no results for it.
SKIP = object()


def walk_jaxpr(
    jaxpr,
    args: Sequence[Any],
    *,
    literal: Callable[[Any], Any],
    lower_eqn: Callable[[Any, Callable[[Any], Any]], Any],
) -> list[Any]:
    """Lowers the equations of ``jaxpr`` in order; returns its outputs' values.

    Args:
      jaxpr: a ``Jaxpr`` (a ``ClosedJaxpr``'s consts are the caller's to bind).
      args: the values of ``jaxpr.constvars`` then ``jaxpr.invars``.
      literal: a jaxpr ``Literal`` -> its value in the backend's value model.
      lower_eqn: ``lower_eqn(eqn, read)`` lowers one equation (``read(var)`` is
        the value of an operand) and returns its result (a list of them for a
        primitive with multiple results), or ``SKIP``.

    Returns:
      The values of ``jaxpr.outvars``.
    """
    env: dict[Any, Any] = {}

    def read(v):
        return literal(v) if isinstance(v, jex_core.Literal) else env[v]

    for v, a in zip([*jaxpr.constvars, *jaxpr.invars], args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        out = lower_eqn(eqn, read)
        if out is SKIP:
            continue
        outs = out if eqn.primitive.multiple_results else [out]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def trace_composite(fn: Callable[..., Any], avals: Sequence[Any], what: str, **params):
    """The jaxpr of ``fn(*args, **params)`` on ``avals`` (shape/dtype records),
    for a backend's ``lower_fun``. A definition that closes over arrays is
    refused (``NotImplementedError`` naming ``what``, the primitive)."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    closed = jax.make_jaxpr(functools.partial(fn, **params))(*structs)
    if closed.consts:
        raise NotImplementedError(f"the jnp definition of '{what}' closes over arrays")
    return closed.jaxpr


def uninitialized_fill(dtype, mode: str = "nan") -> np.ndarray:
    """The value of memory nothing has written yet, as a 0-d numpy array:
    NaN for floating-point (and complex) dtypes, the smallest value for
    integers, False for bools; zero for anything else. Values no kernel
    plausibly computes, so that a read of never-written memory shows.
    ``mode="zero"`` (an interpreter's ``uninitialized`` option) gives zero."""
    dtype = np.dtype(dtype)
    if mode == "zero":
        return np.zeros((), dtype)
    if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
        return np.array(np.nan, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return np.array(jnp.iinfo(dtype).min, dtype)
    return np.zeros((), dtype)
