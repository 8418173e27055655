"""The loop ``emit_pipeline`` (``pipeline.py``) traces into the kernel: the
schedule its module docstring describes. ``run_pipeline`` splits the grid over
cores (``core_axis``), fetches the first blocks of every input (``_prologue``),
then runs a ``fori_loop`` whose ``_step`` fetches inputs ahead
(``_fetch_inputs``), calls the body on this step's blocks (``_call_body``) and
writes outputs back (``_write_back``), then waits for the last write-backs.
Operands whose copies can share predicates are grouped (``_Group``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax, tree_util

import pallas as pl
from pallas import backend as plb
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import pipeline_protocol as protocol
from pallas_tpu._src.language.pipeline_buffers import (
    WHERE,
    any_differ,
    as_index,
    block_indexer,
    call_index_map,
    pipeline_error,
    run_when,
    unravel,
)
from pallas_tpu._src.language.pipeline_plan import Operand

# ---------------------------------------------------------------------------
# Core partitioning (core_axis / core_axis_name).


def _core_info(core_axis):
    if core_axis is None:
        return None, None
    if isinstance(core_axis, int):
        return pl.num_programs(core_axis), pl.program_id(core_axis)
    return lax.axis_size(core_axis), lax.axis_index(core_axis)


def _partition_grid(grid, semantics, num_cores, core_id):
    """(this core's grid, offsets of its indices): split the first parallel
    axis that the cores divide, else the largest parallel one unevenly."""
    if num_cores is None or (isinstance(num_cores, int) and num_cores == 1):
        return tuple(grid), (0,) * len(grid)
    if not isinstance(num_cores, int):
        raise pipeline_error(
            NotImplementedError, f"{WHERE}: cannot split the grid over a dynamic number of cores"
        )
    parallel = [i for i, s in enumerate(semantics) if s is tpu_core.PARALLEL]
    if not parallel:
        raise pipeline_error(
            NotImplementedError,
            f"{WHERE}: splitting the grid over {num_cores} cores needs a 'parallel' axis in "
            f"dimension_semantics, got {tuple(s.value for s in semantics)}",
        )
    offsets = [0] * len(grid)
    grid = list(grid)
    for i in parallel:
        if isinstance(grid[i], int) and grid[i] % num_cores == 0:
            grid[i] //= num_cores
            offsets[i] = core_id * grid[i]
            return tuple(grid), tuple(offsets)
    static = [i for i in parallel if isinstance(grid[i], int)]
    if not static:
        raise pipeline_error(NotImplementedError, f"{WHERE}: cannot split dynamic grid axes over cores")
    i = max(static, key=lambda j: grid[j])
    base, rem = divmod(grid[i], num_cores)
    grid[i] = jnp.where(core_id < rem, base + 1, base).astype(jnp.int32)
    offsets[i] = jnp.where(core_id < rem, core_id * (base + 1), core_id * base + rem)
    return tuple(grid), tuple(offsets)


# ---------------------------------------------------------------------------


@tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PipelineStep:
    """Where a pipeline body runs (given to the body with ``_explicit_indices``).

    Attributes:
      index: the grid indices of this step (offset by this core's share).
      local_index: the linear step counter of this core's loop.
    """

    index: tuple[Any, ...]
    local_index: Any

    def tree_flatten(self):
        vals = (*self.index, self.local_index)
        aux = tuple(v if isinstance(v, int) else None for v in vals)
        return [v for v in vals if not isinstance(v, int)], aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        it = iter(children)
        vals = [v if v is not None else next(it) for v in aux]
        return cls(index=tuple(vals[:-1]), local_index=vals[-1])


class _Group:
    """Buffered operands with the same index map, block shape, array shape,
    buffer count and type: their copies share predicates, slots and
    ``pl.when``s (fewer conditionals for the interpreter to compile)."""

    def __init__(self, members):
        self.members = members
        lead = members[0]
        self.bref, self.spec, self.origin = lead.bref, lead.spec, lead.origin

    def copy_in(self, block_indices, slot, **kw):
        for m in self.members:
            m.copy_in(block_indices, slot, **kw)

    def copy_out(self, block_indices, slot, **kw):
        for m in self.members:
            m.copy_out(block_indices, slot, **kw)


def _group(ops) -> list[_Group]:
    groups: dict[Any, list[Operand]] = {}
    for op in ops:
        key = (
            id(op.spec.index_map),
            op.spec.block_shape,
            op.shape,
            op.bref.buffer_count,
            op.bref.buffer_type,
        )
        groups.setdefault(key, []).append(op)
    return [_Group(g) for g in groups.values()]


def run_pipeline(
    body, plan, rebuild, *, grid, semantics, core_axis, scratches, body_prologue, explicit_indices, name
):
    num_cores, core_id = _core_info(core_axis)
    local_grid, offsets = _partition_grid(grid, semantics, num_cores, core_id)
    static = all(isinstance(g, int) for g in local_grid)
    num_steps = math.prod(local_grid) if static else functools.reduce(lambda a, b: a * b, local_grid)
    ops = [op for op in plan if op is not None]
    protos = [op for op in ops if op.protocol]
    for op in protos:
        protocol.check(op)
    groups = _group([op for op in ops if op.bref.is_buffered and not op.protocol])
    ins = [g for g in groups if g.bref.is_input]
    outs = [g for g in groups if g.bref.is_output]
    run = _Run(
        body,
        plan,
        rebuild,
        local_grid=local_grid,
        offsets=offsets,
        static=static,
        num_steps=num_steps,
        ins=ins,
        outs=outs,
        protos=protos,
        ctx_name=f"emit_pipeline body {name!r}",
        scratches=scratches,
        body_prologue=body_prologue,
        explicit_indices=explicit_indices,
    )
    fetched0, brefs0 = _prologue(run)
    carry = (
        tuple(fetched0),
        tuple(jnp.int32(0) for _ in ins),
        tuple(jnp.int32(0) for _ in outs),
        tuple(protocol.registers(b) for b in brefs0),
    )
    _, _, written, regs = lax.fori_loop(0, num_steps, functools.partial(_step, run), carry)
    # Epilogue: wait for the last write-back of double-buffered outputs.
    at = _Steps(run, jnp.asarray(num_steps - 1, jnp.int32))
    for k, op in enumerate(outs):
        if op.bref.buffer_count == 2:
            op.copy_out(at.block(op, 0), lax.rem(written[k] + 1, 2), start=False, wait=True)
    with run.context(at):
        for op, r in zip(protos, regs):
            protocol.epilogue(at, op, protocol.with_registers(op.bref, r))


@dataclasses.dataclass(eq=False)
class _Run:
    """One run of a pipeline on this core: what the steps of ``run_pipeline`` share."""

    body: Callable[..., None]
    plan: list[Operand | None]
    rebuild: Callable[[list[Any]], Any]
    local_grid: tuple[Any, ...]  # this core's share of the grid
    offsets: tuple[Any, ...]  # of this core's grid indices
    static: bool  # the grid's sizes are all ints
    num_steps: Any
    ins: list[_Group]
    outs: list[_Group]
    protos: list[Operand]  # scheduled through their BufferedRefs' methods (pipeline_protocol.py)
    ctx_name: str
    scratches: tuple[Any, ...]
    body_prologue: Callable[[], None] | None
    explicit_indices: bool

    def indices_at(self, t):
        # The steps around this one wrap around the grid, as in JAX's pipeline: an index map
        # never sees grid indices outside the grid (step -1 of step 0, lookahead past the
        # last step), where a lookup in a scalar-prefetch table would read out of bounds.
        # Blocks at wrapped steps are only compared under predicates that are then false.
        num_steps = self.num_steps
        t = lax.rem(jnp.asarray(t, jnp.int32) + num_steps, jnp.maximum(jnp.asarray(num_steps, jnp.int32), 1))
        return tuple(i + o for i, o in zip(unravel(t, self.local_grid), self.offsets))

    def context(self, at):
        """The kernel context of the step ``at`` is around (``pl.program_id`` in the body,
        index maps and BufferedRef methods)."""
        return plb.kernel_context(plb.KernelContext(self.local_grid, at.indices(0), self.ctx_name))


class _Steps:
    """Grid indices and block indices at the steps around one step,
    computed once (named by their offset from the step)."""

    def __init__(self, run: _Run, s):
        self.run = run
        self.s = s
        self.idx: dict[int, tuple] = {}
        self.blocks: dict[tuple[int, int], tuple] = {}

    def indices(self, k):
        if k not in self.idx:
            self.idx[k] = self.run.indices_at(self.s + k)
        return self.idx[k]

    def block(self, op, k):
        key = (id(op), k)
        if key not in self.blocks:
            idx = self.indices(k)
            with plb.kernel_context(plb.KernelContext(self.run.local_grid, idx, self.run.ctx_name)):
                self.blocks[key] = tuple(map(as_index, call_index_map(op.spec, idx, op.origin)))
        return self.blocks[key]

    def differ(self, op, k1, k2):
        return any_differ(self.block(op, k1), self.block(op, k2))


class _LoopStep(_Steps):
    """``_Steps`` around step ``s`` of the loop, knowing whether it is the first or the last."""

    def __init__(self, run: _Run, s):
        super().__init__(run, s)
        self.first = s == 0
        self.not_first = jnp.logical_not(self.first)
        self.last = s == run.num_steps - 1

    def changed(self, op):  # the block differs from the previous step's
        return jnp.logical_or(self.first, self.differ(op, 0, -1))

    def will_change(self, op):  # the block differs from the next step's, or this is the last step
        return jnp.logical_or(self.last, self.differ(op, 0, 1))


def _prologue(run: _Run) -> tuple[list[Any], list[Any]]:
    """The first n - 1 fetches of every input with n buffers: how many each of ours
    made, and the BufferedRefs of the operands scheduled through their methods."""
    prologue = _Steps(run, jnp.int32(0))
    with run.context(prologue):
        brefs = [protocol.prologue(run, prologue, op) for op in run.protos]
    fetched0 = []
    for op in run.ins:
        n = op.bref.buffer_count
        count = jnp.int32(0)
        for t in range(n - 1):
            if run.static and t >= run.num_steps:
                break
            pred = True if t == 0 else prologue.differ(op, t, t - 1)
            if not run.static:
                pred = jnp.logical_and(t < run.num_steps, pred)
            run_when(pred, functools.partial(op.copy_in, prologue.block(op, t), lax.rem(count, n)))
            count = count + jnp.asarray(pred, jnp.int32)
        fetched0.append(count)
    return fetched0, brefs


def _step(run: _Run, s, carry):
    """One step of the pipeline's loop (``carry``: per input, the blocks fetched
    and used so far; per output, the blocks written back)."""
    fetched, used, written, regs = (list(c) for c in carry)
    at = _LoopStep(run, s)
    # In/out operands finish writing back their previous block before
    # their slots are refilled.
    for k, op in enumerate(run.outs):
        if op.bref.is_input and op.bref.buffer_count == 2:
            pred = jnp.logical_and(at.not_first, at.changed(op))
            prev = functools.partial(op.copy_out, at.block(op, -1), lax.rem(written[k] + 1, 2))
            run_when(pred, functools.partial(prev, start=False, wait=True))
    slots = _fetch_inputs(run, at, fetched, used)
    for k, op in enumerate(run.outs):
        if not op.bref.is_input:
            slots.update((id(m), lax.rem(written[k], op.bref.buffer_count)) for m in op.members)
    brefs = [protocol.with_registers(op.bref, r) for op, r in zip(run.protos, regs)]
    with run.context(at):
        brefs = [protocol.before_body(run, at, op, b) for op, b in zip(run.protos, brefs)]
    _call_body(run, at, slots, {id(op): b.current_ref for op, b in zip(run.protos, brefs)})
    _write_back(run, at, slots, written)
    with run.context(at):
        brefs = [protocol.after_body(run, at, op, b) for op, b in zip(run.protos, brefs)]
    return tuple(fetched), tuple(used), tuple(written), tuple(protocol.registers(b) for b in brefs)


def _fetch_inputs(run: _Run, at: _LoopStep, fetched: list, used: list) -> dict[int, Any]:
    """Inputs: fetch n - 1 steps ahead, then wait for this step's block. Counts
    into ``fetched`` and ``used``; returns each member's slot (by ``id``)."""
    s = at.s
    slots: dict[int, Any] = {}
    for k, op in enumerate(run.ins):
        n = op.bref.buffer_count
        ch = at.changed(op)
        used[k] = used[k] + jnp.logical_and(ch, at.not_first).astype(jnp.int32)
        slot = lax.rem(used[k], n)
        if n == 1:
            run_when(ch, functools.partial(op.copy_in, at.block(op, 0), slot, wait=True))
        else:
            pred = jnp.logical_and(s + (n - 1) < run.num_steps, at.differ(op, n - 1, n - 2))
            run_when(pred, functools.partial(op.copy_in, at.block(op, n - 1), lax.rem(fetched[k], n)))
            fetched[k] = fetched[k] + pred.astype(jnp.int32)
            run_when(ch, functools.partial(op.copy_in, at.block(op, 0), slot, start=False, wait=True))
        slots.update((id(m), slot) for m in op.members)
    return slots


def _call_body(run: _Run, at: _LoopStep, slots: dict[int, Any], current: dict[int, Any]) -> None:
    """The body on this step's blocks: buffer slots, views of unbuffered Refs, or the
    ``current_ref`` of operands scheduled through their methods (``current``, by ``id``)."""
    block_refs: list[Any] = []
    for op in run.plan:
        if op is None:
            block_refs.append(None)
        elif id(op) in current:
            block_refs.append(current[id(op)])
        elif op.bref.is_buffered:
            block_refs.append(op.bref._window_ref_at(slots[id(op)]))
        else:
            block_refs.append(op.ref.at[block_indexer(op.spec, at.block(op, 0))])
    idx = at.indices(0)
    with plb.kernel_context(plb.KernelContext(run.local_grid, idx, run.ctx_name)):
        if run.body_prologue is not None:
            run.body_prologue()
        args = run.rebuild(block_refs)
        if run.explicit_indices:
            run.body(PipelineStep(idx, at.s), *args, *run.scratches)
        else:
            run.body(*args, *run.scratches)


def _write_back(run: _Run, at: _LoopStep, slots: dict[int, Any], written: list) -> None:
    """Outputs: write back when the block is about to change (counted in ``written``)."""
    for k, op in enumerate(run.outs):
        slot = slots[id(op.members[0])]
        wc = at.will_change(op)
        if op.bref.buffer_count == 1:
            run_when(wc, functools.partial(op.copy_out, at.block(op, 0), slot, wait=True))
        else:
            run_when(wc, functools.partial(op.copy_out, at.block(op, 0), slot))
            if not op.bref.is_input:
                pred = jnp.logical_and(at.not_first, at.changed(op))
                prev = functools.partial(op.copy_out, at.block(op, -1), lax.rem(slot + 1, 2))
                run_when(pred, functools.partial(prev, start=False, wait=True))
        written[k] = written[k] + wc.astype(jnp.int32)
