"""The ``gpu`` way: the GPU suite's engine (tests/gpu, ``gpu_test_base.Runner``): pallas-gpu's
lowering of a kernel to Triton.

Off a GPU (any machine, CI) the generated Triton kernel runs under Triton's interpreter on the
CPU, as the ``triton`` way runs it, and is then compiled for each GPU of ``COMPILE_TARGETS``
(sm_80, sm_90: a cubin each, without a GPU), so the generated source must be valid for the
compiler too. With ``PALLAS_GPU_TESTS=gpu`` (``ON_DEVICE``: scripts/gpu_check.sh on the GPU
machine) the same kernel is compiled for the device and run there. Either way its outputs are
compared with the test's ``jnp`` reference (``gpu_test_base.assert_close``: float32 to 1e-5,
16-bit floats to 2e-2, integers exactly).

``triton_mode()`` is what a test that calls ``pallas_call`` (or an op) itself passes as
``interpret=``; ``check_compiles``/``check_all_compile`` compile the kernels of a function for
the targets; ``lowered``/``all_lowered`` are the generated kernels of a function's
``pallas_call``s (what the compile step and the tests of the lowering read).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

import pallas as pl

from .triton import TritonEngine

ON_DEVICE = os.environ.get("PALLAS_GPU_TESTS") == "gpu"
# Every kernel a test runs under Triton's interpreter is also compiled for
# these GPUs (without one): the generated source must be valid for the compiler.
COMPILE_TARGETS = (80, 90)


class GpuEngine(TritonEngine):
    name = "gpu"

    def interpret(self, way):
        return False if ON_DEVICE else super().interpret(way)

    def pallas_call(self, way, kernel, out_shape, **kwargs):
        """On the GPU: the kernel compiled and run there. Off it: run by Triton's interpreter,
        then compiled for each of ``COMPILE_TARGETS``."""
        if ON_DEVICE:
            return pl.pallas_call(kernel, out_shape, **kwargs)
        f = super().pallas_call(way, kernel, out_shape, **kwargs)

        def run_and_compile(*args):
            out = f(*args)
            check_compiles(f, args, kwargs.get("compiler_params"))
            return out

        return run_and_compile


def triton_mode():
    """``interpret=`` for running the generated kernel: Triton's interpreter,
    or (``PALLAS_GPU_TESTS=gpu``) compiled on the GPU."""
    import pallas_gpu as plgpu

    return False if ON_DEVICE else plgpu.InterpretParams()


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def check_compiles(f, args, compiler_params=None) -> None:
    """Compiles the kernel of the pallas_call ``f`` (called on ``args``) to a
    cubin for each of ``COMPILE_TARGETS``."""
    import pallas_gpu as plgpu

    cp = compiler_params if isinstance(compiler_params, plgpu.CompilerParams) else plgpu.CompilerParams()
    check_all_compile(f, args, cp)


def check_all_compile(f, args, compiler_params, targets=COMPILE_TARGETS) -> int:
    """Compiles every pallas_call kernel in ``f`` for each of ``targets``
    (compute capabilities); returns how many kernels there were."""
    from pallas_gpu._src.compile import compiler

    kernels = all_lowered(f, *[jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args])
    options = tuple(sorted(compiler_params.compile_options().items()))
    for lk in kernels:
        for cc in targets:
            assert compiler.compile_kernel(lk, cc, options).asm.get("cubin"), (
                f"no cubin for {lk.name} sm_{cc}"
            )
    return len(kernels)


def lowered(f, *args):
    """The generated Triton kernel (a ``LoweredKernel``) of the one pallas_call in ``f``."""
    from pallas_gpu._src.pallas_call_registration import lowered_kernel

    jaxpr = jax.make_jaxpr(f)(*args)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    return lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"], source_options(eqn))


def source_options(eqn) -> tuple:
    """The source options (``use_tma``, ...) of a pallas_call equation's
    compiler params, as the GPU lowering takes them."""
    import pallas_gpu as plgpu

    cp = eqn.params.get("compiler_params")
    cp = cp[0] if isinstance(cp, (list, tuple)) and cp else cp
    return (
        cp.source_options()
        if isinstance(cp, plgpu.CompilerParams)
        else plgpu.CompilerParams().source_options()
    )


def eqns_outside_kernels(f, *args):
    """The equations of ``f``'s jaxpr, through jit, custom_vjp and other
    sub-jaxprs (e.g. a backward pass), not into a pallas_call kernel's body
    (the pallas_call equations themselves are included)."""
    from jax.extend import core as jex_core

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            if eqn.primitive.name == "pallas_call":
                continue
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        yield from walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        yield from walk(sub)

    return list(walk(jax.make_jaxpr(f)(*args).jaxpr))


def all_lowered(f, *args):
    """The generated Triton kernels of every pallas_call in ``f``, including
    those inside jit, custom_vjp and other sub-jaxprs (e.g. a backward pass)."""
    from pallas_gpu._src.pallas_call_registration import lowered_kernel

    return [
        lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"], source_options(eqn))
        for eqn in eqns_outside_kernels(f, *args)
        if eqn.primitive.name == "pallas_call"
    ]
