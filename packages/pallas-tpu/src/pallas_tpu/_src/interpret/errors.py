"""Errors found while an interpreted TPU kernel runs.

Checks made while tracing (bounds, semaphore waits, DMAs landed) are recorded
in a hidden error record carried through the program: the code of the first
failed check and the values it names; when the kernel finishes, a host callback
raises that one as a ``KernelError``. ``RuntimeChecks`` is a mixin of
``Interpreter`` (``interpreter.py``): it keeps the record in the interpreter's
``hidden`` state.

A large kernel makes hundreds of checks, and every op they add is traced, lowered
and compiled (XLA's CPU compiler spends milliseconds on each fusion). So checks
are gathered while a straight run of the kernel is traced and folded into the
record in one go (``flush_checks``) where the record is needed: before control
flow or a grid step carries the hidden state, and at the end. The fold is a chain
of selects over the record's 9 words, which XLA fuses into one loop; a fold of many
checks picks the words by the number of the first failed check (``_fold_picked``)."""

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


_RECORD = 9  # the error record: the failed check's code (0: none failed), then 8 values

# Folds of more checks than this pick the record's words by the number of the first failed
# check (``_fold_picked``): a chain of selects over the 9-word rows, which XLA's CPU compiler
# turns into a loop computing every condition and row in each word, takes it a time that grows
# faster than the number of checks (a third of a second of LLVM for the 40 checks at the end of
# a large kernel), where two kernels of a chain each are cheap. Smaller folds stay one kernel.
_CHAIN_MAX = 8


def _fold_picked(rec, pending):
    """``flush_checks`` of many checks: the number of the first failed check (0: none,
    or an earlier fold's check did), one chain of scalar selects, each condition computed
    once, behind an optimization barrier so that XLA keeps it one scalar kernel; then each
    word of the record picked by that number. While no check failed the record is all
    zeros, so a word that no check here gives a value stays as it is."""
    first = np.int32(0)
    for i in range(len(pending), 0, -1):
        bad = pending[i - 1][0]
        first = np.int32(i) if bad is True else lax.select(bad, np.int32(i), first)
    words = [lax.reshape(lax.slice(rec, (j,), (j + 1,)), ()) for j in range(_RECORD)]
    first = lax.select(lax.eq(words[0], np.int32(0)), first, np.int32(0))
    # The codes go through the barrier too: data to XLA, so folds of different checks share kernels.
    first, codes = lax.optimization_barrier((first, np.array([code for _, code, _ in pending], np.int32)))
    picks = [lax.eq(first, np.int32(i)) for i in range(1, len(pending) + 1)]
    for i, pick in enumerate(picks):
        words[0] = lax.select(pick, lax.reshape(lax.slice(codes, (i,), (i + 1,)), ()), words[0])
    for pick, (_, _, vals) in zip(picks, pending):
        for j, v in enumerate(vals, 1):
            words[j] = lax.select(pick, v, words[j])
    return lax.concatenate([lax.reshape(w, (1,)) for w in words], 0)


# Folds of more checks than this look the first failed check up in a table (``_fold_table``):
# ``_fold_picked``'s chains of selects, one link per check, are fused by XLA's CPU compiler
# into one kernel per chain at a cost that grows with the square of their length (the 645
# checks of a straight run of per-row DMAs, tokamax's routing gmm: seconds, and gigabytes).
_PICK_MAX = 64


def _fold_table(rec, pending):
    """``flush_checks`` of very many checks: the failed flags as one vector, the first
    failed one found by ``argmax``, its code and values read from a table by that
    position. No op chain grows with the number of checks."""
    flags = lax.concatenate(
        [
            np.ones((1,), np.int32)
            if bad is True
            else lax.reshape(lax.convert_element_type(bad, np.int32), (1,))
            for bad, _, _ in pending
        ],
        0,
    )
    zero = np.zeros((1,), np.int32)
    table = lax.concatenate(
        [
            lax.concatenate([*(lax.reshape(v, (1,)) for v in vals), *[zero] * (_RECORD - 1 - len(vals))], 0)
            for _, _, vals in pending
        ],
        0,
    )
    # Behind a barrier, so that XLA does not fuse the concatenations into their readers (a
    # select over every check per element read), and the codes are data to XLA, as in
    # ``_fold_picked``: folds of different checks share kernels.
    flags, table, codes = lax.optimization_barrier(
        (flags, table, np.array([code for _, code, _ in pending], np.int32))
    )
    first = lax.argmax(flags, 0, np.int32)
    failed = lax.gt(lax.reduce_max(flags, (0,)), np.int32(0))
    values = lax.dynamic_slice(table, (lax.mul(first, np.int32(_RECORD - 1)),), (_RECORD - 1,))
    row = lax.concatenate([lax.dynamic_slice(codes, (first,), (1,)), values], 0)
    clean = lax.eq(lax.reshape(lax.slice(rec, (0,), (1,)), ()), np.int32(0))
    take = lax.bitwise_and(clean, failed)
    return lax.select(lax.broadcast(take, (_RECORD,)), row, rec)


# Counts up to this are exact in float32 (``count_true``).
_F32_EXACT = 1 << 24


def count_true(mask):
    """The number of true elements of ``mask`` (int32). As a dot with ones where float32
    counts it exactly: XLA's CPU backend calls a library for a dot, where it rewrites a
    large reduction into a tree of reduce-window kernels (four kernels to compile, per
    size, for every DMA wait's count of landed elements)."""
    flat = lax.reshape(mask, (mask.size,))
    if mask.size > _F32_EXACT:
        return lax.reduce(lax.convert_element_type(flat, np.int32), np.int32(0), lax.add, (0,))
    ones = lax.full((mask.size,), 1.0, np.float32)
    return lax.convert_element_type(lax.dot(lax.convert_element_type(flat, np.float32), ones), np.int32)


class RuntimeChecks:
    """The run-time checks of ``Interpreter`` (see the module docstring)."""

    def init_checks(self) -> None:
        self.hidden.err = jnp.zeros((_RECORD,), jnp.int32)
        self.hidden.tok = jnp.zeros((), jnp.int32)
        self._pending_checks = []

    def check(self, ok, message: str, values: Sequence[Any] = ()) -> None:
        """Records ``message`` (with up to 8 int values, shown where the message
        has ``{0}``...) as the kernel's error if ``ok`` is false and no check
        before it failed. Gathered until ``flush_checks``."""
        if self._unchecked or (isinstance(ok, (bool, np.bool_)) and ok):
            return
        self.checks.append(message)
        code = len(self.checks)
        bad = lax.bitwise_not(jnp.asarray(ok, jnp.bool_)) if not isinstance(ok, (bool, np.bool_)) else True
        vals = [lax.reshape(jnp.asarray(v, jnp.int32), ()) for v in values][:8]
        self._pending_checks.append((bad, code, vals))

    def flush_checks(self) -> None:
        """Folds the checks gathered since the last flush into ``hidden.err``:
        the record becomes the first failed one's ``[code, values...]`` unless an
        earlier check failed. Called wherever the hidden state is taken (a loop or
        cond carry, a grid step, the end); the checks must be of the trace being
        traced now."""
        pending, self._pending_checks = self._pending_checks, []
        if not pending:
            return
        if len(pending) > _PICK_MAX:
            self.hidden.err = _fold_table(self.hidden.err, pending)
            return
        if len(pending) > _CHAIN_MAX:
            self.hidden.err = _fold_picked(self.hidden.err, pending)
            return
        rec = self.hidden.err
        picked = rec
        # Last to first: each select keeps the row of an earlier failing check over later ones.
        # The code goes through an optimization barrier: XLA sees data, not a constant, so the
        # folds of different checks compile to the same kernel, which XLA compiles once
        # (distinct kernels, not ops, are most of its compile time).
        for bad, code, vals in reversed(pending):
            row = lax.concatenate(
                [
                    lax.optimization_barrier(np.array([code], np.int32)),
                    *(lax.reshape(v, (1,)) for v in vals),
                    np.zeros(_RECORD - 1 - len(vals), np.int32),
                ],
                0,
            )
            if bad is True:
                picked = row
            else:
                picked = lax.select(lax.broadcast(bad, (_RECORD,)), row, picked)
        clean = lax.eq(lax.slice(rec, (0,), (1,)), np.zeros((1,), np.int32))
        self.hidden.err = lax.select(lax.broadcast_in_dim(clean, (_RECORD,), (0,)), picked, rec)

    def drop_checks(self) -> None:
        """Forgets the checks gathered since the last flush: for a trace whose result
        carries no hidden state (a ``while`` loop's condition)."""
        self._pending_checks = []

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
            lax.eq(count_true(lax.ne(pending, np.int32(0))), np.int32(0)),
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
        self.flush_checks()
        if not self.checks:
            return
        messages = list(self.checks)

        def report(rec):
            recs = np.asarray(rec).reshape(-1, _RECORD)
            k = int(recs[:, 0].argmax())  # under vmap: the batch element with the highest code
            err = int(recs[k, 0])
            if err:
                raise KernelError(messages[err - 1].format(*[int(v) for v in recs[k, 1:]]))

        jax.debug.callback(report, self.hidden.err)
