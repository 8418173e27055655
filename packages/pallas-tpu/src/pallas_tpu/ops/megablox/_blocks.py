"""The tiles ``gmm`` and ``tgmm`` choose when none are given (``choose_tiling``): the chip's
measured rows (``ops._policy``; none yet), else a rule from its facts (VMEM, TensorCores, the MXU,
instruction memory) and the shapes and group count."""

from __future__ import annotations

import numpy as np

from pallas_tpu.ops import _policy

_MAX_TM = 512
_LANE = 128
# A step's product in MXU pushes at most (code size: ``choose_tiling``) on a core of
# ``_STEP_PUSHES[1]`` bundles of instruction memory (the v5e's), in proportion elsewhere; the n
# tile it shrinks to before k does.
_STEP_PUSHES = (8192, 56_000)
_MIN_CODE_TN = 512


def max_step_pushes(chip: _policy.Facts) -> int:
    """The MXU pushes a step's straight-line product may take on ``chip``: 8192 on the v5e
    (~39k bundles of its ~56k of instruction memory, the rest of the kernel included), in
    proportion to the instruction memory elsewhere (the v5e's where it is not measured)."""
    pushes, bundles = _STEP_PUSHES
    return pushes * (chip.instruction_bundles or bundles) // bundles


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
    return _policy.fit_block(dim, half) or half


def _rule(chip: _policy.Facts, key) -> tuple[int, int, int]:
    m, k, n, num_groups, isz, osz, transposed, existing = key
    budget = _policy.vmem_budget("megablox", chip)
    tm = _row_tile(m, num_groups)
    if transposed:
        tk, tn = _policy.fit_block(k, 1024) or 1024, _policy.fit_block(n, 1024) or 1024
    else:
        tk, tn = k, n
    if chip.num_cores > 1 and n >= 2 * _LANE:
        tn = min(tn, _shrink(n, n))
    while True:
        need = vmem_bytes(tm, tk, tn, isz, osz, tiles_k=-(-k // tk), transposed=transposed, existing=existing)
        if need <= budget or (tn <= _LANE and tk <= _LANE):
            break
        if tn >= tk and tn > _LANE:
            tn = _shrink(n, tn)
        else:
            tk = _shrink(k, tk)
    while mxu_pushes(tm, tk, tn, isz, chip) > max_step_pushes(chip) and max(tk, tn) > _LANE:
        if tn > _MIN_CODE_TN or tk <= _LANE:
            tn = _shrink(n, tn)
        else:
            tk = _shrink(k, tk)
    return tm, tk, tn


def choose_tiling(m, k, n, num_groups, in_dtype, out_dtype, *, transposed=False, existing=False, info=None):
    """``(tm, tk, tn)`` for ``gmm`` (``transposed=True``: for ``tgmm``) on the chip ``info``
    (default ``pltpu.get_tpu_info()``). ``gmm``: the whole of k and n while the
    double-buffered blocks fit the VMEM budget (n shrunk first, then k), at least one
    n tile per TensorCore. ``tgmm``: output tiles of up to 1024 x 1024, so that each
    step's loads feed the MXU for longer than they take.

    Then, for code size, a step's product is kept to ``max_step_pushes`` MXU pushes (one
    packed vreg of lhs rows through one MXU-square rhs tile; n shrunk first, to 512, then k):
    the product is straight-line code (with the 128-row chunk of a shared tile beside it),
    which must fit the core's instruction memory, ~56k bundles on the v5e; libtpu splits a
    larger kernel into overlays fetched from HBM on every grid step. On the v5e (libtpu's
    scheduler), 4096^3 bf16 in 8 groups at (512, 4096, 2048), 16384 pushes, was 77.1k bundles
    in 4 overlays; at (512, 4096, 1024) it is 39.0k in one, the whole tile's product 30.2k
    bundles for 32.8k MXU cycles (0.92 of them, as before: the MXU sets the pace)."""
    isz, osz = np.dtype(in_dtype).itemsize, np.dtype(out_dtype).itemsize
    key = (m, k, n, num_groups, isz, osz, transposed, existing)
    return _policy.choose("megablox", key, _rule, info)


def mxu_pushes(tm, tk, tn, isz, chip) -> int:
    """The MXU pushes of one step's ``(tm, tk) @ (tk, tn)`` product on ``chip`` (``Facts`` or
    ``TpuInfo``): a vreg of lhs rows (``sublanes`` rows of 4 bytes, packed two or four to a row
    of narrower ones) through each MXU-square tile of rhs."""
    chip = _policy.facts(chip)
    rows = chip.sublanes * max(1, 4 // isz)
    mxu = chip.mxu_columns
    return -(-tm // rows) * -(-tk // mxu) * -(-tn // mxu)


def vmem_bytes(tm, tk, tn, isz, osz, *, tiles_k, transposed, existing):
    """What the blocks of one step hold in VMEM (inputs and output double-buffered)."""
    if transposed:  # lhs (tk, tm), rhs (tm, tn), out (tk, tn), f32 accumulator
        return 2 * (tk * tm + tm * tn) * isz + 2 * tk * tn * osz * (1 + existing) + 2 * tk * tn * 4
    acc = tm * tn * 4 if tiles_k > 1 else 0
    return 2 * (tm * tk + tk * tn) * isz + 2 * tm * tn * osz * (1 + existing) + acc + tm * tn * 4
