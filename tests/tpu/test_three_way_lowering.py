"""Primitives the Mosaic lowering added for the issue "every primitive a TPU
kernel accepts lowers", every TPU way (tests/ways, ``every_way(tpu=True)``: TPU
interpret mode, our lowering + ``run_mosaic``, JAX's lowering + ``run_mosaic``, ours
compiled by libtpu), each against plain jnp on fresh random data; what stays unsupported is a
``pltpu.LoweringException`` naming the primitive, the kernel and the line.
Every module our lowering builds here is verified (``mosaic_module``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu as tpu_dialect
from ways import Way, every_way
from ways.chip import ON_CHIP, chip_tol
from ways.compare import close, equal
from ways.jax_mosaic import OLD_JAX

import pallas as pl
import pallas_tpu as pltpu

# Our lowering, for the tests that read its modules (``pltpu.mosaic_modules``).
MOSAIC = Way("mosaic")


def jax_skips(why: str):
    """Every TPU way; JAX's lowering refuses the kernel (``why``): its way skipped."""
    return every_way(tpu=True, skip={"jax_mosaic": f"JAX's Mosaic lowering: {why}"})


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(0, 2**31 - 1))


def verified(f, *args) -> list[str]:
    """Our Mosaic modules of ``f(*args)``, each parsed back and verified."""
    texts = pltpu.mosaic_modules(f, *args)
    from jax.interpreters import mlir

    ctx = mlir.make_ir_context()
    tpu_dialect.register_dialect(ctx)
    with ctx:
        for t in texts:
            assert ir.Module.parse(t).operation.verify()
    return texts


def lowering_error(f, *args) -> str:
    with pytest.raises(pltpu.LoweringException) as e:
        pltpu.mosaic_modules(f, *args)
    return str(e.value)


def _smem(pl, pltpu):
    return pl.BlockSpec(memory_space=pltpu.SMEM)


# ---------------------------------------------------------------------------
# jax.random with threefry keys inside a kernel


def _seeded(way, kernel, shape, dtype, grid=()):
    """``kernel(pl, seed_ref, o_ref)`` with a seed in SMEM and an output of ``shape``
    (blocks of (8, 128) over ``grid``), a ``pallas_call`` of ``way``'s (None: our
    ``pl.pallas_call``, for ``pltpu.mosaic_modules``)."""
    pl, pltpu = way.modules() if way else MOSAIC.modules()
    spec = pl.BlockSpec((8, 128), lambda *i: (i[0] if i else 0, 0)) if grid else pl.BlockSpec()
    return (way.pallas_call if way else pl.pallas_call)(
        lambda s_ref, o_ref: kernel(pl, s_ref, o_ref),
        out_shape=jax.ShapeDtypeStruct(shape, dtype),
        name=kernel.__name__,
        grid=grid,
        in_specs=[_smem(pl, pltpu)],
        out_specs=spec,
    )


@every_way(tpu=True)
def test_random_uniform_normal_bits_match_jax_random(way):
    seed = fresh_seed()

    def kernel(pl, s_ref, o_ref):
        k = jax.random.key(s_ref[0])
        o_ref[0] = jax.random.uniform(k, (8, 128))
        o_ref[1] = jax.random.normal(k, (8, 128))
        o_ref[2] = jax.random.bits(k, (8, 128)).astype(jnp.float32)

    out = _seeded(way, kernel, (3, 8, 128), jnp.float32)(jnp.array([seed], jnp.int32))
    k = jax.random.key(seed)
    equal(out[0], jax.random.uniform(k, (8, 128)))
    # normal is erf_inv of the uniform draw: on the chip its units' erf_inv (test_three_way_math's floor)
    close(out[1], jax.random.normal(k, (8, 128)), tol=way.chip_tol(1e-5, 1e-3))
    equal(out[2], jax.random.bits(k, (8, 128)).astype(jnp.float32))


@jax_skips("no rule for random_split")
def test_random_split_fold_in_per_block(way):
    """``split`` (unstacked keys), ``fold_in`` of the program id, on a grid."""
    seed = fresh_seed()

    def kernel(pl, s_ref, o_ref):
        k = jax.random.key(s_ref[0])
        _, k2 = jax.random.split(k)
        k3 = jax.random.fold_in(k2, pl.program_id(0))
        o_ref[...] = jax.random.bits(k3, (8, 128))

    out = _seeded(way, kernel, (24, 128), jnp.uint32, grid=(3,))(jnp.array([seed], jnp.int32))
    _, k2 = jax.random.split(jax.random.key(seed))
    expect = jnp.concatenate([jax.random.bits(jax.random.fold_in(k2, i), (8, 128)) for i in range(3)])
    equal(out, expect)


@jax_skips("no rule for random_split")
def test_random_keys_in_a_loop_carry_and_batched_split(way):
    """Keys carried through ``fori_loop`` and a ``(4,)`` key array indexed statically."""
    seed = fresh_seed()

    def kernel(pl, s_ref, o_ref):
        keys = jax.random.split(jax.random.key(s_ref[0]), 4)

        def body(i, carry):
            k, acc = carry
            k, sub = jax.random.split(k)
            return k, acc + jax.random.uniform(sub, (8, 128))

        _, acc = lax.fori_loop(0, 3, body, (keys[2], jnp.zeros((8, 128), jnp.float32)))
        o_ref[...] = acc + jax.random.randint(keys[1], (8, 128), 0, 10).astype(jnp.float32)

    out = _seeded(way, kernel, (8, 128), jnp.float32)(jnp.array([seed], jnp.int32))
    keys = jax.random.split(jax.random.key(seed), 4)
    k, acc = keys[2], jnp.zeros((8, 128), jnp.float32)
    for _ in range(3):
        k, sub = jax.random.split(k)
        acc = acc + jax.random.uniform(sub, (8, 128))
    close(out, acc + jax.random.randint(keys[1], (8, 128), 0, 10).astype(jnp.float32))


def test_random_modules_verify_and_key_errors_name_the_line():
    f = _seeded(
        None,
        lambda pl, s, o: o.__setitem__(..., jax.random.uniform(jax.random.key(s[0]), (8, 128))),
        (8, 128),
        jnp.float32,
    )
    seed = jnp.array([fresh_seed()], jnp.int32)
    (text,) = verified(f, seed)
    assert "arith.xori" in text and "arith.shli" in text  # the hash, as uint32 arithmetic

    def select_keys(pl, s_ref, o_ref):
        keys = jax.random.split(jax.random.key(s_ref[0]), 4)
        pred = jnp.full((4,), s_ref[1] > 0)
        keys = lax.select_n(pred, keys, jax.random.split(keys[0], 4))  # an array predicate
        o_ref[...] = jax.random.uniform(keys[1], (8, 128))

    g = _seeded(None, select_keys, (8, 128), jnp.float32)
    msg = lowering_error(g, jnp.array([1, 2], jnp.int32))
    assert "'select_n'" in msg and "on PRNG key arrays" in msg and "array predicate" in msg, msg
    assert "test_three_way_lowering.py:" in msg and "'select_keys'" in msg, msg

    def rbg(pl, s_ref, o_ref):
        o_ref[...] = jax.random.uniform(jax.random.key(s_ref[0], impl="rbg"), (8, 128))

    msg = lowering_error(_seeded(None, rbg, (8, 128), jnp.float32), seed)
    assert "'rbg'" in msg and "random_seed" in msg and "test_three_way_lowering.py:" in msg, msg


# ---------------------------------------------------------------------------
# Pallas keys (pltpu.to_pallas_key) inside a kernel: prng_set_seed_32 + prng_random_bits


def _pallas_key_ops(data):
    """What the Pallas-key test kernel draws from key data ``uint32[2]`` (in the
    kernel and, as the reference, outside one: the impl's own definitions)."""
    from pallas_tpu._src.language import random as tpu_random

    k = jax.random.wrap_key_data(data.reshape(1, 2), impl=tpu_random.pallas_key_impl)
    k2 = jax.random.fold_in(k, 7)
    _, k3 = jax.random.split(k2)
    return (
        jax.random.bits(k, (8, 128)),
        jax.random.uniform(k2, (8, 128)),
        jax.random.bits(k3, (8, 128), jnp.uint8).astype(jnp.uint32),
        jnp.broadcast_to(jax.random.bits(k, (128,)), (8, 128)),  # a rank-1 draw
        jnp.broadcast_to(jax.random.key_data(k3).reshape(2, 1), (2, 128)),
    )


@jax_skips("wrap_key_data of Pallas keys is refused (wrap_pallas_seed)")
def test_pallas_keys_bits_uniform_fold_in_split(way):
    key = pltpu.to_pallas_key(jax.random.key(fresh_seed()))
    data = jax.random.key_data(key).reshape(2)

    pl, tpu = way.modules()

    def pallas_keys(k_ref, a_ref, b_ref, c_ref, d_ref, e_ref):
        outs = _pallas_key_ops(jnp.stack([k_ref[0], k_ref[1]]))
        for ref, v in zip((a_ref, b_ref, c_ref, d_ref, e_ref), outs, strict=True):
            ref[...] = v

    shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in jax.eval_shape(_pallas_key_ops, data)]
    f = lambda d: way.pallas_call(pallas_keys, out_shape=shapes, in_specs=[_smem(pl, tpu)])(d)

    outs = way.jit(f)(data)
    if way.name == "compiled" and ON_CHIP:
        # The chip's generator is its own and JAX's lowering refuses this kernel: no bit
        # reference there. What any generator must give: the same draws again, in range.
        for got, again in zip(outs, way.jit(f)(data), strict=True):
            equal(got, again)
        u = np.asarray(outs[1])
        assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.05, (u.min(), u.max(), u.mean())
    else:
        for got, expect in zip(outs, _pallas_key_ops(data), strict=True):
            equal(got, expect)
    assert len(np.unique(np.asarray(outs[0]))) > 1000


def test_pallas_key_module_seeds_the_core_prng():
    data = jax.random.key_data(pltpu.to_pallas_key(jax.random.key(fresh_seed()))).reshape(2)

    def kernel(k_ref, o_ref):
        from pallas_tpu._src.language import random as tpu_random

        d = jnp.stack([k_ref[0], k_ref[1]]).reshape(1, 2)
        o_ref[...] = jax.random.uniform(
            jax.random.wrap_key_data(d, impl=tpu_random.pallas_key_impl), (8, 128)
        )

    f = lambda d: pl.pallas_call(  # noqa: E731
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), in_specs=[_smem(pl, pltpu)]
    )(d)
    (text,) = verified(f, data)
    assert "tpu.prng_set_seed_32" in text and "tpu.prng_random_bits" in text, text


# ---------------------------------------------------------------------------
# lax.scan over arrays (xs, stacked ys)


def _one_block(way, kernel, out_shapes):
    """A grid-less ``pallas_call`` of ``way``'s over whole-array blocks (None: our
    ``pl.pallas_call``, for ``pltpu.mosaic_modules``)."""
    return (way.pallas_call if way else pl.pallas_call)(kernel, out_shape=out_shapes, name=kernel.__name__)


@pytest.mark.parametrize("length,unroll", [(4, 2), (5, 2), (7, 3), (2, 4)])
@every_way(tpu=True)
def test_partially_unrolled_fori_loop(way, length, unroll):
    """A ``fori_loop`` partly unrolled, its counter indexing Refs. libtpu 0.0.42.1 (JAX 0.10's,
    the v5e's) aborted the process on Mosaic's ``tpu.late_unroll`` ("Failed to translate
    operation arith.constant"): on jaxlib < 0.11 the lowering unrolls by hand, the remainder
    steps one by one; the compiled way compiles it with that libtpu in ``tests_oldest``."""
    x = rand(4, (8 * length, 128))

    pl, pltpu = way.modules()

    def kernel(x_ref, o_ref):
        def body(i, acc):
            rows = pl.ds(pl.multiple_of(i * 8, 8), 8)
            o_ref[rows, :] = x_ref[rows, :] * 2.0 + acc
            return acc + x_ref[rows, :]

        lax.fori_loop(0, length, body, jnp.zeros((8, 128), jnp.float32), unroll=unroll)

    f = way.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))

    got = way.jit(f)(x)
    blocks = np.asarray(x).reshape(length, 8, 128)
    before = np.cumsum(blocks, axis=0) - blocks
    close(got, (blocks * 2.0 + before).reshape(x.shape), tol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 2, True])
@jax_skips("scan over arrays (xs, ys) is not supported")
def test_scan_over_rows_with_stacked_ys(way, reverse, unroll):
    x, w = rand(1, (6, 8, 128)), rand(2, (8, 128))

    def step(c, xw):
        x, w = xw
        c = jnp.tanh(c * w + x)
        return c, (c.sum(axis=0, keepdims=True), c > 0)

    def scan_rows(x_ref, w_ref, c_ref, s_ref, p_ref):
        ws = jnp.broadcast_to(w_ref[...], x_ref.shape)
        c, (s, p) = lax.scan(
            step, jnp.zeros((8, 128), jnp.float32), (x_ref[...], ws), reverse=reverse, unroll=unroll
        )
        c_ref[...], s_ref[...], p_ref[...] = c, s, p.astype(jnp.int32)

    shapes = (
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        jax.ShapeDtypeStruct((6, 1, 128), jnp.float32),
        jax.ShapeDtypeStruct((6, 8, 128), jnp.int32),
    )
    c, s, p = _one_block(way, scan_rows, shapes)(x, w)
    ec, (es, ep) = lax.scan(
        step, jnp.zeros((8, 128), jnp.float32), (x, jnp.broadcast_to(w, x.shape)), reverse=reverse
    )
    # tanh on the chip is a few hundred ulp from the host's, and the error runs through
    # the six steps (chip_tol); there the signs are compared where |c| is above it
    tol = chip_tol(1e-5, way.name, 2e-4)
    close(c, ec, tol)
    close(s, es, tol=chip_tol(1e-4, way.name, 1e-3))
    _, cs = lax.scan(
        lambda c, xw: (step(c, xw)[0],) * 2,
        jnp.zeros((8, 128), jnp.float32),
        (x, jnp.broadcast_to(w, x.shape)),
        reverse=reverse,
    )
    clear = np.abs(np.asarray(cs)) > tol
    equal(np.asarray(p)[clear], np.asarray(ep.astype(jnp.int32))[clear])


@jax_skips("scan over arrays (xs, ys) is not supported")
def test_scan_xs_only_and_ys_only(way):
    """A scan with xs and no ys (a reduction over rows), one with ys and no xs."""
    x = rand(3, (4, 8, 128))

    def kernel(x_ref, o_ref, y_ref):
        o_ref[...], _ = lax.scan(lambda c, r: (jnp.maximum(c, r), None), x_ref[0], x_ref[...])
        _, y_ref[...] = lax.scan(lambda c, _: (c * 0.5, c), x_ref[1], None, length=4)

    shapes = (jax.ShapeDtypeStruct((8, 128), jnp.float32), jax.ShapeDtypeStruct((4, 8, 128), jnp.float32))
    o, y = _one_block(way, kernel, shapes)(x)
    close(o, x.max(axis=0))
    close(y, x[1] * (0.5 ** jnp.arange(4.0))[:, None, None])


def test_scan_over_arrays_module_verifies():
    x = rand(4, (4, 8, 128))

    def kernel(x_ref, o_ref):
        o_ref[...] = lax.scan(lambda c, r: (c + r, None), jnp.zeros((8, 128)), x_ref[...])[0]

    f = _one_block(None, kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))
    (text,) = verified(f, x)
    assert "tpu.region" in text and "scf.for" in text and "memref.alloca" in text, text


# ---------------------------------------------------------------------------
# Strided .at[...] views


@jax_skips("strided slices of references are unsupported")
def test_strided_views_read_and_written(way):
    """Strided views composed with the access after them (nested views,
    dynamic starts, integer indices, a write through a view)."""
    x = rand(5, (32, 256))

    pl, pltpu = way.modules()
    ds = pl.ds

    def strided_views(x_ref, o_ref):
        evens = x_ref.at[ds(0, 16, stride=2)]  # rows 0, 2, ..., 30
        i = lax.convert_element_type(x_ref[0, 0] > 100.0, jnp.int32) + 2  # a traced 2
        o_ref[0:8, :] = evens[ds(i, 8), ds(0, 128)]  # rows 4, 6, ..., 18
        o_ref[8:16, :] = evens.at[ds(1, 8, stride=2)][:, ds(128, 128)]  # rows 2, 6, ..., 30
        cols = x_ref.at[:, ds(1, 128, stride=2)]  # odd columns
        o_ref[16, :] = cols[3]
        o_ref[17:24, :] = jnp.zeros((7, 128), jnp.float32)
        o_ref.at[ds(24, 4, stride=2)][...] = evens[0:4, 0:128] * 2.0  # rows 24, 26, 28, 30
        o_ref.at[ds(25, 4, stride=2)][...] = cols[ds(i, 4)]  # rows 25, 27, 29, 31

    f = lambda x: way.pallas_call(strided_views, out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32))(x)

    out = way.jit(f)(x)
    expect = jnp.zeros((32, 128), jnp.float32)
    expect = expect.at[0:8].set(x[4:20:2, :128])
    expect = expect.at[8:16].set(x[2:32:4, 128:])
    expect = expect.at[16].set(x[3, 1::2])
    expect = expect.at[24:32:2].set(x[0:8:2, :128] * 2.0)
    expect = expect.at[25:32:2].set(x[2:6, 1::2])
    close(out, expect)


def test_strided_view_modules_verify_and_dma_is_an_error():
    x = rand(6, (16, 128))

    def strided_read(x_ref, o_ref):
        o_ref[...] = x_ref.at[pl.ds(1, 8, stride=2)][...]

    f = _one_block(None, strided_read, jax.ShapeDtypeStruct((8, 128), jnp.float32))
    (text,) = verified(f, x)
    assert "tpu.strided_load" in text and "tpu.memref_slice" not in text, text

    def strided_dma(x_ref, o_ref, buf, sem):
        pltpu.async_copy(x_ref.at[pl.ds(0, 8, stride=2)], buf, sem).wait()
        o_ref[...] = buf[...]

    g = lambda x: pl.pallas_call(  # noqa: E731
        strided_dma,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
    )(x)
    msg = lowering_error(g, x)
    assert "strided views" in msg and "dma_start" in msg and "'strided_dma'" in msg, msg
    assert "test_three_way_lowering.py:" in msg, msg


# ---------------------------------------------------------------------------
# Dynamic grids (traced grid sizes)


@every_way(tpu=True)
def test_dynamic_grid(way):
    """A grid of (n, 2) with n traced: blocks past n * 8 rows stay as aliased."""
    x = rand(7, (32, 256))
    n = jnp.int32(3)

    pl, pltpu = way.modules()

    def dynamic_grid(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + (pl.num_programs(0) * 10 + pl.program_id(1)).astype(jnp.float32)

    def f(n, x):
        spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
        return way.pallas_call(
            dynamic_grid,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(n, 2),
            in_specs=[spec],
            out_specs=spec,
            input_output_aliases={0: 0},
        )(x)

    out = way.jit(f)(n, x)
    bias = 30.0 + (jnp.arange(256) // 128).astype(jnp.float32)
    close(out, x.at[:24].set(x[:24] * 2.0 + bias))


def test_dynamic_grid_module_verifies():
    def dynamic_grid(x_ref, o_ref):
        o_ref[...] = x_ref[...] + pl.num_programs(0).astype(jnp.float32)

    def f(n, x):
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(
            dynamic_grid,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(n,),
            in_specs=[spec],
            out_specs=spec,
        )(x)

    (text,) = verified(f, jnp.int32(2), rand(8, (32, 128)))
    assert "tpu.iteration_bound 0" in text and "iteration_bounds = array<i64: -9223372036854775808>" in text


# ---------------------------------------------------------------------------
# sort (a bitonic network of compares and selects)


@pytest.mark.parametrize(
    "case",
    ["sort_last", "sort_first_axis", "argsort", "descending", "two_keys", "not_pow2", "int32", "nan", "flip"],
)
@jax_skips("no rule for sort (nor rev) on the TensorCore")
def test_sort(way, case):
    rows, cols = (8, 100) if case == "not_pow2" else (8, 128)
    x = rand(9, (rows, cols))
    if case == "int32":
        x = jnp.asarray(np.random.default_rng(9).integers(-50, 50, (rows, cols)), jnp.int32)  # many ties
    if case == "nan":
        x = x.at[1, 3].set(jnp.nan).at[2, 5].set(-0.0).at[2, 6].set(0.0)
    y = jnp.round(rand(10, (rows, cols)) * 2.0)  # few distinct values: ties for the first key

    def reference(x, y):
        if case == "sort_first_axis":
            return jnp.sort(x, axis=0)
        if case == "argsort":
            return jnp.argsort(x, axis=1, stable=True).astype(jnp.float32)
        if case == "descending":
            return jnp.sort(x, axis=1, descending=True)
        if case == "flip":  # lax.rev, no sort
            return jnp.flip(x, axis=(0, 1))
        if case == "two_keys":
            _, _, v = lax.sort((y, x, x * 10.0), dimension=1, num_keys=2)
            return v
        return jnp.sort(x, axis=1).astype(jnp.float32)

    pl, pltpu = way.modules()

    def sort_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = reference(x_ref[...], y_ref[...])

    f = lambda x, y: way.pallas_call(sort_kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32))(
        x, y
    )

    out = way.jit(f)(x, y)
    expect = reference(x, y)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expect))  # NaN == NaN; -0 and 0 in place
    assert np.array_equal(np.signbit(np.asarray(out)), np.signbit(np.asarray(expect)))


def test_sort_module_verifies():
    x = rand(11, (8, 128))

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.sort(x_ref[...], axis=-1)

    (text,) = verified(_one_block(None, kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32)), x)
    assert "arith.select" in text and "tpu.sort" not in text


# ---------------------------------------------------------------------------
# Gathers: Ref reads indexed by an array (one dynamic load per index)


def _gathers(x, i):
    """The gathers of the gather test, as jnp indexing of ``x`` (4, 16, 128)."""
    return (
        x[2][i],  # rows of a 2-D Ref
        x[1][:, i],  # columns
        x[1, i],  # an integer and an array: adjacent, the index shape in place
        x[i % 4, :, 3],  # an array and an integer apart: the index shape leads
        x[0][i.reshape(2, 4)],  # a 2-D index array
        x[3, i, i * 8],  # single elements
    )


@jax_skips("array-indexed Ref reads: 'Cannot do int indexing on TPU'")
def test_gather_ref_reads(way):
    x = rand(fresh_seed(), (4, 16, 128))
    i = jnp.asarray(np.random.default_rng().integers(0, 16, 8), jnp.int32)

    pl, pltpu = way.modules()

    def gathers(x_ref, i_ref, *o_refs):
        i = i_ref[...]
        outs = (
            x_ref.at[2][i],
            x_ref.at[1][:, i],
            x_ref[1, i],
            x_ref[i % 4, :, 3],
            x_ref.at[0][i.reshape(2, 4)],
            x_ref[3, i, i * 8],
        )
        for o_ref, v in zip(o_refs, outs, strict=True):
            o_ref[...] = v

    shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in jax.eval_shape(_gathers, x, i)]
    f = lambda x, i: way.pallas_call(gathers, out_shape=shapes)(x, i)

    for got, expect in zip(way.jit(f)(x, i), _gathers(x, i), strict=True):
        equal(got, expect)


@jax_skips("array-indexed Ref reads: 'Cannot do int indexing on TPU'")
def test_gather_from_smem_and_bool_ref(way):
    table = jnp.asarray(np.random.default_rng().integers(-100, 100, 64), jnp.int32)
    flags = rand(fresh_seed(), (16, 128)) > 0
    i = jnp.asarray(np.random.default_rng().integers(0, 16, 8), jnp.int32)

    pl, pltpu = way.modules()

    def smem_gather(t_ref, f_ref, i_ref, o_ref, b_ref):
        i = i_ref[...]
        o_ref[...] = t_ref[i * 4]
        b_ref[...] = f_ref[i].astype(jnp.int32)

    shapes = (jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((8, 128), jnp.int32))
    specs = [pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(), pl.BlockSpec()]
    f = lambda t, f, i: way.pallas_call(smem_gather, out_shape=shapes, in_specs=specs)(t, f, i)

    out, b = way.jit(f)(table, flags, i)
    equal(out, table[i * 4])
    equal(b, flags[i].astype(jnp.int32))


def test_gather_module_verifies_and_scatter_is_an_error():
    x, i = rand(12, (16, 128)), jnp.arange(8, dtype=jnp.int32)[::-1]

    def gather(x_ref, i_ref, o_ref):
        o_ref[...] = x_ref[i_ref[...]]

    f = lambda x, i: pl.pallas_call(gather, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(x, i)  # noqa: E731
    (text,) = verified(f, x, i)
    assert "vector.extract" in text and "memref.alloca" in text and "tpu.region" in text, text

    def scatter(x_ref, i_ref, o_ref):
        o_ref[i_ref[...]] = x_ref[0:8]

    g = lambda x, i: pl.pallas_call(scatter, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32))(x, i)  # noqa: E731
    msg = lowering_error(g, x, i)
    assert "'swap'" in msg and "a scatter" in msg and "'scatter'" in msg, msg
    assert "test_three_way_lowering.py:" in msg, msg

    def gather_dma(x_ref, i_ref, o_ref, buf, sem):
        pltpu.async_copy(x_ref.at[i_ref[...]], buf, sem).wait()
        o_ref[...] = buf[...]

    h = lambda x, i: pl.pallas_call(  # noqa: E731
        gather_dma,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
    )(x, i)
    msg = lowering_error(h, x, i)
    assert "array-indexed view" in msg and "'gather_dma'" in msg, msg


# ---------------------------------------------------------------------------
# dynamic_slice / dynamic_update_slice of values (through a VMEM scratch)


def _dynamic_slices(x, u, s):
    return (
        lax.dynamic_slice(x, (s[0], s[1]), (8, 128)),
        lax.dynamic_update_slice(x, u, (s[2], s[3])),  # starts clamped (s[3] < 0)
        lax.dynamic_slice(x[0], (s[1],), (128,)),
        lax.dynamic_slice(x, (s[2], s[1]), (8, 128)),  # clamped past the end
        lax.dynamic_update_slice(x > 0, u > 1, (s[0], s[1])).astype(jnp.int32),
    )


@jax_skips("no rule for dynamic_slice (nor dynamic_update_slice)")
def test_dynamic_slice_and_update_of_values(way):
    x, u = rand(fresh_seed(), (16, 256)), rand(fresh_seed(), (8, 128))
    rng = np.random.default_rng()
    s = jnp.array(
        [rng.integers(0, 9), rng.integers(0, 129), rng.integers(9, 16), -rng.integers(1, 50)], jnp.int32
    )

    pl, pltpu = way.modules()

    def dynamic_slices(x_ref, u_ref, s_ref, *o_refs):
        outs = _dynamic_slices(x_ref[...], u_ref[...], [s_ref[k] for k in range(4)])
        for o_ref, v in zip(o_refs, outs, strict=True):
            o_ref[...] = v

    shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in jax.eval_shape(_dynamic_slices, x, u, s)]
    specs = [pl.BlockSpec(), pl.BlockSpec(), _smem(pl, pltpu)]
    f = lambda x, u, s: way.pallas_call(dynamic_slices, out_shape=shapes, in_specs=specs)(x, u, s)

    for got, expect in zip(way.jit(f)(x, u, s), _dynamic_slices(x, u, s), strict=True):
        equal(got, expect)


def _unaligned_accesses(x, b, u, s, idx, v):
    """The reads and writes of the unaligned-access test, as jnp: ``x`` f32
    (16, 256), ``b`` bf16 (32, 256), ``u`` f32 (8, 128), ``v`` f32 (256,)."""
    s3 = s[3] * 8
    strided = jnp.zeros((16, 256), jnp.float32).at[:, 1:128:2].set(x[:, :64])
    return (
        lax.dynamic_slice(x, (s[3] + 5, 0), (8, 256)),  # a plain Ref read at an unaligned row
        lax.dynamic_update_slice(jnp.zeros(256, jnp.float32), lax.dynamic_slice(v, (s[1],), (64,)), (s[0],)),
        x[idx],  # rows of a Ref two tiles wide at dynamic rows
        lax.dynamic_slice(b, (s[0], s[1]), (8, 128)),  # 16-bit, unaligned rows and columns
        lax.dynamic_update_slice(b, u.astype(jnp.bfloat16), (s[2], s[1])),
        lax.dynamic_slice(x, (s3, 0), (8, 256)),  # a start Mosaic proves aligned
        x[:, 0:256:2],  # a stride on the lanes, read
        strided,  # and written
    )


@jax_skips("no rule for dynamic_slice; array-indexed Ref reads")
def test_unaligned_dynamic_accesses_in_forms_mosaic_takes(way):
    """Dynamic starts Mosaic cannot prove aligned (gathered rows of a wide Ref,
    16-bit dynamic slices) are read whole and rotated into place; an aligned
    start (pl.multiple_of) is read directly; lane strides one column at a time."""
    rng = np.random.default_rng()
    x, u = rand(fresh_seed(), (16, 256)), rand(fresh_seed(), (8, 128))
    b = rand(fresh_seed(), (32, 256), jnp.bfloat16)
    s = jnp.array(
        [rng.integers(0, 25), rng.integers(0, 129), rng.integers(0, 25), rng.integers(0, 2)], jnp.int32
    )
    idx = jnp.asarray(rng.integers(0, 16, 8), jnp.int32)
    v = rand(fresh_seed(), (256,))

    pl, pltpu = way.modules()

    def accesses(x_ref, b_ref, u_ref, s_ref, i_ref, v_ref, *o_refs):
        s = [s_ref[k] for k in range(4)]
        p_refs, o_refs = o_refs[:2], o_refs[2:]
        p_refs[0][...] = x_ref[pl.ds(s[3] + 5, 8), :]
        p_refs[1][...] = jnp.zeros((256,), jnp.float32)
        p_refs[1][pl.ds(s[0], 64)] = v_ref[pl.ds(s[1], 64)]  # 1-D, read and written
        o_refs[0][...] = x_ref[i_ref[...]]
        o_refs[1][...] = lax.dynamic_slice(b_ref[...], (s[0], s[1]), (8, 128))
        o_refs[2][...] = lax.dynamic_update_slice(b_ref[...], u_ref[...].astype(jnp.bfloat16), (s[2], s[1]))
        o_refs[3][...] = lax.dynamic_slice(x_ref[...], (pl.multiple_of(s[3] * 8, 8), 0), (8, 256))
        o_refs[4][...] = x_ref.at[:, pl.ds(0, 128, stride=2)][...]
        o_refs[5][...] = jnp.zeros((16, 256), jnp.float32)
        o_refs[5].at[:, pl.ds(1, 64, stride=2)][...] = x_ref[:, 0:64]

    outs = jax.eval_shape(_unaligned_accesses, x, b, u, s, idx, v)
    shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    specs = [
        pl.BlockSpec(),
        pl.BlockSpec(),
        pl.BlockSpec(),
        _smem(pl, pltpu),
        pl.BlockSpec(),
        pl.BlockSpec(),
    ]
    f = lambda *a: way.pallas_call(accesses, out_shape=shapes, in_specs=specs)(*a)

    args = (x, b, u, s, idx, v)
    for got, expect in zip(way.jit(f)(*args), _unaligned_accesses(*args), strict=True):
        equal(got, expect)


def test_unaligned_read_of_a_large_ref_is_a_lowering_error():
    """Reading a whole 1 MiB block to pick 8 rows at a start Mosaic cannot prove
    aligned is refused, naming the fix."""
    x = rand(14, (1024, 256))

    def body(x_ref, s_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(s_ref[0] + 1, 8), :]

    specs = [pl.BlockSpec(), pl.BlockSpec(memory_space=pltpu.SMEM)]
    f = lambda x, s: pl.pallas_call(  # noqa: E731
        body, out_shape=jax.ShapeDtypeStruct((8, 256), jnp.float32), in_specs=specs
    )(x, s)
    msg = lowering_error(f, x, jnp.array([3], jnp.int32))
    assert "'get'" in msg and "'body'" in msg and "test_three_way_lowering.py:" in msg, msg
    assert "pl.multiple_of" in msg and "cannot prove a multiple" in msg, msg


def test_dynamic_slice_at_an_aligned_start_is_one_load():
    """pl.multiple_of's start stays provable through the clamp (tpu.assume_multiple):
    one vector.load, no rotate; an unaligned start is read whole and rotated."""
    x = rand(13, (16, 256))

    def kernel(aligned):
        def body(x_ref, s_ref, o_ref):
            start = pl.multiple_of(s_ref[0] * 8, 8) if aligned else s_ref[0]
            o_ref[...] = lax.dynamic_slice(x_ref[...], (start, 0), (8, 256))

        specs = [pl.BlockSpec(), pl.BlockSpec(memory_space=pltpu.SMEM)]
        out = jax.ShapeDtypeStruct((8, 256), jnp.float32)
        return lambda x, s: pl.pallas_call(body, out_shape=out, in_specs=specs)(x, s)

    s = jnp.array([1], jnp.int32)
    (aligned,) = verified(kernel(True), x, s)
    assert "tpu.assume_multiple" in aligned and "tpu.dynamic_rotate" not in aligned, aligned
    (unaligned,) = verified(kernel(False), x, s)
    assert "tpu.dynamic_rotate" in unaligned, unaligned


# ---------------------------------------------------------------------------
# lgamma, digamma (lower_fun of XLA's Lanczos approximation)


def _gammas(x):
    return (
        lax.lgamma(x),
        lax.digamma(x),
        lax.lgamma(x.astype(jnp.bfloat16)).astype(jnp.float32),
        jax.scipy.special.gammaln(jnp.abs(x) + 1.0),
    )


@jax_skips("no rule for lgamma (nor digamma)")
def test_lgamma_digamma(way):
    x = rand(fresh_seed(), (8, 128)) * 6.0
    x = x.at[0, :10].set(jnp.array([0.0, -1.0, -2.0, 1.0, 2.0, 0.5, -0.5, 1e-3, 1e30, -jnp.inf]))

    pl, pltpu = way.modules()

    def gammas(x_ref, *o_refs):
        for o_ref, v in zip(o_refs, _gammas(x_ref[...]), strict=True):
            o_ref[...] = v

    shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in jax.eval_shape(_gammas, x)]
    f = lambda x: way.pallas_call(gammas, out_shape=shapes)(x)

    expected = [np.asarray(v) for v in _gammas(x)]
    if OLD_JAX and way.name != "tpu_interpret":
        # JAX 0.10's XLA has digamma(0) = NaN; 0.11's is -inf (scipy's too), which our lowering
        # computes on every JAX. Interpret mode runs the installed XLA's digamma.
        expected[1] = np.where(np.asarray(x) == 0, -np.inf, expected[1])
    for k, (got, expect) in enumerate(zip(way.jit(f)(x), expected, strict=True)):
        got = np.asarray(got)
        # k == 2: bfloat16 results (one ulp apart, near lgamma's zeros); the chip's log and
        # exp put lgamma/digamma up to 1e-3 from the host's near their zeros (chip_tol)
        tol = 1e-2 if k == 2 else chip_tol(2e-5, way.name, 2e-3)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expect))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(expect))
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expect))
        ok = np.isfinite(expect)
        np.testing.assert_allclose(got[ok], expect[ok], rtol=tol, atol=tol)


# ---------------------------------------------------------------------------
# Scalar prefetch with input_output_aliases (the alias indices count the prefetch operands)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_grid", "dynamic_grid"])
@every_way(tpu=True)
def test_scalar_prefetch_with_aliased_output(way, dynamic):
    """Two prefetch operands (the blocks to update, a scale), the output aliased
    to input 3 (``y``): the blocks the grid does not visit keep ``y``'s values."""
    rng = np.random.default_rng()
    x, y = rand(fresh_seed(), (32, 128)), rand(fresh_seed(), (32, 128))
    blocks = jnp.asarray(rng.permutation(4)[:2], jnp.int32)
    scale = jnp.asarray(rng.integers(1, 9, 1), jnp.int32)
    n = jnp.int32(2) if dynamic else 2

    pl, pltpu = way.modules()

    def prefetch_alias(b_ref, t_ref, x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...] * t_ref[0].astype(jnp.float32)

    def call(n, blocks, scale, x, y):
        spec = pl.BlockSpec((8, 128), lambda i, b, t: (b[i], 0))
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(n,), in_specs=[spec, spec], out_specs=spec
        )
        return way.pallas_call(
            prefetch_alias,
            out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
            grid_spec=grid_spec,
            input_output_aliases={3: 0},
        )(blocks, scale, x, y)

    f = call if dynamic else (lambda *a: call(n, *a))

    args = (n, blocks, scale, x, y) if dynamic else (blocks, scale, x, y)
    out = way.jit(f)(*args)
    expect = y
    for b in np.asarray(blocks):
        rows = slice(8 * int(b), 8 * int(b) + 8)
        expect = expect.at[rows].set(x[rows] + y[rows] * scale[0].astype(jnp.float32))
    close(out, expect)


# ---------------------------------------------------------------------------
# A rank-0 output in VMEM (a memref<1xT>); a 16-bit dot accumulating in float32


@jax_skips("'Indexing into a ()-shaped Ref not yet supported on TPU'")
def test_rank0_vmem_input_and_output(way):
    x, s = rand(fresh_seed(), (8, 128)), jnp.float32(np.random.default_rng().normal())

    pl, pltpu = way.modules()

    def total(s_ref, x_ref, o_ref, m_ref):
        o_ref[...] = jnp.sum(x_ref[...]) * s_ref[...]
        m_ref[...] = jnp.max(x_ref[...]).astype(jnp.int32)

    shapes = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    f = lambda s, x: way.pallas_call(total, out_shape=shapes)(s, x)

    out, m = way.jit(f)(s, x)
    assert out.shape == m.shape == ()
    close(out, jnp.sum(x) * s, tol=1e-4)
    equal(m, jnp.max(x).astype(jnp.int32))


def test_rank0_vmem_block_mosaic_refuses_is_a_lowering_error():
    def under_grid(x):
        def k(x_ref, o_ref):
            o_ref[...] = jnp.sum(x_ref[...])

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((), jnp.float32), grid=(2,), in_specs=[spec])(
            x
        )

    def bf16(x):
        def k(x_ref, o_ref):
            o_ref[...] = jnp.sum(x_ref[...]).astype(jnp.bfloat16)

        return pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((), jnp.bfloat16))(x)

    assert "rank-0 block in VMEM under a grid" in lowering_error(under_grid, rand(0, (16, 128)))
    assert "rank-0 block in VMEM of bfloat16" in lowering_error(bf16, rand(0, (8, 128)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8], ids=["bfloat16", "int8"])
@every_way(
    tpu=True,
    xfail={"jax_mosaic": "a 16-bit (8-bit) matmul accumulator: 'Expected matmul acc to be 32-bit'"},
)
def test_narrow_dot_accumulates_in_32_bits(way, dtype):
    a = (rand(fresh_seed(), (8, 256)) * 4).astype(dtype)
    b = (rand(fresh_seed(), (128, 256)) * 4).astype(dtype)

    pl, pltpu = way.modules()

    def k(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...].T)

    f = lambda a, b: way.pallas_call(k, out_shape=jax.ShapeDtypeStruct((8, 128), dtype))(a, b)

    out = way.jit(f)(a, b)
    expect = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32).T)
    if dtype == jnp.int8:
        equal(out, expect.astype(jnp.int32).astype(jnp.int8))
    else:
        close(out.astype(jnp.float32), expect.astype(dtype).astype(jnp.float32), tol=2e-2)
