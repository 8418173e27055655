"""What flash attention and splash attention share (their blocks and VMEM budget are
``ops._policy``'s: ``_policy.choose`` with each family's ``_blocks._rule``,
``_policy.vmem_budget("attention")``): the checks of given blocks, and the lane layouts of the kernels' row statistics (a row max, a logsumexp, segment ids kept
lane-replicated as ``(rows, 128)`` so that they meet the score tiles without relayouts)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

NUM_LANES = 128


def check_blocks(op: str, blocks, checks: Iterable[tuple[str, str, Any]], per: str = "") -> None:
    """Each ``(field, of, n)`` of ``checks``: ``blocks.<field>`` divides ``n`` (the length
    named ``of``; ``per`` says of what, e.g. " (per q shard)") and is a multiple of 128 or
    ``n`` itself."""
    for name, of, n in checks:
        size = getattr(blocks, name)
        if size > n or n % size:
            raise ValueError(f"{op}: block_sizes.{name}={size} must divide {of}={n}{per}")
        if size != n and size % NUM_LANES:
            raise ValueError(
                f"{op}: block_sizes.{name}={size} must be a multiple of {NUM_LANES} "
                f"(a TPU tile of lanes) or all of {of}={n}"
            )


def lane_replicated(x, n: int):
    """A lane-replicated ``(rows, 128)`` value widened (or cut) to ``(rows, n)``."""
    if n == NUM_LANES:
        return x
    whole, part = divmod(n, NUM_LANES)
    pieces = [x] * whole + ([x[:, :part]] if part else [])
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def as_column(row, width=NUM_LANES):
    """A ``(1, n)`` row as an ``(n, width)`` column block: row ``i`` holds ``row[0, i]`` in every lane."""
    return jnp.transpose(jnp.broadcast_to(row, (width, row.shape[1])))


def as_row(column):
    """Lane 0 of an ``(n, 128)`` lane-replicated block as a lane-dense ``(1, n)`` row."""
    return jnp.transpose(column)[:1, :]
