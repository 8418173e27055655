"""The ``compiled`` way (off a TPU): our Mosaic lowering compiled by libtpu's Mosaic compiler for
compile-only TPUs of several generations, then run as the ``mosaic`` way runs it.

Each kernel (a ``pallas_call``, a function of them, an op of ``pallas_tpu.ops`` under each chip's
abstract mesh, so the op picks its blocks for that chip) is checked for a TPU (``tpu_check``) and
compiled for each chip of ``COMPILE_CHIPS`` (``PALLAS_TPU_CHIPS``, comma-separated; v5e and v6e by
default; CI's ``tests_newest`` v4 and v5p), for ``MEGACORE_CHIPS`` too over ``num_cores=2``, for
``chip`` alone where the kernel is written for one generation. A refusal by Mosaic fails the test
with Mosaic's message (what a generation's hardware lacks, ``GENERATION_GAPS``, is recorded, not
raised); each compile's outcome and LLO counts are recorded (``record_compile``, summed by
tests/tpu/conftest.py, read by benchmarks/tpu_llo.py; an op's are not: ``Way.ours_only``). Then
the module the compiler took runs by ``run_mosaic`` and its outputs are compared with the test's
plain-``jnp`` reference. With ``PALLAS_TPU_CHIP_BUNDLE=DIR`` each kernel is also added to a chip
bundle (tests/tpu/chip_bundle.py) for a TPU whose JAX is older than ours.

Where JAX's lowering of the same body is wanted beside ours (``jax_beside.wanted``: on a chip,
into a bundle, with ``PALLAS_TPU_JAX_BESIDE=1``), the test body first runs with the
``jax_beside`` engine (``before_call``). On a TPU the compiled way is the chip engine (``chip.py``).

Compiling without running: ``compile_both(build, args, chips)`` (a ``build(pl, pltpu) -> f``,
by both lowerings), ``compile_op(f, args)`` (an op at a size too large to run),
``compile_for_chip`` (one chip), ``chip_mesh`` (an abstract mesh of one compile-only chip).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os

import jax
import numpy as np
import pytest

import pallas as pl
from pallas_tpu._src.mosaic import compile_check as _compile_check

from . import jax_beside
from .machine import ON_CHIP
from .mosaic import MosaicEngine, run_sharded_with_mosaic

# Tests that differ only in their data (a parametrized index, a seed, a value checked) compile
# the same module for the same chip: libtpu compiles it once per pytest process (the last 64
# kept; never where libtpu dumps its passes, PALLAS_TPU_LLO_DUMP).
_compile_check.reuse_compiles(64)

# The chips the compiled way compiles for (libtpu's compile-only devices):
# PALLAS_TPU_CHIPS, comma-separated (CI: v5e and v6e in `tests`, v4 and v5p in `tests_newest`).
# Kernels over a chip's two TensorCores (num_cores=2) compile for the megacore chips.
COMPILE_CHIPS = tuple(c for c in os.environ.get("PALLAS_TPU_CHIPS", "v5e,v6e").split(",") if c)
# What Mosaic says a generation's hardware lacks: a kernel that needs it compiles on the
# chips that have it, and on these its refusal is recorded ("lacks the feature"), not a failure.
GENERATION_GAPS = {
    "v4": (
        "Sublane gather not supported by this TPU generation",
        "Stochastic convert not supported on TPU generations < 5",
        "interleaved unpacking from bitwidth 'bf16'",
        "Unsupported matmul RHS type on target: vector<128x128xi8>",  # v4's MXU takes no int8
        # v4 has no 8-bit vector ALU: Mosaic emulates 8-bit ops, not yet unsigned unpacking
        "unsigned integer unpacking emulation from bitwidth 'i8'",
    ),
}
MEGACORE_CHIPS = ("v5p",)  # libtpu's v4 topology has one TensorCore per device


class CompiledEngine(MosaicEngine):
    name = "compiled"

    def execute(self, way, f, args, closed, shapes):
        compile_for_chips(f, args, "ours", num_cores=way.num_cores, record=_recorder(way), only=way.chip)
        outs = super().execute(way, f, args, closed, shapes)
        if way.num_cores == 1 and way.chip is None and os.environ.get("PALLAS_TPU_CHIP_BUNDLE"):
            add_to_chip_bundle(f, args, outs, way.kept.take() if way.kept else None)
        return outs

    def run_sharded(self, way, f, x, shape, names, spec, input_output_aliases):
        """The sharded kernel compiled for each chip (over a mesh of its compile-only devices), then run."""
        compile_for_chips(f, [x], "ours", mesh=shape, spec=spec)
        return run_sharded_with_mosaic(f, x, shape, input_output_aliases)

    def before_call(self, way, item):
        """Where JAX's lowering is wanted beside ours (``jax_beside.wanted``; never for an op's
        way), the test body runs once first with the ``jax_beside`` engine: JAX's lowering of
        each kernel compiled (its outcome recorded, never asserted) and, where ours' run takes
        it (a chip, a bundle), kept. The body's asserts, errors and skips there are not the
        test's outcome. Returns the way the test runs with: JAX's kernels kept beside it."""
        if way.ours_only or not jax_beside.wanted():
            return way
        kept = jax_beside.Kept()
        args = {name: item.funcargs[name] for name in inspect.signature(item.obj).parameters}
        args["way"] = dataclasses.replace(way, beside=True, kept=kept)
        try:
            item.obj(**args)
        except (Exception, pytest.skip.Exception, pytest.xfail.Exception, pytest.fail.Exception):
            pass
        return dataclasses.replace(way, kept=kept)

    def compile_op(self, f, args, chips=None) -> None:
        """Our lowering of ``f(*args)`` compiled for each of ``chips`` (``COMPILE_CHIPS``) under
        that chip's abstract mesh; a refusal fails the test; nothing recorded."""
        for chip in chips or COMPILE_CHIPS:
            refused = compile_for_chip(f, list(args), chip, "ours", record=unrecorded)
            if refused is not None:
                raise refused


def _recorder(way):
    """What records the compiles of ``way``'s kernels: an op's way (``ours_only``) nothing (the
    compile report compares our lowering with JAX's of the same kernel, which an op has not)."""
    return unrecorded if way.ours_only else None


def unrecorded(*row, **extra) -> None:
    """Records nothing (an op's compiles and chip runs)."""


def compile_for_chips(f, args, lowering, mesh=None, spec=None, num_cores=1, record=None, only=None):
    """``f(*args)`` (its kernels lowered by ``lowering``: "ours" or "jax") compiled by libtpu's
    Mosaic for each of ``COMPILE_CHIPS`` (and ``MEGACORE_CHIPS`` for a kernel over
    ``num_cores=2``; ``only``, one chip, where the kernel is written for it); Mosaic's refusal of
    ours fails the test (a chip's generation gap is recorded, not raised)."""
    megacore = MEGACORE_CHIPS if num_cores == 2 else ()
    for chip in (only,) if only else dict.fromkeys(COMPILE_CHIPS + megacore):
        refused = compile_for_chip(f, args, chip, lowering, mesh, spec, record=record)
        if refused is not None:
            raise refused


def compile_op(f, args, chips=None) -> None:
    """The compiled way's compile of ``f(*args)`` (a function of ops of ``pallas_tpu.ops``;
    ``args`` may be ``jax.ShapeDtypeStruct``s) without its run: libtpu compiles our lowering
    for each chip of ``COMPILE_CHIPS`` under that chip's abstract mesh (so the op
    picks its blocks for that chip; a refusal fails the test); on a TPU, for the chip there.
    For a size too large to run (the blocks an op chooses at scale); ``chips``: for these
    compile-only chips on any machine (``f`` and ``args`` made for them: over a mesh of the
    chip's devices)."""
    from .engine import engine_named

    engine_named("compiled").compile_op(f, args, chips)


def _namespaces(lowering):
    from .jax_mosaic import jax_namespaces

    if lowering == "jax":
        return jax_namespaces()
    import pallas_tpu as pltpu

    return pl, pltpu


def compile_both(build, args, chips, mesh=None, spec=None):
    """The compiled way: ``build``'s kernels lowered by us and compiled by libtpu's
    Mosaic for each of ``chips`` (a ``MosaicCompileError`` fails the test), and
    JAX's lowering of the same kernels compiled beside them where ``jax_beside.wanted``
    (its outcome is recorded, never asserted). The way then checks values as ``"ours"`` does:
    ``run_mosaic`` of the module the compiler took. ``mesh``/``spec``: the kernel
    is ``shard_map``ped over a mesh of that shape of the chip's devices."""
    from pallas_tpu._src.mosaic import compile_check

    if not compile_check.libtpu_available():
        pytest.skip('the compiled way needs libtpu: pip install "jax[tpu]"')
    if ON_CHIP:  # its libtpu is set up for the chip (one active core): CI compiles for the others
        pytest.skip("compiles for compile-only TPUs of other generations: done on the CPU, not on a chip")
    lowerings = ("ours", "jax") if jax_beside.wanted() else ("ours",)
    for chip in chips:
        refused = None  # ours' MosaicCompileError, raised once JAX's outcome is recorded too
        for lowering in lowerings:
            error = compile_for_chip(build(*_namespaces(lowering)), args, chip, lowering, mesh, spec)
            refused = refused or error
        if refused is not None:
            raise refused


def compile_for_chip(f, args, chip, lowering, mesh=None, spec=None, record=None):
    """``f(*args)`` (its kernels lowered by ``lowering``: "ours" or "jax") compiled by libtpu's
    Mosaic for ``chip``, the outcome and LLO counts recorded (by ``record``, default
    ``record_compile``). Returns Mosaic's refusal of our lowering (a ``MosaicCompileError``,
    None if it compiled or the chip lacks the feature); JAX's refusals are recorded only.
    ``mesh``/``spec``: ``f`` is ``shard_map``ped over a mesh of that shape of the chip's devices
    (``args`` already placed over them: ``f`` maps itself, an op that takes its mesh)."""
    from pallas_tpu._src.mosaic import compile_check

    if mesh is not None:
        f, args = _sharded_for_chip(f, args, chip, mesh, spec)
    # Arguments placed over several of the chip's devices (``mesh``'s, or an op's own shard_map's)
    # name the chip themselves.
    sharded = any(
        len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in jax.tree.leaves(args)
    )
    llo, refused = None, None
    ours = lowering == "ours"
    try:
        with chip_mesh(chip) if mesh is None and not sharded else contextlib.nullcontext():
            _, _, llo = compile_check.compile_counting_llo(f, args, chip)
        outcome = "compiled"
    except compile_check.MosaicCompileError as e:
        outcome = "refused by Mosaic"
        if any(gap in str(e) for gap in GENERATION_GAPS.get(chip, ())):
            outcome = "lacks the feature"
        elif ours:
            refused = e
    except Exception:  # JAX's lowering refuses the kernel
        if ours:
            raise
        outcome = "refused by its lowering"
    (record or record_compile)(chip, lowering, outcome, llo)
    return refused


def chip_mesh(chip):
    """An abstract mesh of one ``chip`` device (libtpu's compile-only one): an op traced under
    it picks its blocks for that chip (``pltpu.get_tpu_info()``), and JAX asks it for the
    TPU generation (without one it sees the CPU, and refuses: "Unsupported TPU device kind: cpu")."""
    from pallas_tpu._src.mosaic import compile_check

    dev = compile_check.tpu_devices(chip)[0]
    kind = jax.sharding.AbstractDevice(
        device_kind=dev.device_kind, num_cores=getattr(dev, "num_cores", 1) or 1, platform="tpu"
    )
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=kind))


def _sharded_for_chip(f, args, chip, mesh_shape, spec):
    from pallas_tpu._src.mosaic import compile_check

    devices = compile_check.tpu_devices(chip)
    n = int(np.prod(mesh_shape))
    names = ("x", "y", "z", "w")[: len(mesh_shape)]
    mesh = jax.sharding.Mesh(np.array(devices[:n]).reshape(mesh_shape), names)
    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    return (lambda *a: g(*a)), placed


def record_compile(chip, mode, outcome, llo, **extra):
    """One line per compile in $PALLAS_TPU_COMPILE_REPORT/<worker>.jsonl (tests/tpu/conftest.py
    sums them; benchmarks/tpu_llo.py reads the LLO counts, per kernel in program order)."""
    folder = os.environ.get("PALLAS_TPU_COMPILE_REPORT")
    if not folder:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(folder, f"{worker}.jsonl"), "a") as fh:
        row = dict(test=test, chip=chip, lowering=mode, outcome=outcome, llo=llo, **extra)
        fh.write(json.dumps(row) + "\n")


def add_to_chip_bundle(f, args, outs, theirs=None):
    """With ``PALLAS_TPU_CHIP_BUNDLE=DIR`` the compiled way adds its kernel (our lowering and,
    where the ``jax_beside`` run kept it, JAX's; the inputs as constants, ``run_mosaic``'s
    outputs of ours as the reference) to the bundle in DIR (tests/tpu/chip_bundle.py)."""
    import chip_bundle

    from .engine import whole_function
    from .mosaic import TPU_V5E

    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]

    def ours():
        with whole_function():
            return f(*args)

    def jax_lowering():
        with whole_function():
            return theirs(*args)

    chip_bundle.add(
        os.environ["PALLAS_TPU_CHIP_BUNDLE"],
        test,
        ours,
        jax.tree.leaves(outs),
        theirs=jax_lowering if theirs is not None else None,
        context=lambda: jax.sharding.use_abstract_mesh(TPU_V5E),
    )
