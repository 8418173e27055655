"""Block sizes, segment ids and the constants of ``flash_attention``: the blocks picked from the shapes and the chip."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tpu.ops import _policy
from pallas_tpu.ops._attention_common import NUM_LANES, check_blocks

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
NUM_SUBLANES = 8
MIN_BLOCK_SIZE = 128
TRANS_B_DIM_NUMBERS = (((1,), (1,)), ((), ()))  # a @ b.T

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
F32 = jnp.float32
# A row whose largest base-2 logit is below this sees no key (every key masked, or a bias like
# -1e30): f32 logits that low are spaced by 2 or more, so its softmax carries no information.
SEES_NOTHING = -float(2**24)
# The tile edge of the causal diagonal square: smaller tiles skip more of the masked half,
# larger ones feed the MXU longer runs.
DIAGONAL_TILE = 256
# The fewest query rows a ``dk``/``dv`` grid step sweeps when wide heads shrink it (code size).
MIN_DKV_SWEEP = 512
# The instruction memory (bundles) the code-size rule was measured on: the v5e's. Elsewhere
# the ``dk``/``dv`` sweep scales with the chip's (the v5e's where it is not measured).
MEASURED_BUNDLES = 56_000


def fit_block(n: int | None, target: int) -> int:
    """``_policy.fit_block`` with the whole axis where no multiple of 128 divides it."""
    return cast(int, _policy.fit_block(n, target, or_whole=True))


_BACKWARD_BLOCKS = (
    "block_q_dq",
    "block_k_dq",
    "block_k_major_dq",
    "block_q_dkv",
    "block_k_dkv",
    "block_q_major_dkv",
    "block_k_major_dkv",
)


class SegmentIds(NamedTuple):
    """Segment ids of the query and key sequences: a query attends to the keys of its own segment.

    Attributes:
      q: ``[batch, q_seq_len]`` integer ids of the queries.
      kv: ``[batch, kv_seq_len]`` integer ids of the keys and values.
    """

    q: jax.Array
    kv: jax.Array


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the flash attention kernels (speed only; the results do not depend on them).

    Forward: ``block_q`` query rows and ``block_k_major`` key rows per grid step, the keys
    taken ``block_k`` at a time inside it. ``block_b`` is accepted for JAX's signature; the
    kernels take one batch row per grid step whatever it says. Backward: ``block_k_major_dkv``
    key rows and ``block_q_major_dkv`` query rows per grid step, in tiles of ``block_k_dkv``
    keys by ``block_q_dkv`` queries; the ``_dq`` blocks (``block_q_dq`` query rows and
    ``block_k_major_dq`` key rows per step, keys ``block_k_dq`` at a time) serve the separate
    ``dq`` kernel, used only where a head's ``dq`` does not fit VMEM beside the fused backward
    kernel. Backward blocks left as None are chosen by ``tuned_block_sizes``'s rule (JAX raises instead).
    """

    block_q: int
    block_k_major: int
    block_k: int
    block_b: int

    block_q_major_dkv: int | None = None
    block_k_major_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dkv: int | None = None

    block_k_major_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dq: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            size = getattr(self, f.name)
            if size is not None and (not isinstance(size, (int, np.integer)) or size < 1):
                raise ValueError(f"BlockSizes.{f.name} must be a positive int, got {size!r}")
        pairs = (
            ("block_k", "block_k_major"),
            ("block_k_dkv", "block_k_major_dkv"),
            ("block_q_dkv", "block_q_major_dkv"),
            ("block_k_dq", "block_k_major_dq"),
        )
        for minor, major in pairs:
            lo, hi = getattr(self, minor), getattr(self, major)
            if lo is not None and hi is not None and hi % lo:
                raise ValueError(
                    f"BlockSizes.{minor}={lo} must divide BlockSizes.{major}={hi} "
                    f"(the {minor} tiles are taken from inside one {major} block)"
                )

    @property
    def has_backward_blocks(self) -> bool:
        """Whether every backward block is given."""
        return all(getattr(self, name) is not None for name in _BACKWARD_BLOCKS)

    @classmethod
    def get_default(cls, batch_size, num_heads, q_seq_len, kv_len, d_model) -> BlockSizes:
        """JAX's default blocks: 128 for every block whatever the shapes (its meaning and values).

        ``flash_attention`` does not use these when ``block_sizes`` is None: it takes
        ``tuned_block_sizes``, chosen from the shapes and the chip.
        """
        del batch_size, num_heads, q_seq_len, kv_len, d_model
        return cls(**{f.name: 1 if f.name == "block_b" else MIN_BLOCK_SIZE for f in dataclasses.fields(cls)})


def tuned_block_sizes(
    batch_size, num_heads, q_seq_len, kv_len, d_model, *, causal=False, info=None
) -> BlockSizes:
    """The blocks ``flash_attention`` uses when none are given, from the shapes and the chip.

    Tiles of 1024 x 1024 scores (512 x 512 on chips with less than 64 MiB of VMEM). Without
    ``causal`` a grid step sweeps up to four tiles' worth of keys (``dk``/``dv``: queries),
    so at L <= 4096 a head's keys are copied to VMEM once and its tiles run as straight-line
    code; with ``causal`` a step takes two tiles' worth, so the steps that cross the diagonal
    stay few and small. A step's unrolled tiles spill their scores to VMEM, so its size is
    bounded by the VMEM too. The ``dk``/``dv`` step's query sweep is divided by the MXU's
    passes over the head dimension (one per 128 of ``d_model``), down to 512 rows: for code
    size. Its kernel's code grows with the work of a step (straight-line tiles, each causal
    diagonal place a body of its own) and must fit the core's instruction memory
    (``Facts.instruction_bundles``: ~56k bundles on the v5e, the sweep scaled to the chip's); libtpu splits a larger one into overlays fetched from HBM on every
    grid step. At D256, causal, L=4096 (libtpu's scheduler for the v5e), the fused backward
    kernel with 1024 x 2048 steps was 80.7k bundles in 5 overlays; with 1024 x 1024 steps it
    is 32.9k bundles in one, and a step's bundles stay under its MXU cycles (0.88 of them
    unmasked, 0.91 on the diagonal; 0.87 and 0.88 before). (JAX's defaults, which
    ``BlockSizes.get_default`` returns, are blocks of 128 whatever the shapes.)
    """
    del batch_size, num_heads
    return _policy.choose("flash_attention", (q_seq_len, kv_len, int(d_model), bool(causal)), _rule, info)


def _rule(facts: _policy.Facts, key) -> BlockSizes:
    """``tuned_block_sizes``'s rule for ``key = (q_len, kv_len, head_dim, causal)`` on ``facts``."""
    q_seq_len, kv_len, d_model, causal = key
    budget = _policy.vmem_budget("attention", facts)
    tile = 1024 if budget >= 48 * 2**20 else 512
    widest = max(tile, min(4 * tile, max_step_scores(facts) // tile))
    block_q = fit_block(q_seq_len, tile)
    block_kv = fit_block(kv_len, tile)
    sweep_kv = fit_block(kv_len, 2 * block_q if causal else widest)
    passes = -(-max(d_model, 1) // NUM_LANES)  # the MXU's passes over the head dimension
    bundles = facts.instruction_bundles or MEASURED_BUNDLES
    dkv_work = (2 * block_kv if causal else widest) // passes * bundles // MEASURED_BUNDLES
    sweep_q_dkv = fit_block(q_seq_len, max(MIN_DKV_SWEEP, dkv_work))
    return BlockSizes(
        block_q=block_q,
        block_k_major=sweep_kv,
        block_k=fit_block(sweep_kv, tile),
        block_b=1,
        block_q_major_dkv=sweep_q_dkv,
        block_k_major_dkv=block_kv,
        block_k_dkv=block_kv,
        block_q_dkv=fit_block(sweep_q_dkv, tile),
        block_k_major_dq=sweep_kv,
        block_k_dq=fit_block(sweep_kv, tile),
        block_q_dq=block_q,
    )


def max_step_scores(facts: _policy.Facts | None = None) -> int:
    """The most scores a grid step may sweep: a tile's float32 scores spill to VMEM (up to 4
    bytes each), and the steps' sizes are kept to a quarter of the VMEM budget."""
    return _policy.vmem_budget("attention", facts) // 16


# The most scores a grid step runs as straight-line tiles (None: as many as ``max_step_scores``);
# a larger step loops over its tiles (one tile's code) and crosses the causal diagonal in one
# body, not one per place the diagonal may fall in the step. Loops cut Mosaic's compile: on a
# compile-only v5e (B2 H16 L4096 D128) the forward kernel's first call took 0.56 s of process CPU
# against 1.96 unrolled, fwd+bwd causal 3.27 against 6.47. But on the v5e itself a limit of 1M
# scores (one 1024 x 1024 tile an iteration) ran the forward at 134 TFLOP/s against 179 unrolled,
# causal 93 against 130, fwd+bwd 164 against 182 (benchmarks/tpu_ops_code_size.py): the scheduler
# overlaps one tile's matmuls with the next one's softmax only in straight-line code. Speed
# first: no limit.
STRAIGHT_LINE_SCORES: int | None = None


def max_unrolled_scores() -> int:
    """The most scores a grid step runs as straight-line tiles: ``max_step_scores()``, or
    ``STRAIGHT_LINE_SCORES`` where that is lower."""
    if STRAIGHT_LINE_SCORES is None:
        return max_step_scores()
    return min(max_step_scores(), STRAIGHT_LINE_SCORES)


def below_or_on_diag(r, r_blk_size, c, c_blk_size):
    """Whether block ``(r, c)`` of a causal mask (row blocks of ``r_blk_size``, column blocks of
    ``c_blk_size``) holds any visible entry: its last row is at or past its first column."""
    last_row = r * r_blk_size + (r_blk_size - 1)
    return last_row >= c * c_blk_size


def resolve_blocks(block_sizes, batch, heads, q_len, kv_len, head_dim, causal) -> BlockSizes:
    """The user's blocks with the missing backward ones defaulted, checked against the shapes."""
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            "flash_attention: block_sizes must be a pallas_tpu.ops.flash_attention.BlockSizes or None, "
            f"got {type(block_sizes).__module__}.{type(block_sizes).__qualname__}"
        )
    default = tuned_block_sizes(batch, heads, q_len, kv_len, head_dim, causal=causal)
    if block_sizes is None:
        blocks = default
    else:
        missing = {
            f.name: getattr(default, f.name)
            for f in dataclasses.fields(BlockSizes)
            if getattr(block_sizes, f.name) is None
        }
        blocks = dataclasses.replace(block_sizes, **missing)
    checks = (
        ("block_q", "q_seq_len", q_len),
        ("block_k_major", "kv_seq_len", kv_len),
        ("block_k", "block_k_major", blocks.block_k_major),
        ("block_q_major_dkv", "q_seq_len", q_len),
        ("block_k_major_dkv", "kv_seq_len", kv_len),
        ("block_k_dkv", "block_k_major_dkv", blocks.block_k_major_dkv),
        ("block_q_dkv", "block_q_major_dkv", blocks.block_q_major_dkv),
        ("block_q_dq", "q_seq_len", q_len),
        ("block_k_major_dq", "kv_seq_len", kv_len),
        ("block_k_dq", "block_k_major_dq", blocks.block_k_major_dq),
    )
    for name, of, n in checks:
        size = getattr(blocks, name)
        if of == "q_seq_len" and size != n and size % NUM_LANES == 0 and n % size == 0:
            continue
        if of == "q_seq_len" and size < n and n % size == 0 and size % NUM_SUBLANES == 0:
            raise ValueError(
                f"flash_attention: block_sizes.{name}={size} must be a multiple of {NUM_LANES} or all of "
                f"{of}={n}: each query's logsumexp (and the backward's row terms) is kept lane-dense, "
                f"one query a lane, so a block of queries spans whole {NUM_LANES}-lane TPU tiles"
            )
    check_blocks("flash_attention", blocks, checks)
    if blocks.block_b > batch:
        raise ValueError(f"flash_attention: block_sizes.block_b={blocks.block_b} exceeds batch={batch}")
    return blocks
