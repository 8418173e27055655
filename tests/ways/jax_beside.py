"""JAX's lowering beside ours: the engine the compiled way runs a test body with first, where it
is wanted (``wanted``), so each kernel of the body is also traced by JAX's Pallas, lowered by
JAX's Mosaic lowering and compiled.

It compares nothing itself and asserts nothing: the body's checks of its outputs (zeros of
the right shapes) are not the test's outcome, which is ours' run after it. What it gives:

* off a TPU, JAX's lowering of each kernel compiled for each chip of ``compiled.COMPILE_CHIPS``,
  the outcome (compiled, refused by Mosaic, refused by JAX's lowering) and LLO counts recorded
  beside ours' (tests/tpu/conftest.py's summary: what compiles from ours only;
  benchmarks/tpu_llo.py: our LLO ops against JAX's, kernel by kernel);
* on a chip (``chip.py``) and into a chip bundle, JAX's kernels, kept (``Kept``) in the order
  the body runs them, for ours' run to take each beside its own: the chip runs JAX's on ours'
  inputs and reports how far the two are apart; the bundle exports both.

Wanted on a chip (its run beside ours is the agreement the chip reports), into a chip bundle
(``PALLAS_TPU_CHIP_BUNDLE``), and where ``PALLAS_TPU_JAX_BESIDE=1`` asks for the counts
(benchmarks/tpu_llo.py). Elsewhere (CI) not: its outcome is recorded, never asserted, and running
the test body a second time doubled the way's cost. An op's way (``Way.ours_only``) runs nothing
here: its kernels are written against our modules.
"""

from __future__ import annotations

import os

import jax
import pytest

from .machine import ON_CHIP
from .mosaic import MosaicEngine


def wanted() -> bool:
    """Whether the compiled way runs a test body with JAX's lowering beside ours first."""
    return (
        ON_CHIP
        or bool(os.environ.get("PALLAS_TPU_CHIP_BUNDLE"))
        or os.environ.get("PALLAS_TPU_JAX_BESIDE") == "1"
    )


class Kept:
    """JAX's kernels of one test body (each a function of ours' inputs), in the order the
    body runs them: ours' run of the same body takes the next one beside each of its own."""

    def __init__(self):
        self._kernels = []

    def keep(self, f) -> None:
        self._kernels.append(f)

    def take(self):
        """JAX's kernel beside the one ours runs now (None: JAX's run did not get that far)."""
        return self._kernels.pop(0) if self._kernels else None


class JaxBesideEngine(MosaicEngine):
    name = "compiled"  # the compiled way's test: its body's first run
    jax_lowering = True
    beside = True
    runs_ops = False

    def modules(self, way):
        from .jax_mosaic import jax_namespaces

        return jax_namespaces()

    def check(self, way, closed) -> None:
        """JAX's kernels: its lowering refuses what it refuses (recorded as its outcome)."""

    def execute(self, way, f, args, closed, shapes):
        """JAX's lowering of ``f`` compiled for each chip (off a chip), kept where ours' run
        takes it; the outputs zeros of their shapes."""
        from .compiled import compile_for_chips

        bundled = way.num_cores == 1 and way.chip is None and os.environ.get("PALLAS_TPU_CHIP_BUNDLE")
        if way.kept is not None and (ON_CHIP or bundled):
            way.kept.keep(f)
        if not ON_CHIP:
            compile_for_chips(f, args, "jax", num_cores=way.num_cores, only=way.chip)
        return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes)

    def run_sharded(self, way, f, x, shape, names, spec, input_output_aliases):
        """JAX's sharded kernel compiled for each chip (not on a chip: ours is not run there)."""
        from .compiled import compile_for_chips

        if ON_CHIP:
            pytest.skip("a sharded kernel compiles for compile-only TPUs: done on the CPU, not on a chip")
        compile_for_chips(f, [x], "jax", mesh=shape, spec=spec)
        return x
