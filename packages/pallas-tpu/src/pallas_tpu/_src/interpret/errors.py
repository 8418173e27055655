"""Errors found while an interpreted TPU kernel runs.

Checks made while tracing (bounds, semaphore waits, DMAs landed) are recorded
in a hidden error record carried through the program: the code of the first
failed check and the values it names; when the kernel finishes, a host callback
raises that one as a ``KernelError``. ``Checks`` is a part of the
``Interpreter`` (``interpreter.py``), which keeps the record in its ``hidden``
state and hands it to ``Checks.fold`` and ``Checks.report``.

A large kernel makes hundreds of checks, and every op they add is traced, lowered
and compiled (XLA's CPU compiler spends milliseconds on each fusion). So checks
are gathered while a straight run of the kernel is traced and folded into the
record in one go (``Checks.fold``) where the record is needed: before control
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


class Checks:
    """The run-time checks of a kernel: the messages of the checks made so far, those
    gathered since the last fold, and what ``unchecked`` and ``bounds_checked`` keep.
    The error record itself is the caller's (the interpreter's hidden state): ``fold``
    takes it and returns it updated, ``report`` raises from it."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.pending: list = []  # checks not yet folded into the record
        self.depth_unchecked = 0
        # (trace, index, extent, size) of the traced bounds checks made so far (see bounds_checked).
        self.bounds_seen: dict[tuple[int, int, int, int], tuple[Any, Any]] = {}

    @staticmethod
    def new_record():
        """A record with no error: int32[9], the code of the first failed check (0 while
        none failed), then the values recorded with it."""
        return jnp.zeros((_RECORD,), jnp.int32)

    def check(self, ok, message: str, values: Sequence[Any] = ()) -> None:
        """Records ``message`` (with up to 8 int values, shown where the message
        has ``{0}``...) as the kernel's error if ``ok`` is false and no check
        before it failed. Gathered until ``fold``."""
        if self.depth_unchecked or (isinstance(ok, (bool, np.bool_)) and ok):
            return
        self.messages.append(message)
        code = len(self.messages)
        bad = lax.bitwise_not(jnp.asarray(ok, jnp.bool_)) if not isinstance(ok, (bool, np.bool_)) else True
        vals = [lax.reshape(jnp.asarray(v, jnp.int32), ()) for v in values][:8]
        self.pending.append((bad, code, vals))

    def fold(self, rec):
        """``rec`` with the checks gathered since the last fold folded in: the record
        becomes the first failed one's ``[code, values...]`` unless an earlier check
        failed. Called wherever the hidden state is taken (a loop or cond carry, a
        grid step, the end); the checks must be of the trace being traced now."""
        pending, self.pending = self.pending, []
        if not pending:
            return rec
        if len(pending) > _PICK_MAX:
            return _fold_table(rec, pending)
        if len(pending) > _CHAIN_MAX:
            return _fold_picked(rec, pending)
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
        return lax.select(lax.broadcast_in_dim(clean, (_RECORD,), (0,)), picked, rec)

    def drop(self) -> None:
        """Forgets the checks gathered since the last fold: for a trace whose result
        carries no hidden state (a ``while`` loop's condition)."""
        self.pending = []

    def bounds_checked(self, index, extent: int, size: int) -> bool:
        """True if ``[index, index + extent)`` was checked against ``size`` before, in
        the jaxpr being traced now: that check runs whenever this one would, and an
        error it records comes first, so a second one adds only ops. (DMAs, semaphores
        and their companion cells index the same Refs with the same traced index many
        times; a check made in a ``lax.cond`` branch or loop body, another trace, does
        not count outside it.) Records this one otherwise."""
        if self.depth_unchecked:
            return False
        trace = compat.current_trace()
        key = (id(trace), id(index), extent, size)
        if key in self.bounds_seen:
            return True
        self.bounds_seen[key] = (trace, index)  # keeps both alive, so their ids stay theirs
        return False

    @contextlib.contextmanager
    def unchecked(self):
        """Records no errors inside: for views a TPU never touches (the
        descriptor of a DMA wait only gives a byte count)."""
        self.depth_unchecked += 1
        try:
            yield
        finally:
            self.depth_unchecked -= 1

    def report(self, rec) -> None:
        """Emits the callback that raises the error ``rec`` records, if any
        (after ``fold``)."""
        if not self.messages:
            return
        messages = list(self.messages)

        def report(rec):
            recs = np.asarray(rec).reshape(-1, _RECORD)
            k = int(recs[:, 0].argmax())  # under vmap: the batch element with the highest code
            err = int(recs[k, 0])
            if err:
                raise KernelError(messages[err - 1].format(*[int(v) for v in recs[k, 1:]]))

        jax.debug.callback(report, rec)
