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
from ways import TPU_WAYS, Way, every_way, skip_way
from ways.chip import ON_CHIP

import pallas as pl
import pallas_tpu
from pallas_tpu._src.language import random as _random


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


INTERPRET = Way("tpu_interpret")  # the reference of the Mosaic ways' draws


def _seeds(rng, n=2):
    return jnp.asarray(rng.integers(-(2**31), 2**31 - 1, size=(n,)), jnp.int32)


def draw_twice(seeds, way=INTERPRET):
    """Seeds from SMEM, then two draws of (8, 128) bits, run the ``way`` way."""

    def build(pl, t):
        def kernel(s_ref, o_ref):
            t.prng_seed(s_ref[0], s_ref[1])
            o_ref[0] = t.prng_random_bits((8, 128))
            o_ref[1] = t.prng_random_bits((8, 128))

        return pl.pallas_call(
            kernel, out_shape=_sds((2, 8, 128)), in_specs=[pl.BlockSpec(memory_space=t.SMEM)]
        )

    return way.jit(build(*way.modules()))(seeds)


# ------------------------------------------------------------- stateful PRNG


@every_way(tpu=True)
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


@every_way(tpu=True)
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

    out = way.jit(build_loop(*way.modules()))(seed)
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

    steps = way.jit(build_steps(*way.modules()))(seed)
    assert np.mean(steps[0] == steps[1]) < 0.01 and np.mean(steps[1] == steps[2]) < 0.01
    # Deterministic: the same grid again gives the same bits.
    np.testing.assert_array_equal(steps, way.jit(build_steps(*way.modules()))(seed))


@every_way(
    tpu=True,
    skip={
        "jax_mosaic": "JAX's Mosaic lowering: prng_seed(2**32 - 1): a Python seed above int32's range "
        "overflows (OverflowError)"
    },
)
def test_prng_without_seed_and_with_python_seeds(way):
    def build(pl, t):
        def kernel(o_ref):
            o_ref[0] = t.prng_random_bits((8, 128))  # unseeded: a fixed state
            t.prng_seed(123, 2**32 - 1)
            o_ref[1] = t.prng_random_bits((8, 128))

        return pl.pallas_call(kernel, out_shape=_sds((2, 8, 128)))

    out, out2 = way.jit(build(*way.modules()))(), way.jit(build(*way.modules()))()
    # Unseeded, the interpreters (ours and JAX's) and run_mosaic start from a fixed state; a
    # chip's generator holds whatever the last kernel left there (the TPU v5e, 2026-12-06: the
    # unseeded half differed between two calls), so there only the seeded bits repeat.
    np.testing.assert_array_equal(
        out[1:] if way.name == "compiled" and ON_CHIP else out,
        out2[1:] if way.name == "compiled" and ON_CHIP else out2,
    )
    assert np.mean(out[0] == out[1]) < 0.01


# Each sampler with a check of its distribution on 64 x 128 draws; the bounds are
# about 5 standard errors, so a fresh seed fails them once in millions of runs.
_SAMPLERS = {
    "uniform": (
        lambda t, shape: t.stateful_uniform(shape, minval=-2.0, maxval=3.0),
        lambda u: u.min() >= -2 and u.max() < 3 and abs(u.mean() - 0.5) < 0.08,
        jnp.float32,
    ),
    "normal": (
        lambda t, shape: t.stateful_normal(shape),
        lambda n: abs(n.mean()) < 0.06 and abs(n.std() - 1) < 0.04,
        jnp.float32,
    ),
    "bernoulli": (
        lambda t, shape: t.stateful_bernoulli(0.3, shape).astype(jnp.int32),
        lambda b: set(np.unique(b)) <= {0, 1} and abs(b.mean() - 0.3) < 0.025,
        jnp.int32,
    ),
    "bits": (
        lambda t, shape: t.stateful_bits(shape),
        lambda bits: bits.dtype == np.uint32 and 0.49 < np.unpackbits(bits.view(np.uint8)).mean() < 0.51,
        jnp.uint32,
    ),
    "uniform_bf16": (
        lambda t, shape: t.stateful_uniform(shape, dtype=jnp.bfloat16),
        lambda h: h.min() >= 0 and h.max() < 1 and abs(h.astype(np.float64).mean() - 0.5) < 0.02,
        jnp.bfloat16,
    ),
}
# JAX's Mosaic lowering draws only 32-bit words (random_bits_p: "Only 32-bit PRNG supported").
_JAX_NARROW_BITS = "random bits narrower than 32 (bernoulli draws uint8 words, bf16 uniform uint16)"


@every_way(tpu=True)
@skip_way("jax_mosaic", f"JAX's Mosaic lowering: {_JAX_NARROW_BITS}", ids=("bernoulli", "uniform_bf16"))
@pytest.mark.parametrize("sampler", list(_SAMPLERS))
def test_stateful_samplers_distributions(sampler, way, rng):
    seed = _seeds(rng, 1)
    shape = (64, 128)
    draw, check, dtype = _SAMPLERS[sampler]

    def build(pl, t):
        def kernel(s_ref, o_ref):
            t.prng_seed(s_ref[0])
            o_ref[...] = draw(t, shape)

        return pl.pallas_call(
            kernel, out_shape=_sds(shape, dtype), in_specs=[pl.BlockSpec(memory_space=t.SMEM)]
        )

    out = np.asarray(way.jit(build(*way.modules()))(seed))
    assert out.dtype == dtype and check(out), (sampler, way)
    # The Mosaic ways execute the hardware PRNG as the interpreter models it: the same
    # bits, so the same samples, to erf_inv's error: both Mosaic lowerings (ours, JAX's) take a
    # single-precision polynomial (5.6e-6 relative at worst, in the tails), the interpreter XLA's
    # CPU erf_inv (as accurate on jaxlib 0.11.2; 1.3e-7 relative on jaxlib 0.12.1).
    # A chip's generator is its own (the compiled way there compares ours with JAX's lowering).
    if way.name != "tpu_interpret" and not (way.name == "compiled" and ON_CHIP):
        expect = np.asarray(INTERPRET.jit(build(*INTERPRET.modules()))(seed))
        np.testing.assert_allclose(out.astype(np.float64), expect.astype(np.float64), rtol=1e-5, atol=1e-6)


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


@every_way(only=("core", *TPU_WAYS))
@pytest.mark.parametrize("impl", ["threefry2x32", "pallas"])
def test_sample_block_is_invariant_to_block_shape(way, impl, rng):
    """The same samples whatever the block shape, in pallas-core's interpret mode and
    the three TPU ways (``sample_block`` inside the kernel: threefry or Pallas keys)."""
    total, tile = (32, 512), (8, 128)
    if impl == "pallas":
        key_data = jax.random.key_data(to_pallas_key(jax.random.key(int(rng.integers(0, 2**31))))).reshape(2)
    else:
        key_data = jax.random.key_data(jax.random.key(int(rng.integers(0, 2**31))))

    def build(block, interpret=False):
        def make(pl, t):
            sampler = t.sample_block if hasattr(t, "sample_block") else sample_block

            def kernel(k_ref, o_ref):
                if impl == "threefry2x32":
                    k = jax.random.wrap_key_data(jnp.stack([k_ref[0], k_ref[1]]), impl="threefry2x32")
                elif t is jpltpu:  # JAX's Pallas keys join their seeds with a primitive of its own
                    k = jax_wrap_pallas_seed(k_ref[0], k_ref[1])
                else:
                    d = jnp.stack([k_ref[0], k_ref[1]]).reshape(1, 2)
                    k = jax.random.wrap_key_data(d, impl=_random.pallas_key_impl)
                o_ref[...] = sampler(jax.random.uniform, k, block, tile, total)

            key_spec = (
                pl.BlockSpec((2,), lambda i, j: (0,)) if interpret else pl.BlockSpec(memory_space=t.SMEM)
            )
            return pl.pallas_call(
                kernel,
                out_shape=_sds(total, jnp.float32),
                grid=(total[0] // block[0], total[1] // block[1]),
                in_specs=[key_spec],
                out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
                interpret=interpret,
            )

        return make

    def sample(block):
        if way.name == "core":
            return build(block, interpret=True)(pl, pallas_tpu)(key_data)
        return way.jit(build(block)(*way.modules()))(key_data)

    a, b, c = sample((8, 128)), sample((16, 256)), sample((32, 512))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert abs(float(a.mean()) - 0.5) < 0.03
    # Threefry is a pure function: the Mosaic ways draw what the interpreter draws. (The
    # hardware PRNG behind Pallas keys is modelled, not reproduced: invariance only.)
    if way.name in ("mosaic", "jax_mosaic") and impl == "threefry2x32":
        np.testing.assert_allclose(a, sample_interpret(build, key_data), rtol=0, atol=1e-6)


def jax_wrap_pallas_seed(*seeds):
    from jax._src.pallas.mosaic import primitives, random  # the reference's, test-only

    return primitives.wrap_pallas_seed(*seeds, impl=random.tpu_key_impl)


def sample_interpret(build, key_data):
    return INTERPRET.jit(build((8, 128))(*INTERPRET.modules()))(key_data)


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


def test_pallas_key_fold_in_matches_jax(rng):
    # JAX's Pallas keys fold data in with one Threefry round (jax/_src/pallas/mosaic/random.py:
    # the data added to the second word, threefry2x32.apply_round(..., 13)), not a full threefry
    # hash; JAX's own fold_in runs only inside a TPU kernel, so its round is the reference here.
    from jax._src.random import threefry2x32

    key = to_pallas_key(jax.random.key(int(rng.integers(0, 2**31))))
    data = np.uint32(rng.integers(0, 2**32))
    k0, k1 = np.asarray(jax.random.key_data(key)).reshape(2)
    want = threefry2x32.apply_round([jnp.uint32(k0), jnp.uint32(k1) + data], 13)
    got = jax.random.key_data(jax.random.fold_in(key, data)).reshape(2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.stack(want)))


@every_way(tpu=True, skip={"jax_mosaic": "JAX's Mosaic lowering: no rule for random_split"})
def test_threefry_keys_carried_by_while_and_traced_fori_loops(way):
    # A key taken from a split (row r > 0 of the key data) carried by scf.while and
    # scf.for: Mosaic lays out such a 1-D scf.for carry wrongly, so ours carries it as (1, 2).
    def build(pl, t):
        def kernel(s_ref, o_ref):
            keys = jax.random.split(jax.random.key(s_ref[0]), 4)

            def body(carry):
                i, k, acc = carry
                k, sub = jax.random.split(k)
                return i + 1, k, acc + jax.random.uniform(sub, (8, 128))

            init = (0, keys[3], jnp.zeros((8, 128), jnp.float32))
            _, _, acc = lax.while_loop(lambda c: c[0] < s_ref[1], body, init)

            def body2(i, carry):
                k, acc = carry
                k, sub = jax.random.split(k)
                return k, acc + jax.random.uniform(sub, (8, 128))

            o_ref[...] = lax.fori_loop(0, s_ref[1], body2, (keys[1], acc))[1]

        smem = pl.BlockSpec(memory_space=t.SMEM)
        return lambda s: pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), in_specs=[smem]
        )(s)

    seed = int(np.random.default_rng().integers(0, 2**31))
    got = way.jit(build(*way.modules()))(jnp.array([seed, 3], jnp.int32))
    keys = jax.random.split(jax.random.key(seed), 4)
    want = jnp.zeros((8, 128), jnp.float32)
    for k0 in (keys[3], keys[1]):
        k = k0
        for _ in range(3):
            k, sub = jax.random.split(k)
            want = want + jax.random.uniform(sub, (8, 128))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
