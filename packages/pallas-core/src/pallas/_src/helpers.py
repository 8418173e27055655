"""Small helpers of JAX's Pallas module, kept for API parity."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pallas._src import primitives


def align_to(x: int, alignment: int) -> int:
    """``x`` rounded up to a multiple of ``alignment``."""
    return -(-x // alignment) * alignment


def strides_from_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def empty_ref_like(x: Any) -> Any:
    """A scratch shape (for ``run_scoped``/``scratch_shapes``) like ``x``."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def with_scoped(*types: Any, **kw_types: Any) -> Callable[[Callable[..., Any]], Any]:
    """Decorator form of ``pl.run_scoped``: calls the function at once with
    freshly allocated Refs and binds its name to the result."""

    def decorator(f):
        return primitives.run_scoped(f, *types, **kw_types)

    return decorator
