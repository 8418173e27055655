"""A jaxpr's variables and their values while a walk evaluates it in program order: the TPU
interpreter's (every value known) and ``pltpu.estimate``'s scalar-prefetch walk (a value it
could not evaluate is absent, read as None)."""

from __future__ import annotations

from typing import Any

from jax.extend.core import Literal


class Env(dict):
    """The values of ``jaxpr``'s variables, its constants and inputs bound. ``read``: a variable
    with no value is a ``KeyError``; ``read_known``: it reads as None."""

    def __init__(self, jaxpr, consts, args):
        super().__init__()
        self.bind(jaxpr.constvars, consts)
        self.bind(jaxpr.invars, args)

    def bind(self, variables, values) -> None:
        for v, x in zip(variables, values):
            self[v] = x

    def read(self, v) -> Any:
        return v.val if isinstance(v, Literal) else self[v]

    def read_known(self, v) -> Any:
        return v.val if isinstance(v, Literal) else self.get(v)
