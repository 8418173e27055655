"""Mosaic rules for ``jax.random`` with threefry keys inside a kernel.

A key array is its key data (``key<fry>[n]`` is a ``uint32[n, 2]``, see
``lowering.py``). The PRNG primitives (``random_seed``, ``random_split``,
``random_fold_in``, ``random_bits``, ``random_wrap/unwrap``) and the hash
itself (``threefry2x32``, ``iota_2x32_shape``) are lowered through ``lower_fun``
of the ``jnp`` definitions below: Threefry-2x32 is 20 rounds of 32-bit adds,
rotations and xors (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC 2011), which every Mosaic target has. They follow JAX's
``jax_threefry_partitionable`` scheme (the default since JAX 0.5): a key
hashes the 64-bit linear index of each element of the requested shape, so
the bits equal those ``jax.random`` gives outside a kernel.

Pallas keys (``pltpu.to_pallas_key``, the ``pallas_tpu_key`` implementation,
key data ``uint32[*keys, 1, 2]``) lower as pallas_tpu's interpret mode runs
them (``language/random.py``): ``random_bits`` reseeds the core's PRNG with the two key
words (``tpu.prng_set_seed_32``) and draws ``tpu.prng_random_bits`` (narrow
widths are the low bits of 32-bit words, as threefry's), ``split`` is the
threefry definition above on the key data, and ``fold_in`` is JAX's Pallas-key
mix (the data added to the second word, one Threefry round).

Structural primitives on key arrays (``unstack`` after ``split``, slicing,
reshapes, broadcasts, loops and conds carrying keys) lower on the key data:
``key_params`` says how each one's params change (the key's trailing dim).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_tpu._src import compat
from pallas_tpu._src.language import random as tpu_random
from pallas_tpu._src.mosaic.lowering import (
    key_params,
    key_rules,
    lower_fun,
    physical,
    register_lowering,
)

_PRIMS = compat.random_primitives()
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # Threefry's key-schedule constant


# ---------------------------------------------------------------------------
# The jnp definitions (uint32 arithmetic)


def _rotl(v, r: int):
    return lax.shift_left(v, np.uint32(r)) | lax.shift_right_logical(v, np.uint32(32 - r))


def threefry2x32(k1, k2, x0, x1):
    """Threefry-2x32 of the counters ``(x0, x1)`` under the key ``(k1, k2)``
    (uint32 arrays, broadcast against each other); returns the two output words."""
    k1, k2, x0, x1 = jnp.broadcast_arrays(*(jnp.asarray(a, jnp.uint32) for a in (k1, k2, x0, x1)))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(group + 1) % 3]
        x1 = x1 + ks[(group + 2) % 3] + np.uint32(group + 1)
    return x0, x1


def iota_2x32(shape):
    """The 64-bit linear index of each element of ``shape`` as (hi, lo) uint32 words."""
    if math.prod(shape) >= 2**31:
        raise NotImplementedError(f"random values of shape {shape}: more than 2**31 elements")
    full = (1,) * (2 - len(shape)) + tuple(shape)  # Mosaic's iota is at least 2-D
    lo = jnp.zeros(full, jnp.int32)
    stride = 1
    for d in range(len(full) - 1, -1, -1):
        lo = lo + lax.broadcasted_iota(jnp.int32, full, d) * stride
        stride *= full[d]
    return jnp.zeros(shape, jnp.uint32), lo.reshape(shape).astype(jnp.uint32)


def _hash_shape(data, shape):
    """The two hash words of every key in ``data`` (``[*keys, 2]``) for each
    element of ``shape``: arrays of shape ``[*keys, *shape]``."""
    keys = data.shape[:-1]
    hi, lo = iota_2x32(tuple(shape)) if shape else (np.uint32(0), np.uint32(0))
    ones = (1,) * len(shape)
    k1 = data[..., 0].reshape(keys + ones)
    k2 = data[..., 1].reshape(keys + ones)
    return threefry2x32(k1, k2, hi, lo)


def seed(seeds):
    """Key data of integer seeds (of at most 32 bits: the high word is 0)."""
    if jnp.dtype(seeds.dtype).itemsize > 4:
        raise NotImplementedError("64-bit seeds")
    lo = seeds.astype(jnp.uint32)
    return jnp.stack([jnp.zeros_like(lo), lo], axis=-1)


def split(data, shape):
    y0, y1 = _hash_shape(data, shape)
    return jnp.stack([y0, y1], axis=-1)


def fold_in(data, msgs, out_shape):
    data = jnp.broadcast_to(data, (*out_shape, 2))
    y0, y1 = threefry2x32(data[..., 0], data[..., 1], np.uint32(0), jnp.broadcast_to(msgs, out_shape))
    return jnp.stack([y0, y1], axis=-1)


def random_bits(data, bit_width, shape):
    if bit_width not in (8, 16, 32):
        raise NotImplementedError(f"random bits of {bit_width} bits (Mosaic has 8, 16 and 32)")
    y0, y1 = _hash_shape(data, shape)
    bits = y0 ^ y1
    return bits if bit_width == 32 else bits.astype(f"uint{bit_width}")


# ---------------------------------------------------------------------------
# Rules


# Pallas keys: the key data is [*keys, 1, 2]


def pallas_seed(seeds):
    """Pallas key data of integer seeds: each seed in both words (``_key_seed``)."""
    words = seeds.astype(jnp.int32).astype(jnp.uint32)
    return jnp.broadcast_to(words[..., None, None], (*seeds.shape, 1, 2))


def pallas_fold_in(data, msgs, out_shape):
    """JAX's Pallas-key ``fold_in`` (``tpu_random.mix_fold_in``), as interpret mode runs it."""
    data = jnp.broadcast_to(data[..., 0, :], (*out_shape, 2))
    k0, k1 = tpu_random.mix_fold_in(data[..., 0], data[..., 1], jnp.broadcast_to(msgs, out_shape))
    return jnp.stack([k0, k1], axis=-1)[..., None, :]


def pallas_split(data, shape):
    keys = data.shape[:-2]
    flat = split(data[..., 0, :], (math.prod(shape),))
    return flat.reshape(*keys, *shape, 1, 2)


def pallas_random_bits(data, bit_width, shape):
    """``prng_seed(k0, k1)`` then ``prng_random_bits`` for each key of ``data``
    (the TPU draws rank >= 2 shapes: a lower rank draws ``(1, ..., *shape)``)."""
    if bit_width not in (8, 16, 32):
        raise NotImplementedError(f"random bits of {bit_width} bits (Mosaic has 8, 16 and 32)")
    keys = data.shape[:-2]
    drawn = (1,) * (2 - len(shape)) + tuple(shape)
    flat = data.reshape(-1, 2)
    outs = []
    for k in range(flat.shape[0]):
        tpu_random.prng_seed(flat[k, 0], flat[k, 1])
        bits = lax.bitcast_convert_type(tpu_random.prng_random_bits(drawn), jnp.uint32)
        bits = bits if bit_width == 32 else bits.astype(f"uint{bit_width}")
        outs.append(bits.reshape(shape))
    return jnp.stack(outs).reshape(*keys, *shape) if keys else outs[0]


def _kind(aval) -> str:
    """``"threefry"`` or ``"pallas"``: the implementation of a key aval's keys."""
    impl = compat.key_impl(aval.dtype)
    if impl.name == compat.prng_spec_impl(tpu_random.pallas_key_impl).name:
        return "pallas"
    if impl.name != "threefry2x32":
        raise NotImplementedError(
            f"PRNG keys of the '{impl.name}' implementation; kernels lower threefry2x32 keys "
            "(jax.random.key(seed)), Pallas keys (pltpu.to_pallas_key) or the stateful "
            "pltpu.prng_seed / prng_random_bits"
        )
    if not jax.config.jax_threefry_partitionable:
        raise NotImplementedError(
            "jax_threefry_partitionable=False (kernels follow the partitionable scheme)"
        )
    return "threefry"


def _key_rule(prim_name):
    def decorator(rule):
        p = _PRIMS[prim_name]
        key_rules.add(p)
        return register_lowering(p)(rule)

    return decorator


@_key_rule("random_seed")
def _random_seed(ctx, seeds, *, impl):
    pallas = _kind(ctx.avals_out[0]) == "pallas"
    return lower_fun(pallas_seed if pallas else seed, ctx, seeds)


@_key_rule("random_split")
def _random_split(ctx, keys, *, shape, out_sharding=None):  # out_sharding: JAX 0.12.1, None in a kernel
    fn = pallas_split if _kind(ctx.avals_in[0]) == "pallas" else split
    return lower_fun(fn, ctx, keys, shape=tuple(shape), avals_in=[physical(ctx.avals_in[0])])


@_key_rule("random_fold_in")
def _random_fold_in(ctx, keys, msgs):
    keys_aval, msgs_aval = ctx.avals_in
    fn = pallas_fold_in if _kind(keys_aval) == "pallas" else fold_in
    out_shape = tuple(ctx.avals_out[0].shape)
    avals = [physical(keys_aval), msgs_aval.update(dtype=jnp.uint32)]
    if msgs_aval.dtype != jnp.uint32:
        raise NotImplementedError(f"fold_in of {msgs_aval.dtype} data (jax.random.fold_in passes uint32)")
    return lower_fun(fn, ctx, keys, msgs, out_shape=out_shape, avals_in=avals)


@_key_rule("random_bits")
def _random_bits(ctx, keys, *, bit_width, shape, num_streams=1, out_sharding=None):
    # JAX 0.12.1's random_bits has one result per stream (num_streams, out_sharding); older ones one.
    if num_streams != 1:
        raise NotImplementedError(
            f"random_bits of {num_streams} streams (jax.random.normal(mode='highest'), ...): draw the "
            "streams from keys split with jax.random.split instead"
        )
    fn = pallas_random_bits if _kind(ctx.avals_in[0]) == "pallas" else random_bits
    bits = lower_fun(
        fn, ctx, keys, bit_width=bit_width, shape=tuple(shape), avals_in=[physical(ctx.avals_in[0])]
    )
    return [bits] if ctx.eqn.primitive.multiple_results else bits


@_key_rule("random_wrap")
def _random_wrap(ctx, data, *, impl):
    _kind(ctx.avals_out[0])
    return data


@_key_rule("random_unwrap")
def _random_unwrap(ctx, keys):
    _kind(ctx.avals_in[0])
    return keys


@register_lowering(_PRIMS["threefry2x32"])
def _threefry2x32(ctx, k1, k2, x0, x1):
    return lower_fun(lambda *a: list(threefry2x32(*a)), ctx, k1, k2, x0, x1, multiple_results=True)


@register_lowering(_PRIMS["iota_2x32_shape"])
def _iota_2x32_shape(ctx, *, shape):
    return lower_fun(lambda: list(iota_2x32(tuple(shape))), ctx, multiple_results=True)


# ---------------------------------------------------------------------------
# Structural primitives on key arrays: their params on the key data


def _same(params, avals_in, avals_out):
    return params


def _trailing(avals_out) -> tuple:
    return tuple(physical(avals_out[0]).shape[len(avals_out[0].shape) :])


def _slice(params, avals_in, avals_out):
    t = _trailing(avals_out)
    strides = params.get("strides")
    return dict(
        params,
        start_indices=(*params["start_indices"], *(0 for _ in t)),
        limit_indices=(*params["limit_indices"], *t),
        strides=None if strides is None else (*strides, *(1 for _ in t)),
    )


def _broadcast_in_dim(params, avals_in, avals_out):
    t = _trailing(avals_out)
    n = len(params["shape"])
    dims = (*params["broadcast_dimensions"], *range(n, n + len(t)))
    return dict(params, shape=(*params["shape"], *t), broadcast_dimensions=dims)


def _reshape(params, avals_in, avals_out):
    if params.get("dimensions"):
        raise NotImplementedError("reshape with dimensions")
    return dict(params, new_sizes=(*params["new_sizes"], *_trailing(avals_out)))


def _transpose(params, avals_in, avals_out):
    n = len(params["permutation"])
    t = _trailing(avals_out)
    return dict(params, permutation=(*params["permutation"], *range(n, n + len(t))))


def _select_n(params, avals_in, avals_out):
    if avals_in[0].shape:
        raise NotImplementedError("an array predicate (select keys with a scalar predicate)")
    return params


key_params.update(
    {
        lax.slice_p: _slice,
        lax.broadcast_in_dim_p: _broadcast_in_dim,
        lax.reshape_p: _reshape,
        lax.squeeze_p: _same,
        lax.transpose_p: _transpose,
        lax.concatenate_p: _same,
        lax.unstack_p: _same,
        lax.select_n_p: _select_n,
        lax.copy_p: _same,
        compat.cond_p: _same,
        compat.while_p: _same,
        compat.scan_p: _same,
    }
)
for _prim, _ in compat.call_primitives():
    key_params[_prim] = _same
