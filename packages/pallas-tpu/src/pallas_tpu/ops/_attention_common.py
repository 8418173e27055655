"""What flash attention and splash attention share: the VMEM budget their block rules and
kernels start from and the rule that fits a block to a length (both ``ops._policy``'s), the
checks of given blocks, and the lane layouts of the kernels' row statistics (a row max, a logsumexp, segment ids kept
lane-replicated as ``(rows, 128)`` so that they meet the score tiles without relayouts)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import jax.numpy as jnp

from pallas_tpu.ops import _policy

NUM_LANES = 128


def vmem_budget() -> int:
    """The VMEM a kernel may ask for: ``ops._policy``'s "attention" budget, three quarters of the
    chip's (16 MiB when the chip's facts are unknown), at most 100 MiB."""
    try:
        return _policy.vmem_budget("attention")
    except Exception:  # no TPU facts for this device: the smallest scoped default
        return _policy.VMEM["attention"].budget(16 * 2**20 * 4 // 3)


def fit_block(n: int | None, target: int) -> int:
    """``ops._policy.fit_block`` with the whole axis where no block divides it: the largest
    multiple of 128 at most ``target`` that divides ``n``; ``n`` itself when ``n <= target`` or
    none does (a block as long as its axis is always a legal TPU block); ``target`` when ``n``
    is unknown (None)."""
    return cast(int, _policy.fit_block(n, target, or_whole=True))


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
