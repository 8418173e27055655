"""Triton 3.6's warp specialization on Hopper, measured on a plain Triton
flash-attention forward (GPU, needs torch): the evidence behind
``plgpu.CompilerParams(warp_specialize=True)`` being refused before sm_100,
and behind ``ops.attention``'s FMA form of the softmax.

Usage (GPU machine): ``python benchmarks/hopper_warp_specialize.py`` (attention),
``... --matmul`` (a persistent TMA bf16 matmul, its k loop specialized or not,
beside torch's cuBLAS).

B4 S4096 H32 D128 bf16, causal and not. Each row is one launch of the kernel
below, ``(block_m, block_n, warp_specialize, fma, num_warps, num_stages)``,
timed with ``triton.testing.do_bench`` beside torch's cuDNN SDPA, with its max
error against that output. ``fma``: the max of the raw logits scaled once per
row and ``s * scale - m`` as one FMA (Triton's tutorial form), else the
logits scaled first. Triton 3.6 specializes the loop on sm_90 only at 4 warps
(a producer warpgroup and two consumers splitting the rows); a causal
kernel is one loop with every block masked (a second loop, or a mask under
``if``, stops the specialization or its compilation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIGS = [  # block_m, block_n, warp_specialize, fma, num_warps, num_stages
    (128, 128, False, False, 8, 3),
    (128, 128, False, True, 8, 3),
    (128, 128, True, False, 4, 2),
    (128, 128, True, True, 4, 2),
    (128, 64, True, True, 4, 3),
    (128, 64, True, True, 4, 2),
    (128, 64, True, True, 4, 4),
    (256, 64, True, True, 4, 2),
    (64, 128, True, True, 4, 2),
]


@triton.jit
def _blocks(acc, l, m, q, kd, vd, lo, hi, row0, qk_scale, BM: tl.constexpr, BN: tl.constexpr,
            MASK: tl.constexpr, WS: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    for n in tl.range(lo, hi, BN, warp_specialize=WS):
        k = kd.load([n, 0])
        v = vd.load([n, 0])
        qk = tl.dot(q, k.T)
        if MASK:
            rows = row0 + tl.arange(0, BM)
            cols = n + tl.arange(0, BN)
            qk = qk * qk_scale + tl.where(rows[:, None] >= cols[None, :], 0.0, -1.0e6)
            m_new = tl.maximum(m, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        elif FMA:
            m_new = tl.maximum(m, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        else:
            qk = qk * qk_scale
            m_new = tl.maximum(m, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m = m_new
    return acc, l, m


@triton.jit
def attention_forward(Q, K, V, O, sm_scale, S, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr, FMA: tl.constexpr):  # fmt: skip
    """CAUSAL: 0 no mask; 1 unmasked blocks, then the diagonal masked (two
    loops); 2 one loop, every block masked."""
    nq = S // BM
    pid = tl.program_id(0)
    qi = nq - 1 - pid % nq
    bh = pid // nq
    base = (bh // H) * S * H * D + (bh % H) * D
    qd = tl.make_tensor_descriptor(Q + base, shape=[S, D], strides=[H * D, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K + base, shape=[S, D], strides=[H * D, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V + base, shape=[S, D], strides=[H * D, 1], block_shape=[BN, D])
    q = qd.load([qi * BM, 0])
    m = tl.full([BM], -float("inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    scale = sm_scale * 1.44269504
    row0 = qi * BM
    if CAUSAL == 2:
        acc, l, m = _blocks(acc, l, m, q, kd, vd, 0, row0 + BM, row0, scale, BM, BN, True, WS, FMA)
    elif CAUSAL == 1:
        acc, l, m = _blocks(acc, l, m, q, kd, vd, 0, row0, row0, scale, BM, BN, False, WS, FMA)
        acc, l, m = _blocks(acc, l, m, q, kd, vd, row0, row0 + BM, row0, scale, BM, BN, True, False, FMA)
    else:
        acc, l, m = _blocks(acc, l, m, q, kd, vd, 0, S, row0, scale, BM, BN, False, WS, FMA)
    od = tl.make_tensor_descriptor(O + base, shape=[S, D], strides=[H * D, 1], block_shape=[BM, D])
    od.store([row0, 0], (acc / l[:, None]).to(tl.bfloat16))


@triton.jit
def matmul_ws(A, B, C, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
              NUM_SMS: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """Persistent TMA matmul, tiles in groups of GROUP_M block rows. WS: 0 no
    warp specialization, 1 of the k loop, 2 of the tile loop (the outermost
    loop, which is what ``CompilerParams(warp_specialize=True)`` asks)."""
    ad = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    bd = tl.make_tensor_descriptor(B, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    cd = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, warp_specialize=WS == 2):
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pm = first_m + (tile % (GROUP_M * tiles_n)) % size_m
        pn = (tile % (GROUP_M * tiles_n)) // size_m
        acc = tl.zeros([BM, BN], tl.float32)
        for kk in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS == 1):
            acc = tl.dot(ad.load([pm * BM, kk * BK]), bd.load([kk * BK, pn * BN]), acc)
        cd.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


MATMUL_CONFIGS = [  # block_m, block_n, block_k, WS (0 none, 1 k loop, 2 tile loop), num_warps, num_stages
    (128, 256, 64, 0, 8, 3),
    (128, 256, 64, 1, 4, 3),
    (128, 256, 64, 2, 4, 3),
    (256, 128, 64, 1, 4, 3),
    (128, 128, 64, 1, 4, 4),
    (128, 128, 64, 2, 4, 4),
    (128, 128, 64, 1, 4, 6),
]


def matmul_main() -> None:
    """bf16 matmuls at the issue's sizes: each config beside torch's cuBLAS."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n, k in [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 1024)]:
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        flops = 2 * m * n * k
        ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300)
        cublas = flops / ms * 1e-9
        print(f"matmul {m}x{n}x{k}: cuBLAS (torch) {ms:.3f} ms, {cublas:.1f} TFLOP/s")
        for bm, bn, bk, ws, nw, st in MATMUL_CONFIGS:
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def go(c=c, bm=bm, bn=bn, bk=bk, ws=ws, nw=nw, st=st):
                matmul_ws[(sms,)](a, b, c, m, n, k, bm, bn, bk, 8, sms, ws, num_warps=nw, num_stages=st)
                return c

            cfg = (bm, bn, bk, ws, nw, st)
            try:
                err = ((go().float() - ref).abs().max() / ref.abs().max()).item()
                ms = triton.testing.do_bench(go, warmup=50, rep=300)
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            tf = flops / ms * 1e-9
            print(f"  {cfg}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({tf / cublas:.3f}x cuBLAS), max rel error {err:.4f}",
                  flush=True)  # fmt: skip


def run(q, k, v, causal_mode, bm, bn, ws, fma, num_warps, num_stages):
    B, S, H, D = q.shape
    o = torch.empty_like(q)
    attention_forward[(B * H * (S // bm),)](q, k, v, o, D**-0.5, S, H, D, bm, bn, causal_mode, ws, fma,
                                            num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    return o


def main() -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    B, S, H, D = 4, 4096, 32, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    print(
        f"attention forward bf16 B{B} S{S} H{H} D{D}; triton {triton.__version__}, {torch.cuda.get_device_name()}"
    )
    for causal in (False, True):
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
            ref = sdpa().transpose(1, 2).float()
            ms = triton.testing.do_bench(sdpa, warmup=50, rep=300)
        cudnn = flops / ms * 1e-9
        print(f"causal={causal} cuDNN (torch SDPA): {ms:.3f} ms, {cudnn:.1f} TFLOP/s")
        for cfg in CONFIGS:
            mode = (2 if cfg[2] else 1) if causal else 0
            try:
                err = (run(q, k, v, mode, *cfg).float() - ref).abs().max().item()
                ms = triton.testing.do_bench(lambda: run(q, k, v, mode, *cfg), warmup=50, rep=300)
            except Exception as e:  # noqa: BLE001  (a config that fails to compile is a finding)
                print(f"causal={causal} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            tf = flops / ms * 1e-9
            print(f"causal={causal} {cfg}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({tf / cudnn:.3f}x cuDNN), "
                  f"max error {err:.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    import sys

    if "--matmul" in sys.argv:
        matmul_main()
    else:
        main()
