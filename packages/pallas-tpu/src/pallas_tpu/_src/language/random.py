"""Random numbers in TPU kernels: the core's stateful PRNG and Pallas keys.

A TPU core has one hidden PRNG state: ``prng_seed(*seeds)`` sets it and each
``prng_random_bits(shape)`` returns fresh bits and advances it. The
``stateful_*`` samplers turn those bits into uniform, normal, Bernoulli
values as ``jax.random`` does. ``to_pallas_key`` makes a key for kernels
(``jax.random.uniform(key, ...)`` inside a kernel works on it), and
``sample_block`` draws, block by block, the same array whatever the block
shape or iteration order.

Interpret-mode model (``interpret=pltpu.InterpretParams()``, its rules in
``interpret/language_rules.py``): the hidden state, the interpreter's
``hidden.named["prng_key"]``, is a uint32[3] array ``[k0, k1, n]``: a
threefry key derived from the seeds (``fold_in`` of each seed into a fixed
key) and a counter. ``prng_random_bits`` returns
``jax.random.bits(fold_in(key(k0, k1), n), shape)`` and increments ``n``.
Results are deterministic per seed and differ between calls and loop
iterations, but they are **not** the bits of a TPU's hardware PRNG: tests
can check determinism and distributions, never exact values against a TPU.
An unseeded state behaves as if seeded with no seeds. Each kernel
invocation starts from that unseeded state, like a core whose kernel never
calls ``prng_seed``.

Pallas keys (key shape (1, 2), like JAX's): ``jax.random.bits(key, shape)``
on a key with data ``[[a, b]]`` gives exactly what ``prng_seed(a, b)`` then
``prng_random_bits(shape)`` gives, as on a TPU, but it is computed without
touching the hidden state (on a TPU it also reseeds the core's PRNG).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Effect, Primitive
from jax.extend.random import define_prng_impl
from jax.interpreters import batching, mlir

from pallas.backend import kernel_error, register_internal_dir
from pallas_tpu._src import compat

register_internal_dir(__file__)

_BASE_KEY = np.array([0x0, 0x5EED], np.uint32)


def _threefry(data) -> jax.Array:
    return jax.random.wrap_key_data(jnp.asarray(data, jnp.uint32).reshape(2), impl="threefry2x32")


def state_from_seeds(seeds: Sequence[Any]) -> jax.Array:
    """The hidden PRNG state (uint32[3]) after ``prng_seed(*seeds)``."""
    key = _threefry(_BASE_KEY)
    for s in seeds:
        key = jax.random.fold_in(key, lax.convert_element_type(s, jnp.uint32))
    return jnp.concatenate([jax.random.key_data(key), jnp.zeros((1,), jnp.uint32)])


def bits_from_state(state: jax.Array, shape: tuple[int, ...], dtype=jnp.uint32) -> jax.Array:
    """The bits ``prng_random_bits`` draws from ``state`` (before advancing)."""
    key = jax.random.fold_in(_threefry(state[:2]), state[2])
    return jax.random.bits(key, shape, dtype)


class PRNGEffect(Effect):
    """Reads and writes the core's hidden PRNG state: keep these ops, in order."""

    __str__ = lambda self: "TpuPRNG"  # noqa: E731


prng_effect = PRNGEffect()
compat.allow_effect_in_kernels(PRNGEffect)


def _needs_engine(name: str):
    def rule(ctx, *args, **params):
        raise NotImplementedError(
            f"pltpu.{name} uses the hidden PRNG state of a TPU core: run the kernel with "
            "pl.pallas_call(..., interpret=pltpu.InterpretParams()) (pallas_tpu's TPU interpreter) "
            "or on a TPU; plain JAX and pallas-core's interpret=True cannot run it"
        )

    return rule


# ---------------------------------------------------------------------- prng_seed

prng_seed_p = Primitive("prng_seed")
prng_seed_p.multiple_results = True


def _seed_scalars(seed) -> list[jax.Array]:
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        if not -(2**31) <= int(seed) < 2**32:
            raise kernel_error(ValueError, f"pltpu.prng_seed: seed {seed} does not fit in 32 bits")
        return [jnp.asarray(np.uint32(int(seed) & 0xFFFFFFFF))]
    seed = jnp.asarray(seed) if not isinstance(seed, jax.Array) else seed
    if jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(seed).reshape(-1)
        return [data[i] for i in range(data.shape[0])]
    if (
        seed.shape != ()
        or not jnp.issubdtype(seed.dtype, jnp.integer)
        or jax.dtypes.itemsize_bits(seed.dtype) > 32
    ):
        raise kernel_error(
            TypeError,
            f"pltpu.prng_seed: seeds must be integer scalars of at most 32 bits or keys, got {seed.dtype}{list(seed.shape)}",
        )
    return [seed]


def prng_seed(*seeds: int | jax.Array) -> None:
    """Seeds the core's hidden PRNG.

    Args:
      *seeds: one or more integer scalars (Python ints or int32/uint32
        arrays), or a Pallas key (``to_pallas_key``); several seeds are mixed
        together.
    """
    if not seeds:
        raise kernel_error(TypeError, "pltpu.prng_seed: needs at least one seed")
    scalars = [s for seed in seeds for s in _seed_scalars(seed)]
    prng_seed_p.bind(*scalars)


@prng_seed_p.def_effectful_abstract_eval
def _prng_seed_abstract_eval(*seeds):
    del seeds
    return [], {prng_effect}


def _prng_seed_batch(args, dims):
    raise kernel_error(
        NotImplementedError,
        "pltpu.prng_seed: a TPU core has one PRNG state, so the seeds cannot vary along a vmapped axis",
    )


batching.primitive_batchers[prng_seed_p] = _prng_seed_batch
mlir.register_lowering(prng_seed_p, _needs_engine("prng_seed"))


# --------------------------------------------------------------- prng_random_bits

prng_random_bits_p = Primitive("prng_random_bits")
# One result, as a list: interpreter rules return lists either way.
prng_random_bits_p.multiple_results = True


def prng_random_bits(shape) -> jax.Array:
    """Draws random bits from the core's hidden PRNG and advances it.

    Args:
      shape: the result's shape; the TPU needs rank >= 2.

    Returns:
      An int32 array of random bits (as JAX's; ``bitcast``/
      ``lax.bitcast_convert_type`` it to uint32 for ``stochastic_round``).
    """
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise kernel_error(
            TypeError, f"pltpu.prng_random_bits: shape must be a tuple of ints, got {shape!r}"
        ) from None
    if len(shape) < 2 or any(d < 0 for d in shape):
        raise kernel_error(
            ValueError,
            f"pltpu.prng_random_bits: the TPU draws bits for shapes of rank >= 2 with non-negative sizes, got {shape}",
        )
    (bits,) = prng_random_bits_p.bind(shape=shape)
    return bits


@prng_random_bits_p.def_effectful_abstract_eval
def _prng_random_bits_abstract_eval(*, shape):
    return [compat.ShapedArray(shape, jnp.int32)], {prng_effect}


mlir.register_lowering(prng_random_bits_p, _needs_engine("prng_random_bits"))


# -------------------------------------------------------------- stateful samplers


def _float_dtype(dtype, op: str):
    dtype = jax.dtypes.canonicalize_dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise kernel_error(TypeError, f"pltpu.{op}: dtype must be a float type, got {dtype}")
    return dtype


def _uint_bits(shape, nbits: int) -> jax.Array:
    """``nbits`` random bits per element from the stateful PRNG."""
    bits = lax.bitcast_convert_type(prng_random_bits(shape), jnp.uint32)
    if nbits == 32:
        return bits
    if nbits < 32:
        return (bits >> (32 - nbits)).astype(jnp.dtype(f"uint{nbits}"))
    hi = bits.astype(jnp.uint64)
    lo = lax.bitcast_convert_type(prng_random_bits(shape), jnp.uint32).astype(jnp.uint64)
    return (hi << np.uint64(32)) | lo


def _uniform(shape, dtype, minval, maxval) -> jax.Array:
    # jax.random.uniform's construction: random mantissa bits under exponent 0.
    nbits = jax.dtypes.itemsize_bits(dtype)
    nmant = jnp.finfo(dtype).nmant
    utype = jnp.dtype(f"uint{nbits}")
    bits = _uint_bits(shape, nbits)
    one = lax.bitcast_convert_type(jnp.ones((), dtype), utype)
    floats = lax.bitcast_convert_type((bits >> np.array(nbits - nmant, utype)) | one, dtype) - jnp.ones(
        (), dtype
    )
    minval = jnp.broadcast_to(jnp.asarray(minval, dtype), shape)
    maxval = jnp.broadcast_to(jnp.asarray(maxval, dtype), shape)
    return lax.max(minval, floats * (maxval - minval) + minval)


def stateful_bits(shape=(), dtype=None) -> jax.Array:
    """Random unsigned-integer bits from the core's hidden PRNG.

    Args:
      shape: the result's shape (rank >= 2 on a TPU).
      dtype: uint8, uint16, uint32 (default) or uint64.

    Returns:
      An array of random bits.
    """
    dtype = jnp.dtype(jnp.uint32 if dtype is None else dtype)
    if dtype.kind != "u":
        raise kernel_error(
            TypeError, f"pltpu.stateful_bits: dtype must be an unsigned integer type, got {dtype}"
        )
    return _uint_bits(tuple(shape), jax.dtypes.itemsize_bits(dtype)).astype(dtype)


def stateful_uniform(shape=(), dtype=float, minval=0.0, maxval=1.0) -> jax.Array:
    """Uniform floats in ``[minval, maxval)`` from the core's hidden PRNG.

    Args:
      shape: the result's shape (rank >= 2 on a TPU).
      dtype: a float type (default float32).
      minval, maxval: the bounds, broadcastable to ``shape``.

    Returns:
      An array of ``dtype``.
    """
    return _uniform(tuple(shape), _float_dtype(dtype, "stateful_uniform"), minval, maxval)


def stateful_normal(shape=(), dtype=float) -> jax.Array:
    """Standard normal floats from the core's hidden PRNG.

    Args:
      shape: the result's shape (rank >= 2 on a TPU).
      dtype: a float type (default float32).

    Returns:
      An array of ``dtype``.
    """
    dtype = _float_dtype(dtype, "stateful_normal")
    lo = jnp.nextafter(jnp.array(-1.0, dtype), jnp.array(0.0, dtype))
    u = _uniform(tuple(shape), dtype, lo, 1.0)
    return jnp.array(np.sqrt(2), dtype) * lax.erf_inv(u)


def stateful_bernoulli(p=0.5, shape=None, mode: str = "low") -> jax.Array:
    """Random booleans, True with probability ``p``, from the core's hidden PRNG.

    Args:
      p: the probability of True (a float or an array broadcastable to
        ``shape``).
      shape: the result's shape (default: ``p``'s shape).
      mode: accepted for ``jax.random.bernoulli`` compatibility; both modes
        compare one uniform draw with ``p``.

    Returns:
      A boolean array.
    """
    if mode not in ("low", "high"):
        raise kernel_error(
            ValueError, f"pltpu.stateful_bernoulli: mode must be 'low' or 'high', got {mode!r}"
        )
    p = jnp.asarray(p)
    if not jnp.issubdtype(p.dtype, jnp.floating):
        p = p.astype(jax.dtypes.canonicalize_dtype(float))
    shape = p.shape if shape is None else tuple(shape)
    return _uniform(shape, p.dtype, 0.0, 1.0) < p


# --------------------------------------------------------------------- Pallas keys


def _key_seed(seed):
    return (jnp.zeros((1, 2), jnp.int32) + seed).astype(jnp.uint32)


def _key_random_bits(key, bit_width, shape):
    state = state_from_seeds([key[0, 0], key[0, 1]])
    return bits_from_state(state, tuple(shape), jnp.dtype(f"uint{bit_width}"))


def mix_fold_in(k0, k1, data):
    """A Pallas key's ``fold_in`` as JAX's Pallas defines it: ``data`` added to the
    second word, then one Threefry-2x32 round (rotation 13); cheap, since the
    TPU's PRNG hashes the seed words again when it is seeded."""
    k1 = k1 + data
    k0 = k0 + k1
    k1 = ((k1 << np.uint32(13)) | (k1 >> np.uint32(19))) ^ k0
    return k0, k1


def _key_fold_in(key, data):
    k0, k1 = mix_fold_in(key[0, 0], key[0, 1], jnp.asarray(data, jnp.uint32))
    return jnp.stack([k0, k1]).reshape(1, 2)


def _key_split(key, shape):
    keys = jax.random.split(_threefry(key), math.prod(shape))
    return jax.random.key_data(keys).reshape(*shape, 1, 2)


pallas_key_impl = define_prng_impl(
    key_shape=(1, 2),
    seed=_key_seed,
    split=_key_split,
    random_bits=_key_random_bits,
    fold_in=_key_fold_in,
    name="pallas_tpu_key",
    tag="pltpu",
)


def to_pallas_key(key: jax.Array) -> jax.Array:
    """Converts a JAX PRNG key (typed or legacy uint32, possibly batched)
    into a Pallas TPU key, to pass to a kernel (e.g. in SMEM).

    Args:
      key: a ``jax.random.key`` or ``jax.random.PRNGKey`` (or an array of them).

    Returns:
      A typed key array of the Pallas TPU implementation, with ``key``'s
      batch shape; its data is JAX's ``to_pallas_key``'s.
    """
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    batched = key.ndim > (0 if typed else 1)
    make = functools.partial(jax.random.bits, shape=(1, 2), dtype=jnp.uint32)
    data = jax.vmap(make)(key) if batched else make(key)
    return jax.random.wrap_key_data(data, impl=pallas_key_impl)


def sample_block(
    sampler_fn: Callable[..., jax.Array],
    global_key: jax.Array,
    block_size: Sequence[int],
    tile_size: Sequence[int],
    total_size: Sequence[int],
    block_index: tuple[Any, ...] | None = None,
    **kwargs,
) -> jax.Array:
    """Samples one block of a random array, the same whatever the blocking.

    The array of shape ``total_size`` is cut into tiles of ``tile_size``;
    tile ``t`` (row-major over the tiles of the whole array) is
    ``sampler_fn(fold_in(global_key, t), shape=tile_size, **kwargs)``. A
    block is the concatenation of its tiles, so any block shape that is a
    multiple of ``tile_size`` gives the same overall array.

    Args:
      sampler_fn: a ``jax.random``-style sampler (``jax.random.uniform``...).
      global_key: the key shared by all blocks (any JAX key, e.g. from
        ``to_pallas_key``).
      block_size: the shape of a block (a multiple of ``tile_size``).
      tile_size: the unit of sampling; pick a common divisor of all block
        shapes that must agree.
      total_size: the shape of the whole array.
      block_index: which block; default ``pl.program_id(i)`` for each axis.
      **kwargs: passed to ``sampler_fn``.

    Returns:
      An array of shape ``block_size``.
    """
    block_size, tile_size, total_size = tuple(block_size), tuple(tile_size), tuple(total_size)
    if not len(block_size) == len(tile_size) == len(total_size):
        raise kernel_error(
            ValueError,
            f"pltpu.sample_block: block_size {block_size}, tile_size {tile_size} and total_size "
            f"{total_size} must have the same length",
        )
    if any(t <= 0 or b % t for b, t in zip(block_size, tile_size, strict=True)):
        raise kernel_error(
            ValueError,
            f"pltpu.sample_block: block_size {block_size} must be a multiple of tile_size {tile_size}",
        )
    if block_index is None:
        import pallas as pl

        block_index = tuple(pl.program_id(i) for i in range(len(block_size)))
    if len(block_index) != len(block_size):
        raise kernel_error(
            ValueError,
            f"pltpu.sample_block: block_index has {len(block_index)} entries, block_size {len(block_size)}",
        )
    tiles_in_block = [b // t for b, t in zip(block_size, tile_size, strict=True)]
    tiles_total = [-(-n // t) for n, t in zip(total_size, tile_size, strict=True)]

    def tile_index(local: tuple[int, ...]):
        index = 0
        for axis, i in enumerate(local):
            index = index * tiles_total[axis] + (block_index[axis] * tiles_in_block[axis] + i)
        return index

    def assemble(axis: int, local: tuple[int, ...]) -> jax.Array:
        if axis == len(block_size):
            key = jax.random.fold_in(global_key, tile_index(local))
            return sampler_fn(key, shape=tile_size, **kwargs)
        parts = [assemble(axis + 1, (*local, i)) for i in range(tiles_in_block[axis])]
        return jnp.concatenate(parts, axis=axis)

    return assemble(0, ())
