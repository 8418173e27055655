"""``run_mosaic``: executes a Mosaic TPU kernel module on the CPU with NumPy.

A Mosaic kernel module (what a Pallas TPU kernel lowers to, ours or JAX's) is
a ``func.func`` with the attributes Mosaic reads (``iteration_bounds``,
``window_params``, ``scalar_prefetch``, ``scratch_operands``,
``dimension_semantics``) plus one ``transform_i`` function per blocked
operand. This module runs it the way Mosaic's pipeline does, one grid point
at a time in Mosaic's (lexicographic) order:

* the kernel's arguments are the grid indices, then the scalar-prefetch
  operands (in SMEM), then one window per ``window_params`` entry (the
  ``pallas_call``'s inputs, then its outputs), then the scratch operands;
* a window with ``transform_indices`` is the block ``transform_i(grid
  indices, prefetch refs) * window_bounds`` of its array (arrays are padded
  to whole blocks, so edge blocks are in bounds); a window without one is the
  whole array (``pl.ANY``/HBM operands, moved by DMAs);
* an input's window is a NumPy view of its array; an output's is a buffer of
  its own, kept while consecutive grid steps visit the same block (Mosaic
  keeps it in VMEM between such revisits) and written back when the block
  index changes; a newly visited output block starts uninitialized (a TPU
  never reads an output block from HBM, not even one aliased to an input);
* ops are executed by their rules on NumPy values (``framework.py``: the op
  registry, the module prepared once, the walk; ``dialects/``: one rule
  module per dialect; ``values.py``: vectors are arrays, scalars 0-d arrays,
  memrefs ``Buffer``s, a NumPy view and its memory space). DMAs copy when started and count bytes on their semaphores;
  a wait takes its bytes back and fails if they are not there (a deadlock on
  a TPU). Every load, store and DMA is bounds checked, and an error names the
  op and its location in the module (for modules with debug locations: the
  kernel's source line).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np

from pallas_tpu._src.executor import kernel as kernel_module
from pallas_tpu._src.executor.dialects import (  # noqa: F401  (importing them registers their rules)
    arith,
    func,
    math,
    memref,
    scf,
    tpu_memory,
    tpu_mxu,
    tpu_vector,
    vector,
)
from pallas_tpu._src.executor.errors import MosaicError
from pallas_tpu._src.executor.framework import Executor, Program
from pallas_tpu._src.executor.kernel import Device, parse_module
from pallas_tpu._src.executor.mesh import Mesh
from pallas_tpu._src.executor.values import Buffer, allocate, uninitialized


def run_mosaic(
    module,
    *operands,
    out_shape,
    input_output_aliases: dict[int, int] | Sequence = (),
    num_devices: int = 1,
    mesh_shape: Sequence[int] | None = None,
    num_cores: int = 1,
    mxu_rounding: bool = False,
):
    """Executes a Mosaic kernel module on the CPU.

    Args:
      module: the module as MLIR text (``str``), bytecode (``bytes``, also
        Mosaic's serialized form) or an ``ir.Module``.
      *operands: the ``pallas_call``'s operands, scalar-prefetch operands
        first; for a grid with dynamic sizes (``iteration_bounds`` entries
        ``?``) the sizes come before them, one scalar each, as the custom
        call's first operands.
      out_shape: the ``pallas_call``'s ``out_shape`` (a ``ShapeDtypeStruct``
        or a pytree of them).
      input_output_aliases: ``{input index: output index}`` as ``pallas_call``
        takes it (indices count the scalar-prefetch operands).
      num_devices: run the kernel on this many devices at once (device ids
        ``0..num_devices-1``, as ``tpu.device_id`` and remote DMAs and signals
        see them). Every operand then has a leading axis of this size (device
        ``d`` gets ``operand[d]``), and so does every output, as a
        ``shard_map`` over the devices would see them.
      mesh_shape: run the kernel on an N-D mesh of devices of this shape
        instead (``num_devices`` is then its size or left out). Every operand
        and output has these leading axes: the device at mesh coordinates
        ``c`` gets ``operand[c]``. Device ids are logical: a device's id is
        its row-major position in the mesh (coordinates ``(i, j)`` of a
        ``(m, n)`` mesh are device ``i * n + j``), as ``shard_map`` numbers
        the devices of a mesh and as both lowerings flatten a
        ``DeviceIdType.MESH`` device id.
      num_cores: TensorCores per device (2 on a megacore chip such as TPU v4
        or v5p; a module does not say). Each core runs in a thread with its own
        VMEM/SMEM scratch, allocas and semaphores; the cores of one device
        share its HBM: the operands and outputs (their windows are blocks of
        them). The grid is split over the cores as Mosaic splits it: the first
        ``core_parallel`` axis in contiguous chunks of ``ceil(n / num_cores)``
        indices, or else the leading ``parallel`` axes' sub-grid in contiguous
        ranges; each core runs its grid points in order. ``tpu.core_id`` gives
        the core, and ``core_id`` operands of signals and DMAs name one.
      mxu_rounding: compute a float matmul (``tpu.matmul``) as a TPU's MXU
        does, in bfloat16 passes chosen by its contract precision: 32-bit
        operands rounded to bf16 (to nearest even) at the default precision
        (``lax.Precision.DEFAULT``: what the v5e's results equal), split into
        three bf16 products at ``bf16x3`` (``HIGH``), exact at ``fp32``
        (``HIGHEST``). By default (False) 32-bit float operands multiply exactly,
        as in TPU interpret mode, and a float32 kernel checked against a float32
        reference on the CPU may miss what the chip's rounding does to it.

    Returns:
      the outputs as NumPy arrays, in the structure of ``out_shape``.
    """
    num_devices, mesh_shape = _check_devices(num_cores, num_devices, mesh_shape)
    ctx = kernel_module.context()
    with ctx:
        mod = parse_module(module, ctx)
        kernel, funcs = kernel_module.kernel_funcs(mod)
        # the module's regions, prepared once for every core
        program = Program(funcs, mxu_rounding=bool(mxu_rounding))
        out_leaves, out_tree = jax.tree.flatten(out_shape)
        aliases = dict(input_output_aliases)
        mesh = Mesh(num_devices, shape=mesh_shape, num_cores=num_cores)
        if num_devices == 1 and mesh_shape is None and num_cores == 1:
            dev = kernel_module.prepare_device(kernel, operands, out_leaves, aliases)
            points = kernel_module.core_points(kernel, dev, 1)[0]
            return jax.tree.unflatten(out_tree, _run_core(program, dev, mesh, 0, points))
        lead = () if num_devices == 1 and mesh_shape is None else mesh.shape
        per_device = _split_operands(operands, lead, num_devices, mesh_shape)
        devs = [kernel_module.prepare_device(kernel, xs, out_leaves, aliases) for xs in per_device]
        unit_points = kernel_module.core_points(kernel, devs[0], num_cores)
        results = _run_units(ctx, program, devs, mesh, unit_points)
        outs = [
            np.stack([results[d * num_cores][o] for d in range(num_devices)]).reshape(*lead, *leaf.shape)
            for o, leaf in enumerate(out_leaves)
        ]
        return jax.tree.unflatten(out_tree, outs)


def _check_devices(num_cores, num_devices, mesh_shape) -> tuple[int, tuple[int, ...] | None]:
    """The number of devices and the mesh's shape, checked."""
    if not isinstance(num_cores, int) or num_cores < 1:
        raise ValueError(f"run_mosaic: num_cores must be a positive int, got {num_cores!r}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
        raise ValueError(f"run_mosaic: num_devices must be a positive int, got {num_devices!r}")
    if mesh_shape is not None:
        mesh_shape = tuple(int(n) for n in mesh_shape)
        size = int(np.prod(mesh_shape))
        if num_devices not in (1, size) or not mesh_shape or min(mesh_shape) < 1:
            raise ValueError(
                f"run_mosaic: mesh_shape={mesh_shape} ({size} devices) with num_devices={num_devices}"
            )
        num_devices = size
    return num_devices, mesh_shape


def _split_operands(operands, lead, num_devices, mesh_shape) -> list[list[np.ndarray]]:
    """Each device's operands: the operands' leading ``lead`` axes index the devices."""
    for i, x in enumerate(operands):
        if np.shape(x)[: len(lead)] != lead:
            what = f"mesh_shape={lead}" if mesh_shape is not None else f"num_devices={num_devices}"
            raise ValueError(
                f"run_mosaic: operand {i} has shape {list(np.shape(x))}; with {what} its leading "
                f"{'axes' if len(lead) > 1 else 'axis'} must be {list(lead)}"
            )
    flat = [np.asarray(x).reshape(num_devices, *np.shape(x)[len(lead) :]) for x in operands]
    return [[x[d] for x in flat] for d in range(num_devices)]


def _run_units(ctx, program, devs: list[Device], mesh: Mesh, points) -> list[Any]:
    """Runs every core of every device in its own thread; each unit's outputs
    (its device's). The first error raised is raised again, preferring one
    that is not another device's failure seen from here."""
    num_cores = mesh.num_cores
    results: list[Any] = [None] * mesh.num_units
    errors: list[BaseException] = []

    def unit(d):  # core d % num_cores of device d // num_cores
        try:
            with ctx:
                results[d] = _run_core(program, devs[d // num_cores], mesh, d, points[d % num_cores])
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            errors.append(e)
            mesh.fail(str(e))
        finally:
            with mesh.cv:
                mesh.done.add(d)
                mesh.cv.notify_all()

    threads = [threading.Thread(target=unit, args=(d,), daemon=True) for d in range(mesh.num_units)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if "another device failed" not in str(e)), errors[0])
    return results


def _run_core(program: Program, dev: Device, mesh: Mesh, device, points):
    """One core's run of the kernel over its grid points (``device``: its unit
    of ``mesh``); the outputs (its device's, shared by its cores)."""
    prefetch = [Buffer(np.array(x), "smem") for x in dev.prefetch]  # each core's own SMEM
    for k, arr in enumerate(dev.padded):
        mesh.register(device, ("window", k), arr)
    scratch = []
    for i, t in enumerate(dev.scratch_types):
        scratch.append(allocate(t, ("scratch", i)))
        mesh.register(device, ("scratch", i), cast(np.ndarray, scratch[-1].root))  # allocate sets root
    ex = Executor(program, mesh, device, dev.bounds)
    staged: dict[int, tuple[tuple[slice, ...], np.ndarray]] = {}  # a blocked output's VMEM window
    for point in points:
        idx = [np.int32(i) for i in point]
        views = [_window(ex, dev, k, idx, prefetch, staged) for k in range(len(dev.padded))]
        ex.call(dev.name, [*idx, *prefetch, *views, *scratch])
    for k, (where, block) in staged.items():
        dev.padded[k][where] = block
    with mesh.cv:  # the other devices' signals to this device are in once all are done
        mesh.done.add(device)
        mesh.cv.notify_all()
        mesh.wait(device, lambda: len(mesh.done) == mesh.num_units, "finishing", who=None)
    for i, b in enumerate(scratch):
        if b.is_semaphore and np.any(b.array != 0):
            raise MosaicError(
                f"run_mosaic: semaphore scratch operand {i} of {mesh.name(device)} holds {b.array.tolist()} when the "
                "kernel ends (a DMA or signal was not waited for)"
            )
    return [
        dev.padded[dev.n_in + o][tuple(slice(0, n) for n in leaf.shape)]
        for o, leaf in enumerate(dev.out_leaves)
    ]


def _window(ex: Executor, dev: Device, k: int, idx, prefetch, staged) -> Buffer:
    """Window ``k`` at the grid point ``idx``: an input's block of the array (a view); an
    output's block in a buffer of its own (``staged[k]``: where it goes, the buffer), kept
    while consecutive steps visit that block and written back when the block changes (and
    after the last step). A newly visited output block starts uninitialized, as the
    pipeline's VMEM buffer does on a TPU (it holds an earlier block's data there, never
    the array's: an output is not read from HBM, not even one aliased to an input)."""
    arr, w = dev.padded[k], dev.windows[k]
    shape, space = dev.win_types[k]
    if w.transform is None:
        if arr.ndim == 0 and shape == (1,):  # a rank-0 VMEM block: our lowering's memref<1xT>
            return Buffer(arr.reshape(1), space, key=("window", k), root=arr)
        view = arr[tuple(slice(0, n) for n in shape)] if arr.shape != shape else arr
        return Buffer(view, space, key=("window", k), root=arr, padded=arr if view is not arr else None)
    block = ex.call(w.transform, [*idx, *prefetch])
    bounds = cast(list[int], w.bounds)  # a window with a transform has its block shape
    starts = []
    for d, (b, n) in enumerate(zip(block, bounds)):
        s = int(b) * n
        if not 0 <= s <= arr.shape[d] - n:
            raise MosaicError(
                f"run_mosaic: @{w.transform} gave block index {int(b)} for dimension {d} of window {k} at grid "
                f"point {[int(i) for i in idx]}, outside the array of shape {list(arr.shape)} (window {w.bounds})"
            )
        starts.append(s)
    where = tuple(slice(s, s + n) for s, n in zip(starts, bounds))
    if k < dev.n_in:
        return Buffer(arr[where].reshape(shape), space, key=("window", k), root=arr)
    if k not in staged or staged[k][0] != where:
        if k in staged:
            arr[staged[k][0]] = staged[k][1]
        staged[k] = (where, uninitialized(tuple(bounds), arr.dtype))
    return Buffer(staged[k][1].reshape(shape), space, key=("window", k), root=staged[k][1])


def custom_call_bodies(hlo_text: str) -> list[bytes]:
    """The serialized Mosaic modules of the ``tpu_custom_call``s in a lowered
    or exported program's text (StableHLO), in program order: the program is
    parsed and each call's ``backend_config`` read through the bindings."""
    import base64
    import json

    from jax.interpreters import mlir
    from jaxlib.mlir import ir

    def walk(op):  # the ops under ``op``, in program order
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    yield inner.operation
                    yield from walk(inner.operation)

    out = []
    ctx = mlir.make_ir_context()  # stablehlo and the dialects a lowered program uses
    ctx.allow_unregistered_dialects = True
    with ctx:
        program = ir.Module.parse(hlo_text)
        for op in walk(program.operation):
            if op.name != "stablehlo.custom_call" or "backend_config" not in op.attributes:
                continue
            if ir.StringAttr(op.attributes["call_target_name"]).value != "tpu_custom_call":
                continue
            config = json.loads(ir.StringAttr(op.attributes["backend_config"]).value, strict=False)
            out.append(base64.b64decode(config["custom_call_config"]["body"]))
    return out
