"""Chip and dtype helpers with the names of JAX's ``megablox.common``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tpu as pltpu


def is_tpu() -> bool:
    """Whether the default (or abstract) device is a TPU."""
    return pltpu.is_tpu_device()


def tpu_kind() -> str:
    """The ``device_kind`` of the default device (``"TPU v5 lite"``)."""
    return jax.devices()[0].device_kind


def tpu_generation() -> int:
    """The generation of the attached TPU (5 for a v5e)."""
    if not is_tpu():
        raise NotImplementedError(f"tpu_generation: the default device is not a TPU ({tpu_kind()})")
    return pltpu.get_tpu_info().generation


def supports_bfloat16_matmul() -> bool:
    """Whether the MXU takes bfloat16 operands (TPU v4 on; True off a TPU)."""
    return not is_tpu() or pltpu.get_tpu_info().is_matmul_supported(jnp.bfloat16, jnp.bfloat16)


def assert_is_supported_dtype(dtype) -> None:
    """Raises ValueError unless ``dtype`` is bfloat16 or float32."""
    if np.dtype(dtype) not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
        raise ValueError(f"megablox takes bfloat16 or float32 arrays, got {np.dtype(dtype)}")


def select_input_dtype(lhs, rhs):
    """The dtype both operands reach the MXU in: bfloat16 when both are and the chip
    multiplies it, else float32."""
    both_bf16 = lhs.dtype == rhs.dtype == jnp.bfloat16
    return jnp.bfloat16 if both_bf16 and supports_bfloat16_matmul() else jnp.float32
