"""What the devices of one multi-device kernel call share: one Python ``Session``
per kernel call (``multi.py`` runs the devices; each reaches its session through host
callbacks, ``session_link.py``), and the process-wide state behind it (open sessions,
``races``, the deadlock timeout):

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
mesh spans processes is refused when it is traced (``session_link.SessionLink``);
kernels that need no other device run over such meshes as anywhere else.

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
import numpy as np

from pallas_tpu._src import compat
from pallas_tpu._src.interpret import progress
from pallas_tpu._src.interpret import races as races_mod
from pallas_tpu._src.interpret.errors import KernelError

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
    count: int = 0  # races found (``messages`` keeps the first ones)


races = RaceDetectionState()

# Races printed per kernel call; the rest are counted (``races.messages`` keeps
# the first ``_MAX_MESSAGES``).
_MAX_PRINTED, _MAX_MESSAGES = 8, 100


def report_race(msg: str, printed: bool = True) -> None:
    """A race found, reported as JAX's detector reports one: ``races.races_found``
    is set and (``printed``) the race printed on stderr (``RACE DETECTED``, then our
    sentence naming both accesses, also kept in ``races.messages``)."""
    races.races_found = True
    races.count += 1
    if len(races.messages) < _MAX_MESSAGES:
        races.messages.append(msg)
    if not printed:
        return
    if races.count <= _MAX_PRINTED:
        print(f"RACE DETECTED\n  {msg}", file=sys.stderr, flush=True)
    elif races.count == _MAX_PRINTED + 1:
        print(
            "RACE DETECTED: further races of this kernel call are counted in races.count, not printed",
            file=sys.stderr,
            flush=True,
        )


def reset_races() -> None:
    """A fresh ``races`` for a kernel call (JAX's interpreter starts each call with
    its own state): ``races.races_found`` says what the latest call found."""
    global races
    races = RaceDetectionState()


# The sessions of this process: the live ones by id, and by key those that not every
# device of the mesh has joined yet (``join_session`` pairs the devices' calls).
_lock = threading.Lock()
_live: dict[int, Session] = {}
_open: dict[Any, list[Session]] = collections.defaultdict(list)
_next_sid = 0


def reset_tpu_interpret_mode_state() -> None:
    """Clears TPU interpret mode's shared state after an error (JAX's API; a forced
    default interpret mode stays): forgets every kernel session (devices that never
    met), the races found so far, and a failed kernel's error that JAX would raise
    again at the next ``jax.effects_barrier()``."""
    global races
    compat.forget_failed_effects()
    with _lock:
        for s in _live.values():
            with s.cv:
                s.error = s.error or "the TPU interpret mode state was reset"
                s.cv.notify_all()
        _live.clear()
        _open.clear()
    races = RaceDetectionState()


def get_session(sid) -> Session:
    s = _live.get(int(sid))
    if s is None:
        raise KernelError("TPU interpret mode: this kernel's session was reset while it ran")
    return s


@dataclasses.dataclass
class Message:
    data: np.ndarray
    idx: np.ndarray
    dst_cell: int
    nbytes: int
    dma: Any
    site: str


def index_inside(idx, shape) -> np.ndarray:
    """The flat indices of ``idx`` inside a cell of ``shape`` (positions past
    a traced DMA size hold the cell's size)."""
    idx = np.asarray(idx).reshape(-1)
    return idx[idx < math.prod(shape)]


class Session:
    """One kernel call shared by the devices of a mesh (see the module docstring)."""

    def __init__(
        self, sid: int, key, num_devices: int, kernel: str, detect_races: bool | str, num_cores: int = 1
    ):
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
        self.staged: dict[Any, list[Message]] = {}  # (device, core) -> remote DMAs a wait took, to land
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

    def leave(self, dev: int) -> None:
        """``dev`` finished the kernel; the last device to finish closes the session,
        and raises if a signal or a remote DMA was never waited for."""
        with self.cv:
            self.check_alive(dev)
            self.left.add(dev)
            self.cv.notify_all()
            if len(self.left) < self.num_devices:
                return
            with _lock:
                _live.pop(self.sid, None)
            for key, v in self.sems.items():
                if v:
                    raise self.fail(
                        f"{self.kernel}: {self.sem_names[key]} holds {v} when the kernel ends on every device "
                        "(a signal was not waited for)"
                    )
            for key, q in self.mail.items():
                if q:
                    raise self.fail(
                        f"{self.kernel}: the remote DMA started at {q[0].site} was never waited for by its "
                        f"receiver (device {key[0]}: .wait_recv() on its receive semaphore)"
                    )

    # -- race detection --

    def record(self, buf, thread, write: bool, idx: np.ndarray, what) -> None:
        """Records an access (``what`` names it: a string, or a function giving one).
        One that races with an earlier one is reported as JAX's detector reports it
        (``report_race``); then, with ``on_race="raise"``, the kernel stops with that
        error, else it goes on."""
        if not self.detect_races:
            return
        race = self.hb.record(buf, thread, write, idx, what, self._waiting_dmas)
        if race is not None:
            msg = (
                f"{self.kernel}: data race: {race} touch the same memory with no synchronization "
                "between them (a semaphore signal and wait, a barrier, or waiting for the DMA)"
            )
            report_race(msg, printed=self.detect_races != "raise")
            if self.detect_races == "raise":
                raise self.fail(f"RACE DETECTED: {msg}")

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


def join_session(
    key, num_devices: int, dev: int, kernel: str, detect_races: bool | str, num_cores: int = 1
) -> Session:
    global _next_sid
    with _lock:
        for s in _open[key]:
            if dev not in s.joined:
                break
        else:
            s = Session(_next_sid, key, num_devices, kernel, detect_races, num_cores)
            _next_sid += 1
            if detect_races:
                reset_races()  # each call's own findings, as in JAX's interpreter
            _live[s.sid] = s
            _open[key].append(s)
        s.joined.add(dev)
        if len(s.joined) == num_devices:
            _open[key].remove(s)
    with s.cv:
        s.cv.notify_all()
    return s
