"""The MLIR lowering rule of ``pallas_call_p`` for the Triton backend.

The kernel is lowered to Triton source once per (jaxpr, grid mapping); then

* on a GPU: compiled with ``triton.compile`` for the device's compute
  capability and launched through ``jax_kernel_runtime.kernel_call`` (an XLA
  FFI custom call on XLA's stream);
* with ``interpret=plgpu.InterpretParams()``: run on the CPU by Triton's
  interpreter, inside a host callback, on any platform.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.interpreters import mlir

from pallas_gpu._src import compiler
from pallas_gpu._src.core import CompilerParams, InterpretParams
from pallas_gpu._src.lowering import LoweredKernel, lower_kernel

_lowered_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lowered_kernel(jaxpr, grid_mapping) -> LoweredKernel:
    """The generated kernel, cached per grid mapping object (pallas-core
    keeps one per traced kernel)."""
    per_gm = _lowered_cache.setdefault(grid_mapping, {})
    key = id(jaxpr)
    if key not in per_gm:
        per_gm[key] = (jaxpr, lower_kernel(jaxpr, grid_mapping))
    return per_gm[key][1]


def _compiler_params_list(cp: Any, gm) -> list[CompilerParams]:
    if cp is None:
        return [CompilerParams()]
    if isinstance(cp, CompilerParams):
        return [cp]
    if isinstance(cp, (list, tuple)) and cp and all(isinstance(c, CompilerParams) for c in cp):
        return list(cp)
    raise TypeError(
        f"pallas_call '{gm.kernel_name}' at {gm.source}: compiler_params for the Triton backend must "
        f"be a plgpu.CompilerParams or a tuple of them (autotuning), got {cp!r}"
    )


def lower(ctx, *args, jaxpr, grid_mapping, input_output_aliases, interpret, debug, compiler_params, **_):
    gm = grid_mapping
    lk = lowered_kernel(jaxpr, gm)
    if debug:
        print(f"The Triton kernel for pallas_call '{gm.kernel_name}' ({gm.source}):")
        print(lk.module_source(interpret=False))
    if isinstance(interpret, InterpretParams):
        fun = functools.partial(_interpret_call, lk=lk, gm=gm, aliases=input_output_aliases, params=interpret)
        return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)
    cps = _compiler_params_list(compiler_params, gm)
    cc = _compute_capability(ctx)
    fun = functools.partial(_gpu_call, lk=lk, gm=gm, aliases=input_output_aliases, cps=tuple(cps), cc=cc)
    return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)


# ---------------------------------------------------------------------------
# GPU


def _compute_capability(ctx) -> int:
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices:
        raise RuntimeError("pallas_gpu: lowering for CUDA but JAX sees no GPU device")
    cc = getattr(devices[0], "compute_capability", None)
    if cc is None:
        raise RuntimeError(f"pallas_gpu: cannot read the compute capability of {devices[0]}")
    major, minor = str(cc).split(".")
    return int(major) * 10 + int(minor)


def launch_configs(lk: LoweredKernel, cc: int, cps: Sequence[CompilerParams]):
    """One ``jax_kernel_runtime.KernelConfig`` per compiler-params choice."""
    import jax_kernel_runtime as jkr

    configs = []
    for cp in cps:
        compiled = compiler.compile_kernel(lk, cc, tuple(sorted(cp.compile_options().items())))
        configs.append(jkr.config_from_triton(compiled))
    return configs


def _gpu_call(*args, lk: LoweredKernel, gm, aliases, cps, cc):
    import jax_kernel_runtime as jkr

    if math.prod(gm.grid) == 0:
        return [jax.numpy.zeros(a.shape, a.dtype) for a in gm.out_avals]
    configs = launch_configs(lk, cc, cps)
    out_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in gm.out_avals]
    return jkr.kernel_call(
        *args,
        configs=configs,
        grid=lk.launch_grid,
        out_shapes=out_shapes,
        input_output_aliases=dict(aliases),
        name=lk.name,
        tune_key=lk.name if len(configs) > 1 else "",
    )


# ---------------------------------------------------------------------------
# Triton's interpreter


class _HostBuffer:
    """What Triton's interpreter needs of a tensor argument (it expects
    torch tensors): a data pointer, a dtype, and storage methods that keep
    the data where it is."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args):
        return self

    def copy_(self, other):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return self.array.strides


def _uninitialized(shape, dtype, mode: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if mode == "zero":
        return np.zeros(shape, dtype)
    if np.issubdtype(dtype, np.floating) or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return np.full(shape, np.nan, dtype)
    if np.issubdtype(dtype, np.integer):
        return np.full(shape, np.iinfo(dtype).min, dtype)
    return np.zeros(shape, dtype)


def run_interpreted(lk: LoweredKernel, gm, aliases, params: InterpretParams, *arrays):
    """Runs the generated kernel under Triton's interpreter on host arrays."""
    fn = compiler.load_kernel(lk, interpret=True)
    ins = [np.array(a, copy=True, order="C") for a in arrays]
    alias_of = {o: i for i, o in aliases}
    outs = []
    for o, a in enumerate(gm.out_avals):
        outs.append(
            ins[alias_of[o]] if o in alias_of else _uninitialized(a.shape, a.dtype, params.uninitialized)
        )
    if math.prod(gm.grid) > 0:
        bufs = [_HostBuffer(x.view(np.int8) if x.dtype == np.bool_ else x) for x in ins + outs]
        fn[lk.launch_grid](*bufs)
    return tuple(outs)


def _interpret_call(*args, lk, gm, aliases, params):
    out_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in gm.out_avals]
    cb = functools.partial(run_interpreted, lk, gm, aliases, params)
    return jax.pure_callback(cb, out_shapes, *args, vmap_method="sequential")
