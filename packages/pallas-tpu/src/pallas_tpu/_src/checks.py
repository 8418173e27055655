"""What a TPU refuses, refused the same way by TPU interpret mode and by our
Mosaic lowering: both call ``check_kernel`` before anything else, so a kernel
that would not compile for a TPU does not run in interpret mode either, and
the error names the kernel, the operand or the user's line.

* block shapes: JAX's Mosaic lowering's tiling rules (the last two dims
  multiples of (8, 128) or equal to the array's; rank-1 blocks whole, a
  multiple of sublanes * lanes, or a power of 2 of at least one packed row);
* memory spaces: Refs in HBM (``pl.ANY``, ``pltpu.HBM``) are reached by DMAs
  only, SMEM holds scalars, ``pltpu.SEMAPHORE`` holds semaphores (that HBM
  operands take whole arrays is checked by pallas-core's ``pallas_call``);
* VMEM: blocks (two buffers each: the pipeline prefetches the next block)
  plus VMEM scratch and ``pl.run_scoped`` buffers must fit the chip's VMEM and
  ``vmem_limit_bytes`` (default: XLA's scoped VMEM limit), as libtpu's compiler
  requires (a limit above the chip's VMEM is accepted, as libtpu accepts it);
  SMEM buffers must fit the chip's SMEM;
* ``CompilerParams.allow_input_fusion``: one entry per input.

TPU interpret mode alone (``check_interpreted_grid``), as JAX's: the grid axes marked
"parallel" come first and have static sizes (JAX's Mosaic lowering takes a traced
one, and "parallel" axes anywhere).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import tpu_info


def _err(gm, cls, what, msg):
    return cls(f"{gm.where}: {what}: {msg}")


def _trivial_window(bm) -> bool:
    """The block is the whole array at block index 0 (as JAX's lowering
    decides it: a squeezed dim has size 1)."""
    for d, n, v in zip(bm.block_shape, bm.array_shape, bm.index_map.jaxpr.outvars):
        if getattr(d, "block_size", 1) != n:
            return False
        if not (hasattr(v, "val") and np.ndim(v.val) == 0 and int(v.val) == 0):
            return False
    return True


def check_block_shapes(gm) -> None:
    """JAX's Mosaic lowering's rules for the block shapes of VMEM operands."""
    for bm in gm.block_mappings:
        ms = bm.memory_space
        if ms is tpu_core.SEMAPHORE or (ms is tpu_core.SMEM and _trivial_window(bm)):
            continue
        dims, shape = bm.block_shape, bm.array_shape
        shown = f"block_shape {tuple(str(x) for x in dims)} of array {bm.dtype}{list(shape)}"
        if bm.is_whole_array:  # its block_shape and index_map were checked by pallas_call (pallas-core)
            continue
        if not dims:
            continue
        sizes = [1 if isinstance(d, plb.Squeezed) else d.block_size for d in dims]
        if len(dims) >= 2:
            for k, tile in ((-2, 8), (-1, 128)):
                if sizes[k] != shape[k] and sizes[k] % tile:
                    what = "squeezed (None)" if isinstance(dims[k], plb.Squeezed) else f"{sizes[k]}"
                    raise _err(
                        gm,
                        ValueError,
                        bm.origin,
                        f"{shown}: dimension {len(dims) + k} of the block is {what}; a TPU needs the last "
                        "two block dimensions to be multiples of 8 and 128 (one (8, 128) tile) or equal "
                        f"to the array's ({shape[k]})",
                    )
            continue
        info = tpu_info.get_tpu_info()
        bits = 32 if np.dtype(bm.dtype) == np.bool_ else np.dtype(bm.dtype).itemsize * 8
        min_tiling = info.num_lanes * max(32 // bits, 1)
        chunk = info.num_sublanes * info.num_lanes
        b = sizes[0]
        if not (b == shape[0] or b % chunk == 0 or (b >= min_tiling and b & (b - 1) == 0)):
            raise _err(
                gm,
                ValueError,
                bm.origin,
                f"{shown}: a rank-1 block must be the whole array ({shape[0]}), a multiple of {chunk} "
                f"(sublanes * lanes) or a power of 2 of at least {min_tiling} (128 * (32 // {bits}))",
            )


def _vmem_bytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# XLA's default scoped VMEM limit (--xla_tpu_scoped_vmem_limit_kib): what a
# kernel may use unless CompilerParams(vmem_limit_bytes=...) says otherwise.
_DEFAULT_SCOPED_VMEM_MIB = {6: 32, 7: 32}


def default_scoped_vmem_bytes(info) -> int:
    return min(_DEFAULT_SCOPED_VMEM_MIB.get(info.generation, 16) * 2**20, info.vmem_capacity_bytes)


def single_buffered(bm) -> bool:
    """A VMEM block that is the whole array at a constant index is copied in
    once: Mosaic keeps one buffer of it (as JAX's lowering asks)."""
    if str(bm.memory_space or "vmem") != "vmem" or tuple(bm.block_sizes) != tuple(bm.array_shape):
        return False
    outs = getattr(bm.index_map, "jaxpr", bm.index_map).outvars
    return all(isinstance(v, compat.Literal) and v.val == 0 for v in outs)


def _in_space(aval, spaces) -> bool:
    return getattr(aval, "memory_space", None) in spaces and plb.semaphore_kind(aval) is None


def scoped_bytes(jaxpr, spaces) -> int:
    """The most bytes of ``pl.run_scoped`` buffers in ``spaces`` live at once in ``jaxpr``
    (nested scopes add up; scopes one after the other, or in different branches, do not)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    peak = 0
    for eqn in jaxpr.eqns:
        inner = max(
            (scoped_bytes(s, spaces) for s in jax.extend.core.jaxprs_in_params(eqn.params)), default=0
        )
        own = 0
        if eqn.primitive is plb.run_scoped_p:
            body = eqn.params["jaxpr"]
            avals = [v.aval for v in getattr(body, "jaxpr", body).invars[eqn.params["num_consts"] :]]
            own = sum(_vmem_bytes(a.shape, a.dtype) for a in avals if _in_space(a, spaces))
        peak = max(peak, own + inner)
    return peak


def check_vmem(gm, cp, jaxpr=None) -> None:
    """The VMEM a kernel needs, as Mosaic allocates it (VMEM blocks twice: the
    pipeline fetches the next block while the kernel works on this one; a
    whole array at a constant block index once; VMEM scratch once; ``pl.run_scoped``
    buffers as they nest), refused where libtpu's compiler refuses it: more than the
    chip's VMEM, or more than ``vmem_limit_bytes`` (default: XLA's scoped VMEM limit
    of the chip) where that is less. A ``vmem_limit_bytes`` above the chip's VMEM is
    accepted, as libtpu accepts it (it compiles within the chip's VMEM). Likewise SMEM
    scratch, ``run_scoped`` buffers and blocks against the chip's SMEM. Sizes are
    unpadded (a lower bound of Mosaic's tiled sizes): what is refused here, libtpu
    refuses too."""
    info = tpu_info.get_tpu_info()
    chip = f"TPU {info.chip_version.value}"
    capacity = info.vmem_capacity_bytes
    limit = getattr(cp, "vmem_limit_bytes", None)
    vmem = (None, tpu_core.VMEM)
    blocks = sum(
        (1 if single_buffered(bm) else 2) * _vmem_bytes(bm.block_sizes, bm.dtype)
        for bm in gm.block_mappings
        if not bm.is_whole_array and bm.memory_space in vmem
    )
    scratch = sum(_vmem_bytes(a.shape, a.dtype) for a in gm.scratch_avals if _in_space(a, vmem))
    scoped = scoped_bytes(jaxpr, vmem) if jaxpr is not None else 0
    need = blocks + scratch + scoped
    parts = (
        f"the kernel needs {need} bytes ({_mib(need)}) of VMEM: {blocks} for its blocks (two buffers each, one "
        f"for a whole array at a constant index), {scratch} for VMEM scratch and {scoped} for pl.run_scoped "
        "buffers (those live at once)"
    )
    fix = "Use smaller blocks, or keep large operands in HBM (memory_space=pl.ANY) and copy parts with DMAs"
    if need > capacity:
        raise _err(gm, ValueError, "VMEM", f"{parts}, more than a {chip} has ({_mib(capacity)}). {fix}")
    if limit is None:
        bound = default_scoped_vmem_bytes(info)
        which = (
            f"the default scoped VMEM limit of a {chip} ({_mib(bound)}; raise it with "
            f"pltpu.CompilerParams(vmem_limit_bytes=...), up to the chip's {_mib(capacity)})"
        )
    else:
        bound, which = limit, f"compiler_params.vmem_limit_bytes ({limit} bytes, {_mib(limit)})"
    if need > bound:
        raise _err(gm, ValueError, "VMEM", f"{parts}, more than {which}. {fix}")
    smem_space = (tpu_core.SMEM,)
    smem = (
        sum(_vmem_bytes(a.shape, a.dtype) for a in gm.scratch_avals if _in_space(a, smem_space))
        + sum(_vmem_bytes(a.shape, a.dtype) for a in gm.prefetch_avals)
        + sum(
            _vmem_bytes(bm.block_sizes, bm.dtype) for bm in gm.block_mappings if bm.memory_space in smem_space
        )
        + (scoped_bytes(jaxpr, smem_space) if jaxpr is not None else 0)
    )
    if smem > info.smem_capacity_bytes:
        raise _err(
            gm,
            ValueError,
            "SMEM",
            f"the kernel needs {smem} bytes ({_mib(smem)}) of SMEM (scalar-prefetch operands, SMEM blocks, "
            f"scratch and pl.run_scoped buffers), more than a {chip} has ({info.smem_capacity_bytes} bytes, "
            f"{_mib(info.smem_capacity_bytes)}). SMEM holds scalars: keep large tables in HBM (pl.ANY) and "
            "copy the part you need into SMEM with a DMA",
        )


def check_compiler_params(gm, cp) -> None:
    fusion = getattr(cp, "allow_input_fusion", None)
    n = gm.num_scalar_prefetch + gm.num_inputs
    if fusion is not None and len(fusion) != n:
        raise _err(
            gm,
            ValueError,
            "compiler_params.allow_input_fusion",
            f"got {len(fusion)} entries for a pallas_call of {n} inputs"
            + (f" ({gm.num_scalar_prefetch} scalar-prefetch)" if gm.num_scalar_prefetch else "")
            + "; give one True/False per input",
        )


class DynamicParallelAxisError(jax.errors.ConcretizationTypeError):
    """A traced grid size on a "parallel" axis in TPU interpret mode: a
    ``jax.errors.ConcretizationTypeError``, as JAX's interpret mode raises, with
    our message (kernel, axis, fix) first."""

    def __init__(self, message: str):
        TypeError.__init__(self, message)


def check_interpreted_grid(gm, semantics) -> None:
    """TPU interpret mode splits the leading "parallel" axes over cores, so those
    axes must come first (a "parallel" axis after another kind is a ValueError, in
    JAX's words too), and it needs their sizes when it traces the call (it may
    shuffle them), as JAX's does."""
    for a in range(1, len(semantics)):
        if semantics[a] is tpu_core.PARALLEL and semantics[a - 1] is not tpu_core.PARALLEL:
            named = [getattr(s, "value", s) for s in semantics]
            raise ValueError(
                f"{gm.where}: compiler_params.dimension_semantics {tuple(named)}: grid axis {a} is 'parallel' "
                f"after axis {a - 1}, {named[a - 1]!r}; TPU interpret mode splits the leading "
                "'parallel' axes over cores, so put them first. Dimensions with parallel semantics must "
                "form a prefix of the grid."
            )
    for a, (size, sem) in enumerate(zip(gm.grid, semantics)):
        if size is plb.dynamic_grid_dim and sem is tpu_core.PARALLEL:
            raise DynamicParallelAxisError(
                f"{gm.where}: grid[{a}]: Abstract tracer value encountered "
                f"where concrete value is expected: the size of grid axis {a} is traced (a dynamic grid) and "
                f"dimension_semantics[{a}] is 'parallel'; TPU interpret mode splits parallel axes over cores, "
                "so their sizes must be known when the call is traced. Give that axis a static size, or mark "
                "it 'arbitrary'"
            )


_ACCESS_WHAT = {"get": "reads", "swap": "writes", "addupdate": "adds to"}


def _jax_primitive_name(eqn) -> str:
    """The primitive JAX's TPU interpret mode names in its refusal of an HBM access:
    ``load_p`` for ``pltpu.load`` (a read under its name scope here), else the Ref
    access's own (``get_p``, ``swap_p``, ``addupdate_p``)."""
    if eqn.primitive.name == "get" and LOAD_SCOPE in str(eqn.source_info.name_stack):
        return "load_p"
    return f"{eqn.primitive.name}_p"


# The name scope pltpu.load reads under (language/primitives.py): JAX's messages name
# its own primitive, load_p, there.
LOAD_SCOPE = "pltpu.load"


def _space_name(ms) -> str:
    return "pl.ANY (HBM)" if ms is plb.ANY else f"pltpu.{getattr(ms, 'name', ms)}"


def check_memory_spaces(gm, jaxpr) -> None:
    """Memory spaces used as a TPU allows: data operands not in SEMAPHORE
    space; no loads or stores on HBM Refs (DMAs only); SMEM read and written
    one scalar at a time."""
    for bm in gm.block_mappings:
        if bm.memory_space is tpu_core.SEMAPHORE:
            raise _err(
                gm,
                TypeError,
                bm.origin,
                f"an array {bm.dtype}{list(bm.array_shape)} placed in pltpu.SEMAPHORE: that space holds "
                "semaphores, not data. Put the operand in VMEM, SMEM or HBM (pl.ANY); allocate semaphores "
                "with scratch_shapes=[pltpu.SemaphoreType.DMA(...)]",
            )
    top = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    # pl.ANY Refs have no memory space in their avals: follow the kernel's ANY
    # operands into the jaxprs inside (loops, conds, run_scoped bodies).
    first = len(top.invars) - len(gm.block_mappings) - len(gm.scratch_avals)
    any_vars = {top.invars[first + k] for k, bm in enumerate(gm.block_mappings) if bm.memory_space is plb.ANY}
    _check_accesses(gm, top, any_vars)


def _check_accesses(gm, jaxpr, any_vars) -> None:
    get_p, swap_p, addupdate_p = compat.get_p, compat.swap_p, compat.addupdate_p
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sub = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            outer = plb.inner_invars(eqn, sub)
            _check_accesses(
                gm,
                sub,
                {
                    v
                    for v, o in zip(sub.invars, outer)
                    if o is not None and not hasattr(o, "val") and o in any_vars
                },
            )
        if eqn.primitive not in (get_p, swap_p, addupdate_p):
            continue
        ref = eqn.invars[0]
        aval = ref.aval
        ms = plb.ANY if not hasattr(ref, "val") and ref in any_vars else getattr(aval, "memory_space", None)
        what = _ACCESS_WHAT[eqn.primitive.name]
        where = compat.eqn_user_source(eqn)
        at = f"the kernel at {where}" if where else "the kernel"
        if ms is plb.ANY or ms is tpu_core.HBM:
            raise _err(
                gm,
                plb.ValueOrTypeError,  # JAX raises ValueError, ours raised TypeError: either catches it
                at,
                f"{what} a Ref {aval.dtype}{list(aval.shape)} in {_space_name(ms)} directly; a TPU reaches "
                "HBM by DMAs only: copy it into a VMEM buffer with pltpu.async_copy / "
                "pltpu.make_async_copy(...).start() and .wait(), or give the operand a VMEM BlockSpec "
                f"(JAX's words: {_jax_primitive_name(eqn)}: Buffers with a memory space of HBM or ANY cannot "
                "be referenced directly. Instead, use `pltpu.sync_copy` or `pltpu.async_copy`.)",
            )
        if ms is tpu_core.SMEM:
            shape = eqn.outvars[0].aval.shape if eqn.primitive is get_p else eqn.invars[1].aval.shape
            # A gather (an integer-array index: t_ref[idx]) reads scalars; Mosaic lowers it.
            indices = eqn.invars[1:] if eqn.primitive is get_p else eqn.invars[2:]
            gather = any(getattr(getattr(a, "aval", None), "shape", ()) for a in indices)
            if shape and not gather:
                raise _err(
                    gm,
                    TypeError,
                    at,
                    f"{what} a {list(shape)} vector of a Ref {aval.dtype}{list(aval.shape)} in pltpu.SMEM; "
                    "SMEM holds scalars: index one element at a time (x_ref[i, j]), or put the operand "
                    "in VMEM to use it as a vector",
                )


def check_kernel(gm, jaxpr, compiler_params) -> None:
    """Every check above; called with ``tpu_info`` describing the target chip."""
    check_compiler_params(gm, compiler_params)
    plb.check_zero_stride_writes(jaxpr, gm.where)
    check_block_shapes(gm)
    check_memory_spaces(gm, jaxpr)
    check_vmem(gm, compiler_params, jaxpr)
