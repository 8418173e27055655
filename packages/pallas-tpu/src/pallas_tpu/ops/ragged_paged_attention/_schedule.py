"""The scalar side of ``ragged_paged_attention``'s kernel: which sequences a query block holds,
which keys their rows need, and the DMAs that bring those keys' pages into VMEM.

A *work item* is (sequence ``s``, query block ``i``): the rows of ``s``'s tokens that fall in
block ``i``, against the KV blocks their causal (and sliding-window) span covers. Items run in
order of ``i``, then ``s``; each KV block's pages are started while the block before is
computed, across sequences and across grid steps (``first_item`` and ``next_item`` are exact,
so every started copy is the one waited for next).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl
import pallas_tpu as pltpu


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static facts of one ``ragged_paged_attention`` call."""

    num_kv_heads: int
    groups: int  # q heads per KV head
    head_dim: int
    page_size: int
    pages_per_seq: int
    pages_per_block: int  # KV pages per compute block
    q_block: int  # query tokens per grid step
    window: int  # query tokens of the narrow path (sequences with few rows in a block)
    max_num_seqs: int
    kv_dtype: np.dtype
    compute_dtype: np.dtype
    sliding_window: int | None
    soft_cap: float | None
    mask_value: float
    k_scale: float | None
    v_scale: float | None
    # v3 (``v3.ragged_paged_attention``): the new tokens' K/V are written into the cache by the
    # kernel first; the count of sequences is entry ``num_seqs_slot`` of the 4th scalar table
    # (``num_seqs``: 0, ``distribution``: 2); a per-q-head sink logit joins each softmax.
    update_cache: bool = False
    num_seqs_slot: int = 0
    attention_sink: bool = False
    # Multiplies the float32 scores (``k_scale`` joins it: the codes stay exact in the matmul).
    sm_scale: float = 1.0

    @property
    def kv_heads_combined(self) -> int:
        return 2 * self.num_kv_heads

    @property
    def block_tokens(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def page_rows(self) -> int:
        """Rows of one page in the ``[tokens * combined heads, head_dim]`` view."""
        return self.page_size * self.kv_heads_combined


@dataclasses.dataclass(frozen=True)
class Item:
    """A sequence's rows in a query block and the keys they need (traced int32 scalars)."""

    seq: jax.Array
    row_lo: jax.Array  # block-relative tokens [row_lo, row_hi)
    row_hi: jax.Array
    pos_base: jax.Array  # the kv position of block-relative token t is pos_base + t
    kv_lo: jax.Array  # keys [kv_lo, kv_hi) are needed
    kv_hi: jax.Array


class Tables:
    """Reads of the scalar-prefetched tables (SMEM), every index clamped into range."""

    def __init__(self, plan: Plan, kv_lens, page_indices, cu_q_lens, num_seqs):
        self.plan = plan
        self.kv_lens, self.page_indices, self.cu_q_lens = kv_lens, page_indices, cu_q_lens
        self.num_seqs = jnp.minimum(num_seqs[plan.num_seqs_slot], plan.max_num_seqs)

    def q_start(self, s):
        return self.cu_q_lens[jnp.minimum(s, self.plan.max_num_seqs)]

    def item(self, s, i) -> Item:
        plan = self.plan
        sc = jnp.minimum(s, plan.max_num_seqs - 1)
        q_lo, q_hi = self.q_start(sc), self.q_start(sc + 1)
        kv_len = jnp.minimum(self.kv_lens[sc], plan.pages_per_seq * plan.page_size)
        blk = i * plan.q_block
        row_lo = jnp.maximum(q_lo, blk) - blk
        row_hi = jnp.minimum(q_hi, blk + plan.q_block) - blk
        pos_base = kv_len - (q_hi - q_lo) - q_lo + blk
        kv_hi = jnp.minimum(pos_base + row_hi, kv_len)  # the last row's own key, inclusive
        kv_lo = jnp.int32(0)
        if plan.sliding_window is not None:
            kv_lo = jnp.maximum(pos_base + row_lo - plan.sliding_window + 1, 0)
        return Item(s, row_lo, row_hi, pos_base, kv_lo, kv_hi)

    def active(self, s, i):
        it = self.item(s, i)
        return (s < self.num_seqs) & (it.row_lo < it.row_hi) & (it.kv_lo < it.kv_hi)

    def first_item(self, s, i):
        """The first sequence ``>= s`` with rows and keys in block ``i``, and whether there is one."""
        end = (i + 1) * self.plan.q_block

        def more(s):
            return (s < self.num_seqs) & (self.q_start(s) < end) & jnp.logical_not(self.active(s, i))

        s = lax.while_loop(more, lambda s: s + 1, s)
        return s, (s < self.num_seqs) & (self.q_start(s) < end)

    def kv_len(self, s):
        """Keys of sequence ``s`` (clamped to its page list)."""
        sc = jnp.minimum(s, self.plan.max_num_seqs - 1)
        return jnp.minimum(self.kv_lens[sc], self.plan.pages_per_seq * self.plan.page_size)

    def page(self, s, g):
        return self.page_indices[jnp.minimum(s, self.plan.max_num_seqs - 1) * self.plan.pages_per_seq + g]


def kv_block_range(plan: Plan, item: Item):
    """The KV compute blocks ``[lo, hi)`` of an item."""
    return item.kv_lo // plan.block_tokens, pl.cdiv(item.kv_hi, plan.block_tokens)


def page_range(plan: Plan, item: Item, j):
    """The pages of KV block ``j`` an item needs: ``[lo, hi)``, in the sequence's page list."""
    first = j * plan.pages_per_block
    lo = jnp.maximum(first, item.kv_lo // plan.page_size)
    hi = jnp.minimum(
        jnp.minimum(first + plan.pages_per_block, pl.cdiv(item.kv_hi, plan.page_size)), plan.pages_per_seq
    )
    return lo, hi


class Copies:
    """The DMAs of KV blocks into the two slots of the VMEM buffer (one semaphore per slot). A
    page lands at its place in the block, so a block's tokens are in order whatever pages it
    skips. The cache in HBM and the buffer share their trailing dims (``[combined heads,
    head_dim]``, or v3's ``[combined // packing, packing, head_dim]``): pages are sliced along
    the token dim only, never inside a tile."""

    def __init__(self, plan: Plan, tables: Tables, kv_hbm, buf, sems):
        self.plan, self.tables, self.kv_hbm, self.buf, self.sems = plan, tables, kv_hbm, buf, sems

    def _dst(self, slot, i):
        ps = self.plan.page_size
        return self.buf.at[slot, pl.ds(pl.multiple_of(i * ps, ps), ps)]

    def start(self, item: Item, j, slot):
        lo, hi = page_range(self.plan, item, j)
        first = j * self.plan.pages_per_block

        def one(g, carry):
            page = self.tables.page(item.seq, g)
            pltpu.make_async_copy(
                self.kv_hbm.at[page], self._dst(slot, g - first), self.sems.at[slot]
            ).start()
            return carry

        lax.fori_loop(lo, hi, one, 0)

    def wait(self, item: Item, j, slot):
        lo, hi = page_range(self.plan, item, j)

        def one(g, carry):
            dst = self._dst(slot, 0)
            pltpu.make_async_copy(dst, dst, self.sems.at[slot]).wait()
            return carry

        lax.fori_loop(lo, hi, one, 0)
