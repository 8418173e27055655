"""One kernel body, every way (DESIGN.md, "Tests"): a pallas-core test kernel run
by each engine that can run it, from one parametrize line.

The ways (``WAYS``):

* ``core``: pallas-core's interpret mode, grid steps vectorized where they
  provably do not interact (``interpret=True``);
* ``core_steps``: the same, one grid step at a time
  (``pl.InterpretParams(vectorize=False)``), as JAX's ``interpret=True``;
* ``triton``: pallas-gpu's lowering to Triton source, run by Triton's
  interpreter on the CPU (``plgpu.InterpretParams()``);
* ``tpu_interpret``: pallas-tpu's TPU interpret mode (``pltpu.InterpretParams()``);
* ``mosaic``: pallas-tpu's Mosaic lowering of the kernel, exported for a TPU and
  executed by ``run_mosaic`` on the CPU (tests/tpu/three_way.py's helpers);
* ``jax_mosaic``: the same kernel body traced by JAX's own Pallas
  (``jax.experimental.pallas``), exported for a TPU and executed by ``run_mosaic``:
  a check that the executor follows Mosaic, not our lowering;
* ``compiled``: our lowering compiled by libtpu's Mosaic for compile-only TPUs
  (``three_way.COMPILE_CHIPS``; a refusal fails the test, its LLO counts recorded),
  then run as ``mosaic``; on a TPU (``three_way.ON_CHIP``) compiled and run on the chip.
  On a chip, into a chip bundle, and with ``PALLAS_TPU_JAX_BESIDE=1`` (benchmarks/tpu_llo.py
  sets it; CI does not: ``three_way.jax_beside_wanted``), JAX's lowering of the same body is
  compiled beside it (its outcome and LLO counts recorded, never asserted): tests/conftest.py
  runs the test body once first with ``Way("compiled", beside=True)``, whose modules are
  JAX's and whose kernels are compiled (on a chip: kept to run beside ours), not run.

``@every_way()`` on a test (or a test class) parametrizes the ``way`` fixture
(tests/conftest.py) with a :class:`Way` each: ``DEFAULT_WAYS`` (the engines that run a
pallas-core kernel); ``every_way(tpu=True)`` the four TPU ways (``TPU_WAYS``) of a TPU
kernel; ``every_way(tpu=True, dma=True)`` those with the ``tpu_interpret`` way split by
its DMA execution mode (``tpu_interpret:on_wait``, ``tpu_interpret:eager``: a DMA mode
means nothing to a Mosaic module, so the Mosaic ways run once). ``way.with_params(
num_cores=2, **interpret_params)`` is the same way over a chip's two TensorCores
(``num_cores_or_threads`` in the interpret way; modules exported for a megacore chip and
``run_mosaic(num_cores=2)`` in the Mosaic ways, compiled for ``three_way.MEGACORE_CHIPS``
too) and with those ``pltpu.InterpretParams`` in the ``tpu_interpret`` way;
``way.with_params(chip="v6e")`` the same way for one chip generation (a kernel that reads the
chip's MXU: its model in the interpret way, the module exported under that chip's abstract
device, compiled for it alone, on a TPU run only by that generation).
``every_way(op=True)`` runs an op of ``pallas_tpu.ops`` its three ways (``WAYS_OF_AN_OP``:
``tpu_interpret``, ``mosaic``, ``compiled``; its kernels are written against our modules, so
``jax_mosaic`` does not apply and the compiled way compiles our lowering only, recording
nothing) by ``way.op(op, *args, **kw)`` (``op`` a public function that takes ``interpret=``)
or ``way.jit(f)`` (``f`` a function of ops); ``compile_op(f, args)`` is the compiled way's
compile alone (a size too large to run). On a TPU the
compiled way rounds as the chip does: a test's reference or tolerance goes through
``way.mxu_operand(x)``, ``way.chip_flushed(x)``, ``way.dot_tol(tol)`` or
``way.chip_tol(tol, floor)`` (each its argument itself anywhere else).
A kernel body that uses ``pl``/``pltpu`` takes them from the way
(``pl, pltpu = way.modules()``): JAX's in the ``jax_mosaic`` way, ours elsewhere.
A ``PallasTest`` (tests/core) needs nothing more: its ``self.pallas_call`` is pointed
at ``way.pallas_call``. Another test takes ``way`` and calls ``way.pallas_call(kernel, out_shape, ...)`` where it
would call ``pl.pallas_call(..., interpret=...)``, and ``way.jit(f)`` where it would
call ``jax.jit(f)`` on a function of such calls (a function that calls ``pallas_call``
itself, an example's, passes it ``**way.call_kwargs()``; a kernel written as
``fn(pl, pltpu, *arrays, interpret=..., **kw)`` runs by ``way.call(fn, *arrays, **kw)``;
``way.run_sharded(f, x, n)`` runs one ``pallas_call`` per device over ``n`` devices)::

    @every_way()
    class TestThings(PallasTest): ...

    @every_way(xfail={"triton": "why"}, skip={"mosaic": "why"})
    def test_add(way): ...

    @every_way(tpu=True, skip={"jax_mosaic": "JAX's lowering has no rule for sort"})
    def test_sort(way):
        pl, pltpu = way.modules()
        ...

    @skip_way("triton", "why")  # a method run every_way() (or of a class run so)
    @xfail_way("mosaic", "why", raises=ValueError)

A way skips, with the reason, when its package (or Triton, JAX's Pallas, libtpu) is not
installed, and when the kernel does not apply to it: a TPU way on a kernel no TPU runs
(blocks that break its tiling rules, HBM read without a DMA: the TPU's own
check says so, and tests/conftest.py turns that failure into a skip), the Mosaic way on a
``pallas_call`` applied under a JAX transformation other than ``way.jit`` (``run_mosaic``
runs a module on concrete arrays; ``way.jit(f)`` exports ``f`` whole, traced grid sizes
and all, and runs each of its kernels' modules; the interpret ways cover ``vmap``/``grad``). Anything
else a way fails on is a finding: a strict ``xfail`` with its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import math
import os
import re
import sys
import threading
from typing import Any

import jax
import numpy as np
import pytest

import pallas as pl

WAYS = ("core", "core_steps", "triton", "tpu_interpret", "mosaic", "jax_mosaic", "compiled")
DEFAULT_WAYS = WAYS[:5]  # every_way(): the TPU suites' jax_mosaic and compiled ways cost CI time
TPU_WAYS = ("tpu_interpret", "mosaic", "jax_mosaic", "compiled")
# every_way(op=True): the ways of an op of pallas_tpu.ops (its kernels are written against our
# modules: JAX's lowering of them, the jax_mosaic way, does not apply)
WAYS_OF_AN_OP = ("tpu_interpret", "mosaic", "compiled")
MOSAIC_WAYS = ("mosaic", "jax_mosaic", "compiled")  # run by run_mosaic (compiled: on the CPU)
INTERPRET_WAYS = ("core", "core_steps", "triton", "tpu_interpret")

# What the TPU's check (pallas-tpu's checks.py, run by both TPU ways) says of a
# kernel a TPU cannot run as written: the way does not apply to it.
_NOT_FOR_A_TPU = re.compile(
    r"a TPU needs the last two block dimensions|a rank-1 block must be the whole array"
    r"|a TPU reaches HBM by DMAs only"
)

_TPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu")


def _missing(*modules: str) -> str | None:
    """Why a way cannot run here (the first module that is not installed), or None."""
    for m in modules:
        if importlib.util.find_spec(m) is None:
            dist = {"pallas_gpu": "jax-pallas-gpu", "pallas_tpu": "jax-pallas-tpu"}.get(m, m)
            return f"needs {m} (pip install {dist})"
    return None


@dataclasses.dataclass(frozen=True)
class Way:
    """One way of running a ``pallas_call``: ``pallas_call`` is ``pl.pallas_call``
    run that way (the same arguments, no ``interpret=``)."""

    name: str
    # The compiled way's run of a test body with JAX's modules, before its own run:
    # its kernels are compiled (on a chip: kept for ours to run beside), never run.
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
    # ``three_way.DEVICE_KINDS``; None: any): modelled by the tpu_interpret way
    # (``chip_version``), exported for it by the Mosaic ways, compiled for it alone.
    chip: str | None = None

    def __str__(self) -> str:
        return self.id

    @property
    def id(self) -> str:
        """The test id: the name, and the DMA mode of a split ``tpu_interpret`` way."""
        return f"{self.name}:{self.dma}" if self.dma else self.name

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

    def _interpret_params(self) -> dict:
        """``pltpu.InterpretParams``' arguments in the tpu_interpret way."""
        params = {"dma_execution_mode": self.dma} if self.dma else {}
        if self.num_cores != 1:
            params["num_cores_or_threads"] = self.num_cores
        if self.chip is not None:
            params["chip_version"] = self.chip
        return {**params, **dict(self.params)}

    @property
    def jax_lowering(self) -> bool:
        """Whether kernels are traced by JAX's Pallas (``jax_mosaic``, and the compiled way's
        run beside ours): what a test that picks its source by lowering (an example) reads."""
        return self.name == "jax_mosaic" or self.beside

    @property
    def tpu(self) -> bool:
        return self.name in TPU_WAYS

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
        self.skip_if_missing()
        if self.jax_lowering:
            from jax.experimental import pallas as jpl
            from jax.experimental.pallas import tpu as jpltpu

            return jpl, jpltpu
        import pallas_tpu as pltpu

        return pl, pltpu

    def interpret(self) -> Any:
        """What ``pallas_call(interpret=...)`` gets in an interpret way (None: a Mosaic way)."""
        if self.name == "core":
            return True
        if self.name == "core_steps":
            return pl.InterpretParams(vectorize=False)
        if self.name == "triton":
            import pallas_gpu as plgpu

            return plgpu.InterpretParams()
        if self.name == "tpu_interpret":
            import pallas_tpu as pltpu

            return pltpu.InterpretParams(**self._interpret_params())
        return None

    def skip_if_missing(self) -> None:
        """Skips the test when this way's package (or Triton) is not installed."""
        why = {
            "triton": _missing("triton", "pallas_gpu"),
            "tpu_interpret": _missing("pallas_tpu"),
            "mosaic": _missing("pallas_tpu"),
            "jax_mosaic": _missing("pallas_tpu", "jax.experimental.pallas.tpu"),
            "compiled": _missing("pallas_tpu", "libtpu"),
        }.get(self.name)
        if self.name == "compiled" and why and "libtpu" in why:
            why = 'needs libtpu (pip install "jax[tpu]")'
        if why:
            pytest.skip(f"the {self.name} way {why}")

    def pallas_call(self, kernel, out_shape, **kwargs):
        """``pl.pallas_call(kernel, out_shape, **kwargs)`` run this way."""
        self.skip_if_missing()
        if self.name in MOSAIC_WAYS:
            kwargs.pop("interpret", None)
            f = self.pl.pallas_call(kernel, out_shape, **kwargs)
            # Inside ``way.jit``'s function the call is lowered with it; alone it is run now.
            return lambda *args: f(*args) if _whole_function.active else self._run(f, args)
        kwargs.setdefault("interpret", self.interpret())
        return pl.pallas_call(kernel, out_shape, **kwargs)

    def call_kwargs(self) -> dict:
        """What a function that calls ``pallas_call`` itself (an example's ``call_kwargs``)
        passes to it to run this way: ``interpret=`` in an interpret way, nothing in a Mosaic way."""
        return {} if self.name in MOSAIC_WAYS else {"interpret": self.interpret()}

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
        assert self.name in WAYS_OF_AN_OP, f"an op runs the ways {WAYS_OF_AN_OP}, not {self.name}"
        if self.name == "tpu_interpret":
            return op(*args, interpret=self.interpret(), **kw)
        return self.jit(lambda *a: op(*a, **kw))(*args)

    def jit(self, f):
        """``jax.jit(f)`` run this way, ``f`` a function of ``way.pallas_call``s: the Mosaic
        way exports ``f`` whole for a TPU (a traced grid size, an enclosing function's
        arrays captured by a kernel: as a TPU gets them) and runs each kernel's module by
        ``run_mosaic`` in its place."""
        if self.name == "tpu_interpret":
            return self._forced(jax.jit(f))
        if self.name not in MOSAIC_WAYS:
            return jax.jit(f)

        def run(*args):
            with _whole_function():
                return self._run(f, args)

        return run

    def _forced(self, f):
        """``f`` with every ``pallas_call`` that passes no ``interpret`` (or False) run in TPU
        interpret mode with this way's params (``pltpu.force_tpu_interpret_mode``)."""
        import pallas_tpu as pltpu

        def run(*args):
            with pltpu.force_tpu_interpret_mode(self.interpret()):
                return f(*args)

        return run

    def run_sharded(self, f, x, num_devices, input_output_aliases=()):
        """``f`` (one ``pallas_call`` per device, made with ``way.pallas_call``) ``shard_map``ped
        over ``num_devices`` devices on the leading axis of ``x`` (an int, axis ``"x"``, or a
        mesh shape whose axes ``("x", "y", ...)`` all shard it, row-major), the outputs concatenated along it: CPU devices in
        the interpret ways, ``run_mosaic`` over that many TPUs in the Mosaic ways (the compiled
        way compiles the sharded kernel for each chip first); ``input_output_aliases``: the
        kernel's, for ``run_mosaic``."""
        from jax.sharding import PartitionSpec as P

        tw = _three_way()
        shape = (num_devices,) if isinstance(num_devices, int) else tuple(num_devices)
        names = ("x", "y", "z", "w")[: len(shape)]
        spec = P(names[0]) if len(shape) == 1 else P(names)
        with _whole_function():
            if self.name not in MOSAIC_WAYS:
                n = math.prod(shape)
                mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]).reshape(shape), names)
                g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
                return self._forced(g)(x) if self.name == "tpu_interpret" else g(x)
            if self.name == "compiled":
                if tw.ON_CHIP:
                    pytest.skip(
                        "a sharded kernel compiles for compile-only TPUs: done on the CPU, not on a chip"
                    )
                _compile_for_chips(f, [x], "jax" if self.beside else "ours", mesh=shape, spec=spec)
                if self.beside:
                    return x
            return tw.run_sharded_with_mosaic(f, x, shape, input_output_aliases)

    def _run(self, f, args):
        """``f(*args)`` run this Mosaic way (a ``pallas_call``, or ``way.jit``'s function)."""
        tw = _three_way()
        _skip_under_a_transformation(args)
        if self.beside:
            return _beside_ours(f, args, self.num_cores, self.chip)
        record = _unrecorded if self.ours_only else None
        if self.name == "compiled" and tw.ON_CHIP:
            return _run_on_chip(f, args, self.num_cores, record, self.chip)
        if self.name == "compiled":
            _compile_for_chips(f, args, "ours", num_cores=self.num_cores, record=record, only=self.chip)
        outs = _run_with_mosaic(f, args, self.num_cores, self.chip)
        if (
            self.name == "compiled"
            and self.num_cores == 1
            and self.chip is None
            and os.environ.get("PALLAS_TPU_CHIP_BUNDLE")
        ):
            _add_to_chip_bundle(f, args, outs)
        return outs

    # What a kernel run this way computes where it differs from the host's arithmetic: the
    # compiled way on a TPU (three_way.ON_CHIP) rounds and flushes as the chip does; anywhere
    # else each of these is its argument itself (three_way's functions, by way name).

    def mxu_operand(self, x):
        """``x`` as a matmul kernel run this way multiplies it (on the chip: float32 rounded
        to bfloat16), for the test's reference."""
        return _three_way().mxu_operand(x, self.name)

    def chip_flushed(self, x):
        """``x`` with float32 subnormals flushed to signed zero where the kernel ran on the chip."""
        return _three_way().chip_flushed(x, self.name)

    def dot_tol(self, tol: float, dtype=np.float32, grads: bool = False) -> float:
        """``tol`` for a kernel of chained matmuls of ``dtype`` operands, or the bf16 tolerance
        where it runs on the chip (``grads``: of an attention backward)."""
        return _three_way().dot_tol(tol, self.name, dtype, grads)

    def chip_tol(self, tol: float, floor: float) -> float:
        """``tol``, or ``floor`` where the kernel runs on the chip (its exp and log units)."""
        return _three_way().chip_tol(tol, self.name, floor)

    def not_applicable(self, error: BaseException) -> str | None:
        """Why this way does not apply to a kernel that failed with ``error``: the
        TPU ways refuse, by the TPU's own check, a kernel no TPU runs (None: a finding)."""
        if self.tpu and _NOT_FOR_A_TPU.search(str(error)):
            return f"not a TPU kernel ({self.name} way): {str(error).splitlines()[0]}"
        return None


class _WholeFunction(threading.local):
    """Set while ``Way.jit`` traces its function in the Mosaic way: its ``pallas_call``s are
    lowered with it, not run alone."""

    active = False

    @contextlib.contextmanager
    def __call__(self):
        self.active, before = True, self.active
        try:
            yield
        finally:
            self.active = before


_whole_function = _WholeFunction()


def _three_way():
    if _TPU_DIR not in sys.path:
        sys.path.insert(0, _TPU_DIR)
    import three_way

    return three_way


def _skip_under_a_transformation(args):
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        pytest.skip(
            "a Mosaic way runs a pallas_call on concrete arrays (or a function of them: way.jit),"
            " not under vmap, grad or a jit of its own"
        )


def _run_with_mosaic(f, args, num_cores=1, chip=None):
    """``f(*args)`` (one ``pallas_call``, or a function of them: ``Way.jit``) with the kernels
    lowered to Mosaic, exported for a TPU (of ``num_cores`` TensorCores; ``chip``'s generation)
    and each run by ``run_mosaic``."""
    _skip_under_a_transformation(args)
    tw = _three_way()
    with jax.sharding.use_abstract_mesh(tw.abstract_mesh(num_cores, chip)):
        shapes = jax.eval_shape(f, *args)
    # run_mosaic gives NumPy arrays
    outs = [jax.numpy.asarray(x) for x in tw.run_with_mosaic(f, *args, num_cores=num_cores, chip=chip)]
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def _compile_for_chips(f, args, lowering, mesh=None, spec=None, num_cores=1, record=None, only=None):
    """The compiled way: ``f(*args)`` (``lowering``: "ours", or "jax" beside it) compiled by
    libtpu's Mosaic for each of ``three_way.COMPILE_CHIPS`` (and ``MEGACORE_CHIPS`` for a
    kernel over ``num_cores=2``; ``only``, one chip, where the kernel is written for it) on the
    CPU, outcomes and LLO counts recorded (``record``: ``three_way.record_compile`` by
    default); Mosaic's refusal of ours fails the test (a chip's generation gap is recorded,
    not raised)."""
    tw = _three_way()
    megacore = tw.MEGACORE_CHIPS if num_cores == 2 else ()
    for chip in (only,) if only else dict.fromkeys(tw.COMPILE_CHIPS + megacore):
        if lowering == "jax":
            keep = lambda *row, chip=chip: _jax_compiles.setdefault(chip, []).append(row)  # noqa: E731
            tw.compile_for_chip(f, args, chip, lowering, mesh, spec, record=keep)
            continue
        refused = tw.compile_for_chip(f, args, chip, lowering, mesh, spec, record=record)
        if _jax_compiles.get(chip):
            tw.record_compile(*_jax_compiles[chip].pop(0))
        if refused is not None:
            raise refused


# JAX's compile outcomes from the compiled way's run beside ours, per chip in program order:
# each recorded once ours of the same kernel has compiled (or been refused) for that chip,
# as three_way.compile_both recorded them (none where our lowering fails first).
_jax_compiles: dict[str, list] = {}


# JAX's lowerings of the kernels of the test body the compiled way runs beside ours on a
# chip or adds to a chip bundle beside ours, in program order (``_beside_ours`` adds them,
# ``_run_on_chip`` and ``_add_to_chip_bundle`` take them, on ours' inputs).
_jax_beside: list = []


def _beside_ours(f, args, num_cores=1, chip=None):
    """The compiled way's run beside ours (``Way.beside``): ``f``, traced by JAX's Pallas,
    compiled for each chip (on a chip: kept to run beside ours on ours' inputs); the
    outputs zeros of their shapes (the body's checks of them are not asserted)."""
    tw = _three_way()
    if tw.ON_CHIP or (num_cores == 1 and chip is None and os.environ.get("PALLAS_TPU_CHIP_BUNDLE")):
        _jax_beside.append(f)
    if not tw.ON_CHIP:
        _compile_for_chips(f, args, "jax", num_cores=num_cores, only=chip)
    with jax.sharding.use_abstract_mesh(tw.abstract_mesh(num_cores, chip)):
        shapes = jax.eval_shape(f, *args)
    return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)


def compile_jax_beside(item) -> None:
    """The compiled way's test ``item`` run once with ``Way("compiled", beside=True)``
    (tests/conftest.py calls it before the test's own run): JAX's lowering of each kernel
    compiled beside ours, its outcome recorded; what the body then asserts, or raises, or
    skips is not the test's outcome. Done where its outcome is read
    (``three_way.jax_beside_wanted``); an op's way (``Way.ours_only``) runs nothing here."""
    _jax_beside.clear()
    _jax_compiles.clear()
    if item.funcargs["way"].ours_only or not _three_way().jax_beside_wanted():
        return
    args = {name: item.funcargs[name] for name in inspect.signature(item.obj).parameters}
    args["way"] = dataclasses.replace(args["way"], beside=True)
    try:
        item.obj(**args)
    except (Exception, pytest.skip.Exception, pytest.xfail.Exception, pytest.fail.Exception):
        pass


def compile_op(f, args, chips=None) -> None:
    """The compiled way's compile of ``f(*args)`` (a function of ops of ``pallas_tpu.ops``;
    ``args`` may be ``jax.ShapeDtypeStruct``s) without its run: libtpu compiles our lowering
    for each chip of ``three_way.COMPILE_CHIPS`` under that chip's abstract mesh (so the op
    picks its blocks for that chip; a refusal fails the test); on a TPU, for the chip there.
    For a size too large to run (the blocks an op chooses at scale); ``chips``: for these
    compile-only chips on any machine (``f`` and ``args`` made for them: over a mesh of the
    chip's devices)."""
    Way("compiled").skip_if_missing()
    tw = _three_way()
    if tw.ON_CHIP and chips is None:
        jax.jit(f).lower(*tw.to_chip(args)).compile()
        return
    for chip in chips or tw.COMPILE_CHIPS:
        refused = tw.compile_for_chip(f, list(args), chip, "ours", record=_unrecorded)
        if refused is not None:
            raise refused


def _unrecorded(*row, **extra) -> None:
    """An op's compiles and chip runs (``Way.ours_only``): the compile report and its summary
    compare our lowering with JAX's of the same kernel, which an op's kernels have not."""


def _run_on_chip(f, args, num_cores=1, record=None, chip=None):
    """The compiled way on a TPU (``three_way.ON_CHIP``): our lowering of ``f`` compiled and
    run on the chip, the outputs brought back to the host; JAX's lowering of the same kernel
    (``compile_jax_beside``) run beside it on the same inputs, the difference recorded. A
    kernel over more TensorCores than the chip has, or written for another generation
    (``chip``), skips. ``record``: what records the run (``three_way.record_compile`` by default)."""
    tw = _three_way()
    record = record or tw.record_compile
    theirs = _jax_beside.pop(0) if _jax_beside else None
    if chip is not None and tw.DEVICE_KINDS[chip] != jax.devices()[0].device_kind:
        pytest.skip(f"a kernel for a TPU {chip}; this chip is a {jax.devices()[0].device_kind}")
    chip_cores = getattr(jax.devices()[0], "num_cores", 1) or 1
    if num_cores > chip_cores:
        pytest.skip(
            f"needs a TPU with {num_cores} TensorCores; {jax.devices()[0].device_kind} has {chip_cores}"
        )
    args = tw.to_chip(args)
    with jax.default_device(jax.devices("tpu")[0]), _whole_function():  # a kernel of no arguments too
        try:
            ours = jax.block_until_ready(jax.jit(f)(*args))
        except Exception as e:
            # Which lowering the chip's Mosaic refuses: ours only, or JAX's too (the chip's
            # libtpu lacks the feature)? Recorded, then ours' error fails the test (a strict
            # xfail of old libtpu's refusal expects a MosaicCompileError, as on the CPU).
            theirs_outcome = "not built"
            if theirs is not None:
                try:
                    jax.block_until_ready(jax.jit(theirs)(*args))
                    theirs_outcome = "ran"
                except Exception as e2:
                    theirs_outcome = f"failed ({tw.first_line(e2)})"
            agreement = f"ours failed ({tw.first_line(e)}); JAX's: {theirs_outcome}"
            record("chip", "ours", "failed", None, agreement=agreement)
            if "Mosaic failed to compile" in str(e):
                from pallas_tpu._src.mosaic.compile_check import MosaicCompileError

                raise MosaicCompileError.from_libtpu(e, jax.devices()[0].device_kind, []) from e
            raise
        agreement = "JAX's not built"
        try:
            if theirs is not None:
                agreement = tw.chip_agreement(ours, jax.block_until_ready(jax.jit(theirs)(*args)))
        except Exception as e:  # JAX's lowering refuses the kernel, or Mosaic refuses JAX's module
            agreement = f"JAX's failed: {tw.first_line(e)}"
    record("chip", "ours", "ran", None, agreement=agreement)
    return jax.device_get(ours)


def _add_to_chip_bundle(f, args, outs):
    """With ``PALLAS_TPU_CHIP_BUNDLE=DIR`` the compiled way adds its kernel (our lowering and
    JAX's, the inputs as constants, ``run_mosaic``'s outputs of ours as the reference) to the
    bundle in DIR, as ``three_way._add_to_chip_bundle`` does."""
    import chip_bundle

    tw = _three_way()
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    jax_f = _jax_beside.pop(0) if _jax_beside else None

    def ours():
        with _whole_function():
            return f(*args)

    def theirs():
        with _whole_function():
            return jax_f(*args)

    chip_bundle.add(
        os.environ["PALLAS_TPU_CHIP_BUNDLE"],
        test,
        ours,
        jax.tree.leaves(outs),
        theirs=theirs if jax_f is not None else None,
        context=lambda: jax.sharding.use_abstract_mesh(tw.TPU_V5E),
    )


DMA_MODES = ("on_wait", "eager")  # the tpu_interpret way's, split by every_way(dma=True)


def every_way(*, skip=None, xfail=None, raises=None, only=None, tpu=False, dma=False, op=False):
    """``pytest.mark.parametrize("way", ...)`` over ``DEFAULT_WAYS`` (``TPU_WAYS`` with
    ``tpu``, ``WAYS_OF_AN_OP`` with ``op``; or ``only`` of ``WAYS``): ``way_params``' list.
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
      only: the ways to run (default: ``DEFAULT_WAYS``).
      tpu: a TPU kernel: the ways are ``TPU_WAYS``.
      op: an op of ``pallas_tpu.ops`` (run by ``way.op``), or another kernel written against
        our modules only (names JAX lacks): the ways are ``WAYS_OF_AN_OP``, each ``ours_only``
        (no JAX lowering compiled beside ours, nothing recorded).
      dma: the ``tpu_interpret`` way once per DMA execution mode (``DMA_MODES``; a
        ``skip``/``xfail`` of ``"tpu_interpret"`` marks both).
    """
    skip, xfail = skip or {}, xfail or {}
    unknown = (set(skip) | set(xfail) | set(only or ())) - set(WAYS)
    assert not unknown, f"no such ways: {sorted(unknown)} (ways: {WAYS})"
    params = []
    for name in only or (WAYS_OF_AN_OP if op else TPU_WAYS if tpu else DEFAULT_WAYS):
        marks = []
        if name in skip:
            marks.append(pytest.mark.skip(reason=f"{name} way: {skip[name]}"))
        if name in xfail:
            expected = raises.get(name) if isinstance(raises, dict) else raises
            marks.append(pytest.mark.xfail(strict=True, raises=expected, reason=f"{name} way: {xfail[name]}"))
        split = DMA_MODES if dma and name == "tpu_interpret" else (None,)
        for way in (Way(name, dma=mode, ours_only=op) for mode in split):
            params.append(pytest.param(way, marks=marks, id=way.id))
    return params


def skip_way(name: str, reason: str, ids=()):
    """A mark: the test (run ``every_way()``) does not apply to way ``name``; ``ids``: only
    its parametrizations with one of these ids (e.g. ``"bfloat16"``)."""
    assert name in WAYS, f"no such way: {name!r} (ways: {WAYS})"
    return pytest.mark.skip_way(name, reason=reason, ids=tuple(ids))


def xfail_way(name: str, reason: str, raises=None, ids=()):
    """A mark: way ``name`` has a gap this test shows (a strict xfail, ``raises`` expected);
    ``ids``: only in the test's parametrizations with one of these ids (e.g. ``"bfloat16"``)."""
    assert name in WAYS, f"no such way: {name!r} (ways: {WAYS})"
    return pytest.mark.xfail_way(name, reason=reason, raises=raises, ids=tuple(ids))
