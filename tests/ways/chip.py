"""The chip: on a TPU (``ON_CHIP``; the lent v5e, scripts/tpu_check.sh) the ``compiled`` way is this
engine, which compiles our lowering of each kernel with the chip's own libtpu and runs it there.

Test data and the ``jnp`` reference are made on the host's CPU (``machine.py``); the kernel's
inputs go to the chip (``to_chip``) and its outputs come back, to be compared with the reference
at the chip's arithmetic: the MXU multiplies float32 operands rounded to bfloat16 (``mxu_operand``,
``dot_tol``), the vector unit flushes float32 subnormals (``chip_flushed``), the transcendental
units are a few hundred ulp from the host's libm (``chip_tol``), and the hardware random bits are
the chip's own (``hardware_random_reference``: JAX's lowering of the same kernel run there). Each
of these is its argument itself in every other way (``Engine``'s hooks): the functions here take
the way, or its name, and ask its engine.

Beside each of ours, JAX's lowering of the same kernel (kept by the ``jax_beside`` run of the body)
runs on the same inputs; how far the two are apart (``chip_agreement``) is recorded, never asserted,
and tests/tpu/conftest.py sums it. A kernel over more TensorCores than the chip has, or written for
another generation, skips; a sharded kernel (compiled for compile-only chips on the CPU) too.
``needs_devices(n)`` marks a test of ``n`` devices: CPU devices off a chip, chips on one.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from .compiled import CompiledEngine, record_compile, unrecorded
from .engine import engine_of, whole_function
from .machine import ON_CHIP


def to_chip(args):
    """``args`` on the TPU (``ON_CHIP``), where the kernel under test runs."""
    return jax.device_put(args, jax.devices("tpu")[0])


# At the default precision the MXU multiplies float32 operands rounded to bfloat16 (to
# nearest even) and accumulates in float32, as XLA's jnp.dot does on a TPU (the v5e gave
# such a product of 256x384 by 384x256 to 1e-6); the interpreters and run_mosaic multiply
# in float32.
#
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


class ChipEngine(CompiledEngine):
    """The compiled way on a TPU: ours compiled and run on the chip, JAX's beside it."""

    def execute(self, way, f, args, closed, shapes):
        record = unrecorded if way.ours_only else record_compile
        theirs = way.kept.take() if way.kept else None
        device = jax.devices()[0]
        if way.chip is not None:
            from .mosaic import DEVICE_KINDS

            if DEVICE_KINDS[way.chip] != device.device_kind:
                pytest.skip(f"a kernel for a TPU {way.chip}; this chip is a {device.device_kind}")
        chip_cores = getattr(device, "num_cores", 1) or 1
        if way.num_cores > chip_cores:
            pytest.skip(
                f"needs a TPU with {way.num_cores} TensorCores; {device.device_kind} has {chip_cores}"
            )
        args = to_chip(args)
        with jax.default_device(jax.devices("tpu")[0]), whole_function():  # a kernel of no arguments too
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
                        theirs_outcome = f"failed ({first_line(e2)})"
                record(
                    "chip",
                    "ours",
                    "failed",
                    None,
                    agreement=f"ours failed ({first_line(e)}); JAX's: {theirs_outcome}",
                )
                if "Mosaic failed to compile" in str(e):
                    from pallas_tpu._src.mosaic.compile_check import MosaicCompileError

                    raise MosaicCompileError.from_libtpu(e, device.device_kind, []) from e
                raise
            agreement = "JAX's not built"
            try:
                if theirs is not None:
                    agreement = chip_agreement(ours, jax.block_until_ready(jax.jit(theirs)(*args)))
            except Exception as e:  # JAX's lowering refuses the kernel, or Mosaic refuses JAX's module
                agreement = f"JAX's failed: {first_line(e)}"
        record("chip", "ours", "ran", None, agreement=agreement)
        return jax.device_get(ours)

    def run_sharded(self, way, f, x, shape, names, spec, input_output_aliases):
        pytest.skip("a sharded kernel compiles for compile-only TPUs: done on the CPU, not on a chip")

    def compile_op(self, f, args, chips=None) -> None:
        """On the chip, for the chip there (``chips``: for those compile-only chips, as off a chip)."""
        if chips is not None:
            return super().compile_op(f, args, chips)
        jax.jit(f).lower(*to_chip(args)).compile()

    def mxu_operand(self, x):
        """Float32 rounded to bfloat16, as the MXU multiplies it."""
        if x.dtype == np.float32:
            return x.astype(jax.numpy.bfloat16).astype(np.float32)
        return x

    def chip_flushed(self, x):
        """Float32 subnormals flushed to signed zero, as the vector unit does when it widens
        bfloat16 to float32 (seen on ``unpack_elementwise`` on the v5e)."""
        x = np.asarray(x)
        if x.dtype != np.float32:
            return x
        return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x)

    def dot_tol(self, tol: float, dtype=np.float32, grads: bool = False) -> float:
        """The bf16 tolerance for float32 operands (``F32_DOT_ON_CHIP_TOL``; with ``grads``, of
        an attention backward, ``F32_DOT_GRAD_ON_CHIP_TOL``)."""
        if np.dtype(dtype) == np.float32:
            return max(tol, F32_DOT_GRAD_ON_CHIP_TOL if grads else F32_DOT_ON_CHIP_TOL)
        return tol

    def chip_tol(self, tol: float, floor: float) -> float:
        return max(tol, floor)

    def random_reference(self, build, args, model):
        """JAX's lowering of the same kernel, run on the chip (ours must equal it bit for bit)."""
        from .jax_mosaic import jax_namespaces

        args = to_chip(args)
        with jax.default_device(jax.devices("tpu")[0]):  # a kernel of no arguments too
            return jax.device_get(jax.jit(build(*jax_namespaces()))(*args))


# The chip's arithmetic, asked of a way (a ``Way`` or its name) by the tests' references.


def mxu_operand(x, way):
    """``x`` as a matmul kernel run the ``way`` way multiplies it: on the chip, float32
    rounded to bfloat16; anywhere else ``x`` itself. For the test's reference."""
    return engine_of(way).mxu_operand(x)


def chip_flushed(x, way):
    """``x`` with float32 subnormals flushed to signed zero where the kernel ran on the chip."""
    return engine_of(way).chip_flushed(x)


def dot_tol(tol: float, way, dtype=np.float32, grads: bool = False) -> float:
    """``tol`` for a kernel of chained matmuls of ``dtype`` operands, or the bf16
    tolerance where it runs on the chip."""
    return engine_of(way).dot_tol(tol, dtype, grads)


def chip_tol(tol: float, way, floor: float) -> float:
    """``tol``, or ``floor`` where the kernel runs on the chip: its transcendental units
    (exp, log) are a few hundred ulp from the host's libm."""
    return engine_of(way).chip_tol(tol, floor)


def hardware_random_reference(build, args, way, model):
    """What a kernel on the TPU's hardware random bits must give: ``model()`` (the
    generator as the interpreters and run_mosaic model it), except on a chip, whose generator
    is its own: there JAX's lowering of the same kernel, run on the chip."""
    return engine_of(way).random_reference(build, args, model)


def needs_devices(n: int):
    """A skip mark for a test of ``n`` devices (remote DMAs, barriers between devices): on a
    CPU machine they are ``n`` CPU devices (tests/conftest.py makes 4); on a TPU machine
    (``ON_CHIP``) ``n`` chips, which the one-chip v5e does not have."""
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
