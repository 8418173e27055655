"""The kernel frame: kernel jaxpr + grid mapping -> one Mosaic module.

The module holds, as JAX's Mosaic lowering makes it:

* ``func.func @<kernel>(grid indices: i32..., scalar-prefetch memrefs (SMEM)...,
  operand windows (memrefs of the block shape; squeezed dims kept with size 1,
  the kernel's Ref is a ``BlockRef`` without them; a rank-0 32-bit block in
  VMEM, without a grid, is a ``memref<1xT>`` the Ref squeezes)...,
  scratch memrefs...)`` with the attributes ``dimension_semantics``,
  ``iteration_bounds``, ``scalar_prefetch``, ``scratch_operands``,
  ``tpu.core_type`` and ``window_params``: one dict per operand,
  ``{transform_indices = @transform_i, window_bounds = array<i64: ...>}``,
  empty for whole-array operands (``pl.ANY``, ``pltpu.HBM``);
* ``func.func @transform_i(grid indices..., prefetch memrefs...) -> (i32...)``:
  operand ``i``'s index map (block indices; element offsets for
  ``pl.Element`` dims, whose window then has a ``window_kind``).

Without a grid there are no transforms, no ``window_params`` and no
``iteration_bounds`` (every block is the whole array). A dynamic (traced)
grid size is a dynamic ``iteration_bounds`` entry (``?``, INT64_MIN): the custom
call takes the sizes as its first operands and the kernel reads them with
``tpu.iteration_bound`` (``pl.num_programs``), as in JAX's lowering.
"""

from __future__ import annotations

import re

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import func
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src.checks import single_buffered
from pallas_tpu._src.mosaic import lowering_control as _control  # noqa: F401  (registers rules)
from pallas_tpu._src.mosaic import lowering_dma as _dma  # noqa: F401
from pallas_tpu._src.mosaic import lowering_jax012 as _jax012  # noqa: F401
from pallas_tpu._src.mosaic import lowering_math as _math  # noqa: F401
from pallas_tpu._src.mosaic import lowering_memory as _memory  # noqa: F401
from pallas_tpu._src.mosaic import lowering_mxu as _mxu  # noqa: F401
from pallas_tpu._src.mosaic import lowering_random as _random  # noqa: F401
from pallas_tpu._src.mosaic import lowering_reductions as _reductions  # noqa: F401
from pallas_tpu._src.mosaic import lowering_shapes as _shapes  # noqa: F401
from pallas_tpu._src.mosaic import lowering_sort as _sort  # noqa: F401
from pallas_tpu._src.mosaic.lowering import (
    BlockRef,
    KernelContext,
    LoweringException,
    as_i32,
    lower_jaxpr,
    memory_space_attr,
    memref_type,
    ref_type,
)


def _i32():
    return ir.IntegerType.get_signless(32)


def _i64_attr(v: int) -> ir.Attribute:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v)


def _operand_type(bm) -> ir.MemRefType:
    """A kernel operand's memref: its block (squeezed dims of size 1) in its
    memory space; a whole-array (HBM) operand's is the whole array."""
    shape = bm.array_shape if bm.is_whole_array else bm.block_sizes
    if _scalar_in_vmem(bm):
        shape = (1,)
    return memref_type(shape, bm.dtype, bm.memory_space)


def _scalar_in_vmem(bm) -> bool:
    """A rank-0 block in VMEM: Mosaic has no rank-0 vectors and no scalar loads and
    stores of VMEM, so its operand is a ``memref<1xT>`` (the layout XLA gives a rank-0
    32-bit array is Mosaic's of one element) and the kernel's Ref a ``BlockRef`` squeezing it."""
    return not bm.block_sizes and str(memory_space_attr(bm.memory_space)) == "#tpu.memory_space<vmem>"


def _check_scalar_block(gm, bm) -> None:
    """Mosaic takes a rank-0 VMEM operand only of a 32-bit type, without a grid."""
    if not _scalar_in_vmem(bm):
        return
    bits = 32 if np.dtype(bm.dtype) == np.bool_ else np.dtype(bm.dtype).itemsize * 8
    why = "under a grid (Mosaic has no scalar windows)" if gm.grid else None
    if bits != 32:
        why = f"of {np.dtype(bm.dtype).name} (XLA lays out {bits}-bit scalars unlike Mosaic)"
    if why:
        raise LoweringException(
            f"{plb.describe(gm.kernel_name, gm.source)}: {bm.origin} is a rank-0 block in VMEM {why}; "
            "give the array shape (1,), or put the scalar in SMEM (memory_space=pltpu.SMEM)"
        )


def _batched_hbm_ref(kernel, bm, arg, index_args) -> BlockRef:
    """An HBM operand under ``jax.vmap``: the whole array has a leading batch
    axis (a squeezed dim per vmap) that the kernel does not see. The kernel's
    Ref is the array at the batch index that the index map gives."""
    index_map = getattr(bm.index_map, "jaxpr", bm.index_map)
    starts = [as_i32(o) for o in lower_jaxpr(kernel, index_map, list(index_args))]
    t = ir.MemRefType(arg.type)
    sizes = list(bm.block_sizes)
    sliced = tpu.memref_slice(
        ir.MemRefType.get(sizes, t.element_type, memory_space=t.memory_space), arg, starts, []
    )
    return BlockRef(sliced, tuple(isinstance(d, plb.Squeezed) for d in bm.block_shape))


def _operand_ref(bm, arg):
    squeezed = tuple(isinstance(d, plb.Squeezed) for d in bm.block_shape)
    if _scalar_in_vmem(bm):
        squeezed = (True,)
    return BlockRef(arg, squeezed) if any(squeezed) else arg


def _semantics(gm, compiler_params) -> ir.Attribute:
    sems = getattr(compiler_params, "dimension_semantics", None)
    names = [getattr(s, "value", s) for s in sems] if sems else ["arbitrary"] * len(gm.grid)
    if len(names) != len(gm.grid):
        raise LoweringException(
            f"{plb.describe(gm.kernel_name, gm.source)}: compiler_params.dimension_semantics has "
            f"{len(names)} entries for a grid of rank {len(gm.grid)}"
        )
    return ir.ArrayAttr.get([ir.Attribute.parse(f"#tpu.dimension_semantics<{n}>") for n in names])


def func_name(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", name or "kernel")
    return name if not name[0].isdigit() else f"_{name}"


def lower_kernel(jaxpr, gm, compiler_params=None, mesh_axes=()) -> ir.Module:
    """The Mosaic module of one kernel. Call inside an ``ir.Context`` with the
    tpu dialect registered and a location. ``mesh_axes``: ((name, size), ...)
    of the device mesh (``jax.shard_map``) the kernel runs in."""
    G = len(gm.grid)
    dynamic = [a for a, g in enumerate(gm.grid) if g is plb.dynamic_grid_dim]
    if any(not isinstance(g, int) for a, g in enumerate(gm.grid) if a not in dynamic):
        raise LoweringException(
            f"{plb.describe(gm.kernel_name, gm.source)}: the grid {gm.grid} must be ints or traced int32 sizes"
        )
    prefetch_types = [ref_type(a) for a in gm.prefetch_avals]
    for bm in gm.block_mappings:
        _check_scalar_block(gm, bm)
    operand_types = [_operand_type(bm) for bm in gm.block_mappings]
    scratch_types = [ref_type(a) for a in gm.scratch_avals]
    module = ir.Module.create()
    name = func_name(gm.kernel_name)
    with ir.InsertionPoint(module.body):
        fn = func.FuncOp(name, ([_i32()] * G + prefetch_types + operand_types + scratch_types, []))
        block = fn.add_entry_block()
        kernel = KernelContext(
            gm.kernel_name,
            gm.source,
            tuple(gm.grid),
            _grid_names(gm),
            list(block.arguments[:G]),
            tuple(mesh_axes),
        )
        refs = list(block.arguments)
        first = G + len(prefetch_types)
        for i, bm in enumerate(gm.block_mappings):
            refs[first + i] = _operand_ref(bm, refs[first + i])
        with ir.InsertionPoint(block):
            index_args = [*block.arguments[:G], *refs[G:first]]
            for i, bm in enumerate(gm.block_mappings):
                if bm.is_whole_array and any(isinstance(d, plb.Squeezed) for d in bm.block_shape):
                    refs[first + i] = _batched_hbm_ref(kernel, bm, block.arguments[first + i], index_args)
            sizes = [tpu.iteration_bound(a) for a in dynamic]  # the kernel's inputs after the grid indices
            lower_jaxpr(kernel, jaxpr, [*refs[:G], *sizes, *refs[G:]])
            func.ReturnOp([])
            for size in sizes:  # Mosaic keeps an unused tpu.iteration_bound (one LLO op): JAX emits none
                if not list(size.uses):
                    size.owner.erase()
        fn.attributes["dimension_semantics"] = _semantics(gm, compiler_params)
        fn.attributes["scalar_prefetch"] = _i64_attr(len(prefetch_types))
        fn.attributes["scratch_operands"] = _i64_attr(len(scratch_types))
        fn.attributes["tpu.core_type"] = ir.Attribute.parse("#tpu.core_type<tc>")
        if G:
            bounds = [ir.ShapedType.get_dynamic_size() if a in dynamic else g for a, g in enumerate(gm.grid)]
            fn.attributes["iteration_bounds"] = ir.DenseI64ArrayAttr.get(bounds)
            windows = [_window(i, bm, gm, prefetch_types) for i, bm in enumerate(gm.block_mappings)]
            fn.attributes["window_params"] = ir.ArrayAttr.get(windows)
    return module


def _grid_names(gm) -> tuple:
    names = tuple(gm.grid_names or ())
    return names + (None,) * (len(gm.grid) - len(names))


def _window(i: int, bm, gm, prefetch_types) -> ir.Attribute:
    """Operand ``i``'s ``window_params`` entry, emitting its ``@transform_i``."""
    if bm.is_whole_array:
        return ir.DictAttr.get({})
    G = len(gm.grid)
    name = f"transform_{i}"
    n_out = len(bm.block_shape)
    fn = func.FuncOp(name, ([_i32()] * G + prefetch_types, [_i32()] * n_out))
    block = fn.add_entry_block()
    where = f"{gm.kernel_name} {bm.origin} index_map"
    kernel = KernelContext(where, gm.source, tuple(gm.grid), _grid_names(gm), list(block.arguments[:G]))
    with ir.InsertionPoint(block):
        index_map = getattr(bm.index_map, "jaxpr", bm.index_map)
        consts = getattr(bm.index_map, "consts", ())
        if consts:
            raise LoweringException(
                f"{plb.describe(gm.kernel_name, gm.source)}: {bm.origin} index_map closes over arrays"
            )
        outs = lower_jaxpr(kernel, index_map, list(block.arguments))
        func.ReturnOp([as_i32(o) for o in outs])
    params = {
        "transform_indices": ir.FlatSymbolRefAttr.get(name),
        "window_bounds": ir.DenseI64ArrayAttr.get(list(bm.block_sizes)),
    }
    if single_buffered(bm):
        params["pipeline_mode"] = ir.Attribute.parse("#tpu.pipeline_mode<synchronous>")
    if any(isinstance(d, plb.Element) for d in bm.block_shape):
        if not all(isinstance(d, (plb.Element, plb.Squeezed)) for d in bm.block_shape):
            raise LoweringException(
                f"{plb.describe(gm.kernel_name, gm.source)}: {bm.origin} mixes pl.Element and blocked "
                "dims; Mosaic needs all pl.Element (or squeezed) dims in a block shape with one"
            )
        pads = [d.padding if isinstance(d, plb.Element) else (0, 0) for d in bm.block_shape]
        lo, hi = [p[0] for p in pads], [p[1] for p in pads]
        params["window_kind"] = ir.Attribute.parse(f"#tpu.element_window<{lo},{hi}>")
    return ir.DictAttr.get(params)
