"""Checks on a traced kernel jaxpr that JAX itself does not make."""

from __future__ import annotations

import numpy as np

from pallas._src import compat


def _static_int(x):
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    if isinstance(x, np.ndarray) and x.shape == () and np.issubdtype(x.dtype, np.integer):
        return int(x)
    return None


def check_static_indices(jaxpr, describe_kernel: str) -> None:
    """Static integer indices into a Ref must lie inside the Ref's shape:
    out of range they would read or write another block's memory on a GPU."""
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
                    raise ValueError(
                        f"{describe_kernel}: in the kernel{at}: index {v} is out of bounds for "
                        f"dimension {dim} of a Ref of shape {tuple(indexer.shape)} (the block); "
                        f"valid indices are 0..{n - 1}"
                    )
    for sub in compat.subjaxprs(jaxpr):
        check_static_indices(sub, describe_kernel)
