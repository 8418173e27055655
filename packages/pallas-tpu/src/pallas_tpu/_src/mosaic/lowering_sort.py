"""Mosaic rules for ``lax.sort`` (``jnp.sort``, ``jnp.argsort``, multi-operand
sorts) and ``lax.rev`` (``jnp.flip``, descending sorts).

Mosaic's ``tpu.sort`` is a hardware sort of one vreg's keys and values with a
mask, which ``run_mosaic`` does not run; the rule instead lowers a bitonic
sorting network through ``lower_fun``: ``log2(n) * (log2(n) + 1) / 2`` stages,
each pairing element ``i`` with ``i ^ j`` along the sorted dim (two
``pltpu.roll``s by ``j`` and a select: rotations on the XLU, every vector of the
full shape), a lexicographic compare of the keys and selects. Keys compare in
``lax.sort``'s total order (floats through the integer key that puts -NaN first
and NaN last, -0 == 0). A size that is not a power of two is padded (a leading
"padding" key sorts it last); a stable sort adds the element index as the last
key, so ties keep their order. ``rev`` along a dim of size ``2**m`` flips each of
the ``m`` bits of the index the same way (padded to a power of two, then
sliced). Pairing by reshapes (``(..., n // 2j, 2, j)``) instead gives vectors
whose minor dims are a few lanes wide, which Mosaic tiles into many vregs: a
sort of 128 lanes then took minutes and gigabytes to compile.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_tpu._src.language import vector_primitives as vp
from pallas_tpu._src.mosaic.lowering import lower_fun, register_lowering

_SIGNED = {2: jnp.int16, 4: jnp.int32}


def sort_key(x):
    """``x`` as a key whose order is ``lax.sort``'s (floats: a signed integer; int32 at least)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        signed = _SIGNED.get(jnp.dtype(x.dtype).itemsize)
        if signed is None:
            raise NotImplementedError(f"sorting {jnp.dtype(x.dtype).name}")
        x = jnp.where(x == 0, jnp.zeros_like(x), x)
        x = jnp.where(jnp.isnan(x), jnp.full_like(x, np.nan), x)
        s = lax.bitcast_convert_type(x, signed)
        x = jnp.where(s < 0, jnp.array(jnp.iinfo(signed).max, signed) - s, s)
    # Narrow keys compare as int32 (the same order): the masks of 16-bit compares, and'ed with
    # the index's 32-bit ones, are a relayout libtpu 0.0.42.1's Mosaic refuses (JAX 0.10.2's).
    if x.dtype == jnp.bool_ or jnp.dtype(x.dtype).itemsize < 4:
        return x.astype(jnp.int32)
    return x


def _less(a_keys, b_keys):
    """Lexicographic ``a < b`` over lists of keys."""
    lt, eq = None, None
    for a, b in zip(a_keys, b_keys, strict=True):
        here = a < b
        lt = here if lt is None else lt | (eq & here)
        eq = (a == b) if eq is None else eq & (a == b)
    return lt


def _partner(x, j: int, axis: int, low):
    """``x[i ^ j]`` along ``axis`` (a power-of-two size), where ``low`` is ``i & j == 0``."""
    n = x.shape[axis]
    return jnp.where(low, vp.roll(x, n - j, axis), vp.roll(x, j, axis))


def _pad_to_pow2(x, axis: int):
    n = x.shape[axis]
    N = 1 << max(n - 1, 0).bit_length()
    if N == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, N - n)
    return jnp.pad(x, pad)


def bitonic_sort(operands, *, num_keys: int, is_stable: bool, axis: int):
    """``lax.sort(operands, dimension=axis, num_keys=num_keys)`` as a sorting network."""
    if operands[0].ndim == 1:  # Mosaic rotates vectors of rank 2 and up
        outs = bitonic_sort([x[None] for x in operands], num_keys=num_keys, is_stable=is_stable, axis=1)
        return [o[0] for o in outs]
    n = operands[0].shape[axis]
    keys = [_pad_to_pow2(sort_key(x), axis) for x in operands[:num_keys]]
    # Bools travel as int32 (Mosaic rotates and selects no i1 vectors).
    values = [_pad_to_pow2(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, axis) for x in operands]
    N = values[0].shape[axis]
    index = lax.broadcasted_iota(jnp.int32, values[0].shape, axis)
    if N != n:
        keys.insert(0, (index >= n).astype(jnp.int32))
    if is_stable or N != n:
        keys.append(index)
    arrays = keys + values
    k = 2
    while k <= N:
        j = k // 2
        while j >= 1:
            low = (index & j) == 0
            partners = [_partner(a, j, axis, low) for a in arrays]
            mine, theirs = arrays[: len(keys)], partners[: len(keys)]
            # The low element of an ascending pair keeps the smaller: it takes its
            # partner's where that is less; the others where their own is less.
            keep_min = low == ((index & k) == 0)
            take = (keep_min & _less(theirs, mine)) | (~keep_min & _less(mine, theirs))
            arrays = [jnp.where(take, b, a) for a, b in zip(arrays, partners, strict=True)]
            j //= 2
        k *= 2
    outs = [lax.slice_in_dim(v, 0, n, axis=axis) for v in arrays[len(keys) :]]
    return [o != 0 if x.dtype == jnp.bool_ else o for o, x in zip(outs, operands, strict=True)]


@register_lowering(lax.sort_p)
def _sort(ctx, *operands, dimension, is_stable, num_keys):
    def fn(*xs):
        return bitonic_sort(xs, num_keys=num_keys, is_stable=is_stable, axis=dimension)

    return lower_fun(fn, ctx, *operands, multiple_results=True)


def reverse(x, axis: int):
    """``x`` reversed along ``axis``: index ``i`` of the padded size ``N`` takes
    ``i ^ s`` for each bit ``s`` of ``N``, which is ``N - 1 - i``."""
    if x.ndim == 1:
        return reverse(x[None], 1)[0]
    if x.dtype == jnp.bool_:  # as int32 (Mosaic rotates and selects no i1 vectors)
        return reverse(x.astype(jnp.int32), axis) != 0
    n = x.shape[axis]
    x = _pad_to_pow2(x, axis)
    N = x.shape[axis]
    index = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    s = 1
    while s < N:
        x = _partner(x, s, axis, (index & s) == 0)
        s *= 2
    return lax.slice_in_dim(x, N - n, N, axis=axis)


@register_lowering(lax.rev_p)
def _rev(ctx, x, *, dimensions):
    def fn(x):
        for d in dimensions:
            x = reverse(x, d)
        return x

    return lower_fun(fn, ctx, x)
