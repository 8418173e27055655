"""Buffers that the cores of one device share, and core-independent names for
what each core allocates: the ``pl.run_scoped`` scopes of a kernel that runs on
several TensorCores (``pl.core_map`` / ``pl.kernel`` over a ``pltpu.TensorCoreMesh``
of two cores, ``InterpretParams(num_cores_or_threads=2)``).

A TPU's cores share its HBM: a ``pl.run_scoped(pltpu.HBM(...))`` (allowed in
interpret mode by ``allow_hbm_allocation_in_run_scoped``) is one buffer that every
core of the device reads and writes. As in JAX's TPU interpret mode, the k-th scope
a core enters in a grid step and the k-th scope another core enters are the same
scope: their HBM (and ``pl.ANY``) buffers are one cell, made by the first core to
enter and freed when the last core leaves it (or when the step ends, for a core that
never entered it). VMEM, SMEM and semaphores stay each core's own (JAX's interpret
mode keeps ``VMEM_SHARED`` per core too); their k-th scope gives them the same name
on every core, so that ``pl.semaphore_signal(sem, core_index=c)`` reaches core
``c``'s copy of the semaphore the signalling core names.

Shared cells exist only while the cores of a device run in lockstep
(``pallas_call._core_groups``): all of them within one grid step, taking turns at
semaphore waits, so the cell lives and dies inside that step. A scope entered
inside traced control flow (a loop, a cond of a traced predicate) is evaluated as
one operation of its core and keeps private cells.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pallas import backend as plb
from pallas_tpu._src.language import core as tpu_core

# The memory spaces of a run_scoped buffer that the cores of a device share (HBM; pl.ANY
# means HBM for a scoped buffer).
SHARED_SPACES = (tpu_core.HBM, plb.ANY)


def is_shared_space(space) -> bool:
    return any(space is s for s in SHARED_SPACES)


@dataclasses.dataclass(eq=False)
class _SharedCell:
    cell: int
    holders: int  # cores that entered the scope and have not left it yet
    entered: set[int] = dataclasses.field(default_factory=set)


class SharedScopes:
    """The scopes the cores of a device have entered in the current grid step."""

    def __init__(self):
        self.lanes = 1  # cores running in lockstep this step (1: nothing is shared)
        self._ordinal: dict[int, int] = {}  # core -> scopes it entered this step
        self._cells: dict[tuple[int, int], _SharedCell] = {}  # (scope ordinal, buffer) -> shared cell
        self.labels: dict[int, tuple[int, int]] = {}  # a scope's cell -> (scope ordinal, buffer)

    def begin_step(self, lanes: int) -> None:
        self.lanes = lanes
        self._ordinal.clear()

    def enter(self, core: int) -> int:
        """The ordinal of the scope ``core`` enters now."""
        k = self._ordinal.get(core, 0)
        self._ordinal[core] = k + 1
        return k

    def shared_cell(self, key: tuple[int, int], core: int, make: Callable[[], int]) -> int:
        """The cell every core's buffer ``key`` is; ``make()`` makes it for the first core."""
        entry = self._cells.get(key)
        if entry is None or core in entry.entered:  # a core entering its own scope again: a new one
            entry = self._cells[key] = _SharedCell(make(), 0)
        entry.holders += 1
        entry.entered.add(core)
        return entry.cell

    def leave(self, key: tuple[int, int]) -> bool:
        """A core leaves its scope's shared buffer ``key``: True when it was the last
        of the cores (then the caller frees the cell)."""
        entry = self._cells[key]
        entry.holders -= 1
        if entry.holders > 0 or len(entry.entered) < self.lanes:
            return False
        del self._cells[key]
        return True

    def end_step(self) -> list[int]:
        """The shared cells left when the step ends (a core skipped the scope)."""
        cells = [e.cell for e in self._cells.values()]
        self._cells.clear()
        self.labels.clear()
        self.lanes = 1
        return cells
