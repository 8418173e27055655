"""The MLIR lowering rule of ``pallas_call_p`` for the Triton backend.

The kernel is lowered to Triton source once per (jaxpr, grid mapping); then

* on a GPU: compiled with ``triton.compile`` for the device's compute
  capability and launched through ``jax_kernel_runtime.kernel_call`` (an XLA
  FFI custom call on XLA's stream);
* with ``interpret=plgpu.InterpretParams()``: run on the CPU by Triton's
  interpreter, inside a host callback, on any platform.

This module is pallas-gpu's ``pallas.backend.Backend`` (registered through the
``pallas.backends`` entry point); its members each take the call record.
"""

from __future__ import annotations

import functools
import math
import os
import weakref

import jax
import numpy as np
from jax.interpreters import mlir

import jax_kernel_runtime as jkr
from jax_kernel_runtime.triton import Pointer
from jax_kernel_runtime.triton import interpret as interpret_kernel
from pallas import backend as plb
from pallas_gpu._src.compile import autotune, compiler
from pallas_gpu._src.language.core import CompilerParams, InterpretParams
from pallas_gpu._src.lowering.kernel import lower_kernel  # with the rule modules, which fill the table
from pallas_gpu._src.lowering.lowering import LoweredKernel

PLATFORMS = ("cuda",)
COMPILER_PARAMS = CompilerParams
INTERPRET_PARAMS = InterpretParams
# The launch grid and the generated kernel need static sizes.
DYNAMIC_GRID = False

_lowered_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lowered_kernel(jaxpr, grid_mapping, options: tuple = (), aliases: tuple = ()) -> LoweredKernel:
    """The generated kernel, cached per grid mapping object (pallas-core
    keeps one per traced kernel), source options (``CompilerParams.source_options``)
    and ``input_output_aliases`` (``(input, output)`` pairs: an output aliased to
    an input the kernel reads is not kept in registers across sequential steps)."""
    per_gm = _lowered_cache.setdefault(grid_mapping, {})
    aliases = tuple(sorted((int(i), int(o)) for i, o in aliases))
    key = (id(jaxpr), options, aliases)
    if key not in per_gm:
        # pl.ds(i, n, 0) reads: one element, broadcast (Triton's pointer arithmetic would
        # do, but the lowering's windows assume a stride of at least 1).
        kernel = plb.broadcast_zero_stride_reads(jaxpr, grid_mapping.where)
        per_gm[key] = (jaxpr, lower_kernel(kernel, grid_mapping, dict(options), aliases))
    return per_gm[key][1]


def _source_options(cps: list[CompilerParams], gm) -> tuple:
    """The source options all of ``cps`` share (they share one generated kernel)."""
    first = cps[0].source_options()
    for i, c in enumerate(cps[1:], 1):
        for (name, a), (_, b) in zip(first, c.source_options()):
            if a != b:
                raise ValueError(
                    f"{gm.where}: compiler_params[{i}] has {name}={b!r} but compiler_params[0] has "
                    f"{name}={a!r}; the configs of one pallas_call share the generated kernel and "
                    f"differ only in compile options (num_warps, num_stages, ...): tune {name} with "
                    "plgpu.autotune (one pallas_call per config) instead"
                )
    return first


def _compiler_params_list(call) -> list[CompilerParams]:
    cps = list(call.all_compiler_params) or [CompilerParams()]
    if not all(isinstance(c, CompilerParams) for c in cps):
        raise TypeError(
            f"{call.where}: compiler_params for the Triton backend must "
            f"be a plgpu.CompilerParams or a list of them (autotuning), got {call.compiler_params!r}"
        )
    for i, c in enumerate(cps):
        c.validate(f"{call.where}: compiler_params" + (f"[{i}]" if len(cps) > 1 else ""))
    return cps


def describe() -> str:
    return "pallas_gpu"


def claims_interpret(call) -> bool:
    """Triton's interpreter runs only kernels that ask for it (``plgpu.InterpretParams``)."""
    return False


def check_compiler_params(call) -> tuple[CompilerParams, ...]:
    """The call's configs (one, or several to autotune over), checked."""
    return tuple(_compiler_params_list(call))


def _check_kernel(gm) -> None:
    if gm.num_scalar_prefetch:
        raise NotImplementedError(
            f"{gm.where}: scalar prefetch (PrefetchScalarGridSpec) is a TPU feature the GPU backend "
            "does not lower; run the kernel with interpret=pltpu.InterpretParams() (pallas-tpu) or use "
            "a plain grid"
        )


def _lowered(call, cps: list[CompilerParams]) -> LoweredKernel:
    gm = call.grid_mapping
    lk = lowered_kernel(call.jaxpr, gm, _source_options(cps, gm), tuple(call.input_output_aliases))
    if call.debug:
        print(f"The Triton kernel for pallas_call '{gm.kernel_name}' ({gm.source}):")
        print(lk.module_source(interpret=False))
    return lk


def lower(ctx, call, *args):
    """The kernel compiled by Triton for the GPU, launched by an XLA FFI custom call."""
    gm = call.grid_mapping
    _check_kernel(gm)
    cps = list(call.all_compiler_params)  # checked by check_compiler_params, which pallas-core ran
    lk = _lowered(call, cps)
    cc, device = _target(gm)
    fun = functools.partial(
        _gpu_call, lk=lk, gm=gm, aliases=call.input_output_aliases, cps=tuple(cps), cc=cc, device=device
    )
    return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)


def interpret(ctx, call, params: InterpretParams, *args):
    """The generated kernel run by Triton's interpreter on the CPU, in a host callback."""
    gm = call.grid_mapping
    _check_kernel(gm)
    try:
        cps = _compiler_params_list(call)
    except TypeError:
        cps = [CompilerParams()]  # params for another backend: the interpreter needs none
    lk = _lowered(call, cps)
    lk.module_source(interpret=True)  # uses the interpreter cannot run fail here, not in the callback
    fun = functools.partial(_interpret_call, lk=lk, gm=gm, aliases=call.input_output_aliases, params=params)
    return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)


# ---------------------------------------------------------------------------
# GPU


def _target(gm) -> tuple[int, str]:
    """(compute capability as an int, e.g. 90; device name for tuning keys).

    ``PALLAS_GPU_COMPUTE_CAPABILITY=90`` compiles for that capability
    without asking a device (e.g. ``jax.export`` for CUDA on a CPU machine).
    """
    forced = os.environ.get("PALLAS_GPU_COMPUTE_CAPABILITY", "")
    if forced:
        try:
            cc = int(forced.replace(".", "").removeprefix("sm_"))
        except ValueError:
            raise ValueError(
                f"{gm.where}: PALLAS_GPU_COMPUTE_CAPABILITY={forced!r} is not a compute capability "
                "(write 90 or 9.0 for sm_90)"
            ) from None
        return cc, f"sm_{cc}"
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        raise RuntimeError(
            f"{gm.where}: the kernel is being compiled for a CUDA GPU, but JAX sees no GPU "
            f"(devices: {', '.join(str(d) for d in jax.devices())}). To run it on the CPU pass "
            "interpret=True (plain JAX) or interpret=plgpu.InterpretParams() (the generated Triton "
            "code under Triton's interpreter); otherwise run on a machine with an NVIDIA GPU and "
            "jax[cuda] installed. To export for CUDA from here, set PALLAS_GPU_COMPUTE_CAPABILITY "
            "(e.g. 90)."
        )
    capability = getattr(devices[0], "compute_capability", None)
    if capability is None:
        raise RuntimeError(f"{gm.where}: cannot read the compute capability of {devices[0]}")
    major, minor = str(capability).split(".")
    return int(major) * 10 + int(minor), f"{devices[0].device_kind} sm_{major}{minor}"


def tune_key(lk: LoweredKernel, cps, shapes, device: str) -> str:
    """Identity of one autotuned ``pallas_call`` (hex sha256)."""
    return autotune.sha256(
        "pallas_call",
        lk.module_source(interpret=False),
        [sorted(cp.compile_options().items()) for cp in cps],
        [(tuple(shape), str(dtype)) for shape, dtype in shapes],
        device,
    )


def _gpu_call(*args, lk: LoweredKernel, gm, aliases, cps, cc, device):
    if math.prod(gm.grid) == 0:
        return [jax.numpy.zeros(a.shape, a.dtype) for a in gm.out_avals]
    compiled = compiler.compiled_configs(lk, cc, cps, gm.where)
    key = ""
    if len(compiled) > 1:
        shapes = [(bm.array_shape, bm.dtype) for bm in gm.block_mappings]
        key = tune_key(lk, [cp for cp, _ in compiled], shapes, device)
        winner = autotune.lookup_winner(key)
        if winner is not None and 0 <= winner < len(compiled):
            compiled, key = [compiled[winner]], ""
        else:
            autotune.expect_tuning(key)
    out_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in gm.out_avals]
    return jkr.kernel_call(
        *args,
        configs=[cfg for _, cfg in compiled],
        grid=lk.launch_grid,
        out_shapes=out_shapes,
        input_output_aliases=dict(aliases),
        name=lk.name,
        tune_key=key,
    )


# ---------------------------------------------------------------------------
# Triton's interpreter


def run_interpreted(lk: LoweredKernel, gm, aliases, params: InterpretParams, *arrays):
    """Runs the generated kernel under Triton's interpreter on host arrays."""
    fn = compiler.load_kernel(lk, interpret=True)
    ins = [np.array(a, copy=True, order="C") for a in arrays]
    alias_of = {o: i for i, o in aliases}
    outs = []
    for o, a in enumerate(gm.out_avals):
        outs.append(
            ins[alias_of[o]]
            if o in alias_of
            else np.full(a.shape, plb.uninitialized_fill(a.dtype, params.uninitialized), a.dtype)
        )
    if math.prod(gm.grid) > 0:
        # jax_kernel_runtime's interpreter: shared with jax-triton (one lock),
        # with bounds checks on every memory access and GPU bf16 rounding.
        bufs = [_device_layout(x) for x in ins + outs]
        args = {n: Pointer(t, b) for n, t, b in zip(fn.arg_names, lk.signature, bufs, strict=True)}
        interpret_kernel(fn.fn, lk.launch_grid, args, name=gm.where)
    return tuple(outs)


def _device_layout(x: np.ndarray) -> np.ndarray:
    """``x`` as the GPU holds it: bools as bytes, 4-bit ints packed two per
    byte (the even element in the low nibble), as XLA does."""
    if x.dtype == np.bool_:
        return x.view(np.int8)
    if x.dtype.name in ("int4", "uint4"):
        nibbles = x.reshape(-1).view(np.uint8) & 15
        nibbles = np.pad(nibbles, (0, nibbles.size % 2))
        return nibbles[0::2] | (nibbles[1::2] << 4)
    return x


def _interpret_call(*args, lk, gm, aliases, params):
    out_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in gm.out_avals]
    cb = functools.partial(run_interpreted, lk, gm, aliases, params)
    return jax.pure_callback(cb, out_shapes, *args, vmap_method="sequential")
