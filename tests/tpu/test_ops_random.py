"""``pallas_tpu.ops.random`` (``threefry``, ``philox``, ``prng_utils``): bit for bit
against ``jax.random`` (threefry: its bits, ``split`` and ``fold_in`` for the same
key), against JAX's ops of the same names in JAX's TPU interpret mode (both
generators), and against the published known answers of the two hashes (Random123's
``kat_vectors``), run every way of an op (tests/ways.py's ``every_way(op=True)``, each
test's function of ops by ``way.jit``): our TPU interpret mode, our Mosaic lowering by
``run_mosaic``, compiled by libtpu for the compile-only TPUs first. Keys, offsets and shapes vary per test (fresh keys from ``jax.random``).

JAX's op of 3-d and higher shapes counts with the wrong strides (its iota of a
block takes the leading dims of the total shape, not the trailing ones), so its
bits repeat there and differ from ``jax.random``'s; ours equal ``jax.random``'s at
every rank. JAX's op is compared with ours on 0-2-d shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways import compile_op, every_way

import pallas_tpu as pltpu
from pallas_tpu.ops.random import _blocks, philox, prng_utils, threefry


def raw_key(seed):
    return jax.random.key_data(jax.random.key(seed))


def interpret():
    return pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())


def jax_ops():
    from jax.experimental.pallas import tpu as jax_pltpu
    from jax.experimental.pallas.ops.tpu.random import philox as jax_philox
    from jax.experimental.pallas.ops.tpu.random import threefry as jax_threefry

    return jax_pltpu, jax_threefry, jax_philox


def equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a, b)


# Shapes: 0-d, 1-d, narrow rows (the flat layout, its last block cut), lane-dense rows
# (blocks of strips: a loop), rows wider than a block (the last column block cut), 3-d.
SHAPES = {
    "scalar": (),
    "1d": (300,),
    "narrow": (9, 1300),
    "strips": (64, 1024),
    "wide": (8, 1408),
    "3d": (2, 24, 384),
}


@pytest.mark.parametrize("shape", SHAPES)
@every_way(op=True)
def test_threefry_bits_equal_jax_random(way, shape):
    shape = SHAPES[shape]
    key = raw_key(len(shape) + 11)
    out = way.jit(lambda k: threefry.plthreefry_random_bits(k, 32, shape))(key)
    equal(out, jax.random.bits(jax.random.wrap_key_data(key), shape, jnp.uint32))


@every_way(op=True)
def test_threefry_split_and_fold_in_equal_jax_random(way):
    key, data = raw_key(5), jnp.uint32(123456789)
    split, folded = way.jit(
        lambda k, d: (threefry.threefry_split(k, (3, 2)), threefry.threefry_fold_in(k, d))
    )(key, data)
    typed = jax.random.wrap_key_data(key)
    equal(split, jax.random.key_data(jax.random.split(typed, (3, 2))))
    equal(folded, jax.random.key_data(jax.random.fold_in(typed, data)))


@every_way(op=True)
def test_philox_equals_jax_op(way):
    """``philox_4x32_count`` with an offset, fused and not, against JAX's op."""
    jax_pltpu, _, jax_philox = jax_ops()
    key, offset = raw_key(7), jnp.uint32(1000003)
    calls = [((), False), ((300,), True), ((16, 384), True), ((16, 384), False)]

    def ours(k, o):
        return [philox.philox_4x32_count(k, s, offset=o, fuse_output=f) for s, f in calls]

    out = way.jit(ours)(key, offset)
    with jax_pltpu.force_tpu_interpret_mode():
        theirs = [jax_philox.philox_4x32_count(key, s, offset=offset, fuse_output=f) for s, f in calls]
    for a, b in zip(out, theirs):
        equal(a, b)


@every_way(op=True)
def test_explicit_blocks_equal_jax_op(way):
    """``threefry_2x32_count`` and ``philox_4x32_kernel`` with JAX's block size on a
    padded 2-d shape: the unpadded part equals JAX's op and ``jax.random``."""
    jax_pltpu, jax_threefry, jax_philox = jax_ops()
    key = raw_key(9)
    shape, unpadded, block = (256, 512), (200, 300), (256, 256)

    def ours(k):
        return (
            threefry.threefry_2x32_count(k, shape, unpadded, block),
            philox.philox_4x32_kernel(k, shape, unpadded, block, offset=3, fuse_output=False),
        )

    fry, lox = way.jit(ours)(key)
    with jax_pltpu.force_tpu_interpret_mode():
        jax_fry = jax_threefry.threefry_2x32_count(key, shape, unpadded, block)
        jax_lox = jax_philox.philox_4x32_kernel(key, shape, unpadded, block, offset=3, fuse_output=False)
    equal(fry[:200, :300], jax_fry[:200, :300])
    equal(lox[:, :200, :300], jax_lox[:, :200, :300])
    equal(fry[:200, :300], jax.random.bits(jax.random.wrap_key_data(key), unpadded, jnp.uint32))


@every_way(op=True)
def test_vmap_over_keys(way):
    """Batched keys (``jax.vmap``, as ``jax.random`` batches a key array): a grid axis
    over the keys."""
    keys = jax.random.key_data(jax.random.split(jax.random.key(13), 3))
    out = way.jit(jax.vmap(lambda k: threefry.plthreefry_random_bits(k, 32, (8, 256))))(keys)
    equal(out, jax.vmap(lambda k: jax.random.bits(jax.random.wrap_key_data(k), (8, 256), jnp.uint32))(keys))


def test_threefry_impl_equals_jax_random():
    """``jax.random`` with ``plthreefry_prng_impl`` keys gives ``jax.random``'s values:
    seeds, splits, folds, samplers of 8-, 16- and 32-bit floats, batched keys."""
    ours = jax.random.key(2024, impl=threefry.plthreefry_prng_impl)
    ref = jax.random.key(2024)
    with interpret():
        o1, o2 = jax.random.split(ours)
        r1, r2 = jax.random.split(ref)
        equal(jax.random.key_data(o1), jax.random.key_data(r1))
        equal(
            jax.random.key_data(jax.random.fold_in(o2, 77)), jax.random.key_data(jax.random.fold_in(r2, 77))
        )
        equal(jax.random.uniform(o1, (16, 128)), jax.random.uniform(r1, (16, 128)))
        equal(jax.random.normal(o2, (40,), jnp.bfloat16), jax.random.normal(r2, (40,), jnp.bfloat16))
        equal(jax.random.bits(o1, (3, 5), jnp.uint8), jax.random.bits(r1, (3, 5), jnp.uint8))
        equal(jax.random.bits(o1, (130,), jnp.uint16), jax.random.bits(r1, (130,), jnp.uint16))
        batch = jax.random.split(o1, 4)
        equal(
            jax.vmap(lambda k: jax.random.randint(k, (8, 128), 0, 1000))(batch),
            jax.vmap(lambda k: jax.random.randint(k, (8, 128), 0, 1000))(jax.random.split(r1, 4)),
        )


def test_philox_impl_equals_jax_op_impl():
    """``jax.random`` with ``plphilox_prng_impl`` keys against JAX's Philox
    implementation (JAX's kernels in its interpret mode): seed, split, fold_in, bits."""
    jax_pltpu, _, jax_philox = jax_ops()

    def draws(impl):
        key = jax.random.key(99, impl=impl)
        a, b = jax.random.split(key)
        c = jax.random.fold_in(b, 5)
        return [jax.random.key_data(k) for k in (key, a, b, c)] + [jax.random.bits(c, (8, 384), jnp.uint32)]

    with interpret():
        ours = draws(philox.plphilox_prng_impl)
    with jax_pltpu.force_tpu_interpret_mode():
        theirs = draws(jax_philox.plphilox_prng_impl)
    for a, b in zip(ours, theirs):
        equal(a, b)
    assert len(np.unique(np.asarray(ours[-1]))) > 0.99 * ours[-1].size


def test_64_bit_words():
    """64 bits (with x64): the first word over the second, as ``jax.random``'s threefry."""
    key = raw_key(31)
    with jax.enable_x64(True), interpret():
        ours = threefry.plthreefry_random_bits(key, 64, (5, 130))
        lox = philox.philox_random_bits(key, 64, (7,))
        words = philox.philox_4x32_count(key, (7,), fuse_output=False)
        ref = jax.random.bits(jax.random.wrap_key_data(key), (5, 130), jnp.uint64)
    equal(ours, ref)
    both = np.asarray(words).astype(np.uint64)
    equal(lox, (both[0] << np.uint64(32)) | both[1])


def test_known_answers():
    """Random123's known-answer vectors: Threefry-2x32-20 and Philox-4x32-10."""

    def words(*hexes):
        return [jnp.uint32(int(h, 16)) for h in hexes]

    ones = words(*["ffffffff"] * 6)
    fry = [
        (words("0", "0", "0", "0"), ("6b200159", "99ba4efe")),
        (ones[:4], ("1cb996fc", "bb002be7")),
        (words("13198a2e", "03707344", "243f6a88", "85a308d3"), ("c4923a9c", "483df7a0")),
    ]
    for (k0, k1, c0, c1), expected in fry:
        assert [int(w) for w in threefry.threefry_2x32(k0, k1, c0, c1)] == [int(h, 16) for h in expected]
    lox = [
        (words(*["0"] * 6), ("6627e8d5", "e169c58d", "bc57ac4c", "9b00dbd8")),
        (ones, ("408f276d", "41c83b0e", "a20bc7c6", "6d5451fd")),
        (
            words("243f6a88", "85a308d3", "13198a2e", "03707344", "a4093822", "299f31d0"),
            ("d16cfe09", "94fdcceb", "5001e420", "24126ea1"),
        ),
    ]
    for args, expected in lox:
        assert [int(w) for w in philox.philox_4x32(*args)] == [int(h, 16) for h in expected]


def test_mul32_hi_lo():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**32, 4096, dtype=np.uint64)
    y = rng.integers(0, 2**32, 4096, dtype=np.uint64)
    x[:2], y[:2] = 2**32 - 1, 2**32 - 1  # the largest product
    hi, lo = philox.mul32_hi_lo(jnp.asarray(x, jnp.uint32), jnp.asarray(y, jnp.uint32))
    product = x * y  # exact below 2**64
    equal(hi, (product >> np.uint64(32)).astype(np.uint32))
    equal(lo, (product & np.uint64(2**32 - 1)).astype(np.uint32))


def test_prng_utils_helpers():
    """``blocked_iota`` and ``compute_scalar_offset`` place a block's positions in the
    total shape (trailing dims aligned), as a numpy arange does; ``round_up``."""
    total, block, index = (3, 40, 384), (8, 128), (2, 3, 1)
    positions = prng_utils.blocked_iota(block, total) + prng_utils.compute_scalar_offset(
        index, total, (1, *block)
    )
    expected = np.arange(np.prod(total)).reshape(total)[2, 24:32, 128:256]
    equal(positions, expected.astype(np.uint32))
    assert prng_utils.round_up(300, 128) == 384 and prng_utils.round_up(256, 128) == 256


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4", "v5p"])
def test_choose_block_fits_each_chip(chip):
    info = pltpu.get_tpu_info(chip)
    for rows, width in ((8192, 8192), (1, 128), (12, 1024), (100000, 1024), (64, 1408)):
        bh, bw = _blocks.choose_block(rows, width, info)
        assert bw == width or bw % 128 == 0
        assert bh == rows or bh % 8 == 0
        assert 2 * bh * prng_utils.round_up(bw, 128) * 4 <= info.vmem_capacity_bytes // 8
        steps = -(-rows // bh)
        if rows >= 64 * _blocks.MIN_STEPS:  # rows for several steps per core: there are
            assert steps >= min(_blocks.MIN_STEPS * info.num_cores, rows // 8)


def test_large_shapes_compile_for_each_chip():
    """The blocks chosen for large outputs compile for every chip of the compiled way."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    compile_op(lambda k: threefry.plthreefry_random_bits(k, 32, (4096, 4096)), (key,))
    compile_op(lambda k: philox.philox_4x32_count(k, (8192, 2048), fuse_output=False), (key,))


KEY = jnp.zeros(2, jnp.uint32)
BAD_CALLS = {
    "bit width": (
        lambda: threefry.plthreefry_random_bits(KEY, 12, (8,)),
        ValueError,
        "bit_width must be 8, 16, 32 or 64",
    ),
    "philox bit width": (
        lambda: philox.philox_random_bits(KEY, 128, (8,)),
        ValueError,
        "philox_random_bits: bit_width",
    ),
    "negative dim": (lambda: threefry.plthreefry_random_bits(KEY, 32, (4, -1)), ValueError, "non-negative"),
    "float dim": (lambda: philox.philox_4x32_count(KEY, (4.5,)), ValueError, "sequence of ints"),
    "too many elements": (lambda: philox.philox_4x32_count(KEY, (2**16, 2**16)), ValueError, "2\\*\\*32 - 1"),
    "key shape": (
        lambda: threefry.plthreefry_random_bits(jnp.zeros(3, jnp.uint32), 32, (8,)),
        ValueError,
        "two 32-bit words",
    ),
    "key dtype": (lambda: philox.philox_4x32_count(jnp.zeros(2), (8,)), TypeError, "must be uint32"),
    "count 1-d": (
        lambda: threefry.threefry_2x32_count(KEY, (256,), (256,), (8, 128)),
        ValueError,
        "at least 2 dimensions",
    ),
    "block divides": (
        lambda: threefry.threefry_2x32_count(KEY, (256, 384), (256, 384), (256, 256)),
        ValueError,
        "must be divisible by block_size",
    ),
    "block rows": (
        lambda: philox.philox_4x32_kernel(KEY, (12, 256), (12, 256), (4, 128)),
        ValueError,
        r"block_size\[0\]=4 must be a multiple of 8",
    ),
    "block lanes": (
        lambda: philox.philox_4x32_kernel(KEY, (8, 192), (8, 192), (8, 64)),
        ValueError,
        r"block_size\[1\]=64 must be a multiple of 128",
    ),
    "block pair": (
        lambda: threefry.threefry_2x32_count(KEY, (8, 128), (8, 128), (8,)),
        ValueError,
        "must be a pair",
    ),
    "unpadded larger": (
        lambda: threefry.threefry_2x32_count(KEY, (8, 128), (16, 128), (8, 128)),
        ValueError,
        "must fit in shape",
    ),
    "offset shape": (
        lambda: philox.philox_4x32_count(KEY, (8,), offset=jnp.ones(2, jnp.uint32)),
        ValueError,
        "offset must be a scalar",
    ),
    "offset dtype": (
        lambda: philox.philox_4x32_count(KEY, (8,), offset=1.5),
        TypeError,
        "offset must be an integer",
    ),
    "fold_in data": (
        lambda: philox.philox_fold_in(KEY, jnp.ones(2, jnp.uint32)),
        ValueError,
        "data must be a scalar",
    ),
    "threefry fold_in data": (
        lambda: threefry.threefry_fold_in(KEY, jnp.ones(2, jnp.uint32)),
        ValueError,
        "data must be a scalar",
    ),
    "64 bits without x64": (
        lambda: threefry.plthreefry_random_bits(KEY, 64, (8,)),
        ValueError,
        "jax_enable_x64",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments(case):
    call, error, message = BAD_CALLS[case]
    if case == "64 bits without x64" and jax.config.jax_enable_x64:
        pytest.skip("x64 is on")
    with pytest.raises(error, match=message):
        call()


def test_module_names_match_jax():
    """The names of JAX's modules are here (an import change away)."""
    _, jax_threefry, jax_philox = jax_ops()
    from jax.experimental.pallas.ops.tpu.random import prng_utils as jax_prng_utils

    for ours, theirs in ((threefry, jax_threefry), (philox, jax_philox), (prng_utils, jax_prng_utils)):
        public = {n for n in dir(theirs) if not n.startswith("_") and callable(getattr(theirs, n))}
        public -= {"Shape"} | {
            n for n in public if getattr(getattr(theirs, n), "__module__", "").startswith(("jax.", "numpy"))
        }
        public |= {n for n in ("BLOCK_SIZE", "K_HI_32", "K_LO_32", "MUL_A", "MUL_B") if hasattr(theirs, n)}
        assert public <= set(dir(ours)), public - set(dir(ours))
