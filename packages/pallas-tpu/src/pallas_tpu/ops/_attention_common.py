"""What flash attention and splash attention share (their blocks and VMEM budget are
``ops._policy``'s: ``_policy.choose`` with each family's ``_blocks._rule``,
``_policy.vmem_budget("attention")``): the checks of given blocks, and the lane layouts of the kernels' row statistics (a row max, a logsumexp, segment ids kept
lane-replicated as ``(rows, 128)`` so that they meet the score tiles without relayouts)."""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

import pallas_tpu as pltpu

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


def take_refs(refs, *names):
    """The kernel's refs by name, in order: each of ``names`` a name (always passed) or
    ``(name, present)`` (passed only when ``present``; its attribute then None). Every ref
    must be named."""
    refs = list(refs)
    taken = {}
    for entry in names:
        name, present = (entry, True) if isinstance(entry, str) else entry
        taken[name] = refs.pop(0) if present else None
    if refs:
        raise ValueError(f"take_refs: {len(refs)} refs left unnamed after {list(taken)}")
    return types.SimpleNamespace(**taken)


def softmax_scratch(block_q: int, head_dim: int) -> list:
    """The online softmax's VMEM: the running row max and row sum (lane-replicated) and the
    unnormalized float32 output."""
    return [
        pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # running max
        pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # running sum
        pltpu.VMEM((block_q, head_dim), jnp.float32),  # unnormalized output
    ]


def softmax_init(m_ref, l_ref, acc_ref) -> None:
    """A query block's first step: max ``-inf``, sum and output 0."""
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def softmax_update(s, m_ref, l_ref, acc_ref, r, times_v) -> None:
    """One tile of base-2 logits ``s`` (rows ``r`` of the query block) into the online softmax:
    the running max and sum rescaled, the output rescaled plus ``times_v(p)`` (the tile's
    probabilities times its values, float32)."""
    m_prev = m_ref[r, :]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp2(s - lane_replicated(m_next, s.shape[1]))
    rescale = jnp.exp2(m_prev - m_next)
    m_ref[r, :] = m_next
    l_ref[r, :] = rescale * l_ref[r, :] + jnp.sum(p, axis=1, keepdims=True)
    pv = times_v(p)
    acc_ref[r, :] = acc_ref[r, :] * lane_replicated(rescale, acc_ref.shape[1]) + pv
