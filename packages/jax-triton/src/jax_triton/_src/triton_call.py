"""``triton_call``: the ``triton_call`` primitive and its rules.

Lowering is per platform: CUDA compiles with the pinned Triton and launches
through jax-kernel-runtime's FFI target; CPU runs Triton's interpreter in a
host callback; anything else is a clear error.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

import jax_kernel_runtime as jkr
from jax_kernel_runtime import triton as jkr_triton
from jax_triton._src import arguments, autotune, frontend, operands
from jax_triton._src.compile import CompileOptions, TritonCompilationError, compile_kernel
from jax_triton._src.interpret import run_on_host
from jax_triton._src.signature import BoundCall, bind
from jax_triton._src.triton_compat import check_triton_version, triton
from jax_triton._src.utils import user_source


@dataclasses.dataclass(frozen=True)
class CallVariant:
    bound: BoundCall
    grid: tuple[int, int, int]
    options: CompileOptions
    zeroed_outputs: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: kernels are objects
class CallSpec:
    kernel: Any
    fn: Any  # the base JITFunction
    name: str
    variants: tuple[CallVariant, ...]
    in_avals: tuple
    out_avals: tuple
    input_output_aliases: tuple[tuple[int, int], ...]
    scalars: tuple
    compute_capability: int | None
    debug: bool
    batch_fold: Callable | None
    call_args: tuple  # (operands, metaparams, grid, zeroed, options) for re-binding under vmap
    where: str  # "triton_call 'name' at file.py:LINE", first words of every error


def triton_call(
    *args,
    kernel,
    out_type=None,
    grid,
    name: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_ctas: int | None = None,
    compute_capability: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
    input_output_aliases: dict[int, int] | None = None,
    zeroed_outputs=(),
    debug: bool = False,
    serialized_metadata: bytes = b"",
    cost_estimate: Mapping[str, Any] | None = None,
    has_side_effect: bool = False,
    enable_fp_fusion: bool | None = None,
    batch_fold: Callable | None = None,
    **kwargs,
):
    """Calls a ``@triton.jit`` kernel on JAX arrays.

    Args:
      *args: kernel arguments, bound to the kernel's parameters in order: arrays (passed as pointers),
        ``jax.new_ref`` Refs (pointers to buffers the kernel updates in place; not in ``out_type``),
        Python/numpy scalars (baked into the call) and None (a constexpr None, as in Triton's JIT).
      kernel: a ``@triton.jit`` function, optionally wrapped in ``triton.autotune``/``triton.heuristics``.
      out_type: a pytree of objects with ``.shape`` and ``.dtype`` (e.g. ``jax.ShapeDtypeStruct``); the
        result has the same structure. The outputs not aliased to an input are bound to the kernel's
        non-constexpr parameters that got no argument, in parameter order. ``out_shape=`` (jax-triton 0.4)
        is accepted instead; with it, aliased outputs are bound to parameters too and
        ``input_output_aliases`` counts the array inputs.
      grid: an int, a tuple of 1-3 ints, or a callable of the metaparams dict returning one.
      name: shown in errors (default: the kernel's name).
      num_warps, num_stages, num_ctas: Triton compile options (default 4, 3, 1).
      compute_capability: target for compilation when lowering without a visible GPU (e.g. ``jax.export``);
        default: the device's, else 90.
      backend_options: further options of Triton's CUDA compiler (``{"maxnreg": 128}``), merged with
        ``num_warps``, ``num_stages``, ``num_ctas``, ``enable_fp_fusion`` and ``debug``; giving an option
        both ways is an error. Values must be hashable.
      input_output_aliases: ``{input index: output index}``: the output reuses the input's buffer. With
        ``out_type=`` the indices count the non-constexpr operands in parameter order (scalars included,
        None not); with ``out_shape=`` the array inputs.
      zeroed_outputs: output indices (or a callable of the metaparams returning them) zeroed before the
        kernel runs.
      debug: print the Triton signature and IR when compiling, and turn ``tl.device_assert`` on.
      serialized_metadata, cost_estimate: accepted for upstream compatibility; they have no effect here.
      has_side_effect: only False is supported.
      enable_fp_fusion: Triton's fp fusion (default True).
      batch_fold: optional ``(batch_size, grid, scalars) -> (grid, scalars)`` declaring how ``jax.vmap`` can
        fold a batch into the grid: the batched arrays are laid out contiguously with the batch leading and
        the kernel is re-launched once with the returned grid and scalar arguments (``scalars`` maps the
        positional index, or the keyword of a keyword argument, to the value). Without it, vmap runs the
        kernel once per batch element.
      **kwargs: a keyword naming a non-constexpr kernel parameter is an argument for it, as in ``*args``;
        the others are metaparams: values of ``tl.constexpr`` parameters, by name (missing ones take the
        kernel's defaults), also passed to callable ``grid``/``zeroed_outputs``.

    Returns:
      The outputs, in the structure of ``out_type``.
    """
    check_triton_version()
    fn = autotune.base_function(kernel)
    name = name or fn.__name__
    where = f"triton_call {name!r} at {user_source()}"
    out_type, legacy = _out_type(out_type, kwargs, where)
    _check_flags(where, debug=debug, enable_fp_fusion=enable_fp_fusion, has_side_effect=has_side_effect)
    del serialized_metadata, cost_estimate  # no place for them in our custom call
    out_leaves, out_tree = jax.tree.flatten(out_type)
    out_avals = arguments.output_avals(out_leaves, where, "out_shape" if legacy else "out_type")
    ops = operands.resolve(fn, args, kwargs, out_avals, input_output_aliases, legacy, where)
    explicit = dict(num_warps=num_warps, num_stages=num_stages, num_ctas=num_ctas,
                    enable_fp_fusion=enable_fp_fusion, debug=True if debug else None)  # fmt: skip
    spec = _make_spec(kernel, fn, name, ops.params, ops.in_avals, ops.out_avals, ops.metaparams, grid,
                      zeroed_outputs, ops.aliases, ops.scalars, compute_capability, debug, batch_fold,
                      _compile_options(fn, explicit, backend_options, where), where)  # fmt: skip
    return jax.tree.unflatten(out_tree, _launch(spec, ops)[: len(out_avals)])


def _launch(spec: CallSpec, ops) -> list:
    """The call's outputs (``ops``: ``operands.resolve``'s); the Refs among its arguments are
    updated in place."""
    if any(0 in v.grid for v in spec.variants):
        outs = _no_programs(spec, ops.arrays)
    else:
        outs = triton_call_p.bind(*ops.arrays, call=spec)
    for ref, i in ops.refs:
        ref[...] = outs[ops.aliases[i]]
    return outs


def _out_type(out_type, kwargs: dict, where: str) -> tuple[Any, bool]:
    """(``out_type``, or ``out_shape=``: jax-triton 0.4's name, popped from ``kwargs``; whether
    it was ``out_shape=``)."""
    if "out_shape" in kwargs:
        if out_type is not None:
            raise TypeError(f"{where}: give out_type= or out_shape= (its jax-triton 0.4 name), not both")
        return kwargs.pop("out_shape"), True
    if out_type is None:
        raise TypeError(
            f"{where}: triton_call needs out_type=, the outputs' shapes and dtypes "
            f"(a pytree of jax.ShapeDtypeStruct; out_shape= as in jax-triton 0.4 also works)"
        )
    return out_type, False


def _check_flags(where: str, *, debug, enable_fp_fusion, has_side_effect) -> None:
    """The boolean options are booleans (``"False"`` is truthy); ``has_side_effect`` is False."""
    for option, value, none_ok in (
        ("debug", debug, False),
        ("enable_fp_fusion", enable_fp_fusion, True),
        ("has_side_effect", has_side_effect, False),
    ):
        if not (isinstance(value, (bool, np.bool_)) or (none_ok and value is None)):
            expected = "True, False or None" if none_ok else "True or False"
            raise TypeError(f"{where}: {option} must be {expected}, got {value!r} ({type(value).__name__})")
    if has_side_effect:
        raise NotImplementedError(
            f"{where}: has_side_effect=True is not supported: a triton_call whose outputs "
            f"are unused may be removed. Return an output that depends on the effect."
        )


def _compile_options(fn, explicit: dict, backend_options, where: str) -> CompileOptions:
    """The compile options: ``explicit`` (triton_call's own arguments; None: not given) merged
    with ``backend_options``."""
    # Triton's JIT turns device asserts on for debug=True, @triton.jit(debug=True)
    # or TRITON_DEBUG=1; so do the GPU compile and the interpreter.
    debug_asserts = bool(getattr(fn, "debug", False) or triton.knobs.runtime.debug)
    return arguments.compile_options(
        {k: v for k, v in explicit.items() if v is not None}, backend_options, debug_asserts, where
    )


def _no_programs(spec: CallSpec, arrays) -> list:
    """Outputs of a call whose grid has no programs: the kernel does not run."""
    if not all(0 in v.grid for v in spec.variants):
        grids = [v.grid for v in spec.variants]
        raise ValueError(
            f"{spec.where}: autotune configs give grids {grids}; some have no "
            f"programs and some do. Give every config programs, or none."
        )
    aliased = {o: i for i, o in spec.input_output_aliases}
    return [
        jnp.asarray(arrays[aliased[o]]) if o in aliased else jnp.zeros(a.shape, a.dtype)
        for o, a in enumerate(spec.out_avals)
    ]


def _make_spec(kernel, fn, name, params, in_avals, out_avals, metaparams, grid,
               zeroed_outputs, aliases, scalars, cc, debug, batch_fold, options, where):  # fmt: skip
    def value(op):
        return {"input": in_avals, "output": out_avals}[op.kind][op.index] if op.kind != "value" else op.value

    named_args = {n: value(op) for n, op in params.items()}
    variants = []
    for v in autotune.expand(kernel, named_args, dict(metaparams), options):
        meta = v.meta
        arguments.check_options(v.options, where)
        bound = bind(fn, params, in_avals, out_avals, meta, where)
        zeroed = zeroed_outputs(meta) if callable(zeroed_outputs) else zeroed_outputs
        zeroed = arguments.check_zeroed(zeroed, len(out_avals), where)
        for z in v.reset_to_zero:  # autotune's reset_to_zero, when it names outputs
            if z in params and params[z].kind == "output":
                zeroed.add(params[z].index)
        grid_v = arguments.grid_of(grid, meta, name, where)
        variants.append(CallVariant(bound, grid_v, v.options, tuple(sorted(zeroed))))
    return CallSpec(
        kernel, fn, name, tuple(variants), tuple(in_avals), tuple(out_avals),
        tuple(sorted(aliases.items())), scalars, cc, debug, batch_fold,
        (params, dict(metaparams), grid, zeroed_outputs, options), where,
    )  # fmt: skip


# ---------------------------------------------------------------- lowering


def _compute_capability(ctx, call: CallSpec) -> int:
    if call.compute_capability is not None:
        return int(call.compute_capability)
    devices = getattr(ctx.module_context, "devices", None) or []
    try:
        devices = devices or jax.devices("cuda")
    except RuntimeError:
        devices = []
    for d in devices:
        cc = getattr(d, "compute_capability", None)
        if cc:
            major, minor = str(cc).split(".")
            return int(major) * 10 + int(minor)
    return int(os.environ.get("JAX_TRITON_COMPUTE_CAPABILITY", "90"))


def _runtime_params(bound: BoundCall, operand_avals):
    params: list[jkr.Buffer | jkr.Scalar] = []
    for p in bound.params:
        if p.kind == "buffer":
            # XLA may hand a zero-size operand any address; the kernel cannot read it.
            empty = 0 in operand_avals[p.operand].shape
            params.append(jkr.Buffer(p.operand, 1 if empty else 16))
        elif p.kind == "scalar":
            params.append(jkr.Scalar(p.type, p.value))
    return params


def _cuda_lowering(ctx, *args, call: CallSpec):
    cc = _compute_capability(ctx, call)
    limit = jkr_triton.SHARED_MEMORY_LIMITS.get(cc, 232448)  # the shared layer's table
    compiled = []
    for _i, v in enumerate(call.variants):
        try:
            config, _ = compile_kernel(call.fn, v.bound, v.options, cc, call.debug)
        except TritonCompilationError as e:
            hint = frontend.zero_d_hint(v.bound, call.in_avals)
            raise TritonCompilationError(f"{call.where}: {e}{hint}") from e.__cause__
        if config.shared_memory_bytes > limit:
            if len(call.variants) == 1:
                raise ValueError(
                    f"triton_call {call.name!r}: the kernel needs "
                    f"{config.shared_memory_bytes} bytes of shared memory per block "
                    f"but sm_{cc} allows at most {limit}; use smaller blocks or "
                    f"fewer stages (num_stages={v.options.num_stages})"
                )
            continue  # an autotune config that cannot run on this device
        compiled.append((v, config))
    if not compiled:
        raise ValueError(
            f"triton_call {call.name!r}: every autotune config needs more than "
            f"the {limit} bytes of shared memory sm_{cc} allows"
        )
    operand_avals = call.in_avals + call.out_avals
    layouts = {tuple(_runtime_params(v.bound, operand_avals)) for v, _ in compiled}
    if len(layouts) != 1:
        raise NotImplementedError(
            f"triton_call {call.name!r}: autotune configs change which kernel "
            f"parameters are runtime values; only constexpr metaparams may differ"
        )
    key = ""
    if len(compiled) > 1:
        device = f"sm_{cc}"
        key = autotune.tune_key(
            call.fn, [(v.bound.key(), v.options) for v, _ in compiled], call.in_avals, call.scalars,
            [v.grid for v, _ in compiled], device,
        )  # fmt: skip
        winner = autotune.lookup_winner(key)
        if winner is not None and winner < len(compiled):
            compiled = [compiled[winner]]
            key = ""
        else:
            autotune.expect_tuning(key)
    first = compiled[0][0]
    params = list(next(iter(layouts)))

    def launch(*arrays):
        return jkr.kernel_call(
            *arrays,
            configs=[c for _, c in compiled],
            grid=[v.grid for v, _ in compiled],
            out_shapes=list(call.out_avals),
            params=params,
            input_output_aliases=dict(call.input_output_aliases),
            zeroed_outputs=first.zeroed_outputs,
            name=call.name,
            tune_key=key,
        )

    return mlir.lower_fun(launch, multiple_results=True)(ctx, *args)


def _cpu_lowering(ctx, *args, call: CallSpec):
    # On the CPU the first config stands in for autotuning: timing the
    # interpreter says nothing about GPU speed.
    v = call.variants[0]
    if call.debug:
        print(f"[jax_triton] interpreting {call.name}: signature={v.bound.signature()} grid={v.grid}")
    try:
        frontend.check(call.fn, v.bound, v.options.as_dict())
    except frontend.TritonFrontendError as e:
        raise TritonCompilationError(
            f"{call.where}: Triton cannot compile kernel {call.fn.__name__!r} "
            f"(defined at {frontend.kernel_source(call.fn)}) with signature "
            f"{v.bound.signature()}:\n{e}{frontend.zero_d_hint(v.bound, call.in_avals)}"
        ) from None

    def host(*arrays):
        try:
            return run_on_host(
                call.fn, v.bound, v.grid, call.out_avals, dict(call.input_output_aliases), arrays,
                debug=v.options.debug,
            )  # fmt: skip
        except Exception as e:
            raise RuntimeError(
                f"{call.where}: the kernel failed in Triton's interpreter: {type(e).__name__}: {e}"
            ) from e

    def interpret(*arrays):
        return jax.pure_callback(host, list(call.out_avals), *arrays, vmap_method="sequential")

    return mlir.lower_fun(interpret, multiple_results=True)(ctx, *args)


triton_call_p = jkr.kernel_primitive(
    "triton_call",
    lambda call: call.out_avals,
    {"cuda": _cuda_lowering, "cpu": _cpu_lowering},
    kernel_name=lambda call: call.name,
    elsewhere="jax_triton launches Triton kernels on CUDA GPUs and runs them on the CPU through Triton's "
    "interpreter. Use jax.default_device(jax.devices('cpu')[0]) or a CUDA device.",
)


# ---------------------------------------------------------------- AD, vmap


def _jvp(primals, tangents, *, call: CallSpec):
    raise NotImplementedError(
        f"jax.grad/jvp of triton_call {call.name!r} is not supported: a Triton "
        f"kernel has no derivative rule. Wrap the function that calls it in "
        f"jax.custom_vjp (or jax.custom_jvp) and give it a backward kernel."
    )


ad.primitive_jvps[triton_call_p] = _jvp


def _batch(args, dims, *, call: CallSpec):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]
    if call.batch_fold is not None:
        return _batch_folded(args, dims, size, call), [0] * len(call.out_avals)
    batched = [i for i, d in enumerate(dims) if d is not None]

    def one(xs):
        full = list(args)
        for i, x in zip(batched, xs):
            full[i] = x
        return triton_call_p.bind(*full, call=call)

    outs = jax.lax.map(one, [args[i] for i in batched])
    return list(outs), [0] * len(call.out_avals)


def _batch_folded(args, dims, size, call: CallSpec):
    params, metaparams, grid, zeroed, options = call.call_args
    args = [a if d is not None else jnp.broadcast_to(a, (size, *a.shape)) for a, d in zip(args, dims)]
    batch_fold = cast(Callable, call.batch_fold)  # called only with one (see the batching rule)
    _, new_scalars = batch_fold(size, call.variants[0].grid, dict(call.scalars))
    new_scalars = dict(new_scalars or {})
    keys = {k: i for i, (k, _) in enumerate(call.scalars)}
    names = list(call.fn.arg_names)
    params = dict(params)
    for key, val in new_scalars.items():
        name = names[key] if isinstance(key, int) and 0 <= key < len(names) else key
        if key not in keys or name not in params:
            raise ValueError(
                f"{call.where}: batch_fold returned scalar {key!r}, which is not a scalar "
                f"argument of the call; its scalars are {[k for k, _ in call.scalars]}"
            )
        params[name] = dataclasses.replace(params[name], value=val)
    in_avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    out_avals = tuple(jax.ShapeDtypeStruct((size, *o.shape), o.dtype) for o in call.out_avals)

    def folded_grid(meta):
        return call.batch_fold(
            size, arguments.grid_of(grid, meta, call.name, call.where), dict(call.scalars)
        )[0]

    spec = _make_spec(
        call.kernel, call.fn, call.name, params, in_avals, out_avals, metaparams,
        folded_grid, zeroed, dict(call.input_output_aliases),
        tuple({**dict(call.scalars), **new_scalars}.items()), call.compute_capability,
        call.debug, None, options, call.where,
    )  # fmt: skip
    return triton_call_p.bind(*args, call=spec)


batching.primitive_batchers[triton_call_p] = _batch
