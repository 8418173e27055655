"""The multi-device TPU interpreter: remote DMAs, remote semaphore signals,
barrier semaphores, and race detection.

A kernel called inside ``jax.shard_map`` runs once per device, each device's
copy as its own XLA program, and XLA's CPU client runs those programs on
separate threads at the same time. The kernel's data stays functional per
device (``Interpreter`` cells); what crosses devices goes through host
callbacks (``compat.host_callback``: an unordered ``io_callback`` without its
copies into ``jax.Array``s) into one Python ``_Session`` per kernel call,
shared by the devices of the mesh (``sessions.py``: semaphores that other devices signal, the mailboxes of remote
DMAs, pairing the devices of a call, deadlock errors, race records).
``DeviceTransport`` is the ``Interpreter``'s transport for such kernels (the
interface is ``transport.LocalTransport``'s); ``remote_dma.py`` holds its remote
DMAs.

Callbacks of one device are chained by a token in the interpreter's hidden
state (``cursor.Cursor``: ``hidden.tok``) so XLA keeps them in program order.

Race detection (``InterpretParams(detect_races=True)``, ``races.py``, recorded by
the session) sees every kernel access of a Ref and every DMA's source read and
destination write: ``on_access``, ``on_dma_start`` and the waits below.

Cores of a device share their device's program: they run one after the other,
or, when they signal each other, take turns between semaphore waits
(``pallas_call._core_groups``).
"""

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
from pallas_tpu._src.interpret import sessions
from pallas_tpu._src.interpret.cursor import Cursor
from pallas_tpu._src.interpret.dma_views import DmaViews
from pallas_tpu._src.interpret.errors import Checks
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.interpret.refs import RefAccess, RefView
from pallas_tpu._src.interpret.remote_dma import RemoteDMAs
from pallas_tpu._src.interpret.semaphores import LocalSemaphores
from pallas_tpu._src.interpret.sessions import (
    get_session,
    index_inside,
    join_session,
    live_sessions,
    lowering_mesh_devices,
    sessions_lock,
)
from pallas_tpu._src.interpret.shared_scopes import SharedScopes
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import primitives as tpu_prims


def __getattr__(name: str):
    """Names that moved to ``sessions.py`` (``races``, ``join_session``,
    ``reset_tpu_interpret_mode_state``, ``lowering_mesh``, ...), read there: this module
    stands for JAX's ``interpret_pallas_call`` (``scripts/jax_pallas_tests.py``), and
    ``races`` is rebound on reset."""
    try:
        return getattr(sessions, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


# ---------------------------------------------------------------------------


_SHARED_KINDS = (plb.SemaphoreKind.REGULAR, plb.SemaphoreKind.BARRIER)
_DMA_PRIMS = (tpu_prims.dma_start_p, tpu_prims.dma_wait_p)


class DeviceTransport:
    """The transport of a kernel that talks to other devices or cores, or checks
    races (see the module docstring), holding the device's place in the mesh and its
    session. It reads the kernel's ``memory`` (cells, their names and spaces) and
    views' indices (``refs``), the cores' shared scopes (``scopes``), and follows the
    interpreter's ``cursor`` (the core being traced, the grid step, the callback
    token); ``where(eqn)`` names an equation in messages, ``kernel_desc`` the kernel.
    Remote DMAs are its ``remote`` (``remote_dma.RemoteDMAs``, which also takes
    ``checks``, the core's own semaphores ``local_sems`` and the DMA ends ``views``)."""

    def __init__(
        self,
        memory: Memory,
        refs: RefAccess,
        checks: Checks,
        scopes: SharedScopes,
        cursor: Cursor,
        local_sems: LocalSemaphores,
        views: DmaViews,
        *,
        where: Callable[[Any], str],
        kernel_desc: str,
        kernel_name: str,
        kernel_facts: plb.KernelFacts,
        detect_races: bool,
        num_cores: int,
        collective_id: int | None,
    ):
        self.memory = memory
        self.refs = refs
        self.scopes = scopes
        self.cursor = cursor
        self.where = where
        self.kernel_desc = kernel_desc
        self.kernel_name = kernel_name
        self.kernel_facts = kernel_facts
        self.races = detect_races
        self.num_cores = num_cores
        self.collective_id = collective_id
        self.mesh_axes: tuple[tuple[str, int], ...] = ()
        self.num_devices = 1
        self.my_dev = None  # this device's logical id (traced), from start()
        self.sid = None  # the session's id (traced), from start()
        self.barrier_cell: int | None = None  # the barrier semaphore, when the kernel uses it
        self.remote = RemoteDMAs(memory, refs, checks, cursor, local_sems, views, where, self)

    # -- lifecycle --

    def start(self) -> None:
        names = compat.bound_axis_names()
        sizes = compat.axis_sizes()
        self.mesh_axes = tuple((n, int(sizes[n])) for n in names)
        self.num_devices = math.prod(s for _, s in self.mesh_axes)
        kf = self.kernel_facts  # the call record's facts
        if kf.remote or kf.signals_cores or kf.uses(tpu_prims.get_barrier_semaphore_p):  # needs other devices
            self._check_one_process()
        dev = jnp.int32(0)
        for n, s in self.mesh_axes:
            dev = dev * s + lax.axis_index(n).astype(jnp.int32)
        self.my_dev = dev
        if kf.uses(tpu_prims.get_barrier_semaphore_p):
            if self.collective_id is None:
                raise ValueError(
                    f"{self.kernel_desc}: pltpu.get_barrier_semaphore() needs a collective id: pass "
                    "compiler_params=pltpu.CompilerParams(collective_id=0)"
                )
            self.barrier_cell = self.memory.new_cell(
                jnp.zeros((), jnp.int32),
                "the barrier semaphore",
                plb.SemaphoreSpace(plb.SemaphoreKind.BARRIER),
            )
        key = (self.mesh_axes, self.kernel_name)
        n, desc, races_on = self.num_devices, self.kernel_desc, self.races
        cores = self.num_cores

        def join(dev):
            return np.int32(join_session(key, n, int(dev), desc, races_on, cores).sid)

        (self.sid,) = self.callback(join, [jax.ShapeDtypeStruct((), jnp.int32)], self.my_dev)

    def _check_one_process(self) -> None:
        """Devices of a mesh meet in this process's ``_Session`` (semaphores, DMAs in
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

    def finish(self) -> None:
        def leave(sid, dev):
            s = get_session(sid)
            dev = int(dev)
            with s.cv:
                s.check_alive(dev)
                s.left.add(dev)
                s.cv.notify_all()
                if len(s.left) < s.num_devices:
                    return ()
                with sessions_lock:
                    live_sessions.pop(s.sid, None)
                for key, v in s.sems.items():
                    if v:
                        raise s.fail(
                            f"{s.kernel}: {s.sem_names[key]} holds {v} when the kernel ends on every device "
                            "(a signal was not waited for)"
                        )
                for key, q in s.mail.items():
                    if q:
                        raise s.fail(
                            f"{s.kernel}: the remote DMA started at {q[0].site} was never waited for by its "
                            f"receiver (device {key[0]}: .wait_recv() on its receive semaphore)"
                        )
            return ()

        self.callback(leave, [], self.sid, self.my_dev)

    # -- callbacks --

    def callback(self, fn, result_shapes, *args):
        """``fn(*args)`` on the host, after this device's earlier callbacks."""
        tok_shape = jax.ShapeDtypeStruct((), jnp.int32)

        progress = self.cursor.progress if self.races and args and args[0] is self.sid else None
        if progress is not None:  # a long race-detecting run says how far it got (see _Session.progress)
            args = (*args, *progress)

        def host(tok, *a):
            if progress is not None:
                *a, step, total = a
                get_session(a[0]).progress(int(step), int(total))
            out = fn(*a)
            out = () if out is None else (out if isinstance(out, tuple) else (out,))
            return (np.asarray(tok, np.int32), *out)

        outs = compat.host_callback(host, (tok_shape, *result_shapes), self.cursor.hidden.tok, *args)
        self.cursor.hidden.tok = outs[0]
        return list(outs[1:])

    def site(self, eqn) -> str:
        src = compat.eqn_user_source(eqn)
        return src or self.kernel_name

    def _who(self, dev: int, core: int) -> str:
        return f"device {dev}, core {core}" if self.num_devices > 1 else f"core {core}"

    def _buf_name(self, cell: int, dev: int, idx, shape) -> str:
        name = self.memory.cell_names.get(cell, f"ref#{cell}") + races_mod.region(np.unique(idx), shape)
        return f"{name} on device {dev}" if self.num_devices > 1 else name

    # -- views, indices, device ids --

    def flat_indices(self, view: RefView, eqn, what: str):
        """The flat element indices of the cell that ``view`` covers (traced;
        past a traced size, the cell's size: see ``RefAccess.view_indices``)."""
        try:
            return self.refs.view_indices(view, eqn, what)[0]
        except NotImplementedError:
            return jnp.arange(self.memory.state[view.cell].size, dtype=jnp.int32)

    def sem_key(self, view: RefView, eqn):
        name = self.memory.cell_names.get(view.cell, f"ref#{view.cell}")
        label = self.scopes.labels.get(view.cell)  # a run_scoped semaphore of cores in lockstep
        if name.startswith("scratch_shapes[") or name == "the barrier semaphore":
            key = name
        elif label is not None:  # each core's copy: the same name on every core (shared_scopes.py)
            key = (name, "scope", label)
        else:
            key = (name, view.cell)
        return key, name, self.flat_indices(view, eqn, "read").reshape(())

    def shares(self, cell: int) -> bool:
        sp = self.memory.cell_spaces.get(cell)
        return isinstance(sp, plb.SemaphoreSpace) and sp.kind in _SHARED_KINDS

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

    # -- memory accesses (race detection) --

    def on_access(self, view: RefView, eqn, write: bool) -> None:
        if not self.races or eqn is None or eqn.primitive in _DMA_PRIMS:
            return
        if eqn.primitive is compat.swap_p and not write:
            return  # a store: its read of the old value is not a memory read
        if isinstance(self.memory.cell_spaces.get(view.cell), plb.SemaphoreSpace):
            return
        idx = self.flat_indices(view, eqn, "write" if write else "read")
        cell, core, shape = view.cell, self.cursor.core_id, self.memory.state[view.cell].shape
        site, buf_name, who = self.site(eqn), self._buf_name, self._who

        def access(sid, dev, idx):
            s, dev = get_session(sid), int(dev)
            with s.cv:
                s.check_alive(dev)

                def what():
                    return (
                        f"{'write' if write else 'read'} of {buf_name(cell, dev, idx, shape)} "
                        f"by the kernel at {site} ({who(dev, core)})"
                    )

                s.record(self._race_buf(dev, cell, core), ("core", dev, core), write, idx, what)

        self.callback(access, [], self.sid, self.my_dev, idx)

    def _race_buf(self, dev: int, cell: int, core: int):
        """The memory a cell is, for race detection: a core's own VMEM and SMEM
        (its block buffers and scratch) per core, as on the chip, so that cores
        run one after the other in the same cells do not race there; HBM, ANY and
        VMEM_SHARED once per device. (A remote DMA lands on its issuer's core.)"""
        sp = self.memory.cell_spaces.get(cell)
        return (dev, cell, core) if sp is None or sp in (tpu_core.VMEM, tpu_core.SMEM) else (dev, cell)

    def on_block_write(self, hbm_cell: int, starts, sizes, origin: str, when=True) -> None:
        """The pipeline's write-back of an output block (a DMA on the chip) is the
        core's write of that part of HBM: two cores writing one block race (as JAX's
        TPU interpret mode says), however the cores take turns here."""
        if not self.races:
            return
        shape = self.memory.state[hbm_cell].shape
        axes = [jnp.arange(n, dtype=jnp.int32) + jnp.asarray(st, jnp.int32) for st, n in zip(starts, sizes)]
        idx = jnp.ravel_multi_index(jnp.meshgrid(*axes, indexing="ij"), shape, mode="clip").reshape(-1)
        core, buf_name, who = self.cursor.core_id, self._buf_name, self._who

        def access(sid, dev, idx, when):
            if not bool(when):
                return
            s, dev = get_session(sid), int(dev)
            with s.cv:
                s.check_alive(dev)

                def what():
                    where = buf_name(hbm_cell, dev, idx, shape)
                    return f"write of {where} by the pipeline's write-back of {origin} ({who(dev, core)})"

                s.record(self._race_buf(dev, hbm_cell, core), ("core", dev, core), True, idx, what)

        self.callback(access, [], self.sid, self.my_dev, idx, jnp.asarray(when))

    def dma_start_race(self, s, dev, core, dst_dev, v, src_idx, dst_idx, shapes, site, sem_key):
        """Host side: a new DMA thread with the issuer's clock; records its accesses."""
        thread = ("core", dev, core)
        s.n_dma += 1
        dma = ("dma", s.n_dma)
        s.hb.start_dma(thread, dma)
        s.inflight[sem_key].append(dma)
        src_cell, dst_cell = v
        src_idx, dst_idx = index_inside(src_idx, shapes[0]), index_inside(dst_idx, shapes[1])
        remote = "remote " if dst_dev is not None else ""
        by = f"the {remote}DMA started at {site} ({self._who(dev, core)})"
        s.record(
            self._race_buf(dev, src_cell, core),
            dma,
            False,
            src_idx,
            lambda: f"read of {self._buf_name(src_cell, dev, src_idx, shapes[0])} by {by}",
        )
        tgt = dev if dst_dev is None else dst_dev
        s.record(
            self._race_buf(tgt, dst_cell, core),
            dma,
            True,
            dst_idx,
            lambda: f"write of {self._buf_name(dst_cell, tgt, dst_idx, shapes[1])} by {by}",
        )
        return dma

    def on_dma_start(self, eqn, views) -> None:
        if not self.races:
            return
        src, dst = views["src"], views["dst"]
        src_idx = self.flat_indices(src, eqn, "read")
        dst_idx = self.flat_indices(dst, eqn, "write")
        key, _, sem_idx = self.sem_key(views["dst_sem"], eqn)
        core, site = self.cursor.core_id, self.site(eqn)
        cells = (src.cell, dst.cell)
        shapes = (self.memory.state[src.cell].shape, self.memory.state[dst.cell].shape)

        def start(sid, dev, sem_idx, src_idx, dst_idx):
            s, dev = get_session(sid), int(dev)
            with s.cv:
                s.check_alive(dev)
                sk = ("dst", dev, core, key, int(sem_idx))
                self.dma_start_race(s, dev, core, None, cells, src_idx, dst_idx, shapes, site, sk)

        self.callback(start, [], self.sid, self.my_dev, sem_idx, src_idx, dst_idx)

    def dma_done(self, eqn, sem_view, which: str) -> None:
        key, _, sem_idx = self.sem_key(sem_view, eqn)
        core = self.cursor.core_id

        def done(sid, dev, sem_idx):
            s, dev = get_session(sid), int(dev)
            with s.cv:
                s.check_alive(dev)
                q = s.inflight.get((which, dev, core, key, int(sem_idx)))
                if q:
                    dma = q.popleft()
                    thread = ("core", dev, core)
                    s.hb.acquire(thread, dma)

        self.callback(done, [], self.sid, self.my_dev, sem_idx)

    def on_dma_wait(self, eqn, views) -> None:
        if self.races:
            self.dma_done(eqn, views["dst_sem"], "dst")

    # -- semaphores --

    def _signal(self, eqn, view, inc, target, core):
        key, name, sem_idx = self.sem_key(view, eqn)
        my_core, what = self.cursor.core_id, f"{self.where(eqn)}: pl.semaphore_signal"
        n_cores = self.num_cores

        def signal(sid, dev, target, core, sem_idx, inc):
            s, dev, target, core = get_session(sid), int(dev), int(target), int(core)
            with s.cv:
                s.check_alive(dev)
                if not 0 <= target < s.num_devices:
                    raise s.fail(f"{what}: device_id {target} is outside the mesh of {s.num_devices} devices")
                if not 0 <= core < n_cores:
                    raise s.fail(f"{what}: core_index {core} is outside the {n_cores} cores of a device")
                k = (target, core, key, int(sem_idx))
                s.sems[k] += int(inc)
                s.sem_names[k] = f"semaphore {name}[{int(sem_idx)}] of device {target}, core {core}"
                if s.detect_races:
                    thread = ("core", dev, my_core)
                    s.hb.release_sem(thread, k)
                s.cv.notify_all()

        core = jnp.int32(self.cursor.core_id) if core is None else jnp.asarray(core, jnp.int32)
        self.callback(signal, [], self.sid, self.my_dev, target, core, sem_idx, jnp.asarray(inc, jnp.int32))

    def sem_add(self, view, amount, eqn) -> None:
        self._signal(eqn, view, amount, self.my_dev, None)

    def remote_signal(self, eqn, view, inc, device_id, core_index) -> None:
        target = (
            self.my_dev
            if device_id is None
            else self.device_target(device_id, eqn.params["device_id_type"], eqn)
        )
        self._signal(eqn, view, inc, target, core_index)

    def sem_wait(self, view, amount, eqn, decrement=True, what="semaphore") -> None:
        key, name, sem_idx = self.sem_key(view, eqn)
        core, where = self.cursor.core_id, self.site(eqn)

        def wait(sid, dev, sem_idx, amount):
            s, dev, amount = get_session(sid), int(dev), int(amount)
            k = (dev, core, key, int(sem_idx))
            with s.cv:
                s.check_alive(dev)
                s.sem_names.setdefault(k, f"semaphore {name}[{int(sem_idx)}] of device {dev}, core {core}")
                s.block(
                    dev,
                    lambda: s.sems[k] >= amount,
                    f"waits at {where} on {name}[{int(sem_idx)}] (core {core}) for {amount} but it holds "
                    f"{s.sems[k]}",
                )
                if decrement:
                    s.sems[k] -= amount
                if s.detect_races:
                    s.hb.acquire_sem(("core", dev, core), k)

        self.callback(wait, [], self.sid, self.my_dev, sem_idx, jnp.asarray(amount, jnp.int32))

    def sem_read(self, view, eqn):
        """``pl.semaphore_read`` of a semaphore the session keeps (``shares``)."""
        key, _, sem_idx = self.sem_key(view, eqn)
        core = self.cursor.core_id

        def read(sid, dev, sem_idx):
            s = get_session(sid)
            with s.cv:
                return np.int32(s.sems[(int(dev), core, key, int(sem_idx))])

        (v,) = self.callback(read, [jax.ShapeDtypeStruct((), jnp.int32)], self.sid, self.my_dev, sem_idx)
        return v

    # -- remote DMAs (remote_dma.RemoteDMAs) --

    def remote_dma_start(self, eqn, parts, layout) -> None:
        self.remote.start(eqn, parts, layout)

    def remote_dma_wait(self, eqn, parts, layout, which) -> None:
        self.remote.wait_send(eqn, parts, layout, which)

    def dma_receive(self, eqn, sem, dst, nbytes, remote) -> None:
        self.remote.receive(eqn, sem, dst, nbytes, remote)
