"""JAX 0.12's newest TPU names: ``pltpu.split_bits`` /
``join_bits`` / ``pack_fp6`` / ``unpack_fp6``, ``pltpu.has_memory_space``,
``pltpu.conv``, and the ``pl`` names ``enable_poison_buffers``,
``get_global``, ``Indirect`` and ``semaphore``.

Each kernel runs every TPU way (tests/ways, ``every_way(tpu=True)``) and is compared
with a plain numpy/jnp reference on fresh random data. JAX's own op is the ``jax_mosaic`` way (its
lowering, run by ``run_mosaic``) where the installed JAX has the name (0.12;
0.11.2 has ``conv``), skipped with the reason where it does not: JAX's interpret
modes cannot run these ops on a CPU (no rule for ``unpack_elementwise``, ``conv``,
``has_memory_space``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxlib import version as jaxlib_version
from ways import compare as ways_compare
from ways import compiled as ways_compiled
from ways import every_way
from ways import jax_mosaic as ways_jax_mosaic

import pallas as pl
import pallas_tpu as pltpu

jpl, jtpu = ways_jax_mosaic.jax_namespaces()
NEW_JAXLIB = jaxlib_version.__version_info__ >= (0, 12)


def _jax_has(name):
    return hasattr(jtpu, name) or hasattr(jpl, name)


def ways(name):
    """``every_way(tpu=True)``, the jax_mosaic way skipped where the installed JAX lacks ``name``."""
    if _jax_has(name):
        return every_way(tpu=True)
    return every_way(
        tpu=True,
        skip={
            "jax_mosaic": f"JAX's Mosaic lowering: JAX {jax.__version__} has no {name} (JAX 0.12 added it)"
        },
    )


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture
def no_v4(monkeypatch):
    """The compiled way without TPU v4: its Mosaic has no 2-bit vectors, and libtpu aborts the
    whole process on one ('Unsupported B2 packed type'), so it cannot even be tried there."""
    chips = tuple(c for c in ways_compiled.COMPILE_CHIPS if c != "v4")
    if not chips:
        pytest.skip(
            "TPU v4 has no 2-bit vectors (libtpu aborts the process on them); no other chip to compile for"
        )
    monkeypatch.setattr(ways_compiled, "COMPILE_CHIPS", chips)


def _bytes(rng, shape=(16, 128), dtype=np.int8):
    info = np.iinfo(dtype)
    return jnp.asarray(rng.integers(info.min, info.max, size=shape, endpoint=True), dtype)


def _fields(x, widths):
    """numpy reference: the fields of each byte, lowest first, as signed ints."""
    u = np.asarray(x).view(np.uint8).astype(np.int32)
    out, at = [], 0
    for w in widths:
        f = (u >> at) & ((1 << w) - 1)
        out.append(np.where(f >= 1 << (w - 1), f - (1 << w), f))
        at += w
    return out


# ---------------------------------------------------------------- split / join bits


@ways("split_bits")
@pytest.mark.parametrize(
    "widths, dtype", [((4, 2), np.int8), ((2, 4, 2), np.uint8), ((4, 4), np.int8), ((2,), np.uint8)]
)
def test_split_bits(way, widths, dtype, rng, no_v4):
    x = _bytes(rng, dtype=dtype)

    def build(pl, pltpu):
        def kernel(x_ref, *outs):
            for o, f in zip(outs, pltpu.split_bits(x_ref[...], widths)):
                o[...] = f.astype(jnp.int32)

        shapes = [jax.ShapeDtypeStruct(x.shape, jnp.int32)] * len(widths)
        return lambda x: pl.pallas_call(kernel, out_shape=shapes)(x)

    got = way.jit(build(*way.modules()))(x)
    for g, ref in zip(got, _fields(x, widths)):
        np.testing.assert_array_equal(g, ref)


@ways("join_bits")
@pytest.mark.parametrize("given", ["both", "two", "four"])
def test_join_bits(way, given, rng, no_v4):
    two = jnp.asarray(rng.integers(0, 4, (16, 128)), jnp.uint8)
    four = jnp.asarray(rng.integers(-8, 8, (16, 128)), jnp.int8)

    def build(pl, pltpu):
        def kernel(t_ref, f_ref, o_ref):
            kw = {}
            if given != "four":
                kw["two_bits"] = t_ref[...].astype(jnp.uint2)
            if given != "two":
                kw["four_bits"] = f_ref[...].astype(jnp.int4)
            o_ref[...] = pltpu.join_bits(**kw)

        return lambda t, f: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(t.shape, jnp.int8))(t, f)

    got = way.jit(build(*way.modules()))(two, four)
    t, f = np.asarray(two).astype(np.int32), np.asarray(four).astype(np.int32) & 15
    ref = {"both": (t << 4) | f, "two": t, "four": f}[given]
    np.testing.assert_array_equal(got, ref.astype(np.int8))


@ways("pack_fp6")
def test_pack_unpack_fp6_round_trip(way, rng, no_v4):
    x = jnp.asarray(rng.integers(0, 64, (16, 128)), jnp.int8)  # 6-bit values in bytes

    def build(pl, pltpu):
        def kernel(x_ref, t_ref, f_ref, back_ref):
            two, four = pltpu.pack_fp6(x_ref[...])
            t_ref[...], f_ref[...] = two.astype(jnp.int32), four.astype(jnp.int32)
            back_ref[...] = pltpu.unpack_fp6(two, four)

        shapes = [jax.ShapeDtypeStruct(x.shape, jnp.int32)] * 2 + [jax.ShapeDtypeStruct(x.shape, jnp.int8)]
        return lambda x: pl.pallas_call(kernel, out_shape=shapes)(x)

    two, four, back = way.jit(build(*way.modules()))(x)
    ref_four, ref_two = _fields(x, (4, 2))
    np.testing.assert_array_equal(two, ref_two)
    np.testing.assert_array_equal(four, ref_four)
    np.testing.assert_array_equal(back, x)


def test_bits_outside_kernels_and_under_jit(rng):
    x = _bytes(rng, dtype=np.uint8)
    a, b, c = jax.jit(lambda x: pltpu.split_bits(x, (2, 4, 2)))(x)
    assert (a.dtype, b.dtype, c.dtype) == (jnp.int2, jnp.int4, jnp.int2)
    for g, ref in zip((a, b, c), _fields(x, (2, 4, 2))):
        np.testing.assert_array_equal(np.asarray(g).astype(np.int32), ref)
    two, four = pltpu.pack_fp6(x)
    np.testing.assert_array_equal(pltpu.unpack_fp6(two, four), (np.asarray(x) & 63).astype(np.int8))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (
            lambda: pltpu.split_bits(jnp.zeros(4, jnp.int32), (4,)),
            ValueError,
            r"split_bits: x must be an 8-bit",
        ),
        (lambda: pltpu.split_bits(jnp.zeros(4, jnp.float8_e4m3fn), (4,)), ValueError, r"8-bit integer array"),
        (lambda: pltpu.split_bits(jnp.zeros(4, jnp.int8), (4, 4, 2)), ValueError, r"add up to 10 bits"),
        (
            lambda: pltpu.split_bits(jnp.zeros(4, jnp.int8), (3,)),
            ValueError,
            r"bitwidths may hold only 2 and 4",
        ),
        (lambda: pltpu.split_bits(jnp.zeros(4, jnp.int8), 4), TypeError, r"bitwidths must be a tuple"),
        (lambda: pltpu.join_bits(), ValueError, r"join_bits: give two_bits, four_bits or both"),
        (lambda: pltpu.join_bits(two_bits=jnp.zeros(4, jnp.int4)), ValueError, r"two_bits must be a 2-bit"),
        (lambda: pltpu.join_bits(four_bits=jnp.zeros(4, jnp.int8)), ValueError, r"four_bits must be a 4-bit"),
        (
            lambda: pltpu.join_bits(two_bits=jnp.zeros(4, jnp.int2), four_bits=jnp.zeros(3, jnp.int4)),
            ValueError,
            r"one shape, got \(4,\) and \(3,\)",
        ),
        (lambda: pltpu.unpack_fp6(jnp.zeros(4, jnp.int8), jnp.zeros(4, jnp.int4)), ValueError, r"two_bits"),
        (lambda: pltpu.pack_fp6(jnp.zeros(4, jnp.int16)), ValueError, r"8-bit integer array"),
    ],
)
def test_bits_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_bits_error_in_kernel_names_kernel_and_line():
    def bad_kernel(x_ref, o_ref):
        o_ref[...] = pltpu.split_bits(x_ref[...], (8,))[0].astype(jnp.int32)

    x = jnp.zeros((8, 128), jnp.int8)
    with pytest.raises(ValueError, match=r"bad_kernel.*test_jax012_names.py:\d+.*only 2 and 4"):
        pl.pallas_call(bad_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.int32), interpret=True)(x)


# ------------------------------------------------------------------- has_memory_space


def _has_memory_space_build(pl, pltpu):
    def kernel(x_ref, o_ref):
        o_ref[0] = pltpu.has_memory_space(x_ref, pltpu.HBM).astype(jnp.int32)
        o_ref[1] = pltpu.has_memory_space(x_ref, pltpu.VMEM).astype(jnp.int32)
        o_ref[2] = pltpu.has_memory_space(x_ref.at[2:], pltpu.SMEM).astype(jnp.int32)

    return lambda x: pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((3,), jnp.int32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
    )(x)


@ways("has_memory_space")
def test_has_memory_space(way, rng):
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    if way.name in ("mosaic", "compiled") and not NEW_JAXLIB:
        with pytest.raises(pltpu.LoweringException, match=r"has_memory_space.*JAX/jaxlib >= 0\.12"):
            way.jit(_has_memory_space_build(*way.modules()))(x)
        return
    got = way.jit(_has_memory_space_build(*way.modules()))(x)
    # Interpreters and run_mosaic keep pl.ANY operands in HBM.
    np.testing.assert_array_equal(got, [1, 0, 0])


@pytest.mark.parametrize(
    "ref_space, target, exc, match",
    [
        ("vmem", "hbm", ValueError, r"has_memory_space: ref must have pl.ANY memory space, but got vmem"),
        ("any", "any", ValueError, r"has_memory_space\(\.\.\., pl.ANY\) is not supported"),
        ("any", "vmemx", TypeError, r"memory_space must be a pltpu memory space"),
    ],
)
def test_has_memory_space_errors(ref_space, target, exc, match):
    spaces = {"vmem": pltpu.VMEM, "any": pl.ANY, "hbm": pltpu.HBM, "vmemx": "vmem"}

    def kernel(x_ref, o_ref):
        o_ref[0] = pltpu.has_memory_space(x_ref, spaces[target]).astype(jnp.int32)

    x = jnp.zeros((8, 128), jnp.float32)
    with pytest.raises(exc, match=match):
        pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
            in_specs=[pl.BlockSpec(memory_space=spaces[ref_space])],
            out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
            interpret=pltpu.InterpretParams(),
        )(x)


def test_has_memory_space_value_is_not_a_ref():
    with pytest.raises(TypeError, match=r"has_memory_space: ref must be a Ref"):
        pltpu.has_memory_space(jnp.zeros(3), pltpu.HBM)


# ------------------------------------------------------------------------------- conv


def _conv_ref(x, w, acc, dn, reversal, **kw):
    n = np.ndim(x) - 2
    spec = lax.conv_dimension_numbers(x.shape, w.shape, dn)
    flip = [d for d, r in zip(spec.rhs_spec[2:], reversal or (False,) * n) if r]
    w = np.flip(np.asarray(w), flip) if flip else w
    kw.setdefault("window_strides", (1,) * n)
    out = lax.conv_general_dilated(x, w, dimension_numbers=dn, precision="highest", **kw)
    return out if acc is None else acc + out


CONV_CASES = [
    # (lhs shape, rhs shape, dimension numbers, kwargs of conv, with acc)
    ((2, 16, 128), (3, 128, 128), ("NWC", "WIO", "NWC"), dict(padding="SAME", window_reversal=(True,)), True),
    ((2, 16, 128), (3, 128, 128), ("NWC", "WIO", "NWC"), dict(window_strides=(2,), padding=((1, 1),)), False),
    (
        (1, 8, 8, 128),
        (3, 3, 128, 128),
        ("NHWC", "HWIO", "NHWC"),
        dict(padding="VALID", rhs_dilation=(1, 2)),
        True,
    ),
]


@ways("conv")
@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_conv(way, case, rng):
    xs, ws, dn, kw, with_acc = CONV_CASES[case]
    x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
    w = jnp.asarray(rng.standard_normal(ws), jnp.float32)
    reversal = kw.get("window_reversal")
    plain = {k: v for k, v in kw.items() if k != "window_reversal"}
    plain.setdefault("padding", ((0, 0),) * (len(xs) - 2))
    out0 = _conv_ref(x, w, None, dn, reversal, **plain)
    acc = jnp.asarray(rng.standard_normal(out0.shape), jnp.float32) if with_acc else None

    def build(pl, pltpu):
        def kernel(x_ref, w_ref, *rest):
            *a, o_ref = rest
            o_ref[...] = pltpu.conv(
                x_ref[...], w_ref[...], a[0][...] if a else None, dimension_numbers=dn, **kw
            )

        return lambda *a: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out0.shape, jnp.float32))(*a)

    args = (x, w) if acc is None else (x, w, acc)
    if way.name in ("mosaic", "compiled") and ways_jax_mosaic.OLD_JAX:
        with pytest.raises(pltpu.LoweringException, match=r"pltpu.conv \(tpu.conv\).*>= 0\.11\.2"):
            way.jit(build(*way.modules()))(*args)
        return
    got = way.jit(build(*way.modules()))(*args)
    ref = out0 if acc is None else acc + out0
    # The interpret ways convolve at the CPU's default precision (f32), the Mosaic ways at HIGHEST.
    ways_compare.close(got, np.asarray(ref), tol=2e-4)


def test_conv_preferred_type_and_int(rng):
    x = jnp.asarray(rng.integers(-5, 5, (1, 8, 16)), jnp.int8)
    w = jnp.asarray(rng.integers(-5, 5, (3, 16, 8)), jnp.int8)
    got = pltpu.conv(x, w, dimension_numbers=("NWC", "WIO", "NWC"), preferred_element_type=jnp.int32)
    assert got.dtype == jnp.int32
    ref = lax.conv_general_dilated(
        x.astype(jnp.int32), w.astype(jnp.int32), (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")
    )
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(dimension_numbers=("NWC", "WIO")), ValueError, r"conv: dimension_numbers"),
        (
            dict(dimension_numbers=("NWC", "WIO", "NWC"), window_strides=(0,)),
            ValueError,
            r"window_strides must hold 1",
        ),
        (
            dict(dimension_numbers=("NWC", "WIO", "NWC"), padding="FULL"),
            ValueError,
            r"padding must be 'SAME'",
        ),
        (
            dict(dimension_numbers=("NWC", "WIO", "NWC"), padding=((1, 1), (0, 0))),
            ValueError,
            r"padding must hold 1",
        ),
        (
            dict(dimension_numbers=("NWC", "WIO", "NWC"), window_reversal=(True, False)),
            ValueError,
            r"window_reversal",
        ),
        (
            dict(dimension_numbers=("NWC", "WIO", "NWC"), lhs_dilation="x"),
            TypeError,
            r"lhs_dilation must be a sequence",
        ),
        (
            dict(dimension_numbers=("NWC", "WIO", "NWC"), acc=jnp.zeros((1, 9, 8))),
            ValueError,
            r"acc has shape \(1, 9, 8\) but the convolution gives \(1, 14, 8\)",
        ),
    ],
)
def test_conv_errors(kw, exc, match):
    x, w = jnp.zeros((1, 16, 4)), jnp.zeros((3, 4, 8))
    with pytest.raises(exc, match=match):
        pltpu.conv(x, w, **kw)


def test_conv_rank_error():
    with pytest.raises(ValueError, match=r"pltpu.conv: lhs and rhs must have one rank of at least 3"):
        pltpu.conv(jnp.zeros((4, 4)), jnp.zeros((4, 4)), dimension_numbers=("NC", "IO", "NC"))
