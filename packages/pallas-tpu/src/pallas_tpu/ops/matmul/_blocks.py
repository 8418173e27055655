"""matmul's blocks: the chip's measured row (``_policy``, keyed by the input itemsize), else a
rule from its facts, fitted to the problem; and the VMEM the blocks hold."""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from pallas_tpu.ops import _policy

LANE = 128
_MIN_BLOCK = 256


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
    # Small output tiles (a short m or n) leave VMEM unused: longer k steps
    # then cut the number of grid steps.
    scratch = _itemsize(out_dtype) < 4
    budget = _policy.vmem_budget("matmul", info)
    if bm * bn < 1024 * 1024:
        while (
            bk < min(k, 2048) and vmem_bytes(bm, bn, 2 * bk, in_dtype, out_dtype, scratch=scratch) <= budget
        ):
            bk *= 2
    return bm, _fitted(k, bk), bn
