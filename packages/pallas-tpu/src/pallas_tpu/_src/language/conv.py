"""``pltpu.conv`` (JAX 0.12): an N-D convolution of values inside a TPU
kernel, with an optional accumulator it is added to (``acc + conv(lhs, rhs)``).

Its meaning is ``jax.lax.conv_general_dilated`` with the kernel window
flipped along the spatial dimensions that ``window_reversal`` marks, and the
result added to ``acc`` (zeros when it is not given), in ``acc``'s dtype, else
``preferred_element_type``, else ``lhs``'s. Conventions as in
``vector_common.py``: the public function validates at trace time, the
interpret semantics is that ``jnp`` definition, the Mosaic lowering emits
``tpu.conv`` (``lowering_mxu.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive

from pallas_tpu._src import compat
from pallas_tpu._src.language.vector_common import op_error, register_interpret

conv_p = Primitive("conv")
_OP = "conv"


def _ints(value, n: int, arg: str, default: int) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise op_error(TypeError, _OP, f"{arg} must be a sequence of {n} ints, got {value!r}") from None
    if len(out) != n or any(v < 1 for v in out):
        raise op_error(
            ValueError, _OP, f"{arg} must hold {n} positive ints (one per spatial dim), got {value!r}"
        )
    return out


def _dimension_numbers(lhs, rhs, dimension_numbers) -> lax.ConvDimensionNumbers:
    """``dimension_numbers`` checked against the operands' ranks and shapes."""
    if lhs.ndim != rhs.ndim or lhs.ndim < 3:
        raise op_error(
            ValueError, _OP, f"lhs and rhs must have one rank of at least 3, got {lhs.shape} and {rhs.shape}"
        )
    try:
        return lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    except (TypeError, ValueError) as e:
        raise op_error(
            ValueError,
            _OP,
            f"dimension_numbers {dimension_numbers!r} do not fit lhs {lhs.shape} and rhs {rhs.shape}: {e}",
        ) from None


def _pads(padding, lhs, rhs, dn, strides, rhs_dil) -> tuple[tuple[int, int], ...]:
    """One ``(low, high)`` pair per spatial dim: ``padding`` given as pairs, a string
    (``"SAME"``, ``"VALID"``, ``"SAME_LOWER"``) or None (no padding)."""
    n = lhs.ndim - 2
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID", "SAME_LOWER"):
            raise op_error(
                ValueError, _OP, f"padding must be 'SAME', 'VALID' or (low, high) pairs, got {padding!r}"
            )
        window = [(rhs.shape[d] - 1) * r + 1 for d, r in zip(dn.rhs_spec[2:], rhs_dil)]
        return tuple(lax.padtype_to_pads([lhs.shape[d] for d in dn.lhs_spec[2:]], window, strides, padding))
    if padding is None:
        return ((0, 0),) * n
    try:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise op_error(
            TypeError, _OP, f"padding must be a string or (low, high) pairs, got {padding!r}"
        ) from None
    if len(pads) != n:
        raise op_error(ValueError, _OP, f"padding must hold {n} (low, high) pairs, got {padding!r}")
    return pads


def conv(
    lhs: jax.Array,
    rhs: jax.Array,
    acc: jax.Array | None = None,
    *,
    dimension_numbers: Any,
    window_strides: Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] | None = None,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    window_reversal: Sequence[bool] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """A general N-D convolution in a TPU kernel, added to ``acc``.

    Args:
      lhs: the activations (batch, feature and spatial dims).
      rhs: the kernel window (input-feature, output-feature and spatial dims).
      acc: an initial accumulator of the result's shape and dtype, or None (zeros).
      dimension_numbers: three layout strings (``("NHWC", "HWIO", "NHWC")``) or a
        ``lax.ConvDimensionNumbers``.
      window_strides: strides of the spatial dims (default 1).
      padding: ``"SAME"``, ``"VALID"``, or one ``(low, high)`` pair per spatial dim (default 0).
      lhs_dilation: dilation of the activations (default 1).
      rhs_dilation: dilation of the window (atrous rate, default 1).
      window_reversal: per spatial dim, whether the window is flipped (default none).
      feature_group_count: groups of features (grouped convolution).
      batch_group_count: groups of the batch.
      precision: ``lax.Precision.DEFAULT`` or ``HIGHEST`` (None: the default).
      preferred_element_type: the result's dtype when ``acc`` is None.

    Returns:
      ``acc + conv(lhs, rhs)``.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dn = _dimension_numbers(lhs, rhs, dimension_numbers)
    n = lhs.ndim - 2
    strides = _ints(window_strides, n, "window_strides", 1)
    lhs_dil = _ints(lhs_dilation, n, "lhs_dilation", 1)
    rhs_dil = _ints(rhs_dilation, n, "rhs_dilation", 1)
    pads = _pads(padding, lhs, rhs, dn, strides, rhs_dil)
    reversal = (False,) * n if window_reversal is None else tuple(bool(r) for r in window_reversal)
    if len(reversal) != n:
        raise op_error(ValueError, _OP, f"window_reversal must hold {n} bools, got {window_reversal!r}")
    args = (lhs, rhs) if acc is None else (lhs, rhs, jnp.asarray(acc))
    params = dict(
        dimension_numbers=dn,
        window_strides=strides,
        padding=pads,
        lhs_dilation=lhs_dil,
        rhs_dilation=rhs_dil,
        window_reversal=reversal,
        feature_group_count=int(feature_group_count),
        batch_group_count=int(batch_group_count),
        precision=lax.Precision(precision) if isinstance(precision, str) else precision,
        preferred_element_type=None if preferred_element_type is None else jnp.dtype(preferred_element_type),
    )
    jax.eval_shape(lambda *a: conv_p.bind(*a, **params), *args)  # checks acc's shape, eagerly too
    return conv_p.bind(*args, **params)


def _conv_value(lhs, rhs, *acc, window_reversal, preferred_element_type, **params):
    """The convolution alone (no accumulator), in the result's dtype."""
    dn = params["dimension_numbers"]
    flip = [d for d, r in zip(dn.rhs_spec[2:], window_reversal) if r]
    if flip:
        rhs = lax.rev(rhs, flip)
    out_dtype = acc[0].dtype if acc else (preferred_element_type or lhs.dtype)
    return lax.conv_general_dilated(lhs, rhs, preferred_element_type=out_dtype, **params), out_dtype


def _abstract_eval(lhs, rhs, *acc, **params):
    out = jax.eval_shape(lambda a, b: _conv_value(a, b, *acc, **params)[0], lhs, rhs)
    if not acc:
        return compat.shaped_array(out.shape, out.dtype)
    if tuple(acc[0].shape) != tuple(out.shape):
        raise op_error(
            ValueError,
            _OP,
            f"acc has shape {tuple(acc[0].shape)} but the convolution gives {tuple(out.shape)}",
        )
    return compat.shaped_array(acc[0].shape, acc[0].dtype)


def _conv_impl(lhs, rhs, *acc, **params):
    out, _ = _conv_value(lhs, rhs, *acc, **params)
    return acc[0] + out if acc else out


conv_p.def_abstract_eval(_abstract_eval)
register_interpret(conv_p, _conv_impl)
