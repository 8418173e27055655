"""A persistent ping-pong bf16 matmul for Hopper written in Gluon (Triton
3.6's ``triton.experimental.gluon``), to measure whether the schedule of
cuBLAS's kernel closes ``ops.matmul``'s gap to cuBLAS (issue 13, item 4:
0.96x at 8192^3, 0.86x at 8192 x 8192 x 1024, ``results/ncu_matmul.txt``).
GPU, needs torch.

Nsight Compute put the k = 1024 gap in the tile boundaries: with 16 k steps
per tile, a program fills its pipeline and stores its tile between tiles,
with the tensor cores idle, where cuBLAS's producer warp keeps loading and
its epilogue overlaps the other warpgroup's products. Here, as in the sm_90
attention forward (``pallas_gpu/ops/_attention_sm90_kernel.py``), which this
kernel copies the structure of:

* two math warpgroups (4 warps, 240 registers), each computing whole
  ``BM x BN`` tiles: warpgroup w takes this program's tiles 2i + w. They
  take turns running their k loops (``turn`` mbarriers): while one runs its
  wgmmas, the other stores its finished tile (registers -> shared -> TMA),
  so the tensor cores never wait for an epilogue (CUTLASS's "ping-pong");
* a one-warp producer (24 registers) that streams the A and B blocks of
  every k step of every tile, in the order the warpgroups consume them,
  through an ``NBUF``-deep ring of shared-memory slots by TMA; a slot is
  released by the warpgroup that read it once its wgmma is done (one wgmma
  in flight: ``warpgroup_mma_wait(1)``);
* one program per multiprocessor, tiles in grouped order (``GROUP_M`` rows
  of tiles share their B columns in L2).

A is [M, K], B is [K, N], C is [M, N], row-major bf16, f32 accumulation;
M % BM == N % BN == K % BK == 0 here (a benchmark, not the op).

    python benchmarks/gluon_matmul.py              # GPU: each config beside torch's cuBLAS, checked
    python benchmarks/gluon_matmul.py --config=0 --shape=2   # one config, one shape (a process each)
    python benchmarks/gluon_matmul.py --compile    # no GPU: compile for sm_90; registers, spills,
                                                   # shared memory, wgmma waits, setmaxnreg

Status (2026-12-02): compiled for sm_90 on the CPU only, not yet run on a
GPU (Triton's interpreter does not run Gluon).
"""

from __future__ import annotations

import sys

import triton

from pallas_gpu.ops._matmul_sm90_kernel import matmul_coop, matmul_pingpong

GROUP_M = 8
SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 1024), (1992, 3000, 1000)]  # the last: edge tiles
# kind "pp": ping-pong (each warpgroup its own tiles); "co": cooperative (both on each tile, 64 rows each).
CONFIGS = [
    ("pp", 128, 128, 64, 5),
    ("pp", 64, 256, 64, 4),
    ("pp", 64, 256, 64, 3),
    ("co", 128, 256, 64, 3),
    ("co", 128, 128, 64, 6),
]
KERNELS = {"pp": matmul_pingpong, "co": matmul_coop}


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
            KERNELS[kind], {"A": "*bf16", "B": "*bf16", "C": "*bf16"}, consts, 4, f"{kind} {(bm, bn, bk, nbuf)}"
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
