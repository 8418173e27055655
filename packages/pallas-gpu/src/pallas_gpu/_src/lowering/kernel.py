"""The kernel frame: a kernel jaxpr + grid mapping -> one ``@triton.jit``
function (see ``lowering.py`` for the conventions of the generated code).

The grid is split in two:

* *parallel* axes are folded onto Triton's first launch axis (last axis
  fastest: Pallas' order, so neighbouring programs share blocks);
* *sequential* axes, those along which every output block stays the same
  (no output index map reads them, and the kernel does not index its
  outputs with their ``program_id``), run as nested ``for`` loops inside one
  program, in grid order. This is what a TPU-style kernel that revisits its
  output (a k-loop accumulating into ``o_ref`` under ``pl.when(k == 0)``)
  needs: on the GPU, programs run in parallel, so such revisits would race.
  Output blocks stay in registers across the steps (loaded before the loops,
  stored after) unless the kernel reads or writes them in parts (``pl.ds``,
  ``plgpu.load/store``): those stay in memory, with a barrier between steps.
  Kernels that use atomics keep the parallel grid (atomics are how a Triton
  kernel combines the work of parallel programs). An output aliased to an
  input the kernel reads stays in memory too, so each step's loads see the
  earlier steps' stores.

Looping over a sequential axis inside the programs of a later parallel axis
reorders the steps; that is invisible unless a step touches an output block
that another program writes (``programs_share_blocks``): a race on a GPU.
Then only the sequential axes after every parallel one loop, the others stay
parallel, and Triton's interpreter (which runs programs in order) gives
Pallas' in-order result; on a GPU such a kernel still races.

The module imports ``lowering.py`` and the rule modules; none of them imports
this one.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import hashlib
import keyword
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.extend.core import jaxprs_in_params

from pallas import backend as plb
from pallas_gpu._src import compat
from pallas_gpu._src.language import primitives as gpu_primitives

# The rule modules: importing them fills the table.
from pallas_gpu._src.lowering import control as control_rules  # noqa: F401
from pallas_gpu._src.lowering import dot as dot_rules  # noqa: F401
from pallas_gpu._src.lowering import math as math_rules  # noqa: F401
from pallas_gpu._src.lowering import shapes as shape_rules  # noqa: F401
from pallas_gpu._src.lowering.address import block_ref
from pallas_gpu._src.lowering.grid_order import (
    aliased_outputs_read,
    in_grid_order,
    programs_share_blocks,
    sequential_axes,
)
from pallas_gpu._src.lowering.lowering import (
    BACKEND,
    DTYPES,
    INT4,
    MAX_GRID_X,
    MAX_TENSOR_NUMEL,
    Emitter,
    LoweredKernel,
    LoweringError,
    NotResident,
    ResidentRef,
    RuleContext,
    ScratchRef,
    Val,
    arg_name,
    const,
    is_float,
    lowering_rules,
    pad_shape,
    pointer_signature,
    uninitialized,
)
from pallas_gpu._src.lowering.memory import load_block, store_block

# Primitives whose int4 results are exact without 4-bit arithmetic.
INT4_PRIMITIVES = {
    lax.convert_element_type_p, lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p,
    lax.transpose_p, lax.select_n_p, lax.concatenate_p, lax.slice_p, lax.rev_p, lax.copy_p,
    compat.jit_p, compat.custom_jvp_call_p, compat.custom_vjp_call_p, compat.cond_p, compat.get_p,
    gpu_primitives.load_p,
}  # fmt: skip

# Output blocks kept in registers across sequential grid steps, at most (in
# elements, all outputs together): a 128 x 256 f32 accumulator, as in
# hand-written Triton matmuls. Larger ones stay in memory.
MAX_RESIDENT_NUMEL = 2**15


class KernelLowering:
    """Lowers one kernel jaxpr and its grid mapping to Triton source."""

    def __init__(
        self,
        jaxpr,
        grid_mapping,
        fn_name: str,
        in_memory: frozenset[int] = frozenset(),
        options: dict | None = None,
        aliases: tuple = (),
    ):
        options = options or {}
        self.aliases = aliases  # input_output_aliases: (input, output) pairs
        # Source options (CompilerParams.source_options): TMA tensor descriptors for
        # block Ref accesses, warp-specialized loops.
        self.use_tma = bool(options.get("use_tma", False))
        self.warp_specialize = bool(options.get("warp_specialize", False))
        self.loop_depth = 0  # fori loops being lowered around the current equation
        self.tma_descriptors: dict[tuple, str] = {}  # (pointer, block shape) -> descriptor variable
        self.prologue: list[str] = []  # lines at the top of the kernel (descriptor creation)
        self.jaxpr = jaxpr
        self.gm = grid_mapping
        self.name = grid_mapping.kernel_name  # the user's name, for messages
        self.fn_name = fn_name  # the Triton function's name
        self.in_memory = in_memory  # outputs (block mapping indices) not kept in registers
        self.em = Emitter()
        self._used: set[int] = set()
        self._outer_eqns: list[Any] = []  # equations whose sub-jaxprs are being lowered
        self.gpu_only: list[str] = []  # uses that Triton's interpreter cannot run (inline PTX)
        self.grid_ids: list[Val] = []  # the grid index of each axis (for lax.axis_index of a named grid)

    def source_line(self, eqn) -> str:
        """The user's line of ``eqn``, else of the nearest enclosing equation
        (inside jnp functions' nested jits the line is often missing)."""
        for e in [eqn, *reversed(self._outer_eqns)]:
            line = compat.source_line(e)
            if line and line != "<unknown>":
                return line
        return f"the pallas_call at {self.gm.source}"

    # -- usage --
    def _collect_used(self, jaxpr) -> None:
        jaxpr, _ = compat.unwrap_jaxpr(jaxpr)
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, compat.Var):
                    self._used.add(id(v))
            for sub in jaxprs_in_params(eqn.params):
                self._collect_used(sub)
        for v in jaxpr.outvars:
            if isinstance(v, compat.Var):
                self._used.add(id(v))

    def is_used(self, v) -> bool:
        return id(v) in self._used

    # -- jaxprs --
    def lower_jaxpr(self, closed, args: Sequence[Any]) -> list[Any]:
        jaxpr, consts = compat.unwrap_jaxpr(closed)
        fused = _dot_accumulations(jaxpr)

        def literal(v):
            return self._const_val(v.val, v.aval)

        def lower_eqn(eqn: Any, read: Callable[[Any], Any]) -> Any:
            if id(eqn) in fused.deferred:
                return plb.SKIP  # lowered by the add that takes its result (below)
            rule = lowering_rules.get(eqn.primitive)
            if id(eqn) in fused.adds:  # acc + dot(a, b): lowered as tl.dot(a, b, acc)
                dot, acc_index = fused.adds[id(eqn)]
                rule = functools.partial(lowering_rules[lax.dot_general_p], acc=read(eqn.invars[acc_index]))
                eqn = dot  # its result is bound to the add's outputs
            invals = [read(v) for v in eqn.invars]
            rc = RuleContext(self.em, eqn, [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars], self)
            if rule is None:
                raise rc.error(
                    "has no Triton lowering (the supported primitives are listed in pallas-gpu's "
                    "README); rewrite the kernel without it, or run it with interpret=True"
                )
            self._check_result(rc)
            self._outer_eqns.append(eqn)
            try:
                return rule(rc, *invals, **eqn.params)
            except Exception as e:
                located = _located(e, rc)
                if located is e:
                    raise
                raise located from e
            finally:
                self._outer_eqns.pop()

        const_vals = [self._const_val(c) for c in consts]
        return plb.walk_jaxpr(jaxpr, [*const_vals, *args], literal=literal, lower_eqn=lower_eqn)

    def _check_result(self, rc: RuleContext) -> None:
        """Results Triton cannot hold: too many elements, or a dtype it lacks."""
        for a in rc.avals_out:
            dtype = getattr(a, "dtype", None)
            if dtype is not None and not compat.is_ref_aval(a) and np.dtype(dtype).name not in DTYPES:
                raise rc.error(f"dtype {np.dtype(dtype).name} is not supported by Triton")
            if dtype is not None and np.dtype(dtype).name in INT4 and rc.eqn.primitive not in INT4_PRIMITIVES:
                raise rc.error(
                    f"{np.dtype(dtype).name} values can be cast and moved (reshape, select...) in Triton "
                    "kernels, not computed with; cast them to int8 (x.astype(jnp.int8)) first"
                )
            shape = tuple(getattr(a, "shape", ()))
            numel = math.prod(pad_shape(shape))
            if numel > MAX_TENSOR_NUMEL:
                padded = f" (padded to {pad_shape(shape)})" if pad_shape(shape) != shape else ""
                raise rc.error(
                    f"its result of shape {shape}{padded} has {numel} elements, and Triton tensors hold "
                    f"at most 2**20 = {MAX_TENSOR_NUMEL}; use a smaller block shape in the BlockSpec, or "
                    "read the block in pieces (x_ref[pl.ds(i * n, n), :] in a loop)"
                )

    def _const_val(self, value, aval=None) -> Val:
        arr = np.asarray(value)
        dtype = aval.dtype if aval is not None else arr.dtype
        if arr.shape != ():
            if arr.size and np.all(arr == arr.flat[0]):
                return const(self.em, arr.flat[0].item(), dtype, arr.shape)
            raise LoweringError(
                f"{BACKEND}: kernel '{self.name}' captures a non-uniform array constant of shape "
                f"{arr.shape}; pass it as a pallas_call input instead"
            )
        return const(self.em, arr.item(), dtype)

    # -- frame --
    def program_ids(self, sequential: Sequence[int]) -> tuple[list[Val], tuple[int, int, int]]:
        """Indices of the parallel grid axes from Triton's launch axis 0 (the
        sequential ones are placeholders, set by ``_sequential_loops``), and
        the launch grid."""
        grid = self.gm.grid
        em = self.em
        parallel = [ax for ax in range(len(grid)) if ax not in sequential]
        total = math.prod(grid[ax] for ax in parallel)
        if total > MAX_GRID_X:
            raise LoweringError(
                f"{BACKEND}: kernel '{self.name}': grid {grid} has {total} parallel programs; Triton "
                f"launches at most {MAX_GRID_X}"
            )
        ids = [const(em, 0, np.int32) for _ in grid]
        if parallel:
            em.emit("pid = tl.program_id(0)")
        rest = "pid"
        for ax in reversed(parallel):
            name = f"pid{ax}"
            if ax == parallel[0]:
                em.emit(f"{name} = {rest}")
            elif grid[ax] == 1:
                em.emit(f"{name} = tl.full([], 0, tl.int32)")
            else:
                em.emit(f"{name} = {rest} % {grid[ax]}")
                em.emit(f"pid_rest{ax} = {rest} // {grid[ax]}")
                rest = f"pid_rest{ax}"
            ids[ax] = Val(name, (), np.dtype(np.int32))
        return ids, (max(total, 1), 1, 1)

    def _sequential_loops(
        self, stack: contextlib.ExitStack, sequential: Sequence[int], ids: list[Val]
    ) -> None:
        for ax in sequential:
            it = self.em.fresh("step")
            stack.enter_context(self.em.block(f"for {it} in range(0, {self.gm.grid[ax]}):"))
            # A tensor (the interpreter's loop variable is a Python int).
            self.em.emit(f"pid{ax} = tl.full([], 0, tl.int32) + {it}")
            ids[ax] = Val(f"pid{ax}", (), np.dtype(np.int32))

    def lower(self) -> tuple[str, list[str], tuple[int, int, int]]:
        """Returns (kernel source, pointer signature per argument, launch grid)."""
        self._collect_used(self.jaxpr)
        gm, em = self.gm, self.em
        for bm in gm.out_block_mappings:
            if np.dtype(bm.dtype).name in INT4:
                raise LoweringError(
                    f"{BACKEND}: {bm.origin} of pallas_call '{self.name}' at {gm.source}: outputs of "
                    f"dtype {np.dtype(bm.dtype).name} are not supported (XLA packs 4-bit arrays two per "
                    "byte, and one program's nibbles share bytes with another's); return int8 and cast "
                    "outside the kernel"
                )
        sequential = sequential_axes(gm, self.jaxpr)
        suffix = in_grid_order(gm, sequential)
        if suffix != sequential and programs_share_blocks(gm, self.jaxpr, sequential, self.aliases):
            # The loops would reorder steps that other programs' steps depend on: keep the
            # steps in grid order (see the module docstring).
            sequential = suffix
        ids, launch_grid = self.program_ids(sequential)
        self.grid_ids = ids  # updated in place by the sequential loops
        n_in = gm.num_inputs
        refs: list[Any] = [None] * len(gm.block_mappings)
        # Output blocks do not move along sequential axes: address them once.
        for i in range(n_in, len(gm.block_mappings)):
            refs[i] = block_ref(self, i, gm.block_mappings[i], ids)
        resident = self._resident_outputs(refs, sequential)
        scratch = []
        for a in gm.scratch_avals:
            inner = a.inner_aval if hasattr(a, "inner_aval") else a
            v = uninitialized(em, inner.shape, inner.dtype)
            scratch.append(ScratchRef(v.expr, tuple(inner.shape), np.dtype(inner.dtype)))
        with contextlib.ExitStack() as loops:
            self._sequential_loops(loops, sequential, ids)
            for i in range(n_in):
                refs[i] = block_ref(self, i, gm.block_mappings[i], ids)
            em.emit("# kernel body")
            kernel_refs = [resident.get(i, r) for i, r in enumerate(refs)]
            self.lower_jaxpr(self.jaxpr, [*ids, *kernel_refs, *scratch])
            if sequential and len(resident) < gm.num_outputs:
                em.emit("tl.debug_barrier()  # the next step reads what this one stored")
        for r in resident.values():
            assert r.block is not None  # a resident output is stored back to its block
            store_block(em, r.block, Val(r.var, r.shape, r.dtype), self)
        args = [arg_name(bm, i) for i, bm in enumerate(gm.block_mappings)]
        sig = [pointer_signature(bm.dtype) for bm in gm.block_mappings]
        header = [f"def {self.fn_name}({', '.join(args)}):"]
        return "\n".join(header + self.prologue + em.lines) + "\n", sig, launch_grid

    def tma_descriptor(self, ptr: str, array_shape, block_shape) -> str:
        """The tensor descriptor of array ``ptr`` for tiles of ``block_shape``,
        made once at the top of the kernel (it depends only on the argument)."""
        key = (ptr, tuple(block_shape))
        if key not in self.tma_descriptors:
            name = f"{ptr}_desc{len(self.tma_descriptors)}"
            strides = [math.prod(array_shape[d + 1 :]) for d in range(len(array_shape))]
            self.prologue.append(
                f"    {name} = tl.make_tensor_descriptor({ptr}, shape={list(array_shape)}, "
                f"strides={strides}, block_shape={list(block_shape)})"
            )
            self.tma_descriptors[key] = name
        return self.tma_descriptors[key]

    def _resident_outputs(self, refs: list[Any], sequential: Sequence[int]) -> dict[int, ResidentRef]:
        """Output blocks loaded into registers before the sequential loops."""
        if not sequential:
            return {}
        out: dict[int, ResidentRef] = {}
        budget = MAX_RESIDENT_NUMEL
        for i in range(self.gm.num_inputs, len(refs)):
            numel = math.prod(pad_shape(refs[i].block_shape))
            if i in self.in_memory or numel > budget:
                continue
            budget -= numel
            v = load_block(self.em, refs[i], self)
            out[i] = ResidentRef(v.expr, tuple(refs[i].block_shape), refs[i].dtype, index=i, block=refs[i])
        return out


@dataclasses.dataclass
class _DotAccumulations:
    """``d = add(acc, dot_general(a, b))`` pairs of one jaxpr to lower as ``tl.dot(a, b, acc)``."""

    adds: dict[int, tuple[Any, int]]  # id(add eqn) -> (its dot eqn, the index of acc among its operands)
    deferred: set[int]  # id(dot eqn): not lowered on its own


def _dot_accumulations(jaxpr) -> _DotAccumulations:
    """Finds ``acc + dot(a, b)`` where the f32 dot result has no other use. Triton folds
    ``dot(a, b, 0) + acc`` into ``dot(a, b, acc)`` itself only for some operand types: for
    fp8 on sm_90 it does not (its ``max_num_imprecise_acc`` stops the fold), and the unfused
    form waits for every wgmma to finish and adds the tile in registers at each k step.
    With fp8 operands only an accumulator that is an input of this jaxpr (a loop carry) is
    fused: Triton 3.6 on the H200 gave wrong sums for ``acc * 0.5 + dot(a, b)`` fused
    (tests/gpu/test_dot_accumulate.py)."""
    uses: dict[int, int] = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if isinstance(v, compat.Var):
                uses[id(v)] = uses.get(id(v), 0) + 1
    for v in jaxpr.outvars:
        if isinstance(v, compat.Var):
            uses[id(v)] = uses.get(id(v), 0) + 2  # never fuse a jaxpr output
    dots = {}
    for e in jaxpr.eqns:
        out = e.outvars[0] if e.outvars else None
        if (
            e.primitive is lax.dot_general_p
            and out is not None
            and uses.get(id(out)) == 1
            and np.dtype(out.aval.dtype) == np.float32
            and is_float(e.invars[0].aval.dtype)
            and not isinstance(e.params.get("precision"), lax.DotAlgorithmPreset)
        ):
            dots[id(out)] = e
    inputs = {id(v) for v in jaxpr.invars}
    found = _DotAccumulations({}, set())
    for e in jaxpr.eqns:
        if e.primitive is not lax.add_p:
            continue
        for i in (1, 0):  # the dot is usually the second operand
            v, acc = e.invars[i], e.invars[1 - i]
            dot = dots.get(id(v)) if isinstance(v, compat.Var) else None
            if (
                dot is not None
                and id(dot) not in found.deferred
                and getattr(acc.aval, "shape", None) == v.aval.shape
                and np.dtype(acc.aval.dtype) == np.float32
                and (np.dtype(dot.invars[0].aval.dtype).itemsize > 1 or id(acc) in inputs)
            ):
                found.adds[id(e)] = (dot, 1 - i)
                found.deferred.add(id(dot))
                break
    return found


def _located(e: Exception, rc: RuleContext) -> Exception:
    """``e`` with the equation and the user's line, as an exception of the same
    type (``e`` itself, with a note, when its type cannot be rebuilt from a
    message). Our own errors and already-located ones pass through."""
    if isinstance(e, (LoweringError, NotResident)) or getattr(e, "_pallas_gpu_located", False):
        return e
    eqn = " ".join(str(rc.eqn).split())
    eqn = eqn if len(eqn) <= 300 else eqn[:297] + "..."
    msg = (
        f"{BACKEND}: in kernel '{rc.lowering.name}' at {rc.lowering.source_line(rc.eqn)}: lowering "
        f"primitive '{rc.eqn.primitive.name}' ({eqn}) raised {type(e).__name__}: {e}"
    )
    try:
        new = type(e)(msg)
    except Exception:
        new = None
    if new is None or type(new) is not type(e):
        e.add_note(msg)
        new = e
    setattr(new, "_pallas_gpu_located", True)  # noqa: B010 (an Exception has no such field to type)
    return new


# Names the generated module defines or uses at module level.
_RESERVED = {"triton", "tl", "libdevice", *dir(builtins)}
MAX_NAME = 64


def kernel_name(name: str) -> str:
    """A valid, unclaimed Python/PTX identifier for the Triton function of the
    kernel ``name`` (ASCII letters, digits and ``_``; not a keyword, a builtin
    or a name of the generated module; at most 64 characters)."""
    out = "".join(c if (c.isascii() and c.isalnum()) or c == "_" else "_" for c in name) or "kernel"
    if out[0].isdigit() or out[0] == "_" or keyword.iskeyword(out) or out in _RESERVED:
        out = "k_" + out
    if len(out) > MAX_NAME:
        out = out[: MAX_NAME - 9] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return out


def lower_kernel(jaxpr, grid_mapping, options: dict | None = None, aliases=()) -> LoweredKernel:
    """The Triton source of a kernel; ``aliases``: the call's ``input_output_aliases``
    as ``(input, output)`` pairs."""
    name = kernel_name(grid_mapping.kernel_name)
    in_memory = aliased_outputs_read(jaxpr, grid_mapping, aliases)
    while True:
        kl = KernelLowering(jaxpr, grid_mapping, name, in_memory, options, aliases)
        try:
            src, sig, launch_grid = kl.lower()
            break
        except NotResident as e:  # accessed in parts: lower again with that block in memory
            in_memory |= {e.index}
    helpers = "".join(f"@triton.jit\n{s}\n\n" for s in kl.em.helpers.values())
    body = helpers + "@triton.jit\n" + src
    return LoweredKernel(
        name,
        body,
        tuple(sig),
        launch_grid,
        tuple(kl.gpu_only),
        grid_mapping.kernel_name,
        tuple(sorted((options or {}).items())),
    )
