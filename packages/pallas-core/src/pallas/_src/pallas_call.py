"""pallas_call: trace a kernel over Refs and bind the pallas_call primitive."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from pallas._src import backends, compat, poison, primitives, semaphores, validate
from pallas._src import core as pallas_core
from pallas._src.call import PallasCall
from pallas._src.core import GridMapping, GridSpec
from pallas._src.errors import function_source, kernel_scope, runtime_error_in, user_source
from pallas._src.grid_mapping import (
    IN_SPECS_NOT_A_SEQUENCE,
    Err,
    block_mapping,
    check_aliases,
    const_block_mappings,
    flatten_specs,
    keystr,
    normalize_grid,
)
from pallas._src.interpret import InterpretParams
from pallas._src.pallas_call_rules import pallas_call_p


def _arg_aval(x, name: str, err: Err):
    if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)) or (
        isinstance(x, (int, float, complex, bool)) and not isinstance(x, str)
    ):
        return jax.core.ShapedArray(np.shape(x), jnp.result_type(x))
    raise err(TypeError, name, f"expected an array, got a {type(x).__name__} ({x!r:.60})")


def _out_aval(x, name: str, err: Err):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        traced = [(i, d) for i, d in enumerate(x.shape) if isinstance(d, jax.core.Tracer)]
        if traced:
            i, d = traced[0]
            raise err(
                TypeError,
                name,
                f"dimension {i} of its shape is a traced value ({d.aval.str_short()}), where an int or a "
                "symbolic dimension (jax.export) is expected: shapes are static. A size computed from a "
                "symbolic dimension with //, * or pl.cdiv stays one; jnp and lax functions make traced values",
            )
        try:
            return jax.core.ShapedArray(tuple(x.shape), np.dtype(x.dtype))
        except TypeError:
            pass
    raise err(TypeError, name, f"expected a jax.ShapeDtypeStruct (or an array), got {x!r:.80}")


def _is_scratch_leaf(x) -> bool:
    return hasattr(x, "get_ref_aval") or (hasattr(x, "shape") and hasattr(x, "dtype"))


def _trace_kernel(
    kernel, gm: GridMapping, in_tree, out_struct, err: Err, scratch_tree=None, prefetch_tree=None
):
    """Kernel -> closed jaxpr with invars (grid indices, dynamic grid sizes,
    scalar-prefetch refs, in refs, out refs, scratch refs)."""
    G, nsp = len(gm.grid) + gm.num_dynamic_grid_bounds, gm.num_scalar_prefetch
    idx_avals = [compat.shaped_array((), jnp.int32)] * G
    ref_avals = list(gm.prefetch_avals) + [bm.ref_aval() for bm in gm.block_mappings] + list(gm.scratch_avals)
    out_tree = tree_util.tree_structure(out_struct)
    returned = []

    def flat_kernel(*flat):
        gidx, prefetch, refs = flat[:G], flat[G : G + nsp], flat[G + nsp :]
        if prefetch_tree is not None:
            prefetch = tree_util.tree_unflatten(prefetch_tree, prefetch)
        in_refs = tree_util.tree_unflatten(in_tree, refs[: gm.num_inputs])
        out_refs = tree_util.tree_unflatten(out_tree, refs[gm.num_inputs : gm.num_inputs + gm.num_outputs])
        scratch = refs[gm.num_inputs + gm.num_outputs :]
        if scratch_tree is not None:  # scratch_shapes given as a pytree: the kernel gets it back
            scratch = tree_util.tree_unflatten(scratch_tree, scratch)
        n = len(gm.grid)
        ctx = primitives.KernelContext(gm.grid, gidx[:n], gm.kernel_name, gidx[n:])
        with primitives.kernel_context(ctx), kernel_scope(gm.kernel_name, gm.source):
            res = kernel(*prefetch, *in_refs, *out_refs, *scratch)
        returned.append(res)
        return []

    dbg = compat.make_debug_info("pallas_call", kernel, [None] * (G + len(ref_avals)))
    try:
        # Named grid axes are bound for the whole trace (jax_enable_checks re-checks the jaxpr).
        with compat.extend_axis_env([(n, s) for n, s in zip(gm.grid_names, gm.grid) if n is not None]):
            jaxpr, consts = compat.trace_to_closed_jaxpr(flat_kernel, idx_avals + ref_avals, dbg)
            jaxpr = primitives.resolve_grid_axis_names(jaxpr, gm.grid_names)
    except (ValueError, TypeError, IndexError, NotImplementedError) as e:
        _ref_as_jax_shows_it(e)
        if f"'{gm.kernel_name}'" not in str(e):
            _add_context(e, f"in kernel '{gm.kernel_name}' ({gm.source}): {_kernel_line(e)}")
        raise
    if returned and returned[0] is not None:
        raise err(
            ValueError,
            "",
            f"The kernel function in the pallas_call {function_source(kernel)} should return None "
            f"(it returned {type(returned[0]).__name__}): kernels write their results into the output Refs",
        )
    if consts:
        jaxpr = _hoist_consts(jaxpr, consts, gm)
    jaxpr = validate.normalize_negative_indices(jaxpr)
    validate.check_static_indices(jaxpr, gm.where)
    validate.check_semaphores_not_data(getattr(jaxpr, "jaxpr", jaxpr), gm.where)
    return jaxpr, consts


def _hoist_consts(jaxpr, consts, gm: GridMapping):
    """Arrays the kernel closes over become extra inputs (whole-array blocks,
    after the user's inputs): the kernel jaxpr reads them from Refs."""
    k, head = len(consts), len(gm.grid) + gm.num_dynamic_grid_bounds + gm.num_scalar_prefetch
    n_in = gm.num_inputs
    fun = compat.jaxpr_as_fun(jaxpr)
    avals = list(jaxpr.in_avals[k:])
    const_refs = [compat.ref_aval(np.shape(c), jnp.result_type(c)) for c in consts]
    avals = avals[: head + n_in] + const_refs + avals[head + n_in :]

    def hoisted(*flat):
        refs = flat[head + n_in : head + n_in + k]
        rest = flat[: head + n_in] + flat[head + n_in + k :]
        return fun(*[r[...] for r in refs], *rest)

    dbg = compat.make_debug_info("pallas_call", hoisted, avals)
    closed, more = compat.trace_to_closed_jaxpr(hoisted, avals, dbg)
    assert not more
    return closed


def _ref_as_jax_shows_it(e: BaseException) -> None:
    """JAX's "Attempting to pass a Ref Ref{f32[8,32]} to a primitive" (a Ref given where an
    array is wanted) shows a kernel Ref of JAX's Pallas as ``Ref<default>{...}``: its
    Refs carry the memory space ``default`` where ours carry none. The message says it as
    JAX's does, so code matching JAX's message matches ours."""
    if len(e.args) == 1 and isinstance(e.args[0], str) and "Attempting to pass a Ref Ref{" in e.args[0]:
        e.args = (
            e.args[0].replace("Attempting to pass a Ref Ref{", "Attempting to pass a Ref Ref<default>{"),
        )


def _add_context(e: BaseException, prefix: str) -> None:
    """Prefixes the message of ``e`` in place. Rebuilding it as ``type(e)(msg)``
    would break exceptions whose constructor takes other arguments (JAX's tracer
    errors take the tracer) and lose their attributes."""
    if len(e.args) == 1 and isinstance(e.args[0], str):
        e.args = (prefix + e.args[0],)
    else:
        e.add_note(prefix.rstrip(": "))


def _kernel_line(e: BaseException) -> str:
    from pallas._src.errors import is_internal

    tb, line = e.__traceback__, None
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not is_internal(fn):
            import os

            line = f"{os.path.basename(fn)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"at {line}: " if line else ""


def _normalize_compiler_params(cp: Any, err) -> Any:
    """None, one backend's CompilerParams, or a tuple of them (autotuning)."""
    if cp is None or isinstance(cp, pallas_core.CompilerParams):
        return cp
    if isinstance(cp, (list, tuple)) and cp and all(isinstance(c, pallas_core.CompilerParams) for c in cp):
        if len({type(c) for c in cp}) > 1:
            raise err(
                TypeError,
                "compiler_params",
                "a list of CompilerParams (autotuning) must all be for one backend, got "
                + ", ".join(sorted({type(c).__module__ + "." + type(c).__name__ for c in cp})),
            )
        return cp[0] if len(cp) == 1 else tuple(cp)
    if isinstance(cp, dict):
        raise err(
            TypeError,
            "compiler_params",
            "dicts such as {'triton': {...}} are the old JAX form; pass the backend's dataclass "
            "instead, e.g. pallas_gpu.CompilerParams(num_warps=4)",
        )
    raise err(
        TypeError,
        "compiler_params",
        "expected a backend's CompilerParams (e.g. pallas_gpu.CompilerParams) or a non-empty list "
        f"of them, got {cp!r}",
    )


def pallas_call(
    kernel: Callable[..., None],
    out_shape: Any,
    *,
    grid_spec: GridSpec | None = None,
    grid: Any = None,
    in_specs: Any = pallas_core.no_block_spec,
    out_specs: Any = pallas_core.no_block_spec,
    scratch_shapes: Sequence[Any] = (),
    input_output_aliases: dict[int, int] | None = None,
    debug: bool = False,
    interpret: Any = False,
    name: str | None = None,
    compiler_params: Any = None,
    cost_estimate: pallas_core.CostEstimate | None = None,
    backend: str | None = None,
    metadata: dict[str, str] | None = None,
) -> Callable[..., Any]:
    """Runs ``kernel`` once per point of ``grid`` on blocks of its operands.

    Args:
      kernel: ``kernel(*in_refs, *out_refs, *scratch_refs) -> None``.
      out_shape: a ``jax.ShapeDtypeStruct`` or a pytree (tuple, list, dict)
        of them; the results come in its structure, a list as a tuple (as in JAX).
      grid_spec: a ``GridSpec``; exclusive with grid/in_specs/out_specs/
        scratch_shapes.
      grid: the number of programs along each axis (int or tuple of ints).
      in_specs: the inputs' blocks: one ``BlockSpec`` per array, in the pytree
        of the positional arguments (a list or tuple, one entry per input; a
        ``None`` stands for a whole subtree; a single spec, or a tree that does
        not match, is refused, as in JAX). Each spec's index map takes the program's grid
        indices and returns the block of that input the program reads
        (default: the whole array).
      out_specs: the outputs' blocks: one ``BlockSpec`` per array, in the pytree
        of ``out_shape`` (a single spec for a single output). Each spec's
        index map returns the block of that output the program writes; on
        backends that run the grid in order (TPU, interpret mode) an output
        block whose index stays the same on consecutive steps stays in memory,
        so a kernel can accumulate into it (default: the whole array).
      scratch_shapes: scratch buffers passed after the output Refs.
      input_output_aliases: ``{input index: output index}`` over the
        flattened inputs and outputs.
      debug: print the kernel jaxpr and the grid mapping.
      interpret: ``True`` (or ``pl.InterpretParams``) runs the kernel as
        plain JAX on any platform; a backend's interpret params (e.g.
        ``plgpu.InterpretParams()``) choose that backend's interpreter.
      name: the kernel's name in messages and profiles.
      compiler_params: a backend's ``CompilerParams`` (selects the backend), or a
        list of them for a backend that autotunes over them (pallas-gpu).
      cost_estimate: a ``pl.CostEstimate`` for XLA's scheduler.
      backend: the backend to lower with on hardware: ``"gpu"`` (pallas-gpu; JAX's
        name ``"triton"`` is accepted) or ``"tpu"`` (pallas-tpu; ``"mosaic_tpu"``,
        ``"mosaic"``), or another installed backend's name. Interpret mode ignores it.
      metadata: a dict of str to str (or int, float, bool, None, as JAX's Pallas
        takes) about the kernel, serialized as JSON into the TPU custom call (its
        ``kernel_metadata`` frontend attribute), for debugging and analysis tools;
        other backends ignore it.
    Returns:
      A function of the inputs returning arrays shaped like ``out_shape``.
    """
    spec = _CallSpec(
        kernel=kernel, out_shape=out_shape, kernel_name=name or _function_name(kernel),
        grid_spec=grid_spec, grid=grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch_shapes, input_output_aliases=input_output_aliases, debug=debug,
        interpret=interpret, compiler_params=compiler_params, cost_estimate=cost_estimate,
        backend=backend, metadata=metadata,
    )  # fmt: skip
    if isinstance(in_specs, pallas_core.BlockSpec):  # refused here, as JAX's Pallas does
        raise Err(spec.kernel_name, user_source())(ValueError, "in_specs", IN_SPECS_NOT_A_SEQUENCE)
    if not isinstance(debug, (bool, np.bool_)):  # debug="False" is truthy
        raise Err(spec.kernel_name, user_source())(
            TypeError, "debug", f"expected True or False, got {debug!r} ({type(debug).__name__})"
        )
    cache: dict[Any, _Prepared] = {}

    @functools.wraps(kernel)
    def wrapped(*args):
        prepared, flat_args = _prepared(spec, cache, args)
        return _bind(spec, prepared, flat_args)

    return wrapped


@dataclasses.dataclass(frozen=True)
class _CallSpec:
    """The arguments of one ``pallas_call(...)``, as the user gave them."""

    kernel: Callable[..., None]
    out_shape: Any
    kernel_name: str
    grid_spec: GridSpec | None
    grid: Any
    in_specs: Any
    out_specs: Any
    scratch_shapes: Any
    input_output_aliases: dict[int, int] | None
    debug: bool
    interpret: Any
    compiler_params: Any
    cost_estimate: Any
    backend: Any
    metadata: Any

    @property
    def outs_tuple(self) -> tuple:
        return tuple(self.out_shape) if self._out_is_seq else (self.out_shape,)

    @property
    def _out_is_seq(self) -> bool:
        return isinstance(self.out_shape, (tuple, list))

    def out_path(self, p) -> str:
        # out_shape=(a, b) -> "[1]"; a dict -> "['y']"; a single struct -> "[0]".
        return keystr(p) if self._out_is_seq or not p[1:] else keystr(p[1:])

    def unflatten_outs(self, outs):
        result = tree_util.tree_unflatten(tree_util.tree_structure(self.outs_tuple), outs)
        if self._out_is_seq:
            return tuple(result)  # a list out_shape too, as JAX's pallas_call
        return result[0]


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What one input signature traces to: the call record (its ``interpret``
    is set per call) and the constants the kernel closes over."""

    call: PallasCall
    consts: tuple


def _prepared(spec: _CallSpec, cache: dict, args) -> tuple[_Prepared, list]:
    """The call prepared for ``args``' signature (validated and traced once per signature)."""
    leaves = tree_util.tree_flatten_with_path(args)[0]
    flat_args = [x for _, x in leaves]
    key = (
        tree_util.tree_structure(args),
        tuple((np.shape(x), _dtype_key(x)) for x in flat_args),
        poison.poison_buffers_enabled(),  # the switches that change what a kernel traces to
        semaphores.debug_checks_enabled(),
    )
    if key not in cache:
        source = user_source()
        err = Err(spec.kernel_name, source)
        in_avals = [_arg_aval(x, f"args{keystr(p)}", err) for p, x in leaves]
        cache[key] = _prepare(spec, err, args, [p for p, _ in leaves], in_avals)
    prepared = cache[key]
    if any(isinstance(c, jax.core.Tracer) for c in prepared.consts):
        del cache[key]  # constants of an enclosing trace: retrace the next time
    return prepared, flat_args


def _prepare(spec: _CallSpec, err: Err, args, in_paths, in_avals) -> _Prepared:
    """Validates everything and traces the kernel: the call record."""
    grid, in_specs, out_specs, scratch_shapes = _grid_spec_parts(spec, err)
    grid_t, grid_names, _ = normalize_grid(grid, err)
    prefetch, args, in_paths, in_avals = _split_prefetch(spec.grid_spec, args, in_paths, in_avals, err)
    options = _check_options(spec, err)
    scratch_avals, scratch_tree = _scratch_avals(scratch_shapes, err)
    out_leaves = tree_util.tree_flatten_with_path(spec.outs_tuple)[0]
    out_names = [f"out_shape{spec.out_path(p)}" for p, _ in out_leaves]
    out_avals = [_out_aval(x, n, err) for (_, x), n in zip(out_leaves, out_names)]
    spec_names = [f"in_specs{keystr(p)}" for p in in_paths] + [
        f"out_specs{spec.out_path(p)}" for p, _ in out_leaves
    ]
    flat_specs = flatten_specs(in_specs, args, "in_specs", err) + flatten_specs(
        out_specs, spec.outs_tuple, "out_specs", err
    )
    bms = [
        block_mapping(s, a, n, grid_t, err, prefetch.avals, prefetch.tree)
        for s, a, n in zip(flat_specs, in_avals + out_avals, spec_names)
    ]
    in_names = [f"args{keystr(p)}" for p in in_paths]
    aliases = _aliases(spec, bms, in_avals, out_avals, in_names, out_names, prefetch.count, err)
    gm = GridMapping(
        grid_t,
        tuple(bms),
        len(in_avals),
        len(out_avals),
        scratch_avals,
        spec.kernel_name,
        err.source,
        grid_names=grid_names,
        num_scalar_prefetch=prefetch.count,
        prefetch_avals=prefetch.avals,
    )
    in_tree = tree_util.tree_structure(args)
    jaxpr, gm, consts = _trace(spec, gm, in_tree, err, scratch_tree, prefetch)
    if spec.debug:
        print(f"The kernel jaxpr for pallas_call '{spec.kernel_name}' ({err.source}):")
        print(jaxpr)
        print(gm)
    call = PallasCall.of(jaxpr, gm, input_output_aliases=aliases, debug=spec.debug, **options)
    return _Prepared(call, tuple(consts))


def _bind(spec: _CallSpec, prepared: _Prepared, flat_args) -> Any:
    """Binds ``pallas_call_p`` on the operands: dynamic grid sizes, the arguments, the hoisted constants."""
    call = prepared.call.replace(interpret=_effective_interpret(spec.interpret))
    gm = call.grid_mapping
    dynamic_sizes = []
    if gm.num_dynamic_grid_bounds:  # the traced grid sizes go first
        grid = spec.grid_spec.grid if spec.grid_spec is not None else spec.grid
        dynamic_sizes = normalize_grid(grid, Err(spec.kernel_name, gm.source))[2]
    consts = [jnp.asarray(c) for c in prepared.consts]
    try:
        outs = pallas_call_p.bind(*dynamic_sizes, *flat_args, *consts, **call.params())
        if call.interpret and not any(isinstance(o, jax.core.Tracer) for o in outs):
            # Called outside jit in interpret mode: on an accelerator the kernel runs
            # asynchronously and a callback's error would surface at some later
            # block_until_ready, wrapped; wait here so that it arrives from this call.
            jax.block_until_ready(outs)
    except Exception as e:
        # An error the kernel raised as it ran (in a host callback) arrives wrapped by
        # XLA, its message last: raise it as it was raised, message first.
        inner = runtime_error_in(e)
        if inner is None:
            raise
        raise inner from None
    return spec.unflatten_outs(outs)


def _grid_spec_parts(spec: _CallSpec, err: Err) -> tuple[Any, Any, Any, Any]:
    """(grid, in_specs, out_specs, scratch_shapes), from ``grid_spec`` or the separate arguments."""
    parts = (spec.grid, spec.in_specs, spec.out_specs, spec.scratch_shapes)
    if spec.grid_spec is None:
        return parts
    if (
        spec.grid is not None
        or spec.in_specs is not pallas_core.no_block_spec
        or spec.out_specs is not pallas_core.no_block_spec
        or spec.scratch_shapes
    ):
        raise err(
            ValueError,
            "grid_spec",
            "pass either grid_spec or grid/in_specs/out_specs/scratch_shapes, not both",
        )
    gs = spec.grid_spec
    if not isinstance(gs, GridSpec):
        raise err(TypeError, "grid_spec", f"expected a pl.GridSpec, got {gs!r}")
    return gs.grid, gs.in_specs, gs.out_specs, gs.scratch_shapes


@dataclasses.dataclass(frozen=True)
class _Prefetch:
    """The scalar-prefetch operands: the first ``num_scalar_prefetch`` arguments."""

    count: int  # flat operands
    tree: Any  # their pytree structure (index maps and the kernel get it back)
    avals: tuple  # their Ref avals


def _split_prefetch(grid_spec, args, in_paths, in_avals, err: Err):
    """(the prefetch operands, then the other arguments, their paths and avals)."""
    nsp = getattr(grid_spec, "num_scalar_prefetch", 0) if grid_spec is not None else 0
    if not isinstance(nsp, int) or not 0 <= nsp <= len(args):
        raise err(
            ValueError,
            "grid_spec.num_scalar_prefetch",
            f"expected an int in 0..{len(args)} (the number of arguments), got {nsp!r}",
        )
    # As JAX: the first nsp *arguments* (pytrees, None allowed) are prefetched;
    # index maps and the kernel get them back with their structure.
    tree: Any = tree_util.tree_structure(tuple(args[:nsp]))
    n = tree.num_leaves
    avals = tuple(
        _prefetch_aval(grid_spec, a, f"args{keystr(p)} (scalar prefetch)", err)
        for p, a in zip(in_paths[:n], in_avals[:n])
    )
    return _Prefetch(n, tree, avals), args[len(tree.children()) :], in_paths[n:], in_avals[n:]


def _check_options(spec: _CallSpec, err: Err) -> dict[str, Any]:
    """compiler_params, backend, metadata and cost_estimate, checked and normalized."""
    compiler_params = _normalize_compiler_params(spec.compiler_params, err)
    if spec.backend is not None and not isinstance(spec.backend, str):
        raise err(TypeError, "backend", f"expected a backend name (a str) or None, got {spec.backend!r}")
    try:
        backend = backends.resolve_name(spec.backend)
    except ValueError as e:
        raise err(ValueError, "backend", str(e)) from None
    metadata = _normalize_metadata(spec.metadata, err)
    if spec.cost_estimate is not None and not isinstance(spec.cost_estimate, pallas_core.CostEstimate):
        raise err(TypeError, "cost_estimate", f"expected a pl.CostEstimate, got {spec.cost_estimate!r}")
    return dict(
        compiler_params=compiler_params, backend=backend, metadata=metadata, cost_estimate=spec.cost_estimate
    )


def _scratch_avals(scratch_shapes, err: Err) -> tuple[tuple, Any]:
    if not isinstance(scratch_shapes, (tuple, list)):
        raise err(TypeError, "scratch_shapes", f"expected a tuple, got {scratch_shapes!r}")
    leaves, tree = tree_util.tree_flatten_with_path(tuple(scratch_shapes), is_leaf=_is_scratch_leaf)
    return tuple(_scratch_aval(s, f"scratch_shapes{keystr(p)}", err) for p, s in leaves), tree


def _aliases(spec: _CallSpec, bms, in_avals, out_avals, in_names, out_names, nsp: int, err: Err):
    """The checked ``input_output_aliases`` as sorted (input, output) pairs, inputs
    counted as the user counts them (scalar-prefetch operands included)."""
    aliases = check_aliases(
        spec.input_output_aliases or {}, in_avals, out_avals, in_names, out_names, err, nsp
    )
    for i, o in aliases:
        if any(
            isinstance(d, pallas_core.Element) and d.padding != (0, 0)
            for d in bms[i].block_shape + bms[len(in_avals) + o].block_shape
        ):
            raise err(
                NotImplementedError,
                "input_output_aliases",
                f"input {i + nsp} is aliased to output {o} but is blocked with a padded pl.Element; "
                "aliasing needs both sides unpadded",
            )
    return tuple((i + nsp, o) for i, o in aliases)


def _trace(spec: _CallSpec, gm: GridMapping, in_tree, err: Err, scratch_tree, prefetch: _Prefetch):
    """The kernel jaxpr, and the grid mapping with a whole-array block for each
    constant the kernel closes over (hoisted into inputs)."""
    # A backend's interpret params may set up what tracing reads (pallas-tpu:
    # the TPU generation that emit_pipeline tiles for).
    tracing = getattr(_effective_interpret(spec.interpret), "tracing_context", None)
    with tracing() if tracing is not None else contextlib.nullcontext():
        jaxpr, consts = _trace_kernel(
            spec.kernel, gm, in_tree, spec.outs_tuple, err, scratch_tree, prefetch.tree
        )
    if consts:
        bms, n_in = gm.block_mappings, gm.num_inputs
        const_bms = const_block_mappings(consts, gm.grid, err, prefetch.avals, prefetch.tree)
        gm = gm.replace(block_mappings=(*bms[:n_in], *const_bms, *bms[n_in:]), num_inputs=n_in + len(consts))
    return jaxpr, gm, consts


# What JAX's Pallas writes into the TPU custom call's kernel_metadata (json.dumps of the
# dict): tokamax's gmm_v2 passes ints ({"dims.size_group": 8}).
_METADATA_VALUES = (str, int, float, bool, type(None))


def _normalize_metadata(metadata: Any, err: Err) -> tuple[tuple[str, Any], ...] | None:
    """None, or the (key, value) pairs of a dict of str to JSON scalars, sorted (a
    primitive parameter must be hashable; the JSON sorts its keys anyway)."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise err(TypeError, "metadata", f"expected a dict of str to str, got {metadata!r:.80}")
    for k, v in metadata.items():
        if not isinstance(k, str):
            raise err(TypeError, "metadata", f"keys must be str, got the {type(k).__name__} key {k!r:.40}")
        if not isinstance(v, _METADATA_VALUES):
            raise err(
                TypeError,
                "metadata",
                f"values must be str, int, float, bool or None (written as JSON), got the "
                f"{type(v).__name__} {v!r:.40} for key {k!r}; write it as a string (e.g. str({v!r:.40}))",
            )
    return tuple(sorted(metadata.items()))


def _prefetch_aval(grid_spec, aval, what: str, err: Err):
    if not jnp.issubdtype(aval.dtype, jnp.integer) and not jnp.issubdtype(aval.dtype, jnp.floating):
        raise err(TypeError, what, f"scalar prefetch operands must be numeric arrays, got {aval.dtype}")
    make = getattr(grid_spec, "scalar_prefetch_ref_aval", None)
    return make(aval) if make is not None else compat.ref_aval(aval.shape, aval.dtype)


# The default for ``interpret`` (``pltpu.force_tpu_interpret_mode``): a JAX config state, so
# that it is part of the jit cache key (a function jitted outside the ``with`` block is traced
# again inside it, as JAX's ``pallas_tpu_interpret_mode_context_manager``) and thread-local.
forced_interpret_state = compat.config_state(
    "pallas_forced_interpret_mode",
    "The interpret parameters every pallas_call runs with, whatever interpret= it passes (None: none).",
)


def _function_name(fn) -> str:
    """``fn``'s name, through ``functools.partial`` wrappers (as JAX names kernels)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or "kernel"


def _effective_interpret(interpret):
    """The forced parameters where some are forced, whatever the call passes (as JAX's
    ``force_tpu_interpret_mode``: ``forced or interpret``); else the call's own."""
    forced = forced_interpret_state.value
    if forced is not None:
        return forced
    return True if interpret is True else (interpret or False)


def _dtype_key(x):
    try:
        return jnp.result_type(x)
    except TypeError:
        return type(x)


def _scratch_aval(s, what: str, err: Err):
    try:
        return primitives.scratch_aval(s, what)
    except (TypeError, ValueError) as e:
        raise err(type(e), what, str(e).split(f"{what}: ", 1)[-1]) from None


__all__ = ["pallas_call", "InterpretParams"]
