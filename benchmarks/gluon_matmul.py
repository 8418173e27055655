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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

# (BM, BN, BK, NBUF): a 128 x BN f32 accumulator is BN registers per thread of a warpgroup, and
# the ring (NBUF x (BM + BN) x BK) plus two BM x BN output tiles must fit 227 KB of shared memory.
CONFIGS = [(128, 128, 64, 4), (128, 128, 64, 5), (128, 128, 128, 2)]
SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 1024)]
GROUP_M = 8


@gluon.jit
def _tile(t, M: gl.constexpr, N: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP: gl.constexpr):
    """Tile ``t`` in grouped order: (first row, first column)."""
    tiles_m: gl.constexpr = M // BM
    tiles_n: gl.constexpr = N // BN
    per_group = GROUP * tiles_n
    first_m = (t // per_group) * GROUP
    rows = gl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (t % per_group) % rows
    pid_n = (t % per_group) // rows
    return pid_m * BM, pid_n * BN


@gluon.jit
def _math_warpgroup(cd, a_smem, b_smem, c_smem, ready, empty, turn, WG: gl.constexpr, M: gl.constexpr,
                    N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                    NBUF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """Tiles 2i + WG of this program: the k loop in this warpgroup's turn,
    then the tile through ``c_smem`` (its own) to C by TMA while the other
    warpgroup runs its k loop."""
    warps: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
    KSTEPS: gl.constexpr = K // BK
    TILES: gl.constexpr = (M // BM) * (N // BN)
    G = gl.num_programs(0)
    i = 0
    for t in range(gl.program_id(0) + WG * G, TILES, 2 * G):
        m0, n0 = _tile(t, M, N, BM, BN, GROUP)
        c = (2 * i + WG) * KSTEPS  # ring position of this tile's first k step
        mbarrier.wait(turn.index(WG), i & 1)
        mbarrier.wait(ready.index(c % NBUF), (c // NBUF) & 1)
        acc = hopper.warpgroup_mma(a_smem.index(c % NBUF), b_smem.index(c % NBUF),
                                   gl.zeros([BM, BN], gl.float32, acc_layout), use_acc=False,
                                   is_async=True)  # fmt: skip
        acc = hopper.warpgroup_mma_wait(1, deps=[acc])  # stays in flight (one allowed): a tensor to carry
        for k in range(1, KSTEPS):
            slot = (c + k) % NBUF
            mbarrier.wait(ready.index(slot), ((c + k) // NBUF) & 1)
            acc = hopper.warpgroup_mma(a_smem.index(slot), b_smem.index(slot), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(1, deps=[acc])  # k step k-1 is done: release its slot
            mbarrier.arrive(empty.index((c + k - 1) % NBUF))
        mbarrier.arrive(turn.index(1 - WG))  # every wgmma of this tile is issued: the other's turn
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((c + KSTEPS - 1) % NBUF))
        tma.store_wait(0)  # this warpgroup's previous tile has left c_smem (the issuing thread waits;
        gl.thread_barrier()  # the others wait for it before overwriting the tile)
        c_smem.store(acc.to(cd.dtype))
        fence_async_shared()
        gl.thread_barrier()  # the whole tile is in shared memory before one thread issues the store
        tma.async_copy_shared_to_global(cd, [m0, n0], c_smem)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _producer(ad, bd, a_smem, b_smem, ready, empty, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr,
              GROUP: gl.constexpr):  # fmt: skip
    """Every k step of every tile of this program, in consumption order, into
    the ring slot its last reader has released."""
    KSTEPS: gl.constexpr = K // BK
    TILES: gl.constexpr = (M // BM) * (N // BN)
    c = 0
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        m0, n0 = _tile(t, M, N, BM, BN, GROUP)
        for k in range(KSTEPS):
            slot = c % NBUF
            if c >= NBUF:
                mbarrier.wait(empty.index(slot), ((c // NBUF) - 1) & 1)
            mbarrier.expect(ready.index(slot), ad.block_type.nbytes + bd.block_type.nbytes)
            tma.async_copy_global_to_shared(ad, [m0, k * BK], ready.index(slot), a_smem.index(slot))
            tma.async_copy_global_to_shared(bd, [k * BK, n0], ready.index(slot), b_smem.index(slot))
            c += 1


@gluon.jit
def matmul_pingpong(A, B, C, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """C = A @ B; any grid (persistent: one program per multiprocessor).
    Launched with 4 warps (the first math warpgroup; 12 with the others)."""
    dtype: gl.constexpr = A.dtype.element_ty
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ad = tma.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK], layout=tile)
    bd = tma.make_tensor_descriptor(B, shape=[K, N], strides=[N, 1], block_shape=[BK, BN], layout=tile)
    cd = tma.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BM, BN], layout=tile)
    a_smem = gl.allocate_shared_memory(dtype, [NBUF, BM, BK], tile)
    b_smem = gl.allocate_shared_memory(dtype, [NBUF, BK, BN], tile)
    c0_smem = gl.allocate_shared_memory(dtype, [BM, BN], tile)
    c1_smem = gl.allocate_shared_memory(dtype, [BM, BN], tile)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(turn.index(0))  # warpgroup 0 runs its k loop first
    # fmt: off
    gl.warp_specialize(
        [
            (_math_warpgroup, (cd, a_smem, b_smem, c0_smem, ready, empty, turn, 0, M, N, K, BM, BN, BK, NBUF, GROUP)),
            (_math_warpgroup, (cd, a_smem, b_smem, c1_smem, ready, empty, turn, 1, M, N, K, BM, BN, BK, NBUF, GROUP)),
            (_producer, (ad, bd, a_smem, b_smem, ready, empty, M, N, K, BM, BN, BK, NBUF, GROUP)),
        ],
        worker_num_warps=[4, 1],
        worker_num_regs=[240, 24],
    )
    # fmt: on


def _pick(argv, flag, items):
    chosen = [items[int(a.split("=")[1])] for a in argv if a.startswith(flag + "=")]
    return chosen or items


def compile_only(argv) -> None:
    """Compiles every config for sm_90 (no GPU): registers, spills, shared memory, waits."""
    from _gluon import compile_report

    M, N, K = SHAPES[0]
    for bm, bn, bk, nbuf in _pick(argv, "--config", CONFIGS):
        consts = {"M": M, "N": N, "K": K, "BM": bm, "BN": bn, "BK": bk, "NBUF": nbuf, "GROUP": GROUP_M}
        compile_report(
            matmul_pingpong, {"A": "*bf16", "B": "*bf16", "C": "*bf16"}, consts, 4, f"{(bm, bn, bk, nbuf)}"
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
        for bm, bn, bk, nbuf in _pick(argv, "--config", CONFIGS):
            c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            grid = (min(sms, (M // bm) * (N // bn)),)

            def go(c=c, bm=bm, bn=bn, bk=bk, nbuf=nbuf):
                matmul_pingpong[grid](a, b, c, M, N, K, bm, bn, bk, nbuf, GROUP_M, num_warps=4)  # noqa: B023
                return c

            label = f"  {(bm, bn, bk, nbuf)}"
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
