"""Whether the programs of a batched pass (``_batched``) touched each other's
memory: a pass is kept only when running its programs together gives what
running them in order gives, so memory one program stores must not be
accessed by another program of the pass."""

from __future__ import annotations

import numpy as np


def _units(accesses: list[tuple]) -> list[tuple[np.ndarray, np.ndarray | None, bool]]:
    """The accesses as (units, program, is_store): a unit is the smallest
    element size of the pass; a wider element covers several units."""
    unit = min(e for _, _, e, _ in accesses)
    out = []
    for ptrs, program, elem_bytes, store in accesses:
        first = ptrs // np.uint64(unit)
        n = elem_bytes // unit
        if n > 1:
            first = (first[:, None] + np.arange(n, dtype=np.uint64)[None, :]).reshape(-1)
            program = None if program is None else np.repeat(program, n)
        out.append((first, program, store))
    return out


def conflicts(accesses: list[tuple]) -> bool:
    """Whether memory one program stored is accessed by another program of
    the pass (or stored for all programs and read). ``accesses``: (pointers,
    program of each or None: every program, element bytes, is_store)."""
    if not any(store for *_, store in accesses):
        return False
    if _apart(accesses):
        return False
    units = _units(accesses)
    stored = np.sort(np.concatenate([w for w, _, s in units if s]))
    words, programs = [], []
    for w, prog, _ in units:
        hit = _member(w, stored)
        if hit.any():
            words.append(w[hit])
            programs.append(np.full(int(hit.sum()), -1, np.int32) if prog is None else prog[hit])
    w = np.concatenate(words)
    prog = np.concatenate(programs)
    order = np.lexsort((prog, w))
    w, prog = w[order], prog[order]
    if ((w[1:] == w[:-1]) & (prog[1:] != prog[:-1])).any():
        return True
    # A unit stored by an operation every program runs (-1) and read: each
    # program, in order, would have read the previous one's store.
    stored_by_all = [w for w, prog, s in units if s and prog is None]
    reads = [w for w, _, s in units if not s]
    if stored_by_all and reads:
        return bool(_member(np.concatenate(stored_by_all), np.sort(np.concatenate(reads))).any())
    return False


def _apart(accesses: list[tuple]) -> bool:
    """A quick sufficient test: every program's accesses, one address range
    per operation and program, overlap no range of another program (as in
    elementwise kernels). Operations every program runs (unbatched) make it
    answer False: ``conflicts`` then compares addresses one by one."""
    los, his, programs = [], [], []
    for ptrs, program, elem_bytes, _ in accesses:
        if program is None:
            return False
        # ``program`` is non-decreasing (the pointers are in program-major order).
        starts = np.flatnonzero(np.concatenate([[True], program[1:] != program[:-1]]))
        los.append(np.minimum.reduceat(ptrs, starts))
        his.append(np.maximum.reduceat(ptrs, starts) + np.uint64(elem_bytes))
        programs.append(program[starts])
    lo, hi, prog = np.concatenate(los), np.concatenate(his), np.concatenate(programs)
    order = np.argsort(lo, kind="stable")
    lo, hi, prog = lo[order], hi[order], prog[order]
    # Clusters of overlapping ranges: a range starting at or after the end of
    # every earlier one starts a new cluster. Apart: one program per cluster.
    reach = np.maximum.accumulate(hi)
    new = np.concatenate([[True], lo[1:] >= reach[:-1]])
    starts = np.flatnonzero(new)
    return bool((np.minimum.reduceat(prog, starts) == np.maximum.reduceat(prog, starts)).all())


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``np.isin(values, sorted_set)`` for a sorted ``sorted_set`` (a binary
    search: much faster than NumPy's hash-based unique/isin on large arrays)."""
    if sorted_set.size == 0:
        return np.zeros(values.shape, bool)
    at = np.searchsorted(sorted_set, values).clip(max=sorted_set.size - 1)
    return sorted_set[at] == values
