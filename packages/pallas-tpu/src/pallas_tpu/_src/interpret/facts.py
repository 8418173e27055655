"""Which inputs of a kernel jaxpr a DMA may write (``dma_destinations``), asked
before TPU interpret mode runs it. The other facts (primitives used, remote DMAs
and signals, cores) come once from the call record (``pallas.backend``'s
``KernelFacts``). A walk of the jaxpr only: this module imports no interpreter,
so every module of ``interpret/`` can ask."""

from __future__ import annotations

import jax

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
