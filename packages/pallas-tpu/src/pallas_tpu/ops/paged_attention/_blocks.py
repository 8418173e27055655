"""``paged_attention``'s compute blocks when the caller gives none: the chip's measured rows
(``ops._policy``; none yet), else a rule from the bytes a block must keep in flight."""

from __future__ import annotations

import numpy as np

from pallas_tpu.ops import _policy
from pallas_tpu.ops.paged_attention._kernel import SLOTS, padded_bytes

# Bytes of K and V one compute block copies: what the DMA queue holds while the block before is
# computed. A v5e's HBM moves ~0.82 MB/us, so 1 MiB (2048 bf16 keys of 128) covers a few
# microseconds of latency and the block's fixed work (waits, the softmax's row statistics, the
# loop); more only grows VMEM and the last block's waste. The per-copy issue cost is the same at
# any block size, so small pages get more pages a block, not fewer bytes.
BLOCK_BYTES = 1 << 20
# Pages one block copies at most: a block's copies are issued one after another (a loop of ~9
# bundles a page) before its arithmetic, so more pages make the block scalar-bound.
MAX_PAGES_PER_BLOCK = 128


def _rule(chip: _policy.Facts, key) -> int:
    """``BLOCK_BYTES`` of K and V, at most ``MAX_PAGES_PER_BLOCK``, the ``SLOTS`` block buffers
    within the VMEM budget."""
    page_size, head_dim, kv_itemsize, scales_dim = key
    page_bytes = 2 * page_size * head_dim * kv_itemsize  # a K page and a V page
    vmem_bytes = 2 * padded_bytes(page_size, head_dim, np.dtype(f"i{kv_itemsize}"))
    if scales_dim:
        vmem_bytes += 2 * padded_bytes(page_size, scales_dim, np.float32)
    pages = max(1, BLOCK_BYTES // page_bytes)
    pages = min(pages, max(1, _policy.vmem_budget("paged_attention", chip) // (SLOTS * vmem_bytes)))
    return min(pages, MAX_PAGES_PER_BLOCK)


def choose_pages_per_compute_block(
    page_size, head_dim, pages_per_sequence, kv_itemsize, info=None, scales_dim=None
):
    """The pages of one compute block when the caller gives none: ``BLOCK_BYTES`` of K and V,
    at most ``MAX_PAGES_PER_BLOCK`` and ``pages_per_sequence``, and the ``SLOTS`` block buffers
    within a quarter of the chip's VMEM (``info``; default ``pltpu.get_tpu_info()``), the
    scales of quantized pages (``scales_dim``: 1 or ``head_dim`` float32 per key) counted as
    VMEM lays them out."""
    key = (page_size, head_dim, kv_itemsize, scales_dim or None)
    return int(min(_policy.choose("paged_attention", key, _rule, info), pages_per_sequence))
