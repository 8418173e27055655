"""The Hopper (sm_90) forward of ``mha``, written in Gluon (Triton's
lower-level language, ``triton.experimental.gluon``), where the schedule that
plain Triton cannot express is written by hand. Imported only when that path
is taken: it imports Triton.

Tiles of 128 query rows of one (batch, head); a program takes tiles pid,
pid + grid, ... (``_attention_sm90.grid_size``: one program per
multiprocessor; causal tiles in the order of ``_tile``'s GH, which evens out
the programs' work). 12 warps in three partitions
(``gl.warp_specialize``):

* two math warpgroups (4 warps each, 240 registers), each owning 64 of the
  128 rows. They take turns issuing their wgmmas (two mbarriers, ``turn``),
  so one warpgroup's softmax runs on the CUDA cores while the other's
  products occupy the tensor cores (FlashAttention-3's ping-pong). Within a
  warpgroup, block j+1's ``Q @ K^T`` and block j's ``P @ V`` are issued
  together and the softmax of block j+1 runs while ``P @ V`` does
  (``wgmma_wait(1)``); no wgmma stays in flight across the loop's back edge
  (ptxas then serializes every wgmma: warning C7514). O and the LSE go to
  memory straight from registers, so a warpgroup releases its Q slot as soon
  as its tile's last ``Q @ K^T`` is done;
* a one-warp producer (24 registers) that loads each tile's Q halves once
  their slots are free and streams the K/V blocks through an ``NBUF``-deep
  ring of shared-memory slots by TMA (one descriptor per operand over the
  whole ``[B * T, H * D]`` array), one mbarrier per slot and operand; a slot
  is refilled once both warpgroups have released it (``kv_empty``, count 2).
  The ring runs on across a program's tiles: the next tile's first blocks
  load while the last ones are multiplied.

Causal programs mask only the blocks that cross their rows' diagonal. The
softmax is in base 2 with the max of the raw logits scaled once per row
(``s * scale - m`` is one FMA), which needs ``sm_scale > 0``. Each tile also
writes the natural log-sum-exp of its rows (the backward's residual).

H200, B4 H32 S4096 D128 bf16 (benchmarks/gluon_attention.py, torch's cuDNN
SDPA in the same process): 598.6 TFLOP/s non-causal on 132 persistent
programs (0.996x cuDNN; 566.7 with a program per tile), 495.4 causal with a
program per tile (0.942x; 530.4, 0.998x, persistent in snake order, in
another run); 482.8 / 440.3 without the ping-pong and 465.7 / 420.0 without
warp specialization. Through ``mha`` and ``jax.jit``
(benchmarks/gpu_attention.py): 613.9 (1.037x cuDNN) non-causal and 537.0
(1.036x) causal, persistent in snake order.
"""

# Gluon makes a name a constexpr by its annotation, in each branch that assigns it
# (``mha_forward_sm90``'s EB, KI, KW): the second annotation is not a redefinition.
# mypy: disable-error-code="no-redef"

from __future__ import annotations

import jax_kernel_runtime

# Importing pallas_gpu starts importing Triton in a background thread: importing
# Triton's Gluon here at the same time can meet a half-initialized triton package.
jax_kernel_runtime.prepare_triton()

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia import hopper  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402

# Gluon's names in Triton 3.6 and in later releases (which removed the old ones).
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def softmax_block(s, m, l, qk_scale):
    """P (unnormalized, base 2), the new max and sum, and the rescale of O."""
    m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return p, m_new, l * alpha + gl.sum(p, 1), alpha


@gluon.jit
def softmax_block_causal(s, m, l, qk_scale, q0, k0, BM: gl.constexpr, BN: gl.constexpr):
    """``softmax_block`` of a block that crosses the diagonal: key k0 + c is
    seen by query q0 + r only if k0 + c <= q0 + r. A row with no key in this
    block keeps the finite max of an earlier block (block 0 is never empty)."""
    rows = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s.type.layout))
    cols = k0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
    s = gl.where(rows[:, None] >= cols[None, :], s * qk_scale, -float("inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return p, m_new, l * alpha + gl.sum(p, 1), alpha


@gluon.jit
def softmax_any(s, m, l, qk_scale, q0, k0, CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    if CAUSAL:
        if k0 + BN > q0:
            p, m, l, alpha = softmax_block_causal(s, m, l, qk_scale, q0, k0, BM, BN)
        else:
            p, m, l, alpha = softmax_block(s, m, l, qk_scale)
    else:
        p, m, l, alpha = softmax_block(s, m, l, qk_scale)
    return p, m, l, alpha


@gluon.jit
def _tile(t, TILES: gl.constexpr, H: gl.constexpr, NQ: gl.constexpr, BM: gl.constexpr, GH: gl.constexpr):
    """Tile ``t`` (= pid + i * grid, the program's i-th): (batch, head, first
    query row). GH = 0: a head's query blocks are adjacent (its K/V stay in
    L2), the heaviest causal block first. GH > 0 (for persistent causal
    programs): heads in groups of GH, each group's tiles heaviest first, and
    the programs take them in snake order (program p the p-th tile of even
    rounds, the p-th from the end of odd ones), which evens out their sums of
    blocks."""
    if GH == 0:
        bh = t // NQ
        b, h, q0 = bh // H, bh % H, (NQ - 1 - t % NQ) * BM
    else:
        grid = gl.num_programs(0)
        base = (t // grid) * grid
        left = gl.minimum(grid, TILES - base)
        s = gl.where((t // grid) % 2 == 0, t, base + left - 1 - t % grid)
        r = s % (GH * NQ)
        bh = (s // (GH * NQ)) * GH + r % GH
        b, h, q0 = bh // H, bh % H, (NQ - 1 - r // GH) * BM
    return b, h, q0


@gluon.jit
def _v_operand(v_smem, slot, FP8: gl.constexpr):
    """The B operand of ``P @ V`` in ring slot ``slot``: fp8 slots hold V^T, whose permuted
    view is k-major (as fp8 wgmma reads its B)."""
    if FP8:
        return v_smem.index(slot).permute((1, 0))
    else:
        return v_smem.index(slot)


@gluon.jit
def _store_rows(O, LSE, o, m, l, sm_scale, b, h, row0, T: gl.constexpr, H: gl.constexpr, D: gl.constexpr,
                HM: gl.constexpr, FP8: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    """Stores rows ``row0`` to ``+ HM`` of a tile from registers: their log-sum-exp, and O
    divided by the softmax sums ``l`` (fp8: times the output's scale, ``sm_scale[1]``)."""
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = gl.arange(0, HM, layout=gl.SliceLayout(1, s_layout))
    gl.store(LSE + (b * H + h).to(gl.int64) * T + row0 + rows, (m + gl.log2(l)) * _LN2)
    if FP8:
        o = o * (gl.load(sm_scale + 1) / gl.convert_layout(l, o_rows))[:, None]
    else:
        o = o / gl.convert_layout(l, o_rows)[:, None]
    o_r = (b * T + row0 + gl.arange(0, HM, layout=o_rows)).to(gl.int64)
    o_c = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + (o_r[:, None] * H + h) * D + o_c[None, :], o.to(O.dtype.element_ty))


@gluon.jit
def _math_warpgroup(O, LSE, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, kv_empty, turn, sm_scale,
                    WG: gl.constexpr, T: gl.constexpr, S: gl.constexpr, H: gl.constexpr, D: gl.constexpr,
                    BN: gl.constexpr, NBUF: gl.constexpr, CAUSAL: gl.constexpr, TILES: gl.constexpr,
                    GH: gl.constexpr, FP8: gl.constexpr, KI: gl.constexpr, KW: gl.constexpr):  # fmt: skip
    """Rows ``q0 + 64 WG`` to ``+ 64`` of each of this program's tiles: every
    block's two wgmmas, issued in this warpgroup's turn, and its softmax; then
    O and the LSE, stored from registers (the Q slot is released for the next
    tile's Q as soon as the tile's last ``Q @ K^T`` is done). ``FP8``:
    ``sm_scale`` points at (the logits' scale, the output's scale) and the V
    slots hold V transposed (k-major, as fp8 wgmma reads its B)."""
    HM: gl.constexpr = 64
    BM: gl.constexpr = 128
    warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, BN, KI])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, D, KI])  # fmt: skip
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=KW)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    if FP8:
        qk_scale = gl.load(sm_scale) * _LOG2E
    else:
        qk_scale = sm_scale * _LOG2E
    zero_s = gl.zeros([HM, BN], gl.float32, s_layout)
    q_half = q_smem.index(WG)
    c = 0  # K/V blocks consumed so far: ring slot c % NBUF, phase (c // NBUF) & 1
    it = 0  # turns taken so far
    i = 0  # tiles done so far
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        b, h, q0 = _tile(t, TILES, H, T // BM, BM, GH)
        n = (q0 + BM) // BN if CAUSAL else S // BN
        row0 = q0 + WG * HM
        mbarrier.wait(q_bar.index(WG), i & 1)
        mbarrier.wait(k_bar.index(c % NBUF), (c // NBUF) & 1)
        mbarrier.wait(turn.index(WG), it & 1)
        s_tok = hopper.warpgroup_mma(q_half, k_smem.index(c % NBUF).permute((1, 0)), zero_s, use_acc=False,
                                     is_async=True)  # fmt: skip
        mbarrier.arrive(turn.index(1 - WG))
        it += 1
        s = hopper.warpgroup_mma_wait(0, deps=[s_tok])
        m = gl.full([HM], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l = gl.zeros([HM], gl.float32, gl.SliceLayout(1, s_layout))
        p, m, l, alpha = softmax_any(s, m, l, qk_scale, row0, 0, CAUSAL, HM, BN)
        o = gl.zeros([HM, D], gl.float32, o_layout)
        for j in range(n - 1):
            slot = c % NBUF
            nxt = (c + 1) % NBUF
            mbarrier.wait(k_bar.index(nxt), ((c + 1) // NBUF) & 1)
            mbarrier.wait(v_bar.index(slot), (c // NBUF) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(turn.index(WG), it & 1)
            s_tok = hopper.warpgroup_mma(q_half, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False,
                                         is_async=True)  # fmt: skip
            o_tok = hopper.warpgroup_mma(p_op, _v_operand(v_smem, slot, FP8), o, is_async=True)
            mbarrier.arrive(turn.index(1 - WG))
            it += 1
            s = hopper.warpgroup_mma_wait(1, deps=[s_tok])  # S of block j+1 done; O += P V of block j runs on
            p, m, l, alpha = softmax_any(s, m, l, qk_scale, row0, (j + 1) * BN, CAUSAL, HM, BN)
            o = hopper.warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(kv_empty.index(slot))  # this warpgroup is done with block j's K and V
            o = o * gl.convert_layout(alpha, o_rows)[:, None]
            c += 1
        mbarrier.arrive(q_empty.index(WG))  # the tile's last Q @ K^T is done: its Q slot may be refilled
        slot = c % NBUF
        mbarrier.wait(v_bar.index(slot), (c // NBUF) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(turn.index(WG), it & 1)
        o_tok = hopper.warpgroup_mma(p_op, _v_operand(v_smem, slot, FP8), o, is_async=True)
        mbarrier.arrive(turn.index(1 - WG))
        it += 1
        o = hopper.warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(kv_empty.index(slot))
        c += 1
        i += 1
        _store_rows(O, LSE, o, m, l, sm_scale, b, h, row0, T, H, D, HM, FP8, s_layout, o_layout)


@gluon.jit
def _producer(qd, kd, vd, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, kv_empty, T: gl.constexpr,
              S: gl.constexpr, H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
              CAUSAL: gl.constexpr, TILES: gl.constexpr, GH: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
    """For each tile: Q's two halves once their slots are free, then every
    K/V block into its ring slot once both warpgroups have released the
    slot's previous block (the ring runs on across tiles)."""
    BM: gl.constexpr = 128
    c = 0
    i = 0
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        b, h, q0 = _tile(t, TILES, H, T // BM, BM, GH)
        n = (q0 + BM) // BN if CAUSAL else S // BN
        for w in gl.static_range(2):
            if i > 0:
                mbarrier.wait(q_empty.index(w), (i - 1) & 1)
            mbarrier.expect(q_bar.index(w), qd.block_type.nbytes)
            _tma_load(qd, [b * T + q0 + 64 * w, h * D], q_bar.index(w), q_smem.index(w))
        for blk in range(n):
            slot = c % NBUF
            if c >= NBUF:
                mbarrier.wait(kv_empty.index(slot), ((c // NBUF) - 1) & 1)
            mbarrier.expect(k_bar.index(slot), kd.block_type.nbytes)
            _tma_load(kd, [b * S + blk * BN, h * D], k_bar.index(slot), k_smem.index(slot))
            mbarrier.expect(v_bar.index(slot), vd.block_type.nbytes)
            if FP8:  # V transposed: [B * H * D, S]
                _tma_load(vd, [(b * H + h) * D, blk * BN], v_bar.index(slot), v_smem.index(slot))
            else:
                _tma_load(vd, [b * S + blk * BN, h * D], v_bar.index(slot), v_smem.index(slot))
            c += 1
        i += 1


@gluon.jit
def mha_forward_sm90(Q, K, V, O, LSE, sm_scale, B: gl.constexpr, T: gl.constexpr, S: gl.constexpr,
                     H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
                     CAUSAL: gl.constexpr, GH: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
    """Q, O: [B, T, H, D]; K, V: [B, S, H, D] (bf16 or f16); LSE: [B, H, T]
    f32. Tiles of 128 query rows, B * H * T // 128 of them; any grid: each
    program takes tiles pid, pid + grid, ... (one each when the grid is the
    tile count, persistent when smaller). Launched with 4 warps (the first
    math warpgroup; the other partitions add 5, padded to 12). T % 128 == 0
    and S % BN == 0.

    ``FP8``: Q, K and V are e4m3 with V transposed to [B, H, D, S] (D 128),
    ``sm_scale`` points at two f32 (the logits' scale ``sm_scale * q_scale *
    k_scale``, the output's ``v_scale``) and O is 16-bit."""
    BM: gl.constexpr = 128
    TILES: gl.constexpr = B * H * (T // BM)
    if FP8:
        EB: gl.constexpr = 8
        KI: gl.constexpr = 32
        KW: gl.constexpr = 4
    else:
        EB: gl.constexpr = 16
        KI: gl.constexpr = 16
        KW: gl.constexpr = 2
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=EB, rank=2)
    dtype: gl.constexpr = Q.dtype.element_ty
    # [B * T, H * D] and [B * S, H * D] views: one descriptor each for every tile.
    qd = tma.make_tensor_descriptor(
        Q, shape=[B * T, H * D], strides=[H * D, 1], block_shape=[64, D], layout=tile
    )
    kd = tma.make_tensor_descriptor(
        K, shape=[B * S, H * D], strides=[H * D, 1], block_shape=[BN, D], layout=tile
    )
    if FP8:  # V transposed: [B * H * D, S]
        vd = tma.make_tensor_descriptor(
            V, shape=[B * H * D, S], strides=[S, 1], block_shape=[D, BN], layout=tile
        )
    else:
        vd = tma.make_tensor_descriptor(
            V, shape=[B * S, H * D], strides=[H * D, 1], block_shape=[BN, D], layout=tile
        )
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, D], tile)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, BN, D], tile)
    if FP8:
        v_smem = gl.allocate_shared_memory(dtype, [NBUF, D, BN], tile)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [NBUF, BN, D], tile)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    _cta_barrier()  # every thread sees the barriers initialized
    mbarrier.arrive(turn.index(0))  # warpgroup 0 issues first
    # fmt: off
    gl.warp_specialize(
        [
            (_math_warpgroup, (O, LSE, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, kv_empty, turn, sm_scale,
                               0, T, S, H, D, BN, NBUF, CAUSAL, TILES, GH, FP8, KI, KW)),
            (_math_warpgroup, (O, LSE, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, kv_empty, turn, sm_scale,
                               1, T, S, H, D, BN, NBUF, CAUSAL, TILES, GH, FP8, KI, KW)),
            (_producer, (qd, kd, vd, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, kv_empty, T, S, H, D, BN,
                         NBUF, CAUSAL, TILES, GH, FP8)),
        ],
        worker_num_warps=[4, 1],
        worker_num_regs=[240, 24],
    )
    # fmt: on
