"""The block sizes of the splash attention kernels: ``BlockSizes`` (JAX's fields), the
default blocks (``BlockSizes.get_default``: ``ops._policy``'s ``"splash_attention"``, a
measured row, else ``_rule`` from the chip's facts) and the checks of given blocks."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, cast

import numpy as np

from pallas_tpu.ops import _policy
from pallas_tpu.ops._attention_common import NUM_LANES, check_blocks

# The instruction memory (bundles) the code-size rule was measured on: the v5e's. Elsewhere the
# forward's keys per block scale with the chip's (the v5e's where it is not measured).
MEASURED_BUNDLES = 56_000
# The most keys of a forward block. On the v5e (2026-12-07, B2 H16 L4096 D128 bf16 and GQA 32/8 heads
# at L8192, benchmarks/results/tpu_ops_splash_sweep_v5e.txt), blocks of 1024 queries x 2048 keys ran
# at 95-96 % of 4096 keys' speed (full 158.3 against 166.1 TFLOP/s, causal 136.3 against 142.5, GQA
# causal 150.1 against 155.6) with a first call 2.5-4.3x quicker (1.6 / 3.7 / 3.7 s against 4.9 / 9.1
# / 16.0 s: Mosaic compiles a step's straight-line tiles); 1024 keys cut the first call to 0.9-1.4 s
# but the speed by 12-14 %.
FORWARD_KEYS = 2048


def fit_block(n: int | None, target: int) -> int:
    """``_policy.fit_block`` with the whole axis where no multiple of 128 divides it."""
    return cast(int, _policy.fit_block(n, target, or_whole=True))


_OP = "splash attention"


class QKVLayout(enum.IntEnum):
    """The physical layout JAX's kernels may keep q, k or v in. Accepted here for the
    signature; these kernels always read ``[..., seq_len, head_dim]``."""

    HEAD_DIM_MINOR = enum.auto()  # [..., seq_len, head_dim]
    SEQ_MINOR = enum.auto()  # [..., head_dim, seq_len]


def from_head_minor(vals: tuple[Any, ...], layout: QKVLayout):
    """``vals`` (a shape ending in ``(seq_len, head_dim)``) in ``layout``."""
    if layout == QKVLayout.HEAD_DIM_MINOR:
        return vals
    return (*vals[:-2], vals[-1], vals[-2])


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Block sizes of the splash attention kernels (speed only; results do not depend on them).

    Forward: ``block_q`` query rows by ``block_kv`` keys per grid step (the mask is skipped in
    blocks of this size), swept in chunks of ``block_kv_compute`` keys. ``dk``/``dv``:
    ``block_q_dkv`` by ``block_kv_dkv`` per step, the keys in chunks of ``block_kv_dkv_compute``.
    ``dq``: ``block_q_dq`` by ``block_kv_dq``. Backward blocks left as None are taken from the
    forward ones (JAX then has no backward pass). ``use_fused_bwd_kernel`` (JAX's meaning): ``dq``
    is computed in the ``dk``/``dv`` kernel, accumulated per head in VMEM (where a head's float32
    ``dq`` takes at most 8 MiB; else the two kernels run), and no ``dq`` blocks may be given. The
    layouts are accepted for JAX's signature: q, k, v are read head-dim minor.
    """

    block_q: int
    block_kv: int
    block_kv_compute: int | None = None

    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_kv_dkv_compute: int | None = None

    block_q_dq: int | None = None
    block_kv_dq: int | None = None

    use_fused_bwd_kernel: bool = False

    q_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR
    k_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR
    v_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR

    def __post_init__(self):
        if self.block_kv_compute is None:
            object.__setattr__(self, "block_kv_compute", self.block_kv)
        if self.block_kv_dkv_compute is None:
            object.__setattr__(self, "block_kv_dkv_compute", self.block_kv_dkv)
        for name in _BLOCK_FIELDS:
            size = getattr(self, name)
            if size is not None and (not isinstance(size, (int, np.integer)) or size < 1):
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {size!r}")
        for minor, major in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
            lo, hi = getattr(self, minor), getattr(self, major)
            if lo is not None and hi is not None and hi % lo:
                raise ValueError(f"BlockSizes.{minor}={lo} must divide BlockSizes.{major}={hi}")
        if self.use_fused_bwd_kernel and (self.block_q_dq is not None or self.block_kv_dq is not None):
            raise ValueError("BlockSizes: block sizes for the dq kernel are not needed with a fused kernel")

    @property
    def has_backward_blocks(self) -> bool:
        """Whether every backward block is given."""
        needed: tuple[str, ...] = ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")
        if not self.use_fused_bwd_kernel:
            needed += ("block_q_dq", "block_kv_dq")
        return all(getattr(self, n) is not None for n in needed)

    @classmethod
    def get_default(
        cls,
        q_seq_len: int | None = None,
        kv_seq_len: int | None = None,
        *,
        has_partial: bool = True,
        head_dim: int | None = None,
        dtype: Any = None,
    ) -> BlockSizes:
        """The blocks the kernels use when none are given, from the chip's VMEM, the head
        dimension and dtype (a kernel made without blocks takes them from its call's q) and,
        when given, the lengths (each block the largest multiple of 128 up to its size that
        divides its length). JAX's defaults are blocks of 128 whatever the chip.

        The rule (v5e-class chips, 64 MiB of VMEM or more; the static bundle counts of libtpu's
        scheduler for the v5e, ``benchmarks/tpu_ops_splash.py --sweep`` times them on a chip):
        query blocks of 1024 rows against kv blocks of 2048 keys at a head dimension of 256 or
        less, so that a step is up to eight straight-line tiles whose matmuls and softmaxes
        overlap (a step of one tile reaches two thirds of the MXU's rate, of four or more over
        nine tenths), in tiles of 512 keys and cells of 512 queries (a causal diagonal then
        wastes a quarter of its block, not half; ``has_partial`` no longer changes the tiles:
        on the v5e 512 keys beat 1024 on full masks too). 4096 keys ran 4-5 % faster but took
        2.5-4.3x as long to compile (``FORWARD_KEYS``). Wider heads (each further 128 of
        head_dim one more MXU pass) get proportionally fewer keys per block, down to 512: a
        step's straight-line code grows with its work, and the kernel's code must fit the
        core's instruction memory (``Facts.instruction_bundles``, the keys scaled to the chip's: a
        kernel of 40.8k bundles fits in the v5e's 56k; float32 operands
        at head_dim 128 add no code, so the dtype counts only for VMEM). At head_dim 256 and 4096
        keys a causal mask's forward kernel is ~102k bundles, which libtpu splits into
        overlays fetched from HBM on every grid step (4x slower than JAX's plain 1024 blocks);
        at 2048 keys it is ~36k bundles and runs at the MXU's rate. Chips with less VMEM:
        512-row blocks against 2048 keys (scaled alike), tiles of 512. Blocks whose buffers
        would not fit the VMEM budget (very wide heads, 4-byte dtypes) shrink, keys first.
        The backward pass is one fused kernel (``use_fused_bwd_kernel=True``: ``dq`` beside
        ``dk``/``dv``, the scores computed once; on the v5e 1.27-1.34x JAX's fused kernel at
        its best blocks causal, 1.08-1.10x on a full mask, where the two kernels were 0.84-1.02x)
        with 1024 (512) square blocks whatever the head dimension (at head_dim 256 the
        ``dk``/``dv`` kernel is ~30k bundles, ``dq`` ~23k: they fit), computed in cells of half
        a block (``_backward.cell_of``), the keys in tiles of 512. JAX's default is the two
        kernels.
        """
        return default_blocks(q_seq_len, kv_seq_len, has_partial, head_dim or NUM_LANES, _itemsize(dtype))


def _itemsize(dtype: Any) -> int:
    return 2 if dtype is None else np.dtype(dtype).itemsize


def default_blocks(q_len, kv_len, has_partial: bool, head_dim: int, itemsize: int, info=None) -> BlockSizes:
    """``BlockSizes.get_default``'s blocks on the chip ``info`` (default: the one traced for):
    its measured row, else ``_rule``."""
    key = (q_len, kv_len, int(head_dim), bool(has_partial), itemsize)
    return _policy.choose("splash_attention", key, _rule, info)


def _rule(facts: _policy.Facts, key) -> BlockSizes:
    """The default blocks (``BlockSizes.get_default`` says why) for ``key = (q_len, kv_len,
    head_dim, has_partial, itemsize)`` on ``facts``."""
    # has_partial stays in the key (and get_default's keyword) but no longer changes the blocks
    q_len, kv_len, head_dim, _, itemsize = key
    budget = _policy.vmem_budget("attention", facts)
    large = budget >= 48 * 2**20
    bq, bkv = (1024, 4096) if large else (512, 2048)
    bwd = 1024 if large else 512
    passes = -(-max(head_dim, 1) // NUM_LANES)  # the MXU's passes over the head dimension
    # the work (and so the straight-line code) of a step, as at head_dim 128: fewer keys
    bundles = facts.instruction_bundles or MEASURED_BUNDLES
    bkv = max(512, bkv // passes * bundles // MEASURED_BUNDLES // 512 * 512)
    bkv = min(bkv, FORWARD_KEYS)  # the first call's compile grows with a step's code
    while _forward_vmem(bq, bkv, head_dim, itemsize) > budget and max(bq, bkv) > 128:
        if bkv > 512 or bq == 128:  # fewer keys first, down to 512; then fewer queries
            bkv //= 2
        else:
            bq //= 2
    bc = min(512, bkv)
    bq_fit, bkv_fit = fit_block(q_len, bq), fit_block(kv_len, bkv)
    bwd_q, bwd_kv = fit_block(q_len, bwd), fit_block(kv_len, bwd)
    return BlockSizes(
        block_q=bq_fit,
        block_kv=bkv_fit,
        block_kv_compute=fit_block(bkv_fit, bc),
        block_q_dkv=bwd_q,
        block_kv_dkv=bwd_kv,
        block_kv_dkv_compute=fit_block(bwd_kv, 512),
        use_fused_bwd_kernel=True,
    )


def _forward_vmem(bq: int, bkv: int, head_dim: int, itemsize: int) -> int:
    """The forward kernel's VMEM: q, k, v and out blocks double-buffered, the float32
    accumulator and row statistics, and two float32 score cells (512 x 512 at most)."""
    blocks = 2 * (2 * bq + 2 * bkv) * head_dim * itemsize
    cells = 2 * min(bq, 512) * min(bkv, 512) * 4
    return blocks + bq * head_dim * 4 + 2 * bq * NUM_LANES * 4 + cells


_BLOCK_FIELDS = (
    "block_q",
    "block_kv",
    "block_kv_compute",
    "block_q_dkv",
    "block_kv_dkv",
    "block_kv_dkv_compute",
    "block_q_dq",
    "block_kv_dq",
)


def _complete(blocks: BlockSizes) -> BlockSizes:
    """Missing backward blocks taken from the forward ones; with the fused backward, the ``dq``
    blocks (for a head whose ``dq`` does not fit VMEM: the two kernels then) from ``dk``/``dv``'s."""
    fill: dict[str, Any] = {}
    for name, like in (("block_q_dkv", "block_q"), ("block_kv_dkv", "block_kv")):
        if getattr(blocks, name) is None:
            fill[name] = getattr(blocks, like)
    fused = blocks.use_fused_bwd_kernel
    for name, like in (
        ("block_q_dq", "block_q_dkv" if fused else "block_q"),
        ("block_kv_dq", "block_kv_dkv" if fused else "block_kv"),
    ):
        if getattr(blocks, name) is None:
            fill[name] = fill.get(like, getattr(blocks, like))
    if blocks.block_kv_dkv is None:
        fill["block_kv_dkv_compute"] = fill.get("block_kv_dkv", blocks.block_kv_dkv)
    if not fill:
        return blocks
    return dataclasses.replace(blocks, **fill, use_fused_bwd_kernel=False)


def _shrink(b: BlockSizes, q_len: int, kv_len: int) -> BlockSizes:
    """``b`` with each block longer than its sequence cut to the sequence (a block cannot
    be larger than what it tiles), and each compute chunk then longer than, or not dividing,
    its block fitted to it."""
    fit: dict[str, Any] = {}
    for name, n in (
        ("block_q", q_len),
        ("block_kv", kv_len),
        ("block_q_dkv", q_len),
        ("block_kv_dkv", kv_len),
        ("block_q_dq", q_len),
        ("block_kv_dq", kv_len),
    ):
        if getattr(b, name) > n:
            fit[name] = n
    for chunk, block in (("block_kv_compute", "block_kv"), ("block_kv_dkv_compute", "block_kv_dkv")):
        size, of = getattr(b, chunk), fit.get(block, getattr(b, block))
        if size > of or of % size:
            fit[chunk] = fit_block(of, size) if block in fit else size
    return dataclasses.replace(b, **fit) if fit else b


def _check_blocks(b: BlockSizes, q_len: int, kv_len: int) -> None:
    for name in ("block_q", "block_q_dkv", "block_q_dq"):
        size = getattr(b, name)
        if size < q_len and size % NUM_LANES:
            raise ValueError(
                f"{_OP}: block_sizes.{name}={size} must be a multiple of {NUM_LANES} or all of "
                f"q_seq_len={q_len}: the kernels keep per-query values (the logsumexp, the segment "
                f"ids of the keys' tiles) as lane-dense rows, {NUM_LANES} queries to a TPU tile of lanes"
            )
    checks = (
        ("block_q", "q_seq_len", q_len),
        ("block_kv", "kv_seq_len", kv_len),
        ("block_kv_compute", "block_kv", b.block_kv),
        ("block_q_dkv", "q_seq_len", q_len),
        ("block_kv_dkv", "kv_seq_len", kv_len),
        ("block_kv_dkv_compute", "block_kv_dkv", b.block_kv_dkv),
        ("block_q_dq", "q_seq_len", q_len),
        ("block_kv_dq", "kv_seq_len", kv_len),
    )
    check_blocks(_OP, b, checks, per=" (per q shard)")
