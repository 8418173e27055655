"""Symmetric int8 quantization of KV pages for ``paged_attention``: the names of JAX's
``ops.tpu.paged_attention.quantization_utils``.

A row (the last axis) of ``x`` is stored as int8 codes ``round(x * 127.5 / s)`` beside its
scale ``s = max |x|`` over the row, and read back as ``code * s / 127.5``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

P = jax.sharding.PartitionSpec
#: A row's scale maps to this code: codes are ``round(x * MAX_INT8 / scale)``.
MAX_INT8 = 127.5


class QuantizedTensor(NamedTuple):
    """int8 codes and the scales they were taken with.

    Attributes:
      weight: the int8 codes.
      scales: the scale of each row of ``weight`` (its last axis of size 1, or broadcast).
    """

    weight: jnp.ndarray
    scales: jnp.ndarray


def to_int8(x: jnp.ndarray, h: jnp.ndarray) -> jnp.ndarray:
    """The int8 codes of ``x`` at scale ``h`` (``h`` broadcasts against ``x``)."""
    return jnp.rint(x * (MAX_INT8 / h)).astype(jnp.int8)


def from_int8(x: jnp.ndarray, h: jnp.ndarray, dtype: jax.typing.DTypeLike = jnp.bfloat16) -> jnp.ndarray:
    """The values of int8 codes ``x`` taken at scale ``h``, as ``dtype``."""
    return x.astype(dtype) * h / MAX_INT8


def get_quantization_scales(x: jnp.ndarray) -> jnp.ndarray:
    """Each row's largest magnitude: ``x``'s shape with the last axis kept as 1."""
    return jnp.abs(x).max(axis=-1, keepdims=True)


def quantize_to_int8(x: jnp.ndarray) -> QuantizedTensor:
    """``x`` as int8 codes with one scale per row."""
    scales = get_quantization_scales(x)
    return QuantizedTensor(weight=to_int8(x, scales), scales=scales)


def unquantize_from_int8(x: QuantizedTensor, dtype: jax.typing.DTypeLike = jnp.bfloat16) -> jnp.ndarray:
    """The values a ``QuantizedTensor`` stands for, as ``dtype``."""
    return from_int8(x.weight, x.scales, dtype)
