"""Paged attention for decoding (the name and signature of JAX's ``ops.tpu.paged_attention``):
``paged_attention(q, k_pages, v_pages, lengths, page_indices, *, ...)``; int8 pages through
``quantization_utils.QuantizedTensor``; a plain-JAX reference in ``util``."""

from pallas_tpu.ops.paged_attention.paged_attention_kernel import paged_attention as paged_attention
