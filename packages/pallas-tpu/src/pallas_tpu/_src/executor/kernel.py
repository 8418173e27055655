"""A Mosaic kernel module as ``run_mosaic`` reads it (see ``run.py``): the
module parsed, its kernel and ``transform_i`` functions found, the kernel's
attributes read (``iteration_bounds``, ``window_params``, ``scalar_prefetch``,
``scratch_operands``, ``dimension_semantics``), one device's arrays checked
against the kernel's memrefs and laid out in its HBM (``prepare_device``), and
the grid split over a device's cores (``core_points``)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, cast

import numpy as np

from pallas import backend as plb
from pallas_tpu._src.executor import memory
from pallas_tpu._src.executor.attrs import enum_attr
from pallas_tpu._src.executor.values import memory_space, np_dtype, uninitialized


def context():
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
    ctx = ctx or context()
    with ctx, ir.Location.unknown():
        mod = ir.Module.parse(module)
        if "stable_mosaic.version" in mod.operation.attributes:
            passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(mod.operation)
            del mod.operation.attributes["stable_mosaic.version"]  # now in the current form
    return mod


def kernel_funcs(mod) -> tuple[Any, dict[str, Any]]:
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
class Window:
    """One entry of the kernel's ``window_params``: the function giving the
    block index at a grid point and the block shape; ``None`` for a whole array."""

    transform: str | None = None
    bounds: list[int] | None = None


def _window_params(kernel) -> list[Window]:
    from jaxlib.mlir import ir

    if "window_params" not in kernel.attributes:
        return []
    out = []
    for a in ir.ArrayAttr(kernel.attributes["window_params"]):
        d = ir.DictAttr(a)
        out.append(
            Window(
                transform=ir.FlatSymbolRefAttr(d["transform_indices"]).value
                if "transform_indices" in d
                else None,
                bounds=_ints(d["window_bounds"]) if "window_bounds" in d else None,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class Device:
    """One device's run of the kernel, prepared once (``prepare_device``) and
    shared by its cores: the grid and the kernel's arguments, and its HBM (the
    operands and outputs, padded to whole blocks)."""

    name: str  # the kernel function's
    bounds: list[int]  # the grid, dynamic sizes resolved
    windows: list[Window]  # one per window argument (inputs, then outputs)
    win_types: list[tuple[tuple[int, ...], str]]  # each window argument's memref shape and memory space
    scratch_types: list[Any]  # the scratch arguments' memref types
    n_in: int  # windows that are inputs
    prefetch: list[np.ndarray]  # the scalar-prefetch operands (each core copies them into its SMEM)
    padded: list[np.ndarray]  # each window's array in HBM
    out_leaves: list[Any]  # out_shape's leaves


def _int_attr(kernel, name, default=0) -> int:
    from jaxlib.mlir import ir

    return ir.IntegerAttr(kernel.attributes[name]).value if name in kernel.attributes else default


def _check_dtype(kernel_name: str, what: str, given: np.dtype, memref_type) -> None:
    """Arrays are the module's memrefs: run_mosaic converts nothing (a bool
    array is an i32 memref, as the custom call passes it; Mosaic's integers
    are signless, so uint32 is an i32 memref too)."""
    want = np_dtype(memref_type)
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


def prepare_device(kernel, operands, out_leaves, aliases) -> Device:
    """One device's arrays (its HBM, shared by its cores) and grid."""
    bounds = _ints(kernel.attributes["iteration_bounds"]) if "iteration_bounds" in kernel.attributes else []
    ndyn = sum(b < 0 for b in bounds)  # dynamic grid sizes ('?'): the first operands, as the custom call's
    sizes, operands = operands[:ndyn], operands[ndyn:]
    nsp = _int_attr(kernel, "scalar_prefetch")
    nscratch = _int_attr(kernel, "scratch_operands")
    windows = _window_params(kernel)
    args = list(kernel.regions[0].blocks[0].arguments)
    nwin = len(windows) if windows else len(args) - len(bounds) - nsp - nscratch
    windows = windows or [Window()] * nwin  # no grid, whole arrays
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
            arrays.append(uninitialized(leaf.shape, leaf.dtype))
    padded = []
    for k, arr in enumerate(arrays):
        w = windows[k]
        if w.transform is not None:
            block = cast(list[int], w.bounds)  # a window with a transform has its block shape
            pads = [(0, -n % b) for n, b in zip(arr.shape, block)]
            if any(p for _, p in pads):  # an edge block reads past the array: uninitialized memory
                arr = np.pad(arr, pads, constant_values=plb.uninitialized_fill(arr.dtype))
            else:
                arr = np.ascontiguousarray(arr)
        else:  # a whole array: stored padded to its memory tiling, the padding uninitialized
            tiled = memory.tiled_shape(win_args[k].type)
            if tiled != arr.shape and len(tiled) == arr.ndim:
                store = uninitialized(tiled, arr.dtype)
                store[tuple(slice(0, n) for n in arr.shape)] = arr
                arr = store
        padded.append(arr)
    _share_aliased_hbm(padded, windows, win_args, aliases, nsp, n_in)
    return Device(
        name=name,
        bounds=bounds,
        windows=windows,
        win_types=[_memref_facts(a.type) for a in win_args],
        scratch_types=[a.type for a in args[len(bounds) + nsp + nwin :]],
        n_in=n_in,
        prefetch=[np.array(x) for x in operands[:nsp]],
        padded=padded,
        out_leaves=out_leaves,
    )


def _share_aliased_hbm(padded, windows, win_args, aliases, nsp, n_in) -> None:
    """An output aliased to an input, both whole arrays in HBM (``pl.ANY``), is the
    input's buffer, as on a TPU: a kernel may write it through either Ref (JAX's
    ``core_map`` writes through the input's). VMEM windows stay two buffers, as the
    pipeline's are."""
    spaces = [_memref_facts(a.type)[1] for a in win_args]
    for src, o in aliases.items():
        k, out = src - nsp, n_in + o
        if k < 0 or windows[k].transform is not None or windows[out].transform is not None:
            continue
        if spaces[k] in ("any", "hbm") and spaces[out] in ("any", "hbm"):
            if padded[k].shape == padded[out].shape and padded[k].dtype == padded[out].dtype:
                padded[out] = padded[k]


def _memref_facts(t) -> tuple[tuple[int, ...], str]:
    from jaxlib.mlir import ir

    mt = ir.MemRefType(t)
    return tuple(mt.shape), memory_space(mt)


def core_points(kernel, dev: Device, num_cores) -> list[list[tuple[int, ...]]]:
    """Each core's grid points, in order (see ``run_mosaic``'s ``num_cores``)."""
    from jaxlib.mlir import ir

    bounds = dev.bounds
    points = list(itertools.product(*(range(b) for b in bounds)))
    if num_cores == 1:
        return [points]
    sems = []
    if "dimension_semantics" in kernel.attributes:
        for attr in ir.ArrayAttr(kernel.attributes["dimension_semantics"]):
            sems.append(enum_attr(attr))
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
