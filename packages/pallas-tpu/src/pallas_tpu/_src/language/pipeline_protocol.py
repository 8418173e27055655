"""Operands that ``emit_pipeline`` schedules through their BufferedRef's methods.

JAX's pipeline drives every operand through methods of its ``BufferedRef``: it keeps
slot registers in the BufferedRef (``copy_in_slot``, ``wait_in_slot``,
``copy_out_slot``, ``wait_out_slot``: uint32 counts), calls ``copy_in(src_ref,
grid_indices)``, ``wait_in``, ``copy_out``, ``wait_out`` under its predicates and the
``advance_*_slot`` methods after them, and gives the body ``current_ref``. Libraries
subclass ``pltpu.BufferedRef`` to replace some of those methods (tokamax's routing
matmul does its own gathered DMAs and keeps the pipeline's predicates and slots) and
pass instances as ``allocations``. Our schedule (``pipeline_schedule.py``) plans our
own BufferedRefs itself; an operand whose allocation is a subclass is scheduled here,
through its methods, with the predicates and slot rules of JAX's schedule (``n``: its
buffer count; blocks compared by their index maps; the steps around a step wrap around
the grid):

* before the loop: the slots start at 0; an input fetches the blocks of steps
  ``0 .. n - 2`` (each that differs from the step before), advancing ``copy_in_slot``;
* each step, inputs: ``copy_in`` of the block ``n - 1`` steps ahead when it differs
  from the one before it and that step exists (``n == 1``: this step's block when it
  changed, and at the first step); then ``wait_in`` of this step's block when it
  changed (or at the first step);
* the body, on ``current_ref`` (an input's wait-in slot, an output's copy-out slot);
* outputs: ``copy_out`` of this step's block when the next step's differs (or at the
  last step), advancing ``copy_out_slot``; ``wait_out`` of the previous step's block
  when this step's block changed (not at the first step), advancing ``wait_out_slot``;
  inputs advance ``wait_in_slot`` when the next block differs (or at the last step);
* after the loop: outputs ``wait_out`` the last step's block.

Our ``BufferedRef`` implements these methods with our copies (``copy_block``: the
block's edges as our schedule copies them), so a subclass that keeps some of them
gets ours. JAX's lookahead fetching (``use_lookahead``) is not followed here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_tpu._src.language.pipeline_buffers import (
    WHERE,
    as_index,
    call_index_map,
    pipeline_error,
    register_copy_block,
    run_when,
)
from pallas_tpu._src.language.pipeline_plan import operand_of

_REGISTERS = ("copy_in_slot", "wait_in_slot", "copy_out_slot", "wait_out_slot")


def copy_block(bref, ref, grid_indices, slot, start: bool, wait: bool, into_window: bool) -> None:
    """Starts and/or waits for the copy between the block of ``ref`` at ``grid_indices``
    and ``slot`` of ``bref``'s buffer (``into_window``: from ``ref`` into the buffer)."""
    op = operand_of(bref, ref)
    block = tuple(map(as_index, call_index_map(op.spec, tuple(grid_indices), "spec")))
    copy = op.copy_in if into_window else op.copy_out
    copy(block, slot, start=start, wait=wait)


register_copy_block(copy_block)


def check(op) -> None:
    if op.bref.use_lookahead:
        raise pipeline_error(
            NotImplementedError,
            f"{WHERE}: {op.origin}: a {type(op.bref).__name__} (a BufferedRef subclass given in "
            "allocations) with use_lookahead: JAX's lookahead schedule is not followed for those",
        )


def registers(bref) -> tuple[Any, ...]:
    """What the pipeline's loop carries of a BufferedRef: its slot registers."""
    return tuple(getattr(bref, r) for r in _REGISTERS)


def with_registers(bref, regs):
    return dataclasses.replace(bref, **dict(zip(_REGISTERS, regs)))


def prologue(run, at, op):
    """The BufferedRef of ``op`` with its slots at 0 and its first ``n - 1`` blocks
    fetched (``at``: the steps around step 0)."""
    bref = op.bref.initialize_slots()
    if not bref.is_input:
        return bref
    for t in range(bref.buffer_count - 1):
        if run.static and t >= run.num_steps:
            break
        pred = True if t == 0 else at.differ(op, t, t - 1)
        if not run.static:
            pred = jnp.logical_and(t < run.num_steps, pred)
        run_when(pred, lambda b=bref, t=t: b.copy_in(op.ref, at.indices(t)))
        bref = bref.advance_copy_in_slot(pred)
    return bref


def before_body(run, at, op, bref):
    """An input's copy-in ahead and wait-in of this step's block; the BufferedRef after."""
    if not bref.is_input:
        return bref
    n = bref.buffer_count
    if n < 2:
        pred = jnp.logical_or(at.changed(op), at.first)
        idx = at.indices(0)
    else:
        in_grid = at.s < run.num_steps - (n - 1)
        pred = jnp.logical_and(at.differ(op, n - 2, n - 1), in_grid)
        idx = at.indices(n - 1)
    run_when(pred, lambda b=bref: b.copy_in(op.ref, idx))
    bref = bref.advance_copy_in_slot(pred)
    run_when(at.changed(op), lambda b=bref: b.wait_in(op.ref, at.indices(0)))
    return bref


def after_body(run, at, op, bref):
    """An output's copy-out of this step's block and wait-out of the previous one, an
    input's wait-in slot advanced; the BufferedRef after."""
    del run
    if bref.is_output:
        pred = at.will_change(op)
        run_when(pred, lambda b=bref: b.copy_out(op.ref, at.indices(0)))
        bref = bref.advance_copy_out_slot(pred)
        pred = jnp.logical_and(at.not_first, at.differ(op, 0, -1))
        run_when(pred, lambda b=bref: b.wait_out(op.ref, at.indices(-1)))
        bref = bref.advance_wait_out_slot(pred)
    if bref.is_input:
        bref = bref.advance_wait_in_slot(at.will_change(op))
    return bref


def epilogue(at, op, bref) -> None:
    """An output's wait-out of the last step's block (``at``: the steps around it)."""
    if bref.is_output:
        bref.wait_out(op.ref, at.indices(0))
