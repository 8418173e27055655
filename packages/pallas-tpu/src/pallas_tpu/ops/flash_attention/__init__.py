"""Flash attention for TPUs, forward and backward (FlashAttention-2), written with pallas-tpu.

The names and call signatures are those of JAX's ``ops.tpu.flash_attention``:
``flash_attention(q, k, v, ab=None, segment_ids=None, *, causal, sm_scale, block_sizes, debug)``
on ``[batch, heads, seq, head_dim]`` arrays, ``BlockSizes``, ``SegmentIds``, the constants and
the ``mha_reference`` family. The logits are ``(q @ k.T + ab) * sm_scale``, masked where the
segment ids differ and (``causal``) where the key comes after the query (top-left aligned).

How the kernels work (the choices made for the TPU v5e; static bundle counts from libtpu's
scheduler, ``--xla_jf_dump_to``, guided them):

* Forward: a grid step holds ``block_q`` query rows and ``block_k_major`` key rows and sweeps
  them in tiles of ``block_k`` keys with the online softmax: a running row max ``m`` and row
  sum ``l`` kept lane-replicated (``(block_q, 128)`` float32: they meet the score tiles without
  relayouts), the output accumulated unnormalized in float32 and divided by ``l`` once. The
  softmax runs in base 2: the MXU takes the queries as given, and a float32 score costs one
  multiply by ``sm_scale * log2(e)`` (after the bias, as the logits are defined) and one
  ``exp2`` (rescaling the queries in their own dtype instead would round them twice: with
  bfloat16 inputs and sharp softmaxes, several times JAX's error). A step's tiles are straight-line code (no loop), so
  the scheduler overlaps one tile's matmuls with the next one's softmax; by default a step is a
  head's whole key sequence (L <= 4096), copied to VMEM once per head. The residual for the
  backward pass is one lane-dense logsumexp row (not ``m`` and ``l`` lane-replicated).
* Causal: steps wholly below the diagonal run the unmasked tiles; steps above it do nothing and,
  their block indices clamped to the last block needed, copy nothing; a step holding the
  diagonal runs, for the position the diagonal has in it, the unmasked tiles beside it and the
  diagonal square in bands of ``_DIAGONAL_TILE`` rows, only the tile on the diagonal masked
  (one iota difference against a constant). Only when the query block is longer than the key
  block does the diagonal cross steps (``_Sweep._straddling``: a loop and membership tests).
* Backward: one kernel, key-major: per key block it sweeps the queries in tiles of the
  transposed scores ``k @ q.T`` (so ``p.T @ do``, ``ds.T @ q`` are plain matmuls), recomputing
  the probabilities from the logsumexp, and accumulates ``dq`` for the whole sequence in VMEM
  across the key blocks: five matmuls a tile where separate ``dq`` and ``dk``/``dv`` kernels take
  seven. It also copies the queries to VMEM and computes ``di = rowsum(dO * O)`` itself, on its
  first key block. A query row that sees no key gets a logsumexp of ``+inf``: no gradient. Where a head's ``dq`` does not fit VMEM, ``dq`` is a separate query-major kernel.
* Blocks: ``tuned_block_sizes`` picks them from the shapes and the chip's facts (VMEM,
  instruction memory) through ``ops._policy`` (``"flash_attention"``: a measured row, else
  ``_blocks._rule``); ``BlockSizes.get_default`` is JAX's: 128 whatever the shapes.

The modules: ``_blocks`` (block sizes, segment ids, constants), ``_api`` (the entry point and
its VJP), ``_tiles`` (what the kernels share: the sweep of a step's tiles, the tile's scores,
the query-major specs, ``flash_call``), ``_forward``, ``_backward`` (each kernel body a function
of its own beside the one that builds its specs), ``_reference``.
"""

from ._api import flash_attention
from ._blocks import (
    DEFAULT_MASK_VALUE,
    MIN_BLOCK_SIZE,
    NUM_LANES,
    NUM_SUBLANES,
    TRANS_B_DIM_NUMBERS,
    BlockSizes,
    SegmentIds,
    below_or_on_diag,
    tuned_block_sizes,
)
from ._reference import mha_reference, mha_reference_bwd, mha_reference_no_custom_vjp

__all__ = [
    "DEFAULT_MASK_VALUE",
    "MIN_BLOCK_SIZE",
    "NUM_LANES",
    "NUM_SUBLANES",
    "TRANS_B_DIM_NUMBERS",
    "BlockSizes",
    "SegmentIds",
    "below_or_on_diag",
    "flash_attention",
    "mha_reference",
    "mha_reference_bwd",
    "mha_reference_no_custom_vjp",
    "tuned_block_sizes",
]
