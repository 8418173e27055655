"""Remote DMAs of the multi-device TPU interpreter (``multi.py``): a DMA's
``start`` on the sender posts its data to the session's mailbox of the target
device and receive semaphore; a wait on the target lands it (``dma_receive``),
or stages what does not go to the buffer the wait names (``_land_staged``).
``RemoteDMAs`` is a part of ``multi.DeviceTransport``: it reaches the session
through the device's ``session_link.SessionLink`` (which the transport is handed
too), and the kernel's memory through the parts it is handed (``Memory``,
``RefAccess``, ``dma_views.DmaViews``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

from pallas_tpu._src.interpret.cursor import Cursor
from pallas_tpu._src.interpret.dma_views import DmaViews
from pallas_tpu._src.interpret.errors import Checks
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.interpret.refs import RefAccess
from pallas_tpu._src.interpret.semaphores import LocalSemaphores
from pallas_tpu._src.interpret.session_link import SessionLink
from pallas_tpu._src.interpret.sessions import Message


class RemoteDMAs:
    """The remote DMAs of a ``DeviceTransport`` (see the module docstring) over
    ``memory``'s cells: their ends made, read and written by ``views``; reads of
    semaphores through ``refs``; the core's own semaphores ``local_sems``; ``checks``
    (the waits' descriptors are not bound-checked); the interpreter's ``cursor`` (the
    core being traced, the callback token); the device's ``link`` to its session (its
    callbacks, semaphore keys, device ids and race records); ``where(eqn)`` names
    an equation. Keeps where the remote DMAs traced so far go."""

    def __init__(
        self,
        memory: Memory,
        refs: RefAccess,
        checks: Checks,
        cursor: Cursor,
        local_sems: LocalSemaphores,
        views: DmaViews,
        link: SessionLink,
        where: Callable[[Any], str],
    ):
        self.memory = memory
        self.refs = refs
        self.checks = checks
        self.cursor = cursor
        self.local_sems = local_sems
        self.views = views
        self.link = link
        self.where = where
        self.dst_cells: set[int] = set()  # where remote DMAs traced so far go
        self.sem_cells: set[int] = set()  # and the semaphores they signal there

    def start(self, eqn, v, layout) -> None:
        src, dst = self.views.endpoints(eqn, v["src"], v["dst"])
        nbytes = src.nbytes
        data = self.views.read(src, eqn, "DMA read").reshape(-1)
        dst_idx = (
            dst.idx if dst.idx is not None else self.link.flat_indices(dst.view, eqn, "remote DMA write")
        )
        dst_idx = dst_idx.reshape(-1)
        src_idx = (
            self.link.flat_indices(src.view, eqn, "read") if self.link.races else jnp.zeros((0,), jnp.int32)
        )
        device_id = tree_util.tree_unflatten(layout.device_id_tree, v["device_id"])
        target = self.link.device_target(device_id, layout.device_id_type, eqn)
        key, _, sem_idx = self.link.sem_key(v["dst_sem"], eqn)
        skey, _, ssem_idx = self.link.sem_key(v["src_sem"], eqn)
        core, site, what = (
            self.cursor.core_id,
            self.link.site(eqn),
            f"{self.where(eqn)}: pltpu.make_async_remote_copy",
        )
        cells = (src.cell, dst.cell)
        shapes = (self.memory.state[src.cell].shape, self.memory.state[dst.cell].shape)
        self.dst_cells.add(dst.cell)
        self.sem_cells.add(v["dst_sem"].cell)

        def send(s, dev, target, sem_idx, ssem_idx, nbytes, data, dst_idx, src_idx):
            target = int(target)
            with s.cv:
                s.check_alive(dev)
                if not 0 <= target < s.num_devices:
                    raise s.fail(f"{what}: device_id {target} is outside the mesh of {s.num_devices} devices")
                if int(nbytes) == 0:
                    # An empty DMA (a traced size of 0: tokamax's routing gmm sends its dead rows
                    # so) moves nothing and adds nothing to the receive semaphore: nothing to wait for.
                    return
                if target in s.left:
                    raise s.fail(
                        f"{what}: device {target} has already finished the kernel (it never waits for this DMA)"
                    )
                dma = None
                if s.detect_races:
                    sk = ("send", dev, core, skey, int(ssem_idx))
                    dma = self.link.dma_start_race(
                        s, dev, core, target, cells, src_idx, dst_idx, shapes, site, sk
                    )
                msg = Message(
                    np.asarray(data),
                    np.asarray(dst_idx),
                    cells[1],
                    int(nbytes),
                    dma,
                    f"{site} (device {dev})",
                )
                s.mail[(target, core, key, int(sem_idx))].append(msg)
                s.cv.notify_all()

        self.link.call(
            send,
            [],
            target,
            sem_idx,
            ssem_idx,
            jnp.asarray(nbytes, jnp.int32),
            data,
            dst_idx,
            src_idx,
        )
        self.local_sems.add(v["src_sem"], nbytes, eqn)

    def wait_send(self, eqn, v, layout, which) -> None:
        nbytes = self.views.dma_nbytes(v["src"], eqn)
        self.local_sems.wait(v["src_sem"], nbytes, eqn, what="DMA send semaphore")
        if self.link.races:
            self.link.dma_done(eqn, v["src_sem"], "send")

    def receive(self, eqn, sem, dst, nbytes, remote) -> None:
        """A DMA wait (``.wait_recv()``, or a local descriptor's ``.wait()`` on
        a semaphore remote DMAs signal): when ``sem`` holds fewer than ``nbytes``,
        remote DMAs sent to it land, in the order they were started, until it
        holds enough (blocking for them; a deadlock when no device can send
        more). They land where their ``start`` said, whatever this wait's
        descriptor names; bytes beyond ``nbytes`` stay on the semaphore."""
        if not (remote or sem.cell in self.sem_cells):
            return  # a local wait on a semaphore no remote DMA (so far in the code) signals
        need = jnp.maximum(jnp.asarray(nbytes, jnp.int32) - self.refs.read_view(sem, eqn), 0)
        key, name, sem_idx = self.link.sem_key(sem, eqn)
        with self.checks.unchecked():  # the wait's descriptor names no memory on a TPU
            wait = self.views.dma_view(dst, eqn, "DMA wait")
        cap = wait.idx.size if wait.idx is not None else math.prod(wait.shape)
        cell, x = dst.cell, self.memory.state[dst.cell]
        size, dtype = x.size, np.dtype(x.dtype)
        core, where = self.cursor.core_id, self.link.site(eqn)
        label = f"{name}[{{}}] (core {core})"

        def pull(s, dev, sem_idx, need):
            need = int(need)
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
            self.cursor.hidden.tok = tok
            outs = self.link.call(pull, shapes, sem_idx, need)
            return self.cursor.hidden.tok, *outs

        def nothing(tok, need):
            return (
                tok,
                *(jnp.zeros(a.shape, a.dtype) for a in shapes[:2]),
                jnp.full((cap,), size, jnp.int32),
                jnp.int32(0),
            )

        tok, received, data, idx, staged = lax.cond(need > 0, take, nothing, self.cursor.hidden.tok, need)
        self.cursor.hidden.tok = tok
        self.memory.state[cell] = x.reshape(-1).at[idx].set(data, mode="drop").reshape(x.shape)
        self._land_staged(eqn, staged, [cell, *sorted(self.dst_cells - {cell})])
        self.local_sems.add(sem, received, eqn)

    def _land_staged(self, eqn, staged, cells) -> None:
        """The remote DMAs a wait took that did not all go to the buffer its
        descriptor names land in ``cells`` (the buffers remote DMAs started so
        far went to), whole buffers at a time."""
        cells = [c for c in cells if c in self.memory.state]
        metas = [(c, self.memory.state[c].size, np.dtype(self.memory.state[c].dtype)) for c in cells]
        names = {c: self.memory.cell_names.get(c, f"ref#{c}") for c in cells}
        core, where = self.cursor.core_id, self.link.site(eqn)

        def land(s, dev):
            outs = [(np.zeros(n, dt), np.full(n, n, np.int32)) for _, n, dt in metas]
            with s.cv:
                for m in s.staged.pop((dev, core), []):
                    j = next((j for j, (c, _, _) in enumerate(metas) if c == m.dst_cell), None)
                    if j is None:
                        raise s.fail(
                            f"{s.kernel}: the remote DMA started at {m.site} goes to "
                            f"{self.memory.cell_names.get(m.dst_cell, '?')}, but the wait at {where} that takes its "
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
            self.cursor.hidden.tok = tok
            outs = self.link.call(land, shapes)
            new = [
                v.reshape(-1).at[i].set(d, mode="drop").reshape(v.shape)
                for v, d, i in zip(vals, outs[0::2], outs[1::2])
            ]
            return self.cursor.hidden.tok, new

        tok, vals = lax.cond(
            staged > 0,
            go,
            lambda tok, vals: (tok, list(vals)),
            self.cursor.hidden.tok,
            [self.memory.state[c] for c in cells],
        )
        self.cursor.hidden.tok = tok
        for c, v in zip(cells, vals):
            self.memory.state[c] = v
