"""A flash-attention forward for Hopper written in Gluon (Triton 3.6's
``triton.experimental.gluon``), to measure whether the schedule plain Triton
cannot express closes the gap to cuDNN (issue 13, item 1). GPU, needs torch.

Plain Triton waits for every ``Q @ K^T`` wgmma before its softmax (its
software pipeliner emits ``warp_group_dot_wait 0``), so the exponentials
never overlap the tensor cores: ``ops.attention``'s forward runs its tensor
pipe 53 % busy against cuDNN's 75 % (``results/ncu_attention_fwd.txt``).
Here the schedule is written by hand (FlashAttention-3's intra-warpgroup
overlap), one iteration per K/V block j, with P[j] and the rescaled O ready:

    issue S[j+1] = Q @ K[j+1]^T            (async wgmma)
    issue O += P[j] @ V[j]                 (async wgmma)
    wait for S[j+1]                        (wgmma_wait 1: O runs on)
    softmax of S[j+1] -> P[j+1], alpha     (CUDA cores, while O += P[j] V[j] runs)
    wait for O; release block j's K/V slot; O *= alpha

No wgmma stays in flight across the loop's back edge: when O's did (the
softmax of S[j] overlapping S[j+1], O waited a step later), ptxas serialized
every wgmma ("C7514: wgmma.mma_async instructions are serialized due to non
wgmma instructions reading accumulator registers"), which ``--compile``
reports. K and V blocks stream through an ``NBUF``-deep ring of shared-memory
slots filled by TMA, one mbarrier per slot and operand; Q and O go through
one shared tile. One program per 128-row Q block, not persistent. Three
kernels:

* ``plain``: 8 math warps (two warpgroups of 64 rows in lockstep); one of
  their threads issues the loads and refills a slot after a CTA barrier;
* ``ws``: the same warps, warp-specialized: a one-warp producer partition
  (24 registers) fills the slots and waits on a per-slot "empty" mbarrier
  that the math warps (240 registers) arrive on;
* ``pp``: ``mha``'s sm_90 forward (``pallas_gpu.ops._attention_sm90_kernel``):
  ``ws`` with the two math warpgroups as partitions of their own that take
  turns issuing their wgmmas (FlashAttention-3's ping-pong), so one's softmax
  overlaps the other's products.

Causal programs mask only the blocks that cross the diagonal (a branch per
block). H200, B4 S4096 H32 D128, torch's cuDNN SDPA in the same process,
non-causal / causal TFLOP/s at (128, 128, 3), 2026-12-02: plain 465.7 /
420.0, ws 482.8 / 440.3; pp's first form (per-head descriptors, O stored by
TMA) 572.9 / 500.1 (0.947x / 0.958x cuDNN; 506.3 / 392.5 at 2 slots); the
committed pp 566.7 / 495.4, ppp 598.6 / 494.7 (0.996x / 0.945x cuDNN).

    python benchmarks/gluon_attention.py             # GPU: check against torch's cuDNN SDPA, time both
    python benchmarks/gluon_attention.py --kernel=ws --config=0   # one launch (a process each: a hang stays local)
    python benchmarks/gluon_attention.py --kernel=ppp --seq=1024  # seq 1024 at 16384 tokens (batch 16)
    python benchmarks/gluon_attention.py --compile   # no GPU: compile for sm_90; registers, spills, wgmma waits,
                                                     # setmaxnreg, and whether ptxas serialized the wgmmas
"""

from __future__ import annotations

import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from pallas_gpu.ops._attention_sm90 import head_group
from pallas_gpu.ops._attention_sm90_kernel import mha_forward_sm90, softmax_any

CONFIGS = [(128, 128, 2), (128, 128, 3), (128, 64, 4), (128, 64, 6)]  # block_m, block_n, NBUF


@gluon.jit
def load_kv(kd, vd, k_smem, v_smem, k_bar, v_bar, block, row0, BN: gl.constexpr, NBUF: gl.constexpr):
    """K and V block ``block`` (rows ``row0 + block * BN``) into ring slot ``block % NBUF``."""
    slot = block % NBUF
    mbarrier.expect(k_bar.index(slot), kd.block_type.nbytes)
    tma.async_copy_global_to_shared(kd, [row0 + block * BN, 0], k_bar.index(slot), k_smem.index(slot))
    mbarrier.expect(v_bar.index(slot), vd.block_type.nbytes)
    tma.async_copy_global_to_shared(vd, [row0 + block * BN, 0], v_bar.index(slot), v_smem.index(slot))


@gluon.jit
def _consume(od, kd, vd, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_empty, sm_scale, q0, n, D: gl.constexpr,
             BM: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, CAUSAL: gl.constexpr,
             PRODUCER: gl.constexpr):  # fmt: skip
    """The math warps: every block's two wgmmas and softmax, then O through
    shared memory by TMA. PRODUCER: a producer partition fills the K/V slots
    and waits for their release on ``kv_empty``; else these warps refill each
    slot themselves once both warpgroups are done with it."""
    warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, BN, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                       instr_shape=[16, D, 16])  # fmt: skip
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    qk_scale = sm_scale * 1.4426950408889634
    zero_s = gl.zeros([BM, BN], gl.float32, s_layout)

    mbarrier.wait(q_bar.index(0), 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok = hopper.warpgroup_mma(
        q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True
    )
    s = hopper.warpgroup_mma_wait(0, deps=[s_tok])
    m = gl.full([BM], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    p, m, l, alpha = softmax_any(s, m, l, qk_scale, q0, 0, CAUSAL, BM, BN)
    o = gl.zeros([BM, D], gl.float32, o_layout)
    for j in range(n - 1):
        slot = j % NBUF
        nxt = (j + 1) % NBUF
        mbarrier.wait(k_bar.index(nxt), ((j + 1) // NBUF) & 1)
        s_tok = hopper.warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False,
                                     is_async=True)  # fmt: skip
        mbarrier.wait(v_bar.index(slot), (j // NBUF) & 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        o_tok = hopper.warpgroup_mma(p_op, v_smem.index(slot), o, is_async=True)
        s = hopper.warpgroup_mma_wait(1, deps=[s_tok])  # S[j+1] done; O += P[j] V[j] runs on
        p, m, l, alpha = softmax_any(s, m, l, qk_scale, q0, (j + 1) * BN, CAUSAL, BM, BN)
        o = hopper.warpgroup_mma_wait(0, deps=[o_tok])
        if PRODUCER:
            mbarrier.arrive(kv_empty.index(slot))  # block j's K and V are read
        else:
            gl.thread_barrier()  # both warpgroups are done with block j's slot
            if j + NBUF < n:
                load_kv(kd, vd, k_smem, v_smem, k_bar, v_bar, j + NBUF, 0, BN, NBUF)
        o = o * gl.convert_layout(alpha, o_rows)[:, None]
    last = n - 1
    mbarrier.wait(v_bar.index(last % NBUF), (last // NBUF) & 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    o_tok = hopper.warpgroup_mma(p_op, v_smem.index(last % NBUF), o, is_async=True)
    o = hopper.warpgroup_mma_wait(0, deps=[o_tok])

    o = o / gl.convert_layout(l, o_rows)[:, None]
    q_smem.store(o.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()  # the whole tile is in shared memory before one thread issues the store
    tma.async_copy_shared_to_global(od, [q0, 0], q_smem)
    tma.store_wait(0)


@gluon.jit
def _setup(Q, K, V, O, S, H: gl.constexpr, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
           NBUF: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """This program's Q block (heaviest causal blocks first), its TMA
    descriptors, the shared tiles and the initialized barriers."""
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    nq = S // BM
    pid = gl.program_id(0)
    q0 = (nq - 1 - pid % nq) * BM
    bh = pid // nq
    base = (bh // H).to(gl.int64) * S * H * D + (bh % H) * D
    qd = tma.make_tensor_descriptor(
        Q + base, shape=[S, D], strides=[H * D, 1], block_shape=[BM, D], layout=tile
    )
    kd = tma.make_tensor_descriptor(
        K + base, shape=[S, D], strides=[H * D, 1], block_shape=[BN, D], layout=tile
    )
    vd = tma.make_tensor_descriptor(
        V + base, shape=[S, D], strides=[H * D, 1], block_shape=[BN, D], layout=tile
    )
    od = tma.make_tensor_descriptor(
        O + base, shape=[S, D], strides=[H * D, 1], block_shape=[BM, D], layout=tile
    )
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D], tile)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, D], tile)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, D], tile)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()  # every thread sees the barriers initialized
    n = (q0 + BM) // BN if CAUSAL else S // BN
    return qd, kd, vd, od, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_empty, q0, n


@gluon.jit
def attention_forward(Q, K, V, O, sm_scale, S, H: gl.constexpr, D: gl.constexpr, BM: gl.constexpr,
                      BN: gl.constexpr, NBUF: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """Q, K, V, O: [B, S, H, D] bf16; grid (B * H * S // BM,); S a multiple of BM and BM of BN.
    Every warp computes; one thread of them issues the TMA loads."""
    gl.static_assert(NBUF >= 2, "a slot is refilled while the next block's slot is in use")
    qd, kd, vd, od, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_empty, q0, n = _setup(
        Q, K, V, O, S, H, D, BM, BN, NBUF, CAUSAL
    )
    mbarrier.expect(q_bar.index(0), qd.block_type.nbytes)
    tma.async_copy_global_to_shared(qd, [q0, 0], q_bar.index(0), q_smem)
    for i in gl.static_range(NBUF):
        if i < n:
            load_kv(kd, vd, k_smem, v_smem, k_bar, v_bar, i, 0, BN, NBUF)
    _consume(od, kd, vd, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_empty, sm_scale, q0, n, D, BM, BN, NBUF,
             CAUSAL, False)  # fmt: skip


@gluon.jit
def _produce(qd, kd, vd, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_empty, q0, n, BN: gl.constexpr,
             NBUF: gl.constexpr):  # fmt: skip
    """The producer warp: Q once, then every K/V block into its ring slot once
    the math warps have released the slot's previous block."""
    mbarrier.expect(q_bar.index(0), qd.block_type.nbytes)
    tma.async_copy_global_to_shared(qd, [q0, 0], q_bar.index(0), q_smem)
    for b in range(n):
        if b >= NBUF:
            mbarrier.wait(kv_empty.index(b % NBUF), ((b // NBUF) - 1) & 1)
        load_kv(kd, vd, k_smem, v_smem, k_bar, v_bar, b, 0, BN, NBUF)


@gluon.jit
def attention_forward_ws(Q, K, V, O, sm_scale, S, H: gl.constexpr, D: gl.constexpr, BM: gl.constexpr,
                         BN: gl.constexpr, NBUF: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """``attention_forward`` warp-specialized: a one-warp producer partition
    issues every TMA load; the kernel's warps (the default partition) only
    wait, multiply and exponentiate (the form of cuDNN's kernel: one
    producer, two consumer warpgroups; here not persistent, no ping-pong)."""
    qd, kd, vd, od, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_empty, q0, n = _setup(
        Q, K, V, O, S, H, D, BM, BN, NBUF, CAUSAL
    )
    gl.warp_specialize(
        [
            (
                _consume,
                (
                    od,
                    kd,
                    vd,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bar,
                    k_bar,
                    v_bar,
                    kv_empty,
                    sm_scale,
                    q0,
                    n,
                    D,
                    BM,
                    BN,
                    NBUF,
                    CAUSAL,
                    True,
                ),
            ),  # fmt: skip
            (_produce, (qd, kd, vd, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_empty, q0, n, BN, NBUF)),
        ],
        worker_num_warps=[1],
        worker_num_regs=[24],
    )


KERNELS = {
    "plain": attention_forward,
    "ws": attention_forward_ws,
    "pp": mha_forward_sm90,
    "ppp": mha_forward_sm90,
    "pps": mha_forward_sm90,
}
NUM_WARPS = {"plain": 8, "ws": 8, "pp": 4, "ppp": 4, "pps": 4}  # pp: the first math warpgroup
PACKAGE = (
    "pp",
    "ppp",
    "pps",
)  # the package's kernel: a program per tile, persistent, persistent in snake order


def _launches(argv):
    """(kernel name, (block_m, block_n, NBUF)) pairs asked on the command line
    (``--kernel=plain|ws|pp``, ``--config=i``), every pair by default."""
    kernels = [a.split("=")[1] for a in argv if a.startswith("--kernel=")] or list(KERNELS)
    configs = [CONFIGS[int(a.split("=")[1])] for a in argv if a.startswith("--config=")] or CONFIGS
    return [(k, c) for k in kernels for c in configs]


def compile_only(argv) -> None:
    """Compiles every launch for sm_90 (no GPU) and prints registers, spills and shared memory."""
    from _gluon import compile_report

    for causal in (False, True):
        for name, (bm, bn, nbuf) in _launches(argv):
            sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "sm_scale": "fp32", "S": "i32"}
            consts = {"H": 32, "D": 128, "BM": bm, "BN": bn, "NBUF": nbuf, "CAUSAL": causal}
            if name in PACKAGE:  # the package's kernel: also the LSE, static sizes, block_m 128
                sig = {**sig, "LSE": "*fp32"}
                del sig["S"], consts["BM"]
                consts = {
                    **consts,
                    "B": 4,
                    "T": 4096,
                    "S": 4096,
                    "GH": head_group(128, 32, 132) if name == "pps" else 0,
                }
            compile_report(
                KERNELS[name], sig, consts, NUM_WARPS[name], f"{name} causal={causal} {(bm, bn, nbuf)}"
            )


def main(argv) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    S = next((int(a.split("=")[1]) for a in argv if a.startswith("--seq=")), 4096)
    B, H, D = max(1, 16384 // S), 32, 128  # 16384 tokens, as gpu_attention.py's sweep
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(
        f"attention forward bf16 B{B} S{S} H{H} D{D}; triton {triton.__version__}, {torch.cuda.get_device_name()}"
    )
    for causal in (False, True):
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa = lambda: F.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal
            )  # noqa: E731
            ref = sdpa().transpose(1, 2).float()
            ms = triton.testing.do_bench(sdpa, warmup=50, rep=300)
        cudnn = flops / ms * 1e-9
        print(f"causal={causal} cuDNN (torch SDPA): {ms:.3f} ms, {cudnn:.1f} TFLOP/s")
        for name, (bm, bn, nbuf) in _launches(argv):
            o = torch.empty_like(q)
            lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)

            def go(o=o, lse=lse, name=name, bm=bm, bn=bn, nbuf=nbuf, causal=causal):
                grid = (B * H * (S // bm),)
                if name in PACKAGE:
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    gh = head_group(B * H, S // bm, sms) if name == "pps" else 0
                    grid = grid if name == "pp" else (min(grid[0], sms),)
                    KERNELS[name][grid](
                        q, k, v, o, lse, D**-0.5, B, S, S, H, D, bn, nbuf, causal, gh, num_warps=4
                    )
                else:
                    KERNELS[name][grid](q, k, v, o, D**-0.5, S, H, D, bm, bn, nbuf, causal, num_warps=8)
                return o

            label = f"{name} causal={causal} {(bm, bn, nbuf)}"
            try:
                err = (go().float() - ref).abs().max().item()
                ms = triton.testing.do_bench(go, warmup=50, rep=300)
            except Exception as e:  # noqa: BLE001
                print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            tf = flops / ms * 1e-9
            print(
                f"{label}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({tf / cudnn:.3f}x cuDNN), max error {err:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    compile_only(sys.argv[1:]) if "--compile" in sys.argv else main(sys.argv[1:])
