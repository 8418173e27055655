"""Block sizes of ``ragged_paged_attention`` when the caller gives none (the family's block
module), with the names of JAX's ``ops.tpu.ragged_paged_attention.tuned_block_sizes``: the chip's
measured rows (``ops._policy``, keyed by ``simplify_key``), else a rule from its facts in place
of JAX's table. No block sizes have been measured on a chip for this kernel yet, so
``TUNED_BLOCK_SIZES`` is empty."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

import pallas_tpu as pltpu
from pallas_tpu.ops import _policy

_OP = "ragged_paged_attention"
# A sequence's pages per compute block at most: the page table of a block is read from SMEM.
MAX_PAGES_PER_SEQ = 16


def _jax_table() -> dict[str, dict[tuple, tuple[int, int]]]:
    table: dict[str, dict[tuple, tuple[int, int]]] = {}
    for chip in _policy.GENERATIONS:
        if rows := _policy.measured(chip, _OP):
            table.setdefault(f"TPU v{_policy.generation_facts(chip).generation}", {}).update(rows)
    return table


# JAX's table, ``{"TPU v<generation>": {simplify_key(...): (num_kv_pages_per_block,
# num_queries_per_block)}}``: a copy of the measured rows of ``ops._policy``'s generation files
# (which ``get_tuned_block_sizes`` reads; none yet) under JAX's device names.
TUNED_BLOCK_SIZES = _jax_table()
# Score rows (query tokens times q heads per KV head) of one grid step.
SCORE_ROWS = 512


def next_power_of_2(x: int) -> int:
    """The smallest power of two ``>= x`` (``x > 0``)."""
    if x <= 0:
        raise ValueError(f"next_power_of_2: x must be positive, got {x}")
    return 1 << (x - 1).bit_length()


def simplify_key(key):
    """A table key with the sizes rounded up to powers of two (head_dim to 128s)."""
    q_dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size, tokens, pages_per_seq = key
    return (
        jnp.dtype(q_dtype).name,
        jnp.dtype(kv_dtype).name,
        next_power_of_2(q_heads),
        next_power_of_2(kv_heads),
        -(-head_dim // 128) * 128,
        next_power_of_2(page_size),
        next_power_of_2(tokens),
        next_power_of_2(page_size * pages_per_seq),
    )


def _device_kind() -> str:
    return jax.devices()[0].device_kind


def get_tpu_version() -> int:
    """The TPU generation of this host's first device (``jax.devices()[0].device_kind``), or -1
    when it is not a TPU (a CPU host: kernels there are traced for ``pltpu.get_tpu_info()``'s
    chip, which ``get_tuned_block_sizes(..., info=...)`` takes)."""
    kind = _device_kind()
    if "TPU" not in kind:
        return -1
    if kind == "TPU7x":
        return 7
    match = re.search(r"TPU\s*v?(\d+)", kind, re.IGNORECASE)
    if match is None:
        raise ValueError(f"get_tpu_version: cannot read a TPU generation from device kind {kind!r}")
    return int(match.group(1))


def get_device_name(num_devices: int | None = None) -> str:
    """``"TPU v<generation>"`` (and ``-<num_devices>``) of this host's first device; on a host
    without a TPU, the first two words of its device kind (``"cpu"``)."""
    kind = _device_kind()
    match = re.search(r"TPU\s*v?(\d+)", kind, re.IGNORECASE)
    name = f"TPU v{match.group(1)}" if match else " ".join(kind.split()[:2])
    return name if num_devices is None else f"{name}-{num_devices}"


def query_window(num_q_heads_per_kv_head: int) -> int:
    """Query tokens of the kernel's narrow path: a multiple of 8 whose score rows (times the
    q heads per KV head) fill a 16-row bf16 tile."""
    return 8 if num_q_heads_per_kv_head % 2 == 0 else 16


def get_tuned_block_sizes(
    q_dtype,
    kv_dtype,
    num_q_heads_per_blk,
    num_kv_heads_per_blk,
    head_dim,
    page_size,
    max_num_batched_tokens,
    pages_per_seq,
    *,
    info=None,
) -> tuple[int, int]:
    """``(num_kv_pages_per_block, num_queries_per_block)``: the chip's measured row when there is
    one, else 2 MiB of keys and values per KV block (less on chips with less than 64 MiB of
    VMEM: ``ops._policy``) and ``SCORE_ROWS`` score rows per query block. ``info``: the
    chip's facts. Without ``info`` (JAX's call) this host's TPU is asked, and a host without a
    TPU of generation 4 or later raises ``NotImplementedError`` as JAX's function does;
    ``ragged_paged_attention`` passes ``pltpu.get_tpu_info()``, the chip it traces for."""
    if info is None:
        version = get_tpu_version()
        if version < 4:
            raise NotImplementedError(
                f"get_tuned_block_sizes: the TPU version must be 4 or higher, this host's first device "
                f"is {_device_kind()!r}; pass info=pltpu.get_tpu_info(chip) for a chip's sizes"
            )
        info = pltpu.get_tpu_info()
    exact = (q_dtype, kv_dtype, num_q_heads_per_blk, num_kv_heads_per_blk, head_dim, page_size,
             max_num_batched_tokens, pages_per_seq)  # fmt: skip
    pages, queries = _policy.choose(_OP, simplify_key(exact), lambda chip, _: _rule(chip, *exact), info)
    return int(min(pages, pages_per_seq)), int(queries)


def _rule(chip, q_dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size, tokens, pages_per_seq):
    """The policy's KV block bytes (2 MiB, less on a small VMEM: in flight while the block before
    is computed) of keys and values per KV block, and ``SCORE_ROWS`` score rows per query block."""
    token_bytes = 2 * kv_heads * head_dim * jnp.dtype(kv_dtype).itemsize
    pages = max(1, _policy.vmem_budget(_OP, chip) // (token_bytes * page_size))
    groups = max(1, q_heads // kv_heads)
    window = query_window(groups)
    queries = max(window, min(next_power_of_2(max(SCORE_ROWS // groups, 1)), 256))
    return pages, min(queries, max(window, next_power_of_2(tokens)))


def get_min_page_size(max_model_len: int, min_page_size: int = 16) -> int:
    """A page size that keeps a sequence's page list within ``MAX_PAGES_PER_SEQ`` entries."""
    return max(next_power_of_2(max_model_len) // MAX_PAGES_PER_SEQ, min_page_size)
