"""``kernel_call``: bind a compiled kernel image to JAX arrays via the XLA FFI."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import jax
import numpy as np
from jax import lax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.ffi import ffi_call, register_ffi_target, register_ffi_type
from jax.interpreters import mlir
from jaxlib import xla_client

from jax_kernel_runtime._config import (
    Buffer,
    KernelConfig,
    Param,
    Scalar,
    encode_attributes,
    normalize_grid,
)

try:
    from jax_kernel_runtime import _jax_kernel_runtime as _native

    _native_error: ImportError | None = None
except ImportError as e:  # a missing or broken build: GPU launches fail (native()), the rest works
    _native = None  # type: ignore[assignment]  # mypy's optional-import idiom: no Optional module type
    _native_error = e

#: The name of the runtime's XLA FFI custom-call target (platform CUDA).
TARGET_NAME = "jax_kernel_runtime_launch"
_registered = False
_lock = threading.Lock()


def native_missing() -> str:
    """Why the native extension cannot be imported ("" when it can)."""
    if _native_error is None:
        return ""
    return (
        "jax-kernel-runtime's native extension (jax_kernel_runtime._jax_kernel_runtime) cannot be "
        f"imported ({_native_error}), so kernels cannot be launched on a GPU. Reinstall the "
        "jax-kernel-runtime wheel built for this platform and Python (pip install --force-reinstall "
        "jax-kernel-runtime); Triton's interpreter on the CPU works without it."
    )


def native():
    """The native extension; an ImportError naming the wheel without it."""
    if _native is None:
        raise ImportError(native_missing()) from _native_error
    return _native


def register() -> None:
    """Registers the FFI target and its state type for platform CUDA.

    Idempotent and cheap; ``kernel_call`` calls it. Importing
    ``jax_kernel_runtime`` calls it, and so does JAX's plugin discovery
    (``jax_kernel_runtime.jax_plugin``), so a process that only deserializes
    an exported function containing the target need not.
    """
    global _registered
    with _lock:
        if _registered:
            return
        for type_name, registration in native().type_registrations().items():
            register_ffi_type(type_name, registration, platform="CUDA")
        for name, stages in native().registrations().items():
            register_ffi_target(
                name,
                stages,
                platform="CUDA",
                api_version=1,
                traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE,
            )
        _registered = True


def export_disabled_checks() -> list:
    """The ``disabled_checks`` that ``jax.export.export`` needs for our target.

    jax.export refuses custom calls it does not know to be stable; this one is
    versioned by the jax-kernel-runtime release (see RUNTIME.md).
    """
    return [jax.export.DisabledSafetyCheck.custom_call(TARGET_NAME)]


def kernel_call(
    *args: jax.Array,
    configs: Sequence[KernelConfig],
    grid: int | Sequence[int] | Sequence[Sequence[int]],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    params: Sequence[Param] | None = None,
    input_output_aliases: Mapping[int, int] | None = None,
    zeroed_outputs: Sequence[int] = (),
    name: str = "kernel",
    tune_key: str = "",
) -> list[jax.Array]:
    """Launches a compiled kernel on ``args`` and returns its outputs.

    Lowers to one XLA FFI custom call for platform CUDA; under ``jit`` the
    kernel runs on XLA's stream with no host round trip.

    Args:
      *args: input arrays (operands ``0..len(args)-1``).
      configs: one or more compiled configurations; with several, the runtime
        autotunes on the first execution on each device.
      grid: programs per axis (int or 1-3 ints), or a list with one such grid
        per config (Triton grids usually depend on the config's block sizes).
      out_shapes: shapes/dtypes of the outputs (operands ``len(args)..``).
      params: the kernel's parameters in order; by default every operand, in
        order, as a 16-byte aligned buffer.
      input_output_aliases: ``{input index: output index}``: the output
        reuses the input's buffer (the kernel updates it in place).
      zeroed_outputs: output indices the runtime zeroes before each launch.
      name: shown in every error message.
      tune_key: identifies the call in ``tune_records()``.

    Returns:
      The list of outputs.
    """
    if not configs:
        raise ValueError(f"kernel_call {name!r}: needs at least one KernelConfig")
    if isinstance(grid, list) and grid and not isinstance(grid[0], (int, np.integer)):
        if len(grid) != len(configs):
            raise ValueError(f"kernel_call {name!r}: {len(grid)} grids for {len(configs)} configs")
        grids = [normalize_grid(g, name) for g in grid]
    else:
        grids = [normalize_grid(grid, name)] * len(configs)
    out_shapes = list(out_shapes)
    num_operands = len(args) + len(out_shapes)
    if params is None:
        params = [Buffer(i) for i in range(num_operands)]
    aliases = dict(input_output_aliases or {})
    _check(name, args, out_shapes, configs, params, aliases, zeroed_outputs)
    scratch = max(cfg.scratch_bytes(g) for cfg, g in zip(configs, grids))
    result_shapes = list(out_shapes)
    if scratch:
        result_shapes.append(jax.ShapeDtypeStruct((scratch,), np.uint8))
    attrs = encode_attributes(
        name=name,
        configs=configs,
        grids=grids,
        params=params,
        zeroed_outputs=zeroed_outputs,
        aliased_inputs=sorted(aliases),
        scratch_output=bool(scratch),
        tune_key=tune_key,
    )
    launch = _Launch(name, tuple(result_shapes), tuple(sorted(aliases.items())), attrs)
    results = kernel_call_p.bind(*args, launch=launch)
    return list(results[: len(out_shapes)])


class _Launch:
    """The static parameters of one ``kernel_call_p``; equal when their values are."""

    def __init__(self, name, result_shapes, aliases, attrs):
        self.name, self.result_shapes, self.aliases, self.attrs = name, result_shapes, aliases, attrs
        key = [
            (k, np.asarray(v).dtype.str, np.asarray(v).shape, np.asarray(v).tobytes())
            for k, v in sorted(attrs.items())
        ]
        self._key = (name, tuple((s.shape, str(s.dtype)) for s in result_shapes), aliases, tuple(key))
        self._hash = hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Launch) and self._key == other._key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"kernel {self.name!r}"


def _cuda_lowering(ctx, *args, launch: _Launch):
    register()
    call = ffi_call(
        TARGET_NAME,
        list(launch.result_shapes),
        input_output_aliases=dict(launch.aliases),
        has_side_effect=False,
    )

    def body(*a):
        if launch.aliases:
            # XLA's dynamic-slice fusion wraps a custom call whose operands are contiguous,
            # aligned slices (x[:, rows] of a batch of one) into a fusion that passes the
            # slices as addresses; with outputs aliased to inputs it then lost the copy that
            # one value passed as two aliased operands needs (chained pallas_calls whose first
            # call gets one zeros array as dK and dV: both outputs in one buffer: a flash-attention
            # backward's dK came out wrong on the H200). The barrier keeps aliased calls out of that fusion.
            a = lax.optimization_barrier(a)
        return call(*a, **launch.attrs)

    return mlir.lower_fun(body, multiple_results=True)(ctx, *args)


def kernel_primitive(
    name: str,
    result_shapes: Callable[..., Sequence],
    rules: dict,
    *,
    kernel_name: Callable[..., str],
    elsewhere: str,
) -> Primitive:
    """A primitive ``name`` that launches kernels: several results, of the shapes and dtypes
    ``result_shapes(**params)`` gives; evaluated eagerly by compiling its lowering (as ``jit``
    would); lowered by ``rules`` (platform name -> MLIR lowering rule). Lowering it for any other
    platform raises ``NotImplementedError("<name> '<kernel_name(**params)>' cannot run on platform
    <platforms>: <elsewhere>")``, not XLA's "No FFI handler registered" when compiling."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(
        lambda *avals, **params: [jax.core.ShapedArray(s.shape, s.dtype) for s in result_shapes(**params)]
    )

    def refuse(ctx, *args, **params):
        platforms = ", ".join(ctx.module_context.platforms)
        raise NotImplementedError(
            f"{name} {kernel_name(**params)!r} cannot run on platform {platforms}: {elsewhere}"
        )

    mlir.register_lowering(prim, refuse)
    for platform, rule in rules.items():
        mlir.register_lowering(prim, rule, platform=platform)
    return prim


# A primitive of our own (rather than a bare ffi_call), so that lowering for a platform
# other than CUDA fails saying what to use instead.
kernel_call_p = kernel_primitive(
    "kernel_call",
    lambda launch: launch.result_shapes,
    {"cuda": _cuda_lowering},
    kernel_name=lambda launch: launch.name,
    elsewhere=(
        "jax_kernel_runtime launches compiled kernel images (cubins) on CUDA GPUs only, and needs a "
        "CUDA GPU. On a CPU, run Triton kernels with jax_triton.triton_call (Triton's interpreter) "
        "and Pallas kernels with interpret=True; to only build the GPU program here, lower with "
        "lowering_platforms=('cuda',) or jax.export(..., platforms=['cuda'])."
    ),
)


def _check(name, args, out_shapes, configs, params, aliases, zeroed_outputs) -> None:
    """Trace-time checks of ``kernel_call``'s arguments; errors name the kernel."""
    where = f"kernel_call {name!r}"
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, KernelConfig):
            raise TypeError(f"{where}: configs[{i}] is {type(cfg).__name__}; expected a KernelConfig")
    operands = [("argument", i, a) for i, a in enumerate(args)] + [
        ("out_shapes", i, o) for i, o in enumerate(out_shapes)
    ]
    for kind, i, a in operands:
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{where}: {kind} {i} is {a!r:.60}; expected an array or jax.ShapeDtypeStruct")
        # The image was compiled for this dtype: JAX passing another (float64 -> float32 while
        # x64 is off) would make the kernel read or write the wrong number of bytes.
        canonical = jax.dtypes.canonicalize_dtype(a.dtype)
        if np.dtype(a.dtype) != canonical:
            raise TypeError(
                f"{where}: {kind} {i} has dtype {np.dtype(a.dtype).name}, but with x64 off JAX "
                f"passes {canonical.name}; convert it (and compile the kernel for {canonical.name}) "
                f"or enable x64 (jax.config.update('jax_enable_x64', True))"
            )
    num_operands = len(args) + len(out_shapes)
    for k, p in enumerate(params):
        if not isinstance(p, (Buffer, Scalar)):
            raise TypeError(
                f"{where}: params[{k}] is {p!r:.60}; expected jax_kernel_runtime.Buffer or Scalar"
            )
        if isinstance(p, Buffer) and p.operand >= num_operands:
            raise ValueError(
                f"{where}: parameter refers to operand {p.operand} "
                f"but there are {num_operands} (inputs then outputs)"
            )
    for i, o in aliases.items():
        if not (_is_index(i, len(args)) and _is_index(o, len(out_shapes))):
            raise ValueError(f"{where}: input_output_aliases entry {i}: {o} is out of range")
        a, b = args[i], out_shapes[o]
        if (tuple(a.shape), np.dtype(a.dtype)) != (tuple(b.shape), np.dtype(b.dtype)):
            raise ValueError(
                f"{where}: input_output_aliases entry {i}: {o}: input {i} is "
                f"{np.dtype(a.dtype).name}{list(a.shape)} but output {o} is "
                f"{np.dtype(b.dtype).name}{list(b.shape)}; aliased buffers must match"
            )
    if len(set(aliases.values())) != len(aliases):
        raise ValueError(f"{where}: input_output_aliases {aliases} aliases one output to several inputs")
    for o in zeroed_outputs:
        if not _is_index(o, len(out_shapes)):
            raise ValueError(f"{where}: zeroed output {o!r} out of range (outputs 0..{len(out_shapes) - 1})")


def _is_index(i, n: int) -> bool | np.bool_:
    return isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < n


def tune_records() -> list[tuple[str, int, int, list[float]]]:
    """Autotuning results of this process.

    Each is ``(tune_key, device ordinal, chosen config index, median time in
    ms per config, negative where a config failed)``.
    """
    return _native.tune_records() if _native is not None else []


def launch_counts() -> tuple[int, int]:
    """``(direct, captured)`` kernel launches of this process so far.

    ``direct`` launches went straight onto a stream; ``captured`` ones were
    recorded while XLA captured a CUDA graph (command buffers), so replays of
    that graph run them without calling the runtime again.
    """
    return cast(tuple[int, int], tuple(_native.launch_counts())) if _native is not None else (0, 0)


def driver_error() -> str:
    """Why the CUDA driver cannot be used here ("" when it can)."""
    return _native.driver_error() if _native is not None else native_missing()
