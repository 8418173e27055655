"""A plain-JAX reference of paged attention's arithmetic: ``grouped_query_attention_reference``
with the name and arguments of JAX's ``ops.tpu.paged_attention.util``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_tpu.ops.paged_attention import quantization_utils

#: The logit the reference gives keys past a sequence's length.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.dtype("float32")).max)


def grouped_query_attention_reference(
    queries: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    seq_lens: jax.Array,
    soft_cap: float | None = None,
    debug: bool = False,
) -> jax.Array:
    """One query per sequence against contiguous keys and values, in float32.

    Args:
      queries: ``[batch, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[batch, num_kv_heads, max_seq_len, head_dim]`` (the pages of each
        sequence laid end to end), arrays or ``QuantizedTensor``.
      seq_lens: ``int32[batch]``: keys at positions ``>= seq_lens[b]`` are masked.
      soft_cap: logits become ``tanh(logits / soft_cap) * soft_cap`` when set (and not 0).
      debug: print the logits and probabilities.

    Returns:
      ``[batch, num_q_heads, head_dim]`` in the dtype of ``v_pages``' values.
    """
    if isinstance(k_pages, quantization_utils.QuantizedTensor):
        k_pages = quantization_utils.unquantize_from_int8(k_pages, dtype=jnp.float32)
    if isinstance(v_pages, quantization_utils.QuantizedTensor):
        v_pages = quantization_utils.unquantize_from_int8(v_pages, dtype=jnp.float32)
    batch, num_q_heads, head_dim = queries.shape
    _, num_kv_heads, max_seq_len, _ = k_pages.shape
    if k_pages.shape != v_pages.shape or k_pages.shape[0] != batch or k_pages.shape[-1] != head_dim:
        raise ValueError(
            f"shapes do not agree: queries {queries.shape}, k {k_pages.shape}, v {v_pages.shape}"
        )
    groups = num_q_heads // num_kv_heads
    q = queries.reshape(batch, num_kv_heads, groups, head_dim).astype(jnp.float32)
    logits = jnp.einsum("bkgd,bktd->bkgt", q, k_pages.astype(jnp.float32))
    if soft_cap is not None and soft_cap != 0.0:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    valid = jnp.arange(max_seq_len)[None, :] < seq_lens[:, None]
    logits = logits + jnp.where(valid, 0.0, MASK_VALUE)[:, None, None, :]
    if debug:
        jax.debug.print("logits: {}", logits)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_pages.dtype)
    if debug:
        jax.debug.print("probabilities: {}", probs)
    out = jnp.einsum("bkgt,bktd->bkgd", probs, v_pages)
    return out.reshape(batch, num_q_heads, head_dim)
