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
  executed by ``run_mosaic`` on the CPU (tests/tpu/three_way.py's helpers).

``@every_way()`` on a test (or a test class) parametrizes the ``way`` fixture
(tests/conftest.py) with a :class:`Way` each. A ``PallasTest`` (tests/core) needs
nothing more: its ``self.pallas_call`` is pointed at ``way.pallas_call``. Another
test takes ``way`` and calls ``way.pallas_call(kernel, out_shape, ...)`` where it
would call ``pl.pallas_call(..., interpret=...)``, and ``way.jit(f)`` where it would
call ``jax.jit(f)`` on a function of such calls::

    @every_way()
    class TestThings(PallasTest): ...

    @every_way(xfail={"triton": "why"}, skip={"mosaic": "why"})
    def test_add(way): ...

    @skip_way("triton", "why")  # a method run every_way() (or of a class run so)
    @xfail_way("mosaic", "why", raises=ValueError)

A way skips, with the reason, when its package (or Triton) is not installed,
and when the kernel does not apply to it: a TPU way on a kernel no TPU runs
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
import os
import re
import sys
import threading
from typing import Any

import jax
import pytest

import pallas as pl

WAYS = ("core", "core_steps", "triton", "tpu_interpret", "mosaic")
TPU_WAYS = ("tpu_interpret", "mosaic")
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

    def __str__(self) -> str:
        return self.name

    @property
    def tpu(self) -> bool:
        return self.name in TPU_WAYS

    def interpret(self) -> Any:
        """What ``pallas_call(interpret=...)`` gets in an interpret way (None: the Mosaic way)."""
        if self.name == "core":
            return True
        if self.name == "core_steps":
            return pl.InterpretParams(vectorize=False)
        if self.name == "triton":
            import pallas_gpu as plgpu

            return plgpu.InterpretParams()
        if self.name == "tpu_interpret":
            import pallas_tpu as pltpu

            return pltpu.InterpretParams()
        return None

    def skip_if_missing(self) -> None:
        """Skips the test when this way's package (or Triton) is not installed."""
        why = {
            "triton": _missing("triton", "pallas_gpu"),
            "tpu_interpret": _missing("pallas_tpu"),
            "mosaic": _missing("pallas_tpu"),
        }.get(self.name)
        if why:
            pytest.skip(f"the {self.name} way {why}")

    def pallas_call(self, kernel, out_shape, **kwargs):
        """``pl.pallas_call(kernel, out_shape, **kwargs)`` run this way."""
        self.skip_if_missing()
        if self.name == "mosaic":
            kwargs.pop("interpret", None)
            f = pl.pallas_call(kernel, out_shape, **kwargs)
            # Inside ``way.jit``'s function the call is lowered with it; alone it is run now.
            return lambda *args: f(*args) if _whole_function.active else _run_with_mosaic(f, args)
        kwargs.setdefault("interpret", self.interpret())
        return pl.pallas_call(kernel, out_shape, **kwargs)

    def jit(self, f):
        """``jax.jit(f)`` run this way, ``f`` a function of ``way.pallas_call``s: the Mosaic
        way exports ``f`` whole for a TPU (a traced grid size, an enclosing function's
        arrays captured by a kernel: as a TPU gets them) and runs each kernel's module by
        ``run_mosaic`` in its place."""
        if self.name != "mosaic":
            return jax.jit(f)

        def run(*args):
            with _whole_function():
                return _run_with_mosaic(f, args)

        return run

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


def _run_with_mosaic(f, args):
    """``f(*args)`` (one ``pallas_call``, or a function of them: ``Way.jit``) with the kernels
    lowered to Mosaic, exported for a TPU and each run by ``run_mosaic``."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        pytest.skip(
            "the mosaic way runs a pallas_call on concrete arrays (or a function of them: way.jit),"
            " not under vmap, grad or a jit of its own"
        )
    tw = _three_way()
    with jax.sharding.use_abstract_mesh(tw.TPU_V5E):
        shapes = jax.eval_shape(f, *args)
    outs = [jax.numpy.asarray(x) for x in tw.run_with_mosaic(f, *args)]  # run_mosaic gives NumPy arrays
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def every_way(*, skip=None, xfail=None, raises=None, only=None):
    """``pytest.mark.parametrize("way", ...)`` over ``WAYS`` (or ``only`` of them).

    Args:
      skip: ``{way: reason}``: the kernel does not apply to that way.
      xfail: ``{way: reason}``: a gap that way has (a strict xfail; ``raises``
        the exception expected).
      only: the ways to run (default: all).
    """
    skip, xfail = skip or {}, xfail or {}
    unknown = (set(skip) | set(xfail) | set(only or ())) - set(WAYS)
    assert not unknown, f"no such ways: {sorted(unknown)} (ways: {WAYS})"
    params = []
    for name in only or WAYS:
        marks = []
        if name in skip:
            marks.append(pytest.mark.skip(reason=f"{name} way: {skip[name]}"))
        if name in xfail:
            marks.append(pytest.mark.xfail(strict=True, raises=raises, reason=f"{name} way: {xfail[name]}"))
        params.append(pytest.param(Way(name), marks=marks, id=name))
    return pytest.mark.parametrize("way", params, indirect=True)


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
