"""``emit_pipeline``'s plan: one ``Operand`` per pipelined Ref, its spec checked
and normalized at trace time (blocks that do not divide the array, ``pl.BoundedSlice``
dims and their memory tiling), and its copies in and out. See ``pipeline.py``'s
docstring for the schedule and the edge rules."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

import pallas as pl
from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import primitives as tpu_prims
from pallas_tpu._src.language import tpu_info
from pallas_tpu._src.language.pipeline_buffers import (
    HBM,
    SMEM,
    VMEM,
    WHERE,
    BufferedRef,
    BufferedRefBase,
    BufferType,
    block_indexer,
    dim_size,
    pipeline_error,
    run_when,
)

# ---------------------------------------------------------------------------
# The plan: one Operand per pipelined Ref, checked at trace time.


@dataclasses.dataclass
class Operand:
    origin: str  # "in_specs[0]", for messages
    bref: BufferedRef
    ref: Any  # the Ref (or view) the blocks come from / go to
    shape: tuple[int, ...]
    # dim -> (number of blocks, size of the last block, that size rounded up to the tiling)
    partial: dict[int, tuple[int, int, int]]
    # whether the operand is a whole Ref (not a view): its edge tiles end in tile padding
    whole_ref: bool = False
    # pl.BoundedSlice dim -> the memory tiling its copies round up to (None: unknown)
    bounded: dict[int, int | None] = dataclasses.field(default_factory=dict)
    # scheduled through its BufferedRef's methods, as JAX's scheduler does (a subclass
    # given in ``allocations``: pipeline_protocol.py), not by our schedule
    protocol: bool = False

    @property
    def spec(self):
        return self.bref.spec

    def sizes(self, combo, padded=False):
        """Per-dim DMA sizes for one choice of (full, last) per partial dim
        (``padded``: the last block's sizes rounded up to whole memory tiles)."""
        sizes = [dim_size(bd) for bd in self.spec.block_shape]
        for (d, (_, last, rounded)), is_last in zip(self.partial.items(), combo):
            if is_last:
                sizes[d] = rounded if padded else last
        return sizes

    def bounded_sizes(self, block_indices) -> dict[int, Any]:
        """The copy sizes of the ``pl.BoundedSlice`` dims at these block indices, as JAX's
        pipeline computes them: the slice's size clamped to the end of the array, rounded up
        to the dim's memory tiling (a Mosaic copy slices tiled dims by whole tiles), and here
        also cut at the end of the array (interpret mode has no tile padding; the Mosaic
        lowering rounds it up again, ``_RoundUp``)."""
        out = {}
        for d, t in self.bounded.items():
            start, size = block_indices[d].start, block_indices[d].size
            if t is None:
                out[d] = size
                continue
            left = self.shape[d] - start
            out[d] = _minimum(_round_up(_minimum(size, left), t), left)
        return out

    def per_block(self, block_indices, fn):
        """Calls ``fn(hbm_view, window_indexer_tail, padded)`` for this
        block's shape: under ``pl.when`` per variant when the last block may be
        cut. A cut block is copied as its exact view in interpret mode and as
        whole memory tiles in Mosaic (``padded``, the DMA's shape there, as
        JAX's pipeline copies it: Mosaic slices tiled dims by whole tiles); its
        start is static (the last block's). ``pl.BoundedSlice`` dims are copied
        at their traced sizes (``bounded_sizes``); where one rounds to tiles,
        ``padded`` is a ``_RoundUp`` of the copy's sizes."""
        bounded = self.bounded_sizes(block_indices) if self.bounded else {}
        if not self.partial and not bounded:
            fn(self.ref.at[block_indexer(self.spec, block_indices)], (), None)
            return
        conds = [block_indices[d] == nb - 1 for d, (nb, _, _) in self.partial.items()]
        # A dim with one block (the block larger than the array) has only its last block:
        # a whole-block copy there could not even be traced (tokamax's gmm_v2, tile_k > k).
        choices = [(True,) if nb == 1 else (False, True) for nb, _, _ in self.partial.values()]
        for combo in itertools.product(*choices):
            sizes = self.sizes(combo)
            for d, n in bounded.items():
                sizes[d] = n
            tail = tuple(pl.ds(0, s) for s in sizes if s is not None)
            padded = None
            if bounded and self.whole_ref:
                # Round up the bounded dims and the cut ones (a cut block's size rounds up
                # to its rounded size); a leading dim (tiling 1) needs nothing.
                tiles = {d: t for d, t in self.bounded.items() if t is not None and t > 1}
                tiles.update(
                    (d, r) for (d, (_, _, r)), is_last in zip(self.partial.items(), combo) if is_last
                )
                if tiles:
                    dims = [d for d, s in enumerate(sizes) if s is not None]
                    padded = _RoundUp(tuple(tiles.get(d, 1) for d in dims))
            elif any(combo) and self.whole_ref:
                padded = tuple(s for s in self.sizes(combo, padded=True) if s is not None)
            indices = list(block_indices)
            pred = True
            for (d, (nb, _, _)), c, is_last in zip(self.partial.items(), conds, combo):
                if is_last:
                    indices[d] = nb - 1
                if nb == 1:
                    continue
                c = c if is_last else jnp.logical_not(c)
                pred = c if pred is True else jnp.logical_and(pred, c)

            def go(sizes=sizes, tail=tail, padded=padded, indices=tuple(indices)):
                fn(self.ref.at[block_indexer(self.spec, indices, sizes)], tail, padded)

            run_when(pred, go)

    def _copy(self, src, dst, sem, padded, start, wait):
        copy = tpu_prims.make_async_copy(src, dst, sem)
        if isinstance(padded, _RoundUp):
            copy.layout = dataclasses.replace(copy.layout, padded_tiling=padded.tiles)
        elif padded is not None and padded != copy.shape:
            copy.layout = dataclasses.replace(copy.layout, padded_shape=padded)
        if start:
            copy.start()
        if wait:
            copy.wait()

    def copy_in(self, block_indices, slot, *, start=True, wait=False):
        def fn(src, tail, padded):
            window = self.bref._window_ref_at(slot, tail)
            self._copy(src, window, self.bref.sem_recvs.at[slot], padded, start, wait)

        self.per_block(block_indices, fn)

    def copy_out(self, block_indices, slot, *, start=True, wait=False):
        def fn(dst, tail, padded):
            window = self.bref._window_ref_at(slot, tail)
            self._copy(window, dst, self.bref.sem_sends.at[slot], padded, start, wait)

        self.per_block(block_indices, fn)


@dataclasses.dataclass(frozen=True)
class _RoundUp:
    """A copy whose sizes Mosaic rounds up to these multiples (one per dim of the block
    that is not squeezed; 1: as is): a ``pl.BoundedSlice`` block's traced size copied as
    whole memory tiles, into the edge tile's padding (the DMA's ``padded_tiling``)."""

    tiles: tuple[int, ...]


def _minimum(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return min(int(a), int(b))
    return jnp.minimum(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _round_up(n, t: int):
    if t == 1:
        return n
    if isinstance(n, (int, np.integer)):
        return -(-int(n) // t) * t
    return pl.multiple_of(lax.div(n + (t - 1), jnp.int32(t)) * t, t)


def _ref_space_and_aval(ref, origin):
    try:
        base, leaves, tree = plb.flatten_ref(ref, f"{WHERE}: {origin}")
    except TypeError:
        raise pipeline_error(
            TypeError,
            f"{WHERE}: the operand of {origin} must be a Ref (e.g. a kernel argument in pl.ANY or "
            f"pltpu.HBM), got {type(ref).__name__}",
        ) from None
    base_aval = compat.get_aval(base)
    if plb.semaphore_kind(base_aval) is not None:
        raise pipeline_error(
            TypeError, f"{WHERE}: the operand of {origin} is a semaphore; pipelines move data Refs"
        )
    aval = plb.transformed_aval(base_aval, plb.unflatten_transforms(tree, leaves))
    space = getattr(base_aval, "memory_space", None)
    return (pl.ANY if space is None else space), aval


def _has_tile_padding(ref, dims) -> bool:
    """Whether the edges of ``ref`` along ``dims`` are the edges of its array's memory
    tiles, so that a copy may round up into the tile padding there: a whole Ref, or a
    reshape of one that keeps those of its two minor dimensions (tokamax's gmm_v2 pipelines
    ``lhs.reshape(-1, 8, k)``, rounding its lanes); not an ``.at[...]`` view, whose edge
    may be in the middle of the data."""
    if not isinstance(ref, compat.TransformedRef):
        return True
    if not ref.transforms or not all(isinstance(t, compat.ReshapeTransform) for t in ref.transforms):
        return False
    base, view = tuple(compat.get_aval(ref.ref).shape), tuple(ref.shape)
    for d in dims:
        k = len(view) - d  # 1: the minor dimension, 2: the second-minor
        if k > 2 or len(base) < k or view[-k:] != base[-k:]:
            return False
    return True


def _rounded_dims(partial, bounded) -> list[int]:
    """The dims whose copies round up to the memory tiling."""
    cut = [d for d, (_, last, rounded) in partial.items() if rounded != last]
    return [*cut, *(d for d, t in bounded.items() if t is not None and t > 1)]


def _is_full_block(spec, shape) -> bool:
    bs = spec.block_shape
    if bs is None:
        return True
    if len(bs) != len(shape):
        return False
    for bd, n in zip(bs, shape):
        if isinstance(bd, pl.Blocked):
            bd = bd.block_size
        if not isinstance(bd, int) or bd != n:
            return False
    return True


def _normalize_spec(spec, aval, origin):
    if not isinstance(spec, pl.BlockSpec):
        raise pipeline_error(
            TypeError, f"{WHERE}: {origin} must be a pl.BlockSpec, got {type(spec).__name__}"
        )
    if spec.block_shape is None:
        spec = dataclasses.replace(spec, block_shape=tuple(aval.shape))
    block_shape = tuple(spec.block_shape)
    if len(block_shape) != len(aval.shape):
        raise pipeline_error(
            ValueError,
            f"{WHERE}: {origin}: block_shape {block_shape} has {len(block_shape)} dimensions but the "
            f"operand has shape {tuple(aval.shape)}",
        )
    for bd in block_shape:
        if isinstance(bd, pl.Element) and tuple(bd.padding) != (0, 0):
            raise pipeline_error(
                NotImplementedError, f"{WHERE}: {origin}: pl.Element with padding is not supported"
            )
        size = dim_size(bd)
        if size is not None and size <= 0:
            raise pipeline_error(
                ValueError, f"{WHERE}: {origin}: block sizes must be positive, got {block_shape}"
            )
    return dataclasses.replace(spec, block_shape=block_shape)


def _partial_dims(spec, aval, tiling, origin) -> dict[int, tuple[int, int, int]]:
    """Dims the block does not divide: dim -> (number of blocks, last size,
    last size rounded up to the memory tiling of the dim)."""
    out = {}
    tiles = None
    for d, (bd, n) in enumerate(zip(spec.block_shape, aval.shape)):
        if not isinstance(bd, (int, pl.Blocked)):
            continue
        b = dim_size(bd)
        if n % b == 0:
            continue
        if tiles is None:
            tiles = _tiling_of(aval, tiling)
        t = tiles[d]
        if t is None or b % t:
            raise pipeline_error(
                ValueError,
                f"{WHERE}: {origin}: block size {b} does not divide dimension {d} of the operand "
                f"(shape {tuple(aval.shape)}); that needs a block size that is a multiple of the "
                f"memory tiling of that dimension ({t}), as on a TPU",
            )
        last = n - (n // b) * b
        out[d] = (-(-n // b), last, -(-last // t) * t)
    return out


def _bounded_dims(spec, aval, tiling, origin) -> dict[int, int | None]:
    """The ``pl.BoundedSlice`` dims: dim -> the memory tiling their copies round up to
    (None: unknown, copied at the slice's size). The bound must be whole tiles, as JAX's
    pipeline requires."""
    dims = [d for d, bd in enumerate(spec.block_shape) if isinstance(bd, pl.BoundedSlice)]
    if not dims:
        return {}
    tiles = _tiling_of(aval, tiling)
    for d in dims:
        bd, t = spec.block_shape[d], tiles[d]
        if t is not None and bd.block_size % t:
            raise pipeline_error(
                ValueError,
                f"{WHERE}: {origin}: {bd!r} at dimension {d} of the operand (shape {tuple(aval.shape)}): "
                f"the bound must be a multiple of the memory tiling of that dimension ({t}), as on a TPU",
            )
    return {d: tiles[d] for d in dims}


def _tiling_of(aval, tiling):
    try:
        return tuple(tpu_info.infer_tiling(aval, tiling))
    except ImportError:
        return (1,) * (len(aval.shape) - 2) + (8, 128)[-min(2, len(aval.shape)) :]
    except ValueError:
        return (None,) * len(aval.shape)


def _is_jax_buffered_ref(x) -> bool:
    """An instance of JAX's own ``BufferedRef`` (JAX's private Mosaic pipeline module), or a
    subclass of it: a pytree of JAX's pipeline, which ours cannot schedule."""
    return any(c.__name__ == "BufferedRef" and c.__module__.startswith("jax.") for c in type(x).__mro__)


def _is_allocation_leaf(x) -> bool:
    return x is None or isinstance(x, BufferedRefBase) or _is_jax_buffered_ref(x)


def allocation_leaves(allocations) -> list:
    """The BufferedRefs (and ``None`` entries) of ``allocations``, in the order of the
    spec leaves: a flat sequence (``make_allocations``) or, as JAX's pipeline takes them,
    a pytree mirroring the Refs (e.g. dataclasses of BufferedRefs)."""
    leaves = tree_util.tree_leaves(allocations, is_leaf=_is_allocation_leaf)
    for i, x in enumerate(leaves):
        if _is_jax_buffered_ref(x):
            raise pipeline_error(
                TypeError,
                f"{WHERE}: allocations[{i}] is a {type(x).__name__}, a subclass of JAX's own BufferedRef "
                f"({type(x).__module__}, from JAX's Mosaic pipeline): our pipeline schedules "
                "pltpu.BufferedRef and its subclasses (pallas_tpu's). Derive the class from pltpu.BufferedRef "
                "(the same fields and methods: copy_in, wait_in, copy_out, wait_out, the slot registers)",
            )
    return leaves


def operand_of(bref, ref, origin: str = "allocations") -> Operand:
    """The ``Operand`` of a BufferedRef on ``ref``, its spec checked (for the
    BufferedRef's own copy methods, pipeline_protocol.py)."""
    space, aval = _ref_space_and_aval(ref, origin)
    del space
    spec = _normalize_spec(bref.spec, aval, origin)
    partial = _partial_dims(spec, aval, bref.tiling, origin)
    bounded = _bounded_dims(spec, aval, bref.tiling, origin)
    whole_ref = _has_tile_padding(ref, _rounded_dims(partial, bounded))
    return Operand(origin, bref.with_spec(spec), ref, tuple(aval.shape), partial, whole_ref, bounded)


def pipeline_allocations(*refs, in_specs=(), out_specs=(), tiling=None, grid=(), should_accumulate_out=False):
    """One BufferedRef (buffer and semaphores as types) per pipelined Ref,
    None for ``pl.no_block_spec`` operands, in the order of ``refs``."""
    del grid
    plan, _ = plan_pipeline(refs, in_specs, out_specs, tiling, should_accumulate_out, None)
    return tuple(op.bref if op is not None else None for op in plan)


def _top(specs) -> tuple:
    return tuple(specs) if isinstance(specs, (list, tuple)) else (specs,)


def _is_spec_leaf(s) -> bool:
    return s is None or s is pl.no_block_spec or isinstance(s, pl.BlockSpec)


def _accumulate_flags(should_accumulate_out, n_out: int) -> list:
    """``should_accumulate_out`` as one flag per output spec leaf."""
    if isinstance(should_accumulate_out, (bool, np.bool_)):
        return [bool(should_accumulate_out)] * n_out
    accumulate = tree_util.tree_leaves(should_accumulate_out)
    if len(accumulate) != n_out:
        raise pipeline_error(
            ValueError,
            f"{WHERE}: should_accumulate_out has {len(accumulate)} entries but out_specs has {n_out}",
        )
    return accumulate


def _planned_operand(origin: str, spec, ref, btype, alloc, tiling) -> Operand:
    """The ``Operand`` of one spec leaf (``origin``) on ``ref``: its BufferedRef, ``alloc``'s
    (the BufferedRef the caller allocated, or None) or a new one of ``btype``, its spec checked."""
    space, aval = _ref_space_and_aval(ref, origin)
    if space not in (pl.ANY, HBM, VMEM, SMEM):
        raise pipeline_error(
            ValueError,
            f"{WHERE}: the operand of {origin} is in {space}; pipelines copy blocks of Refs in "
            "pl.ANY or pltpu.HBM (a Ref already in VMEM or SMEM is seen by the body as a view)",
        )
    spec = _normalize_spec(spec, aval, origin)
    full = _is_full_block(spec, aval.shape)
    mode = spec.pipeline_mode
    count = mode.buffer_count if mode is not None else (1 if full else 2)
    if alloc is not None:
        bref = alloc.with_spec(spec)
    else:
        bref = BufferedRef.create(
            spec,
            aval.dtype,
            btype,
            count,
            source_memory_space=space,
            tiling=tiling,
            is_trivial_windowing=full,
        )
    # A BufferedRef subclass does its own copies (its methods work out the blocks' edges).
    protocol = bref.is_buffered and type(bref) is not BufferedRef
    checked = bref.is_buffered and not protocol
    partial = _partial_dims(spec, aval, tiling, origin) if checked else {}
    bounded = _bounded_dims(spec, aval, tiling, origin) if checked else {}
    whole_ref = _has_tile_padding(ref, _rounded_dims(partial, bounded))
    return Operand(origin, bref, ref, tuple(aval.shape), partial, whole_ref, bounded, protocol)


def plan_pipeline(refs, in_specs, out_specs, tiling, should_accumulate_out, allocations):
    """(one Operand or None per spec leaf, a function from the flat block
    Refs to the body's arguments)."""
    in_top, out_top = _top(in_specs), _top(out_specs)
    if len(refs) != len(in_top) + len(out_top):
        raise pipeline_error(
            TypeError,
            f"{WHERE}: the pipeline got {len(refs)} Refs but in_specs has {len(in_top)} and out_specs has "
            f"{len(out_top)} entries (one Ref per spec: inputs first, then outputs)",
        )
    in_leaves, in_tree = tree_util.tree_flatten(in_top, is_leaf=_is_spec_leaf)
    out_leaves, out_tree = tree_util.tree_flatten(out_top, is_leaf=_is_spec_leaf)
    try:
        in_refs = in_tree.flatten_up_to(tuple(refs[: len(in_top)]))
        out_refs = out_tree.flatten_up_to(tuple(refs[len(in_top) :]))
    except ValueError as e:
        raise pipeline_error(
            ValueError, f"{WHERE}: the Refs do not have the structure of the specs: {e}"
        ) from None
    accumulate = _accumulate_flags(should_accumulate_out, len(out_leaves))
    allocs = None if allocations is None else allocation_leaves(allocations)
    if allocs is not None and len(allocs) != len(in_leaves) + len(out_leaves):
        raise pipeline_error(
            ValueError,
            f"{WHERE}: allocations has {len(allocs)} BufferedRefs (or None entries) but there are "
            f"{len(in_leaves) + len(out_leaves)} specs (give one per spec: a flat sequence, or a pytree "
            "mirroring the Refs)",
        )
    entries = [(f"in_specs[{i}]", s, r, BufferType.INPUT) for i, (s, r) in enumerate(zip(in_leaves, in_refs))]
    entries += [
        (f"out_specs[{i}]", s, r, BufferType.INPUT_OUTPUT if acc else BufferType.OUTPUT)
        for i, (s, r, acc) in enumerate(zip(out_leaves, out_refs, accumulate))
    ]
    plan = [
        None
        if spec is None or spec is pl.no_block_spec
        else _planned_operand(origin, spec, ref, btype, None if allocs is None else allocs[k], tiling)
        for k, (origin, spec, ref, btype) in enumerate(entries)
    ]

    n_in = len(in_leaves)

    def rebuild(flat):
        return [
            *tree_util.tree_unflatten(in_tree, flat[:n_in]),
            *tree_util.tree_unflatten(out_tree, flat[n_in:]),
        ]

    return plan, rebuild
