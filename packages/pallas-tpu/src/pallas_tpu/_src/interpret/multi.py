"""The multi-device TPU interpreter: remote DMAs, remote semaphore signals,
barrier semaphores, and race detection.

A kernel called inside ``jax.shard_map`` runs once per device, each device's
copy as its own XLA program, and XLA's CPU client runs those programs on
separate threads at the same time. The kernel's data stays functional per
device (``Interpreter`` cells); what crosses devices goes through host
callbacks (``compat.host_callback``: an unordered ``io_callback`` without its
copies into ``jax.Array``s) into one Python ``Session`` per kernel call,
shared by the devices of the mesh (``sessions.py``: semaphores that other devices signal, the mailboxes of remote
DMAs, pairing the devices of a call, deadlock errors, race records).
``DeviceTransport`` is the ``Interpreter``'s transport for such kernels (the
interface is ``transport.LocalTransport``'s); ``remote_dma.py`` holds its remote
DMAs. Both reach the session through the device's ``session_link.SessionLink``
(the session and device ids, the callbacks, chained by a token in the interpreter's
hidden state so XLA keeps them in program order, semaphore keys, device ids, the
race records of DMAs).

Race detection (``InterpretParams(detect_races=True)``, ``races.py``, recorded by
the session) sees every kernel access of a Ref and every DMA's source read and
destination write: ``on_access``, ``on_dma_start`` and the waits below.

Cores of a device share their device's program: they run one after the other,
or, when they signal each other, take turns between semaphore waits
(``pallas_call._core_groups``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import sessions
from pallas_tpu._src.interpret.cursor import Cursor
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.interpret.refs import RefView
from pallas_tpu._src.interpret.remote_dma import RemoteDMAs
from pallas_tpu._src.interpret.session_link import SessionLink
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
    races (see the module docstring), over the device's ``link`` to its session
    (``session_link.SessionLink``). It reads the kernel's ``memory`` (cells, their
    spaces and shapes) and follows the interpreter's ``cursor`` (the core being
    traced); ``where(eqn)`` names an equation in messages, ``kernel_desc`` the kernel.
    Remote DMAs are its ``remote`` (``remote_dma.RemoteDMAs``, made by the interpreter over
    the same link)."""

    def __init__(
        self,
        memory: Memory,
        cursor: Cursor,
        link: SessionLink,
        remote: RemoteDMAs,
        *,
        where: Callable[[Any], str],
        kernel_desc: str,
        kernel_facts: plb.KernelFacts,
        num_cores: int,
        collective_id: int | None,
    ):
        self.memory = memory
        self.cursor = cursor
        self.link = link
        self.where = where
        self.kernel_desc = kernel_desc
        self.kernel_facts = kernel_facts
        self.num_cores = num_cores
        self.collective_id = collective_id
        self.barrier_cell: int | None = None  # the barrier semaphore, when the kernel uses it
        self.remote = remote

    # -- lifecycle --

    def start(self) -> None:
        kf = self.kernel_facts  # the call record's facts
        self.link.locate(kf.remote or kf.signals_cores or kf.uses(tpu_prims.get_barrier_semaphore_p))
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
        self.link.join()

    def finish(self) -> None:
        self.link.leave()

    def shares(self, cell: int) -> bool:
        sp = self.memory.cell_spaces.get(cell)
        return isinstance(sp, plb.SemaphoreSpace) and sp.kind in _SHARED_KINDS

    # -- memory accesses (race detection) --

    def on_access(self, view: RefView, eqn, write: bool) -> None:
        if not self.link.races or eqn is None or eqn.primitive in _DMA_PRIMS:
            return
        if eqn.primitive is compat.swap_p and not write:
            return  # a store: its read of the old value is not a memory read
        if isinstance(self.memory.cell_spaces.get(view.cell), plb.SemaphoreSpace):
            return
        idx = self.link.flat_indices(view, eqn, "write" if write else "read")
        cell, core, shape = view.cell, self.cursor.core_id, self.memory.state[view.cell].shape
        link, site = self.link, self.link.site(eqn)

        def access(s, dev, idx):
            with s.cv:
                s.check_alive(dev)

                def what():
                    return (
                        f"{'write' if write else 'read'} of {link.buf_name(cell, dev, idx, shape)} "
                        f"by the kernel at {site} ({link.who(dev, core)})"
                    )

                s.record(link.race_buf(dev, cell, core), ("core", dev, core), write, idx, what)

        self.link.call(access, [], idx)

    def on_block_write(self, hbm_cell: int, starts, sizes, origin: str, when=True) -> None:
        """The pipeline's write-back of an output block (a DMA on the chip) is the
        core's write of that part of HBM: two cores writing one block race (as JAX's
        TPU interpret mode says), however the cores take turns here."""
        if not self.link.races:
            return
        shape = self.memory.state[hbm_cell].shape
        axes = [jnp.arange(n, dtype=jnp.int32) + jnp.asarray(st, jnp.int32) for st, n in zip(starts, sizes)]
        idx = jnp.ravel_multi_index(jnp.meshgrid(*axes, indexing="ij"), shape, mode="clip").reshape(-1)
        core, link = self.cursor.core_id, self.link

        def access(s, dev, idx, when):
            if not bool(when):
                return
            with s.cv:
                s.check_alive(dev)

                def what():
                    where = link.buf_name(hbm_cell, dev, idx, shape)
                    return (
                        f"write of {where} by the pipeline's write-back of {origin} ({link.who(dev, core)})"
                    )

                s.record(link.race_buf(dev, hbm_cell, core), ("core", dev, core), True, idx, what)

        self.link.call(access, [], idx, jnp.asarray(when))

    def on_dma_start(self, eqn, views) -> None:
        if not self.link.races:
            return
        src, dst = views["src"], views["dst"]
        src_idx = self.link.flat_indices(src, eqn, "read")
        dst_idx = self.link.flat_indices(dst, eqn, "write")
        key, _, sem_idx = self.link.sem_key(views["dst_sem"], eqn)
        core, site, link = self.cursor.core_id, self.link.site(eqn), self.link
        cells = (src.cell, dst.cell)
        shapes = (self.memory.state[src.cell].shape, self.memory.state[dst.cell].shape)

        def start(s, dev, sem_idx, src_idx, dst_idx):
            with s.cv:
                s.check_alive(dev)
                sk = ("dst", dev, core, key, int(sem_idx))
                link.dma_start_race(s, dev, core, None, cells, src_idx, dst_idx, shapes, site, sk)

        self.link.call(start, [], sem_idx, src_idx, dst_idx)

    def on_dma_wait(self, eqn, views) -> None:
        if self.link.races:
            self.link.dma_done(eqn, views["dst_sem"], "dst")

    # -- semaphores --

    def _signal(self, eqn, view, inc, target, core):
        key, name, sem_idx = self.link.sem_key(view, eqn)
        my_core, what = self.cursor.core_id, f"{self.where(eqn)}: pl.semaphore_signal"
        n_cores = self.num_cores

        def signal(s, dev, target, core, sem_idx, inc):
            target, core = int(target), int(core)
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
        self.link.call(signal, [], target, core, sem_idx, jnp.asarray(inc, jnp.int32))

    def sem_add(self, view, amount, eqn) -> None:
        self._signal(eqn, view, amount, self.link.my_dev, None)

    def remote_signal(self, eqn, view, inc, device_id, core_index) -> None:
        target = (
            self.link.my_dev
            if device_id is None
            else self.link.device_target(device_id, eqn.params["device_id_type"], eqn)
        )
        self._signal(eqn, view, inc, target, core_index)

    def sem_wait(self, view, amount, eqn, decrement=True, what="semaphore") -> None:
        key, name, sem_idx = self.link.sem_key(view, eqn)
        core, where = self.cursor.core_id, self.link.site(eqn)

        def wait(s, dev, sem_idx, amount):
            amount = int(amount)
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

        self.link.call(wait, [], sem_idx, jnp.asarray(amount, jnp.int32))

    def sem_read(self, view, eqn):
        """``pl.semaphore_read`` of a semaphore the session keeps (``shares``)."""
        key, _, sem_idx = self.link.sem_key(view, eqn)
        core = self.cursor.core_id

        def read(s, dev, sem_idx):
            with s.cv:
                return np.int32(s.sems[(dev, core, key, int(sem_idx))])

        (v,) = self.link.call(read, [jax.ShapeDtypeStruct((), jnp.int32)], sem_idx)
        return v

    # -- remote DMAs (remote_dma.RemoteDMAs) --

    def remote_dma_start(self, eqn, parts, layout) -> None:
        self.remote.start(eqn, parts, layout)

    def remote_dma_wait(self, eqn, parts, layout, which) -> None:
        self.remote.wait_send(eqn, parts, layout, which)

    def dma_receive(self, eqn, sem, dst, nbytes, remote) -> None:
        self.remote.receive(eqn, sem, dst, nbytes, remote)
