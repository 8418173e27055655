"""A device's connection to the session of its kernel call (``sessions.py``) in the
multi-device TPU interpreter: where the device sits in the mesh (its logical id,
traced), the session it joined, the host callbacks into that session (``call``:
chained by the token in the interpreter's hidden state, ``cursor.Cursor``, so XLA keeps
them in program order), the names the session knows things by (a semaphore's key, a
device id, an equation's source line) and the race detector's records of DMAs.

``multi.DeviceTransport`` (semaphores, Ref accesses) and ``remote_dma.RemoteDMAs``
(remote DMAs) both reach the session through one ``SessionLink``, which the
``Interpreter`` builds."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import races as races_mod
from pallas_tpu._src.interpret.cursor import Cursor
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.interpret.refs import RefAccess, RefView
from pallas_tpu._src.interpret.sessions import (
    Session,
    get_session,
    index_inside,
    join_session,
    lowering_mesh_devices,
)
from pallas_tpu._src.interpret.shared_scopes import SharedScopes
from pallas_tpu._src.language import core as tpu_core


class SessionLink:
    """This device's connection to its kernel call's session (see the module
    docstring). It names the cells of ``memory`` (and reads their shapes), takes
    views' indices from ``refs`` and the labels of the cores' shared scopes from
    ``scopes``, and follows the interpreter's ``cursor`` (the core being traced, the
    grid step, the callback token). ``where(eqn)`` names an equation in messages,
    ``kernel_desc`` and ``kernel_name`` the kernel; ``detect_races``: whether the
    session records accesses (``races``): False, or what a race does, ``"raise"`` or
    ``"warn"`` (``InterpretParams.on_race``)."""

    def __init__(
        self,
        memory: Memory,
        refs: RefAccess,
        scopes: SharedScopes,
        cursor: Cursor,
        *,
        where: Callable[[Any], str],
        kernel_desc: str,
        kernel_name: str,
        detect_races: bool | str,
        num_cores: int,
    ):
        self.memory = memory
        self.refs = refs
        self.scopes = scopes
        self.cursor = cursor
        self.where = where
        self.kernel_desc = kernel_desc
        self.kernel_name = kernel_name
        self.races = detect_races
        self.num_cores = num_cores
        self.mesh_axes: tuple[tuple[str, int], ...] = ()
        self.num_devices = 1
        self.my_dev = None  # this device's logical id (traced), from locate()
        self._sid = None  # the session's id (traced), from join()

    # -- joining and leaving the session --

    def locate(self, needs_other_devices: bool) -> None:
        """Finds this device in the mesh of the enclosing ``shard_map``; a kernel
        that ``needs_other_devices`` is refused where they are in other processes."""
        names = compat.bound_axis_names()
        sizes = compat.axis_sizes()
        self.mesh_axes = tuple((n, int(sizes[n])) for n in names)
        self.num_devices = math.prod(s for _, s in self.mesh_axes)
        if needs_other_devices:
            self._check_one_process()
        dev = jnp.int32(0)
        for n, s in self.mesh_axes:
            dev = dev * s + lax.axis_index(n).astype(jnp.int32)
        self.my_dev = dev

    def _check_one_process(self) -> None:
        """Devices of a mesh meet in this process's ``Session`` (semaphores, DMAs in
        flight, the mailboxes of remote DMAs): devices run by other processes of a
        ``jax.distributed`` job never join it, and a kernel that talks to them would
        wait for them until the deadlock timeout. Refuse it when it is traced."""
        if jax.process_count() == 1:
            return
        devices = lowering_mesh_devices()
        local = jax.local_device_count()
        if devices is not None:
            processes = sorted({d.process_index for d in devices})
            if len(processes) == 1:
                return
            span = f"spans processes {processes}"
        elif self.num_devices > local:
            span = f"has {self.num_devices} devices, more than the {local} of this process"
        else:
            return
        axes = ", ".join(f"{n}={s}" for n, s in self.mesh_axes) or "none"
        raise NotImplementedError(
            f"{self.kernel_desc}: TPU interpret mode cannot simulate remote DMAs, remote semaphore signals "
            f"or barrier semaphores between processes: it keeps what devices share (semaphores, DMAs in "
            f"flight) in one Python process, and the mesh of this shard_map (axes {axes}) {span} of a "
            f"jax.distributed job of {jax.process_count()} processes. Run this kernel under shard_map over a mesh "
            "of this process's devices (jax.local_devices()), or in one process with several CPU devices "
            "(jax.config.update('jax_num_cpu_devices', n)); kernels without remote DMAs, remote signals or "
            "barrier semaphores run over meshes that span processes"
        )

    def join(self) -> None:
        """Joins this call's session (after ``locate``)."""
        key = (self.mesh_axes, self.kernel_name)
        n, desc, races_on = self.num_devices, self.kernel_desc, self.races
        cores = self.num_cores

        def join(dev):
            return np.int32(join_session(key, n, int(dev), desc, races_on, cores).sid)

        (self._sid,) = self._ordered(join, [jax.ShapeDtypeStruct((), jnp.int32)], (self.my_dev,))

    def leave(self) -> None:
        """Leaves the session: the last device to leave closes it (``Session.leave``)."""
        self.call(lambda s, dev: s.leave(dev), [])

    # -- callbacks --

    def call(self, fn: Callable[..., Any], result_shapes, *args) -> list:
        """``fn(session, device, *args)`` on the host, after this device's earlier
        callbacks (``device``: this device's logical id, an int)."""
        progress = self.cursor.progress if self.races else None
        if progress is not None:  # a long race-detecting run says how far it got (see Session.progress)
            args = (*args, *progress)

        def host(sid, dev, *a):
            s = get_session(sid)
            if progress is not None:
                *a, step, total = a
                s.progress(int(step), int(total))
            return fn(s, int(dev), *a)

        return self._ordered(host, result_shapes, (self._sid, self.my_dev, *args))

    def _ordered(self, fn, result_shapes, args: tuple) -> list:
        tok_shape = jax.ShapeDtypeStruct((), jnp.int32)

        def host(tok, *a):
            out = fn(*a)
            out = () if out is None else (out if isinstance(out, tuple) else (out,))
            return (np.asarray(tok, np.int32), *out)

        outs = compat.host_callback(host, (tok_shape, *result_shapes), self.cursor.hidden.tok, *args)
        self.cursor.hidden.tok = outs[0]
        return list(outs[1:])

    # -- what the session calls things --

    def site(self, eqn) -> str:
        src = compat.eqn_user_source(eqn)
        return src or self.kernel_name

    def flat_indices(self, view: RefView, eqn, what: str):
        """The flat element indices of the cell that ``view`` covers (traced;
        past a traced size, the cell's size: see ``RefAccess.view_indices``)."""
        try:
            return self.refs.view_indices(view, eqn, what)[0]
        except NotImplementedError:
            return jnp.arange(self.memory.state[view.cell].size, dtype=jnp.int32)

    def sem_key(self, view: RefView, eqn):
        """(the session's key of the semaphore ``view``, its name, its index, traced)."""
        name = self.memory.cell_names.get(view.cell, f"ref#{view.cell}")
        label = self.scopes.labels.get(view.cell)  # a run_scoped semaphore of cores in lockstep
        key: Any
        if name.startswith("scratch_shapes[") or name == "the barrier semaphore":
            key = name
        elif label is not None:  # each core's copy: the same name on every core (shared_scopes.py)
            key = (name, "scope", label)
        else:
            key = (name, view.cell)
        return key, name, self.flat_indices(view, eqn, "read").reshape(())

    def device_target(self, device_id, device_id_type, eqn):
        """The logical id (traced int32) of ``device_id``."""
        if device_id_type is plb.DeviceIdType.LOGICAL:
            (leaf,) = tree_util.tree_leaves(device_id)
            return jnp.asarray(leaf, jnp.int32)
        names = [n for n, _ in self.mesh_axes]
        if isinstance(device_id, dict):
            unknown = [k for k in device_id if k not in names]
            if unknown:
                raise ValueError(
                    f"{self.where(eqn)}: device_id names axes {unknown} that the mesh {names} lacks"
                )
            coords = [device_id[n] if n in device_id else lax.axis_index(n) for n in names]
        else:
            coords = list(device_id) if isinstance(device_id, (tuple, list)) else [device_id]
            if len(coords) != len(names):
                raise ValueError(
                    f"{self.where(eqn)}: a MESH device_id has one coordinate per mesh axis {names}, got "
                    f"{len(coords)} ({device_id!r})"
                )
        out = jnp.int32(0)
        for c, (_, s) in zip(coords, self.mesh_axes):
            out = out * s + jnp.asarray(c, jnp.int32)
        return out

    # -- race records (host side, holding the session's cv) --

    def who(self, dev: int, core: int) -> str:
        return f"device {dev}, core {core}" if self.num_devices > 1 else f"core {core}"

    def buf_name(self, cell: int, dev: int, idx, shape) -> str:
        name = self.memory.cell_names.get(cell, f"ref#{cell}") + races_mod.region(np.unique(idx), shape)
        return f"{name} on device {dev}" if self.num_devices > 1 else name

    def race_buf(self, dev: int, cell: int, core: int):
        """The memory a cell is, for race detection: a core's own VMEM and SMEM
        (its block buffers and scratch) per core, as on the chip, so that cores
        run one after the other in the same cells do not race there; HBM, ANY and
        VMEM_SHARED once per device. (A remote DMA lands on its issuer's core.)"""
        sp = self.memory.cell_spaces.get(cell)
        return (dev, cell, core) if sp is None or sp in (tpu_core.VMEM, tpu_core.SMEM) else (dev, cell)

    def dma_start_race(self, s: Session, dev, core, dst_dev, v, src_idx, dst_idx, shapes, site, sem_key):
        """A new DMA thread with the issuer's clock; records its accesses."""
        thread = ("core", dev, core)
        s.n_dma += 1
        dma = ("dma", s.n_dma)
        s.hb.start_dma(thread, dma)
        s.inflight[sem_key].append(dma)
        src_cell, dst_cell = v
        src_idx, dst_idx = index_inside(src_idx, shapes[0]), index_inside(dst_idx, shapes[1])
        remote = "remote " if dst_dev is not None else ""
        by = f"the {remote}DMA started at {site} ({self.who(dev, core)})"
        s.record(
            self.race_buf(dev, src_cell, core),
            dma,
            False,
            src_idx,
            lambda: f"read of {self.buf_name(src_cell, dev, src_idx, shapes[0])} by {by}",
        )
        tgt = dev if dst_dev is None else dst_dev
        s.record(
            self.race_buf(tgt, dst_cell, core),
            dma,
            True,
            dst_idx,
            lambda: f"write of {self.buf_name(dst_cell, tgt, dst_idx, shapes[1])} by {by}",
        )
        return dma

    def dma_done(self, eqn, sem_view, which: str) -> None:
        """A wait on ``sem_view`` (``which``: "dst" or "send") took the oldest DMA in
        flight to it: its waiter acquires the DMA's clock."""
        key, _, sem_idx = self.sem_key(sem_view, eqn)
        core = self.cursor.core_id

        def done(s, dev, sem_idx):
            with s.cv:
                s.check_alive(dev)
                q = s.inflight.get((which, dev, core, key, int(sem_idx)))
                if q:
                    dma = q.popleft()
                    thread = ("core", dev, core)
                    s.hb.acquire(thread, dma)

        self.call(done, [], sem_idx)
