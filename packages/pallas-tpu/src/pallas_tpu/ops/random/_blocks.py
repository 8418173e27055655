"""The blocks of the generators' kernel: the chip's measured rows (``ops._policy``; none yet),
else a rule from its facts: rows as wide as ``MAX_LANES``, about the policy's block bytes a block
(2 MiB: the ~0.35 us a grid step costs is then a few percent of a block's hashing on any
generation), and at least ``MIN_STEPS`` steps per TensorCore when there are rows for them, so
the write-back of one block overlaps the hashing of the next."""

from __future__ import annotations

from pallas_tpu.ops import _policy
from pallas_tpu.ops.random.prng_utils import round_up

MAX_LANES = 1024
MIN_STEPS = 4
# A strip of this many 32-bit elements is 8 vregs per live value: the hashes keep
# about four values live, half of the 64 vregs.
STRIP_ELEMS = 8 * 8 * 128


def strip_rows(block_rows: int, block_lanes: int, sublanes: int = 8) -> int:
    """Rows a strip of a ``(block_rows, block_lanes)`` block hashes at a time:
    a multiple of ``sublanes`` that divides ``block_rows``, about
    ``STRIP_ELEMS`` elements; the whole block when its rows are not a multiple
    of ``sublanes``."""
    if block_rows % sublanes:
        return block_rows
    lanes = round_up(block_lanes, 128)
    want = max(sublanes, STRIP_ELEMS // lanes // sublanes * sublanes)
    rows = min(want, block_rows)
    while block_rows % rows:
        rows -= sublanes
    return rows


def _rule(chip: _policy.Facts, key) -> tuple[int, int]:
    rows, width = key
    sub = chip.sublanes
    if width <= MAX_LANES:
        bw = width
    else:  # a divisor of at least half of MAX_LANES, else MAX_LANES with the last block cut
        bw = next((b for b in range(MAX_LANES, MAX_LANES // 2 - 1, -128) if width % b == 0), MAX_LANES)
    strip = strip_rows(round_up(rows, sub), bw, sub)
    budget = _policy.vmem_budget("random", chip)
    bh = max(strip, budget // (4 * round_up(bw, 128)) // strip * strip)
    steps = MIN_STEPS * max(chip.num_cores, 1)
    bh = min(bh, max(strip, round_up(-(-rows // steps), strip)))
    if bh >= rows:
        return rows, bw
    return bh, bw


def choose_block(rows: int, width: int, info=None) -> tuple[int, int]:
    """``(bh, bw)`` for a ``(rows, width)`` uint32 output on the chip ``info``
    (default ``pltpu.get_tpu_info()``); blocks need not divide the output (the
    last block of each axis is cut off)."""
    return _policy.choose("random", (rows, width), _rule, info)
