"""The ``tpu_interpret`` way: pallas-tpu's TPU interpret mode, on the CPU.

It runs the kernel as a TPU would (its memory spaces, DMAs and semaphores, its grid over the
chip's TensorCores, the chip's MXU model) and compares the outputs with the test's plain-``jnp``
reference at the host's arithmetic. The way's parameters become ``pltpu.InterpretParams``: the
DMA execution mode of a split way (``every_way(tpu=True, dma=True)``: ``tpu_interpret:on_wait``,
``tpu_interpret:eager``), ``num_cores_or_threads`` (``way.with_params(num_cores=2)``),
``chip_version`` (``with_params(chip="v6e")``) and any other ``with_params`` knob.

Every kernel is checked for a TPU before pallas-tpu's interpreter runs it (``tpu_check``: a
kernel no TPU runs as written skips the way). ``way.interpret()`` is those params wrapped in
``Checked``, the interpret params of a backend this engine registers with pallas-core
(``pallas.backend.register_backend``: pallas-tpu's own backend with the check in front), so the
kernel checked is the one that runs: the way's ``pallas_call``, a function of them
(``way.jit``, in ``pltpu.force_tpu_interpret_mode``), an op given ``interpret=``, a kernel a test
builds with ``interpret=way.interpret()``, and the kernel ``vmap`` makes of any of them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import pytest

from . import tpu_check
from .engine import InterpretEngine

DMA_MODES = ("on_wait", "eager")  # pltpu.InterpretParams' dma_execution_mode: every_way(dma=True)


@dataclasses.dataclass(frozen=True)
class Checked:
    """``pltpu.InterpretParams`` of the tpu_interpret way: the ``CheckingBackend`` runs a kernel
    given them (each attribute is the params' own: what tracing reads, ``chip_version``...)."""

    params: Any  # pltpu.InterpretParams

    def __getattr__(self, name):
        if name == "params" or name.startswith("__"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.params, name)


class CheckingBackend:
    """pallas-tpu's backend for pallas-core, for ``Checked`` params: each kernel is checked for
    a TPU (``tpu_check.refusal_of``), then pallas-tpu's interpreter runs it with the params."""

    PLATFORMS: tuple[str, ...] = ()  # never chosen for a platform: only by its params' type
    INTERPRET_PARAMS = Checked

    def __init__(self, tpu):
        self._tpu = tpu
        self.COMPILER_PARAMS = tpu.COMPILER_PARAMS
        self.DYNAMIC_GRID = tpu.DYNAMIC_GRID

    def describe(self) -> str:
        return self._tpu.describe()

    def check_compiler_params(self, call):
        return self._tpu.check_compiler_params(call)

    def lower(self, ctx, call, *args):
        raise NotImplementedError("the tpu_interpret way interprets; it lowers nothing")

    def claims_interpret(self, call) -> bool:
        return False

    def interpret(self, ctx, call, params, *args):
        why = tpu_check.refusal_of(call.grid_mapping, call.jaxpr, params.chip_version)
        if why:
            pytest.skip(f"not a TPU kernel ({TpuInterpretEngine.name} way): {why}")
        return self._tpu.interpret(ctx, call.replace(interpret=params.params), params.params, *args)


@functools.cache
def _registered() -> None:
    """Registers the ``CheckingBackend`` with pallas-core (once a process)."""
    from pallas import backend as plb
    from pallas_tpu._src import pallas_call_registration

    plb.register_backend("tests.ways.tpu_interpret", CheckingBackend(pallas_call_registration))


class TpuInterpretEngine(InterpretEngine):
    name = "tpu_interpret"
    tpu = True
    runs_ops = True
    dma_modes = DMA_MODES

    def params(self, way):
        """The way's ``pltpu.InterpretParams``."""
        import pallas_tpu as pltpu

        params = {"dma_execution_mode": way.dma} if way.dma else {}
        if way.num_cores != 1:
            params["num_cores_or_threads"] = way.num_cores
        if way.chip is not None:
            params["chip_version"] = way.chip
        return pltpu.InterpretParams(**{**params, **dict(way.params)})

    def interpret(self, way):
        """The way's params, ``Checked``: each kernel given them is checked for a TPU first."""
        _registered()
        return Checked(self.params(way))

    def jit(self, way, f):
        """``jax.jit(f)`` with every ``pallas_call`` that passes no ``interpret`` (or False) run
        in TPU interpret mode with this way's params (``pltpu.force_tpu_interpret_mode``)."""
        import pallas_tpu as pltpu

        g = jax.jit(f)

        def run(*args):
            with pltpu.force_tpu_interpret_mode(self.interpret(way)):
                return g(*args)

        return run

    def op(self, way, op, *args, **kw):
        return op(*args, interpret=self.interpret(way), **kw)
