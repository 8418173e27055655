"""``ops.matmul``'s Hopper kernels (``pallas_gpu/ops/_matmul_sm90_kernel.py``,
written in Gluon) launched directly from torch over several tile shapes,
beside torch's cuBLAS, each checked against it. GPU, needs torch.

Nsight Compute put ``ops.matmul``'s k = 1024 gap (0.86x cuBLAS) in the tile
boundaries: with 16 k steps per tile, a program fills its pipeline and stores
its tile between tiles, with the tensor cores idle, where cuBLAS's producer
warp keeps loading and its epilogue overlaps the other warpgroup's products.
The kernels here have a one-warp TMA producer over a ring that runs on across
tiles, one program per multiprocessor in grouped order, and two math
warpgroups: ``pp`` (ping-pong) gives each whole tiles and has them take turns
so one's epilogue overlaps the other's wgmmas; ``co`` (cooperative) puts both
on each tile, 64 rows each.

    python benchmarks/gluon_matmul.py              # GPU: each config beside torch's cuBLAS, checked
    python benchmarks/gluon_matmul.py --config=0 --shape=2   # one config, one shape (a process each)
    python benchmarks/gluon_matmul.py --compile    # no GPU: compile for sm_90; registers, spills,
                                                   # shared memory, wgmma waits, setmaxnreg

H200, 2026-12-02 (benchmarks/README.md has every row): co 128x256x64/3
0.957x / 0.990x / 1.043x torch's cuBLAS at 8192^3 / 4096^3 / 8192x8192x1024,
pp 128x128x64/5 0.904x / 0.943x / 1.023x.
"""

from __future__ import annotations

import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from pallas_gpu.ops._matmul_sm90_kernel import _matmul, matmul_coop, matmul_pingpong

GROUP_M = 8
SHAPES = [
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (8192, 8192, 1024),
    (1992, 3000, 1000),
]  # the last: edge tiles
# kind "pp": ping-pong (each warpgroup its own tiles); "co": cooperative (both on each tile, 64 rows each).
CONFIGS = [
    ("pp", 128, 128, 64, 5),
    ("pp", 64, 256, 64, 4),
    ("pp", 64, 256, 64, 3),
    ("co", 128, 256, 64, 3),
    ("co", 128, 128, 64, 6),
    ("co-", 128, 256, 64, 3),
]


@gluon.jit
def matmul_coop_unstored(A, B, C, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr,
                         BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """``matmul_coop`` storing only each program's last tile (so the compiler
    keeps every wgmma): a timing diagnostic; its time beside "co"'s is what
    the other tiles' epilogues cost, their writes of C included."""
    _matmul(A, B, C, M, N, K, BM, BN, BK, NBUF, GROUP, True, False)


# "co-": "co" with most of C left unwritten (its error is reported, not a failure).
KERNELS = {"pp": matmul_pingpong, "co": matmul_coop, "co-": matmul_coop_unstored}


def _pick(argv, flag, items):
    chosen = [items[int(a.split("=")[1])] for a in argv if a.startswith(flag + "=")]
    return chosen or items


def compile_only(argv) -> None:
    """Compiles every config for sm_90 (no GPU): registers, spills, shared memory, waits."""
    from _gluon import compile_report

    M, N, K = SHAPES[0]
    for kind, bm, bn, bk, nbuf in _pick(argv, "--config", CONFIGS):
        consts = {"M": M, "N": N, "K": K, "BM": bm, "BN": bn, "BK": bk, "NBUF": nbuf, "GROUP": GROUP_M}
        compile_report(
            KERNELS[kind],
            {"A": "*bf16", "B": "*bf16", "C": "*bf16"},
            consts,
            4,
            f"{kind} {(bm, bn, bk, nbuf)}",
        )


def main(argv) -> None:
    import torch

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"matmul bf16, f32 accumulation; triton {triton.__version__}, {torch.cuda.get_device_name()}, {sms} SMs"
    )
    torch.manual_seed(0)
    for M, N, K in _pick(argv, "--shape", SHAPES):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.matmul(a, b)
        flops = 2 * M * N * K
        ms = triton.testing.do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300)  # noqa: B023
        cublas = flops / ms * 1e-9
        print(f"{M}x{N}x{K}: cuBLAS (torch) {ms:.3f} ms, {cublas:.1f} TFLOP/s")
        for kind, bm, bn, bk, nbuf in _pick(argv, "--config", CONFIGS):
            c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            grid = (min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)

            def go(c=c, kind=kind, bm=bm, bn=bn, bk=bk, nbuf=nbuf):
                KERNELS[kind][grid](a, b, c, M, N, K, bm, bn, bk, nbuf, GROUP_M, num_warps=4)  # noqa: B023
                return c

            label = f"  {kind} {(bm, bn, bk, nbuf)}"
            try:
                err = ((go().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                ms = triton.testing.do_bench(go, warmup=50, rep=300)
            except Exception as e:  # noqa: BLE001
                print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            tf = flops / ms * 1e-9
            print(f"{label}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({tf / cublas:.3f}x cuBLAS), max rel. error {err:.4f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    compile_only(sys.argv[1:]) if "--compile" in sys.argv else main(sys.argv[1:])
