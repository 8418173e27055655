"""All-gather over a ring of TPU devices, with the names and call signature of
JAX's ``ops.tpu.all_gather``: ``all_gather(x, *, mesh, axis_name, memory_space)``.

``x`` is sharded over ``axis_name`` of ``mesh`` (its leading dimension split in
``n`` shards); every device ends with all of it. The devices along the axis form
a ring and the gather is two streams of remote DMAs going round it in opposite
directions, each carrying whole shards: a device first sends its own shard to
both neighbours, then, for ``n // 2`` steps to the right and ``(n - 1) // 2``
to the left, forwards the shard that has just landed from the other side.
Every link then carries ``n // 2`` shards, half of what one direction would,
and each slot of the output is written once, by one DMA, so no step needs more
than the data it forwards to have landed (no flow control, no buffer reuse).

The kernel starts once its two neighbours have entered it (the barrier
semaphore: their output buffers exist and their semaphores are ready); its own
shard is copied into its slot meanwhile. With ``memory_space=pltpu.VMEM`` (the
default, as JAX's) the shard and the gathered output live in VMEM and must fit
there; ``pl.ANY`` keeps them in HBM (the DMAs go HBM to HBM) for any size.

Beside JAX's op: shards of any leading size (JAX's halves each shard: of an odd
one, the last row never leaves its device), ``axis_name`` may name several mesh axes (the ring runs over their
row-major product, as ``P(axis_name)`` numbers the shards), and the own shard is
sent straight from the input instead of after a blocking local copy.

The modules (the skeleton of every family, ``pallas_tpu.ops``' docstring): this one the
API (JAX's names), ``_kernel`` the kernel body; no blocks (the shard moves whole), its
VMEM from ``ops._policy``; the reference is ``x`` itself, replicated.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops.all_gather._kernel import ag_kernel as ag_kernel
from pallas_tpu.ops.all_gather._kernel import get_neighbor as get_neighbor
from pallas_tpu.ops.all_gather._kernel import ring_axes

P = jax.sharding.PartitionSpec

_MEMORY_SPACES = {"vmem": pltpu.VMEM, "any": pl.ANY, "hbm": pltpu.HBM}


def _vmem_bytes(shape, dtype, n: int) -> int:
    """VMEM of the shard and the ``(n, *shard)`` output, their last two
    dimensions padded to the chip's (8, 128) tiles of 32-bit words."""
    *lead, rows, lanes = shape
    per_word = max(1, 4 // np.dtype(dtype).itemsize)
    tile = -(-rows // (8 * per_word)) * 8 * per_word * -(-lanes // 128) * 128
    return (n + 1) * math.prod(lead) * tile * np.dtype(dtype).itemsize


def _check(x, mesh, axes, memory_space) -> int:
    if not hasattr(mesh, "shape") or not hasattr(mesh, "axis_names"):
        raise TypeError(f"all_gather: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(
            f"all_gather: axis_name must be a mesh axis name or a sequence of them, got {axes!r}"
        )
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(
                f"all_gather: axis_name {a!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)})"
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"all_gather: axis_name names an axis twice: {axes!r}")
    if not any(memory_space is m for m in _MEMORY_SPACES.values()):
        raise ValueError(
            f"all_gather: memory_space must be pltpu.VMEM (the default), pl.ANY or pltpu.HBM, got {memory_space!r}"
        )
    n = math.prod(mesh.shape[a] for a in axes)
    if jnp.ndim(x) == 0:
        raise ValueError("all_gather: x must have a leading dimension to gather along, got a scalar")
    if x.shape[0] % n:
        raise ValueError(
            f"all_gather: x.shape[0]={x.shape[0]} must be divisible by the {n} devices along {axes!r}"
        )
    return n


@functools.partial(jax.jit, static_argnames=["mesh", "axis_name", "memory_space"])
def all_gather(x, *, mesh, axis_name: str | Sequence[str], memory_space=pltpu.VMEM):
    """``x``, sharded along its leading dimension over ``axis_name`` of
    ``mesh``, gathered whole on every device.

    Args:
      x: the array (at least 1-d); ``x.shape[0]`` divisible by the number of
        devices along ``axis_name``.
      mesh: the ``jax.sharding.Mesh``.
      axis_name: a mesh axis, or several (the ring runs over their row-major
        product, as ``P(axis_name)`` shards).
      memory_space: where the kernel holds the shard and the output:
        ``pltpu.VMEM`` (the default; they must fit), ``pl.ANY`` or
        ``pltpu.HBM`` (any size).

    Returns:
      ``x``'s values, replicated on every device of the mesh.

    A ``jax.jit`` of its arguments, as JAX's (``mesh``, ``axis_name`` and ``memory_space``
    static: several axes as a tuple, hashable).

    Raises:
      ValueError: an axis not of the mesh, a leading dimension the devices do
        not divide, an unknown memory space, or a gather too large for VMEM.
      TypeError: ``mesh`` is not a mesh.
    """
    axes = ring_axes(axis_name)
    n = _check(x, mesh, axes, memory_space)
    if n == 1:
        return x
    return _all_gather(x, mesh=mesh, axes=axes, memory_space=memory_space)


def _compiler_params(kernel_shard, shard, dtype, n, memory_space):
    params = dict(collective_id=0)
    if memory_space is pltpu.VMEM:
        chip = _policy.facts()
        needed = _vmem_bytes(kernel_shard, dtype, n)
        if needed > _policy.vmem_budget("all_gather", chip):
            raise ValueError(
                f"all_gather: {n} shards of {shard} {dtype} need {needed} bytes of VMEM, more than "
                f"{_policy.vmem_policy('all_gather', chip).fraction:.0%} of the {chip.name} chip's "
                f"{chip.vmem_bytes}: pass memory_space=pl.ANY (the gather then runs HBM to HBM)"
            )
        params["vmem_limit_bytes"] = _policy.vmem_limit("all_gather", needed, chip)
    return pltpu.CompilerParams(**params)


@functools.partial(jax.jit, static_argnames=["mesh", "axes", "memory_space"])
def _all_gather(x, *, mesh, axes: tuple[str, ...], memory_space):
    n = math.prod(mesh.shape[a] for a in axes)
    shard = (x.shape[0] // n, *x.shape[1:])
    # A 1-d shard is one row of a 2-d one: a slot of the output is then a
    # whole leading index, as for any other rank.
    kernel_shard = shard if len(shard) >= 2 else (1, *shard)

    def gather_shard(x_shard):
        # Traced inside the shard_map: the chip is the mesh's.
        params = _compiler_params(kernel_shard, shard, x.dtype, n, memory_space)
        out = pl.pallas_call(
            functools.partial(ag_kernel, axis_name=axes, mesh=mesh),
            out_shape=jax.ShapeDtypeStruct((n, *kernel_shard), x_shard.dtype),
            in_specs=[pl.BlockSpec(memory_space=memory_space)],
            out_specs=pl.BlockSpec(memory_space=memory_space),
            scratch_shapes=[
                (pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA),
                (pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA),
            ],
            compiler_params=params,
            name="all_gather",
        )(x_shard.reshape(kernel_shard))
        return out.reshape(n * shard[0], *shard[1:])

    spec = P(axes if len(axes) > 1 else axes[0])
    return jax.shard_map(gather_shard, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)(x)
