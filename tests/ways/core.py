"""The ``core`` and ``core_steps`` ways: pallas-core's interpret mode, on the CPU.

* ``core`` runs a kernel by ``pallas_call(interpret=True)``: the kernel discharged to plain JAX,
  grid steps vectorized where they provably do not interact;
* ``core_steps`` by ``pl.InterpretParams(vectorize=False)``: one grid step at a time, as JAX's
  ``interpret=True`` runs it.

Both compare the kernel's outputs with the test's plain-``jnp`` reference at the host's
arithmetic; their difference from each other is the vectorization (a test that compares the two
runs ``core`` and calls ``Way("core_steps")`` beside it). Every pallas-core kernel applies.
"""

from __future__ import annotations

import pallas as pl

from .engine import InterpretEngine


class CoreEngine(InterpretEngine):
    name = "core"

    def interpret(self, way):
        return True


class CoreStepsEngine(InterpretEngine):
    name = "core_steps"

    def interpret(self, way):
        return pl.InterpretParams(vectorize=False)
