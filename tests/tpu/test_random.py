"""TPU random numbers: the stateful core PRNG (prng_seed, prng_random_bits,
stateful_*), Pallas keys (to_pallas_key) and sample_block.

Interpret-mode bits are not a TPU's hardware bits, so the stateful PRNG is
checked for determinism, independence between seeds, calls, loop iterations
and grid steps, and distributions. Keys and ``sample_block`` are pure
functions: they are compared with JAX's (``to_pallas_key`` data,
``sample_block`` on threefry keys) and with themselves across block shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as jpltpu
from three_way import WAYS, run

import pallas as pl
import pallas_tpu
from pallas_tpu._src import random as _random


def _public(name):
    try:
        return getattr(pallas_tpu, name)
    except (AttributeError, NotImplementedError):
        return getattr(_random, name)


prng_seed = _public("prng_seed")
prng_random_bits = _public("prng_random_bits")
stateful_uniform = _public("stateful_uniform")
stateful_normal = _public("stateful_normal")
stateful_bernoulli = _public("stateful_bernoulli")
stateful_bits = _public("stateful_bits")
sample_block = _public("sample_block")
to_pallas_key = _public("to_pallas_key")


def _tpu():
    try:
        return pallas_tpu.InterpretParams()
    except (AttributeError, NotImplementedError):
        pytest.skip("pallas_tpu.InterpretParams is not exported yet")


def _smem():
    return pl.BlockSpec(memory_space=pallas_tpu.SMEM)


def _sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def _seeds(rng, n=2):
    return jnp.asarray(rng.integers(-(2**31), 2**31 - 1, size=(n,)), jnp.int32)


def draw_twice(seeds, way="interpret"):
    """Seeds from SMEM, then two draws of (8, 128) bits, run the ``way`` way."""

    def build(pl, t):
        def kernel(s_ref, o_ref):
            t.prng_seed(s_ref[0], s_ref[1])
            o_ref[0] = t.prng_random_bits((8, 128))
            o_ref[1] = t.prng_random_bits((8, 128))

        return pl.pallas_call(
            kernel, out_shape=_sds((2, 8, 128)), in_specs=[pl.BlockSpec(memory_space=t.SMEM)]
        )

    return run(build, (seeds,), way)


# ------------------------------------------------------------- stateful PRNG


@pytest.mark.parametrize("way", WAYS)
def test_prng_is_deterministic_per_seed_and_fresh_per_call(way, rng):
    seeds = _seeds(rng)
    a, b = draw_twice(seeds, way), draw_twice(seeds, way)
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(a, b)  # same seed, same bits
    assert np.mean(a[0] == a[1]) < 0.01  # two calls differ
    other = draw_twice(seeds.at[1].add(1), way)
    assert np.mean(other[0] == a[0]) < 0.01  # another seed differs
    # About half of all bits are set.
    ones = np.unpackbits(np.asarray(a).view(np.uint8)).mean()
    assert 0.49 < ones < 0.51


@pytest.mark.interpret_only(
    reason="the interpreter's PRNG bits are jax.random.bits of a Pallas key (not a TPU's)"
)
def test_prng_matches_pallas_key_bits(rng):
    # As on a TPU: jax.random.bits(key) == prng_seed(*key_data) then prng_random_bits.
    seeds = _seeds(rng)
    key = jax.random.wrap_key_data(seeds.astype(jnp.uint32).reshape(1, 2), impl=_random.pallas_key_impl)
    np.testing.assert_array_equal(
        lax.bitcast_convert_type(draw_twice(seeds)[0], jnp.uint32), jax.random.bits(key, (8, 128))
    )


@pytest.mark.parametrize("way", WAYS)
def test_prng_differs_between_loop_iterations_and_grid_steps(way, rng):
    seed = _seeds(rng, 1)

    def build_loop(pl, t):
        def kernel(s_ref, o_ref):
            t.prng_seed(s_ref[0])

            def body(i, c):
                o_ref[i] = t.prng_random_bits((8, 128))
                return c

            lax.fori_loop(0, 4, body, 0)

        return pl.pallas_call(
            kernel, out_shape=_sds((4, 8, 128)), in_specs=[pl.BlockSpec(memory_space=t.SMEM)]
        )

    out = run(build_loop, (seed,), way)
    for i in range(4):
        for j in range(i):
            assert np.mean(out[i] == out[j]) < 0.01

    def build_steps(pl, t):
        def per_step(s_ref, o_ref):
            t.prng_seed(s_ref[0], pl.program_id(0))
            o_ref[...] = t.prng_random_bits((8, 128))[None]

        spec = pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0))
        smem = pl.BlockSpec(memory_space=t.SMEM)
        return pl.pallas_call(
            per_step, out_shape=_sds((3, 8, 128)), grid=(3,), in_specs=[smem], out_specs=spec
        )

    steps = run(build_steps, (seed,), way)
    assert np.mean(steps[0] == steps[1]) < 0.01 and np.mean(steps[1] == steps[2]) < 0.01
    # Deterministic: the same grid again gives the same bits.
    np.testing.assert_array_equal(steps, run(build_steps, (seed,), way))


def test_prng_without_seed_and_with_python_seeds():
    def kernel(o_ref):
        o_ref[0] = prng_random_bits((8, 128))  # unseeded: a fixed state
        prng_seed(123, 2**32 - 1)
        o_ref[1] = prng_random_bits((8, 128))

    out = pl.pallas_call(kernel, out_shape=_sds((2, 8, 128)), interpret=_tpu())()
    out2 = pl.pallas_call(kernel, out_shape=_sds((2, 8, 128)), interpret=_tpu())()
    np.testing.assert_array_equal(out, out2)
    assert np.mean(out[0] == out[1]) < 0.01


def test_stateful_samplers_distributions(rng):
    seed = _seeds(rng, 1)
    shape = (64, 128)

    def kernel(s_ref, u_ref, n_ref, b_ref, bits_ref, h_ref):
        prng_seed(s_ref[0])
        u_ref[...] = stateful_uniform(shape, minval=-2.0, maxval=3.0)
        n_ref[...] = stateful_normal(shape)
        b_ref[...] = stateful_bernoulli(0.3, shape).astype(jnp.int32)
        bits_ref[...] = stateful_bits(shape)
        h_ref[...] = stateful_uniform(shape, dtype=jnp.bfloat16)

    outs = pl.pallas_call(
        kernel,
        out_shape=[
            _sds(shape, jnp.float32),
            _sds(shape, jnp.float32),
            _sds(shape),
            _sds(shape, jnp.uint32),
            _sds(shape, jnp.bfloat16),
        ],
        in_specs=[_smem()],
        interpret=_tpu(),
    )(seed)
    u, n, b, bits, h = (np.asarray(o, np.float64) if i != 3 else np.asarray(o) for i, o in enumerate(outs))
    assert u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.05
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03
    assert abs(b.mean() - 0.3) < 0.02
    assert outs[3].dtype == jnp.uint32 and 0.49 < np.unpackbits(bits.view(np.uint8)).mean() < 0.51
    assert h.min() >= 0 and h.max() < 1 and abs(h.mean() - 0.5) < 0.02


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: prng_seed(), TypeError, "at least one seed"),
        (lambda: prng_seed(1.5), TypeError, "integer scalars"),
        (lambda: prng_seed(jnp.zeros((2,), jnp.int32)), TypeError, "integer scalars"),
        (lambda: prng_seed(2**40), ValueError, "32 bits"),
        (lambda: prng_random_bits((128,)), ValueError, "rank >= 2"),
        (lambda: stateful_uniform((8, 128), dtype=jnp.int32), TypeError, "float type"),
        (lambda: stateful_bits((8, 128), dtype=jnp.int32), TypeError, "unsigned"),
    ],
)
def test_prng_argument_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        jax.make_jaxpr(call)()


def test_prng_outside_the_tpu_interpreter_says_what_to_do():
    with pytest.raises(NotImplementedError, match="InterpretParams"):
        jax.jit(lambda: prng_random_bits((8, 128)))()

    def kernel(o_ref):
        prng_seed(1)
        o_ref[...] = prng_random_bits((8, 128))

    with pytest.raises(NotImplementedError, match="InterpretParams"):
        pl.pallas_call(kernel, out_shape=_sds((8, 128)), interpret=True)()


def test_prng_seed_cannot_vary_under_vmap():
    with pytest.raises(NotImplementedError, match="one PRNG state"):
        jax.make_jaxpr(jax.vmap(lambda s: prng_seed(s)))(jnp.arange(3))


# ------------------------------------------------------------- Pallas keys


@pytest.mark.parametrize(
    "make",
    [
        lambda k: jax.random.key(k),
        lambda k: jax.random.PRNGKey(k),
        lambda k: jax.random.split(jax.random.key(k), 3),
    ],
)
def test_to_pallas_key_matches_jax(make, rng):
    key = make(int(rng.integers(0, 2**31)))
    ours, theirs = to_pallas_key(key), jpltpu.to_pallas_key(key)
    np.testing.assert_array_equal(jax.random.key_data(ours), jax.random.key_data(theirs))
    assert ours.shape == theirs.shape


def test_pallas_key_sampling_is_deterministic_and_uniform(rng):
    key = to_pallas_key(jax.random.key(int(rng.integers(0, 2**31))))
    u = jax.random.uniform(key, (64, 128))
    np.testing.assert_array_equal(u, jax.jit(lambda k: jax.random.uniform(k, (64, 128)))(key))
    assert abs(float(u.mean()) - 0.5) < 0.02
    k1, k2 = jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)
    assert np.mean(jax.random.bits(k1, (8, 128)) == jax.random.bits(k2, (8, 128))) < 0.01
    assert jax.random.split(key, 4).shape == (4,)


# ------------------------------------------------------------ sample_block


@pytest.mark.parametrize(
    "sampler", [jax.random.uniform, jax.random.normal, jax.random.bits], ids=lambda f: f.__name__
)
def test_sample_block_matches_jax_on_threefry_keys(sampler, rng):
    key = jax.random.key(int(rng.integers(0, 2**31)))
    for index in [(0, 0), (1, 1), (0, 1)]:
        ours = sample_block(sampler, key, (16, 256), (8, 128), (32, 512), block_index=index)
        theirs = jpltpu.sample_block(sampler, key, (16, 256), (8, 128), (32, 512), block_index=index)
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("mode", ["core_interpret", "tpu_interpret"])
@pytest.mark.parametrize("impl", ["threefry2x32", "pallas"])
def test_sample_block_is_invariant_to_block_shape(mode, impl, rng):
    total, tile = (32, 512), (8, 128)
    if impl == "pallas":
        key = to_pallas_key(jax.random.key(int(rng.integers(0, 2**31))))
        key_data = jax.random.key_data(key).reshape(2)

        def wrap(d):
            return jax.random.wrap_key_data(d.reshape(1, 2), impl=_random.pallas_key_impl)
    else:
        key_data = jax.random.key_data(jax.random.key(int(rng.integers(0, 2**31))))

        def wrap(d):
            return jax.random.wrap_key_data(d, impl="threefry2x32")

    interpret = True if mode == "core_interpret" else _tpu()
    key_spec = (
        pl.BlockSpec(memory_space=pallas_tpu.SMEM)
        if mode == "tpu_interpret"
        else pl.BlockSpec((2,), lambda i, j: (0,))
    )

    def sample(block):
        def kernel(k_ref, o_ref):
            k = wrap(jnp.stack([k_ref[0], k_ref[1]]))
            o_ref[...] = sample_block(jax.random.uniform, k, block, tile, total)

        grid = (total[0] // block[0], total[1] // block[1])
        return pl.pallas_call(
            kernel,
            out_shape=_sds(total, jnp.float32),
            grid=grid,
            in_specs=[key_spec],
            out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
            interpret=interpret,
        )(key_data)

    a, b, c = sample((8, 128)), sample((16, 256)), sample((32, 512))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert abs(float(a.mean()) - 0.5) < 0.03


@pytest.mark.parametrize(
    "args,match",
    [
        (((16, 128), (8,), (32, 512)), "same length"),
        (((12, 128), (8, 128), (32, 512)), "multiple of tile_size"),
    ],
)
def test_sample_block_errors(args, match):
    with pytest.raises(ValueError, match=match):
        sample_block(jax.random.uniform, jax.random.key(0), *args, block_index=(0, 0))
