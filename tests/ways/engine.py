"""The interface every way runs behind (``ways.Way`` holds a test's parameters, its engine
runs the kernels): an ``Engine`` is told the way (cores, chip generation, DMA mode, interpret
params) and runs a ``pallas_call``, a function of them (``jit``), an op of ``pallas_tpu.ops``,
a kernel per device (``run_sharded``); it says which modules a kernel body takes
(``modules``), whether it applies to a kernel (``check``, before the run) and how far what it
computes may be from the host's arithmetic (``mxu_operand``, ``chip_flushed``, ``dot_tol``,
``chip_tol``: the identity except on a chip).

``REGISTRY`` finds a way's engine by its name: one class in one module of this package each,
imported when the way first runs (after its packages are found installed: ``missing``), so a
machine without pallas-tpu or Triton collects every test and skips those ways.

``InterpretEngine`` is the base of the engines that run a kernel by ``pallas_call(interpret=
...)`` (core, core_steps, triton, tpu_interpret, gpu); ``mosaic.MosaicEngine`` the base of those
that lower it to Mosaic and run the module (mosaic, jax_mosaic, compiled, chip, jax_beside).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import math
import threading
from typing import Any

import jax
import numpy as np

import pallas as pl

from .machine import ON_CHIP


class Engine:
    """One way of running a kernel. Each method takes the ``Way`` first: the parameters of
    the test's run (``num_cores``, ``chip``, ``dma``, ``params``, ``ours_only``, ``kept``)."""

    #: The way's name: the test id, and what ``skip_way``/``xfail_way`` marks name.
    name = ""
    #: Kernel bodies are traced by JAX's Pallas (``jax.experimental.pallas``), not ours.
    jax_lowering = False
    #: A TPU engine: it runs TPU kernels, and checks before the run that a kernel is one.
    tpu = False
    #: It runs an op of ``pallas_tpu.ops`` (``way.op``): the op's kernels are ours.
    runs_ops = False
    #: JAX's lowering compiled beside ours (``jax_beside``): the test body's run is not the test's.
    beside = False
    #: The DMA execution modes a test of DMAs runs this engine in, one test each
    #: (``every_way(dma=True)``; none: once, a Mosaic module has no such mode).
    dma_modes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # -- the kernel body's modules, and what ``pallas_call`` gets ------------------------

    def modules(self, way):
        """``(pl, pltpu)`` a kernel body run this way takes: ours."""
        import pallas_tpu as pltpu

        return pl, pltpu

    def interpret(self, way) -> Any:
        """What ``pallas_call(interpret=...)`` gets in this engine (None: the kernel is
        lowered and its module run, not interpreted)."""
        return None

    def call_kwargs(self, way) -> dict:
        """What a function that calls ``pallas_call`` itself passes to it to run this way."""
        return {}

    # -- running ----------------------------------------------------------------------------

    def pallas_call(self, way, kernel, out_shape, **kwargs):
        """``pl.pallas_call(kernel, out_shape, **kwargs)`` run this way."""
        raise NotImplementedError

    def jit(self, way, f):
        """``jax.jit(f)`` run this way, ``f`` a function of ``way.pallas_call``s."""
        raise NotImplementedError

    def op(self, way, op, *args, **kw):
        """``op(*args, **kw)`` run this way, ``op`` a public function that takes ``interpret=``."""
        raise AssertionError(f"an op of pallas_tpu.ops does not run the {self.name} way")

    def run_sharded(self, way, f, x, shape, names, spec, input_output_aliases):
        """``f`` ``shard_map``ped over a mesh of ``shape`` devices (axes ``names``) on the
        leading axis of ``x``, the outputs concatenated along it."""
        raise NotImplementedError

    def before_call(self, way, item):
        """Called before the test body runs with ``way`` (tests/conftest.py): the way it runs
        with (``way`` itself; the compiled engine's, with JAX's kernels kept beside it)."""
        return way

    # -- does the kernel apply ------------------------------------------------------------------

    def check(self, way, closed) -> None:
        """Before the run: skips the test when a kernel of ``closed`` (the traced function)
        is not one this engine runs. Every kernel applies to an engine that is not a TPU's."""

    # -- what a kernel run this way computes where it differs from the host's arithmetic --

    def mxu_operand(self, x):
        """``x`` as a matmul kernel run this way multiplies it: ``x`` itself."""
        return x

    def chip_flushed(self, x):
        """``x`` with the subnormals this way flushes flushed: ``x`` itself."""
        return np.asarray(x)

    def dot_tol(self, tol: float, dtype=np.float32, grads: bool = False) -> float:
        """The tolerance of a kernel of chained matmuls of ``dtype`` operands: ``tol``."""
        return tol

    def chip_tol(self, tol: float, floor: float) -> float:
        """The tolerance of a kernel of transcendental functions: ``tol``."""
        return tol

    def random_reference(self, build, args, model):
        """What a kernel on the TPU's hardware random bits gives: ``model()``, the generator
        as the interpreters and ``run_mosaic`` model it."""
        return model()


class InterpretEngine(Engine):
    """An engine that runs a kernel by ``pl.pallas_call(..., interpret=self.interpret(way))``."""

    def pallas_call(self, way, kernel, out_shape, **kwargs):
        kwargs.setdefault("interpret", self.interpret(way))
        return pl.pallas_call(kernel, out_shape, **kwargs)

    def call_kwargs(self, way) -> dict:
        return {"interpret": self.interpret(way)}

    def jit(self, way, f):
        return jax.jit(f)

    def run_sharded(self, way, f, x, shape, names, spec, input_output_aliases):
        """On CPU devices (tests/conftest.py makes four)."""
        n = math.prod(shape)
        mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]).reshape(shape), names)
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
        return self.jit(way, g)(x)


class _WholeFunction(threading.local):
    """Set while a Mosaic engine traces ``way.jit``'s function (or runs a kernel per device):
    its ``pallas_call``s are lowered with it, not run alone."""

    active = False

    @contextlib.contextmanager
    def __call__(self):
        self.active, before = True, self.active
        try:
            yield
        finally:
            self.active = before


whole_function = _WholeFunction()


# -- the registry: a way's engine by its name ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where a way's engine lives: ``module:cls`` in this package, the modules it needs
    installed, and the engine that runs it on a TPU (``on_chip``) and JAX's lowering beside it
    (``beside``), where those differ."""

    engine: str
    needs: tuple[str, ...] = ()
    on_chip: str | None = None
    beside: str | None = None


REGISTRY = {
    "core": Entry("core:CoreEngine"),
    "core_steps": Entry("core:CoreStepsEngine"),
    "triton": Entry("triton:TritonEngine", ("triton", "pallas_gpu")),
    "tpu_interpret": Entry("tpu_interpret:TpuInterpretEngine", ("pallas_tpu",)),
    "mosaic": Entry("mosaic:MosaicEngine", ("pallas_tpu",)),
    "jax_mosaic": Entry("jax_mosaic:JaxMosaicEngine", ("pallas_tpu", "jax.experimental.pallas.tpu")),
    "compiled": Entry(
        "compiled:CompiledEngine",
        ("pallas_tpu", "libtpu"),
        on_chip="chip:ChipEngine",
        beside="jax_beside:JaxBesideEngine",
    ),
    "gpu": Entry("gpu:GpuEngine", ("triton", "pallas_gpu")),
}

# What to install for a module an engine needs.
_INSTALL = {"pallas_gpu": "jax-pallas-gpu", "pallas_tpu": "jax-pallas-tpu", "libtpu": '"jax[tpu]"'}


@functools.cache
def missing(name: str) -> str | None:
    """Why way ``name`` cannot run here (the first module it needs that is not installed), or None."""
    for m in REGISTRY[name].needs:
        try:
            found = importlib.util.find_spec(m) is not None
        except ModuleNotFoundError:  # its parent package is not installed
            found = False
        if not found:
            return f"needs {m} (pip install {_INSTALL.get(m, m)})"
    return None


@functools.cache
def engine_named(name: str, beside: bool = False) -> Engine:
    """The engine of way ``name`` on this machine (``beside``: JAX's lowering beside it)."""
    entry = REGISTRY[name]
    where = entry.beside if beside else entry.on_chip if ON_CHIP and entry.on_chip else entry.engine
    if where is None:
        raise ValueError(f"the {name} way has no engine beside it")
    module, cls = where.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)()


def engine_of(way) -> Engine:
    """The engine of ``way``: a ``Way``, or a way's name."""
    return engine_named(way) if isinstance(way, str) else way.engine
