"""A flash-attention forward for Hopper written in Gluon (Triton 3.6's
``triton.experimental.gluon``), to measure whether the schedule plain Triton
cannot express closes the gap to cuDNN (issue 13, item 1). GPU, needs torch.

Plain Triton waits for every ``Q @ K^T`` wgmma before its softmax (its
software pipeliner emits ``warp_group_dot_wait 0``), so the exponentials
never overlap the tensor cores: ``ops.attention``'s forward runs its tensor
pipe 53 % busy against cuDNN's 75 % (``results/ncu_attention_fwd.txt``).
Here the schedule is written by hand, one iteration per K/V block j:

    issue S[j+1] = Q @ K[j+1]^T          (async wgmma)
    softmax of S[j] -> P[j], alpha       (CUDA cores, while S[j+1] runs)
    wait for O += P[j-1] @ V[j-1]        (wgmma_wait: 1 left in flight, S[j+1])
    refill the K/V slot of block j-1 with block j-1+NBUF (TMA, after a CTA barrier)
    O = O * alpha; issue O += P[j] @ V[j] (async wgmma)
    wait for S[j+1]                      (1 left in flight: O)

K and V blocks stream through an ``NBUF``-deep ring of shared-memory slots
filled by TMA, one mbarrier per slot and operand; Q and O go through one
shared tile. One program per 128-row Q block, 8 warps (two warpgroups of
64 rows), no warp specialization, no persistence. Causal programs mask only
the blocks that cross the diagonal (a branch per block).

    python benchmarks/gluon_attention.py             # GPU: check against torch's cuDNN SDPA, time both
    python benchmarks/gluon_attention.py --config=0  # only CONFIGS[0] (one process per config: a hang stays local)
    python benchmarks/gluon_attention.py --compile   # no GPU: compile for sm_90, print registers and spills
"""

from __future__ import annotations

import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

CONFIGS = [(128, 128, 3), (128, 64, 4), (128, 64, 6)]  # block_m, block_n, NBUF


@gluon.jit
def _load_kv(kd, vd, k_smem, v_smem, k_bar, v_bar, block, BN: gl.constexpr, NBUF: gl.constexpr):
    slot = block % NBUF
    mbarrier.expect(k_bar.index(slot), kd.block_type.nbytes)
    tma.async_copy_global_to_shared(kd, [block * BN, 0], k_bar.index(slot), k_smem.index(slot))
    mbarrier.expect(v_bar.index(slot), vd.block_type.nbytes)
    tma.async_copy_global_to_shared(vd, [block * BN, 0], v_bar.index(slot), v_smem.index(slot))


@gluon.jit
def _softmax(s, m, l, qk_scale):
    """P (unnormalized, base 2), the new max and sum, and the rescale of O;
    the max of the raw logits is scaled once per row (``s * scale - m`` is
    one FMA), which needs ``qk_scale > 0``."""
    m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return p, m_new, l * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _softmax_causal(s, m, l, qk_scale, q0, k0, BM: gl.constexpr, BN: gl.constexpr):
    """``_softmax`` of a block that crosses the diagonal: key k0 + c is seen by
    query q0 + r only if k0 + c <= q0 + r. A row with no key in this block
    (block_n < block_m) keeps the finite max of an earlier block."""
    rows = q0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s.type.layout))
    cols = k0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
    s = gl.where(rows[:, None] >= cols[None, :], s * qk_scale, -float("inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return p, m_new, l * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _block_softmax(s, m, l, qk_scale, q0, k0, CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    if CAUSAL:
        if k0 + BN > q0:
            p, m, l, alpha = _softmax_causal(s, m, l, qk_scale, q0, k0, BM, BN)
        else:
            p, m, l, alpha = _softmax(s, m, l, qk_scale)
    else:
        p, m, l, alpha = _softmax(s, m, l, qk_scale)
    return p, m, l, alpha


@gluon.jit
def attention_forward(Q, K, V, O, sm_scale, S, H: gl.constexpr, D: gl.constexpr, BM: gl.constexpr,
                      BN: gl.constexpr, NBUF: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """Q, K, V, O: [B, S, H, D] bf16; grid (B * H * S // BM,); S a multiple of BM and BM of BN.
    Causal: a query block walks the key blocks up to its diagonal, heaviest programs first."""
    gl.static_assert(NBUF >= 3, "a slot is refilled while the next two blocks' slots are in use")
    warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    nq = S // BM
    pid = gl.program_id(0)
    qi = nq - 1 - pid % nq
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
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()  # every thread sees the barriers initialized

    q0 = qi * BM
    n = (q0 + BM) // BN if CAUSAL else S // BN
    mbarrier.expect(q_bar.index(0), qd.block_type.nbytes)
    tma.async_copy_global_to_shared(qd, [q0, 0], q_bar.index(0), q_smem)
    for i in gl.static_range(NBUF):
        if i < n:
            _load_kv(kd, vd, k_smem, v_smem, k_bar, v_bar, i, BN, NBUF)

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
    acc = hopper.warpgroup_mma_init(gl.zeros([BM, D], gl.float32, o_layout))

    for j in range(n - 1):
        slot = j % NBUF
        nxt = (j + 1) % NBUF
        mbarrier.wait(k_bar.index(nxt), ((j + 1) // NBUF) & 1)
        s_tok = hopper.warpgroup_mma(
            q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True
        )
        p, m, l, alpha = _block_softmax(s, m, l, qk_scale, q0, j * BN, CAUSAL, BM, BN)
        o = hopper.warpgroup_mma_wait(1, deps=[acc])  # O += P[j-1] V[j-1] done; S[j+1] may run
        if j >= 1:
            gl.thread_barrier()  # both warpgroups are past block j-1's slot
            if j - 1 + NBUF < n:
                _load_kv(kd, vd, k_smem, v_smem, k_bar, v_bar, j - 1 + NBUF, BN, NBUF)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_bar.index(slot), (j // NBUF) & 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = hopper.warpgroup_mma(p_op, v_smem.index(slot), o, is_async=True)
        s = hopper.warpgroup_mma_wait(1, deps=[s_tok])  # S[j+1] done; O may run

    last = n - 1
    p, m, l, alpha = _block_softmax(s, m, l, qk_scale, q0, last * BN, CAUSAL, BM, BN)
    o = hopper.warpgroup_mma_wait(0, deps=[acc])
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_bar.index(last % NBUF), (last // NBUF) & 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = hopper.warpgroup_mma(p_op, v_smem.index(last % NBUF), o, is_async=True)
    o = hopper.warpgroup_mma_wait(0, deps=[acc])

    o = o / gl.convert_layout(l, gl.SliceLayout(1, o_layout))[:, None]
    q_smem.store(o.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()  # the whole tile is in shared memory before one thread issues the store
    tma.async_copy_shared_to_global(od, [q0, 0], q_smem)
    tma.store_wait(0)
    mbarrier.invalidate(q_bar.index(0))
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))


def compile_only() -> None:
    """Compiles every config for sm_90 (no GPU) and prints registers, spills and shared memory."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "sm_scale": "fp32", "S": "i32"}
    for (bm, bn, nbuf), causal in [(c, causal) for causal in (False, True) for c in CONFIGS]:
        consts = {"H": 32, "D": 128, "BM": bm, "BN": bn, "NBUF": nbuf, "CAUSAL": causal}
        src = GluonASTSource(attention_forward, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 8})
        except Exception as e:  # noqa: BLE001
            print(f"causal={causal} {(bm, bn, nbuf)}: FAILED {type(e).__name__}: {str(e)[:2000]}")
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(k.asm["ptx"])
            f.flush()
            out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                 capture_output=True, text=True)  # fmt: skip
        regs = re.findall(r"Used (\d+) registers", out.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
        print(f"causal={causal} {(bm, bn, nbuf)}: shared {k.metadata.shared} B, registers {regs}, spill stores {spills} B, "
              f"wgmma waits {re.findall(r'wgmma.wait_group.sync.aligned (\d+)', k.asm['ptx'])[:8]}")  # fmt: skip


def main() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    B, S, H, D = 4, 4096, 32, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(
        f"attention forward bf16 B{B} S{S} H{H} D{D}; triton {triton.__version__}, {torch.cuda.get_device_name()}"
    )
    only = [int(a.split("=")[1]) for a in sys.argv if a.startswith("--config=")]
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
        for bm, bn, nbuf in [CONFIGS[i] for i in only] if only else CONFIGS:
            o = torch.empty_like(q)

            def go(o=o, bm=bm, bn=bn, nbuf=nbuf, causal=causal):
                grid = (B * H * (S // bm),)
                attention_forward[grid](q, k, v, o, D**-0.5, S, H, D, bm, bn, nbuf, causal, num_warps=8)
                return o

            try:
                err = (go().float() - ref).abs().max().item()
                ms = triton.testing.do_bench(go, warmup=50, rep=300)
            except Exception as e:  # noqa: BLE001
                print(f"causal={causal} {(bm, bn, nbuf)}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            tf = flops / ms * 1e-9
            print(f"causal={causal} {(bm, bn, nbuf)}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({tf / cudnn:.3f}x cuDNN), "
                  f"max error {err:.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    compile_only() if "--compile" in sys.argv else main()
