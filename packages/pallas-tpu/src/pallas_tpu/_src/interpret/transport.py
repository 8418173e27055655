"""How an interpreted kernel's DMAs and semaphores reach beyond its device: the
``LocalTransport`` of a kernel that talks to no other device or core and checks no
races (remote DMAs and signals are errors there), and the interface that
``multi.DeviceTransport`` implements for the others (remote DMAs, remote and
shared semaphores, barrier semaphores, race detection, over host callbacks into
a session the devices of the mesh share).

The ``Interpreter`` (``interpreter.py``) builds one and hands it to the parts
that call its hooks below: the DMA engine (``dma.DmaEngine``: DMAs, remote DMAs,
their race records), the semaphores (``semaphores.Semaphores``), and the
interpreter itself for Ref accesses, the pipeline's write-backs and remote signals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LocalTransport:
    """One device, no races: the hooks see nothing, and what needs other devices
    raises. ``where(eqn)`` names an equation in messages."""

    barrier_cell: int | None = None  # no barrier semaphore (DeviceTransport allocates one)

    def __init__(self, where: Callable[[Any], str]):
        self.where = where

    def start(self) -> None:
        """Called once before the grid starts."""

    def finish(self) -> None:
        """Called once after the last grid step."""

    def shares(self, cell: int) -> bool:
        """Whether semaphore ``cell`` lives in the transport (signalled by other
        devices or cores) rather than in the interpreter's memory."""
        return False

    def on_access(self, view, eqn, write: bool) -> None:
        pass

    def on_dma_start(self, eqn, views) -> None:
        pass

    def on_block_write(self, hbm_cell: int, starts, sizes, origin: str, when=True) -> None:
        """The pipeline writes an output block back to HBM (``when``: traced bool)."""

    def on_dma_wait(self, eqn, views) -> None:
        pass

    def remote_dma_start(self, eqn, parts, layout) -> None:
        raise NotImplementedError(f"{self.where(eqn)}: remote DMAs need the multi-device TPU interpreter")

    def remote_dma_wait(self, eqn, parts, layout, which) -> None:
        """``.wait_send()`` of a remote DMA."""
        raise NotImplementedError(f"{self.where(eqn)}: remote DMAs need the multi-device TPU interpreter")

    def dma_receive(self, eqn, sem, dst, nbytes, remote: bool) -> None:
        """Before a DMA wait on ``sem`` takes ``nbytes``: remote DMAs sent to
        this device land and add their bytes to ``sem`` (multi-device interpreter)."""
        if remote:
            raise NotImplementedError(f"{self.where(eqn)}: remote DMAs need the multi-device TPU interpreter")

    def remote_signal(self, eqn, view, inc, device_id, core_index) -> None:
        raise NotImplementedError(
            f"{self.where(eqn)}: remote semaphore signals need the multi-device interpreter"
        )

    def sem_add(self, view, amount, eqn) -> None:
        raise AssertionError("a LocalTransport shares no semaphore")

    def sem_wait(self, view, amount, eqn, decrement=True, what="semaphore") -> None:
        raise AssertionError("a LocalTransport shares no semaphore")

    def sem_read(self, view, eqn):
        raise AssertionError("a LocalTransport shares no semaphore")
