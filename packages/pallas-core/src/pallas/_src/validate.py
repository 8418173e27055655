"""Checks on a traced kernel jaxpr that JAX itself does not make."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import jaxprs_in_params

from pallas._src import compat


def _static_int(x):
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    if isinstance(x, np.ndarray) and x.shape == () and np.issubdtype(x.dtype, np.integer):
        return int(x)
    return None


def normalize_negative_indices(jaxpr):
    """Static negative integer indices into a Ref count from the end, as in
    Python (and JAX): ``x_ref[-1]`` becomes ``x_ref[n - 1]`` in the jaxpr, so
    every backend sees in-range indices. Out-of-range ones are left for
    ``check_static_indices`` to report."""

    def fix(eqn):
        for shape, dim, pos, val in compat.ref_index_literals(eqn):
            v = _static_int(val)
            if v is not None and -shape[dim] <= v < 0:
                eqn = compat.replace_literal(eqn, pos, v + shape[dim])
        return eqn

    return compat.map_eqns(jaxpr, fix)


def check_static_indices(jaxpr, describe_kernel: str) -> None:
    """Static integer indices into a Ref must lie inside the Ref's shape:
    out of range they would read or write another block's memory on a GPU.

    Code that may not run (a ``cond`` branch, a ``while`` loop's body) is not checked:
    a kernel may index past the end where a condition it knows never holds guards it
    (tokamax's fused MoE decode reads ``ids_ref[4]`` of 4 entries under
    ``pl.when(units > 4)``), which JAX's interpret mode and a TPU accept; where such code
    runs, the interpreters check the access as they check a dynamic index."""
    for eqn in jaxpr.eqns:
        for indexer in compat.ref_indexers(eqn):
            for dim, idx in enumerate(indexer.indices):
                v = _static_int(idx)
                if v is None or dim >= len(indexer.shape):
                    continue
                n = indexer.shape[dim]
                if not 0 <= v < n:
                    where = compat.eqn_user_source(eqn)
                    at = f" at {where}" if where else ""
                    # JAX's interpreters' words first ("Out-of-bounds read" / "Out-of-bounds
                    # write", what code matching JAX's messages looks for), then ours.
                    kind = "read" if eqn.primitive.name == "get" else "write"
                    raise ValueError(
                        f"{describe_kernel}: in the kernel{at}: Out-of-bounds {kind}: index {v} is out of "
                        f"bounds for dimension {dim} of a Ref of shape {tuple(indexer.shape)} (the block); "
                        f"valid indices are {-n}..{n - 1}"
                    )
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("cond", "while"):
            continue
        for sub in jaxprs_in_params(eqn.params):
            check_static_indices(getattr(sub, "jaxpr", sub), describe_kernel)


_READS = {"get": "reads", "swap": "writes", "addupdate": "adds to"}


def check_semaphores_not_data(jaxpr, describe_kernel: str) -> None:
    """A semaphore Ref is not data: ``sem[0]`` would read a count the hardware keeps
    elsewhere (JAX refuses it: "dtype=dma_sem is not a valid dtype")."""
    from pallas._src.core import semaphore_kind

    for eqn in jaxpr.eqns:
        what = _READS.get(eqn.primitive.name)
        if what is not None:
            aval: Any = getattr(eqn.invars[0], "aval", None)
            kind = semaphore_kind(aval)
            if kind is not None:
                where = compat.eqn_user_source(eqn)
                at = f" at {where}" if where else ""
                raise TypeError(
                    f"{describe_kernel}: in the kernel{at}: {what} the {kind.name} semaphore Ref "
                    f"{kind.name.lower()}_sem{list(aval.shape)} as data; a semaphore's count is read with "
                    "pl.semaphore_read(sem.at[i]) and changed with pl.semaphore_signal / pl.semaphore_wait "
                    "(a DMA semaphore: through its copy's .wait())"
                )
        for sub in jaxprs_in_params(eqn.params):
            check_semaphores_not_data(getattr(sub, "jaxpr", sub), describe_kernel)


def check_bool_fields(owner: str, obj, names) -> None:
    """Options documented as bool must be bools: ``detect_races="no"`` is
    truthy and would silently switch the option on."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{owner}: {name} must be True or False, got {v!r} ({type(v).__name__})")


def inner_invars(eqn, sub) -> list:
    """The outer atoms of ``eqn`` bound to the invars of ``sub``, one of its
    jaxprs (None where unknown): how a Ref passed to a loop, cond or
    run_scoped body is followed inside."""
    n = len(sub.invars)
    name = eqn.primitive.name
    if name == "cond":
        outer = list(eqn.invars[1:])
    elif name == "while":
        c, b = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        if sub is eqn.params["cond_jaxpr"].jaxpr:
            outer = list(eqn.invars[:c]) + list(eqn.invars[c + b :])
        else:
            outer = list(eqn.invars[c:])
    elif name == "run_scoped":
        outer = list(eqn.invars) + [None] * (n - len(eqn.invars))
    else:
        outer = list(eqn.invars)[-n:] if n else []
    outer = [None] * (n - len(outer)) + outer
    return outer[:n]
