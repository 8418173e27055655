"""``pl.pad_ref`` (JAX 0.12.1): a view of a Ref with a larger shape, for reads past
its end.

``pl.pad_ref(x_ref, (16, 256))`` of an ``f32[10, 200]`` Ref is an ``f32[16, 256]``
view: element ``(i, j)`` is ``x_ref[i, j]`` inside the Ref and padding outside it.
A kernel can then read whole tiles of a Ref whose shape is not a multiple of the
tile (``view[...]`` or ``view[pl.ds(8, 8), :]``) without reading past the buffer.

What the padding holds: zeros in interpret mode (as in JAX's interpret mode). On
a TPU (Mosaic's ``tpu.memref_pad``) it is whatever the padded memory holds: a
kernel must not depend on it (mask it, or reduce over the valid part only).
Writes through the view land inside the Ref; the part of a write that falls in
the padding is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax, tree_util

from pallas._src import compat, errors


@dataclasses.dataclass(frozen=True)
class PadTransform:
    """The Ref transform of ``pl.pad_ref``: the view's shape ``shape`` (each dim at
    least the Ref's), padded at the end of each dimension."""

    shape: tuple[int, ...]

    def transform_type(self, x: Any) -> Any:
        if isinstance(x, compat.AbstractRef):
            return x.update(inner_aval=self.transform_type(x.inner_aval))
        if isinstance(x, compat.ShapedArray):
            _check_padding(tuple(x.shape), self.shape)
            return x.update(shape=self.shape)
        raise TypeError(f"pl.pad_ref: cannot pad {x}")

    def transform_shape(self, shape):  # JAX 0.10's transform protocol
        if shape is None:
            return None
        _check_padding(tuple(shape), self.shape)
        return self.shape

    def transform_dtype(self, dtype):  # JAX 0.10's transform protocol
        return dtype

    def transform_array(self, x: Any) -> Any:
        """The view of array ``x``: zeros past its end (interpret mode's padding)."""
        config = [(0, p - n, 0) for n, p in zip(x.shape, self.shape)]
        return lax.pad(x, jnp.zeros((), x.dtype), config)

    def undo(self, x: Any) -> Any:
        """Back from the view to the Ref (``x`` the Ref's type): a write keeps the part inside."""
        return _UnpadTransform(tuple(x.shape))

    def pretty_print(self, context: Any) -> Any:
        from jax._src import pretty_printer as pp

        del context
        return pp.text(f"{{pad({list(self.shape)})}}")


@dataclasses.dataclass(frozen=True)
class _UnpadTransform:
    """The inverse of a ``PadTransform``: the first ``shape`` elements of each dim."""

    shape: tuple[int, ...]

    def transform_array(self, x: Any) -> Any:
        return lax.slice(x, (0,) * len(self.shape), self.shape)

    def transform_type(self, x: Any) -> Any:
        if isinstance(x, compat.AbstractRef):
            return x.update(inner_aval=self.transform_type(x.inner_aval))
        return x.update(shape=self.shape)


for _cls in (PadTransform, _UnpadTransform):
    tree_util.register_dataclass(_cls, data_fields=[], meta_fields=["shape"])


def _check_padding(shape: tuple[int, ...], padded: tuple[int, ...]) -> None:
    if len(padded) != len(shape):
        raise errors.kernel_error(
            ValueError,
            f"pl.pad_ref: Padded shape rank {len(padded)} does not match ref rank {len(shape)} "
            f"(the Ref is {list(shape)}; give one size per dimension)",
        )
    for d, (n, p) in enumerate(zip(shape, padded)):
        if n > p:
            raise errors.kernel_error(
                ValueError,
                f"pl.pad_ref: Padded dim {p} cannot be smaller than original dim {n} (dimension {d} "
                f"of a Ref {list(shape)} padded to {list(padded)}: a padded shape is at least the Ref's)",
            )


def pad_ref(ref: Any, shape: tuple[int, ...]) -> Any:
    """A view of ``ref`` with the larger ``shape``, padded at the end of each
    dimension, for reads past the end of ``ref`` (JAX's ``pl.pad_ref``).

    Args:
      ref: a Ref, or a view of one (``ref.at[...]``, ``.reshape``, ``.bitcast``).
      shape: the view's shape: one size per dimension, each at least the Ref's.

    Returns:
      The padded view. Reads of its padding give zeros in interpret mode and
      unspecified values on a TPU; the part of a write in the padding is dropped.
    """
    if not isinstance(ref, compat.TransformedRef) and not isinstance(
        getattr(ref, "aval", None), compat.AbstractRef
    ):
        raise errors.kernel_error(
            TypeError,
            f"pl.pad_ref: ref must be a reference (a kernel's Ref or a view of one), got {type(ref).__name__}",
        )
    try:
        padded = tuple(int(n) for n in shape)
    except TypeError:
        raise errors.kernel_error(
            TypeError, f"pl.pad_ref: shape must be a tuple of ints, got {shape!r}"
        ) from None
    t = PadTransform(padded)
    if isinstance(ref, compat.TransformedRef):
        view = compat.TransformedRef(ref.ref, (*ref.transforms, t))
    else:
        view = compat.TransformedRef(ref, (t,))
    view.shape  # noqa: B018  (checks the padded shape against the Ref's now, not at the first read)
    return view
