"""Shared helpers: run a kernel through pallas-gpu and compare with jnp.

``Runner.INTERPRET`` is the hook: by default the generated Triton kernel runs
under Triton's interpreter (any machine, CI). With ``PALLAS_GPU_TESTS=gpu``
(set by scripts/gpu_check.sh on the GPU machine) the same tests compile the
kernel for the device and run it there.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_gpu as plgpu

ON_DEVICE = os.environ.get("PALLAS_GPU_TESTS") == "gpu"
_counter = [0]


def triton_mode():
    """``interpret=`` for running the generated kernel: Triton's interpreter,
    or (``PALLAS_GPU_TESTS=gpu``) compiled on the GPU."""
    return False if ON_DEVICE else plgpu.InterpretParams()


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def fresh_key():
    _counter[0] += 1
    return jax.random.key(1000 + _counter[0])


def random(shape, dtype, key=None, low=-3, high=3):
    key = key if key is not None else fresh_key()
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return jax.random.bernoulli(key, 0.5, shape)
    if jnp.issubdtype(dtype, jnp.integer):
        lo = max(low * 10, int(jnp.iinfo(dtype).min))
        hi = min(high * 10, int(jnp.iinfo(dtype).max))
        return jax.random.randint(key, shape, lo, hi, dtype=jnp.int32).astype(dtype)
    return jax.random.uniform(key, shape, jnp.float32, low, high).astype(dtype)


def tol(dtype):
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.float16, jnp.bfloat16):
        return dict(rtol=2e-2, atol=2e-2)
    if dtype == jnp.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=0, atol=0)


def assert_close(actual, expected, dtype=None, **kw):
    dtype = dtype or jnp.asarray(expected).dtype
    t = {**tol(dtype), **kw}
    np.testing.assert_allclose(
        np.asarray(
            jnp.asarray(actual).astype(jnp.float32) if jnp.asarray(actual).dtype == jnp.bfloat16 else actual
        ),
        np.asarray(
            jnp.asarray(expected).astype(jnp.float32)
            if jnp.asarray(expected).dtype == jnp.bfloat16
            else expected
        ),
        **t,
    )


# Every kernel a test runs under Triton's interpreter is also compiled for
# these GPUs (without one): the generated source must be valid for the compiler.
COMPILE_TARGETS = (80, 90)


def check_compiles(f, args, compiler_params=None) -> None:
    """Compiles the kernel of the pallas_call ``f`` (called on ``args``) to a
    cubin for each of ``COMPILE_TARGETS``."""
    cp = compiler_params if isinstance(compiler_params, plgpu.CompilerParams) else plgpu.CompilerParams()
    check_all_compile(f, args, cp)


class Runner:
    """Calls pallas_call with the backend hook."""

    INTERPRET = not ON_DEVICE

    def call(self, kernel, out_shape, **kw):
        if not self.INTERPRET:
            return pl.pallas_call(kernel, out_shape, **kw)
        kw.setdefault("interpret", plgpu.InterpretParams())
        f = pl.pallas_call(kernel, out_shape, **kw)

        def run_and_compile(*args):
            out = f(*args)
            check_compiles(f, args, kw.get("compiler_params"))
            return out

        return run_and_compile


def whole(fn, *xs, out_shape=None):
    """Runs ``fn`` over whole-array blocks (grid of one program)."""

    def kernel(*refs):
        *ins, o = refs
        o[...] = fn(*[r[...] for r in ins])

    out = out_shape or jax.eval_shape(fn, *xs)
    return Runner().call(kernel, jax.ShapeDtypeStruct(out.shape, out.dtype))(*xs)


def whole_multi(fn, *xs):
    """Like ``whole`` for a ``fn`` returning a tuple of arrays."""
    outs = jax.eval_shape(fn, *xs)

    def kernel(*refs):
        ins, os = refs[: len(xs)], refs[len(xs) :]
        for o, v in zip(os, fn(*[r[...] for r in ins])):
            o[...] = v

    return Runner().call(kernel, tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs))(*xs)


def lowered(f, *args):
    """The generated Triton kernel (a ``LoweredKernel``) of the one pallas_call in ``f``."""
    from pallas_gpu._src.pallas_call_registration import lowered_kernel

    jaxpr = jax.make_jaxpr(f)(*args)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    return lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"], source_options(eqn))


def source_options(eqn) -> tuple:
    """The source options (``use_tma``, ...) of a pallas_call equation's
    compiler params, as the GPU lowering takes them."""
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


def ops_outside_kernels(f, *args) -> set[str]:
    """The primitives ``f`` runs outside its pallas_call kernels."""
    return {eqn.primitive.name for eqn in eqns_outside_kernels(f, *args)}


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


gpu = pytest.mark.gpu
