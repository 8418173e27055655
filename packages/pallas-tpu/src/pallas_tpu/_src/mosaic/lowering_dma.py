"""Mosaic rules for DMAs and semaphores (``tpu.enqueue_dma``, ``tpu.wait_dma``
or ``wait_dma2``, ``tpu.sem_signal/wait/read``, the barrier semaphore), the
devices they address (logical ids and mesh coordinates of a ``jax.shard_map``
mesh, ``lax.axis_index``), and the core's other effects: ``delay``, its PRNG
(``prng_seed``, ``prng_random_bits``) and ``pl.debug_print`` (``tpu.log``)."""

from __future__ import annotations

import string

import numpy as np
from jax import tree_util
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mosaic.python import tpu

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import primitives as tpu_prims
from pallas_tpu._src.language import random as tpu_random
from pallas_tpu._src.mosaic.lowering import (
    as_i32,
    aval_type,
    index,
    is_bool,
    is_float,
    is_unsigned,
    memref_type,
    ref_type,
    register_lowering,
)
from pallas_tpu._src.mosaic.lowering_views import view

# ---------------------------------------------------------------------------
# Semaphores and DMAs


@register_lowering(plb.semaphore_signal_p)
def _semaphore_signal(ctx, sem, *rest, sem_tree, device_id_tree, device_id_type, has_core_index):
    n = sem_tree.num_leaves
    leaves, inc, extra = rest[:n], rest[n], list(rest[n + 1 :])
    core = extra.pop() if has_core_index else None
    device = logical_device_id(ctx, extra, device_id_tree, device_id_type)
    tpu.sem_signal(view(sem, leaves, sem_tree), inc, device_id=device, core_id=core)
    return []


@register_lowering(plb.semaphore_wait_p)
def _semaphore_wait(ctx, sem, *rest, sem_tree, decrement):
    if not decrement:
        raise NotImplementedError("pl.semaphore_wait(..., decrement=False) has no Mosaic equivalent")
    n = sem_tree.num_leaves
    tpu.sem_wait(view(sem, rest[:n], sem_tree), rest[n])
    return []


@register_lowering(plb.semaphore_read_p)
def _semaphore_read(ctx, sem, *leaves, sem_tree):
    return tpu.sem_read(view(sem, leaves, sem_tree))


@register_lowering(tpu_prims.get_barrier_semaphore_p)
def _barrier_semaphore(ctx):
    return tpu.sem_barrier(ref_type(ctx.avals_out[0]))


@register_lowering(plb.delay_p)
def _delay(ctx, nanos):
    tpu.delay(nanos)
    return []


@register_lowering(tpu_random.prng_seed_p)
def _prng_seed(ctx, *seeds):
    tpu.prng_set_seed_32(list(seeds))
    return []


@register_lowering(tpu_random.prng_random_bits_p)
def _prng_random_bits(ctx, *, shape):
    if len(shape) < 2:
        raise NotImplementedError("prng_random_bits needs a shape of rank >= 2 on the TPU")
    return [tpu.prng_random_bits(aval_type(ctx.avals_out[0]))]


@register_lowering(plb.debug_print_p)
def _debug_print(ctx, *args, fmt, **_):
    """``tpu.log`` of scalars (``{}`` placeholders become Mosaic's ``$s0``,
    ``$f1``...), or ``tpu.log_buffer`` of one array (``fmt`` ending in ``{}``)."""
    avals = ctx.avals_in
    if any(a.shape for a in avals):
        if len(avals) != 1 or not fmt.endswith("{}") or "{}" in fmt[:-2]:
            raise NotImplementedError(
                "pl.debug_print prints scalars, or one array with a format ending in {} (e.g. 'x: {}')"
            )
        region = tpu.RegionOp([])
        with ir.InsertionPoint(region.body):
            buf = memref.alloca(memref_type(avals[0].shape, avals[0].dtype, None), [], [])
            vector.store(args[0], buf, [index(0)] * len(avals[0].shape))
            tpu.log_buffer(buf, list(avals[0].shape), fmt[:-2])
            tpu.yield_([])
        return []
    pieces = list(string.Formatter().parse(fmt))
    formatted = any(field is not None for _, field, _, _ in pieces)
    if formatted:
        if any(np.dtype(a.dtype).itemsize != 4 or is_bool(a.dtype) for a in avals):
            raise TypeError("pl.debug_print with {} placeholders prints 32-bit ints and floats only")
        spec = ["f" if is_float(a.dtype) else "u" if is_unsigned(a.dtype) else "s" for a in avals]
        fmt = "".join(
            t + (f"${spec[i]}{i}" if f is not None else "") for i, (t, f, _, _) in enumerate(pieces)
        )
    tpu.log(list(args), fmt, formatted=formatted)
    return []


def _dma_operands(ctx, args, layout):
    """The DMA's memref views and its target's logical device id (None: local)."""
    parts = layout.split(args)
    trees = {"src": layout.src_tree, "dst": layout.dst_tree, "dst_sem": layout.dst_sem_tree}
    if layout.src_sem_tree is not None:
        trees["src_sem"] = layout.src_sem_tree
    padded = {"src": layout.padded_shape, "dst": layout.padded_shape}
    tiling = {"src": layout.padded_tiling, "dst": layout.padded_tiling}
    views = {k: view(*parts[k], trees[k], padded.get(k), tiling.get(k)) for k in trees}
    device = logical_device_id(ctx, parts["device_id"], layout.device_id_tree, layout.device_id_type)
    return views, device


@register_lowering(tpu_prims.dma_start_p)
def _dma_start(ctx, *args, layout, priority, add):
    if add:
        raise NotImplementedError("DMAs that add into the destination (add=True) are not supported")
    v, device = _dma_operands(ctx, args, layout)
    tpu.enqueue_dma(
        v["src"],
        v["dst"],
        target_semaphore=v["dst_sem"],
        source_semaphore=v.get("src_sem"),
        device_id=device,
        priority=priority or None,
    )
    return []


@register_lowering(tpu_prims.dma_wait_p)
def _dma_wait(ctx, *args, layout, which="dst", **_):
    """Waits as the running JAX's lowering does: ``tpu.wait_dma`` naming the
    whole copy (JAX 0.12+), else ``tpu.wait_dma2`` on the destination's
    semaphore, or for ``.wait_send()`` on the source's with src and dst
    swapped and device 0."""
    v, device = _dma_operands(ctx, args, layout)
    send = which == "send"
    if compat.emits_wait_dma():
        tpu.wait_dma(
            v["src"],
            v["dst"],
            not send,
            source_semaphore=v.get("src_sem"),
            target_semaphore=v["dst_sem"],
            device_id=device,
        )
    elif send:
        zero = as_i32(0)
        tpu.wait_dma2(v["src_sem"], v["dst"], v["src"], device_id=zero, core_id=zero)
    else:
        tpu.wait_dma2(v["dst_sem"], v["src"], v["dst"], device_id=device)
    return []


# ---------------------------------------------------------------------------
# Devices of a jax.shard_map mesh


def _mesh(ctx) -> tuple[tuple[str, int], ...]:
    if not ctx.kernel.mesh_axes:
        raise NotImplementedError(
            "the kernel addresses devices of a mesh, but is not lowered inside jax.shard_map over one "
            "(JAX: 'Cannot use communication in pallas_call without shard_map.')"
        )
    return ctx.kernel.mesh_axes


def mesh_axis_index(ctx, name) -> ir.Value:
    """This device's index along mesh axis ``name``: (device_id // stride) % size."""
    axes = _mesh(ctx)
    names = [n for n, _ in axes]
    if name not in names:
        raise NotImplementedError(f"axis '{name}' is neither a grid axis nor an axis of the mesh {names}")
    k = names.index(name)
    stride = int(np.prod([s for _, s in axes[k + 1 :]], dtype=np.int64))
    return arith.remsi(arith.divsi(tpu.device_id(), as_i32(stride)), as_i32(axes[k][1]))


def logical_device_id(ctx, leaves, tree, device_id_type):
    """The logical (flat, row-major over the mesh) id of a device id given as
    ``pl.DeviceIdType.LOGICAL`` or as MESH coordinates (a tuple in mesh axis
    order, or a dict {axis: index} whose missing axes are this device's)."""
    if tree is None or not leaves:
        return None
    if device_id_type is plb.DeviceIdType.LOGICAL:
        return leaves[0]
    axes = _mesh(ctx)
    coords = tree_util.tree_unflatten(tree, list(leaves))
    if isinstance(coords, dict):
        coords = [coords[n] if n in coords else mesh_axis_index(ctx, n) for n, _ in axes]
    elif not isinstance(coords, (tuple, list)):
        coords = [coords]
    if len(coords) != len(axes):
        raise ValueError(f"device_id {coords} has {len(coords)} coordinates for the mesh {dict(axes)}")
    flat = None
    for c, (_, size) in zip(coords, axes):
        flat = c if flat is None else arith.addi(arith.muli(flat, as_i32(size)), c)
    return flat


@register_lowering(compat.axis_index_p)
def _axis_index(ctx, *, axis_name):
    return mesh_axis_index(ctx, axis_name)
