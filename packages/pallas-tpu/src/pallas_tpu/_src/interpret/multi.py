"""The multi-device TPU interpreter: remote DMAs, remote semaphore signals,
barrier semaphores, and race detection.

A kernel called inside ``jax.shard_map`` runs once per device, each device's
copy as its own XLA program, and XLA's CPU client runs those programs on
separate threads at the same time. The kernel's data stays functional per
device (``Interpreter`` cells); what crosses devices goes through host
callbacks (``compat.host_callback``: an unordered ``io_callback`` without its
copies into ``jax.Array``s) into one Python ``_Session`` per kernel call,
shared by the devices of the mesh:

* semaphores that another device or core can signal (REGULAR and BARRIER
  semaphores) are counters in the session; a wait blocks on a
  ``threading.Condition`` until other devices' signals satisfy it;
* a remote DMA's ``start`` reads its source on the sender and posts a message
  (the data and the flat element indices of its destination, computed on the
  sender: they may depend on the sender's device id) to a mailbox keyed by the
  target device and its receive semaphore; the target writes the data into
  its destination at ``wait_recv``. The send semaphore is local;
* pairing: the n-th call of a kernel on each device of a mesh meets the n-th
  call on the others (a device joins the oldest session it has not joined);
* a wait that no device can satisfy any more (every device of the mesh is
  finished or blocked) raises a deadlock error at once; a wait that lasts
  longer than ``deadlock_timeout`` seconds raises one too. An error on one
  device aborts the session on the others.

All of this lives in one Python process. In a ``jax.distributed`` job, devices
of other processes never join a session: a kernel that needs other devices
(remote DMAs, remote signals, barrier semaphores) under a ``shard_map`` whose
mesh spans processes is refused when it is traced (``_check_one_process``);
kernels that need no other device run over such meshes as anywhere else.

Callbacks of one device are chained by a token in ``Interpreter.hidden.tok`` so
XLA keeps them in program order.

Race detection (``InterpretParams(detect_races=True)``, ``races.py``) is a
happens-before detector with vector clocks: each (device, core) running the kernel and each
DMA is a thread; a semaphore signal releases the signaller's clock into the
semaphore and a wait acquires it; a DMA starts with its issuer's clock and the
thread that waits for it acquires the DMA's clock. Every kernel access of a
Ref and every DMA's source read and destination write is recorded (a callback
per access) with the flat element indices it touches; two accesses of
overlapping elements of one buffer, at least one a write, by threads with no
happens-before between them are a race, reported with both accesses named.
What can no longer race is forgotten as the kernel runs (``races.HappensBefore.collect``),
so the cost per grid step stays flat on long grids; a long run prints its
progress on stderr every few seconds (``PALLAS_TPU_PROGRESS_S``).
Cores of a device share their device's program: they run one after the other,
or, when they signal each other, take turns between semaphore waits
(``pallas_call._core_groups``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import dma as interpret_dma
from pallas_tpu._src.interpret import facts, progress
from pallas_tpu._src.interpret import races as races_mod
from pallas_tpu._src.interpret.interpreter import Interpreter, KernelError, RefView
from pallas_tpu._src.language import primitives as tpu_prims

# ---------------------------------------------------------------------------
# Process-wide state.

deadlock_timeout: float = float(os.environ.get("PALLAS_TPU_INTERPRET_DEADLOCK_TIMEOUT", "60"))


def set_deadlock_timeout(seconds: float) -> float:
    """Sets how long a blocked wait may last before it is reported as a
    deadlock (when the other devices are not all blocked); returns the old value."""
    global deadlock_timeout
    old, deadlock_timeout = deadlock_timeout, float(seconds)
    return old


@dataclasses.dataclass
class RaceDetectionState:
    """What race detection found (JAX's ``interpret_pallas_call.races``)."""

    races_found: bool = False
    messages: list[str] = dataclasses.field(default_factory=list)


races = RaceDetectionState()

_lock = threading.Lock()
_sessions: dict[int, _Session] = {}
_open: dict[Any, list[_Session]] = collections.defaultdict(list)
_next_sid = 0


def reset_tpu_interpret_mode_state() -> None:
    """Clears TPU interpret mode's shared state after an error (JAX's API; a forced
    default interpret mode stays): forgets every kernel session (devices that never
    met), the races found so far, and a failed kernel's error that JAX would raise
    again at the next ``jax.effects_barrier()``."""
    global races
    compat.forget_failed_effects()
    with _lock:
        for s in _sessions.values():
            with s.cv:
                s.error = s.error or "the TPU interpret mode state was reset"
                s.cv.notify_all()
        _sessions.clear()
        _open.clear()
    races = RaceDetectionState()


def _session(sid) -> _Session:
    s = _sessions.get(int(sid))
    if s is None:
        raise KernelError("TPU interpret mode: this kernel's session was reset while it ran")
    return s


@dataclasses.dataclass
class _Message:
    data: np.ndarray
    idx: np.ndarray
    dst_cell: int
    nbytes: int
    dma: Any
    site: str


def _inside(idx, shape) -> np.ndarray:
    """The flat indices of ``idx`` inside a cell of ``shape`` (positions past
    a traced DMA size hold the cell's size)."""
    idx = np.asarray(idx).reshape(-1)
    return idx[idx < math.prod(shape)]


class _Session:
    """One kernel call shared by the devices of a mesh (see the module docstring)."""

    def __init__(self, sid: int, key, num_devices: int, kernel: str, detect_races: bool, num_cores: int = 1):
        self.sid, self.key, self.num_devices, self.kernel = sid, key, num_devices, kernel
        self.detect_races = detect_races
        self.cv = threading.Condition()
        self.joined: set[int] = set()
        self.left: set[int] = set()
        self.blocked: dict[int, tuple[Any, str]] = {}
        self.error: str | None = None
        self.sems: dict[Any, int] = collections.defaultdict(int)
        self.sem_names: dict[Any, str] = {}
        self.mail: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self.inflight: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self.dma_sites: dict[Any, str] = {}
        self.staged: dict[Any, list[_Message]] = {}  # (device, core) -> remote DMAs a wait took, to land
        self.n_dma = 0
        self.num_cores = num_cores
        self.hb = races_mod.HappensBefore(num_devices, num_cores)
        self.num_steps, self.steps_done = 0, 0
        self.started = time.monotonic()
        self.next_report = self.started + progress.progress_seconds()

    # -- errors --

    def fail(self, msg: str) -> KernelError:
        """Aborts the session on every device; returns the error to raise here."""
        with _lock:
            if self.error is None:
                self.error = msg
            if self in _open.get(self.key, []):
                _open[self.key].remove(self)
        self.cv.notify_all()
        return KernelError(msg)

    def check_alive(self, dev: int) -> None:
        if self.error is not None:
            raise KernelError(f"{self.kernel}: device {dev} stopped because the kernel failed: {self.error}")

    # -- blocking --

    def block(self, dev: int, pred, desc) -> None:
        """Waits (holding ``cv``) until ``pred()``; raises on deadlock or timeout.
        ``desc`` (a string, or a function giving one when it is reported) says
        what ``dev`` waits for."""
        deadline = time.monotonic() + deadlock_timeout
        while not pred():
            self.check_alive(dev)
            self.blocked[dev] = (pred, desc)
            self.cv.notify_all()
            if len(self.joined) == self.num_devices and all(
                d in self.left or (d in self.blocked and not self.blocked[d][0]())
                for d in range(self.num_devices)
            ):
                states = [
                    f"device {d} {races_mod.text(self.blocked[d][1])}"
                    if d in self.blocked
                    else f"device {d} finished the kernel"
                    for d in range(self.num_devices)
                    if d != dev
                ]
                raise self.fail(
                    f"{self.kernel}: deadlock: device {dev} {races_mod.text(desc)}, and no device can signal it any more ("
                    + "; ".join(states)
                    + ")"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.num_devices)) - self.joined)
                extra = f"; devices {missing} never started the kernel" if missing else ""
                if missing and jax.process_count() > 1:
                    extra += (
                        " (devices run by other processes of a jax.distributed job never join: TPU "
                        "interpret mode keeps what devices share in one Python process)"
                    )
                raise self.fail(
                    f"{self.kernel}: deadlock: device {dev} {races_mod.text(desc)} and waited {deadlock_timeout:g} s "
                    f"(pallas_tpu interpret deadlock_timeout){extra}"
                )
            self.cv.wait(min(left, 0.25))
        self.blocked.pop(dev, None)

    # -- race detection --

    def record(self, buf, thread, write: bool, idx: np.ndarray, what) -> None:
        """Records an access and raises if it races with an earlier one
        (``what`` names it: a string, or a function giving one)."""
        if not self.detect_races:
            return
        race = self.hb.record(buf, thread, write, idx, what, self._waiting_dmas)
        if race is not None:
            msg = (
                f"{self.kernel}: data race: {race} touch the same memory with no synchronization "
                "between them (a semaphore signal and wait, a barrier, or waiting for the DMA)"
            )
            races.races_found = True
            races.messages.append(msg)
            raise self.fail(msg)

    def _waiting_dmas(self) -> set:
        """The DMAs not waited for yet: in flight, or in a mailbox or staged for a wait."""
        waiting = {d for q in self.inflight.values() for d in q}
        waiting.update(m.dma for q in self.mail.values() for m in q)
        waiting.update(m.dma for ms in self.staged.values() for m in ms)
        return waiting

    def progress(self, step: int, total: int) -> None:
        """A line on stderr every few seconds of a long race-detecting run."""
        self.steps_done = max(self.steps_done, step + 1)
        self.num_steps = total
        now = time.monotonic()
        if now < self.next_report:
            return
        self.next_report = now + max(progress.progress_seconds(), 1.0)
        elapsed, done, total = now - self.started, self.steps_done, self.num_steps
        tail = ""
        if total and done < total:
            tail = f", about {elapsed / done * (total - done):.0f} s left"
        print(
            f"pallas_tpu: detecting races {self.kernel}: grid step {done}"
            + (f" of {total}" if total else "")
            + f" after {elapsed:.1f} s{tail} (detect_races=True checks every memory access on the host)",
            file=sys.stderr,
            flush=True,
        )


_lowering_mesh = threading.local()


def lowering_mesh_devices():
    """The devices of the shard_map mesh whose lowering interprets a kernel, when
    the lowering rule said (``lowering_mesh``); None when not known."""
    return getattr(_lowering_mesh, "devices", None)


@contextlib.contextmanager
def lowering_mesh(axis_context):
    """Records the devices of ``axis_context``'s mesh (an SPMD axis context of
    JAX's lowering) while a kernel is interpreted."""
    mesh = getattr(axis_context, "mesh", None)
    devices = getattr(mesh, "devices", None)
    old = lowering_mesh_devices()
    _lowering_mesh.devices = None if devices is None else list(np.asarray(devices).reshape(-1))
    try:
        yield
    finally:
        _lowering_mesh.devices = old


def _join_session(
    key, num_devices: int, dev: int, kernel: str, detect_races: bool, num_cores: int = 1
) -> _Session:
    global _next_sid
    with _lock:
        for s in _open[key]:
            if dev not in s.joined:
                break
        else:
            s = _Session(_next_sid, key, num_devices, kernel, detect_races, num_cores)
            _next_sid += 1
            _sessions[s.sid] = s
            _open[key].append(s)
        s.joined.add(dev)
        if len(s.joined) == num_devices:
            _open[key].remove(s)
    with s.cv:
        s.cv.notify_all()
    return s


# ---------------------------------------------------------------------------


_SHARED_KINDS = (plb.SemaphoreKind.REGULAR, plb.SemaphoreKind.BARRIER)
_DMA_PRIMS = (tpu_prims.dma_start_p, tpu_prims.dma_wait_p)


class MultiDeviceInterpreter(Interpreter):
    """``Interpreter`` with devices: see the module docstring."""

    # -- lifecycle --

    def setup(self, jaxpr, compiler_params) -> None:
        names = compat.bound_axis_names()
        sizes = compat.axis_sizes()
        self.mesh_axes = tuple((n, int(sizes[n])) for n in names)
        self.num_devices = math.prod(s for _, s in self.mesh_axes)
        if facts.needs_multi_device(jaxpr):
            self._check_one_process()
        dev = jnp.int32(0)
        for n, s in self.mesh_axes:
            dev = dev * s + lax.axis_index(n).astype(jnp.int32)
        self.my_dev = dev
        self.core_id = 0
        self.races = self.params.detect_races
        self.remote_dst_cells: set[int] = set()  # where remote DMAs traced so far go
        self.remote_sem_cells: set[int] = set()  # and the semaphores they signal there
        self.hidden.tok = jnp.zeros((), jnp.int32)
        if facts.kernel_uses(jaxpr, {tpu_prims.get_barrier_semaphore_p}):
            cp = compiler_params[0] if isinstance(compiler_params, tuple) else compiler_params
            if getattr(cp, "collective_id", None) is None:
                raise ValueError(
                    f"{self.kernel_desc}: pltpu.get_barrier_semaphore() needs a collective id: pass "
                    "compiler_params=pltpu.CompilerParams(collective_id=0)"
                )
            cell = self.new_cell(
                jnp.zeros((), jnp.int32),
                "the barrier semaphore",
                plb.SemaphoreSpace(plb.SemaphoreKind.BARRIER),
            )
            self.barrier_cell = cell
        key = (self.mesh_axes, self.gm.kernel_name)
        n, desc, races_on = self.num_devices, self.kernel_desc, self.races
        cores = self.params.num_cores_or_threads

        def join(dev):
            return np.int32(_join_session(key, n, int(dev), desc, races_on, cores).sid)

        (self.sid,) = self._callback(join, [jax.ShapeDtypeStruct((), jnp.int32)], self.my_dev)

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
            s = _session(sid)
            dev = int(dev)
            with s.cv:
                s.check_alive(dev)
                s.left.add(dev)
                s.cv.notify_all()
                if len(s.left) < s.num_devices:
                    return ()
                with _lock:
                    _sessions.pop(s.sid, None)
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

        self._callback(leave, [], self.sid, self.my_dev)

    # -- callbacks --

    def _callback(self, fn, result_shapes, *args):
        """``fn(*args)`` on the host, after this device's earlier callbacks."""
        tok_shape = jax.ShapeDtypeStruct((), jnp.int32)

        progress = self.progress if self.races and args and args[0] is getattr(self, "sid", None) else None
        if progress is not None:  # a long race-detecting run says how far it got (see _Session.progress)
            args = (*args, *progress)

        def host(tok, *a):
            if progress is not None:
                *a, step, total = a
                _session(a[0]).progress(int(step), int(total))
            out = fn(*a)
            out = () if out is None else (out if isinstance(out, tuple) else (out,))
            return (np.asarray(tok, np.int32), *out)

        outs = compat.host_callback(host, (tok_shape, *result_shapes), self.hidden.tok, *args)
        self.hidden.tok = outs[0]
        return list(outs[1:])

    def _site(self, eqn) -> str:
        src = compat.eqn_user_source(eqn)
        return src or self.gm.kernel_name

    def _who(self, dev: int, core: int) -> str:
        return f"device {dev}, core {core}" if self.num_devices > 1 else f"core {core}"

    def _buf_name(self, cell: int, dev: int, idx, shape) -> str:
        name = self.cell_names.get(cell, f"ref#{cell}") + races_mod.region(np.unique(idx), shape)
        return f"{name} on device {dev}" if self.num_devices > 1 else name

    # -- views, indices, device ids --

    def _flat_indices(self, view: RefView, eqn, what: str):
        """The flat element indices of the cell that ``view`` covers (traced;
        past a traced size, the cell's size: see ``Interpreter.view_indices``)."""
        try:
            return self.view_indices(view, eqn, what)[0]
        except NotImplementedError:
            return jnp.arange(self.state[view.cell].size, dtype=jnp.int32)

    def _sem_key(self, view: RefView, eqn):
        name = self.cell_names.get(view.cell, f"ref#{view.cell}")
        key = (
            name
            if name.startswith("scratch_shapes[") or name == "the barrier semaphore"
            else (name, view.cell)
        )
        return key, name, self._flat_indices(view, eqn, "read").reshape(())

    def _is_shared_sem(self, cell: int) -> bool:
        sp = self.cell_spaces.get(cell)
        return isinstance(sp, plb.SemaphoreSpace) and sp.kind in _SHARED_KINDS

    def _target(self, device_id, device_id_type, eqn):
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
        if isinstance(self.cell_spaces.get(view.cell), plb.SemaphoreSpace):
            return
        idx = self._flat_indices(view, eqn, "write" if write else "read")
        cell, core, shape = view.cell, self.core_id, self.state[view.cell].shape
        site, buf_name, who = self._site(eqn), self._buf_name, self._who

        def access(sid, dev, idx):
            s, dev = _session(sid), int(dev)
            with s.cv:
                s.check_alive(dev)

                def what():
                    return (
                        f"{'write' if write else 'read'} of {buf_name(cell, dev, idx, shape)} "
                        f"by the kernel at {site} ({who(dev, core)})"
                    )

                s.record((dev, cell), ("core", dev, core), write, idx, what)

        self._callback(access, [], self.sid, self.my_dev, idx)

    def _dma_start_race(self, s, dev, core, dst_dev, v, src_idx, dst_idx, shapes, site, sem_key):
        """Host side: a new DMA thread with the issuer's clock; records its accesses."""
        thread = ("core", dev, core)
        s.n_dma += 1
        dma = ("dma", s.n_dma)
        s.hb.start_dma(thread, dma)
        s.inflight[sem_key].append(dma)
        src_cell, dst_cell = v
        src_idx, dst_idx = _inside(src_idx, shapes[0]), _inside(dst_idx, shapes[1])
        remote = "remote " if dst_dev is not None else ""
        by = f"the {remote}DMA started at {site} ({self._who(dev, core)})"
        s.record(
            (dev, src_cell),
            dma,
            False,
            src_idx,
            lambda: f"read of {self._buf_name(src_cell, dev, src_idx, shapes[0])} by {by}",
        )
        tgt = dev if dst_dev is None else dst_dev
        s.record(
            (tgt, dst_cell),
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
        src_idx = self._flat_indices(src, eqn, "read")
        dst_idx = self._flat_indices(dst, eqn, "write")
        key, _, sem_idx = self._sem_key(views["dst_sem"], eqn)
        core, site = self.core_id, self._site(eqn)
        cells = (src.cell, dst.cell)
        shapes = (self.state[src.cell].shape, self.state[dst.cell].shape)

        def start(sid, dev, sem_idx, src_idx, dst_idx):
            s, dev = _session(sid), int(dev)
            with s.cv:
                s.check_alive(dev)
                sk = ("dst", dev, core, key, int(sem_idx))
                self._dma_start_race(s, dev, core, None, cells, src_idx, dst_idx, shapes, site, sk)

        self._callback(start, [], self.sid, self.my_dev, sem_idx, src_idx, dst_idx)

    def _dma_done(self, eqn, sem_view, which: str) -> None:
        key, _, sem_idx = self._sem_key(sem_view, eqn)
        core = self.core_id

        def done(sid, dev, sem_idx):
            s, dev = _session(sid), int(dev)
            with s.cv:
                s.check_alive(dev)
                q = s.inflight.get((which, dev, core, key, int(sem_idx)))
                if q:
                    dma = q.popleft()
                    thread = ("core", dev, core)
                    s.hb.acquire(thread, dma)

        self._callback(done, [], self.sid, self.my_dev, sem_idx)

    def on_dma_wait(self, eqn, views) -> None:
        if self.races:
            self._dma_done(eqn, views["dst_sem"], "dst")

    # -- semaphores --

    def _signal(self, eqn, view, inc, target, core):
        key, name, sem_idx = self._sem_key(view, eqn)
        my_core, what = self.core_id, f"{self.where(eqn)}: pl.semaphore_signal"
        n_cores = self.params.num_cores_or_threads

        def signal(sid, dev, target, core, sem_idx, inc):
            s, dev, target, core = _session(sid), int(dev), int(target), int(core)
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

        core = jnp.int32(self.core_id) if core is None else jnp.asarray(core, jnp.int32)
        self._callback(signal, [], self.sid, self.my_dev, target, core, sem_idx, jnp.asarray(inc, jnp.int32))

    def sem_add(self, view, amount, eqn) -> None:
        if not self._is_shared_sem(view.cell):
            return super().sem_add(view, amount, eqn)
        self._signal(eqn, view, amount, self.my_dev, None)

    def remote_signal(self, eqn, view, inc, device_id, core_index) -> None:
        target = (
            self.my_dev if device_id is None else self._target(device_id, eqn.params["device_id_type"], eqn)
        )
        self._signal(eqn, view, inc, target, core_index)

    def sem_wait(self, view, amount, eqn, decrement=True, what="semaphore") -> None:
        if not self._is_shared_sem(view.cell):
            return super().sem_wait(view, amount, eqn, decrement=decrement, what=what)
        key, name, sem_idx = self._sem_key(view, eqn)
        core, where = self.core_id, self._site(eqn)

        def wait(sid, dev, sem_idx, amount):
            s, dev, amount = _session(sid), int(dev), int(amount)
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

        self._callback(wait, [], self.sid, self.my_dev, sem_idx, jnp.asarray(amount, jnp.int32))

    def read_view(self, view, eqn, what="read"):
        if eqn is not None and eqn.primitive is plb.semaphore_read_p and self._is_shared_sem(view.cell):
            key, _, sem_idx = self._sem_key(view, eqn)
            core = self.core_id

            def read(sid, dev, sem_idx):
                s = _session(sid)
                with s.cv:
                    return np.int32(s.sems[(int(dev), core, key, int(sem_idx))])

            (v,) = self._callback(read, [jax.ShapeDtypeStruct((), jnp.int32)], self.sid, self.my_dev, sem_idx)
            return v
        return super().read_view(view, eqn, what)

    # -- remote DMAs --

    def remote_dma_start(self, eqn, v, layout) -> None:
        src, dst = interpret_dma.endpoints(self, eqn, v["src"], v["dst"])
        nbytes = src.nbytes
        data = interpret_dma.read(self, src, eqn, "DMA read").reshape(-1)
        dst_idx = dst.idx if dst.idx is not None else self._flat_indices(dst.view, eqn, "remote DMA write")
        dst_idx = dst_idx.reshape(-1)
        src_idx = self._flat_indices(src.view, eqn, "read") if self.races else jnp.zeros((0,), jnp.int32)
        device_id = tree_util.tree_unflatten(layout.device_id_tree, v["device_id"])
        target = self._target(device_id, layout.device_id_type, eqn)
        key, _, sem_idx = self._sem_key(v["dst_sem"], eqn)
        skey, _, ssem_idx = self._sem_key(v["src_sem"], eqn)
        core, site, what = self.core_id, self._site(eqn), f"{self.where(eqn)}: pltpu.make_async_remote_copy"
        cells = (src.cell, dst.cell)
        shapes = (self.state[src.cell].shape, self.state[dst.cell].shape)
        self.remote_dst_cells.add(dst.cell)
        self.remote_sem_cells.add(v["dst_sem"].cell)

        def send(sid, dev, target, sem_idx, ssem_idx, nbytes, data, dst_idx, src_idx):
            s, dev, target = _session(sid), int(dev), int(target)
            with s.cv:
                s.check_alive(dev)
                if not 0 <= target < s.num_devices:
                    raise s.fail(f"{what}: device_id {target} is outside the mesh of {s.num_devices} devices")
                if target in s.left:
                    raise s.fail(
                        f"{what}: device {target} has already finished the kernel (it never waits for this DMA)"
                    )
                dma = None
                if s.detect_races:
                    sk = ("send", dev, core, skey, int(ssem_idx))
                    dma = self._dma_start_race(
                        s, dev, core, target, cells, src_idx, dst_idx, shapes, site, sk
                    )
                msg = _Message(
                    np.asarray(data),
                    np.asarray(dst_idx),
                    cells[1],
                    int(nbytes),
                    dma,
                    f"{site} (device {dev})",
                )
                s.mail[(target, core, key, int(sem_idx))].append(msg)
                s.cv.notify_all()

        self._callback(
            send,
            [],
            self.sid,
            self.my_dev,
            target,
            sem_idx,
            ssem_idx,
            jnp.asarray(nbytes, jnp.int32),
            data,
            dst_idx,
            src_idx,
        )
        Interpreter.sem_add(self, v["src_sem"], nbytes, eqn)

    def remote_dma_wait(self, eqn, v, layout, which) -> None:
        nbytes = interpret_dma.dma_nbytes(self, v["src"], eqn)
        Interpreter.sem_wait(self, v["src_sem"], nbytes, eqn, what="DMA send semaphore")
        if self.races:
            self._dma_done(eqn, v["src_sem"], "send")

    def dma_receive(self, eqn, sem, dst, nbytes, remote) -> None:
        """A DMA wait (``.wait_recv()``, or a local descriptor's ``.wait()`` on
        a semaphore remote DMAs signal): when ``sem`` holds fewer than ``nbytes``,
        remote DMAs sent to it land, in the order they were started, until it
        holds enough (blocking for them; a deadlock when no device can send
        more). They land where their ``start`` said, whatever this wait's
        descriptor names; bytes beyond ``nbytes`` stay on the semaphore."""
        if not (remote or sem.cell in self.remote_sem_cells):
            return  # a local wait on a semaphore no remote DMA (so far in the code) signals
        need = jnp.maximum(jnp.asarray(nbytes, jnp.int32) - Interpreter.read_view(self, sem, eqn), 0)
        key, name, sem_idx = self._sem_key(sem, eqn)
        with self.unchecked():  # the wait's descriptor names no memory on a TPU
            wait = interpret_dma.dma_view(self, dst, eqn, "DMA wait")
        cap = wait.idx.size if wait.idx is not None else math.prod(wait.shape)
        cell, x = dst.cell, self.state[dst.cell]
        size, dtype = x.size, np.dtype(x.dtype)
        core, where = self.core_id, self._site(eqn)
        label = f"{name}[{{}}] (core {core})"

        def pull(sid, dev, sem_idx, need):
            s, dev, need = _session(sid), int(dev), int(need)
            k = (dev, core, key, int(sem_idx))
            with s.cv:
                s.check_alive(dev)
                q = s.mail[k]
                s.block(
                    dev,
                    lambda: sum(m.nbytes for m in q) >= need,
                    lambda: (
                        f"waits at {where} on {label.format(int(sem_idx))} for {need} bytes more than it holds, "
                        f"and the remote DMAs sent to it carry {sum(m.nbytes for m in q)}"
                    ),
                )
                got, received = [], 0
                while received < need:
                    m = q.popleft()
                    got.append(m)
                    received += m.nbytes
                    if s.detect_races and m.dma is not None:
                        thread = ("core", dev, core)
                        s.hb.acquire(thread, m.dma)
                data, idx = np.zeros(cap, dtype), np.full(cap, size, np.int32)
                n = sum(m.data.size for m in got)
                if all(m.dst_cell == cell for m in got) and n <= cap:  # all into the buffer the wait names
                    if got:
                        data[:n] = np.concatenate([m.data.reshape(-1) for m in got])
                        idx[:n] = np.concatenate([m.idx.reshape(-1) for m in got])
                    return np.int32(received), data, idx, np.int32(0)
                s.staged[(dev, core)] = got
                return np.int32(received), data, idx, np.int32(1)

        shapes = [
            jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((cap,), x.dtype),
            jax.ShapeDtypeStruct((cap,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32),
        ]

        def take(tok, need):
            self.hidden.tok = tok
            outs = self._callback(pull, shapes, self.sid, self.my_dev, sem_idx, need)
            return self.hidden.tok, *outs

        def nothing(tok, need):
            return (
                tok,
                *(jnp.zeros(a.shape, a.dtype) for a in shapes[:2]),
                jnp.full((cap,), size, jnp.int32),
                jnp.int32(0),
            )

        tok, received, data, idx, staged = lax.cond(need > 0, take, nothing, self.hidden.tok, need)
        self.hidden.tok = tok
        self.state[cell] = x.reshape(-1).at[idx].set(data, mode="drop").reshape(x.shape)
        self._land_staged(eqn, staged, [cell, *sorted(self.remote_dst_cells - {cell})])
        Interpreter.sem_add(self, sem, received, eqn)

    def _land_staged(self, eqn, staged, cells) -> None:
        """The remote DMAs a wait took that did not all go to the buffer its
        descriptor names land in ``cells`` (the buffers remote DMAs started so
        far went to), whole buffers at a time."""
        cells = [c for c in cells if c in self.state]
        metas = [(c, self.state[c].size, np.dtype(self.state[c].dtype)) for c in cells]
        names = {c: self.cell_names.get(c, f"ref#{c}") for c in cells}
        core, where = self.core_id, self._site(eqn)

        def land(sid, dev):
            s, dev = _session(sid), int(dev)
            outs = [(np.zeros(n, dt), np.full(n, n, np.int32)) for _, n, dt in metas]
            with s.cv:
                for m in s.staged.pop((dev, core), []):
                    j = next((j for j, (c, _, _) in enumerate(metas) if c == m.dst_cell), None)
                    if j is None:
                        raise s.fail(
                            f"{s.kernel}: the remote DMA started at {m.site} goes to "
                            f"{self.cell_names.get(m.dst_cell, '?')}, but the wait at {where} that takes its "
                            f"bytes names {names[cells[0]]}, and the TPU interpreter lands a remote DMA only at "
                            "a wait whose descriptor names its destination buffer, or the destination of a remote "
                            "DMA that comes before the wait in the kernel's code: wait with a descriptor of the "
                            "DMA's destination buffer"
                        )
                    data, idx = outs[j]
                    inside = m.idx < metas[j][1]
                    data[m.idx[inside]] = m.data.reshape(-1)[inside]
                    idx[m.idx[inside]] = m.idx[inside]
            return tuple(a for pair in outs for a in pair)

        shapes = [
            s
            for _, n, dt in metas
            for s in (jax.ShapeDtypeStruct((n,), dt), jax.ShapeDtypeStruct((n,), jnp.int32))
        ]

        def go(tok, vals):
            self.hidden.tok = tok
            outs = self._callback(land, shapes, self.sid, self.my_dev)
            new = [
                v.reshape(-1).at[i].set(d, mode="drop").reshape(v.shape)
                for v, d, i in zip(vals, outs[0::2], outs[1::2])
            ]
            return self.hidden.tok, new

        tok, vals = lax.cond(
            staged > 0,
            go,
            lambda tok, vals: (tok, list(vals)),
            self.hidden.tok,
            [self.state[c] for c in cells],
        )
        self.hidden.tok = tok
        for c, v in zip(cells, vals):
            self.state[c] = v
