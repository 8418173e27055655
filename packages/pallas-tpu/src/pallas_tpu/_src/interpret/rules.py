"""Extension tables of the TPU interpreter (``interpreter.py``).

STATE_RULES: ``{primitive: rule}``; ``rule(ctx, eqn, *invals) -> list of outvals``.
  The interpreter calls the rule instead of binding the primitive. ``ctx`` is
  the running ``Interpreter``; ``ctx.hidden.named`` is a dict of traced arrays
  that the interpreter carries through loops and conds (read and assign entries).
ITER_RULES: ``{primitive: rule}``; ``rule(ctx, eqn, invals, pause)`` is a generator
  that yields where the kernel may pause (a semaphore wait, when cores take turns)
  and returns the outvals: for primitives with a kernel body (``pl.run_scoped``).
HIDDEN_STATE: ``{primitive: {name: initializer}}``: hidden state a primitive
  needs; the interpreter creates ``ctx.hidden.named[name] = initializer()`` before
  the grid starts if the kernel uses the primitive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

STATE_RULES: dict[Any, Callable[..., list[Any]]] = {}
ITER_RULES: dict[Any, Callable[..., Any]] = {}
HIDDEN_STATE: dict[Any, dict[str, Callable[[], Any]]] = {}
