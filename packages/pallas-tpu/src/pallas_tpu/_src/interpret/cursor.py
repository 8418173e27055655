"""Where the TPU interpreter is while it traces a kernel: the core whose kernel
is being traced, the grid step, and the traced values besides the cells that it
carries through loops, conds and grid steps (``Hidden``: the error record, the
token that orders host callbacks, the pipeline's block positions, the state of
extension rules).

The ``Interpreter`` (``interpreter.py``) holds one ``Cursor`` and moves it; its
parts that follow the kernel (the multi-device transport, ``multi.py``, its link to the
session, ``session_link.py``, and its
remote DMAs) are handed the same one, and read and advance the token through it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import tree_util


@dataclasses.dataclass(eq=False)
class Hidden:
    """The traced values besides the cells that the interpreter carries through
    loops, conds and grid steps (a pytree: its leaves are part of every carry)."""

    # int32[9]: the code of the first failed check (0 while none failed), then the
    # values recorded with it (``check``, ``flush_checks``).
    err: jax.Array | None = None
    tok: jax.Array | None = None  # orders host callbacks (``ordered_callback``)
    # (operand, core slot) -> where that core's block of the operand started at the
    # grid step before (the pipeline: fetch or write back when it moves).
    block_starts: dict[tuple[int, int], jax.Array] = dataclasses.field(default_factory=dict)
    # State of extension rules, by name (``rules.HIDDEN_STATE``): the PRNG state.
    named: dict[str, jax.Array] = dataclasses.field(default_factory=dict)


tree_util.register_dataclass(Hidden, data_fields=["err", "tok", "block_starts", "named"], meta_fields=[])


@dataclasses.dataclass(eq=False)
class Cursor:
    """Where the interpreter is (see the module docstring). ``hidden`` is replaced
    whenever a carry is restored, so parts hold the cursor, never its ``hidden``."""

    core_id: int = 0  # the core whose kernel is being traced (pallas_call._run_lanes)
    progress: tuple[Any, Any] | None = None  # (grid step, number of steps), traced, while a step runs
    hidden: Hidden = dataclasses.field(default_factory=Hidden)
