"""The KV cache update of ``v3.ragged_paged_attention``'s kernel: the new tokens' keys and
values, DMA'd from HBM into their pages of the (aliased) cache in HBM before any page is read.

Sequence ``s``'s ``q_len`` new tokens take cache positions ``[kv_len - q_len, kv_len)``. The
run of them that falls in one page is copied by at most ``bit_length(page_size)`` DMAs of
static sizes (the binary digits of the run's length), so a decode costs one DMA and a whole
page of a prefill costs one. The slices are along the token dims, never inside a tile (an
offset there that is not a tile multiple is refused by libtpu 0.0.42.1's Mosaic). Every copy of the step is started before the first is waited
for; the waits walk the same pieces, so each wait matches one started copy.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops.ragged_paged_attention._schedule import Plan, Tables


def _for_each_piece(plan: Plan, tables: Tables, new_ref, cache_ref, sem, act: str):
    ps = plan.page_size
    # A run is at most a page and at most the batch's tokens long.
    sizes = [1 << b for b in reversed(range(min(ps, new_ref.shape[0]).bit_length()))]

    def sequence(s, carry):
        q_lo, q_hi = tables.q_start(s), tables.q_start(s + 1)
        kv_len = tables.kv_len(s)
        first = kv_len - (q_hi - q_lo)  # the cache position of the first new token

        def page(g, carry):
            lo = jnp.maximum(first, g * ps)
            n = jnp.minimum(kv_len, (g + 1) * ps) - lo
            tok = q_lo + lo - first  # the new token at cache position lo
            dst = tables.page(s, g)
            for size in sizes:
                off = n & ~(2 * size - 1)  # the pieces of the higher binary digits come first

                @pl.when((n & size) != 0)
                def _():
                    copy = pltpu.make_async_copy(
                        new_ref.at[pl.ds(tok + off, size)],
                        cache_ref.at[dst, pl.ds(lo - g * ps + off, size)],
                        sem,
                    )
                    if act == "start":
                        copy.start()
                    else:
                        copy.wait()

            return carry

        has_new = (q_hi > q_lo) & (first >= 0)
        lo_page = jnp.where(has_new, first // ps, 0)
        hi_page = jnp.where(has_new, pl.cdiv(kv_len, ps), 0)
        return lax.fori_loop(lo_page, hi_page, page, carry)

    lax.fori_loop(0, tables.num_seqs, sequence, 0)


def write_new_kv(plan: Plan, tables: Tables, new_ref, cache_ref, sem):
    """Copies every sequence's new K/V (``new_ref``: ``[tokens, ...tail]``, HBM) into its pages
    of ``cache_ref`` (``[pages, page_size, ...tail]``, HBM; the tail holds a token's combined
    heads, so the copies slice the token dims only) and waits for all of them."""
    _for_each_piece(plan, tables, new_ref, cache_ref, sem, "start")
    _for_each_piece(plan, tables, new_ref, cache_ref, sem, "wait")
