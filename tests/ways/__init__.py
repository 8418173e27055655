"""One kernel body, every way (ARCHITECTURE.md, "Tests"): a test kernel run by each engine that can run
it, from one parametrize line. Each way is an engine behind one small interface (``engine.py``'s
``Engine``), one module each:

=================  ===================  ===================================================
way (test id)      module               runs the kernel by / compares
=================  ===================  ===================================================
``core``           ``core.py``          pallas-core's interpret mode, grid steps vectorized
                                        where they provably do not interact; against ``jnp``
``core_steps``     ``core.py``          the same, one grid step at a time (as JAX's
                                        ``interpret=True``); against ``jnp``
``triton``         ``triton.py``        pallas-gpu's lowering to Triton, run by Triton's
                                        interpreter on the CPU; against ``jnp``
``tpu_interpret``  ``tpu_interpret.py`` pallas-tpu's TPU interpret mode (split by DMA
                                        execution mode with ``dma=True``); against ``jnp``
``mosaic``         ``mosaic.py``        our Mosaic lowering, exported for a TPU and run by
                                        ``run_mosaic`` on the CPU; against ``jnp``
``jax_mosaic``     ``jax_mosaic.py``    JAX's Pallas and Mosaic lowering of the same body,
                                        run by ``run_mosaic``; against ``jnp`` (the executor
                                        follows Mosaic, not our lowering)
``compiled``       ``compiled.py``      our lowering compiled by libtpu for compile-only
                                        TPUs (a refusal fails; LLO counts recorded), then
                                        run as ``mosaic``; against ``jnp``
                   ``jax_beside.py``    JAX's lowering beside ours (where wanted: on a chip,
                                        for a chip bundle, ``PALLAS_TPU_JAX_BESIDE=1``): the
                                        body run once first, JAX's kernels compiled and
                                        recorded (kept, on a chip), never asserted
``compiled``       ``chip.py``          on a TPU: our lowering compiled and run on the chip;
  (on a TPU)                            against ``jnp`` at the chip's rounding, and against
                                        JAX's lowering run beside it (recorded)
``gpu``            ``gpu.py``           the GPU suite's (tests/gpu): Triton's interpreter
                                        and a compile for sm_80/sm_90, or the GPU itself
                                        (``PALLAS_GPU_TESTS=gpu``); against ``jnp``
=================  ===================  ===================================================

Which ways a test runs is its decorator: ``@every_way()`` on a test (or a test class)
parametrizes the ``way`` fixture (tests/conftest.py) with a :class:`Way` each: ``DEFAULT_WAYS``
(the engines that run a pallas-core kernel: ``core``, ``core_steps``, ``triton``,
``tpu_interpret``, ``mosaic``); ``every_way(tpu=True)`` the four TPU ways (``TPU_WAYS``) of a
TPU kernel; ``every_way(tpu=True, dma=True)`` those with the ``tpu_interpret`` way split by its
DMA execution mode (``tpu_interpret:on_wait``, ``tpu_interpret:eager``); ``every_way(op=True)``
an op of ``pallas_tpu.ops`` its three ways (``WAYS_OF_AN_OP``: ``tpu_interpret``, ``mosaic``,
``compiled``; its kernels are written against our modules, so ``jax_mosaic`` does not apply and
nothing is compiled beside them); ``every_way(only=(...))`` those ways.

A test takes ``way`` and calls ``way.pallas_call(kernel, out_shape, ...)`` where it would call
``pl.pallas_call(..., interpret=...)``, ``way.jit(f)`` where it would call ``jax.jit(f)`` on a
function of such calls, ``way.op(op, *args, **kw)`` for an op (``op`` a public function that takes
``interpret=``), ``way.call(fn, *arrays, **kw)`` for a kernel written as ``fn(pl, pltpu, *arrays,
interpret=..., **kw)``, ``way.run_sharded(f, x, n)`` for one ``pallas_call`` per device over ``n``
devices; a function that calls ``pallas_call`` itself (an example's) passes it
``**way.call_kwargs()``; ``compile_op(f, args)`` is the compiled way's compile alone (a size too
large to run). A kernel body takes ``pl, pltpu = way.modules()`` (JAX's in ``jax_mosaic``, ours
elsewhere). A ``PallasTest`` (tests/core) needs nothing more: its ``self.pallas_call`` is pointed
at ``way.pallas_call``. ``way.with_params(num_cores=2, **interpret_params)`` is the same way over
a chip's two TensorCores (and those ``pltpu.InterpretParams`` in ``tpu_interpret``),
``way.with_params(chip="v6e")`` the same way for one chip generation. A test's reference or
tolerance goes through ``way.mxu_operand(x)``, ``way.chip_flushed(x)``, ``way.dot_tol(tol)`` or
``way.chip_tol(tol, floor)``: the chip's arithmetic on a TPU, the argument itself anywhere else::

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

Whether a way applies is decided before the run: a way skips, with the reason, when its package
(or Triton, JAX's Pallas, libtpu) is not installed; a TPU way skips a kernel no TPU runs (blocks
that break its tiling rules, an HBM Ref read without a DMA: ``tpu_check.py`` asks pallas-tpu's
own rules of each kernel before it runs, ``vmap``'s too); a Mosaic way skips a ``pallas_call`` applied under a JAX
transformation other than ``way.jit`` (``run_mosaic`` runs a module on concrete arrays; the
interpret ways cover ``vmap``/``grad``). Anything else a way fails on is a finding: a strict
``xfail`` with its reason.

The helpers of the TPU tests live with the engine they belong to: ``mosaic`` (``run_with_mosaic``,
``tpu_modules``, ``abstract_mesh``, ``TPU_V5E``), ``jax_mosaic`` (``jax_namespaces``, ``OLD_JAX``,
``tensorcore_mesh``, ``load_example``), ``compiled`` (``COMPILE_CHIPS``, ``compile_both``,
``chip_mesh``), ``chip`` (``ON_CHIP``, ``needs_devices``, ``chip_tol``, ...), ``compare``
(``close``, ``equal``); the GPU suite's in ``gpu``.
"""

from .tpu_interpret import DMA_MODES
from .way import (
    DEFAULT_WAYS,
    INTERPRET_WAYS,
    MOSAIC_WAYS,
    TPU_WAYS,
    WAYS,
    WAYS_OF_AN_OP,
    Way,
    compile_op,
    every_way,
    skip_way,
    way_params,
    xfail_way,
)

__all__ = [
    "DEFAULT_WAYS",
    "DMA_MODES",
    "INTERPRET_WAYS",
    "MOSAIC_WAYS",
    "TPU_WAYS",
    "WAYS",
    "WAYS_OF_AN_OP",
    "Way",
    "compile_op",
    "every_way",
    "skip_way",
    "way_params",
    "xfail_way",
]
