"""Mosaic rules for ``lax.sort`` (``jnp.sort``, ``jnp.argsort``, multi-operand
sorts) and ``lax.rev`` (``jnp.flip``, descending sorts).

Mosaic's ``tpu.sort`` is a hardware sort of one vreg's keys and values with a
mask, which ``run_mosaic`` does not run; the rule instead lowers a bitonic
sorting network through ``lower_fun``: ``log2(n) * (log2(n) + 1) / 2`` stages,
each a reshape that pairs element ``i`` with ``i ^ j``, a lexicographic compare
of the keys and selects. Keys compare in ``lax.sort``'s total order (floats
through the integer key that puts -NaN first and NaN last, -0 == 0). A size that
is not a power of two is padded (a leading "padding" key sorts it last); a
stable sort adds the element index as the last key, so ties keep their order.
``rev`` along a dim of size ``2**m`` flips each of the ``m`` bits of the index:
``m`` reshapes that swap two halves (padded to a power of two, then sliced).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_tpu._src.lowering import lower_fun, register_lowering

_SIGNED = {2: jnp.int16, 4: jnp.int32}


def sort_key(x):
    """``x`` as a key whose order is ``lax.sort``'s (floats: a signed integer)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        signed = _SIGNED.get(jnp.dtype(x.dtype).itemsize)
        if signed is None:
            raise NotImplementedError(f"sorting {jnp.dtype(x.dtype).name}")
        x = jnp.where(x == 0, jnp.zeros_like(x), x)
        x = jnp.where(jnp.isnan(x), jnp.full_like(x, np.nan), x)
        s = lax.bitcast_convert_type(x, signed)
        return jnp.where(s < 0, jnp.array(jnp.iinfo(signed).max, signed) - s, s)
    if x.dtype == jnp.bool_:
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


def _iota(shape, dim):
    full = (1,) * (2 - len(shape)) + tuple(shape)  # Mosaic's iota is at least 2-D
    return lax.broadcasted_iota(jnp.int32, full, dim + len(full) - len(shape)).reshape(shape)


def bitonic_sort(operands, *, num_keys: int, is_stable: bool):
    """``lax.sort(operands, dimension=-1, num_keys=num_keys)`` as a sorting network."""
    n = operands[0].shape[-1]
    N = 1 << max(n - 1, 0).bit_length()
    keys = [sort_key(x) for x in operands[:num_keys]]
    values = list(operands)
    lead = operands[0].shape[:-1]
    if N != n:
        pad = [(0, 0)] * len(lead) + [(0, N - n)]
        keys = [jnp.pad(k, pad) for k in keys]
        values = [jnp.pad(v, pad) for v in values]
        keys.insert(0, (_iota((*lead, N), len(lead)) >= n).astype(jnp.int32))
    if is_stable or N != n:
        keys.append(_iota((*lead, N), len(lead)))
    arrays = keys + values
    k = 2
    while k <= N:
        j = k // 2
        while j >= 1:
            split = [a.reshape(*lead, N // (2 * j), 2, j) for a in arrays]
            lo = [a[..., 0, :] for a in split]
            hi = [a[..., 1, :] for a in split]
            block = _iota((*lead, N // (2 * j), j), len(lead)) * (2 * j)
            ascending = (block & k) == 0
            swap = _less(hi[: len(keys)], lo[: len(keys)]) == ascending
            new_lo = [jnp.where(swap, h, lo_) for lo_, h in zip(lo, hi)]
            new_hi = [jnp.where(swap, lo_, h) for lo_, h in zip(lo, hi)]
            arrays = [
                jnp.stack([a, b], axis=-2).reshape(*lead, N) for a, b in zip(new_lo, new_hi, strict=True)
            ]
            j //= 2
        k *= 2
    return [v[..., :n] for v in arrays[len(keys) :]]


@register_lowering(lax.sort_p)
def _sort(ctx, *operands, dimension, is_stable, num_keys):
    rank = len(ctx.avals_in[0].shape)

    def fn(*xs):
        if dimension == rank - 1:
            return bitonic_sort(xs, num_keys=num_keys, is_stable=is_stable)
        moved = [jnp.moveaxis(x, dimension, -1) for x in xs]
        outs = bitonic_sort(moved, num_keys=num_keys, is_stable=is_stable)
        return [jnp.moveaxis(o, -1, dimension) for o in outs]

    return lower_fun(fn, ctx, *operands, multiple_results=True)


def reverse_last(x):
    """``x`` reversed along its last dim."""
    n = x.shape[-1]
    N = 1 << max(n - 1, 0).bit_length()
    lead = x.shape[:-1]
    if N != n:
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, N - n)])
    s = 1
    while s < N:
        pairs = x.reshape(*lead, N // (2 * s), 2, s)
        x = jnp.concatenate([pairs[..., 1:, :], pairs[..., :1, :]], axis=-2).reshape(*lead, N)
        s *= 2
    return x[..., N - n :]


@register_lowering(lax.rev_p)
def _rev(ctx, x, *, dimensions):
    def fn(x):
        for d in dimensions:
            x = jnp.moveaxis(reverse_last(jnp.moveaxis(x, d, -1)), -1, d)
        return x

    return lower_fun(fn, ctx, x)
