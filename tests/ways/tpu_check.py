"""The check a TPU engine makes before it runs a kernel: is it a TPU kernel?

A pallas-core kernel run ``every_way()`` may be one no TPU runs as written: blocks that break
the TPU's tiling rules (the last two dimensions multiples of (8, 128) or the array's, rank-1
blocks whole or of whole tiles), an HBM Ref read or written without a DMA, vectors in SMEM,
data in semaphore memory; ``vmap`` of a kernel of rank-1 blocks is often one (its blocks gain a
squeezed leading dimension). pallas-tpu refuses such a kernel in both its engines (its
``checks.check_kernel``); here the same rules (``checks.check_block_shapes`` and
``checks.check_memory_spaces``) are asked of the kernel before it runs, and a TPU way skips such
a test, saying why: ``not a TPU kernel (<way> way): <the rule>``. Anything else a TPU way
refuses is a finding (a failure, or a strict ``xfail`` with its reason).

The Mosaic engines ask it of the kernels of their trace of the function (``refusal``); the
``tpu_interpret`` engine of each kernel as its interpreter is handed it (``refusal_of``).
"""

from __future__ import annotations

import contextlib

import jax
from jax.extend.core import jaxprs_in_params

from pallas import backend as plb


def kernels(jaxpr):
    """The equations of our ``pallas_call``s in ``jaxpr`` (and the jaxprs inside it: jit,
    custom_vjp, shard_map, cond, ...), not into a kernel's body."""
    for eqn in jaxpr.eqns:
        if "grid_mapping" in eqn.params:  # a pallas_call: ours (pallas-core's GridMapping) or JAX's
            if isinstance(eqn.params["grid_mapping"], plb.GridMapping):
                yield eqn
            continue
        for sub in jaxprs_in_params(eqn.params):
            yield from kernels(getattr(sub, "jaxpr", sub))


def refusal_of(grid_mapping, jaxpr, chip=None) -> str | None:
    """What the TPU's rules say of a kernel (its grid mapping and jaxpr) no TPU runs as written
    (None: a TPU kernel); ``chip``: the generation it is written for."""
    from pallas_tpu._src import checks
    from pallas_tpu._src.language import tpu_info

    with tpu_info.modeled_chip(chip) if chip else contextlib.nullcontext():
        try:
            checks.check_block_shapes(grid_mapping)
            checks.check_memory_spaces(grid_mapping, jaxpr)
        except (ValueError, TypeError) as e:
            return str(e).splitlines()[0]
    return None


def refusal(closed, chip=None) -> str | None:
    """``refusal_of`` the first kernel of ``closed`` (a traced function) no TPU runs, or None."""
    for eqn in kernels(closed.jaxpr):
        why = refusal_of(eqn.params["grid_mapping"], eqn.params["jaxpr"], chip)
        if why:
            return why
    return None


def check(engine, way, closed) -> None:
    """Skips the test when a kernel of ``closed`` is not a TPU kernel (``refusal``)."""
    import pytest

    why = refusal(closed, way.chip)
    if why:
        pytest.skip(f"not a TPU kernel ({engine.name} way): {why}")


def trace(f, args):
    """``f(*args)`` traced: its closed jaxpr and the shapes of its outputs (their tree)."""
    return jax.make_jaxpr(f, return_shape=True)(*args)
