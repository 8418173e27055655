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

This module holds the API (``emit_pipeline`` and its two variants, which check
their arguments and plan the operands: ``pipeline_plan.py``); the loop that
runs the schedule is ``pipeline_schedule.py``'s, the operands' buffers and
block indexing ``pipeline_buffers.py``'s. ``BufferedRef`` subclasses given as
``allocations`` (a flat sequence, or a pytree mirroring the Refs) are scheduled
through their own methods, as JAX's pipeline schedules every operand:
``pipeline_protocol.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas as pl
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language.pipeline_buffers import WHERE, BufferType, pipeline_error
from pallas_tpu._src.language.pipeline_plan import allocation_leaves, pipeline_allocations, plan_pipeline
from pallas_tpu._src.language.pipeline_schedule import (
    PipelineStep as PipelineStep,  # the public API imports it from here
)
from pallas_tpu._src.language.pipeline_schedule import run_pipeline


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
    grid, semantics = _checked_grid(grid, core_axis, core_axis_name, dimension_semantics)
    name = getattr(body, "__name__", "body")

    def pipeline(*refs, scratches=None, allocations=None, body_prologue=None):
        plan, rebuild = _plan_call(
            refs, in_specs, out_specs, tiling, should_accumulate_out, no_pipelining, allocations
        )
        run = functools.partial(
            run_pipeline,
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


def _checked_grid(grid, core_axis, core_axis_name, dimension_semantics):
    """``emit_pipeline``'s grid (a tuple of ints and traced scalars) and its
    dimension semantics, checked."""
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    for g in grid:
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer, jax.Array)):
            raise pipeline_error(
                TypeError, f"{WHERE}: grid entries must be ints or int32 scalars, got grid={grid!r}"
            )
        if isinstance(g, (int, np.integer)) and g <= 0:
            raise pipeline_error(
                ValueError, f"{WHERE}: grid entries must be strictly positive, got grid={grid!r}"
            )
    grid = tuple(int(g) if isinstance(g, (int, np.integer)) else g for g in grid)
    if core_axis is not None and core_axis_name is not None:
        raise pipeline_error(ValueError, f"{WHERE}: give core_axis or core_axis_name, not both")
    if dimension_semantics is None:
        semantics = (tpu_core.ARBITRARY,) * len(grid)
    else:
        semantics = tuple(
            tpu_core.normalize_semantics(s, f"{WHERE} dimension_semantics[{i}]")
            for i, s in enumerate(dimension_semantics)
        )
        if len(semantics) != len(grid):
            raise pipeline_error(
                ValueError,
                f"{WHERE}: dimension_semantics has {len(semantics)} entries but grid={grid} has {len(grid)} axes",
            )
    return grid, semantics


def _plan_call(refs, ispecs, ospecs, tiling, should_accumulate_out, no_pipelining, allocations):
    """The plan of one call of a pipeline on ``refs`` (``plan_pipeline``), its specs taken
    from ``allocations`` when the pipeline was made without them."""
    if isinstance(allocations, PrefetchedInputs):
        allocations.check_for(refs[: len(jax.tree.leaves(ispecs))], ispecs)
        allocations = None  # the first input blocks are fetched at the start: see PrefetchedInputs
    if allocations is not None and not ispecs and not ospecs:
        # The specs come with the allocations (JAX allows this too).
        allocs = allocation_leaves(allocations)
        ispecs = tuple(b.spec for b in allocs if b is not None and b.buffer_type is BufferType.INPUT)
        ospecs = tuple(b.spec for b in allocs if b is not None and b.buffer_type is not BufferType.INPUT)
    plan, rebuild = plan_pipeline(refs, ispecs, ospecs, tiling, should_accumulate_out, allocations)
    if no_pipelining:
        for op in plan:
            if op is not None and op.bref.is_buffered:
                op.bref = dataclasses.replace(op.bref, _buffer_count=1)
    return plan, rebuild


def _is_type(x) -> bool:
    return isinstance(x, pl.MemoryRef)


def emit_pipeline_with_allocations(body, *, grid, in_specs=(), out_specs=(), should_accumulate_out=False):
    """``(pipeline, make_allocations)``: ``make_allocations(*refs)`` gives the
    pipeline's BufferedRefs (buffers as types) to allocate once, e.g. with
    ``pl.run_scoped``, and pass to several ``pipeline(..., allocations=...)``
    calls."""
    make_allocations = functools.partial(
        pipeline_allocations,
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
            raise pipeline_error(
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
            raise pipeline_error(
                ValueError,
                f"{WHERE}: allocations from async_prefetch were made for inputs {self._show(self.inputs)} "
                f"but the pipeline runs on {self._show(got)}",
            )

    @staticmethod
    def _show(items) -> str:
        return ", ".join(f"{d}{list(s)}" for s, d in items)
