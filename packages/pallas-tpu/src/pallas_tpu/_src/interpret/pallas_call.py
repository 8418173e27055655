"""The grid driver of TPU interpret mode: state cells for every operand, the
TPU pipeline around each grid step, cores, and the checks made before the
kernel runs (TPU block shapes, SMEM dtypes, VMEM budget).

``run`` goes in named steps: ``_start`` (the checks, the interpreter),
``_lay_out`` (operand cells, grid points, in a ``_Call`` record), then
``_run_group`` for each group of cores that run in lockstep (``_new_lane``,
``_run_lanes`` per grid step, ``_end_lane``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src import checks, compat
from pallas_tpu._src.interpret import (
    core_rules,  # also registers the rules of JAX's primitives
    sessions,
    shared_scopes,
)
from pallas_tpu._src.interpret import dma as _interpret_dma  # noqa: F401  (registers the DMA rules)
from pallas_tpu._src.interpret import facts as interpret_facts
from pallas_tpu._src.interpret import language_rules as _language_rules  # noqa: F401  (and the language's)
from pallas_tpu._src.interpret import mxu as interpret_mxu
from pallas_tpu._src.interpret import rules as interpret_rules
from pallas_tpu._src.interpret.interpreter import Interpreter, InterpretParams
from pallas_tpu._src.interpret.refs import RefView
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import primitives as tpu_prims


def _err(gm, cls, what, msg):
    return cls(f"{gm.where}: {what}: {msg}")


def semantics_of(gm, cp) -> tuple[tpu_core.GridDimensionSemantics, ...]:
    G = len(gm.grid)
    sems = getattr(cp, "dimension_semantics", None)
    if sems is None:
        return (tpu_core.ARBITRARY,) * G
    if len(sems) != G:
        raise _err(
            gm,
            ValueError,
            "compiler_params.dimension_semantics",
            f"got {len(sems)} entries for a grid of {G} axes {gm.grid}; give one per grid axis",
        )
    return tuple(sems)


def _smem_ok(dtype) -> bool:
    # 8- and 16-bit scalars are accepted as JAX's TPU interpret mode accepts them
    # (a TPU widens them to 32-bit words); 64-bit ones have no SMEM form.
    return np.dtype(dtype).itemsize <= 4


def check_memory(gm, compiler_params) -> None:
    for bm in gm.block_mappings:
        if bm.memory_space is tpu_core.SMEM and not _smem_ok(bm.dtype):
            raise _err(
                gm,
                TypeError,
                bm.origin,
                f"SMEM holds scalars of at most 32 bits, got {bm.dtype} (use int32/float32 or VMEM)",
            )
    for i, a in enumerate(gm.scratch_avals):
        ms = getattr(a, "memory_space", None)
        if ms is tpu_core.SMEM and not _smem_ok(a.dtype):
            raise _err(
                gm, TypeError, f"scratch_shapes[{i}]", f"SMEM holds scalars of at most 32 bits, got {a.dtype}"
            )


def dynamic_grid_sizes(gm, sems, params: InterpretParams, dynamic_sizes) -> list:
    """The grid's sizes (ints and int32 scalars) when some are traced. Such a
    grid runs on one core, in lexicographic order."""
    for what, bad in (
        ("num_cores_or_threads > 1", params.num_cores_or_threads > 1),
        ("random_seed (shuffled parallel axes)", params.random_seed is not None),
    ):
        if bad:
            raise _err(
                gm,
                NotImplementedError,
                f"grid {gm.grid}",
                f"a grid with dynamic (traced) sizes is interpreted on one core in order; "
                f"InterpretParams {what} is not supported with it",
            )
    it = iter(dynamic_sizes)
    return [next(it) if g is plb.dynamic_grid_dim else g for g in gm.grid]


def grid_points(gm, sems, params: InterpretParams) -> list[np.ndarray]:
    """The grid points each core runs, in order: one (N, G) table per core."""
    G = len(gm.grid)
    if math.prod(gm.grid) == 0:
        return []
    points = plb.grid_table(gm)
    if params.random_seed is not None:
        for a, order in _shuffled_parallel_axes(gm.grid, sems, params.random_seed).items():
            points[:, a] = order[points[:, a]]
    core_axes = [a for a in range(G) if sems[a] in (tpu_core.CORE_PARALLEL, tpu_core.SUBCORE_PARALLEL)]
    n = params.num_cores_or_threads
    if n == 1:
        return [points]
    if core_axes:
        a = core_axes[0]
        chunk = -(-gm.grid[a] // n)
        core = points[:, a] // chunk
        return [points[core == c] for c in range(n) if np.any(core == c)]
    # A megacore chip splits the leading "parallel" axes over its cores (as JAX's
    # interpreter): core c runs a contiguous range of the parallel sub-grid.
    prefix = 0
    while prefix < G and sems[prefix] is tpu_core.PARALLEL:
        prefix += 1
    if prefix == 0:
        return [points]
    sub = math.prod(gm.grid[:prefix])
    per_core = -(-sub // n) * (len(points) // sub)
    return [points[c * per_core : (c + 1) * per_core] for c in range(n) if c * per_core < len(points)]


def _shuffled_parallel_axes(grid, sems, seed: int) -> dict[int, np.ndarray]:
    """The order in which each "parallel" axis is run under ``random_seed``: the
    orders JAX's TPU interpret mode draws for the same seed (``jax.random.key(seed)``,
    split once per parallel axis in axis order, each axis a ``jax.random.permutation``
    of its indices), so that a kernel visits its grid in the same order in both."""
    orders = {}
    with jax.ensure_compile_time_eval():  # concrete here, even under jax.jit
        key = jax.random.key(seed)
        for a, n in enumerate(grid):
            if sems[a] is tpu_core.PARALLEL:
                key, sub = jax.random.split(key)
                orders[a] = np.asarray(jax.random.permutation(sub, jnp.arange(n, dtype=jnp.int32)))
    return orders


def _hidden_initializers(kernel_facts: plb.KernelFacts) -> dict[str, Any]:
    out = {}
    for prim, inits in interpret_rules.HIDDEN_STATE.items():
        if kernel_facts.uses(prim):
            out.update(inits)
    return out


@dataclasses.dataclass(eq=False)
class _Operand:
    """A ``pallas_call`` operand: its block mapping, its HBM cell and its
    block buffer's cell (``None`` for a whole-array operand)."""

    bm: Any
    hbm: int
    buf: int | None


@dataclasses.dataclass(eq=False)
class _Lane:
    """One core of a group of cores that run their grid points in lockstep
    (``slot``: its position in the group): its operands (its own block
    buffers), the kernel's Ref arguments and its scratch cells."""

    core_id: int
    slot: int
    ops: list[_Operand]
    views: list[RefView]  # one per operand, then one per scratch cell
    scratch: list[int]


@dataclasses.dataclass(eq=False)
class _Running:
    """A lane within a grid step: the kernel's steps (a generator that stops at
    each semaphore wait) and what the interpreter switches to when it resumes."""

    core_id: int
    steps: Any
    grid_env: dict[str, Any] = dataclasses.field(default_factory=dict)
    named: dict[str, Any] = dataclasses.field(default_factory=dict)  # the lane's ``Hidden.named``


def _pad_to_blocks(x, bm, mode):
    pads = []
    for size, d in zip(x.shape, bm.block_shape):
        if isinstance(d, plb.Element):
            pads.append((*d.padding, 0))
        else:
            b = 1 if isinstance(d, plb.Squeezed) else d.block_size
            pads.append((0, b if size == 0 else -size % max(b, 1), 0))  # an empty dim: one block
    if all(p[:2] == (0, 0) for p in pads):
        return x
    fill = plb.uninitialized_value((), x.dtype, mode)
    return lax.pad(x, fill, pads)


def _unpad(x, bm):
    lo = [d.padding[0] if isinstance(d, plb.Element) else 0 for d in bm.block_shape]
    if tuple(x.shape) == tuple(bm.array_shape) and not any(lo):
        return x
    return lax.slice(x, lo, [s + n for s, n in zip(lo, bm.array_shape)])


def check_block_visits(gm, params: InterpretParams, sems, input_output_aliases=()) -> None:
    """The blocks a static grid visits, found while tracing from the index maps that
    read no scalar-prefetch operand, in JAX's words then ours:

    * a block outside its array (past the padding of an edge block): an IndexError,
      "Out-of-bounds block index (4, 0) for input 0 in iteration (3,)", for outputs and,
      unless ``out_of_bounds_reads="uninitialized"``, for inputs;
    * an output block visited again after the kernel left it (not in consecutive grid
      steps of one core): a RuntimeError, "Revisited block (0, 0) of output 1 in
      iteration (2, 0)". On a TPU the block was written back when the kernel left it
      and its buffer is not read again: the second visit starts from an uninitialized
      buffer and its write-back replaces the first's. Outputs aliased to an input are
      not checked (as in JAX's interpreter).

    Index maps that read scalar-prefetch operands, and dynamic grids, are checked as
    the kernel runs (blocks outside the arrays only)."""
    if gm.num_dynamic_grid_bounds or not gm.block_mappings or math.prod(gm.grid) == 0:
        return
    nsp = gm.num_scalar_prefetch
    aliased = {o for _, o in input_output_aliases}
    per_core = None
    for k, bm in enumerate(gm.block_mappings):
        is_out = k >= gm.num_inputs
        j = k - gm.num_inputs if is_out else k
        if bm.is_whole_array or not bm.block_shape:
            continue
        ijaxpr = bm.index_map.jaxpr
        if any(v in _used_vars(ijaxpr) for v in ijaxpr.invars[len(gm.grid) : len(gm.grid) + nsp]):
            continue  # reads scalar prefetch: checked as the kernel runs
        check_oob = is_out or params.out_of_bounds_reads == "raise"
        check_revisit = is_out and j not in aliased
        if not (check_oob or check_revisit):
            continue
        if per_core is None:
            per_core = grid_points(gm, sems, params)
        name = f"output {j}" if is_out else f"input {j}"
        for core, pts in enumerate(per_core):
            try:
                idx = _index_map_table(bm, pts, len(gm.grid))  # (N, ndim) block indices
            except Exception:  # noqa: BLE001  (not computable while tracing: checked as the kernel runs)
                break
            if check_oob:
                _check_table_in_bounds(gm, bm, name, pts, idx, core, len(per_core))
            if check_revisit:
                _check_no_revisit(gm, bm, name, pts, idx, core, len(per_core))


def _used_vars(jaxpr) -> set:
    used = {v for e in jaxpr.eqns for v in e.invars if not hasattr(v, "val")}
    return used | {v for v in jaxpr.outvars if not hasattr(v, "val")}


def _index_map_table(bm, pts: np.ndarray, G: int) -> np.ndarray:
    """``bm``'s index map at every grid point of ``pts`` (``(N, G)``), as an ``(N, ndim)``
    int table (the map reads no scalar-prefetch operand)."""
    closed = bm.index_map
    # Without the (unused) scalar-prefetch Refs, which jax_enable_checks would want as Refs.
    jaxpr = closed.jaxpr.replace(invars=closed.jaxpr.invars[:G])

    def one(pt):
        return jnp.stack([jnp.asarray(o, jnp.int32) for o in jax.core.eval_jaxpr(jaxpr, closed.consts, *pt)])

    with jax.ensure_compile_time_eval():
        cols = jnp.asarray(pts, jnp.int32).T
        out = jax.vmap(lambda *pt: one(pt))(*cols) if G else one(()).reshape(1, -1).repeat(len(pts), 0)
        return np.asarray(out).reshape(len(pts), len(bm.block_shape))


def _point_text(pt) -> str:
    return "(" + ", ".join(str(int(i)) for i in pt) + ("," if len(pt) == 1 else "") + ")"


def _core_text(core: int, n_cores: int) -> str:
    return f" (core {core})" if n_cores > 1 else ""


def _check_table_in_bounds(gm, bm, name, pts, idx, core, n_cores) -> None:
    for d, dim in enumerate(bm.block_shape):
        size = bm.block_sizes[d]
        starts = idx[:, d] if isinstance(dim, (plb.Element, plb.Squeezed)) else idx[:, d] * size
        if isinstance(dim, plb.Element):
            n = bm.array_shape[d] + sum(dim.padding)
        else:
            n = bm.array_shape[d] + (size if bm.array_shape[d] == 0 else -bm.array_shape[d] % max(size, 1))
        bad = np.nonzero((starts < 0) | (starts + size > n))[0]
        if bad.size:
            r = int(bad[0])
            n_blocks = -(-bm.array_shape[d] // max(size, 1))
            raise IndexError(
                f"{gm.where}: Out-of-bounds block index {_point_text(idx[r])} for {name} in iteration "
                f"{_point_text(pts[r])}{_core_text(core, n_cores)}: {bm.origin}.index_map returned block "
                f"index {int(idx[r, d])} for dimension {d}, outside the array {bm.dtype}{list(bm.array_shape)} "
                f"(block {size}, {n_blocks} blocks)"
            )


def _check_no_revisit(gm, bm, name, pts, idx, core, n_cores) -> None:
    if len(idx) < 3:
        return
    new_run = np.ones(len(idx), bool)
    new_run[1:] = np.any(idx[1:] != idx[:-1], axis=1)
    runs = np.nonzero(new_run)[0]  # the step where each visit of a block starts
    ends = np.append(runs[1:] - 1, len(idx) - 1)
    _, group = np.unique(idx[runs], axis=0, return_inverse=True)
    group = group.reshape(-1)
    first_run = np.full(int(np.max(group)) + 1, len(runs))
    np.minimum.at(first_run, group, np.arange(len(runs)))
    again = np.nonzero(first_run[group] < np.arange(len(runs)))[0]
    if again.size:
        k = int(again[0])  # the first visit of a block visited before
        earlier = np.nonzero(group[:k] == group[k])[0]
        r, first, end = runs[k], runs[earlier[0]], ends[earlier[-1]]
        b = tuple(int(i) for i in idx[r])
        raise RuntimeError(
            f"{gm.where}: Revisited block {_point_text(b)} of {name} in iteration {_point_text(pts[r])}"
            f"{_core_text(core, n_cores)}. The block was previously visited in iterations "
            f"{_point_text(pts[first])} through {_point_text(pts[end])}: {bm.origin}.index_map returns to "
            "an output block the kernel left earlier. On a TPU an output block is written back when the "
            "kernel moves to another block and its buffer is not read again, so this visit starts from an "
            "uninitialized buffer and its write-back replaces the earlier writes. Visit each output block "
            'in consecutive grid steps (the axes that revisit it innermost, "arbitrary"), or alias the '
            "output to an input (input_output_aliases) and read what it holds"
        )


def _starts(bm, idx):
    out = []
    for d, i in zip(bm.block_shape, idx):
        i = jnp.asarray(i, jnp.int32)
        out.append(i if isinstance(d, (plb.Element, plb.Squeezed)) else i * d.block_size)
    return out


@dataclasses.dataclass(eq=False)
class _Call:
    """What the steps of ``run`` share about one ``pallas_call``: the interpreter,
    the kernel, the cells of its operands and the grid points each core runs."""

    interp: Interpreter
    jaxpr: Any
    gm: Any
    params: InterpretParams
    lane_hidden: list[tuple[str, Any]]  # (name, initializer) of per-core hidden state, e.g. the PRNG state
    dynamic_sizes: list[Any]  # the traced sizes of a dynamic grid
    prefetch_args: list[Any]
    prefetch: list[RefView] = dataclasses.field(default_factory=list)
    ops: list[_Operand] = dataclasses.field(default_factory=list)
    # Positions of the kernel's inputs a DMA may write; None: any cell may be a DMA's destination.
    targets: frozenset[int] | None = None
    first_ref: int = 0  # the kernel's first Ref input (after grid indices, dynamic sizes, prefetch)
    sizes: list[Any] | None = None  # a dynamic grid: its sizes
    n_steps: Any = None  # a dynamic grid: its number of steps
    per_core: list[Any] = dataclasses.field(default_factory=list)  # grid points per core (see grid_points)
    blocked: list[int] = dataclasses.field(default_factory=list)  # operands with a block buffer

    @property
    def dynamic(self) -> bool:
        return bool(self.gm.num_dynamic_grid_bounds)


def run(args, *, jaxpr, grid_mapping, input_output_aliases, params, compiler_params, kernel_facts=None):
    """Interprets one ``pallas_call`` (``kernel_facts``: the call record's facts about
    ``jaxpr``, from one walk of it; computed here when not given)."""
    gm = grid_mapping
    if any(map(compat.has_symbolic_shape, args)):
        raise _err(
            gm,
            NotImplementedError,
            "operands",
            "TPU interpret mode takes static shapes; these have symbolic dimensions (jax.export shape "
            "polymorphism): export for platforms=['tpu'] lowers such a call, interpret=True runs it",
        )
    kernel_facts = plb.kernel_facts(jaxpr) if kernel_facts is None else kernel_facts
    params = mesh_params(params, compiler_params)
    sessions.reset_races()  # this call's findings (a call that checks races starts afresh when it runs, too)
    # Blocks outside the arrays and revisited output blocks first: they are wrong whatever
    # else is (a block shape a TPU refuses, checked next).
    check_block_visits(gm, params, semantics_of(gm, compiler_params), input_output_aliases)
    interp, sems, lane_hidden = _start(jaxpr, gm, params, compiler_params, kernel_facts)
    call = _lay_out(interp, args, jaxpr, gm, params, input_output_aliases, sems, lane_hidden)
    shares = interpret_facts.scoped_in_spaces(jaxpr, shared_scopes.SHARED_SPACES)
    groups = _core_groups(kernel_facts, call.per_core, shares)
    total_steps = call.n_steps if call.dynamic else sum(len(call.per_core[g[0]]) for g in groups)
    steps_before = 0
    for group in groups:
        steps_before += _run_group(call, group, steps_before, total_steps)
    for c in list(interp.shadows):
        interp.check_dmas_landed(c, "when the kernel ends")
    interp.finish()
    outs = [_unpad(interp.state[op.hbm], op.bm) for op in call.ops[gm.num_inputs :]]
    interp.raise_checks()
    return outs


def mesh_params(params: InterpretParams, cp) -> InterpretParams:
    """A body over a ``pltpu.TensorCoreMesh`` (``pl.kernel``, ``pl.core_map``) runs on
    the mesh's cores, one mesh point each in order, as in JAX's TPU interpret mode
    (whatever ``num_cores_or_threads`` and ``random_seed`` say)."""
    if not isinstance(cp, tpu_core.MeshCompilerParams):
        return params
    return dataclasses.replace(params, num_cores_or_threads=cp.mesh_num_cores, random_seed=None)


def needs_devices(params: InterpretParams, kernel_facts: plb.KernelFacts) -> bool:
    """Whether a kernel needs the multi-device transport: it reaches other devices or
    cores (remote DMAs and signals, barrier semaphores) or checks races."""
    f = kernel_facts
    return bool(
        params.detect_races or f.remote or f.signals_cores or f.uses(tpu_prims.get_barrier_semaphore_p)
    )


def _start(jaxpr, gm, params, compiler_params, kernel_facts):
    """The interpreter of a call, after the checks made before the kernel runs;
    with the grid's dimension semantics and the per-core hidden state's initializers."""
    desc = f"in TPU kernel '{gm.kernel_name}' ({gm.source})"
    interp = Interpreter(
        params,
        gm,
        desc,
        kernel_facts=kernel_facts,
        jaxpr=jaxpr,
        compiler_params=compiler_params,
        multi_device=needs_devices(params, kernel_facts),
    )
    sems = semantics_of(gm, compiler_params)
    checks.check_kernel(gm, jaxpr, compiler_params)  # what the Mosaic lowering refuses too
    checks.check_interpreted_grid(gm, sems)  # what JAX's interpret mode refuses too
    check_memory(gm, compiler_params)
    interp.init_checks()
    lane_hidden = list(_hidden_initializers(kernel_facts).items())  # per core, e.g. the PRNG state
    for name, init in lane_hidden:
        interp.hidden.named[name] = init()
    interp.setup()
    return interp, sems, lane_hidden


def _lay_out(interp, args, jaxpr, gm, params, input_output_aliases, sems, lane_hidden) -> _Call:
    """Cells for the scalar prefetch operands and the operands; the grid points."""
    nsp, D = gm.num_scalar_prefetch, gm.num_dynamic_grid_bounds
    dynamic_sizes, args = list(args[:D]), args[D:]
    call = _Call(interp, jaxpr, gm, params, lane_hidden, dynamic_sizes, list(args[:nsp]))
    call.prefetch = [
        RefView(interp.new_cell(jnp.asarray(a), f"scalar prefetch operand {i}", tpu_core.SMEM))
        for i, a in enumerate(args[:nsp])
    ]
    # The kernel's inputs: grid indices, dynamic grid sizes, scalar prefetch, operands, scratch.
    call.first_ref = len(gm.grid) + D + nsp
    call.targets = interp.dma_targets(jaxpr)
    if len(jaxpr.jaxpr.invars) != call.first_ref + len(gm.block_mappings) + len(gm.scratch_avals):
        call.targets = None  # not the layout above: any cell may be a DMA's destination
    call.ops = _operand_cells(call, args[nsp:], input_output_aliases)
    if D:  # one core; each step computes its grid point (see _grid_point)
        call.sizes = dynamic_grid_sizes(gm, sems, params, dynamic_sizes)
        interp.grid_sizes = call.sizes  # pl.num_programs in the index maps (dynamic_grid_size)
        call.n_steps = plb.num_steps(call.sizes)
        call.per_core = [None]
    else:
        call.per_core = grid_points(gm, sems, params)
    call.blocked = [i for i, op in enumerate(call.ops) if op.buf is not None]
    return call


def _operand_cells(call: _Call, operands, input_output_aliases) -> list[_Operand]:
    """Each operand's HBM cell (an aliased output shares its input's) and block buffer."""
    interp, gm, mode = call.interp, call.gm, call.params.uninitialized_memory
    alias_of = {o: i for i, o in input_output_aliases}
    ops: list[_Operand] = []
    for k, bm in enumerate(gm.block_mappings):
        is_out = k >= gm.num_inputs
        o = k - gm.num_inputs
        if not is_out:
            hbm = interp.new_cell(
                _pad_to_blocks(jnp.asarray(operands[k]), bm, mode), f"{bm.origin} (HBM)", tpu_core.HBM
            )
        elif o in alias_of:
            hbm = ops[alias_of[o]].hbm
            interp.cell_names[hbm] += f" = {bm.origin}"
        else:
            padded = _pad_to_blocks(jnp.zeros(bm.array_shape, bm.dtype), bm, mode).shape
            hbm = interp.new_cell(interp.memory.fresh(padded, bm.dtype), f"{bm.origin} (HBM)", tpu_core.HBM)
        buf = None
        if not bm.is_whole_array:
            buf = interp.new_cell(
                interp.memory.fresh(bm.kernel_block_shape, bm.dtype),
                f"{bm.origin} block",
                bm.memory_space or tpu_core.VMEM,
                dma_target=call.targets is None or call.first_ref + k in call.targets,
            )
        ops.append(_Operand(bm, hbm, buf))
    return ops


def _new_scratch(call: _Call) -> list[int]:
    cells = []
    gm, targets = call.gm, call.targets
    for i, a in enumerate(gm.scratch_avals):
        if isinstance(getattr(a, "memory_space", None), interpret_mxu.tpu_mxu.AccMemorySpace):
            raise _err(
                gm,
                ValueError,
                f"scratch_shapes[{i}]",
                "an MXU accumulator (pltpu.ACC) is allocated with pl.run_scoped inside the kernel, "
                "not as scratch (as in JAX)",
            )
        init = (
            jnp.zeros(a.shape, jnp.int32)
            if plb.semaphore_kind(a) is not None
            else call.interp.memory.fresh(a.shape, a.dtype)
        )
        space = getattr(a, "memory_space", None)
        target = targets is None or call.first_ref + len(gm.block_mappings) + i in targets
        cells.append(call.interp.new_cell(init, f"scratch_shapes[{i}]", space, dma_target=target))
    return cells


def _new_lane(call: _Call, slot: int, core_id: int) -> _Lane:
    """A core of a group: its own scratch, and block buffers (the group's first
    core uses the operands' own)."""
    interp = call.interp
    scratch = _new_scratch(call)
    core_ops = list(call.ops)
    for i in call.blocked:
        op = call.ops[i]
        init = call.interp.memory.fresh(op.bm.kernel_block_shape, op.bm.dtype)
        buf = cast(int, op.buf)  # a blocked operand has a block buffer
        if slot > 0:
            name = f"{op.bm.origin} block (core {core_id})"
            buf = interp.new_cell(init, name, interp.cell_spaces[buf], dma_target=buf in interp.shadows)
        interp.state[buf] = init
        core_ops[i] = _Operand(op.bm, op.hbm, buf)
        interp.hidden.block_starts[i, slot] = jnp.zeros((len(op.bm.block_shape),), jnp.int32)
    views = [RefView(op.buf if op.buf is not None else op.hbm) for op in core_ops]
    return _Lane(core_id, slot, core_ops, views + [RefView(c) for c in scratch], scratch)


def _run_group(call: _Call, group: list[int], steps_before: int, total_steps) -> int:
    """Runs the grid points of a group of cores; returns how many steps that was
    (0 for a dynamic grid, which runs once, as one group)."""
    interp, D = call.interp, call.dynamic
    # Each core of a group has its own scratch and block buffers; the cores
    # of a group run their grid points in lockstep (see _core_groups).
    lanes = [_new_lane(call, slot, core_id) for slot, core_id in enumerate(group)]
    for view, a in zip(call.prefetch, call.prefetch_args):  # each core group has its own SMEM copy
        interp.state[view.cell] = jnp.asarray(a)
    table = None if D else jnp.asarray(np.stack([call.per_core[c] for c in group]), jnp.int32)

    def step(s, carry):
        interp.restore(*carry)
        interp.progress = (jnp.asarray(steps_before + s, jnp.int32), jnp.asarray(total_steps, jnp.int32))
        _run_lanes(call, lanes, table, s)
        return interp.snapshot()

    carry = interp.snapshot()
    n = call.n_steps if D else len(call.per_core[group[0]])
    carry = step(0, carry) if not D and n == 1 else lax.fori_loop(0, n, step, carry)
    interp.restore(*carry)
    interp.progress = None
    for lane in lanes:
        _end_lane(call, lane, n)
    return 0 if D else n


def _run_lanes(call: _Call, lanes: list[_Lane], table, s) -> None:
    """Grid step ``s`` of every lane: round robin, each core runs up to its next
    semaphore wait (a single core runs straight through). The run_scoped buffers
    the lanes share live within the step (``shared_scopes.py``)."""
    interp = call.interp
    pause = _is_sem_wait if len(lanes) > 1 else None
    interp.scopes.begin_step(len(lanes))
    # One step per core (pl.core_map): the grid points are known while tracing.
    interp.fold_static = len(lanes) > 1 and isinstance(s, int) and not call.dynamic
    running = []
    for lane in lanes:
        lane_run = _Running(
            lane.core_id, None, named={n: interp.hidden.named[n] for n, _ in call.lane_hidden}
        )
        lane_run.steps = _lane_steps(call, lane, table, s, pause, lane_run)
        running.append(lane_run)
    while running:  # round robin: each core runs up to its next semaphore wait
        for lane_run in list(running):
            interp.core_id = lane_run.core_id
            interp.grid_env = lane_run.grid_env
            interp.hidden.named.update(lane_run.named)
            try:
                next(lane_run.steps)
            except StopIteration:
                running.remove(lane_run)
            lane_run.named = {n: interp.hidden.named[n] for n, _ in call.lane_hidden}
    interp.fold_static = False
    for cell in interp.scopes.end_step():  # a shared buffer some core never entered
        interp.free_cell(cell)


def _lane_steps(call: _Call, lane: _Lane, table, s, pause, lane_run: _Running):
    """One lane's grid step ``s`` as a generator (see ``Interpreter.iter_jaxpr``):
    its blocks enter the pipeline, then the kernel runs."""
    interp, gm, prefetch = call.interp, call.gm, call.prefetch
    core_ops, views = lane.ops, lane.views
    pt: jnp.ndarray | np.ndarray
    if call.dynamic:
        pt = jnp.stack(plb.grid_point(s, call.sizes))
    elif interp.fold_static:
        pt = np.asarray(call.per_core[lane.core_id][s], np.int32)
    else:
        pt = table[lane.slot, s]
    gidx = [pt[g] for g in range(len(gm.grid))]
    lane_run.grid_env = {n: gidx[g] for g, n in enumerate(gm.grid_names) if n is not None}
    interp.grid_env = lane_run.grid_env
    if call.params.grid_point_recorder is not None:
        interp.ordered_callback(call.params.grid_point_recorder, pt, jnp.int32(lane.core_id))
    for i in call.blocked:
        _enter_block(interp, core_ops[i], (i, lane.slot), _jax_operand_name(gm, i), gidx, prefetch, s)
    views = [_batched_view(interp, op, v, gidx, prefetch) for op, v in zip(core_ops, views)] + list(
        views[len(core_ops) :]
    )
    invals = [*gidx, *call.dynamic_sizes, *prefetch, *views]
    yield from interp.iter_jaxpr(call.jaxpr.jaxpr, call.jaxpr.consts, invals, pause)


def _end_lane(call: _Call, lane: _Lane, n) -> None:
    """After a lane's last grid step (``n`` steps): its semaphores must be back at
    zero, its last output blocks go back to HBM, its cells are freed."""
    interp, gm = call.interp, call.gm
    core_ops, scratch = lane.ops, lane.scratch
    interp.core_id = lane.core_id
    for i, a in enumerate(gm.scratch_avals):
        if plb.semaphore_kind(a) is not None:
            core_rules.check_sem_zero(interp, RefView(scratch[i]), None, "when the kernel ends")
    interpret_mxu.check_registers_empty(interp)
    for i in call.blocked:
        if i >= gm.num_inputs:  # the last output block goes back to HBM
            op = core_ops[i]
            prev_arr = interp.hidden.block_starts.pop((i, lane.slot))
            prev = [prev_arr[d] for d in range(len(op.bm.block_shape))]
            blk = interp.state[cast(int, op.buf)].reshape(op.bm.block_sizes)  # blocked: has a buffer
            if call.dynamic:  # a dynamic grid may run no step: then there is no last block
                old = lax.dynamic_slice(interp.state[op.hbm], prev, op.bm.block_sizes)
                blk = jnp.where(n > 0, blk, old)
            interp.on_block_write(
                op.hbm, prev, op.bm.block_sizes, op.bm.origin, n > 0 if call.dynamic else True
            )
            interp.state[op.hbm] = lax.dynamic_update_slice(interp.state[op.hbm], blk, prev)
        else:
            interp.hidden.block_starts.pop((i, lane.slot))
        if lane.slot > 0:
            interp.free_cell(cast(int, core_ops[i].buf))  # blocked: has a buffer
    for op in core_ops[gm.num_inputs :]:
        if op.buf is None and _copied_whole(op.bm):
            # A whole-array output in VMEM or SMEM is copied back to HBM after the core's
            # last step, as a block is: two cores that both write it race (as in JAX's).
            interp.on_block_write(op.hbm, [0] * len(op.bm.array_shape), op.bm.array_shape, op.bm.origin)
    for c in scratch:
        interp.free_cell(c)


def _copied_whole(bm) -> bool:
    """A whole-array operand the pipeline copies into the core's memory (VMEM or
    SMEM), not one the kernel reaches in HBM (``pl.ANY``, ``pltpu.HBM``)."""
    ms = bm.memory_space
    return ms is None or ms in (tpu_core.VMEM, tpu_core.SMEM)


def _batched_view(interp, op, view, gidx, prefetch):
    """A whole-array (HBM) operand of a kernel under ``jax.vmap`` has a squeezed
    block dim per batch axis: the kernel sees the array at its batch index."""
    bm = op.bm
    if op.buf is not None or not any(isinstance(d, plb.Squeezed) for d in bm.block_shape):
        return view
    idx = interp.eval_closed(bm.index_map, [*gidx, *prefetch])
    NDIndexer, _ = compat.indexing_types()
    sel = tuple(
        jnp.asarray(i, jnp.int32) if isinstance(d, plb.Squeezed) else slice(None)
        for d, i in zip(bm.block_shape, idx)
    )
    return view.with_transforms([NDIndexer.from_indices_shape(sel, tuple(interp.state[op.hbm].shape))])


def _is_sem_wait(eqn) -> bool:
    return eqn.primitive is plb.semaphore_wait_p


def _core_groups(kernel_facts: plb.KernelFacts, per_core, shares_scoped: bool = False) -> list[list[int]]:
    """The cores that run together. Cores run one after the other, except when
    the kernel signals another core's semaphore (``pl.semaphore_signal(...,
    core_index=...)``, ``pltpu.core_barrier``) or allocates a buffer the cores
    share (``pl.run_scoped(pltpu.HBM(...))``, ``shares_scoped``): then all cores
    run their grid points in lockstep, and within a grid step they take turns,
    each running up to its next ``pl.semaphore_wait`` outside control flow, so a
    core can wait for a signal another core sends before its own wait. A wait
    inside a loop, or a ``lax.cond`` whose predicate is not known while tracing,
    is one step of its core; waiting there for a core that has not run yet is
    reported as a deadlock. With one grid point per core (``pl.core_map``), a
    cond on the core index (``pl.when(lax.axis_index(...) == 0)``) is known."""
    cores = list(range(len(per_core)))
    together = kernel_facts.signals_cores or shares_scoped
    if len(cores) > 1 and together and len({len(p) for p in per_core}) == 1:
        return [cores]
    return [[c] for c in cores]


def _block_or_fill(hbm, starts, sizes, mode):
    """The block of ``hbm`` at ``starts``, with the uninitialized value (``mode``) where
    it lies past the array's edge (a gather with ``mode="fill"``)."""
    fill = plb.uninitialized_fill(hbm.dtype, mode)[()]
    idx = []
    for d, (st, size) in enumerate(zip(starts, sizes)):
        shape = [1] * len(sizes)
        shape[d] = size
        idx.append((jnp.asarray(st, jnp.int32) + jnp.arange(size, dtype=jnp.int32)).reshape(shape))
    return hbm.at[tuple(idx)].get(mode="fill", fill_value=fill)


def _jax_operand_name(gm, i: int) -> str:
    """JAX's interpreter's name of operand ``i`` in its messages: ``input 0``, ``output 1``."""
    return f"input {i}" if i < gm.num_inputs else f"output {i - gm.num_inputs}"


def _enter_block(interp, op, key: tuple[int, int], jax_name: str, gidx, prefetch, s):
    """The pipeline before a grid step: fetch a changed input block; write back
    an output block whose index changed (its new buffer starts uninitialized).
    ``key``: (operand, core slot), where the block started at the step before
    in ``interp.hidden.block_starts``; ``jax_name``: the operand as JAX's messages
    name it (``input 0``, ``output 1``)."""
    bm = op.bm
    is_out = jax_name.startswith("output")
    idx = interp.eval_closed(bm.index_map, [*gidx, *prefetch])
    starts = _starts(bm, idx)
    hbm = interp.state[op.hbm]
    # out_of_bounds_reads="uninitialized": an input block past the array's edge reads the
    # uninitialized value there (as in JAX's); an output block past it is an error in any mode.
    fill_oob = not is_out and interp.params.out_of_bounds_reads == "uninitialized"
    for d, (st, size, n) in enumerate(zip(starts, bm.block_sizes, hbm.shape)):
        if fill_oob:
            break
        shown = [st if isinstance(bm.block_shape[d], (plb.Element, plb.Squeezed)) else idx[d]]
        # JAX's words first (its interpreter: "Out-of-bounds block index (4, 0) for input
        # ... in iteration (3,)"), then ours.
        pos = ", ".join(f"{{{k + 1}}}" for k in range(len(gidx))) + ("," if len(gidx) == 1 else "")
        iteration = f" in iteration ({pos})" if len(gidx) <= 7 else ""
        interp.check(
            jnp.logical_and(st >= 0, st + size <= n),
            f"{interp.kernel_desc}: Out-of-bounds block index {{0}} (dimension {d}) for {jax_name}"
            f"{iteration}: {bm.origin}.index_map returned block index {{0}} for dimension {d}, "
            f"outside the array {bm.dtype}{list(bm.array_shape)} (block {bm.block_sizes[d]}, "
            f"{-(-bm.array_shape[d] // max(bm.block_sizes[d], 1))} blocks)",
            shown + (list(gidx) if len(gidx) <= 7 else []),
        )
    starts_c = [
        lax.clamp(np.int32(0), st, np.int32(max(n - size, 0)))
        for st, size, n in zip(starts, bm.block_sizes, hbm.shape)
    ]
    prev_arr = interp.hidden.block_starts[key]
    seen = (
        [jnp.asarray(st, jnp.int32) for st in starts] if fill_oob else starts_c
    )  # unclamped: a block past the edge is its own
    cur = jnp.stack(seen) if seen else jnp.zeros((0,), jnp.int32)
    changed = jnp.logical_or(s == 0, jnp.any(cur != prev_arr))
    kshape = bm.kernel_block_shape
    if not is_out:
        if fill_oob:
            new = _block_or_fill(hbm, starts, bm.block_sizes, interp.memory.uninitialized).reshape(kshape)
        else:
            new = lax.dynamic_slice(hbm, starts_c, bm.block_sizes, allow_negative_indices=False).reshape(
                kshape
            )
        interp.state[op.buf] = jnp.where(changed, new, interp.state[op.buf])
    else:
        prev = [prev_arr[d] for d in range(len(starts_c))]
        old_hbm = lax.dynamic_slice(hbm, prev, bm.block_sizes, allow_negative_indices=False)
        blk = interp.state[op.buf].reshape(bm.block_sizes)
        write_back = jnp.logical_and(changed, s > 0)
        interp.on_block_write(op.hbm, prev, bm.block_sizes, bm.origin, write_back)
        interp.state[op.hbm] = lax.dynamic_update_slice(
            hbm, jnp.where(write_back, blk, old_hbm), prev, allow_negative_indices=False
        )
        fresh = interp.memory.fresh(kshape, bm.dtype)
        interp.state[op.buf] = jnp.where(changed, fresh, interp.state[op.buf])
    interp.hidden.block_starts[key] = cur
