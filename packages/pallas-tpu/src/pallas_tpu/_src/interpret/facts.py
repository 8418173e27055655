"""Which inputs of a kernel jaxpr a DMA may write (``dma_destinations``) and the
static intervals of its DMAs' traced sizes and indices (``dma_size_bounds``), asked
before TPU interpret mode runs it. The other facts (primitives used, remote DMAs
and signals, cores) come once from the call record (``pallas.backend``'s
``KernelFacts``). A walk of the jaxpr only: this module imports no interpreter,
so every module of ``interpret/`` can ask."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.language import primitives as tpu_prims


def dma_destinations(jaxpr, memo: dict | None = None) -> frozenset[int]:
    """Positions of ``jaxpr``'s inputs that a DMA may write: the destination Ref of
    a ``dma_start``, or a Ref handed on to one through control flow, a call or a
    ``pl.run_scoped`` body. Only such on-chip cells need the shadow and marks of
    ``dma_execution_mode="on_wait"``: every cell more is carried through every
    loop and branch of the interpreted kernel, and compiled. A sub-jaxpr of a kind
    not known here that starts a DMA counts all its operands as destinations."""
    memo = {} if memo is None else memo
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if id(jaxpr) in memo:
        return memo[id(jaxpr)][0]
    dsts: set = set()

    def inner(sub, outer_of):  # outer_of(i): the outer operand of the sub-jaxpr's input i, or None
        for i in dma_destinations(sub, memo):
            v = outer_of(i)
            if v is not None:
                dsts.add(v)

    for eqn in jaxpr.eqns:
        ins, prim = list(eqn.invars), eqn.primitive
        at = lambda k, ins=ins: ins[k] if 0 <= k < len(ins) else None  # noqa: E731
        if prim is tpu_prims.dma_start_p:
            dsts.add(eqn.params["layout"].split(ins)["dst"][0])
        elif prim is compat.cond_p:
            for branch in eqn.params["branches"]:
                inner(branch, lambda i, at=at: at(i + 1))
        elif prim is compat.while_p:
            nc = eqn.params["cond_nconsts"]  # the body's inputs: its consts, then the carry
            inner(eqn.params["body_jaxpr"], lambda i, at=at, nc=nc: at(nc + i))
        elif prim is plb.run_scoped_p:  # inputs past num_consts are the buffers it allocates
            inner(eqn.params["jaxpr"], lambda i, at=at, n=eqn.params["num_consts"]: at(i) if i < n else None)
        elif prim is compat.scan_p or prim in _CALLS:
            for sub in _subjaxprs(eqn):
                inner(sub, at)
        else:
            for sub in _subjaxprs(eqn):
                if dma_destinations(sub, memo):
                    dsts.update(ins)
    out = frozenset(i for i, v in enumerate(jaxpr.invars) if v in dsts)
    memo[id(jaxpr)] = (out, jaxpr)  # keeps the jaxpr alive, so its id stays its own
    return out


def _subjaxprs(eqn):
    return list(jax.extend.core.jaxprs_in_params(eqn.params))


_CALLS = frozenset(p for p, _ in compat.call_primitives())


# -- static bounds of DMA sizes and indices ------------------------------------------------
#
# Kernels that move a variable number of rows write ``pl.ds(row, n)`` with ``n``
# traced but known small: tokamax's routing gmm moves each row of a tile with its own
# DMA of size ``jnp.where(live, 1, 0)``. The interpreter moves a DMA of traced size by
# flat element indices over a window of static size (``RefAccess.view_indices``); with
# an upper bound of ``n`` known while tracing, the window is that bound, not the whole
# dimension, and a bounds check that holds for every value in range is not made.
# Intervals come from a walk of the jaxpr: literals, ``select_n`` of bounded cases
# (``jnp.where``), ``min``, ``max``, ``clamp``, ``rem`` and ``and`` by constants, sums,
# conversions and calls. The interpreter checks at run time that a size keeps to its
# interval's upper end.

_SAME = frozenset({"convert_element_type", "reshape", "broadcast_in_dim", "squeeze", "copy", "copy_p"})
_NONE = (None, None)


def dma_size_bounds(jaxpr) -> dict[int, tuple[Any, dict[str, list]]]:
    """``id(eqn) -> (eqn, {"src": intervals, "dst": intervals})`` for the
    ``dma_start`` equations of ``jaxpr`` (and its sub-jaxprs) with a bounded traced
    operand: one ``(low, high)`` per leaf of that end's Ref transforms, the static
    bounds of the leaf's value (either None where unknown)."""
    out: dict[int, tuple[Any, dict[str, list]]] = {}
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    intervals(jaxpr, [_NONE] * len(jaxpr.invars), out)
    return out


def _literal_interval(v):
    val = np.asarray(v.val)
    if not np.issubdtype(val.dtype, np.integer) or val.size == 0 or val.size > 1024:
        return _NONE
    return int(val.min()), int(val.max())


def _is_int(v) -> bool:
    aval = getattr(v, "aval", None)
    return aval is not None and np.issubdtype(getattr(aval, "dtype", np.float32), np.integer)


def _all(xs):
    return None if any(x is None for x in xs) else list(xs)


def _rule(name, invars, ins):
    """The interval of a primitive's one output from its inputs' (``_NONE`` if unknown)."""
    lo, hi = [b[0] for b in ins], [b[1] for b in ins]
    if name == "select_n":
        los, his = _all(lo[1:]), _all(hi[1:])
        return (min(los) if los else None, max(his) if his else None)
    if name in _SAME:
        return ins[0]
    if name == "add":
        los, his = _all(lo), _all(hi)
        return (sum(los) if los else None, sum(his) if his else None)
    if name in ("min", "max"):
        known_hi, known_lo = [h for h in hi if h is not None], [v for v in lo if v is not None]
        if name == "min":
            los = _all(lo)
            return (min(los) if los else None, min(known_hi) if known_hi else None)
        his = _all(hi)
        return (max(known_lo) if known_lo else None, max(his) if his else None)
    if name == "clamp":  # clamp(low, x, high)
        his = [h for h in hi[1:] if h is not None]
        los = [v for v in lo[:2] if v is not None]
        return (max(los) if los else None, min(his) if his else None)
    if name == "rem" and isinstance(invars[1], compat.Literal) and hi[1]:
        c = abs(hi[1]) - 1
        return (0 if lo[0] is not None and lo[0] >= 0 else -c, c)
    if name == "and":
        masks = [b for v, b in zip(invars, hi) if isinstance(v, compat.Literal) and b is not None and b >= 0]
        return (0, min(masks)) if masks else _NONE
    return _NONE


def intervals(jaxpr, ins, out, depth: int = 0) -> list:
    """The static intervals ``(low, high)`` of ``jaxpr``'s integer outputs (either
    end None: unknown), given its inputs'; records the bounded DMA operands met on the
    way in ``out`` (``dma_size_bounds``)."""
    known: dict[Any, tuple] = {}
    for v, b in zip(jaxpr.invars, ins):
        if b != _NONE:
            known[v] = b

    def get(v):
        if isinstance(v, compat.Literal):
            return _literal_interval(v)
        return known.get(v, _NONE)

    def sub(j, bounds):
        j = getattr(j, "jaxpr", j)
        return intervals(j, list(bounds) + [_NONE] * (len(j.invars) - len(bounds)), out, depth + 1)

    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        prim = eqn.primitive
        res: list = [_NONE] * len(eqn.outvars)
        if prim is tpu_prims.dma_start_p:
            _note_dma(eqn, ins, out)
        elif not prim.multiple_results and not _subjaxprs(eqn):
            res = [_rule(prim.name, eqn.invars, ins)]
        elif depth < 32 and prim is compat.cond_p:
            per = [sub(br, ins[1:]) for br in eqn.params["branches"]]
            res = [_union(bs) for bs in zip(*per)]
        elif depth < 32 and prim in _CALLS:
            for j in _subjaxprs(eqn):
                res = sub(j, ins)
        elif depth < 32 and prim is plb.run_scoped_p:
            sub(eqn.params["jaxpr"], ins[: eqn.params["num_consts"]])
        elif depth < 32 and prim is compat.while_p:
            cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            sub(eqn.params["body_jaxpr"], ins[cn : cn + bn])
            sub(eqn.params["cond_jaxpr"], ins[:cn])
        elif depth < 32:  # scan and others: the consts' intervals are not followed
            for j in _subjaxprs(eqn):
                sub(j, [])
        for v, b in zip(eqn.outvars, res):
            if b != _NONE and _is_int(v) and _fits(b, v.aval.dtype):  # no wrap-around
                known[v] = b
    return [get(v) for v in jaxpr.outvars]


def _fits(b, dtype) -> bool:
    info = np.iinfo(dtype)
    return all(x is None or info.min <= x <= info.max for x in b) and (b[0] is not None or b[1] is not None)


def _union(bs):
    los, his = _all([b[0] for b in bs]), _all([b[1] for b in bs])
    return (min(los) if los else None, max(his) if his else None)


def _note_dma(eqn, ins, out) -> None:
    """Records the intervals of a ``dma_start``'s source and destination transform leaves."""
    if all(b == _NONE for b in ins):
        return
    parts = eqn.params["layout"].split(list(ins))
    ends = {name: list(parts[name][1]) for name in ("src", "dst") if name in parts}
    old = out.get(id(eqn))
    if old is not None:  # a sub-jaxpr met twice: the union of both
        for name, bounds in ends.items():
            prev = old[1].get(name, [_NONE] * len(bounds))
            ends[name] = [_union([a, b]) for a, b in zip(bounds, prev)]
    out[id(eqn)] = (eqn, ends)


def scoped_in_spaces(jaxpr, spaces) -> bool:
    """Whether a ``pl.run_scoped`` of the kernel (in any sub-jaxpr) allocates a buffer
    in one of ``spaces`` (e.g. HBM, which the cores of a device share)."""
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive is plb.run_scoped_p:
                body = eqn.params["jaxpr"]
                for aval in body.in_avals[eqn.params["num_consts"] :]:
                    if any(getattr(aval, "memory_space", None) is s for s in spaces):
                        return True
            stack += [getattr(s, "jaxpr", s) for s in _subjaxprs(eqn)]
    return False
