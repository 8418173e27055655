"""The MLIR lowering rule of ``pallas_call_p`` for the platform ``tpu``.

With ``interpret=pltpu.InterpretParams()`` the kernel runs in the TPU
interpreter (plain JAX, any platform). Otherwise it is lowered to a Mosaic
module (``mosaic/lowering_kernel.py``, verified in ``mosaic/modules.py``) and
serialized into XLA's ``tpu_custom_call`` with the backend config Mosaic expects, through JAX's own helper (compat): so
``jax.export(f, platforms=["tpu"])`` works on a machine without a TPU.
``mosaic_modules(fn, *args)`` returns the modules ``fn`` lowers to.

This module is pallas-tpu's ``pallas.backend.Backend`` (registered through the
``pallas.backends`` entry point); its members each take the call record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import numpy as np
from jax.interpreters import mlir
from jaxlib.mlir import ir

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import pallas_call as interpret_pallas_call
from pallas_tpu._src.interpret import progress as compile_progress
from pallas_tpu._src.interpret import sessions as interpret_sessions
from pallas_tpu._src.interpret.interpreter import InterpretParams
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import tpu_info
from pallas_tpu._src.mosaic import modules
from pallas_tpu._src.mosaic.lowering import BOOL_MEMORY_DTYPE, LoweringException
from pallas_tpu._src.mosaic.lowering_kernel import func_name

PLATFORMS = ("tpu",)
# Grids with traced sizes lower: the sizes are the custom call's first operands.
DYNAMIC_GRID = True
# The Backend protocol's members (pallas.backend.Backend: this module is the backend), and the
# names pallas_tpu exports from here.
__all__ = [
    "COMPILER_PARAMS",
    "DYNAMIC_GRID",
    "INTERPRET_PARAMS",
    "PLATFORMS",
    "LoweringException",
    "check_compiler_params",
    "claims_interpret",
    "describe",
    "interpret",
    "lower",
    "mosaic_modules",
]

COMPILER_PARAMS = tpu_core.CompilerParams
INTERPRET_PARAMS = InterpretParams


def describe() -> str:
    return "pallas_tpu"


def _interpret(*args, call, params: InterpretParams):
    # Reads through pl.ds(i, n, 0): one element, broadcast (the interpreter's windows need strides >= 1).
    jaxpr = plb.broadcast_zero_stride_reads(call.jaxpr, call.where)
    with tpu_info.modeled_chip(params.chip_version):
        return interpret_pallas_call.run(
            args,
            jaxpr=jaxpr,
            grid_mapping=call.grid_mapping,
            input_output_aliases=call.block_aliases,
            params=params,
            compiler_params=call.first_compiler_params,
            kernel_facts=call.facts if jaxpr is call.jaxpr else None,
        )


def _interpret_lower(ctx, call, params: InterpretParams, *args):
    # The mesh's devices tell the multi-device interpreter whether they all live in this process.
    with (
        compile_progress.interpreting(call.grid_mapping.kernel_name),
        interpret_sessions.lowering_mesh(ctx.module_context.axis_context),
    ):
        fun = functools.partial(_interpret, call=call, params=params)
        return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)


def interpret(ctx, call, params: InterpretParams, *args):
    """MLIR lowering of the call through the TPU interpreter, with ``params``
    (pallas-core resolved them: ``call.interpret`` itself, or the defaults for a
    kernel it handed over)."""
    if call.interpret is not params:  # handed over (interpret=True): pallas-core guards export
        return _interpret_lower(ctx, call, params, *args)
    gm = call.grid_mapping
    if modules.collecting():
        raise _interpret_mode_error(gm, params, "pltpu.mosaic_modules")
    try:
        return _interpret_lower(ctx, call, params, *args)
    except ValueError as e:
        # JAX's host callbacks lower only for the platform of a backend it has.
        if "different from the lowering platform" not in str(e):
            raise
        platforms = ", ".join(getattr(ctx.module_context, "platforms", ())) or "a TPU"
        raise _interpret_mode_error(gm, params, f"lowering for {platforms}") from e


def claims_interpret(call) -> bool:
    """pallas-core hands us every kernel its own interpreter cannot run."""
    return True


def check_compiler_params(call) -> tpu_core.CompilerParams:
    cp = call.compiler_params if call.compiler_params is not None else tpu_core.CompilerParams()
    if not isinstance(cp, tpu_core.CompilerParams):
        raise TypeError(f"{call.where}: compiler_params for a TPU must be pltpu.CompilerParams, got {cp!r}")
    return cp


# ---------------------------------------------------------------------------
# Mosaic


def _custom_call_config(cp: tpu_core.CompilerParams, cost_estimate, aliases, metadata) -> dict:
    cost = dataclasses.asdict(cost_estimate) if cost_estimate is not None else None
    return dict(
        cost_estimate=cost,
        vmem_limit_bytes=cp.vmem_limit_bytes,
        flags=dict(cp.flags) if cp.flags else None,
        allow_input_fusion=cp.allow_input_fusion,
        input_output_aliases=tuple(aliases),
        internal_scratch_in_bytes=cp.internal_scratch_in_bytes,
        collective_id=cp.collective_id,
        has_side_effects=cp.has_side_effects,
        serialization_format=cp.serialization_format,
        output_memory_spaces=None,
        input_memory_spaces=None,
        disable_bounds_checks=cp.disable_bounds_checks,
        disable_semaphore_checks=cp.disable_semaphore_checks,
        skip_device_barrier=cp.skip_device_barrier,
        allow_collective_id_without_custom_barrier=cp.allow_collective_id_without_custom_barrier,
        shape_invariant_numerics=cp.shape_invariant_numerics,
        needs_layout_passes=cp.needs_layout_passes,
        metadata=dict(metadata or ()),  # as JAX: kernel_metadata = "{}" when there is none
        opt_level=cp.opt_level,
    )


def lower(ctx, call, *args):
    """MLIR lowering of the call for a TPU: a Mosaic module in a ``tpu_custom_call``."""
    gm = call.grid_mapping
    cp = check_compiler_params(call)
    # Every per-generation decision (VMEM, tiling) follows the TPU this lowering compiles for.
    device = compat.lowering_tpu_device(ctx)
    target = (
        tpu_info.target_device(device.device_kind, getattr(device, "num_cores", 1) or 1)
        if device is not None
        else contextlib.nullcontext()
    )
    with target:
        module = modules.mosaic_module(call.jaxpr, gm, cp, ctx.module_context.context, compat.mesh_axes(ctx))
    # The canonicalized text (a clone of the module through a pass) only where it is read.
    if call.debug or modules.collecting():
        text = modules.module_text(module)
        if call.debug:
            print(f"\nThe Mosaic module for {gm.where}:")
            print(text)
        modules.record(gm.where, module, text)
    # The custom call's operands are the dynamic grid sizes, then pallas_call's
    # arguments, which the aliases count (scalar-prefetch operands included, as JAX).
    aliases = tuple((i + gm.num_dynamic_grid_bounds, o) for i, o in call.input_output_aliases)
    config = _custom_call_config(cp, call.cost_estimate, aliases, call.metadata)
    return _bool_as_int32(ctx, args, functools.partial(_custom_call, module=module, gm=gm, config=config))


def _interpret_mode_error(gm, interpret, what: str) -> ValueError:
    return ValueError(
        f"{gm.where}: {what}: the kernel asks for TPU interpret mode (interpret={interpret!r}), which runs "
        "it in Python on the CPU through host callbacks, so there is no Mosaic module to make and nothing "
        "a TPU can run. Drop interpret= (or pass interpret=False) to lower the kernel for a TPU; keep it to "
        "run the kernel on the CPU under jax.jit (jax.export cannot serialize the interpreter's host "
        "callbacks; interpret=True exports for the CPU where the kernel uses no TPU features)."
    )


def _custom_call(ctx, *args, module, gm, config):
    with ctx.module_context.context, ir.Location.unknown(ctx.module_context.context):
        try:
            return compat.lower_mosaic_to_custom_call(
                ctx,
                *args,
                module=module,
                out_avals=list(ctx.avals_out),
                kernel_name=func_name(gm.kernel_name),
                **config,
            )
        except ValueError as e:
            if "collective_id" not in str(e):
                raise
            raise LoweringException(
                f"{gm.where}: {e}. A kernel that uses pltpu.get_barrier_semaphore() needs "
                "compiler_params=pltpu.CompilerParams(collective_id=<int>)"
            ) from e


def _bool_as_int32(ctx, args, call):
    """``call(ctx, *args)`` with bool operands and results passed as int32,
    the kernel's memory type for bools."""
    to_mem = [a.update(dtype=BOOL_MEMORY_DTYPE) if a.dtype == np.bool_ else a for a in ctx.avals_in]
    from_mem = [a.update(dtype=BOOL_MEMORY_DTYPE) if a.dtype == np.bool_ else a for a in ctx.avals_out]
    if to_mem == list(ctx.avals_in) and from_mem == list(ctx.avals_out):
        return call(ctx, *args)
    cast_in = mlir.lower_fun(
        lambda *xs: [x.astype(a.dtype) for x, a in zip(xs, to_mem)], multiple_results=True
    )
    args = cast_in(ctx.replace(avals_out=to_mem), *args)
    outs = call(ctx.replace(avals_in=to_mem, avals_out=from_mem), *args)
    out_avals = list(ctx.avals_out)
    cast_out = mlir.lower_fun(
        lambda *ys: [y.astype(a.dtype) for y, a in zip(ys, out_avals)], multiple_results=True
    )
    return cast_out(ctx.replace(avals_in=from_mem), *outs)


def mosaic_modules(fn, *args, **kwargs) -> list[str]:
    """The Mosaic module text of every ``pallas_call`` that ``fn(*args)``
    lowers for a TPU, in program order (no TPU needed).

    Args:
      fn: a function of JAX arrays calling TPU kernels.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments.
    Returns:
      One ``str`` per kernel lowering.
    """

    # A fresh wrapper each time: JAX caches the lowering of a traced function,
    # and a cached lowering would not run our rule again.
    def wrapper(*a, **k):
        return fn(*a, **k)

    with modules.collect_kernels() as sink:
        jax.export.export(jax.jit(wrapper), platforms=["tpu"])(*args, **kwargs)
    return [text for _, text, _ in sink]
