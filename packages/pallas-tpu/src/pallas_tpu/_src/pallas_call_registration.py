"""pallas-tpu as a pallas-core backend: the TPU interpreter for
``interpret=pltpu.InterpretParams(...)`` (and for ``interpret=True`` on kernels
that pallas-core's interpreter cannot run), and the platform ``tpu``."""

from __future__ import annotations

import functools

from jax.interpreters import mlir

from pallas import backend as plb
from pallas_tpu._src import core as tpu_core
from pallas_tpu._src import interpret_pallas_call
from pallas_tpu._src.interpret import Interpreter, InterpretParams

PLATFORMS = ("tpu",)


class LoweringException(Exception):
    """A kernel that cannot be lowered to Mosaic (JAX's ``pltpu.LoweringException``)."""


COMPILER_PARAMS = tpu_core.CompilerParams
INTERPRET_PARAMS = InterpretParams


def _interpreter_class(jaxpr, params):
    from pallas_tpu._src import interpret_multi

    if params.detect_races or interpret_multi.needs_multi_device(jaxpr):
        return interpret_multi.MultiDeviceInterpreter
    return Interpreter


def _interpret(*args, jaxpr, grid_mapping, input_output_aliases, interpret, compiler_params, **_):
    params = interpret if isinstance(interpret, InterpretParams) else InterpretParams()
    from pallas_tpu._src import tpu_info

    cls = _interpreter_class(jaxpr, params)
    with tpu_info.modeled_chip(params.chip_version):
        return interpret_pallas_call.run(
            cls,
            args,
            jaxpr=jaxpr,
            grid_mapping=grid_mapping,
            input_output_aliases=input_output_aliases,
            params=params,
            compiler_params=compiler_params,
        )


def interpret_lower(ctx, *args, **params):
    """MLIR lowering of pallas_call_p through the TPU interpreter."""
    return mlir.lower_fun(functools.partial(_interpret, **params), multiple_results=True)(ctx, *args)


def claims_interpret(jaxpr, grid_mapping) -> bool:
    """pallas-core hands us every kernel its own interpreter cannot run."""
    return True


def lower(ctx, *args, jaxpr, grid_mapping, interpret=False, **params):
    if isinstance(interpret, InterpretParams):
        return interpret_lower(
            ctx, *args, jaxpr=jaxpr, grid_mapping=grid_mapping, interpret=interpret, **params
        )
    raise NotImplementedError(
        f"{plb.describe(grid_mapping.kernel_name, grid_mapping.source)}: lowering Pallas kernels to Mosaic "
        "for a TPU is not implemented yet (issue 'pallas-tpu 2 of 2'); run the kernel with "
        "interpret=pltpu.InterpretParams() on any machine"
    )
