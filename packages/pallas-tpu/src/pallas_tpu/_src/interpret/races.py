"""Race detection in TPU interpret mode (``InterpretParams(detect_races=True)``):
a happens-before detector with vector clocks, one per kernel call (``sessions.py``
keeps it in the call's session and calls it under the session's lock).

Each (device, core) running the kernel and each DMA is a thread; a semaphore
signal releases the signaller's clock into the semaphore and a wait acquires
it; a DMA starts with its issuer's clock and the thread that waits for it
acquires the DMA's clock. Every kernel access of a Ref and every DMA's source
read and destination write is recorded with the flat element indices it
touches; two accesses of overlapping elements of one buffer, at least one a
write, by threads with no happens-before between them are a race. What can no
longer race is forgotten as the kernel runs (``HappensBefore.collect``), so the
cost per grid step stays flat on long grids.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np


def text(desc) -> str:
    """A description given as a string, or as a function giving one."""
    return desc() if callable(desc) else desc


@dataclasses.dataclass
class Access:
    thread: Any
    epoch: int
    write: bool
    idx: np.ndarray  # sorted unique flat element indices
    # "write of out_specs[0] (HBM)[0:8, 0:128] by the kernel at k.py:3 (device 1)", or a
    # function giving it: most accesses never race, and naming a region costs more than checking it.
    what: Any

    @property
    def lo(self) -> int:
        return int(self.idx[0]) if self.idx.size else 0

    @property
    def dense(self) -> bool:
        """Whether the indices are one contiguous range."""
        return self.idx.size == 0 or int(self.idx[-1]) - int(self.idx[0]) + 1 == self.idx.size

    def overlaps(self, other: Access) -> bool:
        a, b = self.idx, other.idx
        if a.size == 0 or b.size == 0 or a[-1] < b[0] or b[-1] < a[0]:
            return False
        if self.dense and other.dense:
            return True  # two ranges whose bounds interleave
        return bool(np.isin(a, b, assume_unique=True).any())

    def same_elements(self, other: Access) -> bool:
        if self.idx.size != other.idx.size:
            return False
        if self.idx.size == 0:
            return True
        if self.dense and other.dense:
            return self.lo == other.lo
        return bool(np.array_equal(self.idx, other.idx))


def sorted_unique(idx) -> np.ndarray:
    idx = np.asarray(idx, np.int64).reshape(-1)
    if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        idx = np.unique(idx)
    return idx


def join(a: dict, b: dict) -> dict:
    """The vector clock that has seen what ``a`` and ``b`` have."""
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


def region(idx: np.ndarray, shape) -> str:
    """The box of a cell of ``shape`` that the flat indices ``idx`` touch, as
    ``[0:8, 0:128]`` (with their count when they do not fill it)."""
    if not shape:
        return ""
    if idx.size == 0:
        return "[empty]"
    coords: tuple[np.ndarray, ...] = np.unravel_index(idx, shape)
    parts = [f"{int(c.min())}:{int(c.max()) + 1}" for c in coords]
    box = math.prod(int(c.max()) - int(c.min()) + 1 for c in coords)
    return "[" + ", ".join(parts) + "]" + ("" if box == idx.size else f" ({idx.size} elements)")


class HappensBefore:
    """The vector clocks and the recorded accesses of one kernel call. A thread is
    ``("core", device, core)`` or ``("dma", n)``; a buffer ``(device, cell)``."""

    def __init__(self, num_devices: int, num_cores: int):
        self.num_devices, self.num_cores = num_devices, num_cores
        self.clocks: dict[Any, dict] = {}
        self.sem_clocks: dict[Any, dict] = {}  # semaphore -> the clocks released into it
        self.accesses: dict[Any, list[Access]] = collections.defaultdict(list)
        self.n_records, self.collect_at = 0, 64

    def clock(self, thread) -> dict:
        c = self.clocks.get(thread)
        if c is None:
            c = self.clocks[thread] = {thread: 1}
        return c

    def tick(self, thread) -> None:
        c = self.clock(thread)
        c[thread] += 1

    def start_dma(self, thread, dma) -> None:
        """``thread`` starts the DMA thread ``dma``: it begins with the issuer's clock."""
        self.clocks[dma] = join(self.clock(thread), {dma: 1})
        self.tick(thread)

    def acquire(self, thread, other) -> None:
        """``thread`` has seen what thread ``other`` did (it waited for a DMA)."""
        self.clocks[thread] = join(self.clock(thread), self.clocks[other])

    def release_sem(self, thread, sem) -> None:
        """``thread`` signals the semaphore ``sem``."""
        self.sem_clocks[sem] = join(self.sem_clocks.get(sem, {}), self.clock(thread))
        self.tick(thread)

    def acquire_sem(self, thread, sem) -> None:
        """``thread`` waited on the semaphore ``sem``."""
        if sem in self.sem_clocks:
            self.clocks[thread] = join(self.clock(thread), self.sem_clocks[sem])

    def record(
        self, buf, thread, write: bool, idx: np.ndarray, what, waiting: Callable[[], set]
    ) -> str | None:
        """Records an access (``what`` names it: a string, or a function giving
        one); returns ``"<this access> and <the earlier one>"`` if it races with
        an earlier access. ``waiting()``: the DMAs not waited for yet (``collect``)."""
        clock = self.clock(thread)
        new = Access(thread, clock[thread], write, sorted_unique(idx), what)
        accesses = self.accesses[buf]
        replaces = None
        for j, acc in enumerate(accesses):
            if acc.thread == thread:
                # A later access of the same elements by the same thread races with whatever
                # the earlier one would: keep only the later one.
                if replaces is None and acc.write == write and acc.same_elements(new):
                    replaces = j
                continue
            if not (write or acc.write) or acc.epoch <= clock.get(acc.thread, 0):
                continue
            if new.overlaps(acc):
                return f"{text(what)} and {text(acc.what)}"
        if replaces is None:
            accesses.append(new)
        else:
            accesses[replaces] = new
        self.n_records += 1
        if self.n_records >= self.collect_at:
            self.collect(waiting)
        return None

    def collect(self, waiting: Callable[[], set]) -> None:
        """Forgets what can no longer race. Only cores make new accesses (a DMA
        makes its own when it starts, with its issuer's clock), so an access
        that every core's clock has passed is ordered before every access to
        come; and a DMA with no access left needs no entry in any clock.
        Without this a long grid makes every access check against all earlier
        ones and every clock grow by one entry per DMA (a 10^5-step grid with
        a DMA a step ran 16 ms a step). ``waiting()``: the DMAs not waited for
        yet, whose clocks are still to be acquired."""
        cores = [("core", d, c) for d in range(self.num_devices) for c in range(self.num_cores)]
        clocks = [(t, self.clocks.get(t, {t: 1})) for t in cores]
        live: set = set()
        kept = 0
        for accesses in self.accesses.values():
            accesses[:] = [
                a
                for a in accesses
                if not all(t == a.thread or c.get(a.thread, 0) >= a.epoch for t, c in clocks)
            ]
            live.update(a.thread for a in accesses)
            kept += len(accesses)
        dead = {t for t in self.clocks if t[0] == "dma" and t not in live}
        if dead:
            for t in dead - waiting():
                del self.clocks[t]
            for c in [*self.clocks.values(), *self.sem_clocks.values()]:
                for t in dead.intersection(c):
                    del c[t]
        self.collect_at = self.n_records + max(64, 2 * kept)
