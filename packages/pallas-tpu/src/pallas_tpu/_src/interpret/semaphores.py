"""Semaphores of an interpreted TPU kernel: the counters in the core's own memory
(``LocalSemaphores``: cells of the ``Memory``, read and written through
``RefAccess``; a wait that they cannot satisfy is a deadlock error), and
``Semaphores``, which sends each semaphore to where it lives: the transport's
(``transport.py``: shared with other devices or cores, ``multi.py``) or the
core's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from pallas_tpu._src.interpret.errors import Checks
from pallas_tpu._src.interpret.refs import RefAccess, RefView

_SEM_BARRIER_EVERY = 16


class LocalSemaphores:
    """The semaphores of this core's memory, through ``refs``; a wait that cannot
    be satisfied records a deadlock in ``checks``; ``where(eqn)`` names an equation."""

    def __init__(self, refs: RefAccess, checks: Checks, where: Callable[[Any], str]):
        self.refs = refs
        self.checks = checks
        self.where = where
        self.updates = 0  # semaphore updates traced (_store)

    def add(self, view: RefView, amount, eqn) -> None:
        cur = self.refs.read_view(view, eqn)
        self._store(view, lax.add(cur, jnp.asarray(amount, cur.dtype)), eqn)

    def wait(self, view: RefView, amount, eqn, decrement=True, what="semaphore") -> None:
        """A deadlock error if the semaphore holds less than ``amount``."""
        cur = self.refs.read_view(view, eqn)
        amount = jnp.asarray(amount, cur.dtype)
        self.checks.check(
            lax.ge(cur, amount),
            f"{self.where(eqn)}: waiting on {what} {self.refs.describe_ref(view)} for {{1}} but it holds {{0}} "
            "and nothing else can signal it: on a TPU this wait never returns (deadlock)",
            [cur, amount],
        )
        if decrement:
            self._store(view, lax.sub(cur, amount), eqn)

    def _store(self, view: RefView, new, eqn) -> None:
        self.updates += 1
        if self.updates % _SEM_BARRIER_EVERY == 0:
            # A long straight run of DMA starts and waits makes a semaphore's value a chain of
            # adds and subtractions, which XLA's CPU fusion copies into every check that reads
            # it: a cost quadratic in the run's length (tokamax's routing gmm: hundreds of
            # per-row DMAs). A barrier now and then keeps the copies short.
            new = lax.optimization_barrier(new)
        self.refs.write_view(view, new, eqn)


class Semaphores:
    """Signals and waits of any semaphore: the ``transport``'s when it shares the
    semaphore's cell, else the core's own (``local``)."""

    def __init__(self, local: LocalSemaphores, transport):
        self.local = local
        self.transport = transport

    def add(self, view: RefView, amount, eqn) -> None:
        if self.transport.shares(view.cell):
            self.transport.sem_add(view, amount, eqn)
        else:
            self.local.add(view, amount, eqn)

    def wait(self, view: RefView, amount, eqn, decrement=True, what="semaphore") -> None:
        if self.transport.shares(view.cell):
            self.transport.sem_wait(view, amount, eqn, decrement=decrement, what=what)
        else:
            self.local.wait(view, amount, eqn, decrement=decrement, what=what)
