"""``run_mosaic``'s rules for the ``scf`` dialect: structured control flow,
running the op's prepared regions (see ``framework``)."""

from __future__ import annotations

import numpy as np

from pallas_tpu._src.executor.attrs import array_attr
from pallas_tpu._src.executor.framework import rule


@rule("scf.if", regions=True)
def _if(ex, op, vals, env, regions):
    return ex.run(regions[0] if bool(vals[0]) else regions[1], [], env)


@rule("scf.for", regions=True)
def _for(ex, op, vals, env, regions):
    lb, ub, step, *carry = vals
    i = lb
    while i < ub:
        carry = ex.run(regions[0], [i, *carry], env)
        i = type(np.asarray(lb)[()])(i + step)
    return carry


@rule("scf.while", regions=True)
def _while(ex, op, vals, env, regions):
    carry = vals
    while True:
        cond, *args = ex.run(regions[0], carry, env)
        if not bool(cond):
            return args
        carry = ex.run(regions[1], args, env)


@rule("scf.index_switch", regions=True)
def _switch(ex, op, vals, env, regions):
    cases = array_attr(op, "cases")
    k = int(vals[0])
    return ex.run(regions[1 + cases.index(k)] if k in cases else regions[0], [], env)
