"""The TPU ways' machinery under tests/ways.py (DESIGN.md, "Tests"): a kernel run every
TPU way (``every_way(tpu=True)``: ``tpu_interpret``, ``mosaic``, ``jax_mosaic``,
``compiled``) is run by this module's executor, compile and chip helpers:

* ``run_with_mosaic(f, *args)``: ``f`` (a JAX function of ``pallas_call``s) exported for
  TPU, its jaxpr evaluated with each ``pallas_call`` replaced by ``run_mosaic`` of the next
  exported module (``num_cores=2``: exported for a megacore chip); ``run_sharded_with_mosaic``
  the same over a mesh of devices;
* ``compile_for_chip``: the compiled way's libtpu compile for one of ``COMPILE_CHIPS``
  (``MEGACORE_CHIPS`` for two-TensorCore kernels), outcome and LLO counts recorded
  (``record_compile``; tests/tpu/conftest.py sums them); ``compile_both`` compiles a
  ``build(pl, pltpu) -> f`` by both lowerings (a test that compiles without running:
  test_helpers' core-parallel grid, test_downstream_patterns', the ported ops of
  test_lowering_jax_ops and test_jax_tpu_ops at sizes given as shapes);
* on a TPU (``ON_CHIP``): test data on the host's CPU, kernels sent to the chip
  (``to_chip``), ours against JAX's lowering there (``chip_agreement``); the tolerances of
  the chip's rounding (``mxu_operand``, ``chip_flushed``, ``dot_tol``, ``chip_tol``) and
  its hardware random bits (``hardware_random_reference``), by way name.

A test that checks what only the interpreter does (races, poisoning, DMA order, its error
messages and knobs) carries ``@pytest.mark.interpret_only(reason=...)`` (registered in
``conftest.py``). Tests of ``run_mosaic`` itself take a kernel's modules from
``tpu_modules``; a ``pl.run_state`` (a ``core_map``'s Refs) is discharged to run its module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import jax
import numpy as np
from jax import export

import pallas as pl
import pallas_tpu as pltpu
from pallas._src import compat
from pallas_tpu._src.executor import run as executor
from pallas_tpu._src.mosaic import compile_check

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

# The device kind of each chip generation a test names (``Way.with_params(chip=...)``).
DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite", "7x": "TPU7x"}


def abstract_mesh(num_cores, chip=None):
    """The abstract TPU a kernel is exported for (JAX's lowering asks the device for its TPU
    generation for some ops): ``chip``'s generation, or a v5e (a v4, a megacore chip, with
    ``num_cores=2``)."""
    chip = chip or ("v5e" if num_cores == 1 else "v4")
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[chip], num_cores=num_cores, platform="tpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


TPU_V5E = abstract_mesh(1)


def close(a, b, tol=1e-5):
    """Same shape and dtype, and equal to ``tol`` (relative and absolute) in float64."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


def equal(a, b):
    """Same shape and dtype, and bit-for-bit equal values."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a, b)


def jax_namespaces():
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jtpu

    return jpl, jtpu


# JAX 0.10.2, the oldest supported (Python 3.11's, the lent v5e's), comes with libtpu 0.0.42.1,
# whose Mosaic compiler refuses some forms that of JAX 0.11.2 (libtpu 0.0.48.1) takes, and its
# Pallas lacks some of the features ours has.
OLD_JAX = jax.__version_info__ < (0, 11)


def namespaces(mode):
    return jax_namespaces() if mode == "jax" else (pl, pltpu)


def tpu_modules(f, *args, num_cores=1, chip=None) -> list[bytes]:
    """The serialized Mosaic modules of ``f(*args)`` exported for TPU (a chip
    with ``num_cores`` TensorCores: TPU v5e for one, TPU v4 for two; or ``chip``)."""
    with jax.sharding.use_abstract_mesh(abstract_mesh(num_cores, chip)):
        txt = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    return executor.custom_call_bodies(txt)


# On a TPU (the lent v5e: scripts/tpu_check.sh) the compiled way compiles with the chip's own
# libtpu and runs there: our lowering's outputs go to the test's jnp comparison, and JAX's
# lowering of the same kernel, compiled and run beside it, is compared with ours in the report.
ON_CHIP = jax.default_backend() == "tpu"
if ON_CHIP:
    # Test data and jnp references are made on the host's CPU, as in CI: XLA on the TPU
    # flushes subnormals and canonicalizes NaN payloads (a bit-exact reference made there
    # is not the one the test means), and its default matmul precision is bf16. Kernels go
    # to the chip explicitly (``to_chip``).
    jax.config.update("jax_default_device", jax.devices("cpu")[0])


def to_chip(args):
    """``args`` on the TPU (``ON_CHIP``), where the kernel under test runs."""
    return jax.device_put(args, jax.devices("tpu")[0])


# At the default precision the MXU multiplies float32 operands rounded to bfloat16 (to
# nearest even) and accumulates in float32, as XLA's jnp.dot does on a TPU (the v5e gave
# such a product of 256x384 by 384x256 to 1e-6); the interpreters and run_mosaic multiply
# in float32.
def mxu_operand(x, way: str):
    """``x`` as a matmul kernel run the ``way`` way multiplies it: on the chip, float32
    rounded to bfloat16; anywhere else ``x`` itself. For the test's reference."""
    if ON_CHIP and way == "compiled" and x.dtype == np.float32:
        return x.astype(jax.numpy.bfloat16).astype(np.float32)
    return x


def chip_flushed(x, way: str):
    """``x`` with float32 subnormals flushed to signed zero where the kernel ran on the
    chip (``ON_CHIP``), whose vector unit flushes them when it widens bfloat16 to float32
    (seen on ``unpack_elementwise`` on the v5e); anywhere else ``x`` itself."""
    x = np.asarray(x)
    if not (ON_CHIP and way == "compiled" and x.dtype == np.float32):
        return x
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x)


# A kernel of several float32 matmuls in a row (attention: the probabilities are rounded
# too) is held to the tolerance of a bf16 one on the chip (the ops tests' bf16 attention
# cases with gradients allow 4e-2).
F32_DOT_ON_CHIP_TOL = 4e-2
# Attention gradients of float32 inputs on the chip: dS = P * (dP - rowsum(O * dO)) subtracts
# two O(|dO| |V| sqrt(D)) terms, each from bf16-rounded MXU operands, so the absolute error of
# dq/dk/dv is of that rounding times the logits' scale whatever the gradient's size. Seen on
# the v5e (splash attention, unit-normal q/k/v, D128): 0.048-0.058 of max(1, |want|),
# identical over two runs; after the backward's change to half-block cells, 0.049-0.071
# against a reference of bf16-rounded matmul operands, which is itself 0.02-0.03 from the
# exact one (its O and dP round elsewhere than the kernel's).
F32_DOT_GRAD_ON_CHIP_TOL = 1e-1


def dot_tol(tol: float, way: str, dtype=np.float32, grads: bool = False) -> float:
    """``tol`` for a kernel of chained matmuls of ``dtype`` operands, or the bf16
    tolerance where it runs on the chip (``F32_DOT_ON_CHIP_TOL``; with ``grads``, of an
    attention backward, ``F32_DOT_GRAD_ON_CHIP_TOL``)."""
    if ON_CHIP and way == "compiled" and np.dtype(dtype) == np.float32:
        return max(tol, F32_DOT_GRAD_ON_CHIP_TOL if grads else F32_DOT_ON_CHIP_TOL)
    return tol


def chip_tol(tol: float, way: str, floor: float) -> float:
    """``tol``, or ``floor`` where the kernel runs on the chip: its transcendental units
    (exp, log) are a few hundred ulp from the host's libm."""
    return max(tol, floor) if ON_CHIP and way == "compiled" else tol


def needs_devices(n: int):
    """A skip mark for a test of ``n`` devices (remote DMAs, barriers between devices): on a
    CPU machine they are ``n`` CPU devices (tests/conftest.py makes 4); on a TPU machine
    (``ON_CHIP``) ``n`` chips, which the one-chip v5e does not have."""
    import pytest

    if ON_CHIP:
        have = len(jax.devices())
        return pytest.mark.skipif(
            have < n, reason=f"needs {n} TPU chips (DMAs between devices); this machine has {have}"
        )
    return pytest.mark.skipif(
        jax.device_count() < n,
        reason=f"needs {n} CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count={n} "
        "(tests/conftest.py sets 4 unless JAX started earlier)",
    )


def hardware_random_reference(build, args, mode, model):
    """What a kernel on the TPU's hardware random bits must give: ``model()`` (the
    generator as the interpreters and run_mosaic model it), except in the compiled way on
    a chip, whose generator is its own: there JAX's lowering of the same kernel, run on
    the chip (ours must equal it bit for bit)."""
    if not (mode == "compiled" and ON_CHIP):
        return model()
    args = to_chip(args)
    with jax.default_device(jax.devices("tpu")[0]):  # a kernel of no arguments too
        return jax.device_get(jax.jit(build(*jax_namespaces()))(*args))


def first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("---")]
    text = next((ln for ln in lines if "Mosaic failed" in ln or "Error" in ln), lines[0] if lines else "")
    return f"{type(e).__name__}: {text[:160]}"


def chip_agreement(ours, theirs) -> str:
    """'equal' (bit for bit), 'close (max rel R)' or 'differ (max rel R)': ours against
    JAX's lowering on the chip, over every output."""
    worst, equal = 0.0, True
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "iub" or a.size == 0:
            equal &= bool(np.array_equal(a, b))
            worst = max(worst, 0.0 if np.array_equal(a, b) else 1.0)
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        same = np.array_equal(a64, b64, equal_nan=True)
        equal &= bool(same)
        if not same:
            scale = max(float(np.nanmax(np.abs(b64))) if np.isfinite(b64).any() else 1.0, 1e-30)
            diff = np.abs(a64 - b64)
            worst = max(worst, float(np.nanmax(np.where(np.isnan(a64) & np.isnan(b64), 0, diff))) / scale)
    if equal:
        return "equal"
    return f"{'close' if worst <= 1e-2 else 'differ'} (max rel {worst:.2g})"


def jax_beside_wanted() -> bool:
    """Whether the compiled way compiles JAX's lowering of a test's kernels beside ours: on a
    chip (its run beside ours is the agreement the chip reports), into a chip bundle
    (``PALLAS_TPU_CHIP_BUNDLE``), and where ``PALLAS_TPU_JAX_BESIDE=1`` asks for the counts
    (benchmarks/tpu_llo.py compares the LLO of both). Elsewhere (CI) not: its outcome is
    recorded, never asserted, and running the test body a second time doubled the way's cost."""
    return (
        ON_CHIP
        or bool(os.environ.get("PALLAS_TPU_CHIP_BUNDLE"))
        or os.environ.get("PALLAS_TPU_JAX_BESIDE") == "1"
    )


def compile_both(build, args, chips, mesh=None, spec=None):
    """The compiled way: ``build``'s kernels lowered by us and compiled by libtpu's
    Mosaic for each of ``chips`` (a ``MosaicCompileError`` fails the test), and
    JAX's lowering of the same kernels compiled beside them where ``jax_beside_wanted``
    (its outcome is recorded, never asserted). The way then checks values as ``"ours"`` does:
    ``run_mosaic`` of the module the compiler took. ``mesh``/``spec``: the kernel
    is ``shard_map``ped over a mesh of that shape of the chip's devices."""
    import pytest

    if not compile_check.libtpu_available():
        pytest.skip('the compiled way needs libtpu: pip install "jax[tpu]"')
    if ON_CHIP:  # its libtpu is set up for the chip (one active core): CI compiles for the others
        pytest.skip("compiles for compile-only TPUs of other generations: done on the CPU, not on a chip")
    for chip in chips:
        refused = None  # ours' MosaicCompileError, raised once JAX's outcome is recorded too
        for mode in ("ours", "jax") if jax_beside_wanted() else ("ours",):
            error = compile_for_chip(build(*namespaces(mode)), args, chip, mode, mesh, spec)
            if mode == "ours":
                refused = error
        if refused is not None:
            raise refused


def compile_for_chip(f, args, chip, lowering, mesh=None, spec=None, record=None):
    """``f(*args)`` (its kernels lowered by ``lowering``: "ours" or "jax") compiled by libtpu's
    Mosaic for ``chip``, the outcome and LLO counts recorded (by ``record``, default
    ``record_compile``). Returns Mosaic's refusal of our lowering (a ``MosaicCompileError``,
    None if it compiled or the chip lacks the feature); JAX's refusals are recorded only.
    ``mesh``/``spec``: ``f`` is ``shard_map``ped over a mesh of that shape of the chip's devices
    (``args`` already placed over them: ``f`` maps itself, an op that takes its mesh)."""
    if mesh is not None:
        f, args = _sharded_for_chip(f, args, chip, mesh, spec)
    # Arguments placed over several of the chip's devices (``mesh``'s, or an op's own shard_map's)
    # name the chip themselves.
    sharded = any(
        len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in jax.tree.leaves(args)
    )
    llo, refused = None, None
    try:
        with _chip_context(chip, mesh is None and not sharded):
            _, _, llo = compile_check.compile_counting_llo(f, args, chip)
        outcome = "compiled"
    except compile_check.MosaicCompileError as e:
        outcome = "refused by Mosaic"
        if any(gap in str(e) for gap in GENERATION_GAPS.get(chip, ())):
            outcome = "lacks the feature"
        elif lowering == "ours":
            refused = e
    except Exception:  # JAX's lowering refuses the kernel
        if lowering == "ours":
            raise
        outcome = "refused by its lowering"
    (record or record_compile)(chip, lowering, outcome, llo)
    return refused


def _chip_context(chip, single_device):
    """An abstract mesh of ``chip``'s device kind: JAX's lowering asks the context
    for the TPU generation (without one it sees the CPU, and refuses:
    "Unsupported TPU device kind: cpu"). A shard_map's mesh of the chip's devices says it itself."""
    import contextlib

    return chip_mesh(chip) if single_device else contextlib.nullcontext()


def chip_mesh(chip):
    """An abstract mesh of one ``chip`` device (libtpu's compile-only one): an op traced under
    it picks its blocks for that chip (``pltpu.get_tpu_info()``), and JAX asks it for the
    TPU generation."""
    dev = compile_check.tpu_devices(chip)[0]
    kind = jax.sharding.AbstractDevice(
        device_kind=dev.device_kind, num_cores=getattr(dev, "num_cores", 1) or 1, platform="tpu"
    )
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=kind))


def _sharded_for_chip(f, args, chip, mesh_shape, spec):
    devices = compile_check.tpu_devices(chip)
    n = int(np.prod(mesh_shape))
    names = ("x", "y", "z", "w")[: len(mesh_shape)]
    mesh = jax.sharding.Mesh(np.array(devices[:n]).reshape(mesh_shape), names)
    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    return (lambda *a: g(*a)), placed


def record_compile(chip, mode, outcome, llo, **extra):
    """One line per compile in $PALLAS_TPU_COMPILE_REPORT/<worker>.jsonl (conftest sums
    them; benchmarks/tpu_llo.py reads the LLO counts, per kernel in program order)."""
    folder = os.environ.get("PALLAS_TPU_COMPILE_REPORT")
    if not folder:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(folder, f"{worker}.jsonl"), "a") as fh:
        row = dict(test=test, chip=chip, lowering=mode, outcome=outcome, llo=llo, **extra)
        fh.write(json.dumps(row) + "\n")


def tensorcore_mesh(pltpu):
    """A mesh of a chip's two TensorCores in ``pltpu`` (ours or JAX's): JAX's releases
    name its constructor ``TensorCoreMesh`` or ``create_tensorcore_mesh``."""
    if hasattr(pltpu, "TensorCoreMesh"):
        return pltpu.TensorCoreMesh(axis_name="core", num_cores=2)
    return pltpu.create_tensorcore_mesh("core", num_cores=2)


def run_with_mosaic(f, *args, num_cores=1, chip=None) -> list:
    """The flat outputs of ``f(*args)``, each ``pallas_call`` replaced by
    ``run_mosaic`` of the module ``f`` exports for TPU (``chip``'s generation where given),
    in program order."""
    bodies = tpu_modules(f, *args, num_cores=num_cores, chip=chip)
    with jax.sharding.use_abstract_mesh(abstract_mesh(num_cores, chip)):
        closed = jax.make_jaxpr(f)(*args)
    outs = _eval_with_mosaic(closed.jaxpr, closed.consts, jax.tree.leaves(args), bodies, num_cores)
    assert not bodies, f"{len(bodies)} exported kernels were not reached"
    return outs


def _eval_with_mosaic(jaxpr, consts, args, bodies, num_cores=1):
    env = {}

    def read(v):
        return v.val if type(v).__name__ == "Literal" else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in ("pallas_call", "mpmd_map"):  # mpmd_map: JAX's pl.kernel over a TensorCoreMesh
            out_shape = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            # Both primitives count the scalar-prefetch operands, as run_mosaic does.
            aliases = dict(eqn.params.get("input_output_aliases", ()))
            outs = pltpu.run_mosaic(
                bodies.pop(0), *invals, out_shape=out_shape, input_output_aliases=aliases, num_cores=num_cores
            )
        elif name == "run_state":  # a core_map's Refs: discharged, its kernel's module run on their values
            sub = compat.discharge(compat.close_jaxpr(eqn.params["jaxpr"]))
            outs = _eval_with_mosaic(sub.jaxpr, sub.consts, invals, bodies, num_cores)
        elif name in (
            "pjit",
            "jit",
            "closed_call",
            "custom_jvp_call",
            "custom_vjp_call",
            "checkpoint",
            "remat",
        ):
            sub = next(eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params)
            if hasattr(sub, "consts"):
                outs = _eval_with_mosaic(sub.jaxpr, sub.consts, invals, bodies, num_cores)
            else:
                outs = _eval_with_mosaic(sub, (), invals, bodies, num_cores)
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def run_sharded_with_mosaic(f, x, mesh_shape, input_output_aliases=()):
    """``f`` (one ``pallas_call`` per device) ``shard_map``ped over a mesh of ``mesh_shape``
    on the leading axis of ``x`` (as ``run_sharded``), exported for TPU and its module run by
    ``run_mosaic`` on every device; the outputs concatenated along that axis."""
    from jax.sharding import PartitionSpec as P

    shape = tuple(mesh_shape)
    n = int(np.prod(shape))
    names = ("x", "y", "z", "w")[: len(shape)]
    spec = P(names[0]) if len(shape) == 1 else P(names)
    mesh = jax.sharding.AbstractMesh(
        shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        abstract_device=TPU_V5E.abstract_device,
    )
    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    with jax.sharding.use_abstract_mesh(mesh):
        txt = export.export(jax.jit(g), platforms=["tpu"])(x).mlir_module()
        whole = jax.eval_shape(g, x)
    (body,) = executor.custom_call_bodies(txt)
    out_shape = jax.ShapeDtypeStruct((whole.shape[0] // n, *whole.shape[1:]), whole.dtype)
    shards = x.reshape(*shape, x.shape[0] // n, *x.shape[1:])
    kw = dict(num_devices=n) if len(shape) == 1 else dict(mesh_shape=shape)
    per_device = pltpu.run_mosaic(
        body, shards, out_shape=out_shape, input_output_aliases=input_output_aliases, **kw
    )
    return per_device.reshape(n * out_shape.shape[0], *out_shape.shape[1:])


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str, mode: str):
    """``examples/<name>.py`` as a module; for mode ``"jax"`` with its two Pallas
    imports rewritten to JAX's (the reverse of the migration the example shows)."""
    src = (EXAMPLES / f"{name}.py").read_text()
    if mode == "jax":
        src = re.sub(r"^import pallas as pl$", "from jax.experimental import pallas as pl", src, flags=re.M)
        src = re.sub(
            r"^import pallas_tpu as pltpu$",
            "from jax.experimental.pallas import tpu as pltpu",
            src,
            flags=re.M,
        )
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_loader(f"_example_{name}_{mode}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, str(EXAMPLES / f"{name}.py"), "exec"), mod.__dict__)
    return mod
