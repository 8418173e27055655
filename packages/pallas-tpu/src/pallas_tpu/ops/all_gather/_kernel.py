"""The all-gather kernel: two streams of remote DMAs round a ring of devices (the package's
docstring says how)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu


def ring_axes(axis_name) -> tuple[str, ...]:
    """``axis_name`` (a mesh axis or several) as a tuple of axes."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _ring_position(axes: Sequence[str], mesh) -> jax.Array:
    """This device's position on the ring: its row-major index over ``axes``."""
    position = jnp.int32(0)
    for a in axes:
        position = position * mesh.shape[a] + lax.axis_index(a)
    return position


def get_neighbor(
    idx: jax.Array, mesh, axis_name: str | Sequence[str], *, direction: str
) -> tuple[jax.Array, ...]:
    """The mesh coordinates (one per axis of ``mesh``, for
    ``DeviceIdType.MESH``) of the device next to ring position ``idx`` on the
    ring over ``axis_name`` (``"right"``: position ``idx + 1``, ``"left"``:
    ``idx - 1``, wrapping); on the other axes, this device's own coordinates."""
    if direction not in ("left", "right"):
        raise ValueError(f"get_neighbor: direction must be 'left' or 'right', got {direction!r}")
    axes = ring_axes(axis_name)
    size = math.prod(mesh.shape[a] for a in axes)
    step = 1 if direction == "right" else size - 1
    position = lax.rem(jnp.asarray(idx, jnp.int32) + step, size)
    coords = {}
    for i, a in enumerate(reversed(axes)):
        coords[a] = lax.rem(position, mesh.shape[a]) if i < len(axes) - 1 else position
        position = lax.div(position, mesh.shape[a])
    return tuple(coords[a] if a in coords else lax.axis_index(a) for a in mesh.axis_names)


def ag_kernel(x_ref, o_ref, send_sem, recv_sem, *, axis_name: str | Sequence[str], mesh):
    """The all-gather kernel: ``x_ref`` this device's shard, ``o_ref`` the
    ``(n, *shard)`` output, ``send_sem`` and ``recv_sem`` two DMA semaphores each
    (the left-going stream's, then the right-going one's). Needs
    ``pltpu.CompilerParams(collective_id=...)`` (it uses the barrier semaphore)."""
    axes = ring_axes(axis_name)
    n = math.prod(mesh.shape[a] for a in axes)
    me = _ring_position(axes, mesh)
    left = get_neighbor(me, mesh, axes, direction="left")
    right = get_neighbor(me, mesh, axes, direction="right")
    right_hops, left_hops = n // 2, (n - 1) // 2

    # The own shard into its slot, while the neighbours are awaited. The left
    # stream's send semaphore carries it: no send of ours has started yet.
    own = pltpu.make_async_copy(x_ref, o_ref.at[me], send_sem[0])
    own.start()
    barrier = pltpu.get_barrier_semaphore()
    for neighbour in (left, right):
        pl.semaphore_signal(barrier, 1, device_id=neighbour, device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, 2)
    own.wait()

    def hop(src_ref, slot, stream: int, neighbour):
        return pltpu.make_async_remote_copy(
            src_ref,
            o_ref.at[slot],
            send_sem[stream],
            recv_sem[stream],
            device_id=neighbour,
            device_id_type=pl.DeviceIdType.MESH,
        )

    def finish(copies):
        for copy in copies:
            copy.wait_send()
        for copy in copies:
            copy.wait_recv()

    # Step 0: the own shard, straight from the input, to both neighbours.
    first = [hop(x_ref, me, 1, right)] + ([hop(x_ref, me, 0, left)] if left_hops else [])
    for copy in first:
        copy.start()
    finish(first)

    # Step t: forward what landed at step t - 1 (from the left: slot me - t;
    # from the right: slot me + t).
    def step(t, carry):
        going_right = hop(o_ref.at[lax.rem(me - t + n, n)], lax.rem(me - t + n, n), 1, right)
        going_right.start()
        if left_hops < right_hops:

            @pl.when(t < left_hops)
            def _():
                going_left = hop(o_ref.at[lax.rem(me + t, n)], lax.rem(me + t, n), 0, left)
                going_left.start()
                finish([going_left])

        else:
            going_left = hop(o_ref.at[lax.rem(me + t, n)], lax.rem(me + t, n), 0, left)
            going_left.start()
            finish([going_left])
        finish([going_right])
        return carry

    if right_hops > 1:
        lax.fori_loop(1, right_hops, step, 0)
