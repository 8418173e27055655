"""The tiles ``gmm`` and ``tgmm`` choose when none are given (``choose_tiling``): from the
shapes, the group count and the chip (``pltpu.get_tpu_info()``: VMEM, cores, the MXU)."""

from __future__ import annotations

import numpy as np

import pallas_tpu as pltpu
from pallas_tpu.ops import matmul as _matmul

_MAX_TM = 512
_LANE = 128
# A step's product in MXU pushes at most (code size: ``choose_tiling``), and the n tile it
# shrinks to before k does.
_MAX_STEP_PUSHES = 8192
_MIN_CODE_TN = 512


def _row_tile(m: int, num_groups: int) -> int:
    """Rows per tile: the largest power of two up to the mean group size, 128 to 512 rows;
    a tile much taller than a group computes mostly rows it throws away."""
    mean = max(m // max(num_groups, 1), 1)
    tm = _LANE
    while tm * 2 <= min(mean, _MAX_TM):
        tm *= 2
    return m if m <= tm else tm


def _shrink(dim: int, t: int) -> int:
    half = max(_LANE, (t // 2) // _LANE * _LANE)
    return _matmul.fit_block(dim, half) or half


def choose_tiling(m, k, n, num_groups, in_dtype, out_dtype, *, transposed=False, existing=False, info=None):
    """``(tm, tk, tn)`` for ``gmm`` (``transposed=True``: for ``tgmm``) on the chip ``info``
    (default ``pltpu.get_tpu_info()``). ``gmm``: the whole of k and n while the
    double-buffered blocks fit the VMEM budget (n shrunk first, then k), at least one
    n tile per TensorCore. ``tgmm``: output tiles of up to 1024 x 1024, so that each
    step's loads feed the MXU for longer than they take.

    Then, for code size, a step's product is kept to ``_MAX_STEP_PUSHES`` MXU pushes (one
    packed vreg of lhs rows through one ``mxu_column_size``-square rhs tile; n shrunk first,
    to 512, then k): the product is straight-line code (with the 128-row chunk of a shared
    tile beside it), which must fit the core's instruction memory, ~56k bundles on the v5e;
    libtpu splits a larger kernel into overlays fetched from HBM on every grid step. On the
    v5e (libtpu's scheduler), 4096^3 bf16 in 8 groups at (512, 4096, 2048), 16384 pushes, was
    77.1k bundles in 4 overlays; at (512, 4096, 1024) it is 39.0k in one, the whole tile's
    product 30.2k bundles for 32.8k MXU cycles (0.92 of them, as before: the MXU sets the pace)."""
    info = info or pltpu.get_tpu_info()
    isz, osz = np.dtype(in_dtype).itemsize, np.dtype(out_dtype).itemsize
    budget = _matmul.VMEM_BUDGET_FRACTION * info.vmem_capacity_bytes
    tm = _row_tile(m, num_groups)
    if transposed:
        tk, tn = _matmul.fit_block(k, 1024) or 1024, _matmul.fit_block(n, 1024) or 1024
    else:
        tk, tn = k, n
    if info.num_cores > 1 and n >= 2 * _LANE:
        tn = min(tn, _shrink(n, n))
    while True:
        need = vmem_bytes(tm, tk, tn, isz, osz, tiles_k=-(-k // tk), transposed=transposed, existing=existing)
        if need <= budget or (tn <= _LANE and tk <= _LANE):
            break
        if tn >= tk and tn > _LANE:
            tn = _shrink(n, tn)
        else:
            tk = _shrink(k, tk)
    while mxu_pushes(tm, tk, tn, isz, info) > _MAX_STEP_PUSHES and max(tk, tn) > _LANE:
        if tn > _MIN_CODE_TN or tk <= _LANE:
            tn = _shrink(n, tn)
        else:
            tk = _shrink(k, tk)
    return tm, tk, tn


def mxu_pushes(tm, tk, tn, isz, info) -> int:
    """The MXU pushes of one step's ``(tm, tk) @ (tk, tn)`` product: a vreg of lhs rows
    (``num_sublanes`` rows of 4 bytes, packed two or four to a row of narrower ones) through
    each ``mxu_column_size``-square tile of rhs."""
    rows = info.num_sublanes * max(1, 4 // isz)
    mxu = info.mxu_column_size
    return -(-tm // rows) * -(-tk // mxu) * -(-tn // mxu)


def vmem_bytes(tm, tk, tn, isz, osz, *, tiles_k, transposed, existing):
    """What the blocks of one step hold in VMEM (inputs and output double-buffered)."""
    if transposed:  # lhs (tk, tm), rhs (tm, tn), out (tk, tn), f32 accumulator
        return 2 * (tk * tm + tm * tn) * isz + 2 * tk * tn * osz * (1 + existing) + 2 * tk * tn * 4
    acc = tm * tn * 4 if tiles_k > 1 else 0
    return 2 * (tm * tk + tk * tn) * isz + 2 * tm * tn * osz * (1 + existing) + acc + tm * tn * 4
