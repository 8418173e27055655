"""``emit_pipeline``: a software pipeline over HBM Refs, written inside a kernel.

``emit_pipeline(body, grid=..., in_specs=..., out_specs=...)(*hbm_refs)`` runs
``body(*block_refs)`` once per step of ``grid`` (lexicographic order), with
each operand's block copied between its HBM Ref and a VMEM buffer by DMAs, as
``pallas_call`` does for its own grid. It is traced into the kernel as plain
kernel code (``run_scoped`` buffers and DMA semaphores, a ``fori_loop``,
``pl.when`` and DMAs), so TPU interpret mode runs it like any other kernel.

The schedule, per operand (``n`` = its buffer count, ``pl.Buffered(n)``,
default 2; ``b_t`` = its block index at step ``t``; a *change* is a step whose
block index differs from the previous step's):

* inputs: the block of each change is DMA'd into slot ``change % n``, ``n - 1``
  steps ahead of its use (the prologue starts the first ``n - 1``); a step
  whose block changed waits for its DMA before the body runs. With ``n == 1``
  the copy is started and waited for at the step that needs it. Unchanged
  blocks are not copied again.
* outputs (``n`` of 1 or 2): the body writes slot ``run % n``; when the block
  index is about to change (and at the last step) the slot is DMA'd to HBM.
  With ``n == 2`` that copy is waited for one step later (after the next
  body), with ``n == 1`` at once. ``should_accumulate_out`` makes an output
  also an input: its block is loaded from HBM when the index changes, so the
  body accumulates into what the output held.
* a block that is the whole array gets one buffer (copied in before the
  first step and out after the last), unless ``pipeline_mode`` says otherwise;
  a spec in ``pl.ANY``/HBM, or in the memory space its Ref already lives in,
  gets no buffer: the body sees a view of the Ref.

Blocks that do not divide the array: a dimension whose block size does not
divide it is allowed where JAX allows it (the block size is a multiple of the
memory tiling of that dimension, from ``tpu_info.infer_tiling``); the last
block's DMA then copies, in interpret mode (which has no tile padding), only
the elements that exist, the rest of the buffer keeping stale data, and in
Mosaic whole memory tiles (its size rounded up to the tiling, into the edge
tile's padding, as JAX's pipeline copies it: Mosaic slices tiled dimensions by
whole tiles), from the last block's static start (the DMA's ``padded_shape``).
A Ref view (``ref.at[...]``) has no padding of its own: its edge is copied
exactly, which Mosaic takes only where the last block is whole tiles.

A ``pl.BoundedSlice(n)`` dimension is a window of traced size: its index map
returns ``pl.ds(start, size)``, ``size <= n``; the buffer has ``n`` along it and
the copy takes ``size`` clamped to the end of the array, rounded up to the
dimension's memory tiling as in JAX's pipeline (``_Operand.bounded_sizes``;
tiling 1 on leading dims), with the same interpret/Mosaic split at the edge.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

import pallas as pl
from pallas import backend as plb
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language.pipeline_buffers import (
    _WHERE,
    BufferType,
    _as_index,
    _block_indexer,
    _call_index_map,
    _differ,
    _err,
    _unravel,
    _when,
)
from pallas_tpu._src.language.pipeline_plan import _make_pipeline_allocations, _Operand, _plan

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
        raise _err(NotImplementedError, f"{_WHERE}: cannot split the grid over a dynamic number of cores")
    parallel = [i for i, s in enumerate(semantics) if s is tpu_core.PARALLEL]
    if not parallel:
        raise _err(
            NotImplementedError,
            f"{_WHERE}: splitting the grid over {num_cores} cores needs a 'parallel' axis in "
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
        raise _err(NotImplementedError, f"{_WHERE}: cannot split dynamic grid axes over cores")
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


def emit_pipeline(
    body: Callable[..., None],
    *,
    grid: tuple[int | jax.Array, ...],
    in_specs=(),
    out_specs=(),
    tiling=None,
    core_axis: int | None = None,
    core_axis_name: str | None = None,
    dimension_semantics=None,
    trace_scopes: bool = True,
    no_pipelining: bool = False,
    should_accumulate_out: bool | Sequence[bool] = False,
    _explicit_indices: bool = False,
):
    """A pipeline to call inside a kernel: ``body`` over ``grid`` with blocks
    of HBM Refs double-buffered through VMEM (see the module docstring).

    Args:
      body: called as ``body(*block_refs, *scratches)`` once per grid step
        (``body(pipeline_step, ...)`` with ``_explicit_indices``);
        ``pl.program_id``/``pl.num_programs`` in it (and in the index maps)
        refer to the pipeline's grid.
      grid: the pipeline's grid (ints, or traced int32 scalars).
      in_specs, out_specs: one ``pl.BlockSpec`` per input / output Ref (or
        pytrees of them); ``pipeline_mode=pl.Buffered(n)`` sets the buffer count.
      tiling: the ``pltpu.Tiling`` assumed for blocks that do not divide their
        array (default: the TensorCore tiling of the modeled chip).
      core_axis, core_axis_name: split the grid's first ``parallel`` axis over
        the cores of this kernel grid axis / this named mesh axis.
      dimension_semantics: one ``"parallel"``/``"arbitrary"`` per grid axis.
      trace_scopes: accepted for compatibility (named scopes in profiles).
      no_pipelining: every copy synchronous (one buffer per operand).
      should_accumulate_out: per output (or one bool for all): load the output's
        block from HBM when it changes, so the body can accumulate into it.

    Returns:
      ``pipeline(*refs, scratches=None, allocations=None, body_prologue=None)``.
    """
    del trace_scopes
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    for g in grid:
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer, jax.Array)):
            raise _err(TypeError, f"{_WHERE}: grid entries must be ints or int32 scalars, got grid={grid!r}")
        if isinstance(g, (int, np.integer)) and g <= 0:
            raise _err(ValueError, f"{_WHERE}: grid entries must be strictly positive, got grid={grid!r}")
    grid = tuple(int(g) if isinstance(g, (int, np.integer)) else g for g in grid)
    if core_axis is not None and core_axis_name is not None:
        raise _err(ValueError, f"{_WHERE}: give core_axis or core_axis_name, not both")
    if dimension_semantics is None:
        semantics = (tpu_core.ARBITRARY,) * len(grid)
    else:
        semantics = tuple(
            tpu_core.normalize_semantics(s, f"{_WHERE} dimension_semantics[{i}]")
            for i, s in enumerate(dimension_semantics)
        )
        if len(semantics) != len(grid):
            raise _err(
                ValueError,
                f"{_WHERE}: dimension_semantics has {len(semantics)} entries but grid={grid} has {len(grid)} axes",
            )
    name = getattr(body, "__name__", "body")

    def pipeline(*refs, scratches=None, allocations=None, body_prologue=None):
        ispecs, ospecs = in_specs, out_specs
        if isinstance(allocations, PrefetchedInputs):
            allocations.check_for(refs[: len(jax.tree.leaves(ispecs))], ispecs)
            allocations = None  # the first input blocks are fetched at the start: see PrefetchedInputs
        if allocations is not None and not ispecs and not ospecs:
            # The specs come with the allocations (JAX allows this too).
            allocs = list(allocations)
            ispecs = tuple(b.spec for b in allocs if b is not None and b.buffer_type is BufferType.INPUT)
            ospecs = tuple(b.spec for b in allocs if b is not None and b.buffer_type is not BufferType.INPUT)
        plan, rebuild = _plan(refs, ispecs, ospecs, tiling, should_accumulate_out, allocations)
        if no_pipelining:
            for op in plan:
                if op is not None and op.bref.is_buffered:
                    op.bref = dataclasses.replace(op.bref, _buffer_count=1)
        run = functools.partial(
            _run_pipeline,
            body,
            plan,
            rebuild,
            grid=grid,
            semantics=semantics,
            core_axis=core_axis if core_axis is not None else core_axis_name,
            scratches=() if scratches is None else tuple(scratches),
            body_prologue=body_prologue,
            explicit_indices=_explicit_indices,
            name=name,
        )
        needs_alloc = [
            op for op in plan if op is not None and op.bref.is_buffered and _is_type(op.bref.window_ref)
        ]
        if not needs_alloc:
            run()
            return

        def scoped(brefs):
            for op, b in zip(needs_alloc, brefs):
                op.bref = b
            run()

        pl.run_scoped(scoped, [op.bref for op in needs_alloc])

    return pipeline


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
    groups: dict[Any, list[_Operand]] = {}
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


def _is_type(x) -> bool:
    return isinstance(x, pl.MemoryRef)


def _run_pipeline(
    body, plan, rebuild, *, grid, semantics, core_axis, scratches, body_prologue, explicit_indices, name
):
    num_cores, core_id = _core_info(core_axis)
    local_grid, offsets = _partition_grid(grid, semantics, num_cores, core_id)
    static = all(isinstance(g, int) for g in local_grid)
    num_steps = math.prod(local_grid) if static else functools.reduce(lambda a, b: a * b, local_grid)
    ops = [op for op in plan if op is not None]
    groups = _group([op for op in ops if op.bref.is_buffered])
    ins = [g for g in groups if g.bref.is_input]
    outs = [g for g in groups if g.bref.is_output]
    ctx_name = f"emit_pipeline body {name!r}"

    def indices_at(t):
        # The steps around this one wrap around the grid, as in JAX's pipeline: an index map
        # never sees grid indices outside the grid (step -1 of step 0, lookahead past the
        # last step), where a lookup in a scalar-prefetch table would read out of bounds.
        # Blocks at wrapped steps are only compared under predicates that are then false.
        t = lax.rem(jnp.asarray(t, jnp.int32) + num_steps, jnp.maximum(jnp.asarray(num_steps, jnp.int32), 1))
        return tuple(i + o for i, o in zip(_unravel(t, local_grid), offsets))

    class Steps:
        """Grid indices and block indices at the steps around one step,
        computed once (named by their offset from the step)."""

        def __init__(self, s):
            self.s = s
            self.idx: dict[int, tuple] = {}
            self.blocks: dict[tuple[int, int], tuple] = {}

        def indices(self, k):
            if k not in self.idx:
                self.idx[k] = indices_at(self.s + k)
            return self.idx[k]

        def block(self, op, k):
            key = (id(op), k)
            if key not in self.blocks:
                idx = self.indices(k)
                with plb.kernel_context(plb.KernelContext(local_grid, idx, ctx_name)):
                    self.blocks[key] = tuple(map(_as_index, _call_index_map(op.spec, idx, op.origin)))
            return self.blocks[key]

        def differ(self, op, k1, k2):
            return _differ(self.block(op, k1), self.block(op, k2))

    # Prologue: the first n - 1 fetches of every input with n buffers.
    prologue = Steps(jnp.int32(0))
    fetched0 = []
    for op in ins:
        n = op.bref.buffer_count
        count = jnp.int32(0)
        for t in range(n - 1):
            if static and t >= num_steps:
                break
            pred = True if t == 0 else prologue.differ(op, t, t - 1)
            if not static:
                pred = jnp.logical_and(t < num_steps, pred)
            _when(pred, functools.partial(op.copy_in, prologue.block(op, t), lax.rem(count, n)))
            count = count + jnp.asarray(pred, jnp.int32)
        fetched0.append(count)

    def step(s, carry):
        fetched, used, written = (list(c) for c in carry)
        at = Steps(s)
        first = s == 0
        not_first = jnp.logical_not(first)
        last = s == num_steps - 1

        def changed(op):  # the block differs from the previous step's
            return jnp.logical_or(first, at.differ(op, 0, -1))

        def will_change(op):  # the block differs from the next step's, or this is the last step
            return jnp.logical_or(last, at.differ(op, 0, 1))

        # In/out operands finish writing back their previous block before
        # their slots are refilled.
        for k, op in enumerate(outs):
            if op.bref.is_input and op.bref.buffer_count == 2:
                pred = jnp.logical_and(not_first, changed(op))
                prev = functools.partial(op.copy_out, at.block(op, -1), lax.rem(written[k] + 1, 2))
                _when(pred, functools.partial(prev, start=False, wait=True))
        # Inputs: fetch n - 1 steps ahead, then wait for this step's block.
        slots = {}
        for k, op in enumerate(ins):
            n = op.bref.buffer_count
            ch = changed(op)
            used[k] = used[k] + jnp.logical_and(ch, not_first).astype(jnp.int32)
            slot = lax.rem(used[k], n)
            if n == 1:
                _when(ch, functools.partial(op.copy_in, at.block(op, 0), slot, wait=True))
            else:
                pred = jnp.logical_and(s + (n - 1) < num_steps, at.differ(op, n - 1, n - 2))
                _when(pred, functools.partial(op.copy_in, at.block(op, n - 1), lax.rem(fetched[k], n)))
                fetched[k] = fetched[k] + pred.astype(jnp.int32)
                _when(ch, functools.partial(op.copy_in, at.block(op, 0), slot, start=False, wait=True))
            slots.update((id(m), slot) for m in op.members)
        for k, op in enumerate(outs):
            if not op.bref.is_input:
                slots.update((id(m), lax.rem(written[k], op.bref.buffer_count)) for m in op.members)

        block_refs = []
        for op in plan:
            if op is None:
                block_refs.append(None)
            elif op.bref.is_buffered:
                block_refs.append(op.bref.window_ref.at[slots[id(op)]])
            else:
                block_refs.append(op.ref.at[_block_indexer(op.spec, at.block(op, 0))])
        idx = at.indices(0)
        with plb.kernel_context(plb.KernelContext(local_grid, idx, ctx_name)):
            if body_prologue is not None:
                body_prologue()
            args = rebuild(block_refs)
            if explicit_indices:
                body(PipelineStep(idx, s), *args, *scratches)
            else:
                body(*args, *scratches)

        # Outputs: write back when the block is about to change.
        for k, op in enumerate(outs):
            slot = slots[id(op.members[0])]
            wc = will_change(op)
            if op.bref.buffer_count == 1:
                _when(wc, functools.partial(op.copy_out, at.block(op, 0), slot, wait=True))
            else:
                _when(wc, functools.partial(op.copy_out, at.block(op, 0), slot))
                if not op.bref.is_input:
                    pred = jnp.logical_and(not_first, changed(op))
                    prev = functools.partial(op.copy_out, at.block(op, -1), lax.rem(slot + 1, 2))
                    _when(pred, functools.partial(prev, start=False, wait=True))
            written[k] = written[k] + wc.astype(jnp.int32)
        return tuple(fetched), tuple(used), tuple(written)

    carry = (tuple(fetched0), tuple(jnp.int32(0) for _ in ins), tuple(jnp.int32(0) for _ in outs))
    _, _, written = lax.fori_loop(0, num_steps, step, carry)
    # Epilogue: wait for the last write-back of double-buffered outputs.
    at = Steps(jnp.asarray(num_steps - 1, jnp.int32))
    for k, op in enumerate(outs):
        if op.bref.buffer_count == 2:
            op.copy_out(at.block(op, 0), lax.rem(written[k] + 1, 2), start=False, wait=True)


def emit_pipeline_with_allocations(body, *, grid, in_specs=(), out_specs=(), should_accumulate_out=False):
    """``(pipeline, make_allocations)``: ``make_allocations(*refs)`` gives the
    pipeline's BufferedRefs (buffers as types) to allocate once, e.g. with
    ``pl.run_scoped``, and pass to several ``pipeline(..., allocations=...)``
    calls."""
    make_allocations = functools.partial(
        _make_pipeline_allocations,
        in_specs=in_specs,
        out_specs=out_specs,
        grid=grid,
        should_accumulate_out=should_accumulate_out,
    )
    pipeline = emit_pipeline(
        body, grid=grid, in_specs=in_specs, out_specs=out_specs, should_accumulate_out=should_accumulate_out
    )
    return pipeline, make_allocations


def emit_pipeline_with_async_prefetch(
    body,
    *,
    grid,
    in_specs=(),
    out_specs=(),
    mesh=None,
    tiling=None,
    core_axis=None,
    core_axis_name=None,
    dimension_semantics=None,
    trace_scopes: bool = True,
    no_pipelining: bool = False,
    _explicit_indices: bool = False,
):
    """``(pipeline, async_prefetch)`` (JAX's signature): ``pipeline`` is
    ``emit_pipeline(...)``; ``async_prefetch(*inputs)``, called outside the
    kernel, starts the DMAs of the inputs' first blocks and returns them as
    ``allocations`` for ``pipeline(..., allocations=...)`` in a later kernel
    over ``mesh``. In interpret mode the returned ``PrefetchedInputs`` stands
    for those in-flight blocks: the pipeline that takes it lands them when it
    starts (see ``PrefetchedInputs``)."""
    del mesh
    pipeline = emit_pipeline(
        body,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        tiling=tiling,
        core_axis=core_axis,
        core_axis_name=core_axis_name,
        dimension_semantics=dimension_semantics,
        trace_scopes=trace_scopes,
        no_pipelining=no_pipelining,
        _explicit_indices=_explicit_indices,
    )

    def async_prefetch(*inputs):
        specs = list(in_specs) if isinstance(in_specs, (list, tuple)) else [in_specs]
        if len(inputs) != len(specs) or any(
            jax.tree.structure(x) != jax.tree.structure(sp, is_leaf=lambda v: v is None)
            for x, sp in zip(inputs, specs)
        ):
            raise _err(
                ValueError,
                f"pltpu.emit_pipeline_with_async_prefetch: async_prefetch takes one input per in_spec "
                f"({len(specs)}), with the in_specs' structure; got {len(inputs)} inputs",
            )
        return PrefetchedInputs(tuple(_shape_dtype(x) for x in jax.tree.leaves(inputs)))

    return pipeline, async_prefetch


def _shape_dtype(x):
    return (tuple(x.shape), jnp.dtype(x.dtype))


@dataclasses.dataclass(frozen=True)
class PrefetchedInputs:
    """What ``async_prefetch`` returns: the first input blocks of a pipeline,
    fetched ahead of the kernel that runs it. On a TPU that overlaps the
    fetch with earlier work; the data are the inputs' first blocks either way
    (the inputs are immutable JAX arrays), so interpret mode fetches them when
    the pipeline starts, which gives the same results. The pipeline checks
    that it runs on inputs of the prefetched shapes and dtypes."""

    inputs: tuple[tuple[tuple[int, ...], Any], ...]

    def __len__(self) -> int:
        return len(self.inputs)

    def check_for(self, refs, ispecs) -> None:
        got = tuple(_shape_dtype(r) for r in jax.tree.leaves(refs))
        if got != self.inputs:
            raise _err(
                ValueError,
                f"{_WHERE}: allocations from async_prefetch were made for inputs {self._show(self.inputs)} "
                f"but the pipeline runs on {self._show(got)}",
            )

    @staticmethod
    def _show(items) -> str:
        return ", ".join(f"{d}{list(s)}" for s, d in items)
