"""Value-level TPU primitives (roll, bitcast, pack/unpack, stochastic_round,
reciprocal, einshape, trace_value, touch, annotate,
with_memory_space_constraint) and tpu_info.

Each op runs five ways: directly under ``jax.jit`` (its interpret semantics
is plain JAX), and as a kernel the ways of tests/ways ``VECTOR_WAYS`` names:
pallas-core's ``interpret=True`` (``core``), TPU interpret mode, our Mosaic lowering
and JAX's, each executed by ``run_mosaic``. An op is written as ``fn(t, *arrays)``
where ``t`` is the pallas-tpu namespace (``jax.experimental.pallas.tpu`` in the
``jax_mosaic`` way). Results are compared with a plain numpy/jnp reference and, where
JAX can run the op on a CPU, with JAX's own op under JAX's ``interpret=True``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.jax_mosaic
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from ways import every_way, way_params

import pallas as pl
import pallas_tpu
from pallas_tpu._src.language import einshape as _einshape_mod
from pallas_tpu._src.language import tpu_info as _tpu_info_mod
from pallas_tpu._src.language import vector_primitives as _vp


def _public(name, module):
    """``pltpu.<name>``, or the defining module's until ``pallas_tpu`` re-exports it."""
    try:
        return getattr(pallas_tpu, name)
    except (AttributeError, NotImplementedError):
        return getattr(module, name)


roll = _public("roll", _vp)
bitcast = _public("bitcast", _vp)
pack_elementwise = _public("pack_elementwise", _vp)
unpack_elementwise = _public("unpack_elementwise", _vp)
stochastic_round = _public("stochastic_round", _vp)
reciprocal = _public("reciprocal", _vp)
trace_value = _public("trace_value", _vp)
touch = _public("touch", _vp)
annotate = _public("annotate", _vp)
with_memory_space_constraint = _public("with_memory_space_constraint", _vp)
einshape = _public("einshape", _einshape_mod)
get_tpu_info = _public("get_tpu_info", _tpu_info_mod)
get_tpu_info_for_chip = _public("get_tpu_info_for_chip", _tpu_info_mod)
ChipVersion = _public("ChipVersion", _tpu_info_mod)
Tiling = _public("Tiling", _tpu_info_mod)
is_tpu_device = _public("is_tpu_device", _tpu_info_mod)

VECTOR_WAYS = ("core", "tpu_interpret", "mosaic", "jax_mosaic")
# "direct" (the op under jax.jit, the ``way`` fixture's parameter as it is), then each way.
MODES = pytest.mark.parametrize("way", ["direct", *way_params(only=VECTOR_WAYS)], indirect=True)


def _tpu_interpret_params():
    try:
        return pallas_tpu.InterpretParams()
    except (AttributeError, NotImplementedError):
        pytest.skip("pallas_tpu.InterpretParams is not exported yet")


def _kernel_of(fn, n_in):
    def kernel(*refs):
        refs[-1][...] = fn(*[r[...] for r in refs[:n_in]])

    return kernel


def run(way, fn, *args):
    """``fn(t, *args)`` (arrays -> one array; ``t`` the pallas-tpu namespace)
    directly (``way`` "direct") or as a whole-array kernel run the ``way`` way."""
    if way == "direct":
        return jax.jit(functools.partial(fn, pallas_tpu))(*args)
    if way.name == "core":
        f = functools.partial(fn, pallas_tpu)
        return pl.pallas_call(_kernel_of(f, len(args)), out_shape=jax.eval_shape(f, *args), interpret=True)(
            *args
        )
    f = functools.partial(fn, way.pltpu)
    return way.jit(lambda *a: way.pallas_call(_kernel_of(f, len(args)), out_shape=jax.eval_shape(f, *a))(*a))(
        *args
    )


def run_jax(fn, *args):
    """The same kernel under JAX's Pallas ``interpret=True`` (the reference)."""
    f = functools.partial(fn, jpltpu)
    return jpl.pallas_call(_kernel_of(f, len(args)), out_shape=jax.eval_shape(f, *args), interpret=True)(
        *args
    )


def as_bits(x):
    x = np.asarray(x)
    return x.view(f"uint{x.dtype.itemsize * 8}")


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def _rand(rng, shape, dtype):
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(rng.integers(int(info.min), int(info.max), size=shape, endpoint=True), dtype)


# ---------------------------------------------------------------------- roll


@MODES
@pytest.mark.parametrize(
    "shape,axis,shift,dtype",
    [
        ((8, 128), 1, 5, jnp.float32),
        ((8, 128), 0, 3, jnp.int32),
        ((16, 128), 1, 127, jnp.bfloat16),
        ((2, 8, 128), 2, 200, jnp.float32),
        ((2, 8, 128), 0, 1, jnp.float32),
    ],
)
def test_roll_matches_jnp_and_jax(way, shape, axis, shift, dtype, rng):
    x = _rand(rng, shape, dtype)
    out = run(way, lambda t, x: t.roll(x, shift, axis), x)
    np.testing.assert_array_equal(out, jnp.roll(x, shift, axis))
    np.testing.assert_array_equal(out, run_jax(lambda t, x: t.roll(x, shift, axis), x))


@MODES
@pytest.mark.parametrize("axis,stride,stride_axis", [(1, 1, 0), (1, 3, 0), (0, 2, 1)])
def test_roll_stride(way, axis, stride, stride_axis, rng):
    x = _rand(rng, (8, 128), jnp.float32)
    shift = int(rng.integers(0, 64))
    out = run(way, lambda t, x: t.roll(x, shift, axis, stride=stride, stride_axis=stride_axis), x)
    # Reference: slice k along stride_axis rolls by shift + k * stride.
    xn = np.asarray(x)
    ref = np.stack(
        [
            np.roll(np.take(xn, k, stride_axis), shift + k * stride, axis - (axis > stride_axis))
            for k in range(8 if stride_axis == 0 else 128)
        ],
        stride_axis,
    )
    np.testing.assert_array_equal(out, ref)
    jax_ref = run_jax(lambda t, x: t.roll(x, shift, axis, stride=stride, stride_axis=stride_axis), x)
    np.testing.assert_array_equal(out, jax_ref)


@MODES
def test_roll_dynamic_shift(way, rng):
    x = _rand(rng, (8, 128), jnp.float32)
    shifts = jnp.full((8, 128), int(rng.integers(0, 300)), jnp.int32)
    out = run(way, lambda t, x, s: t.roll(x, s[0, 0], 1), x, shifts)
    np.testing.assert_array_equal(out, jnp.roll(x, int(shifts[0, 0]), 1))


def test_roll_vmap_and_grad(rng):
    x = _rand(rng, (4, 8, 128), jnp.float32)
    shifts = jnp.asarray(rng.integers(0, 128, size=4), jnp.int32)
    out = jax.vmap(lambda x, s: roll(x, s, 1))(x, shifts)
    np.testing.assert_array_equal(out, jnp.stack([jnp.roll(x[i], int(shifts[i]), 1) for i in range(4)]))
    xt = x[:, :, :8]  # batch along the last axis: 8 columns, one JAX reference call each
    out = jax.vmap(lambda x: roll(x, 3, 0, stride=2, stride_axis=1), in_axes=2, out_axes=2)(xt)
    theirs = jax.jit(lambda a: jpltpu.roll(a, 3, 0, stride=2, stride_axis=1))
    ref = jnp.stack([theirs(xt[:, :, i]) for i in range(8)], 2)
    np.testing.assert_array_equal(out, ref)
    w = _rand(rng, (8, 128), jnp.float32)
    g = jax.grad(lambda x: (roll(x, 7, 1, stride=1, stride_axis=0) * w).sum())(x[0])
    # Reference: the gradient of the same strided roll written with jnp.roll.
    strided = lambda a: jnp.concatenate([jnp.roll(a[k : k + 1], 7 + k, 1) for k in range(8)], 0)  # noqa: E731
    np.testing.assert_array_equal(g, jax.grad(lambda a: (strided(a) * w).sum())(x[0]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(shift=-1, axis=1), "shift must be non-negative"),
        (dict(shift=1, axis=2), "axis 2 is out of range"),
        (dict(shift=1, axis=-1), "axis -1 is out of range"),
        (dict(shift=1.5, axis=1), "shift must be an integer scalar"),
        (dict(shift=1, axis=1, stride=1), "both stride and stride_axis"),
        (dict(shift=1, axis=1, stride=1, stride_axis=1), "must differ"),
        (dict(shift=1, axis=1, stride=-1, stride_axis=0), "stride must be non-negative"),
    ],
)
def test_roll_errors(kwargs, match):
    x = jnp.zeros((8, 128))
    with pytest.raises((ValueError, TypeError), match=match):
        roll(x, **kwargs)


def test_roll_error_in_kernel_names_kernel_and_line():
    def my_kernel(x_ref, o_ref):
        o_ref[...] = roll(x_ref[...], 1, 5)

    x = jnp.zeros((8, 128))
    with pytest.raises(ValueError, match=r"my_kernel.*test_vector_primitives.py:\d+.*pltpu.roll"):
        pl.pallas_call(my_kernel, out_shape=x, interpret=True)(x)


# ------------------------------------------------------------------- bitcast


def _bitcast_ref(x, ty):
    """numpy: the width change is absorbed by the second-minor dim, low part first."""
    x = np.asarray(x)
    src, dst = x.dtype.itemsize * 8, jnp.dtype(ty).itemsize * 8
    *lead, m, n = x.shape
    u = as_bits(x)
    if src > dst:
        k = src // dst
        parts = [(u >> (dst * b)) & ((1 << dst) - 1) for b in range(k)]  # (..., m, n) each
        out = np.stack(parts, -2).reshape(*lead, m * k, n)
    elif src < dst:
        k = dst // src
        u = u.reshape(*lead, m // k, k, n).astype(np.uint64)
        out = sum(u[..., b, :] << (src * b) for b in range(k))
    else:
        out = u
    return out.astype(f"uint{dst}")


@MODES
@pytest.mark.parametrize(
    "src,dst",
    [
        (jnp.int32, jnp.int8),
        (jnp.int32, jnp.int16),
        (jnp.float32, jnp.bfloat16),
        (jnp.int32, jnp.float32),
        (jnp.int8, jnp.int32),
        (jnp.bfloat16, jnp.uint32),
        (jnp.int16, jnp.int8),
    ],
)
def test_bitcast(way, src, dst, rng):
    x = _rand(rng, (32, 128), src)
    out = run(way, lambda t, x: t.bitcast(x, dst), x)
    assert out.dtype == jnp.dtype(dst)
    np.testing.assert_array_equal(as_bits(out), _bitcast_ref(x, dst))
    np.testing.assert_array_equal(as_bits(out), as_bits(run_jax(lambda t, x: t.bitcast(x, dst), x)))
    back = run(way, lambda t, y: t.bitcast(y, src), out)
    np.testing.assert_array_equal(as_bits(back), as_bits(x))


def test_bitcast_vmap_keeps_last_two_dims(rng):
    x = _rand(rng, (8, 3, 128), jnp.int32)
    out = jax.vmap(lambda a: bitcast(a, jnp.int8), in_axes=1, out_axes=1)(x)
    ref = np.stack([_bitcast_ref(x[:, i], jnp.int8) for i in range(3)], 1)
    np.testing.assert_array_equal(as_bits(out), ref)


@pytest.mark.parametrize(
    "shape,src,dst,match",
    [
        ((128,), jnp.int32, jnp.int8, "rank >= 2"),
        ((6, 128), jnp.int8, jnp.int32, "cannot be packed"),
        ((8, 128), jnp.bool_, jnp.int8, "cannot be bitcast"),
    ],
)
def test_bitcast_errors(shape, src, dst, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bitcast(jnp.zeros(shape, src), dst)


# ------------------------------------------------------- pack / unpack elementwise


@MODES
@pytest.mark.parametrize(
    "src,packed",
    [
        (jnp.float32, jnp.bfloat16),
        (jnp.int32, jnp.int8),
        (jnp.int32, jnp.int16),
        (jnp.int8, jnp.int4),
        (jnp.int16, jnp.int4),
    ],
)
def test_pack_unpack_elementwise(way, src, packed, rng):
    k = jnp.dtype(src).itemsize * 8 // jax.dtypes.itemsize_bits(jnp.dtype(packed))
    xs = [_rand(rng, (8, 128), src) for _ in range(k)]
    out = run(way, lambda t, *xs: t.pack_elementwise(list(xs), packed_dtype=packed), *xs)
    width = jnp.dtype(src).itemsize * 8
    p = width // k
    assert out.dtype == jnp.dtype(f"uint{width}")
    # Reference: field i (low bits first) holds xs[i] in the packed type.
    ref = np.zeros((8, 128), np.uint64)
    for i, x in enumerate(xs):
        if jnp.issubdtype(src, jnp.floating):
            field = as_bits(np.asarray(x.astype(packed))).astype(np.uint64)
        else:
            field = as_bits(np.asarray(x)).astype(np.uint64) & ((1 << p) - 1)
        ref |= field << (i * p)
    np.testing.assert_array_equal(out, ref.astype(out.dtype))
    for i, x in enumerate(xs):
        got = run(
            way, lambda t, w: t.unpack_elementwise(w, index=i, packed_dtype=packed, unpacked_dtype=src), out
        )
        np.testing.assert_array_equal(got, x.astype(packed).astype(src))


def test_unpack_matches_strided_bitcast(rng):
    # JAX's docstring: unpack(i16_x, index) == bitcast(i16_x, int8)[index::2].astype(int16).
    x = _rand(rng, (16, 128), jnp.int16)
    i8 = bitcast(x, jnp.int8)
    for index in range(2):
        got = unpack_elementwise(x, index=index, packed_dtype=jnp.int8, unpacked_dtype=jnp.int16)
        np.testing.assert_array_equal(got, i8[index::2].astype(jnp.int16))


def test_pack_vmap(rng):
    a, b = _rand(rng, (3, 8, 128), jnp.float32), _rand(rng, (8, 128), jnp.float32)
    out = jax.vmap(lambda a: pack_elementwise([a, b], packed_dtype=jnp.bfloat16))(a)
    for i in range(3):
        np.testing.assert_array_equal(out[i], pack_elementwise([a[i], b], packed_dtype=jnp.bfloat16))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: pack_elementwise([jnp.zeros((8, 128))], packed_dtype=jnp.bfloat16), "holds 2"),
        (lambda: pack_elementwise([], packed_dtype=jnp.bfloat16), "at least one"),
        (
            lambda: pack_elementwise([jnp.zeros((8, 128)), jnp.zeros((8, 64))], packed_dtype=jnp.bfloat16),
            "one shape",
        ),
        (lambda: pack_elementwise([jnp.zeros((8, 128))] * 4, packed_dtype=jnp.int8), "float32 -> bfloat16"),
        (
            lambda: unpack_elementwise(
                jnp.zeros((8, 128), jnp.uint32), index=0, packed_dtype=jnp.int8, unpacked_dtype=jnp.int16
            ),
            "bit width",
        ),
        (
            lambda: unpack_elementwise(
                jnp.zeros((8, 128), jnp.uint32), index=4, packed_dtype=jnp.int8, unpacked_dtype=jnp.int32
            ),
            "out of range",
        ),
        (
            lambda: unpack_elementwise(
                jnp.zeros((8, 128), jnp.uint32), index=0, packed_dtype=jnp.bfloat16, unpacked_dtype=jnp.int32
            ),
            "both be floats",
        ),
    ],
)
def test_pack_unpack_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------ stochastic_round


@MODES
def test_stochastic_round_bf16_matches_bit_trick(way, rng):
    x = _rand(rng, (8, 128), jnp.float32) * 100
    bits = jnp.asarray(rng.integers(0, 2**32, size=(8, 128), dtype=np.uint64).astype(np.uint32))
    out = run(way, lambda t, x, b: t.stochastic_round(x, b, target_dtype=jnp.bfloat16), x, bits)
    # Up when the low 23 random bits are below the 16 bits cut off, as a 23-bit fraction
    # (the TPU v5e's rule).
    up = (np.asarray(bits) & 0x7FFFFF) < ((as_bits(x) & 0xFFFF).astype(np.uint32) << 7)
    word = (as_bits(x).astype(np.uint64) + np.where(up, 0x10000, 0).astype(np.uint64)) & np.uint64(0xFFFF0000)
    ref = (word.astype(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(as_bits(out), ref)


@pytest.mark.parametrize(
    "dtype",
    [jnp.bfloat16, jnp.float8_e5m2, jnp.float8_e4m3fn, jnp.float8_e4m3b11fnuz, jnp.float4_e2m1fn, jnp.int4],
    ids=str,
)
def test_stochastic_round_is_unbiased_and_brackets_x(dtype, rng):
    hi = 5.0 if dtype in (jnp.float4_e2m1fn, jnp.int4) else 20.0
    x = jnp.asarray(rng.uniform(-hi, hi, size=(64,)).astype(np.float32))
    n = 4000
    bits = jnp.asarray(rng.integers(0, 2**32, size=(n, 64), dtype=np.uint64).astype(np.uint32))
    xs = jnp.broadcast_to(x, (n, 64))
    out = jax.jit(lambda x, b: stochastic_round(x, b, target_dtype=dtype))(xs, bits).astype(jnp.float32)
    out = np.asarray(out, np.float64)
    down = np.asarray(
        jax.jit(lambda x: stochastic_round(x, jnp.full(x.shape, 2**32 - 1, jnp.uint32), target_dtype=dtype))(
            x
        ).astype(jnp.float32),
        np.float64,
    )
    up = np.asarray(
        jax.jit(lambda x: stochastic_round(x, jnp.zeros(x.shape, jnp.uint32), target_dtype=dtype))(x).astype(
            jnp.float32
        ),
        np.float64,
    )
    xd = np.asarray(x, np.float64)
    # Each result is one of the two neighbors of x; they bracket x.
    assert np.all((out == down) | (out == up))
    assert np.all(np.minimum(down, up) <= xd) and np.all(xd <= np.maximum(down, up))
    # Unbiased: the mean of many roundings is x (within 5 standard errors).
    gap = np.abs(up - down)
    err = np.abs(out.mean(0) - xd)
    assert np.all(err <= 5 * gap / (2 * np.sqrt(n)) + 1e-6), (err / np.maximum(gap, 1e-30)).max()


def test_stochastic_round_keeps_nan_inf_and_saturates():
    x = jnp.array([[jnp.nan, jnp.inf, -jnp.inf, 1e6, -1e6, 0.0, -0.0, 1.0]], jnp.float32)
    bits = jnp.zeros(x.shape, jnp.uint32)
    out = stochastic_round(x, bits, target_dtype=jnp.float8_e5m2).astype(jnp.float32)
    assert np.isnan(out[0, 0]) and out[0, 1] == np.inf and out[0, 2] == -np.inf
    big = float(jnp.finfo(jnp.float8_e5m2).max)
    assert float(out[0, 3]) == big and float(out[0, 4]) == -big
    np.testing.assert_array_equal(out[0, 5:], [0.0, 0.0, 1.0])


@pytest.mark.parametrize(
    "x,bits,target,match",
    [
        (jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((8, 128), jnp.uint32), jnp.int4, "x must be float32"),
        (jnp.zeros((8, 128)), jnp.zeros((8, 128), jnp.int32), jnp.bfloat16, "must be uint32"),
        (jnp.zeros((8, 128)), jnp.zeros((8, 64), jnp.uint32), jnp.bfloat16, "has shape"),
        (jnp.zeros((8, 128)), jnp.zeros((8, 128), jnp.uint32), jnp.float16, "unsupported target_dtype"),
    ],
)
def test_stochastic_round_errors(x, bits, target, match):
    with pytest.raises((ValueError, TypeError), match=match):
        stochastic_round(x, bits, target_dtype=target)


# ------------------------------------------------------------------ reciprocal


def _reciprocal(t):
    """``t.reciprocal``: JAX 0.10 has it as ``pl.reciprocal`` (moved to pltpu in 0.11)."""
    return getattr(t, "reciprocal", None) or jpl.reciprocal


@MODES
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("approx", [False, True])
def test_reciprocal(way, dtype, approx, rng):
    if way != "direct" and way.name == "jax_mosaic" and dtype == jnp.bfloat16 and ways.jax_mosaic.OLD_JAX:
        pytest.skip("JAX 0.10's Pallas: its lowering of reciprocal takes float32 only")
    x = _rand(rng, (8, 128), dtype) + jnp.asarray(3.0, dtype)
    out = run(way, lambda t, x: _reciprocal(t)(x, approx=approx), x)
    assert out.dtype == jnp.dtype(dtype)
    tol = 1e-2 if approx or dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(out, np.float32), 1 / np.asarray(x, np.float32), rtol=tol)
    if dtype == jnp.float32 and not (
        approx and way != "direct" and way.name in ("mosaic", "jax_mosaic")
    ):  # run_mosaic models the approximation
        if approx and ways.jax_mosaic.OLD_JAX:
            pytest.skip(
                "the comparison with JAX's: JAX 0.10's interpret mode computes approx=True exactly; "
                "0.11's, as ours, in bfloat16 (ours matched 1 / x to 1e-2)"
            )
        ref = run_jax(lambda t, x: _reciprocal(t)(x, approx=approx), x)
        np.testing.assert_array_equal(out, ref)


def test_reciprocal_grad_and_errors(rng):
    x = _rand(rng, (8, 128), jnp.float32) + 3
    np.testing.assert_allclose(jax.grad(lambda x: reciprocal(x).sum())(x), -1 / x**2, rtol=1e-5)
    np.testing.assert_allclose(jax.vmap(reciprocal)(x), 1 / x, rtol=1e-6)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        reciprocal(jnp.ones((8, 128), jnp.int32))


# ---------------------------------------------------------------- einshape


EINSHAPE_CASES = [
    ("ab->ba", (8, 128), {}),
    ("a(bc)->bac", (8, 128), dict(b=4)),
    ("a(bc)->(ba)c", (8, 128), dict(c=32)),
    ("abc->(ab)c", (2, 8, 128), {}),
    ("(ab)c->abc", (16, 128), dict(a=2)),
    ("abc->cba", (2, 8, 128), {}),
    ("(ab)(cd)->(ac)(bd)", (16, 128), dict(a=2, c=4)),
]


@MODES
@pytest.mark.parametrize("equation,shape,sizes", EINSHAPE_CASES)
def test_einshape(way, equation, shape, sizes, rng):
    x = _rand(rng, shape, jnp.float32)
    out = run(way, lambda t, x: t.einshape(equation, x, **sizes), x)
    np.testing.assert_array_equal(out, jpltpu.einshape(equation, x, **sizes))
    np.testing.assert_array_equal(out, run_jax(lambda t, x: t.einshape(equation, x, **sizes), x))


def test_einshape_numpy_reference_and_any_letter(rng):
    x = _rand(rng, (6, 20), jnp.int32)
    # A split size may be named x: equation and value are positional-only.
    out = einshape("(xy)b->y(bx)", x, x=2)
    ref = np.asarray(x).reshape(2, 3, 20).transpose(1, 2, 0).reshape(3, 40)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("equation,shape,sizes", EINSHAPE_CASES)
def test_einshape_vmap_and_grad(equation, shape, sizes, rng):
    x = _rand(rng, (3, *shape), jnp.float32)
    f = lambda x: einshape(equation, x, **sizes)  # noqa: E731
    out = jax.vmap(f, in_axes=0, out_axes=0)(x)
    np.testing.assert_array_equal(out, jnp.stack([f(x[i]) for i in range(3)]))
    w = _rand(rng, out.shape[1:], jnp.float32)
    g = jax.grad(lambda a: (f(a) * w).sum())(x[0])
    # einshape moves elements: its transpose puts w's elements back where they came from.
    came_from = jpltpu.einshape(equation, jnp.arange(x[0].size).reshape(shape), **sizes)
    np.testing.assert_array_equal(g, jnp.zeros(x[0].size).at[came_from.ravel()].set(w.ravel()).reshape(shape))
    if ways.jax_mosaic.OLD_JAX:
        pytest.skip(
            "the comparison with JAX's grad: JAX 0.10's einshape has no VJP (ours matched the transpose)"
        )
    g_ref = jax.grad(lambda a: (jpltpu.einshape(equation, a, **sizes) * w).sum())(x[0])
    np.testing.assert_array_equal(g, g_ref)


@pytest.mark.parametrize(
    "equation,sizes,match",
    [
        ("a(bc)->abc", {}, "all but one"),
        ("ab->a", {}, "same letters"),
        ("abc->abc", {}, "has 3 dimensions"),
        ("a(bc->abc", dict(b=2), "unmatched"),
        ("a(bc)->abc", dict(b=7), "cannot split"),
        ("ab-ba", {}, "exactly one '->'"),
        ("ab->ba", dict(z=2), "not in the equation"),
    ],
)
def test_einshape_errors(equation, sizes, match):
    with pytest.raises(ValueError, match=match):
        einshape(equation, jnp.zeros((6, 20)), **sizes)


# --------------------------------------------- ops with no value semantics


@every_way(
    only=VECTOR_WAYS,
    skip={"jax_mosaic": "JAX 0.10's Pallas: no pltpu.annotate"} if ways.jax_mosaic.OLD_JAX else {},
)
def test_trace_touch_annotate_are_value_identities(way, rng):
    x = _rand(rng, (8, 128), jnp.float32)

    def build(pl, t):
        def kernel(x_ref, o_ref):
            t.trace_value("sum", jnp.sum(x_ref[...]))
            t.trace_value("count", jnp.int32(3))
            t.touch(x_ref)
            o = t.annotate(o_ref, no_bank_conflict=True, no_hazard=True)
            o[...] = x_ref[...] * 2
            t.touch([o_ref, x_ref])

        if way.name == "core":
            return pl.pallas_call(kernel, out_shape=x, interpret=True)
        vmem = pl.BlockSpec(memory_space=t.VMEM)  # JAX's annotate wants VMEM Refs
        return pl.pallas_call(kernel, out_shape=x, in_specs=[vmem], out_specs=vmem)

    if way.name == "core":
        out = build(pl, pallas_tpu)(x)
    else:
        out = way.jit(build(*way.modules()))(x)
    np.testing.assert_array_equal(out, x * 2)


def test_trace_value_in_loop_and_jit(rng):
    x = _rand(rng, (8, 128), jnp.float32)

    def f(x):
        def body(i, c):
            trace_value("i", i)
            return c + 1.0

        return lax.fori_loop(0, 3, body, x)

    np.testing.assert_allclose(jax.jit(f)(x), x + 3, rtol=1e-6)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: trace_value("v", jnp.zeros((2,), jnp.float32)), ValueError, "scalar"),
        (lambda: trace_value("v", jnp.int8(1)), TypeError, "int32 or float32"),
        (lambda: trace_value(3, jnp.int32(1)), TypeError, "label"),
        (lambda: touch(jnp.zeros((8, 128))), TypeError, "expects Refs"),
        (lambda: annotate(jnp.zeros((8, 128)), no_store=True), TypeError, "must be a Ref"),
    ],
)
def test_no_value_ops_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_annotate_errors_in_kernel():
    x = jnp.zeros((8, 128))

    def both(x_ref, o_ref):
        annotate(o_ref, no_store=True, no_hazard=True)

    with pytest.raises(ValueError, match="exclude each other"):
        pl.pallas_call(both, out_shape=x, interpret=True)(x)

    def hazard_smem(x_ref, o_ref):
        annotate(x_ref, no_hazard=True)

    params = _tpu_interpret_params()  # pallas-core's Refs do not carry TPU memory spaces
    with pytest.raises(ValueError, match="only valid for VMEM"):
        pl.pallas_call(
            hazard_smem, out_shape=x, in_specs=[pl.BlockSpec(memory_space=pallas_tpu.SMEM)], interpret=params
        )(x)


def test_with_memory_space_constraint(rng):
    x = _rand(rng, (8, 128), jnp.float32)
    assert with_memory_space_constraint(x, pl.ANY) is x
    np.testing.assert_array_equal(jax.jit(lambda x: with_memory_space_constraint(x, pl.HOST) * 2)(x), x * 2)
    vmem = getattr(getattr(pallas_tpu, "__dict__", {}), "get", lambda *_: None)("VMEM")
    if vmem is not None:
        np.testing.assert_array_equal(jax.jit(lambda x: with_memory_space_constraint(x, vmem))(x), x)
    np.testing.assert_array_equal(
        jax.grad(lambda x: with_memory_space_constraint(x, pl.HOST).sum())(x), jnp.ones_like(x)
    )
    with pytest.raises(NotImplementedError, match="HBM, VMEM, SMEM and HOST"):
        with_memory_space_constraint(x, "semaphore")


# -------------------------------------------------------------------- tpu_info


@pytest.mark.parametrize("chip", list(jpltpu.ChipVersion), ids=str)
def test_tpu_info_matches_jax(chip):
    for cores in (1, 2) if chip.supports_megacore else (1,):
        ours = dataclasses.asdict(get_tpu_info_for_chip(ChipVersion(chip.value), cores))
        theirs = dataclasses.asdict(jpltpu.get_tpu_info_for_chip(chip, cores))
        assert str(ours.pop("chip_version")) == str(theirs.pop("chip_version"))
        assert ours == theirs
    ours, theirs = get_tpu_info_for_chip(chip.value, 1), jpltpu.get_tpu_info_for_chip(chip, 1)
    assert (ours.is_lite, ours.is_split_chip, ours.is_megacore) == (
        theirs.is_lite,
        theirs.is_split_chip,
        theirs.is_megacore,
    )
    dts = [
        jnp.float32,
        jnp.bfloat16,
        jnp.int8,
        jnp.uint8,
        jnp.int4,
        jnp.uint4,
        jnp.float8_e5m2,
        jnp.float8_e4m3fn,
        jnp.float8_e4m3b11fnuz,
    ]
    # JAX 0.10's TPU 8 is older than 0.11's (ours): its sublane tiling raises "TPU generation
    # is not supported" (0.11 tiles as TPU7x: large second-minor tiles for every width), and
    # its matmuls take no int4/uint4 right-hand side after float32, bfloat16 or float8.
    old_tpu8 = ways.jax_mosaic.OLD_JAX and theirs.generation > 7
    int4_lhs = {np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float8_e5m2, jnp.float8_e4m3fn)}
    for a in dts:
        if old_tpu8:
            assert ours.get_sublane_tiling(a) == ours.num_sublanes * 32 // jax.dtypes.itemsize_bits(a)
        else:
            assert ours.get_sublane_tiling(a) == theirs.get_sublane_tiling(a)
        for b in dts:
            newer = old_tpu8 and np.dtype(a) in int4_lhs and b in (jnp.int4, jnp.uint4)
            assert ours.is_matmul_supported(a, b) == (theirs.is_matmul_supported(a, b) or newer), (a, b)


def test_tpu_info_modeled_chip_without_a_tpu():
    assert not is_tpu_device()  # the test machines have no TPU
    info = get_tpu_info()
    assert info.chip_version == ChipVersion.TPU_V5E and info.num_cores == 1
    assert info.vmem_capacity_bytes == 128 * 2**20
    with _tpu_info_mod.modeled_chip("v5p") as modeled:
        assert get_tpu_info() == modeled and modeled.num_cores == 2
        assert get_tpu_info().chip_version == ChipVersion.TPU_V5P
        with _tpu_info_mod.modeled_chip(ChipVersion.TPU_8T):
            assert Tiling.COMPACT.shape == (16, 128)
        assert Tiling.COMPACT.shape == (8, 128)
    assert get_tpu_info().chip_version == ChipVersion.TPU_V5E
    assert get_tpu_info("v6e").mxu_column_size == 256


def test_tpu_info_infer_tiling():
    t = _tpu_info_mod.infer_tiling
    sa = jax.ShapeDtypeStruct
    assert t(sa((256, 256), jnp.float32)) == (8, 128)
    assert t(sa((2, 3, 128, 128), jnp.float32)) == (1, 1, 8, 128)
    assert t(sa((2, 3, 128, 128), jnp.bfloat16)) == (1, 1, 8, 128)
    assert t(sa((4, 256), jnp.int4)) == (8, 128)
    assert t(sa((16,), jnp.int8)) == (512,)
    assert t(sa((1, 128), jnp.float32)) == (1, 128)


def test_tpu_info_errors():
    with pytest.raises(ValueError, match="no megacore"):
        get_tpu_info_for_chip(ChipVersion.TPU_V5E, 2)
    with pytest.raises(ValueError, match="unknown TPU chip version"):
        get_tpu_info("v99")
    with pytest.raises(ValueError, match="unknown TPU chip version"):
        with _tpu_info_mod.modeled_chip("h200"):
            pass
