"""Which grid axes a Pallas GPU kernel may loop over inside one program, and when
doing so would change what a step reads (``kernel.py``'s docstring has the rules):
read off the kernel's jaxpr and its block mappings' index maps."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun, jaxprs_in_params

from pallas import backend as plb
from pallas_gpu._src import compat
from pallas_gpu._src.language import primitives as gpu_primitives


def sequential_axes(gm, jaxpr) -> tuple[int, ...]:
    """Grid axes (of size > 1) along which every output block stays the same:
    no output index map reads them, and the kernel does not address its
    outputs with their ``program_id`` (a Triton-style kernel over whole
    arrays writes ``o_ref[pl.ds(i * b, b)]``: its programs write disjoint
    parts and stay parallel). Empty for kernels without outputs or with
    atomics (those combine parallel programs through memory)."""
    outs = gm.out_block_mappings
    if not outs or plb.kernel_facts(jaxpr).uses(gpu_primitives.atomic_rmw_p, gpu_primitives.atomic_cas_p):
        return ()
    read: set[int] = set()
    for bm in outs:
        read |= _inputs_read(bm.index_map)
    invars = compat.unwrap_jaxpr(jaxpr)[0].invars
    first_out = len(gm.grid) + gm.num_inputs
    out_refs = {id(v) for v in invars[first_out : first_out + gm.num_outputs]}
    return tuple(
        ax
        for ax, g in enumerate(gm.grid)
        if g > 1 and ax not in read and not _addresses(jaxpr, {id(invars[ax])}, out_refs)
    )


def in_grid_order(gm, sequential: Sequence[int]) -> tuple[int, ...]:
    """The sequential axes that come after every parallel axis of size > 1: looping over
    those inside each program keeps the steps in grid order."""
    parallel = [ax for ax, g in enumerate(gm.grid) if g > 1 and ax not in sequential]
    return tuple(ax for ax in sequential if not parallel or ax > parallel[-1])


# Grids with more steps are not checked by ``programs_share_blocks`` (it evaluates
# every index map at every step).
MAX_CHECKED_STEPS = 1 << 16


def programs_share_blocks(gm, jaxpr, sequential: Sequence[int], aliases) -> bool:
    """Whether, with ``sequential`` axes looped inside programs, a step reads or writes
    an output block that a step of another program writes: two programs writing one
    output block, or a program reading (through an aliased input, ``aliases`` as
    ``(input, output)`` pairs) a block another program writes. On a GPU that is a race;
    Triton's interpreter runs programs in order, so the step order decides what is read.
    False where it cannot tell (dynamic or huge grids, ``Element`` blocks, outputs the
    kernel indexes with ``program_id``, aliased blocks of another shape)."""
    grid = tuple(gm.grid)
    if not all(isinstance(g, int) for g in grid) or math.prod(grid) > MAX_CHECKED_STEPS:
        return False
    parallel = [ax for ax in range(len(grid)) if ax not in sequential]
    points = np.stack(np.meshgrid(*[np.arange(g, dtype=np.int32) for g in grid], indexing="ij"), -1)
    points = points.reshape(-1, len(grid))
    program = np.zeros(len(points), np.int64)
    for ax in parallel:
        program = program * grid[ax] + points[:, ax]
    jaxpr_ = compat.unwrap_jaxpr(jaxpr)[0]
    ids = {id(v) for v in jaxpr_.invars[: len(grid)] if grid[jaxpr_.invars.index(v)] > 1}
    n_in = gm.num_inputs
    writer: dict[int, np.ndarray] = {}  # output -> (block key, its one writing program) pairs
    for o in range(gm.num_outputs):
        ref = jaxpr_.invars[len(grid) + n_in + o]
        keys = _block_keys(gm.block_mappings[n_in + o], points)
        if keys is None or _addresses(jaxpr, ids, {id(ref)}):
            continue
        pairs = np.unique(np.stack([keys, program], 1), axis=0)
        if (pairs[1:, 0] == pairs[:-1, 0]).any():
            return True
        writer[o] = pairs
    used = {id(v) for e in jaxpr_.eqns for v in e.invars}
    for i, o in aliases:
        if o not in writer or i >= n_in or id(jaxpr_.invars[len(grid) + i]) not in used:
            continue
        bm_in, bm_out = gm.block_mappings[i], gm.block_mappings[n_in + o]
        if bm_in.block_sizes != bm_out.block_sizes:
            continue
        keys = _block_keys(bm_in, points)
        if keys is None:
            continue
        written, by = writer[o][:, 0], writer[o][:, 1]
        at = np.clip(np.searchsorted(written, keys), 0, len(written) - 1)
        if ((written[at] == keys) & (by[at] != program)).any():
            return True
    return False


def _block_keys(bm, points: np.ndarray) -> np.ndarray | None:
    """One int per grid point naming the block of ``bm`` it accesses (block indices
    wrapped and clamped as ``block_ref`` does); None for ``Element`` blocks."""
    sizes = []
    for dim in bm.block_shape:
        if isinstance(dim, plb.Squeezed):
            sizes.append(1)
        elif isinstance(dim, plb.Blocked):
            sizes.append(dim.block_size)
        else:
            return None
    if not sizes:
        return np.zeros(len(points), np.int64)
    with jax.ensure_compile_time_eval():
        idx = jax.vmap(jaxpr_as_fun(bm.index_map))(*[points[:, a] for a in range(points.shape[1])])
    key = np.zeros(len(points), np.int64)
    for d, (size, n) in enumerate(zip(sizes, bm.array_shape)):
        count = max(-(-n // size), 1) if size else 1
        ix = np.broadcast_to(np.asarray(idx[d], np.int64), (len(points),))
        ix = np.clip(np.where(ix < 0, ix + count, ix), 0, count - 1)
        key = key * count + ix
    return key


# State primitives: (ref, value, *indices) for these, (ref, *indices, ...) for the others.
_WITH_VALUE = {compat.swap_p, compat.addupdate_p, gpu_primitives.store_p, gpu_primitives.swap_p}
_STATE = {compat.get_p, gpu_primitives.load_p, *_WITH_VALUE}


def _addresses(closed, tainted: set[int], refs: set[int]) -> bool:
    """Whether a value computed from ``tainted`` vars indexes one of ``refs``
    (followed into sub-jaxprs by position; ``id``s of jaxpr vars)."""
    jaxpr, _ = compat.unwrap_jaxpr(closed)
    tainted = set(tainted)
    for eqn in jaxpr.eqns:
        ins = [v if isinstance(v, compat.Var) else None for v in eqn.invars]
        if eqn.primitive in _STATE and id(ins[0]) in refs:
            if any(
                id(v) in tainted for v in ins[2 if eqn.primitive in _WITH_VALUE else 1 :] if v is not None
            ):
                return True
        for sub in jaxprs_in_params(eqn.params):
            pairs = _by_position(compat.unwrap_jaxpr(sub)[0].invars, ins)
            sub_tainted = {id(s) for s, v in pairs if v is not None and id(v) in tainted}
            sub_refs = {id(s) for s, v in pairs if v is not None and id(v) in refs}
            if sub_refs and _addresses(sub, sub_tainted, sub_refs):
                return True
        if any(v is not None and id(v) in tainted for v in ins):
            tainted |= {id(v) for v in eqn.outvars}
    return False


def _by_position(sub_invars, ins):
    """Pairs (sub-jaxpr input, equation operand): one to one, else the
    operands are a suffix (cond branches, while bodies) or a prefix (run_scoped)."""
    if len(sub_invars) <= len(ins):
        return list(zip(sub_invars, ins[len(ins) - len(sub_invars) :]))
    return list(zip(sub_invars, ins))


def _inputs_read(closed) -> set[int]:
    """Positions of the jaxpr's inputs that its outputs depend on (an
    equation with sub-jaxprs counts as reading all its operands)."""
    jaxpr, _ = compat.unwrap_jaxpr(closed)
    needed = {id(v) for v in jaxpr.outvars if isinstance(v, compat.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(id(v) in needed for v in eqn.outvars):
            needed |= {id(v) for v in eqn.invars if isinstance(v, compat.Var)}
    return {k for k, v in enumerate(jaxpr.invars) if id(v) in needed}


def aliased_outputs_read(jaxpr, grid_mapping, aliases) -> frozenset[int]:
    """Outputs (block mapping indices) aliased to an input the kernel reads
    (``input_output_aliases``, JAX's ``(input, output)`` pairs). A sequential
    step that reads such an input sees what earlier steps stored through the
    output (Pallas' in-order semantics): the output stays in memory, not in
    registers, where those stores would be invisible to the input's loads."""
    invars = compat.unwrap_jaxpr(jaxpr)[0].invars
    first_in = len(grid_mapping.grid)
    used = {id(v) for e in compat.unwrap_jaxpr(jaxpr)[0].eqns for v in e.invars}
    return frozenset(
        grid_mapping.num_inputs + o
        for i, o in aliases
        if i < grid_mapping.num_inputs and id(invars[first_in + i]) in used
    )
