"""Ref bitcasts (``ref.bitcast(dtype)``, JAX's ``BitcastTransform``; tokamax's
routing grouped matmul reads a bf16 VMEM block as uint32 words). A bitcast that keeps the
element width reads the same elements as another dtype; one that changes it packs along
the second-to-last dimension, as a TPU does: ``(16, 128)`` int32 is ``(32, 128)`` bfloat16,
row ``2r + k`` holding half ``k`` (least significant first) of row ``r``. Reads and writes
through the view, every TPU way (tests/ways) against plain jnp (``lax.bitcast_convert_type``
and reshapes) on fresh random data, JAX's interpret mode as a second reference, and the
error paths. ``run_mosaic`` runs a width-changing ``tpu.memref_bitcast`` through a table of
each element's bytes in its allocation (no NumPy view packs two rows into one element)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

pytest.importorskip("jax.experimental.pallas.tpu")

from ways import Way, every_way  # noqa: E402
from ways.jax_mosaic import OLD_JAX  # noqa: E402

import pallas as pl  # noqa: E402
import pallas_tpu as pltpu  # noqa: E402

jax.config.update("jax_enable_checks", True)


def bits(seed, shape, dtype):
    """Random bits of ``dtype`` (every pattern: NaNs and denormals included for floats)."""
    width = jax.dtypes.itemsize_bits(jnp.dtype(dtype))
    u = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[width]
    raw = jax.random.bits(jax.random.key(seed), shape, u)
    return lax.bitcast_convert_type(raw, dtype)


def tpu_bitcast(x, dtype):
    """The reference: JAX's TPU rule, with jnp alone."""
    x = jnp.asarray(x)
    src, dst = jax.dtypes.itemsize_bits(x.dtype), jax.dtypes.itemsize_bits(jnp.dtype(dtype))
    *lead, m, n = x.shape
    if src < dst:
        k = dst // src
        return lax.bitcast_convert_type(jnp.swapaxes(x.reshape(*lead, m // k, k, n), -1, -2), dtype)
    if src > dst:
        parts = lax.bitcast_convert_type(x, dtype)
        return jnp.swapaxes(parts, -1, -2).reshape(*lead, m * (src // dst), n)
    return lax.bitcast_convert_type(x, dtype)


def same_bits(a, b):
    """Equal bit for bit (floats compared as their bits: NaN payloads count)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    np.testing.assert_array_equal(a.view(u), b.view(u))


# -- kernels -------------------------------------------------------------------


def build_read_write(pl, pltpu, *, shape, src, dst, interpret=None):
    """Reads ``x`` (``src``) through a ``dst`` view into a ``dst`` output, and writes
    ``z`` (``dst``, the view's shape) through a ``dst`` view of a ``src`` output."""
    view_shape = jax.eval_shape(lambda a: tpu_bitcast(a, dst), jax.ShapeDtypeStruct(shape, src)).shape

    def kernel(x_ref, z_ref, o_ref, back_ref):
        o_ref[...] = x_ref.bitcast(dst)[...]
        back_ref.bitcast(dst)[...] = z_ref[...]

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(view_shape, dst), jax.ShapeDtypeStruct(shape, src)),
        interpret=interpret,
    )


def _uint(dtype):
    return {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[jax.dtypes.itemsize_bits(jnp.dtype(dtype))]


def read_write_args(seed, shape, src, dst):
    x = bits(seed, shape, src)
    return x, bits(seed + 100, tpu_bitcast(x, dst).shape, dst)


def read_write_expected(x, z):
    return tpu_bitcast(x, z.dtype), tpu_bitcast(z, x.dtype)


SAME_WIDTH = [
    ((16, 128), jnp.float32, jnp.int32),
    ((16, 128), jnp.int32, jnp.float32),
    ((2, 16, 256), jnp.uint32, jnp.float32),
    ((16, 128), jnp.bfloat16, jnp.int16),
]
WIDTH_CHANGING = [
    ((16, 128), jnp.int32, jnp.bfloat16),  # (16, 128) int32 -> (32, 128) bf16
    ((32, 128), jnp.bfloat16, jnp.uint32),  # -> (16, 128) uint32: tokamax's routing gmm
    ((2, 32, 128), jnp.bfloat16, jnp.int32),
    ((32, 256), jnp.int8, jnp.int32),  # -> (8, 256)
    ((8, 128), jnp.float32, jnp.int8),  # -> (32, 128)
]


def _id(case):
    shape, src, dst = case
    return f"{jnp.dtype(src).name}{list(shape)}-{jnp.dtype(dst).name}"


@every_way(tpu=True)
@pytest.mark.parametrize("case", SAME_WIDTH, ids=_id)
def test_same_width_read_and_write(case, way):
    shape, src, dst = case
    x, z = read_write_args(sum(shape), shape, src, dst)
    o, back = way.jit(build_read_write(*way.modules(), shape=shape, src=src, dst=dst))(x, z)
    want_o, want_back = read_write_expected(x, z)
    same_bits(o, want_o)
    same_bits(back, want_back)


@every_way(tpu=True)
@pytest.mark.parametrize("case", WIDTH_CHANGING, ids=_id)
def test_width_changing_read_and_write(case, way):
    shape, src, dst = case
    x, z = read_write_args(sum(shape) + 1, shape, src, dst)
    o, back = way.jit(build_read_write(*way.modules(), shape=shape, src=src, dst=dst))(x, z)
    want_o, want_back = read_write_expected(x, z)
    same_bits(o, want_o)
    same_bits(back, want_back)


# JAX 0.10.2's discharge interpreter (interpret=True) has no rule for a bitcast view.
_OLD_JAX_INTERPRET = (
    'JAX 0.10\'s interpret=True refuses a Ref bitcast ("Unsupported transform: BitcastTransform")'
)


@pytest.mark.parametrize("case", SAME_WIDTH + WIDTH_CHANGING, ids=_id)
def test_as_jax_interprets_it(case):
    # JAX's reference is its discharge interpreter (interpret=True): JAX's TPU interpret
    # mode (0.11.2 and 0.12) stops at a bitcast view ("'BitcastTransform' object has no
    # attribute 'indices'"). Ours both ways: TPU interpret mode, and pallas-core's.
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu

    shape, src, dst = case
    args = read_write_args(sum(shape) + 2, shape, src, dst)
    want = read_write_expected(*args)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        ours = jax.jit(build_read_write(pl, pltpu, shape=shape, src=src, dst=dst))(*args)
    for a, w in zip(ours, want, strict=True):
        same_bits(a, w)
    core = jax.jit(build_read_write(pl, pltpu, shape=shape, src=src, dst=dst, interpret=True))
    if OLD_JAX:
        # pallas-core's interpret=True discharges the kernel's state with JAX's rules, which
        # in JAX 0.10 have none for a bitcast view: refused, as JAX's own interpret=True.
        with pytest.raises(NotImplementedError, match="Unsupported transform: BitcastTransform"):
            core(*args)
        pytest.skip(f"the comparison with JAX: {_OLD_JAX_INTERPRET} (ours: TPU interpret mode matched jnp)")
    for c, w in zip(core(*args), want, strict=True):
        same_bits(c, w)
    theirs = jax.jit(build_read_write(jpl, jpltpu, shape=shape, src=src, dst=dst, interpret=True))(*args)
    for a, b in zip(theirs, want, strict=True):
        same_bits(a, b)


# -- bitcasts with other views -------------------------------------------------


def build_with_indexers(pl, pltpu, interpret=None):
    """A bitcast after ``.at[...]`` and indexers after a bitcast (the last read as the window)."""

    def kernel(x_ref, o_ref, p_ref):
        o_ref[0] = x_ref.at[1].bitcast(jnp.bfloat16)[...]
        o_ref[1] = x_ref.bitcast(jnp.bfloat16)[0]
        p_ref[...] = x_ref.bitcast(jnp.bfloat16).at[1][16:32]
        x_ref.at[0].bitcast(jnp.bfloat16)[0:16] = p_ref[...]  # an input written: read back below
        o_ref[2] = x_ref.bitcast(jnp.bfloat16)[0]

    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((3, 32, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
        ),
        interpret=interpret,
    )


def with_indexers_expected(x):
    # In uint16, the bits of the bfloat16 view: JAX 0.10's CPU concatenate of bfloat16
    # quiets NaN payloads (0xffc0 for 0xffaf), where a kernel's copies keep them.
    v = tpu_bitcast(x, jnp.uint16)  # (2, 32, 128)
    p = v[1, 16:32]
    o = jnp.stack([v[1], v[0], v[0].at[0:16].set(p)])
    return lax.bitcast_convert_type(o, jnp.bfloat16), lax.bitcast_convert_type(p, jnp.bfloat16)


def quiet_nans(x):
    """bfloat16 ``x`` with each NaN the quiet one of its sign (0x7fc0, 0xffc0)."""
    u = np.asarray(x).view(np.uint16)
    nan = (u & 0x7FFF) > 0x7F80
    return np.where(nan, (u & 0x8000) | 0x7FC0, u).astype(np.uint16).view(np.asarray(x).dtype)


@every_way(tpu=True)
def test_bitcast_with_indexers(way):
    x = bits(11, (2, 16, 128), jnp.int32)
    o, p = way.jit(build_with_indexers(*way.modules()))(x)
    want_o, want_p = with_indexers_expected(x)
    if OLD_JAX and way.name == "tpu_interpret":
        # jaxlib 0.10's CPU concatenate and dynamic_update_slice of bfloat16 quiet NaN
        # payloads (0.11's keep them): the TPU interpreter's writes of o's rows are those
        # (p is written whole).
        want_o = quiet_nans(want_o)
    same_bits(o, want_o)
    same_bits(p, want_p)


def build_compact_words(pl, pltpu, interpret=None):
    """tokamax's routing gmm (``layout_util.load_compact_to_large`` and its store): a
    bf16 VMEM block ``(n, stride, 2, lanes)`` read and written as uint32 words,
    ``ref.bitcast(jnp.uint32).reshape(-1, lanes)``, with strided row windows."""
    n, stride, lanes = 2, 8, 128

    def kernel(x_ref, o_ref):
        words = x_ref.bitcast(jnp.uint32).reshape(-1, lanes)  # (n * stride, lanes)
        out = o_ref.bitcast(jnp.uint32).reshape(-1, lanes)
        for c in range(stride):
            out[c::stride] = words[c::stride] ^ jnp.uint32(c)

    shape = (n, stride, 2, lanes)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.bfloat16), interpret=interpret)


def compact_words_expected(x):
    n, stride, _, lanes = x.shape
    words = tpu_bitcast(x, jnp.uint32).reshape(-1, lanes)
    words = words ^ jnp.tile(jnp.arange(stride, dtype=jnp.uint32), n)[:, None]
    return tpu_bitcast(words.reshape(n, stride, 1, lanes), jnp.bfloat16)


@every_way(
    tpu=True,
    skip={
        "jax_mosaic": "JAX's Mosaic lowering: a reshape view under an abstract mesh of a TPU: "
        '"Length of sharding.spec (4) must be '
        "equal to aval's ndim (2)\" (its ReshapeTransform keeps the Ref's sharding)",
    },
)
def test_tokamax_compact_words(way):
    x = bits(12, (2, 8, 2, 128), jnp.bfloat16)
    same_bits(way.jit(build_compact_words(*way.modules()))(x), compact_words_expected(x))


def build_dma(pl, pltpu, *, wide, interpret=None):
    """DMAs through bitcast views: an HBM int32 array copied as bf16 into VMEM, then
    into an HBM output through its bf16 view (``wide``: the views are uint32 of a
    bf16 array instead, tokamax's ``o_hbm.bitcast(jnp.uint32)``)."""
    src, dst = (jnp.bfloat16, jnp.uint32) if wide else (jnp.int32, jnp.bfloat16)
    shape = (32, 128) if wide else (16, 128)
    view = (16, 128) if wide else (32, 128)

    def kernel(x_hbm, o_hbm, buf, sem):
        pltpu.async_copy(x_hbm.bitcast(dst), buf, sem).wait()
        buf[...] = lax.bitcast_convert_type(
            lax.bitcast_convert_type(buf[...], _uint(dst)) ^ _uint(dst)(5), dst
        )
        pltpu.async_copy(buf, o_hbm.bitcast(dst), sem).wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(shape, src),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM(view, dst), pltpu.SemaphoreType.DMA],
        interpret=interpret,
    )


def dma_expected(x, dst):
    v = tpu_bitcast(x, dst)
    v = lax.bitcast_convert_type(lax.bitcast_convert_type(v, _uint(dst)) ^ _uint(dst)(5), dst)
    return tpu_bitcast(v, x.dtype)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("wide", [False, True], ids=["narrowing", "widening"])
def test_dma_through_bitcast_views(wide, way):
    x = bits(13 + wide, (32, 128) if wide else (16, 128), jnp.bfloat16 if wide else jnp.int32)
    got = way.jit(build_dma(*way.modules(), wide=wide))(x)
    same_bits(got, dma_expected(x, jnp.uint32 if wide else jnp.bfloat16))


@pytest.mark.parametrize(
    "build, args, expected",
    [
        (build_with_indexers, lambda: (bits(11, (2, 16, 128), jnp.int32),), with_indexers_expected),
        (build_compact_words, lambda: (bits(12, (2, 8, 2, 128), jnp.bfloat16),), compact_words_expected),
    ],
    ids=["indexers", "compact_words"],
)
@pytest.mark.skipif(
    OLD_JAX, reason=f"{_OLD_JAX_INTERPRET}; ours: test_bitcast_with_indexers, test_tokamax_compact_words"
)
def test_views_as_jax_interprets_them(build, args, expected):
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu

    args = args()
    theirs = jax.jit(build(jpl, jpltpu, interpret=True))(*args)
    jax.tree.map(same_bits, theirs, expected(*args))


# -- errors --------------------------------------------------------------------


def _bitcast_kernel_call(shape, src, dst, **spec):
    def bitcast_reader(x_ref, o_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype) + x_ref.bitcast(dst)[...].astype(o_ref.dtype).sum()

    return pl.pallas_call(bitcast_reader, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), **spec)


@pytest.mark.parametrize(
    "shape, src, dst, exc, words",
    [
        ((256,), jnp.int32, jnp.bfloat16, NotImplementedError, "Bitcast 1D ref with bitwidth change"),
        (
            (3, 128),
            jnp.int8,
            jnp.int32,
            ValueError,
            "multiplying the second-minor dimension by the bitwidths",
        ),
    ],
    ids=["1d", "rows_not_packable"],
)
@pytest.mark.parametrize("mode", ["interpret", "ours"])
def test_shapes_jax_refuses(shape, src, dst, exc, words, mode):
    # JAX's rule refuses these when the kernel is traced (JAX's words); ours names the
    # kernel and the line of the read.
    x = bits(1, shape, src)
    f = _bitcast_kernel_call(shape, src, dst)
    with pytest.raises(exc, match=r"(?s)in kernel 'bitcast_reader'.*test_ref_bitcast.py:\d+.*" + words):
        if mode == "interpret":
            with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
                jax.jit(f)(x)
        else:
            Way("mosaic").jit(f)(x)


def test_width_change_of_a_block_squeezing_its_second_minor_dim_is_refused_by_the_lowering():
    # As JAX's lowering: the kernel's Ref (16, 128) of a (16, None, 128) block has no
    # second-to-last dimension of the block to pack along.
    x = bits(2, (16, 1, 128), jnp.int32)
    spec = dict(in_specs=[pl.BlockSpec((16, None, 128), lambda: (0, 0, 0))])
    f = _bitcast_kernel_call(None, jnp.int32, jnp.bfloat16, **spec)
    with pytest.raises(
        NotImplementedError, match=r"squeezes the second-to-last dimension \(None in block_shape\[-2\]\)"
    ):
        Way("mosaic").jit(f)(x)
    # Interpret mode reads the (16, 128) Ref the kernel sees, as JAX's interpret=True does.
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = jax.jit(f)(x)
    want = tpu_bitcast(x[:, 0], jnp.bfloat16).astype(jnp.float32).sum()
    np.testing.assert_allclose(np.asarray(got), np.full((8, 128), want), rtol=1e-2)


@pytest.mark.interpret_only(reason="the interpreter's flat indices of a DMA with a traced size")
def test_dma_of_traced_size_through_a_width_changing_bitcast_says_so():
    def kernel(n_ref, x_hbm, o_ref, buf, sem):
        n = n_ref[0]
        pltpu.async_copy(x_hbm.bitcast(jnp.bfloat16).at[pl.ds(0, n)], buf.at[pl.ds(0, n)], sem).wait()
        o_ref[...] = buf[...]

    f = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((32, 128), jnp.bfloat16),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((32, 128), lambda *_: (0, 0)),
            scratch_shapes=[pltpu.VMEM((32, 128), jnp.bfloat16), pltpu.SemaphoreType.DMA],
        ),
    )
    with pytest.raises(NotImplementedError, match="through a bitcast from int32 to bfloat16"):
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            jax.jit(f)(jnp.array([16], jnp.int32), bits(4, (16, 128), jnp.int32))
