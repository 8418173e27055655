"""The memory of an interpreted TPU kernel: its cells (HBM operands, VMEM/SMEM
buffers, scratch, semaphore counters), each with a name and a memory space, the
companion cells where ``dma_execution_mode="on_wait"`` DMAs land before their
wait (``dma.py``), and the policy for uninitialized memory (NaN or zero).

``Memory`` is a part of the ``Interpreter`` (``interpreter.py``); the values of
the cells are traced, and ``state`` is what loops, conds and grid steps carry."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src.interpret import facts
from pallas_tpu._src.language import core as tpu_core


def on_chip(space) -> bool:
    """VMEM (the default of kernel scratch), SMEM: buffers small enough to
    shadow, where on_wait DMAs land at their wait (see dma.py)."""
    return space is None or space in (tpu_core.VMEM, tpu_core.SMEM, tpu_core.VMEM_SHARED)


class Memory:
    """The cells of one kernel call (see the module docstring). ``dma_shadows``:
    on_wait DMAs land in companion cells (``shadows``) before their wait;
    ``uninitialized``: the ``uninitialized_memory`` policy of ``fresh``."""

    def __init__(self, *, dma_shadows: bool, uninitialized: str):
        self.dma_shadows = dma_shadows
        self.uninitialized = uninitialized
        self.state: dict[int, jax.Array] = {}
        self.cell_names: dict[int, str] = {}
        self.cell_spaces: dict[int, Any] = {}
        # dma_execution_mode="on_wait": data cell -> (shadow cell, pending cell), and
        # semaphore cell -> () for the semaphores whose waits land DMAs; see dma.py.
        self.shadows: dict[int, tuple[int, ...]] = {}
        self.sem_code_bases: dict[int, Any] = {}  # semaphore cell -> its traced code base (dma.py)
        self.dma_memo: dict = {}  # facts.dma_destinations of the jaxprs seen
        self.next_cell = 0
        self.keys: list[int] = []  # the cells of the last snapshot, in order

    def fresh(self, shape, dtype):
        """A buffer the kernel has not written yet, by the uninitialized-memory policy."""
        return plb.uninitialized_value(shape, dtype, self.uninitialized)

    def describe(self, cell: int) -> str:
        return self.cell_names.get(cell, f"ref#{cell}")

    def new_cell(self, value, name: str, space=None, dma_target: bool = True) -> int:
        """A new cell holding ``value``. ``dma_target=False``: no DMA writes it
        (``facts.dma_destinations``), so it needs no on_wait shadow."""
        c = self.new_cell_plain(value, name, space)
        if self.dma_shadows and dma_target and on_chip(space):
            # on_wait DMAs land here first (what landed, and which semaphore's wait commits it).
            # Flat, so that the bookkeeping of buffers of one size compiles to the same kernels
            # whatever their shapes (dma.py moves runs of them).
            size = math.prod(jnp.shape(value))
            shadow = self.new_cell_plain(jnp.zeros((size,), value.dtype), f"{name} (DMA in flight)", space)
            pending = self.new_cell_plain(jnp.zeros((size,), jnp.int32), f"{name} (DMA pending)", space)
            self.shadows[c] = (shadow, pending)
        elif self.dma_shadows and isinstance(space, plb.SemaphoreSpace):
            self.shadows[c] = ()  # a semaphore whose waits land on_wait DMAs (no companion cells)
            # The number marks name it by (dma.py), opaque to XLA: the bookkeeping of DMAs on
            # different semaphores then compiles to the same kernels, which XLA compiles once.
            self.sem_code_bases[c] = lax.optimization_barrier(np.int32(c * 65536 + 1))
        return c

    def new_cell_plain(self, value, name: str, space=None) -> int:
        """A new cell holding ``value``, without on_wait companions."""
        c = self.next_cell
        self.next_cell += 1
        self.state[c] = value
        self.cell_names[c] = name
        self.cell_spaces[c] = space
        return c

    def free_cell(self, c: int) -> None:
        del self.state[c]
        self.sem_code_bases.pop(c, None)
        for companion in self.shadows.pop(c, ()):
            del self.state[companion]

    def dma_targets(self, jaxpr) -> frozenset[int]:
        """Positions of ``jaxpr``'s inputs that a DMA may write (all of them when
        on_wait shadows are off: then it does not matter)."""
        if not self.dma_shadows:
            return frozenset(range(len(getattr(jaxpr, "jaxpr", jaxpr).invars)))
        return facts.dma_destinations(jaxpr, self.dma_memo)

    def snapshot(self) -> list:
        """The cells' values in order of their ids (a loop carry); ``restore`` takes them back."""
        self.keys = sorted(self.state)
        return [self.state[k] for k in self.keys]

    def restore(self, vals) -> None:
        self.state = dict(zip(self.keys, vals))
