"""Small helpers of JAX's Pallas module, kept for API parity."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallas._src import errors, primitives


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


@dataclasses.dataclass(frozen=True)
class SelectedRef:
    """One of ``refs``, chosen by the traced scalar ``idx`` when the kernel runs
    (``pl.select_ref``). DMAs take it as a source or destination."""

    idx: Any
    refs: tuple[Any, ...]


def select_ref(idx: Any, *refs: Any) -> SelectedRef:
    """Selects a Ref from ``refs`` by the runtime value of the scalar ``idx``
    (0 the first), as JAX's ``pl.select_ref``: for DMA sources and
    destinations (``pltpu.async_copy``, ``make_async_copy``, ``sync_copy``,
    remote copies). The Refs, or ``.at[...]`` views of them, must have the same
    shape, dtype and memory space. An ``idx`` out of range selects the last.

    Args:
      idx: an integer scalar (traced or not).
      *refs: two or more Refs or views.

    Returns:
      A selected Ref, for the DMA helpers of a backend.
    """
    if len(refs) <= 1:
        raise errors.kernel_error(ValueError, "At least two refs are required for pl.select_ref.")
    idx = jnp.asarray(idx)
    if idx.shape != () or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise errors.kernel_error(
            TypeError, f"pl.select_ref: idx must be an integer scalar, got {idx.dtype}{list(idx.shape)}"
        )
    if any(isinstance(r, SelectedRef) for r in refs):
        raise errors.kernel_error(TypeError, "pl.select_ref: the Refs to select from cannot be selected Refs")
    return SelectedRef(idx.astype(jnp.int32), tuple(refs))


def lower_as_mlir(
    f: Callable[..., Any],
    *args: Any,
    dynamic_shapes: bool = False,
    device: Any = None,
    static_argnames: Sequence[str] = (),
    platforms: Sequence[str] | None = None,
    **kwargs: Any,
) -> str:
    """The StableHLO text of ``f(*args, **kwargs)`` exported with ``jax.export`` for
    ``platforms`` (default ``["tpu"]``), as JAX's ``pl.lower_as_mlir``: a debugging aid
    (the kernels appear as their backend's custom calls), with no stability promise.
    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s, with symbolic dimensions
    (``jax.export.symbolic_shape``) where the grid follows them.

    ``dynamic_shapes=True`` (JAX: blocks whose shapes are symbolic) is not supported:
    block shapes must be static here.
    """
    if not isinstance(dynamic_shapes, bool):
        name = getattr(f, "__name__", None) or type(f).__name__
        raise TypeError(
            f"pl.lower_as_mlir of '{name}' at {errors.user_source()}: dynamic_shapes must be a bool, "
            f"got {dynamic_shapes!r} ({type(dynamic_shapes).__name__}); a string such as 'no' would "
            f"read as True"
        )
    if dynamic_shapes:
        raise NotImplementedError(
            "pl.lower_as_mlir(dynamic_shapes=True): blocks of symbolic shape are not supported; "
            "symbolic array shapes with static block shapes export without it"
        )
    platforms = _platform_list(platforms, f)
    jitted = jax.jit(f, device=device, static_argnames=tuple(static_argnames))
    exported = jax.export.export(jitted, platforms=platforms)(*args, **kwargs)
    return exported.mlir_module()


def _platform_list(platforms: Any, f: Callable[..., Any]) -> list[str]:
    """``lower_as_mlir``'s ``platforms``, checked: None means ``["tpu"]``; a str would be
    read letter by letter and an empty list would mean the default backend."""
    name = getattr(f, "__name__", None) or type(f).__name__
    where = f"pl.lower_as_mlir of '{name}' at {errors.user_source()}: platforms"
    if platforms is None:
        return ["tpu"]
    if isinstance(platforms, str):
        raise TypeError(
            f"{where}: expected a list of platform names, got the str {platforms!r}: "
            f"write platforms=[{platforms!r}]"
        )
    platforms = list(platforms)
    if not platforms:
        raise ValueError(f"{where}: expected at least one platform name (e.g. ['tpu']), got an empty list")
    bad = [p for p in platforms if not isinstance(p, str)]
    if bad:
        raise TypeError(f"{where}: expected platform names (str, e.g. 'tpu'), got {bad[0]!r}")
    return platforms
