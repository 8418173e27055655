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
* windows are NumPy views of the arrays, so a revisited output block keeps
  what earlier grid steps wrote to it (Mosaic keeps it in VMEM between
  revisits and writes it back when the block index changes);
* ops are executed by the table in ``ops.py`` on NumPy values: vectors
  are arrays, scalars 0-d arrays, memrefs ``Buffer``s (a NumPy view and its
  memory space). DMAs copy when started and count bytes on their semaphores;
  a wait takes its bytes back and fails if they are not there (a deadlock on
  a TPU). Every load, store and DMA is bounds checked, and an error names the
  op and its location in the module (for modules with debug locations: the
  kernel's source line).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pallas_tpu._src.executor import memory, ops
from pallas_tpu._src.executor import vector as executor_vector  # noqa: F401  (registers the vector rules)

Buffer = ops.Buffer
MosaicError = ops.MosaicError


def _context():
    from jax.interpreters import mlir
    from jaxlib.mosaic.python import tpu

    ctx = mlir.make_ir_context()  # the upstream dialects (func, arith, vector, scf, math, memref)
    tpu.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    return ctx


def parse_module(module, ctx=None):
    """An ``ir.Module`` from MLIR text or bytecode (also Mosaic's serialized
    form, as stored in a ``tpu_custom_call``'s backend config)."""
    from jaxlib.mlir import ir, passmanager

    if isinstance(module, ir.Module):
        return module
    if not isinstance(module, (str, bytes, bytearray)):
        raise TypeError(
            "run_mosaic: module must be a Mosaic module as MLIR text (str), bytecode (bytes) or an "
            f"ir.Module (e.g. pltpu.mosaic_modules(fn, *args)[0]), got {type(module).__name__} {module!r:.80}"
        )
    ctx = ctx or _context()
    with ctx, ir.Location.unknown():
        mod = ir.Module.parse(module)
        if "stable_mosaic.version" in mod.operation.attributes:
            passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(mod.operation)
            del mod.operation.attributes["stable_mosaic.version"]  # now in the current form
    return mod


def _funcs(mod) -> tuple[Any, dict[str, Any]]:
    funcs = {}
    kernel = None
    for op in mod.body.operations:
        if op.operation.name != "func.func":
            continue
        name = op.attributes["sym_name"].value
        funcs[name] = op
        if "window_params" in op.attributes or "iteration_bounds" in op.attributes:
            if kernel is not None:
                raise ValueError(
                    f"run_mosaic: the module has two kernel functions, @{kernel.attributes['sym_name'].value} and @{name}"
                )
            kernel = op
    if kernel is None:  # a kernel with no grid and no blocks has neither attribute
        plain = [f for n, f in funcs.items() if not n.startswith("transform_")]
        if len(plain) != 1:
            raise ValueError("run_mosaic: the module has no kernel function (a func.func with window_params)")
        kernel = plain[0]
    return kernel, funcs


def _ints(attr) -> list[int]:
    from jaxlib.mlir import ir

    return list(ir.DenseI64ArrayAttr(attr)) if attr is not None else []


@dataclasses.dataclass(frozen=True)
class _Window:
    """One entry of the kernel's ``window_params``: the function giving the
    block index at a grid point and the block shape; ``None`` for a whole array."""

    transform: str | None = None
    bounds: list[int] | None = None


def _window_params(kernel) -> list[_Window]:
    from jaxlib.mlir import ir

    if "window_params" not in kernel.attributes:
        return []
    out = []
    for a in ir.ArrayAttr(kernel.attributes["window_params"]):
        d = ir.DictAttr(a)
        out.append(
            _Window(
                transform=ir.FlatSymbolRefAttr(d["transform_indices"]).value
                if "transform_indices" in d
                else None,
                bounds=_ints(d["window_bounds"]) if "window_bounds" in d else None,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class _Device:
    """One device's run of the kernel, prepared once (``_prepare``) and shared by
    its cores: the grid and the kernel's arguments, and its HBM (the operands and
    outputs, padded to whole blocks)."""

    bounds: list[int]  # the grid, dynamic sizes resolved
    nsp: int  # scalar-prefetch arguments
    windows: list[_Window]  # one per window argument (inputs, then outputs)
    args: list[Any]  # the kernel's block arguments (grid indices, prefetch, windows, scratch)
    nwin: int
    n_in: int  # windows that are inputs
    prefetch: list[np.ndarray]  # the scalar-prefetch operands (each core copies them into its SMEM)
    win_args: list[Any]  # the window arguments of ``args``
    padded: list[np.ndarray]  # each window's array in HBM
    out_leaves: list[Any]  # out_shape's leaves


def _int_attr(kernel, name, default=0) -> int:
    from jaxlib.mlir import ir

    return ir.IntegerAttr(kernel.attributes[name]).value if name in kernel.attributes else default


def run_mosaic(
    module,
    *operands,
    out_shape,
    input_output_aliases: dict[int, int] | Sequence = (),
    num_devices: int = 1,
    mesh_shape: Sequence[int] | None = None,
    num_cores: int = 1,
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
        share its HBM: the operands and outputs (every window is a view of
        them). The grid is split over the cores as Mosaic splits it: the first
        ``core_parallel`` axis in contiguous chunks of ``ceil(n / num_cores)``
        indices, or else the leading ``parallel`` axes' sub-grid in contiguous
        ranges; each core runs its grid points in order. ``tpu.core_id`` gives
        the core, and ``core_id`` operands of signals and DMAs name one.

    Returns:
      the outputs as NumPy arrays, in the structure of ``out_shape``.
    """
    import threading

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
    ctx = _context()
    with ctx:
        mod = parse_module(module, ctx)
        kernel, funcs = _funcs(mod)
        out_leaves, out_tree = jax.tree.flatten(out_shape)
        aliases = dict(input_output_aliases)
        mesh = ops.Mesh(num_devices, shape=mesh_shape, num_cores=num_cores)
        single = num_devices == 1 and mesh_shape is None
        if single and num_cores == 1:
            dev = _prepare(kernel, operands, out_leaves, aliases)
            outs = _run_core(kernel, funcs, dev, mesh, 0, _core_points(kernel, dev, 1)[0])
            return jax.tree.unflatten(out_tree, outs)
        lead = () if single else mesh.shape
        for i, x in enumerate(operands):
            if np.shape(x)[: len(lead)] != lead:
                what = f"mesh_shape={lead}" if mesh_shape is not None else f"num_devices={num_devices}"
                raise ValueError(
                    f"run_mosaic: operand {i} has shape {list(np.shape(x))}; with {what} its leading "
                    f"{'axes' if len(lead) > 1 else 'axis'} must be {list(lead)}"
                )
        flat = [np.asarray(x).reshape(num_devices, *np.shape(x)[len(lead) :]) for x in operands]
        devs = [_prepare(kernel, [x[d] for x in flat], out_leaves, aliases) for d in range(num_devices)]
        points = _core_points(kernel, devs[0], num_cores)
        results: list[Any] = [None] * mesh.num_units
        errors: list[BaseException] = []

        def device(d):  # d: a unit, core d % num_cores of device d // num_cores
            try:
                with ctx:
                    results[d] = _run_core(
                        kernel, funcs, devs[d // num_cores], mesh, d, points[d % num_cores]
                    )
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                errors.append(e)
                mesh.fail(str(e))
            finally:
                with mesh.cv:
                    mesh.done.add(d)
                    mesh.cv.notify_all()

        threads = [threading.Thread(target=device, args=(d,), daemon=True) for d in range(mesh.num_units)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = next((e for e in errors if "another device failed" not in str(e)), errors[0])
            raise first
        outs = [
            np.stack([results[d * num_cores][o] for d in range(num_devices)]).reshape(
                *lead, *out_leaves[o].shape
            )
            for o in range(len(out_leaves))
        ]
        return jax.tree.unflatten(out_tree, outs)


def _check_dtype(kernel_name: str, what: str, given: np.dtype, memref_type) -> None:
    """Arrays are the module's memrefs: run_mosaic converts nothing (a bool
    array is an i32 memref, as the custom call passes it; Mosaic's integers
    are signless, so uint32 is an i32 memref too)."""
    want = ops.np_dtype(memref_type)
    if given == want or (given == np.bool_ and want == np.int32):
        return
    if given.kind in "iu" and want.kind in "iu" and given.itemsize == want.itemsize:
        return
    fix = (
        f"give it dtype {want.name}"
        if what.startswith("out_shape")
        else f"pass a {want.name} array (x.astype(jnp.{want.name}) if a conversion is meant)"
    )
    raise TypeError(
        f"run_mosaic of kernel @{kernel_name}: {what} has dtype {given.name}, but the module's memref for it is "
        f"{memref_type} "
        f"({want.name}); {fix}"
    )


def _prepare(kernel, operands, out_leaves, aliases) -> _Device:
    """One device's arrays (its HBM, shared by its cores) and grid."""
    bounds = _ints(kernel.attributes["iteration_bounds"]) if "iteration_bounds" in kernel.attributes else []
    ndyn = sum(b < 0 for b in bounds)  # dynamic grid sizes ('?'): the first operands, as the custom call's
    sizes, operands = operands[:ndyn], operands[ndyn:]
    nsp = _int_attr(kernel, "scalar_prefetch")
    nscratch = _int_attr(kernel, "scratch_operands")
    windows = _window_params(kernel)
    args = list(kernel.regions[0].blocks[0].arguments)
    nwin = len(windows) if windows else len(args) - len(bounds) - nsp - nscratch
    windows = windows or [_Window()] * nwin  # no grid, whole arrays
    n_in = nwin - len(out_leaves)
    if n_in != len(operands) - nsp or n_in < 0 or any(np.ndim(x) != 0 for x in sizes):
        raise ValueError(
            f"run_mosaic: the kernel takes {nwin} windows, so with {len(out_leaves)} outputs it expects "
            + (f"{ndyn} grid-size + " if ndyn else "")
            + f"{nsp} scalar-prefetch + {nwin - len(out_leaves)} operands; got {len(sizes) + len(operands)} operands"
        )
    it = iter(max(int(np.asarray(x)), 0) for x in sizes)
    bounds = [next(it) if b < 0 else b for b in bounds]
    name = kernel.attributes["sym_name"].value
    prefetch_args = args[len(bounds) : len(bounds) + nsp]
    win_args = args[len(bounds) + nsp : len(bounds) + nsp + nwin]
    for k, (x, a) in enumerate(zip(operands[:nsp], prefetch_args)):
        _check_dtype(name, f"scalar-prefetch operand {k + ndyn}", np.asarray(x).dtype, a.type)
    for k, (x, a) in enumerate(zip(operands[nsp:], win_args)):
        _check_dtype(name, f"operand {k + ndyn + nsp}", np.asarray(x).dtype, a.type)
    for o, (leaf, a) in enumerate(zip(out_leaves, win_args[n_in:])):
        _check_dtype(name, f"out_shape[{o}]", np.dtype(leaf.dtype), a.type)
    arrays = [np.array(x) for x in operands[nsp:]]
    for o, leaf in enumerate(out_leaves):
        src = {v: k for k, v in aliases.items()}.get(o)
        if src is not None:
            arrays.append(np.array(operands[src], dtype=leaf.dtype))
        else:
            arrays.append(ops.uninitialized(leaf.shape, leaf.dtype))
    padded = []
    for k, arr in enumerate(arrays):
        w = windows[k]
        if w.transform is not None:
            pads = [(0, -n % b) for n, b in zip(arr.shape, w.bounds)]
            arr = np.pad(arr, pads) if any(p for _, p in pads) else np.ascontiguousarray(arr)
        else:  # a whole array: stored padded to its memory tiling, the padding poisoned
            tiled = memory.tiled_shape(win_args[k].type)
            if tiled != arr.shape and len(tiled) == arr.ndim:
                store = np.full(tiled, memory.padding_fill(arr.dtype), arr.dtype)
                store[tuple(slice(0, n) for n in arr.shape)] = arr
                arr = store
        padded.append(arr)
    return _Device(
        bounds=bounds,
        nsp=nsp,
        windows=windows,
        args=args,
        nwin=nwin,
        n_in=n_in,
        prefetch=[np.array(x) for x in operands[:nsp]],
        win_args=win_args,
        padded=padded,
        out_leaves=out_leaves,
    )


def _core_points(kernel, dev: _Device, num_cores) -> list[list[tuple[int, ...]]]:
    """Each core's grid points, in order (see ``run_mosaic``'s ``num_cores``)."""
    from jaxlib.mlir import ir

    bounds = dev.bounds
    points = list(itertools.product(*(range(b) for b in bounds)))
    if num_cores == 1:
        return [points]
    sems = []
    if "dimension_semantics" in kernel.attributes:
        for a in ir.ArrayAttr(kernel.attributes["dimension_semantics"]):
            sems.append(ops.enum_attr(a))
    core_axes = [a for a, m in enumerate(sems) if m in ("core_parallel", "subcore_parallel")]
    if core_axes:
        a = core_axes[0]
        chunk = -(-bounds[a] // num_cores)
        return [[p for p in points if p[a] // chunk == c] for c in range(num_cores)]
    prefix = 0
    while prefix < len(sems) and prefix < len(bounds) and sems[prefix] == "parallel":
        prefix += 1
    if prefix == 0:  # nothing to split: core 0 runs the grid, the others nothing
        return [points] + [[] for _ in range(num_cores - 1)]
    sub = int(np.prod(bounds[:prefix]))
    per_core = -(-sub // num_cores) * (len(points) // sub) if sub else 0
    return [points[c * per_core : (c + 1) * per_core] for c in range(num_cores)]


def _run_core(kernel, funcs, dev: _Device, mesh, device, points):
    """One core's run of the kernel over its grid points (``device``: its unit
    of ``mesh``); the outputs (its device's, shared by its cores)."""
    bounds, nsp, windows, args = dev.bounds, dev.nsp, dev.windows, dev.args
    nwin, n_in, win_args, padded = dev.nwin, dev.n_in, dev.win_args, dev.padded
    out_leaves = dev.out_leaves
    prefetch = [Buffer(np.array(x), "smem") for x in dev.prefetch]  # each core's own SMEM
    for k, arr in enumerate(padded):
        mesh.register(device, ("window", k), arr)
    scratch = []
    for i, a in enumerate(args[len(bounds) + nsp + nwin :]):
        scratch.append(ops.allocate(a.type, ("scratch", i)))
        mesh.register(device, ("scratch", i), scratch[-1].root)
    ex = ops.Executor(funcs, mesh, device)
    ex.iteration_bounds = bounds
    for point in points:
        idx = [np.int32(i) for i in point]
        views = []
        for k, (arr, arg) in enumerate(zip(padded, win_args)):
            w = windows[k]
            views.append(_window(ex, arr, arg, w, idx, prefetch, k))
        ex.call(kernel, [*idx, *prefetch, *views, *scratch])
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
    return [padded[n_in + o][tuple(slice(0, n) for n in leaf.shape)] for o, leaf in enumerate(out_leaves)]


def _window(ex, arr, arg, w, idx, prefetch, k):
    from jaxlib.mlir import ir

    mt = ir.MemRefType(arg.type)
    space = ops.memory_space(mt)
    if w.transform is None:
        shape = tuple(mt.shape)
        if arr.ndim == 0 and shape == (1,):  # a rank-0 VMEM block: our lowering's memref<1xT>
            return Buffer(arr.reshape(1), space, key=("window", k), root=arr)
        view = arr[tuple(slice(0, n) for n in shape)] if arr.shape != shape else arr
        return Buffer(view, space, key=("window", k), root=arr, padded=arr if view is not arr else None)
    block = ex.call(ex.funcs[w.transform], [*idx, *prefetch])
    starts = []
    for d, (b, n) in enumerate(zip(block, w.bounds)):
        s = int(b) * n
        if not 0 <= s <= arr.shape[d] - n:
            raise MosaicError(
                f"run_mosaic: @{w.transform} gave block index {int(b)} for dimension {d} of window {k} at grid "
                f"point {[int(i) for i in idx]}, outside the array of shape {list(arr.shape)} (window {w.bounds})"
            )
        starts.append(s)
    view = arr[tuple(slice(s, s + n) for s, n in zip(starts, w.bounds))]
    return Buffer(view.reshape(tuple(mt.shape)), space, key=("window", k), root=arr)


def custom_call_bodies(hlo_text: str) -> list[bytes]:
    """The serialized Mosaic modules of the ``tpu_custom_call``s in a lowered
    or exported program's text (StableHLO), in program order."""
    import base64
    import json
    import re

    out = []
    for m in re.finditer(
        r"stablehlo\.custom_call @tpu_custom_call\(.*?backend_config = \"((?:[^\"\\]|\\.)*)\"", hlo_text
    ):
        raw = re.sub(r"\\([0-9A-Fa-f]{2})", lambda e: chr(int(e.group(1), 16)), m.group(1))
        out.append(base64.b64decode(json.loads(raw, strict=False)["custom_call_config"]["body"]))
    return out
