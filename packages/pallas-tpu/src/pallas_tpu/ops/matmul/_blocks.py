"""matmul's blocks: the chip's measured row (``_policy``, keyed by the input itemsize), else a
rule from its facts, fitted to the problem; and the VMEM the blocks hold."""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from pallas_tpu.ops import _policy

LANE = 128
_MIN_BLOCK = 256
# A product of at most this many rows (a decode projection: few tokens against a weight) is
# bound by HBM bringing ``y`` in; its panels are then whole rows of ``y`` (one contiguous DMA
# each) of about SKINNY_PANEL bytes. On the v5e at 256x8192x8192 bf16, (256, 8192, 256) ran
# 205 us where the square rule's (256, 1024, 2048) ran 241 (XLA: 207); pltpu.estimate ranks
# the whole-row panels first at 64x4096x4096 and 128x8192x28672 too, and not at 512 rows,
# where the square rule is within 1 % of its best (benchmarks/tpu_ops_matmul.py, "skinny").
SKINNY_ROWS = 256
SKINNY_PANEL = 4 << 20


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def vmem_bytes(bm, bn, bk, in_dtype, out_dtype, *, scratch: bool) -> int:
    """VMEM a ``(bm, bn, bk)`` program holds: both panels and the output block
    double-buffered, and the f32/int32 accumulator when it is a scratch."""
    panels = 2 * (bm * bk + bk * bn) * _itemsize(in_dtype)
    out = 2 * bm * bn * _itemsize(out_dtype)
    return panels + out + (bm * bn * 4 if scratch else 0)


def _rule(chip: _policy.Facts, in_dtype, out_dtype) -> tuple[int, int, int]:
    """Square tiles big enough that each loaded byte feeds the MXU for longer than HBM takes
    to bring the next one (1.5x the chip's flops per byte), in multiples of the MXU's width,
    shrunk (k first) to fit the VMEM budget."""
    isz = _itemsize(in_dtype)
    ops = chip.int8_ops if isz == 1 and chip.int8_ops else chip.bf16_flops
    flops_per_byte = ops / max(chip.hbm_bytes_per_second, 1)
    # A (b, b, bk) step does 2*b*b*bk flops on 2*b*bk*isz bytes: b / isz flops per byte.
    b = 2 ** math.ceil(math.log2(max(1.5 * flops_per_byte * isz, _MIN_BLOCK)))
    b = max(min(b, 2048), chip.mxu_columns)
    bk = 512
    budget = _policy.vmem_budget("matmul", chip)
    scratch = _itemsize(out_dtype) < 4
    while vmem_bytes(b, b, bk, in_dtype, out_dtype, scratch=scratch) > budget and b > _MIN_BLOCK:
        if bk > _MIN_BLOCK:
            bk //= 2
        else:
            b //= 2
    return b, b, bk


def _fitted(dim: int, want: int) -> int:
    """A block for ``dim`` that divides it, or else its length padded to 128s."""
    padded = -(-dim // LANE) * LANE  # 128 divides it: a block always fits
    return _policy.fit_block(dim, want) or cast(int, _policy.fit_block(padded, want))


def choose_blocks(m: int, k: int, n: int, in_dtype, out_dtype, info=None) -> tuple[int, int, int]:
    """``(bm, bk, bn)`` for ``x (m, k) @ y (k, n)`` on the chip ``info`` (default
    ``pltpu.get_tpu_info()``): its measured row (the v5e's), else the rule from its facts,
    fitted to the problem. A dimension no block divides gets a block of 128 multiples
    (``matmul`` pads it)."""
    chip = _policy.facts(info)
    rule = lambda chip, isz: _rule(chip, in_dtype, out_dtype)
    bm, bn, bk = _policy.choose("matmul", _itemsize(in_dtype), rule, info)
    if chip.num_cores > 1 and m <= bm and n > LANE:
        # Give a megacore chip's second TensorCore a share of the parallel axes.
        bn = max(LANE, min(bn, (n // 2) // LANE * LANE))
    bm, bn = _fitted(m, bm), _fitted(n, bn)
    scratch = _itemsize(out_dtype) < 4
    budget = _policy.vmem_budget("matmul", info)
    if m <= SKINNY_ROWS and chip.num_cores == 1:
        return _skinny(bm, k, n, in_dtype, out_dtype, budget, scratch)
    # Small output tiles (a short m or n) leave VMEM unused: longer k steps
    # then cut the number of grid steps.
    if bm * bn < 1024 * 1024:
        while (
            bk < min(k, 2048) and vmem_bytes(bm, bn, 2 * bk, in_dtype, out_dtype, scratch=scratch) <= budget
        ):
            bk *= 2
    return bm, _fitted(k, bk), bn


def _skinny(bm: int, k: int, n: int, in_dtype, out_dtype, budget: int, scratch: bool) -> tuple[int, int, int]:
    """``(bm, bk, bn)`` for a product of few rows: ``y``'s panels whole rows (``bn`` the whole of
    ``n``, halved while the blocks overflow the VMEM budget), ``bk`` rows of them in about
    ``SKINNY_PANEL`` bytes (128 to 1024)."""
    bn = _fitted(n, n)
    while True:
        rows = SKINNY_PANEL // (bn * _itemsize(in_dtype))
        bk = max(LANE, min(1024, 2 ** max(int(math.log2(max(rows, 1))), 0)))
        if bn <= 1024 or vmem_bytes(bm, bn, bk, in_dtype, out_dtype, scratch=scratch) <= budget:
            return bm, _fitted(k, bk), bn
        bn = _fitted(n, bn // 2)
