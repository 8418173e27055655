"""pallas_call_p and its rules: abstract eval, vmap, jvp, the grad error,
and lowering (interpret mode or a registered backend)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallas._src import backends, compat, primitives
from pallas._src import core as pallas_core
from pallas._src.call import PallasCall
from pallas._src.errors import ValueOrTypeError

#: The primitive ``pallas_call`` binds; backends register its MLIR lowering for their platform.
pallas_call_p = Primitive("pallas_call")
pallas_call_p.multiple_results = True


def _abstract_eval(*avals, grid_mapping, **_):
    return list(grid_mapping.out_avals)


pallas_call_p.def_abstract_eval(_abstract_eval)
pallas_call_p.def_impl(functools.partial(jax._src.dispatch.apply_primitive, pallas_call_p))


# ---------------------------------------------------------------------------
# vmap: the batch becomes a new leading grid axis.


def _retrace(fun, avals, dbg_name: str):
    dbg = compat.make_debug_info(dbg_name, fun, [None] * len(avals))
    jaxpr, consts = compat.trace_to_closed_jaxpr(fun, avals, dbg)
    assert not consts, consts
    return jaxpr


class _AxesAfterBatch:
    """The grid sizes an index map reads (``pl.num_programs`` of a traced size), seen from
    the batched grid: axis ``a`` is the new grid's axis ``a + 1``."""

    def __getitem__(self, axis: int):
        return primitives.dynamic_grid_size_p.bind(axis=axis + 1)


def _batch_index_map(index_map, batched: bool, G: int):
    def fun(*g):
        return primitives.eval_index_map(index_map, _AxesAfterBatch(), *g)

    def new_map(b, *g):
        res = list(fun(*g))
        return [b, *res] if batched else res

    return _retrace(new_map, [compat.shaped_array((), jnp.int32), *index_map.in_avals], "index_map")


def _batch_block_mapping(bm: pallas_core.BlockMapping, batched: bool, axis_size: int, G: int):
    if not batched:
        return dataclasses.replace(bm, index_map=_batch_index_map(bm.index_map, False, G))
    return dataclasses.replace(
        bm,
        block_shape=(pallas_core.squeezed, *bm.block_shape),
        index_map=_batch_index_map(bm.index_map, True, G),
        array_shape=(axis_size, *bm.array_shape),
    )


def _batch_kernel_jaxpr(jaxpr):
    """Adds a leading (unused) grid index input to the kernel jaxpr."""
    fun = compat.jaxpr_as_fun(jaxpr)
    avals = [compat.shaped_array((), jnp.int32), *jaxpr.in_avals]
    return _retrace(lambda b, *rest: fun(*rest), avals, "pallas_call")


def _batch_with_loop(args, dims, axis_size, params):
    """vmap by running one pallas_call per batch element (batched dynamic grid sizes)."""
    batched = [d is not None for d in dims]
    xs = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims) if d is not None]

    def one(slices):
        it = iter(slices)
        return pallas_call_p.bind(*[next(it) if b else a for a, b in zip(args, batched)], **params)

    outs = jax.lax.map(one, xs)
    return outs, [0] * len(outs)


def _batching_rule(args, dims, **params):
    call = PallasCall(**params)
    jaxpr, gm = call.jaxpr, call.grid_mapping
    axis_size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    D = gm.num_dynamic_grid_bounds
    if any(d is not None for d in dims[:D]):  # each element has its own grid
        return _batch_with_loop(args, dims, axis_size, params)
    if any(d is not None for d in dims[D : D + gm.num_scalar_prefetch]):
        # each element has its own scalar-prefetch values (its own block indices)
        return _batch_with_loop(args, dims, axis_size, params)
    dynamic_sizes, args, dims = args[:D], list(args[D:]), list(dims[D:])
    G, nsp = len(gm.grid), gm.num_scalar_prefetch
    batched = [d is not None for d in dims]
    # An output aliased to an unbatched input gets a batched buffer.
    for i, _ in call.input_output_aliases:  # JAX's convention: indices into args
        if not batched[i]:
            a = jnp.asarray(args[i])  # a Python scalar arrives as a literal with no .shape
            args[i] = jnp.broadcast_to(a, (axis_size, *a.shape))
            batched[i] = True
            dims = list(dims)
            dims[i] = 0
    args = [jnp.moveaxis(a, d, 0) if b else a for a, d, b in zip(args, dims, batched)]
    bms = [_batch_block_mapping(bm, b, axis_size, G) for bm, b in zip(gm.in_block_mappings, batched[nsp:])]
    bms += [_batch_block_mapping(bm, True, axis_size, G) for bm in gm.out_block_mappings]
    names = (None, *gm.grid_names) if gm.grid_names else ()
    new_gm = gm.replace(grid=(axis_size, *gm.grid), block_mappings=tuple(bms), grid_names=names)
    cp = call.compiler_params
    if cp is not None:  # backends that keep per-axis settings add one for the batch axis
        batched_cp = lambda c: c.batched() if hasattr(c, "batched") else c  # noqa: E731
        cp = tuple(map(batched_cp, cp)) if isinstance(cp, tuple) else batched_cp(cp)
    # The batched kernel only takes one more (unused) grid index: its facts are the same.
    batched_call = call.replace(jaxpr=_batch_kernel_jaxpr(jaxpr), grid_mapping=new_gm, compiler_params=cp)
    outs = pallas_call_p.bind(*dynamic_sizes, *args, **batched_call.params())
    # Outputs that no batched input reaches are the same for every batch element:
    # returned unbatched, as jax.jacfwd needs the primal outputs of a jvp.
    first = len(jaxpr.jaxpr.invars) - gm.num_inputs - gm.num_outputs - len(gm.scratch_avals)
    reached = _reached_refs(jaxpr.jaxpr, {first + i for i, b in enumerate(batched[nsp:]) if b})
    aliased = {o for _, o in call.input_output_aliases}  # start as their (batched) inputs
    out_batched = [o in aliased or first + gm.num_inputs + o in reached for o in range(gm.num_outputs)]
    outs = [x if b else x[0] for x, b in zip(outs, out_batched)]
    return outs, [0 if b else None for b in out_batched]


def _reached_refs(jaxpr, sources: set[int]) -> set[int]:
    """The kernel's inputs (by position) that values of the ``sources`` inputs
    may reach, conservatively: an equation with a reached input reaches all its
    outputs and every Ref it takes (so a loop or call over a reached value
    reaches all its Refs). Repeated to a fixed point: the body runs once per
    grid step, and a Ref written late in one step is read early in the next."""
    reached = {jaxpr.invars[i] for i in sources}
    size = -1
    while len(reached) != size:
        size = len(reached)
        for eqn in jaxpr.eqns:
            if any(not hasattr(v, "val") and v in reached for v in eqn.invars):
                reached.update(eqn.outvars)
                reached.update(v for v in eqn.invars if not hasattr(v, "val") and compat.is_ref_aval(v.aval))
    return {i for i, v in enumerate(jaxpr.invars) if v in reached}


batching.primitive_batchers[pallas_call_p] = _batching_rule


# ---------------------------------------------------------------------------
# jvp: one kernel computes primals and tangents.


def _has_tangent(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _jvp_rule(primals, tangents, **params):
    call = PallasCall(**params)
    jaxpr, gm = call.jaxpr, call.grid_mapping
    if call.input_output_aliases:
        raise NotImplementedError(
            f"{gm.where}: jax.jvp of a pallas_call with input_output_aliases is not supported"
        )
    # The kernel jaxpr's leading int inputs: grid indices, then dynamic grid sizes.
    G, n_in, n_out, nsp = (
        len(gm.grid) + gm.num_dynamic_grid_bounds,
        gm.num_inputs,
        gm.num_outputs,
        gm.num_scalar_prefetch,
    )
    D = gm.num_dynamic_grid_bounds
    prefetch_primals, primals, tangents = primals[: D + nsp], primals[D + nsp :], tangents[D + nsp :]
    nz_in = [
        not isinstance(t, ad.Zero) and _has_tangent(bm.dtype) for t, bm in zip(tangents, gm.in_block_mappings)
    ]
    nz_out = [_has_tangent(bm.dtype) for bm in gm.out_block_mappings]
    nz_scr = [_has_tangent(a.dtype) for a in gm.scratch_avals]
    nonzeros = [False] * (G + nsp) + nz_in + nz_out + nz_scr
    jvp_jaxpr, _ = compat.jvp_jaxpr(jaxpr, nonzeros, instantiate=False)
    # jvp_jaxpr's inputs: all primals, then tangents of the nonzero ones.
    # Reorder to (grid, ins, in tangents, outs, out tangents, scratch, scratch tangents).
    n_prim = len(nonzeros)
    tan_pos, k = {}, 0
    for i, nz in enumerate(nonzeros):
        if nz:
            tan_pos[i] = n_prim + k
            k += 1
    H = G + nsp
    groups = [range(H, H + n_in), range(H + n_in, H + n_in + n_out), range(H + n_in + n_out, n_prim)]
    order = list(range(H))
    for grp in groups:  # each tangent right after its primal, as the block mappings are
        for i in grp:
            order += [i] + ([tan_pos[i]] if i in tan_pos else [])
    fun = compat.jaxpr_as_fun(jvp_jaxpr)
    avals = jvp_jaxpr.in_avals

    def reordered(*args):
        full = [None] * len(args)
        for pos, a in zip(order, args):
            full[pos] = a
        return fun(*full)

    new_jaxpr = _retrace(reordered, [avals[i] for i in order], "pallas_call")

    def tangent_bm(bm):
        return dataclasses.replace(bm, origin=f"{bm.origin} (tangent)")

    in_bms, out_bms = [], []
    for bm, nz in zip(gm.in_block_mappings, nz_in):
        in_bms += [bm] + ([tangent_bm(bm)] if nz else [])
    for bm, nz in zip(gm.out_block_mappings, nz_out):
        out_bms += [bm] + ([tangent_bm(bm)] if nz else [])
    scratch = []
    for a, nz in zip(gm.scratch_avals, nz_scr):
        scratch += [a] + ([a] if nz else [])
    new_gm = gm.replace(
        block_mappings=tuple(in_bms + out_bms),
        num_inputs=len(in_bms),
        num_outputs=len(out_bms),
        scratch_avals=tuple(scratch),
    )
    args = list(prefetch_primals)
    for p, t, nz in zip(primals, tangents, nz_in):
        args += [p] + ([ad.instantiate_zeros(t)] if nz else [])
    outs = pallas_call_p.bind(*args, **call.with_kernel(new_jaxpr, new_gm).params())
    it = iter(outs)
    out_p, out_t = [], []
    for nz in nz_out:
        out_p.append(next(it))
        out_t.append(next(it) if nz else compat.zero_tangent(out_p[-1]))
    return out_p, out_t


ad.primitive_jvps[pallas_call_p] = _jvp_rule


def _grad_error(gm) -> Exception:
    # JAX's Pallas fails here with "Linearization failed ..." (a ValueError): say that too.
    return ValueOrTypeError(
        f"{gm.where}: reverse-mode differentiation (jax.grad, "
        "jax.vjp) of a pallas_call is not supported. Define the backward pass yourself: wrap "
        "the call in a function decorated with jax.custom_vjp and write the backward kernel "
        "(see https://docs.jax.dev/en/latest/notebooks/Custom_derivative_rules_for_Python_code.html). "
        "(JAX's Pallas: Linearization failed to produce known values for all output primals.)"
    )


def _transpose_rule(cts, *args, grid_mapping, **_):
    raise _grad_error(grid_mapping)


ad.primitive_transposes[pallas_call_p] = _transpose_rule


def _linearize_rule(is_vjp, nonzeros, *primals, grid_mapping, **_):
    raise _grad_error(grid_mapping)


compat.primitive_linearizations[pallas_call_p] = _linearize_rule


# ---------------------------------------------------------------------------
# Lowering: interpret mode (pallas-core's, or a backend's interpreter) or a
# backend's lowering for the hardware. ``interpret`` is resolved here, once.


@dataclasses.dataclass(frozen=True)
class _Interpreter:
    """Who runs an interpreted call: pallas-core (``backend`` None) or a
    backend's interpreter, with its params; ``claimed``: the backend took over a
    kernel pallas-core's interpret mode cannot run."""

    backend: backends.Backend | None
    params: Any
    claimed: bool = False


def resolve_interpret(call: PallasCall) -> _Interpreter:
    """The one place ``interpret`` is dispatched: ``True``, ``pl.InterpretParams``
    (or ``False`` on the CPU) run in pallas-core's interpret mode unless the kernel
    needs a backend's interpreter; a backend's interpret params select that backend."""
    from pallas._src.interpret import InterpretParams

    interpret = call.interpret
    if interpret and interpret is not True and not isinstance(interpret, InterpretParams):
        backend = backends.for_interpret_params(interpret)
        if backend is None:
            raise TypeError(
                f"{call.where}: interpret={interpret!r} is not understood by pallas-core or any installed backend"
            )
        return _Interpreter(backend, interpret)
    if call.needs_backend_interpreter:
        backend = backends.interpreter_for(call)
        if backend is None:
            raise NotImplementedError(
                f"{call.where}: this kernel uses backend memory spaces, "
                "semaphores, a named grid or scalar prefetch, which pallas-core's interpret mode does "
                "not model; install the TPU interpreter (pip install jax-pallas-tpu) and pass "
                "interpret=pltpu.InterpretParams() or interpret=True"
            )
        return _Interpreter(backend, backend.INTERPRET_PARAMS(), claimed=True)
    return _Interpreter(None, interpret if isinstance(interpret, InterpretParams) else InterpretParams())


def _interpret_lowering(ctx, call: PallasCall, *args):
    from pallas._src.interpret import interpret_pallas_call

    engine = resolve_interpret(call)
    if engine.backend is None:
        fun = functools.partial(interpret_pallas_call, call=call, params=engine.params)
        return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)
    _check_dynamic_grid(call, engine.backend, f"{engine.backend.describe()}'s interpreter does not run")
    if not engine.claimed:
        platforms = compat.lowering_platforms(ctx)
        if len(platforms) > 1:  # jax.export for several platforms: host callbacks do not serialize
            raise NotImplementedError(
                f"{call.where}: jax.export for the platforms {', '.join(platforms)} cannot serialize this "
                f"kernel: interpret={type(call.interpret).__name__}(...) runs it in "
                f"{engine.backend.describe()}'s interpreter, which calls back into Python (host callbacks). "
                "Export it without interpret= for its hardware platform, or with interpret=True "
                "(pallas-core's interpret mode, plain JAX) for the CPU too, where the kernel uses no "
                "backend features."
            )
        return engine.backend.interpret(ctx, call, engine.params, *args)
    if not compat.lowering_for_export(ctx):
        return engine.backend.interpret(ctx, call, engine.params, *args)
    callbacks = compat.host_callback_count(ctx)
    try:
        outs = engine.backend.interpret(ctx, call, engine.params, *args)
    except ValueError as e:
        # On a machine whose default backend is not the CPU (a GPU machine), JAX
        # refuses to lower the interpreter's host callbacks for the CPU at all.
        if compat.host_callbacks_unavailable(ctx):
            raise _export_error(call, engine.backend) from e
        raise
    if compat.host_callback_count(ctx) > callbacks:
        raise _export_error(call, engine.backend)
    return outs


def _export_error(call: PallasCall, backend) -> NotImplementedError:
    mode = "in interpret mode" if call.interpret else "on the CPU"
    return NotImplementedError(
        f"{call.where}: jax.export cannot serialize this kernel {mode}: "
        "it uses backend memory spaces, semaphores, a named grid or scalar prefetch, so it runs in "
        f"{backend.describe()}'s interpreter, which calls back into Python (host callbacks). Export it "
        "without interpret mode for its hardware platform only (e.g. platforms=['tpu']), or leave those "
        "features out of the kernel to export it for the CPU as well."
    )


def _platform_rule(platform: str, call: PallasCall, platforms: tuple[str, ...] = ()):
    """The lowering rule ``(ctx, call, *args)`` of one platform; ``platforms``: all
    those being lowered for (several under ``jax.export(..., platforms=[...])``)."""
    cp = call.first_compiler_params  # several configs to autotune over are all of one type
    if platform == "cpu":
        want = getattr(cp, "PLATFORM", "")
        # Exported for ("cpu", "tpu") with TPU compiler_params: the TPU branch uses
        # them, the CPU branch runs the kernel in interpret mode.
        if want and want != "cpu" and want not in platforms:
            owner = backends.for_platform(want, cp)
            interpreter = (
                f"{owner.describe()}.InterpretParams()"
                if owner is not None and owner.INTERPRET_PARAMS is not None
                else "the backend's InterpretParams()"
            )
            raise ValueError(
                f"{call.where}: compiler_params {type(cp).__name__} are for "
                f"'{want}', but the kernel is being lowered for the CPU (no {want} device). Pass "
                f"interpret=True to run it as plain JAX, or interpret={interpreter} for "
                "the backend's interpreter."
            )
        return _interpret_lowering
    backend = _hardware_backend(platform, call, cp)
    _check_dynamic_grid(call, backend, f"the {platform} backend does not lower")

    def rule(ctx, call: PallasCall, *args):
        call = call.replace(compiler_params=backend.check_compiler_params(call))
        return backend.lower(ctx, call, *args)

    return rule


def _check_dynamic_grid(call: PallasCall, backend: backends.Backend, what: str) -> None:
    """The one check of a grid with traced sizes against the backend that takes the call."""
    if call.grid_mapping.num_dynamic_grid_bounds and not backend.DYNAMIC_GRID:
        raise NotImplementedError(
            f"{call.where}: grid {call.grid_mapping.grid} has dynamic (traced) sizes, which {what}; use "
            "static grid sizes (e.g. the largest size, skipping the extra programs with pl.when), or "
            "interpret=True"
        )


def _hardware_backend(platform: str, call: PallasCall, cp) -> backends.Backend:
    name = call.backend
    backend = backends.for_platform(platform, cp, name)
    if backend is None and name is not None:
        raise ValueError(f"{call.where}: {_named_backend_problem(name, platform)}")
    if backend is None:
        pkg = backends.PACKAGE_FOR_PLATFORM.get(platform)
        installed = [n for n, b in backends.backends().items() if backends.PACKAGE_FOR_BACKEND.get(n) == pkg]
        if pkg and installed:  # e.g. rocm: jax-pallas-gpu is there, but lowers for cuda only
            serves = ", ".join(backends.backends()[installed[0]].PLATFORMS) or "no platform"
            raise ValueError(
                f"{call.where}: {pkg} is installed, but its backend '{installed[0]}' lowers for {serves}, "
                f"not for platform '{platform}', which no installed Pallas backend lowers for. Use "
                "interpret=True to run the kernel as plain JAX instead."
            )
        hint = f"pip install {pkg}" if pkg else "no pallas backend exists for it"
        extra = backends.load_errors()
        broken = f" (installed backends that failed to load: {extra})" if extra else ""
        raise ValueError(
            f"{call.where}: no Pallas backend is installed for "
            f"platform '{platform}' ({hint}){broken}. Use interpret=True to run the kernel "
            "as plain JAX instead."
        )
    want = getattr(cp, "PLATFORM", "")
    if want and platform not in backend.PLATFORMS:
        raise ValueError(
            f"{call.where}: compiler_params {type(cp).__name__} are for "
            f"'{want}' but the kernel is being lowered for '{platform}'"
        )
    return backend


def _named_backend_problem(name: str, platform: str) -> str:
    found = backends.backends().get(name)
    pkg = backends.PACKAGE_FOR_BACKEND.get(name, name)
    if found is None:
        return f"backend={name!r} selects {pkg}, which is not installed (pip install {pkg})"
    serves = ", ".join(found.PLATFORMS) or "no platform"
    return f"backend={name!r} ({pkg}) lowers for {serves}, not for platform '{platform}'"


def _lowering(ctx, *args, **params):
    call = PallasCall(**params)
    if call.interpret:
        return _interpret_lowering(ctx, call, *args)
    platforms = compat.lowering_platforms(ctx)
    if len(platforms) == 1:
        return _platform_rule(platforms[0], call)(ctx, call, *args)
    # Several platforms (jax.export(..., platforms=[...])): one branch per platform,
    # chosen by the platform the exported module runs on, as JAX's Pallas does.
    # Each branch's rule is looked up when that branch is lowered, so an error names
    # the platform whose backend is missing.
    rules = {p: functools.partial(_lower_for_platform, p, platforms, call) for p in platforms}
    return compat.lower_per_platform(ctx, "pallas_call", rules, *args)


def _lower_for_platform(platform: str, platforms: tuple[str, ...], call: PallasCall, ctx, *args):
    try:
        rule = _platform_rule(platform, call, platforms)
    except ValueError as e:
        e.add_note(f"(lowering for the platforms {', '.join(platforms)}: the '{platform}' branch failed)")
        raise
    return rule(ctx, call, *args)


mlir.register_lowering(pallas_call_p, _lowering)
