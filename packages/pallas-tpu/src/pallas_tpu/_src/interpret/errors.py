"""Errors found while an interpreted TPU kernel runs.

Checks made while tracing (bounds, semaphore waits, DMAs landed) are recorded
in a hidden error code carried through the program with the values they name;
when the kernel finishes, a host callback raises the first one as a
``KernelError``. ``RuntimeChecks`` is a mixin of ``Interpreter``
(``interpreter.py``): it keeps its codes in the interpreter's ``hidden`` state."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret.refs import RefView


class KernelError(Exception):
    """Raised when an interpreted TPU kernel does something a TPU would not do
    (out-of-bounds access, a wait that never completes, a race). Raised in a host
    callback as the kernel runs: recorded, so that the pallas_call raises it as it
    was, message first, rather than inside XLA's "CpuCallback error" wrapper."""

    def __init__(self, *args):
        super().__init__(*args)
        plb.record_runtime_error(self)


class RuntimeChecks:
    """The run-time checks of ``Interpreter`` (see the module docstring)."""

    def init_checks(self) -> None:
        self.hidden.err = jnp.zeros((), jnp.int32)
        self.hidden.errvals = jnp.zeros((8,), jnp.int32)
        self.hidden.tok = jnp.zeros((), jnp.int32)

    def check(self, ok, message: str, values: Sequence[Any] = ()) -> None:
        """Records ``message`` (with up to 8 int values, shown where the message
        has ``{0}``...) as the kernel's error if ``ok`` is false."""
        if self._unchecked or (isinstance(ok, (bool, np.bool_)) and ok):
            return
        self.checks.append(message)
        code = len(self.checks)
        err = self.hidden.err
        # lax, not jnp (no jitted helpers): a large kernel makes hundreds of checks, and
        # every op here is traced, lowered and compiled with it.
        first = lax.bitwise_and(lax.eq(err, np.int32(0)), lax.bitwise_not(jnp.asarray(ok, jnp.bool_)))
        self.hidden.err = lax.select(first, np.int32(code), err)
        if values:  # no values: errvals still holds zeros wherever this is the first error
            vals = [jnp.asarray(v, jnp.int32).reshape(()) for v in values][:8]
            row = jnp.concatenate([jnp.stack(vals), np.zeros(8 - len(vals), np.int32)])
            errvals = self.hidden.errvals
            self.hidden.errvals = lax.select(lax.broadcast(first, errvals.shape), row, errvals)

    def _bounds_checked(self, index, extent: int, size: int) -> bool:
        """True if ``[index, index + extent)`` was checked against ``size`` before, in
        the jaxpr being traced now: that check runs whenever this one would, and an
        error it records comes first, so a second one adds only ops. (DMAs, semaphores
        and their companion cells index the same Refs with the same traced index many
        times; a check made in a ``lax.cond`` branch or loop body, another trace, does
        not count outside it.) Records this one otherwise."""
        if self._unchecked:
            return False
        trace = compat.current_trace()
        key = (id(trace), id(index), extent, size)
        if key in self._bounds_seen:
            return True
        self._bounds_seen[key] = (trace, index)  # keeps both alive, so their ids stay theirs
        return False

    @contextlib.contextmanager
    def unchecked(self):
        """Records no errors inside: for views a TPU never touches (the
        descriptor of a DMA wait only gives a byte count)."""
        self._unchecked += 1
        try:
            yield
        finally:
            self._unchecked -= 1

    def check_dmas_landed(self, cell: int, when: str) -> None:
        """on_wait DMAs: an error if data started into ``cell`` has not landed
        though no semaphore is owed it any more (a wait consumed its bytes but
        the interpreter could not tell where that DMA went)."""
        if cell not in self.shadows or len(self.shadows[cell]) != 2:
            return
        pending = self.state[self.shadows[cell][1]]
        self.check(
            jnp.logical_not(jnp.any(pending != 0)),
            f"{self.kernel_desc}: a DMA into {self.describe_ref(RefView(cell))} was waited for but never "
            f"landed {when}: its wait named another buffer than the one the DMA went to, and the TPU "
            "interpreter had not seen that buffer used by a DMA on the semaphore before the wait; "
            "run with dma_execution_mode='eager', or wait with the descriptor the DMA was started with",
        )

    def ordered_callback(self, fn, *args) -> None:
        """Calls ``fn(*args)`` on the host, in program order: each call takes
        and returns a token kept in ``self.hidden``, so XLA keeps the order."""
        from jax.experimental import io_callback

        if self.hidden.tok is None:
            raise RuntimeError("ordered_callback needs init_checks() first")

        def call(tok, *a):
            fn(*a)
            return tok

        self.hidden.tok = io_callback(call, jax.ShapeDtypeStruct((), jnp.int32), self.hidden.tok, *args)

    def raise_checks(self) -> None:
        """Emits the callback that raises the first recorded error, if any."""
        if not self.checks:
            return
        messages = list(self.checks)

        def report(err, vals):
            errs = np.asarray(err).reshape(-1)
            err = int(errs.max())
            if err:  # under vmap: the values recorded with the reported error
                vals = np.asarray(vals).reshape(-1, 8)[int(errs.argmax())]
                raise KernelError(messages[err - 1].format(*[int(v) for v in vals]))

        jax.debug.callback(report, self.hidden.err, self.hidden.errvals)
