"""The argument checks ``kernel.ragged_paged_attention`` and ``v3.ragged_paged_attention``
share, each raising with the op's name (``op``) and the argument's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

KV_DTYPES = tuple(
    np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
)
Q_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def get_dtype_packing(dtype) -> int:
    """Elements of ``dtype`` in one 32-bit word."""
    return 32 // (np.dtype(dtype).itemsize * 8)


def check_ndim(op: str, name: str, x, ndim: int, layout: str) -> None:
    """``x`` has ``ndim`` dimensions, named by ``layout`` in the message."""
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must be {layout}, got shape {x.shape}")


def check_dtypes(op: str, q_name: str, q_dtype, kv_name: str, kv_dtype) -> None:
    if kv_dtype not in KV_DTYPES:
        raise TypeError(f"{op}: {kv_name} must be one of {[d.name for d in KV_DTYPES]}, got {kv_dtype}")
    if q_dtype not in Q_DTYPES:
        raise TypeError(f"{op}: {q_name} must be float32 or bfloat16, got {q_dtype}")


def check_heads(op: str, num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")


def check_tables(op: str, max_num_seqs: int, **tables) -> None:
    """``tables["cu_q_lens"]`` one longer than the sequences, and every table int32."""
    if tables["cu_q_lens"].shape != (max_num_seqs + 1,):
        raise ValueError(
            f"{op}: cu_q_lens must have shape ({max_num_seqs + 1},), got {tables['cu_q_lens'].shape}"
        )
    for name, x in tables.items():
        if x.dtype != jnp.int32:
            raise ValueError(f"{op}: {name} must be int32, got {x.dtype}")


def check_options(op: str, pages_per_seq: int, *, scales: dict, sliding_window, soft_cap, num_kv_pages_per_block,
                  num_queries_per_block, vmem_limit_bytes, chunk_prefill_size=None) -> None:  # fmt: skip
    """The static options: scales floats, a positive window, a nonzero cap, blocks and limits
    in range (``chunk_prefill_size``: v3's)."""
    for name, scale in scales.items():
        if scale is not None and not isinstance(scale, float):
            raise TypeError(f"{op}: {name} must be a float or None, got {scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, (int, np.integer)) or sliding_window <= 0
    ):
        raise ValueError(f"{op}: sliding_window={sliding_window!r} must be a positive int or None")
    if soft_cap is not None and soft_cap == 0.0:
        raise ValueError(f"{op}: soft_cap={soft_cap!r} must not be 0.0 (None turns the cap off)")
    if chunk_prefill_size is not None and chunk_prefill_size <= 0:
        raise ValueError(f"{op}: chunk_prefill_size={chunk_prefill_size} must be positive")
    if num_kv_pages_per_block is not None and not 0 < num_kv_pages_per_block <= pages_per_seq:
        raise ValueError(
            f"{op}: num_kv_pages_per_block={num_kv_pages_per_block} must be in (0, {pages_per_seq}]"
        )
    if num_queries_per_block is not None and num_queries_per_block <= 0:
        raise ValueError(f"{op}: num_queries_per_block={num_queries_per_block} must be positive")
    if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
        raise ValueError(f"{op}: vmem_limit_bytes={vmem_limit_bytes} must be positive")


def check_sequence(op: str, s: int, q_len: int, kv_len: int) -> None:
    """A sequence's queries are its last ``q_len`` keys' positions: ``0 <= q_len <= kv_len``."""
    if q_len < 0 or q_len > kv_len:
        raise ValueError(
            f"{op}: sequence {s} has {q_len} query tokens and kv_lens {kv_len}: need 0 <= q_len <= kv_len"
        )
