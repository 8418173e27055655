"""Small helpers that jax-triton 0.4 users import from ``jax_triton``."""

from __future__ import annotations

import numpy as np


def cdiv(a: int, b: int) -> int:
    """Ceiling division, for grids: ``cdiv(n, BLOCK)`` programs cover n."""
    return (a + b - 1) // b


def next_power_of_2(x: int) -> int:
    """Smallest power of two >= x (Triton block sizes must be powers of 2)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def strides_from_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape`` (JAX's layout)."""
    size = int(np.prod(shape)) if shape else 1
    strides = []
    for s in shape:
        size = size // s if s else 0
        strides.append(size)
    return tuple(strides)
