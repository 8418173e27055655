"""pallas_call: trace a kernel over Refs and bind the pallas_call primitive."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from pallas._src import backends, compat, primitives, validate
from pallas._src import core as pallas_core
from pallas._src.core import GridMapping, GridSpec
from pallas._src.errors import describe, function_source, kernel_scope, runtime_error_in, user_source
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
    validate.check_static_indices(jaxpr, describe(gm.kernel_name, gm.source))
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


def _add_context(e: BaseException, prefix: str) -> None:
    """Prefixes the message of ``e`` in place. Rebuilding it as ``type(e)(msg)``
    would break exceptions whose constructor takes other arguments (JAX's tracer
    errors take the tracer) and lose their attributes."""
    if len(e.args) == 1 and isinstance(e.args[0], str):
        e.args = (prefix + e.args[0],)
    else:
        e.add_note(prefix.rstrip(": "))


def _kernel_line(e: BaseException) -> str:
    from pallas._src.errors import _is_internal

    tb, line = e.__traceback__, None
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not _is_internal(fn):
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
        of them.
      grid_spec: a ``GridSpec``; exclusive with grid/in_specs/out_specs/
        scratch_shapes.
      grid: the number of programs along each axis (int or tuple of ints).
      in_specs, out_specs: pytree prefixes of ``BlockSpec`` objects for the inputs
        and outputs (default: the whole array).
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
    kernel_name = name or _function_name(kernel)
    if isinstance(in_specs, pallas_core.BlockSpec):  # refused here, as JAX's Pallas does
        raise Err(kernel_name, user_source())(ValueError, "in_specs", IN_SPECS_NOT_A_SEQUENCE)
    is_seq = isinstance(out_shape, (tuple, list))
    outs_tuple = tuple(out_shape) if is_seq else (out_shape,)
    cache: dict[Any, Any] = {}

    def out_path(p) -> str:
        # out_shape=(a, b) -> "[1]"; a dict -> "['y']"; a single struct -> "[0]".
        if is_seq or not p[1:]:
            return keystr(p)
        return keystr(p[1:])

    def prepare(source: str, args, in_tree, in_paths, in_avals):
        """Validates everything and traces the kernel (once per input signature)."""
        err = Err(kernel_name, source)
        g, ins, outs, scratch_shapes_ = grid, in_specs, out_specs, scratch_shapes
        if grid_spec is not None:
            if (
                grid is not None
                or ins is not pallas_core.no_block_spec
                or outs is not pallas_core.no_block_spec
                or scratch_shapes_
            ):
                raise err(
                    ValueError,
                    "grid_spec",
                    "pass either grid_spec or grid/in_specs/out_specs/scratch_shapes, not both",
                )
            if not isinstance(grid_spec, GridSpec):
                raise err(TypeError, "grid_spec", f"expected a pl.GridSpec, got {grid_spec!r}")
            g, ins, outs, scratch_shapes_ = (
                grid_spec.grid,
                grid_spec.in_specs,
                grid_spec.out_specs,
                grid_spec.scratch_shapes,
            )
        grid_t, grid_names, _ = normalize_grid(g, err)
        nsp = getattr(grid_spec, "num_scalar_prefetch", 0) if grid_spec is not None else 0
        if not isinstance(nsp, int) or not 0 <= nsp <= len(args):
            raise err(
                ValueError,
                "grid_spec.num_scalar_prefetch",
                f"expected an int in 0..{len(args)} (the number of arguments), got {nsp!r}",
            )
        # As JAX: the first nsp *arguments* (pytrees, None allowed) are prefetched;
        # index maps and the kernel get them back with their structure.
        prefetch_tree = tree_util.tree_structure(tuple(args[:nsp]))
        nsp = prefetch_tree.num_leaves
        prefetch_avals = tuple(
            _prefetch_aval(grid_spec, a, f"args{keystr(p)} (scalar prefetch)", err)
            for p, a in zip(in_paths[:nsp], in_avals[:nsp])
        )
        args, in_paths, in_avals = args[len(prefetch_tree.children()) :], in_paths[nsp:], in_avals[nsp:]
        in_tree = tree_util.tree_structure(args)
        compiler_params_ = _normalize_compiler_params(compiler_params, err)
        if backend is not None and not isinstance(backend, str):
            raise err(TypeError, "backend", f"expected a backend name (a str) or None, got {backend!r}")
        try:
            backend_ = backends.resolve_name(backend)
        except ValueError as e:
            raise err(ValueError, "backend", str(e)) from None
        metadata_ = _normalize_metadata(metadata, err)
        if cost_estimate is not None and not isinstance(cost_estimate, pallas_core.CostEstimate):
            raise err(TypeError, "cost_estimate", f"expected a pl.CostEstimate, got {cost_estimate!r}")
        if not isinstance(scratch_shapes_, (tuple, list)):
            raise err(TypeError, "scratch_shapes", f"expected a tuple, got {scratch_shapes_!r}")
        scratch_leaves, scratch_tree = tree_util.tree_flatten_with_path(
            tuple(scratch_shapes_), is_leaf=_is_scratch_leaf
        )
        scratch_avals = tuple(_scratch_aval(s, f"scratch_shapes{keystr(p)}", err) for p, s in scratch_leaves)
        out_leaves = tree_util.tree_flatten_with_path(outs_tuple)[0]
        out_names = [f"out_shape{out_path(p)}" for p, _ in out_leaves]
        out_avals = [_out_aval(x, n, err) for (_, x), n in zip(out_leaves, out_names)]
        in_names = [f"args{keystr(p)}" for p in in_paths]
        flat_in_specs = flatten_specs(ins, args, "in_specs", err)
        flat_out_specs = flatten_specs(outs, outs_tuple, "out_specs", err)
        spec_names = [f"in_specs{keystr(p)}" for p in in_paths]
        spec_names += [f"out_specs{out_path(p)}" for p, _ in out_leaves]
        bms = [
            block_mapping(s, a, n, grid_t, err, prefetch_avals, prefetch_tree)
            for s, a, n in zip(flat_in_specs + flat_out_specs, in_avals + out_avals, spec_names)
        ]
        aliases = check_aliases(
            input_output_aliases or {}, in_avals, out_avals, in_names, out_names, err, nsp
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
        gm = GridMapping(
            grid_t,
            tuple(bms),
            len(in_avals),
            len(out_avals),
            scratch_avals,
            kernel_name,
            source,
            grid_names=grid_names,
            num_scalar_prefetch=nsp,
            prefetch_avals=prefetch_avals,
        )
        # A backend's interpret params may set up what tracing reads (pallas-tpu:
        # the TPU generation that emit_pipeline tiles for).
        tracing = getattr(_effective_interpret(interpret), "tracing_context", None)
        with tracing() if tracing is not None else contextlib.nullcontext():
            jaxpr, consts = _trace_kernel(kernel, gm, in_tree, outs_tuple, err, scratch_tree, prefetch_tree)
        if consts:
            n_in = len(in_avals)
            bms = (
                *bms[:n_in],
                *const_block_mappings(consts, grid_t, err, prefetch_avals, prefetch_tree),
                *bms[n_in:],
            )
            gm = gm.replace(block_mappings=bms, num_inputs=n_in + len(consts))
        if debug:
            print(f"The kernel jaxpr for pallas_call '{kernel_name}' ({source}):")
            print(jaxpr)
            print(gm)
        return jaxpr, gm, aliases, compiler_params_, consts, backend_, metadata_

    @functools.wraps(kernel)
    def wrapped(*args):
        leaves = tree_util.tree_flatten_with_path(args)[0]
        flat_args = [x for _, x in leaves]
        in_tree = tree_util.tree_structure(args)
        key = (in_tree, tuple((np.shape(x), _dtype_key(x)) for x in flat_args))
        if key not in cache:
            source = user_source()
            err = Err(kernel_name, source)
            in_avals = [_arg_aval(x, f"args{keystr(p)}", err) for p, x in leaves]
            cache[key] = prepare(source, args, in_tree, [p for p, _ in leaves], in_avals)
        jaxpr, gm, aliases, compiler_params_, consts, backend_, metadata_ = cache[key]
        if any(isinstance(c, jax.core.Tracer) for c in consts):
            del cache[key]  # constants of an enclosing trace: retrace the next time
        consts = [jnp.asarray(c) for c in consts]
        dynamic_sizes = []
        if gm.num_dynamic_grid_bounds:  # the traced grid sizes go first
            g = grid_spec.grid if grid_spec is not None else grid
            dynamic_sizes = normalize_grid(g, Err(kernel_name, gm.source))[2]
        try:
            outs = pallas_call_p.bind(
                *dynamic_sizes,
                *flat_args,
                *consts,
                jaxpr=jaxpr,
                grid_mapping=gm,
                input_output_aliases=aliases,
                interpret=_effective_interpret(interpret),
                debug=debug,
                compiler_params=compiler_params_,
                cost_estimate=cost_estimate,
                backend=backend_,
                metadata=metadata_,
            )
        except Exception as e:
            # An error the kernel raised as it ran (in a host callback) arrives wrapped by
            # XLA, its message last: raise it as it was raised, message first.
            inner = runtime_error_in(e)
            if inner is None:
                raise
            raise inner from None
        result = tree_util.tree_unflatten(tree_util.tree_structure(outs_tuple), outs)
        if is_seq:
            return tuple(result) if isinstance(out_shape, tuple) else list(result)
        return result[0]

    return wrapped


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


# A process-wide default for ``interpret`` (``pltpu.force_tpu_interpret_mode``).
_forced_interpret: list[Any] = []


def _function_name(fn) -> str:
    """``fn``'s name, through ``functools.partial`` wrappers (as JAX names kernels)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or "kernel"


def _effective_interpret(interpret):
    if not interpret and _forced_interpret:
        return _forced_interpret[-1]
    return True if interpret is True else (interpret or False)


def _dtype_key(x):
    try:
        return jnp.result_type(x)
    except TypeError:
        return type(x)


def _scratch_aval(s, what: str, err: Err):
    try:
        return primitives._scratch_aval(s, what)
    except TypeError as e:
        raise err(TypeError, what, str(e).split(f"{what}: ", 1)[-1]) from None


__all__ = ["pallas_call", "InterpretParams"]
