"""The Hopper (sm_90) kernels of ``ops.matmul`` for 16-bit inputs, written in
Gluon (``triton.experimental.gluon``): the schedules of cuBLAS's Hopper
kernels, which plain Triton cannot express. Imported only when that path is
taken: it imports Triton.

``C = A @ B`` with A ``[M, K]``, B ``[K, N]`` and C ``[M, N]`` row-major, one
16-bit dtype, f32 accumulation. Persistent: a program takes tiles pid,
pid + grid, ... in grouped order (``GROUP`` block rows share their B columns
in L2). Any M, N, K whose rows are 16-byte aligned (K % 8 == N % 8 == 0):
TMA fills the loads past an edge with zeros and clips the stores. 12 warps in
three partitions (``gl.warp_specialize``):

* a one-warp producer (24 registers) that streams the A and B blocks of every
  k step of every tile of the program, in the order they are consumed,
  through an ``NBUF``-deep ring of shared-memory slots by TMA (one
  mbarrier per slot that the loads complete, one the readers release);
* two math warpgroups (4 warps, 240 registers), one wgmma in flight each,
  releasing a slot when the wgmma after the one that read it is issued.
  ``matmul_pingpong``: each warpgroup computes whole ``BM x BN`` tiles (its
  tiles are the program's 2i + w) and they take turns running their k loops
  (the ``turn`` mbarriers), so one's epilogue (registers -> shared -> TMA
  store) overlaps the other's wgmmas (CUTLASS's "ping-pong").
  ``matmul_coop``: both work on each tile, 64 rows each (CUTLASS's
  "cooperative"): larger tiles (128 x 256) read fewer bytes of shared memory
  per product, but the tensor cores wait during the epilogue.
"""

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
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _tile(t, M: gl.constexpr, N: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP: gl.constexpr):
    """Tile ``t`` in grouped order: (first row, first column)."""
    tiles_m: gl.constexpr = (M + BM - 1) // BM
    tiles_n: gl.constexpr = (N + BN - 1) // BN
    per_group = GROUP * tiles_n
    first_m = (t // per_group) * GROUP
    rows = gl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (t % per_group) % rows
    pid_n = (t % per_group) // rows
    return pid_m * BM, pid_n * BN


@gluon.jit
def _k_loop(a_smem, b_smem, ready, empty, c, acc, HM: gl.constexpr, WG: gl.constexpr, KSTEPS: gl.constexpr,
            NBUF: gl.constexpr):  # fmt: skip
    """The k steps of one tile from ring position ``c`` on, rows ``WG * HM``
    to ``+ HM`` of each A slot; every slot is released once read, the last
    one after the final wait. Returns the accumulator (all wgmmas done)."""
    mbarrier.wait(ready.index(c % NBUF), (c // NBUF) & 1)
    acc = hopper.warpgroup_mma(a_smem.index(c % NBUF).slice(WG * HM, HM), b_smem.index(c % NBUF), acc,
                               use_acc=False, is_async=True)  # fmt: skip
    acc = hopper.warpgroup_mma_wait(1, deps=[acc])
    for k in range(1, KSTEPS):
        slot = (c + k) % NBUF
        mbarrier.wait(ready.index(slot), ((c + k) // NBUF) & 1)
        acc = hopper.warpgroup_mma(a_smem.index(slot).slice(WG * HM, HM), b_smem.index(slot), acc,
                                   is_async=True)  # fmt: skip
        acc = hopper.warpgroup_mma_wait(1, deps=[acc])  # k step k-1 is done: release its slot
        mbarrier.arrive(empty.index((c + k - 1) % NBUF))
    return acc


@gluon.jit
def _store_tile(cd, c_smem, acc, m0, n0):
    """The tile through this warpgroup's ``c_smem`` to C by TMA, once the
    previous tile's store has left ``c_smem``."""
    tma.store_wait(0)  # executed by the issuing thread only: the others wait for it at the barrier
    _cta_barrier()
    c_smem.store(acc.to(cd.dtype))
    fence_async_shared()
    _cta_barrier()  # the whole tile is in shared memory before one thread issues the store
    _tma_store(cd, [m0, n0], c_smem)


@gluon.jit
def _pingpong_warpgroup(cd, a_smem, b_smem, c_smem, ready, empty, turn, WG: gl.constexpr, M: gl.constexpr,
                        N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                        NBUF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """Tiles 2i + WG of this program: the k loop in this warpgroup's turn,
    then the tile to C while the other warpgroup runs its k loop."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
    KSTEPS: gl.constexpr = (K + BK - 1) // BK
    TILES: gl.constexpr = ((M + BM - 1) // BM) * ((N + BN - 1) // BN)
    G = gl.num_programs(0)
    i = 0
    for t in range(gl.program_id(0) + WG * G, TILES, 2 * G):
        m0, n0 = _tile(t, M, N, BM, BN, GROUP)
        c = (2 * i + WG) * KSTEPS  # ring position of this tile's first k step
        mbarrier.wait(turn.index(WG), i & 1)
        acc = _k_loop(a_smem, b_smem, ready, empty, c, gl.zeros([BM, BN], gl.float32, acc_layout), BM, 0,
                      KSTEPS, NBUF)  # fmt: skip
        mbarrier.arrive(turn.index(1 - WG))  # every wgmma of this tile is issued: the other's turn
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((c + KSTEPS - 1) % NBUF))
        _store_tile(cd, c_smem, acc, m0, n0)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _coop_warpgroup(cd, a_smem, b_smem, c_smem, ready, empty, turn, WG: gl.constexpr, M: gl.constexpr,
                    N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                    NBUF: gl.constexpr, GROUP: gl.constexpr, STORE: gl.constexpr):  # fmt: skip
    """Rows ``64 WG`` to ``+ 64`` of each of this program's tiles (``turn``
    unused). ``STORE`` False stores only the program's last tile: a timing
    diagnostic (``benchmarks/gluon_matmul.py``) of what the epilogue costs
    (with no tile stored, the compiler drops the wgmmas)."""
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])  # fmt: skip
    KSTEPS: gl.constexpr = (K + BK - 1) // BK
    TILES: gl.constexpr = ((M + BM - 1) // BM) * ((N + BN - 1) // BN)
    c = 0
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        m0, n0 = _tile(t, M, N, BM, BN, GROUP)
        acc = _k_loop(a_smem, b_smem, ready, empty, c, gl.zeros([HM, BN], gl.float32, acc_layout), HM, WG,
                      KSTEPS, NBUF)  # fmt: skip
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((c + KSTEPS - 1) % NBUF))
        c += KSTEPS
        if STORE:
            _store_tile(cd, c_smem, acc, m0 + WG * HM, n0)
        elif t + gl.num_programs(0) >= TILES:
            _store_tile(cd, c_smem, acc, m0 + WG * HM, n0)
    tma.store_wait(0)


@gluon.jit
def _producer(ad, bd, a_smem, b_smem, ready, empty, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr,
              GROUP: gl.constexpr):  # fmt: skip
    """Every k step of every tile of this program, in consumption order, into
    the ring slot its readers have released."""
    KSTEPS: gl.constexpr = (K + BK - 1) // BK
    TILES: gl.constexpr = ((M + BM - 1) // BM) * ((N + BN - 1) // BN)
    c = 0
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        m0, n0 = _tile(t, M, N, BM, BN, GROUP)
        for k in range(KSTEPS):
            slot = c % NBUF
            if c >= NBUF:
                mbarrier.wait(empty.index(slot), ((c // NBUF) - 1) & 1)
            mbarrier.expect(ready.index(slot), ad.block_type.nbytes + bd.block_type.nbytes)
            _tma_load(ad, [m0, k * BK], ready.index(slot), a_smem.index(slot))
            _tma_load(bd, [k * BK, n0], ready.index(slot), b_smem.index(slot))
            c += 1


@gluon.jit
def _matmul(A, B, C, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
            BK: gl.constexpr, NBUF: gl.constexpr, GROUP: gl.constexpr, COOP: gl.constexpr,
            STORE: gl.constexpr = True):  # fmt: skip
    dtype: gl.constexpr = A.dtype.element_ty
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    CM: gl.constexpr = BM // 2 if COOP else BM  # rows of C one warpgroup stores
    ad = tma.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BM, BK], layout=tile)
    bd = tma.make_tensor_descriptor(B, shape=[K, N], strides=[N, 1], block_shape=[BK, BN], layout=tile)
    cd = tma.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[CM, BN], layout=tile)
    a_smem = gl.allocate_shared_memory(dtype, [NBUF, BM, BK], tile)
    b_smem = gl.allocate_shared_memory(dtype, [NBUF, BK, BN], tile)
    c0_smem = gl.allocate_shared_memory(dtype, [CM, BN], tile)
    c1_smem = gl.allocate_shared_memory(dtype, [CM, BN], tile)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NBUF):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2 if COOP else 1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()
    _cta_barrier()  # every thread sees the barriers initialized
    mbarrier.arrive(turn.index(0))  # ping-pong: warpgroup 0 runs its k loop first
    # fmt: off
    if COOP:
        gl.warp_specialize(
            [
                (_coop_warpgroup, (cd, a_smem, b_smem, c0_smem, ready, empty, turn, 0, M, N, K, BM, BN, BK, NBUF, GROUP, STORE)),
                (_coop_warpgroup, (cd, a_smem, b_smem, c1_smem, ready, empty, turn, 1, M, N, K, BM, BN, BK, NBUF, GROUP, STORE)),
                (_producer, (ad, bd, a_smem, b_smem, ready, empty, M, N, K, BM, BN, BK, NBUF, GROUP)),
            ],
            worker_num_warps=[4, 1],
            worker_num_regs=[240, 24],
        )
    else:
        gl.warp_specialize(
            [
                (_pingpong_warpgroup, (cd, a_smem, b_smem, c0_smem, ready, empty, turn, 0, M, N, K, BM, BN, BK, NBUF, GROUP)),
                (_pingpong_warpgroup, (cd, a_smem, b_smem, c1_smem, ready, empty, turn, 1, M, N, K, BM, BN, BK, NBUF, GROUP)),
                (_producer, (ad, bd, a_smem, b_smem, ready, empty, M, N, K, BM, BN, BK, NBUF, GROUP)),
            ],
            worker_num_warps=[4, 1],
            worker_num_regs=[240, 24],
        )
    # fmt: on


@gluon.jit
def matmul_pingpong(A, B, C, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """C = A @ B, each math warpgroup on whole ``BM x BN`` tiles, taking turns;
    any grid. Launched with 4 warps (the first math warpgroup; the other
    partitions add 5, padded to 12)."""
    _matmul(A, B, C, M, N, K, BM, BN, BK, NBUF, GROUP, False)


@gluon.jit
def matmul_coop(A, B, C, M: gl.constexpr, N: gl.constexpr, K: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr, BK: gl.constexpr, NBUF: gl.constexpr, GROUP: gl.constexpr):  # fmt: skip
    """C = A @ B, both math warpgroups on each ``BM x BN`` tile (``BM / 2``
    rows each); any grid. Launched with 4 warps."""
    _matmul(A, B, C, M, N, K, BM, BN, BK, NBUF, GROUP, True)
