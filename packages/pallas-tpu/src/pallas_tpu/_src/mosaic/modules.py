"""A kernel's verified Mosaic module, its text, and the modules a function
lowers: ``collect_kernels`` gathers, per thread, what ``pallas_call_registration.lower``
records (``pltpu.mosaic_modules`` and ``compile_check`` read them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jax.interpreters import mlir
from jaxlib.mlir import ir, passmanager
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src import checks
from pallas_tpu._src.mosaic.lowering import LoweringException
from pallas_tpu._src.mosaic.lowering_kernel import func_name, lower_kernel

_collecting = threading.local()


def mosaic_module(
    jaxpr, grid_mapping, compiler_params=None, context: ir.Context | None = None, mesh_axes=()
) -> ir.Module:
    """The verified Mosaic module of a kernel, built in ``context`` (a new
    one with the tpu dialect when None); ``mesh_axes`` as ``lower_kernel``'s."""
    checks.check_kernel(grid_mapping, jaxpr, compiler_params)  # what TPU interpret mode refuses too
    if context is None:
        context = mlir.make_ir_context()
    tpu.register_dialect(context)
    with context, ir.Location.unknown(context):
        module = lower_kernel(jaxpr, grid_mapping, compiler_params, mesh_axes)
        # Named after the kernel: libtpu's errors say "MLIR module name `<kernel>`".
        module.operation.attributes["sym_name"] = ir.StringAttr.get(func_name(grid_mapping.kernel_name))
        if not module.operation.verify():  # verify() raises with the diagnostics on failure
            where = plb.describe(grid_mapping.kernel_name, grid_mapping.source)
            raise LoweringException(f"{where}: the Mosaic module does not verify")
    return module


def module_text(module: ir.Module) -> str:
    """The module as text, canonicalized (constants hoisted, dead loads and
    empty branches dropped) as JAX prints it for ``debug=True``."""
    with module.context:
        clone = module.operation.clone(ip=False)  # not into the caller's insertion point
        passmanager.PassManager.parse("builtin.module(canonicalize)").run(clone)
        return str(clone.get_asm(assume_verified=True))  # a str: the bindings type it as object


def collecting() -> bool:
    """Whether a ``collect_kernels`` is open in this thread."""
    return bool(getattr(_collecting, "sinks", ()))


def record(kernel: str, module: ir.Module, text: str) -> None:
    """Hands a lowered kernel to every open ``collect_kernels`` of this thread."""
    sinks = getattr(_collecting, "sinks", ())
    if sinks:  # with locations: compile_check finds a Mosaic error's kernel by its line
        with_locations = module.operation.get_asm(enable_debug_info=True, assume_verified=True)
        for sink in sinks:
            sink.append((kernel, text, with_locations))


@contextlib.contextmanager
def collect_kernels() -> Iterator[list[tuple[str, str, str]]]:
    """Collects ``(kernel, module text, module text with locations)`` of every
    kernel lowered to Mosaic in this thread inside the ``with`` (``kernel``
    names it and its line)."""
    sinks = _collecting.__dict__.setdefault("sinks", [])
    sink: list[tuple[str, str, str]] = []
    sinks.append(sink)
    try:
        yield sink
    finally:
        sinks.remove(sink)
