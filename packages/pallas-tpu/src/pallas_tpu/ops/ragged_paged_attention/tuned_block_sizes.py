"""Block sizes of ``ragged_paged_attention`` when the caller gives none: the names of JAX's
``ops.tpu.ragged_paged_attention.tuned_block_sizes``, with a rule from the chip's facts
(``pltpu.get_tpu_info()``) in place of JAX's table; no block sizes have been measured on a chip
for this kernel yet, so ``TUNED_BLOCK_SIZES`` is empty."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

import pallas_tpu as pltpu

# A sequence's pages per compute block at most: the page table of a block is read from SMEM.
MAX_PAGES_PER_SEQ = 16
# (chip name, key of ``simplify_key``) -> (num_kv_pages_per_block, num_queries_per_block).
TUNED_BLOCK_SIZES: dict[str, dict[tuple, tuple[int, int]]] = {}
# Bytes of one KV block (all heads' K and V): what is in flight while the block before is
# computed (a v5e moves ~0.82 MB/us from HBM).
KV_BLOCK_BYTES = 2 << 20
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
    """``(num_kv_pages_per_block, num_queries_per_block)``: the table's entry for the chip when
    there is one, else ``KV_BLOCK_BYTES`` of keys and values per KV block (halved on chips with
    less than 64 MiB of VMEM) and ``SCORE_ROWS`` score rows per query block. ``info``: the
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
    key = simplify_key(
        (q_dtype, kv_dtype, num_q_heads_per_blk, num_kv_heads_per_blk, head_dim, page_size,
         max_num_batched_tokens, pages_per_seq)
    )  # fmt: skip
    entry = TUNED_BLOCK_SIZES.get(f"TPU v{info.generation}", {}).get(key)
    if entry is not None:
        return min(entry[0], pages_per_seq), entry[1]
    budget = KV_BLOCK_BYTES if info.vmem_capacity_bytes >= 64 << 20 else KV_BLOCK_BYTES // 2
    token_bytes = 2 * num_kv_heads_per_blk * head_dim * jnp.dtype(kv_dtype).itemsize
    pages = max(1, budget // (token_bytes * page_size))
    groups = max(1, num_q_heads_per_blk // num_kv_heads_per_blk)
    window = query_window(groups)
    queries = max(window, min(next_power_of_2(max(SCORE_ROWS // groups, 1)), 256))
    queries = min(queries, max(window, next_power_of_2(max_num_batched_tokens)))
    return int(min(pages, pages_per_seq)), int(queries)


def get_min_page_size(max_model_len: int, min_page_size: int = 16) -> int:
    """A page size that keeps a sequence's page list within ``MAX_PAGES_PER_SEQ`` entries."""
    return max(next_power_of_2(max_model_len) // MAX_PAGES_PER_SEQ, min_page_size)
