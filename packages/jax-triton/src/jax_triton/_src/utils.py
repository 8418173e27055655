"""Small helpers that jax-triton 0.4 users import from ``jax_triton``."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, cast

import jax
import numpy as np
import triton

import jax_kernel_runtime

if TYPE_CHECKING:
    from types import FrameType


def cdiv(a: int, b: int) -> int:
    """Ceiling division, for grids: ``cdiv(n, BLOCK)`` programs cover n."""
    return (a + b - 1) // b


def next_power_of_2(x: int) -> int:
    """Smallest power of two >= x (Triton block sizes must be powers of 2); 1 for x <= 1."""
    return triton.next_power_of_2(max(int(x), 1))


def strides_from_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape`` (JAX's layout)."""
    size = int(np.prod(shape)) if shape else 1
    strides = []
    for s in shape:
        size = size // s if s else 0
        strides.append(size)
    return tuple(strides)


# pallas-core has the same search (``pallas.backend.user_source``), but jax-triton
# depends on jax and jax-kernel-runtime only, never on Pallas. JAX's own user-frame
# filter (``jax.extend.source_info_util``) is no substitute: its exclusions are
# process-wide (registering our folders would change the frames JAX names in every
# user's locations) and it is public only as formatted text.
# Frames inside these folders are ours, JAX's or the standard library's:
# errors name the innermost frame outside them, the user's line.
_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(cast(str, m.__file__))) + os.sep for m in (jax, jax_kernel_runtime)
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def _is_internal(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    filename = os.path.abspath(filename)
    stdlib = filename.startswith(_STDLIB_DIR) and "site-packages" not in filename
    return stdlib or filename.startswith(_INTERNAL_DIRS)


def user_source() -> str:
    """``file.py:LINE`` of the innermost caller outside jax_triton, JAX and the stdlib."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if not _is_internal(frame.f_code.co_filename):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
