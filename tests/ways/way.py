"""The ``way`` a test runs its kernels (the object the ``way`` fixture gives), and the marks that
parametrize a test with the ways (``every_way``, ``way_params``, ``skip_way``, ``xfail_way``).

A ``Way`` is a way's name and a test's parameters of it (cores, chip generation, DMA mode,
interpret params); everything it does it asks of its engine (``engine.py``'s ``REGISTRY``: one
module of this package per engine), so nothing here, or in a test, decides by a way's name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from .engine import REGISTRY, Engine, engine_named, missing, whole_function

WAYS = ("core", "core_steps", "triton", "tpu_interpret", "mosaic", "jax_mosaic", "compiled")
DEFAULT_WAYS = WAYS[:5]  # every_way(): the TPU suites' jax_mosaic and compiled ways cost CI time
TPU_WAYS = ("tpu_interpret", "mosaic", "jax_mosaic", "compiled")
# every_way(op=True): the ways of an op of pallas_tpu.ops (its kernels are written against our
# modules: JAX's lowering of them, the jax_mosaic way, does not apply)
WAYS_OF_AN_OP = ("tpu_interpret", "mosaic", "compiled")
MOSAIC_WAYS = ("mosaic", "jax_mosaic", "compiled")  # run by run_mosaic (compiled: on the CPU)
INTERPRET_WAYS = ("core", "core_steps", "triton", "tpu_interpret")


@dataclasses.dataclass(frozen=True)
class Way:
    """One way of running a ``pallas_call``: ``pallas_call`` is ``pl.pallas_call``
    run that way (the same arguments, no ``interpret=``)."""

    name: str
    # The compiled way's run of a test body with JAX's lowering beside ours, before its own
    # run (the ``jax_beside`` engine): its kernels are compiled (on a chip: kept), never run.
    beside: bool = False
    # The tpu_interpret way's DMA execution mode ("on_wait", "eager"; None: the default).
    dma: str | None = None
    # TensorCores per device (``with_params``): 2 runs a kernel over a megacore chip's two.
    num_cores: int = 1
    # More ``pltpu.InterpretParams`` of the tpu_interpret way, as (name, value) pairs.
    params: tuple = ()
    # An op's way (``every_way(op=True)``): its kernels are ours only, so the compiled way
    # compiles no JAX lowering beside them and records nothing in the compile report.
    ours_only: bool = False
    # The chip generation a kernel is written for (``with_params(chip=...)``, a key of
    # ``mosaic.DEVICE_KINDS``; None: any): modelled by the tpu_interpret way
    # (``chip_version``), exported for it by the Mosaic ways, compiled for it alone.
    chip: str | None = None
    # JAX's kernels of this test's body kept by the ``jax_beside`` run, for ours' run to take
    # beside its own (``jax_beside.Kept``; the compiled engine's ``before_call`` sets it).
    kept: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return self.id

    @property
    def id(self) -> str:
        """The test id: the name, and the DMA mode of a split ``tpu_interpret`` way."""
        return f"{self.name}:{self.dma}" if self.dma else self.name

    @property
    def engine(self) -> Engine:
        """What runs this way's kernels on this machine (imported on first use)."""
        self.skip_if_missing()
        return engine_named(self.name, self.beside)

    def with_params(
        self, *, num_cores: int | None = None, chip: str | None = None, **interpret_params
    ) -> Way:
        """This way with ``num_cores`` TensorCores per device (``num_cores_or_threads`` in
        the interpret way; a megacore chip's modules and ``run_mosaic(num_cores=)`` in the
        Mosaic ways), for ``chip``'s generation (its MXU modelled in the interpret way, the
        module exported under its abstract device, compiled for it alone; on a TPU run only
        by that generation) and ``interpret_params`` for ``pltpu.InterpretParams`` in the
        ``tpu_interpret`` way (a Mosaic module has no such knobs: ignored there)."""
        params = {**dict(self.params), **interpret_params}
        return dataclasses.replace(
            self,
            num_cores=num_cores or self.num_cores,
            chip=chip or self.chip,
            params=tuple(sorted(params.items())),
        )

    @property
    def jax_lowering(self) -> bool:
        """Whether kernels are traced by JAX's Pallas (``jax_mosaic``, and the compiled way's
        run beside ours): what a test that picks its source by lowering (an example) reads."""
        return self.engine.jax_lowering

    @property
    def tpu(self) -> bool:
        """Whether this is a TPU way (it runs TPU kernels, checking first that a kernel is one)."""
        return self.engine.tpu

    @property
    def pl(self):
        """``pallas`` in this way: JAX's ``jax.experimental.pallas`` in the ``jax_mosaic`` way."""
        return self.modules()[0]

    @property
    def pltpu(self):
        """``pallas_tpu`` in this way: JAX's ``jax.experimental.pallas.tpu`` in ``jax_mosaic``."""
        return self.modules()[1]

    def modules(self):
        """``(pl, pltpu)`` for a kernel body run this way: JAX's in the ``jax_mosaic`` way."""
        return self.engine.modules(self)

    def interpret(self) -> Any:
        """What ``pallas_call(interpret=...)`` gets in an interpret way (None: a Mosaic way)."""
        return self.engine.interpret(self)

    def skip_if_missing(self) -> None:
        """Skips the test when this way's package (or Triton, JAX's Pallas, libtpu) is not installed."""
        why = missing(self.name)
        if why:
            pytest.skip(f"the {self.name} way {why}")

    def pallas_call(self, kernel, out_shape, **kwargs):
        """``pl.pallas_call(kernel, out_shape, **kwargs)`` run this way."""
        return self.engine.pallas_call(self, kernel, out_shape, **kwargs)

    def call_kwargs(self) -> dict:
        """What a function that calls ``pallas_call`` itself (an example's ``call_kwargs``)
        passes to it to run this way: ``interpret=`` in an interpret way, nothing in a Mosaic way."""
        return self.engine.call_kwargs(self)

    def call(self, fn, *args, **kw):
        """``fn(pl, pltpu, *args, interpret=..., **kw)`` (a kernel written as a function of
        the two modules that calls its ``pallas_call``s with ``interpret=``) run this way:
        ``way.jit`` of it, the way's modules and ``interpret`` given (False in a Mosaic way)."""
        pl_, pltpu_ = self.modules()
        interpret = self.interpret() or False
        return self.jit(lambda *a: fn(pl_, pltpu_, *a, interpret=interpret, **kw))(*args)

    def op(self, op, *args, **kw):
        """``op(*args, **kw)`` run this way, ``op`` a public function that takes ``interpret=``
        (an op of ``pallas_tpu.ops``): given this way's ``pltpu.InterpretParams`` in the
        ``tpu_interpret`` way; in the Mosaic ways ``way.jit`` of it (the compiled way: our
        lowering compiled for each chip under that chip's abstract mesh, so the op picks its
        blocks for the chip, then run by ``run_mosaic``; on a TPU run on the chip)."""
        assert self.engine.runs_ops, f"an op runs the ways {WAYS_OF_AN_OP}, not {self.name}"
        return self.engine.op(self, op, *args, **kw)

    def jit(self, f):
        """``jax.jit(f)`` run this way, ``f`` a function of ``way.pallas_call``s: the Mosaic
        way exports ``f`` whole for a TPU (a traced grid size, an enclosing function's
        arrays captured by a kernel: as a TPU gets them) and runs each kernel's module by
        ``run_mosaic`` in its place."""
        return self.engine.jit(self, f)

    def run_sharded(self, f, x, num_devices, input_output_aliases=()):
        """``f`` (one ``pallas_call`` per device, made with ``way.pallas_call``) ``shard_map``ped
        over ``num_devices`` devices on the leading axis of ``x`` (an int, axis ``"x"``, or a
        mesh shape whose axes ``("x", "y", ...)`` all shard it, row-major), the outputs
        concatenated along it: CPU devices in the interpret ways, ``run_mosaic`` over that many
        TPUs in the Mosaic ways (the compiled way compiles the sharded kernel for each chip
        first); ``input_output_aliases``: the kernel's, for ``run_mosaic``."""
        from jax.sharding import PartitionSpec as P

        shape = (num_devices,) if isinstance(num_devices, int) else tuple(num_devices)
        names = ("x", "y", "z", "w")[: len(shape)]
        spec = P(names[0]) if len(shape) == 1 else P(names)
        with whole_function():
            return self.engine.run_sharded(self, f, x, shape, names, spec, input_output_aliases)

    # What a kernel run this way computes where it differs from the host's arithmetic: the
    # compiled way on a TPU rounds and flushes as the chip does (chip.py); anywhere else each
    # of these is its argument itself.

    def mxu_operand(self, x):
        """``x`` as a matmul kernel run this way multiplies it (on the chip: float32 rounded
        to bfloat16), for the test's reference."""
        return self.engine.mxu_operand(x)

    def chip_flushed(self, x):
        """``x`` with float32 subnormals flushed to signed zero where the kernel ran on the chip."""
        return self.engine.chip_flushed(x)

    def dot_tol(self, tol: float, dtype=None, grads: bool = False) -> float:
        """``tol`` for a kernel of chained matmuls of ``dtype`` operands (float32 by default),
        or the bf16 tolerance where it runs on the chip (``grads``: of an attention backward)."""
        import numpy as np

        return self.engine.dot_tol(tol, np.float32 if dtype is None else dtype, grads)

    def chip_tol(self, tol: float, floor: float) -> float:
        """``tol``, or ``floor`` where the kernel runs on the chip (its exp and log units)."""
        return self.engine.chip_tol(tol, floor)


def every_way(*, skip=None, xfail=None, raises=None, only=None, tpu=False, dma=False, op=False):
    """``pytest.mark.parametrize("way", ...)`` over ``DEFAULT_WAYS`` (``TPU_WAYS`` with
    ``tpu``, ``WAYS_OF_AN_OP`` with ``op``; or ``only`` of the ways): ``way_params``' list.
    """
    params = way_params(skip=skip, xfail=xfail, raises=raises, only=only, tpu=tpu, dma=dma, op=op)
    return pytest.mark.parametrize("way", params, indirect=True)


def way_params(*, skip=None, xfail=None, raises=None, only=None, tpu=False, dma=False, op=False) -> list:
    """The ``pytest.param`` of each way ``every_way`` runs (for a ``parametrize("way", ...,
    indirect=True)`` that adds parameters of its own: the ``way`` fixture gives them as they are).

    Args:
      skip: ``{way: reason}``: the kernel does not apply to that way.
      xfail: ``{way: reason}``: a gap that way has (a strict xfail; ``raises``
        the exception expected, or ``{way: exception}``).
      only: the ways to run (default: ``DEFAULT_WAYS``; any way of ``engine.REGISTRY``).
      tpu: a TPU kernel: the ways are ``TPU_WAYS``.
      op: an op of ``pallas_tpu.ops`` (run by ``way.op``), or another kernel written against
        our modules only (names JAX lacks): the ways are ``WAYS_OF_AN_OP``, each ``ours_only``
        (no JAX lowering compiled beside ours, nothing recorded).
      dma: the ``tpu_interpret`` way once per DMA execution mode (``DMA_MODES``; a
        ``skip``/``xfail`` of ``"tpu_interpret"`` marks both).
    """
    skip, xfail = skip or {}, xfail or {}
    unknown = (set(skip) | set(xfail) | set(only or ())) - set(REGISTRY)
    assert not unknown, f"no such ways: {sorted(unknown)} (ways: {tuple(REGISTRY)})"
    params = []
    for name in only or (WAYS_OF_AN_OP if op else TPU_WAYS if tpu else DEFAULT_WAYS):
        marks = []
        if name in skip:
            marks.append(pytest.mark.skip(reason=f"{name} way: {skip[name]}"))
        if name in xfail:
            expected = raises.get(name) if isinstance(raises, dict) else raises
            marks.append(pytest.mark.xfail(strict=True, raises=expected, reason=f"{name} way: {xfail[name]}"))
        # A DMA mode is the tpu_interpret way's alone: a Mosaic module has none, so the others run once.
        split = (engine_named(name).dma_modes if dma else ()) or (None,)
        for way in (Way(name, dma=mode, ours_only=op) for mode in split):
            params.append(pytest.param(way, marks=marks, id=way.id))
    return params


def skip_way(name: str, reason: str, ids=()):
    """A mark: the test (run ``every_way()``) does not apply to way ``name``; ``ids``: only
    its parametrizations with one of these ids (e.g. ``"bfloat16"``)."""
    assert name in REGISTRY, f"no such way: {name!r} (ways: {tuple(REGISTRY)})"
    return pytest.mark.skip_way(name, reason=reason, ids=tuple(ids))


def xfail_way(name: str, reason: str, raises=None, ids=()):
    """A mark: way ``name`` has a gap this test shows (a strict xfail, ``raises`` expected);
    ``ids``: only in the test's parametrizations with one of these ids (e.g. ``"bfloat16"``)."""
    assert name in REGISTRY, f"no such way: {name!r} (ways: {tuple(REGISTRY)})"
    return pytest.mark.xfail_way(name, reason=reason, raises=raises, ids=tuple(ids))


def compile_op(f, args, chips=None) -> None:
    """The compiled way's compile of ``f(*args)`` without its run (``compiled.compile_op``: an
    op at a size too large to run; on a TPU, for the chip there); skips without libtpu."""
    Way("compiled").skip_if_missing()
    from .compiled import compile_op as compile_

    compile_(f, args, chips)
