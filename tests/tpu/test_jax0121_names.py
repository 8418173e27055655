"""JAX 0.12.1's new names: ``pl.pad_ref`` (a view of a Ref with a larger shape, for
reads past its end) and ``pltpu.request_p_state`` (a TensorCore P-state request).

Kernels run in both interpret modes (pallas-core's ``interpret=True`` and TPU
interpret mode) against a jnp reference, and beside JAX's own ``pl.pad_ref`` where
the installed JAX has it (0.12.1 on; skipped with the reason before). The Mosaic
lowering is checked for the op JAX 0.12.1's lowering emits (``tpu.memref_pad``,
``tpu.request_p_state``) where jaxlib's dialect has it, and for the refusal naming the
release where it does not.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from jaxlib.mosaic.python import tpu as mosaic_tpu

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.language import tpu_info

pytestmark = pytest.mark.interpret_only(reason="JAX 0.12.1's names in interpret mode and the lowering")

INTERPRETS = {"core": True, "tpu": pltpu.InterpretParams()}
JAX_HAS_PAD_REF = hasattr(jpl, "pad_ref")
JAX_HAS_P_STATE = hasattr(jpltpu, "request_p_state")


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def padded(x, shape):
    """What a padded view reads in interpret mode: zeros past the end, as in JAX's."""
    return jnp.pad(x, [(0, p - n) for n, p in zip(x.shape, shape)])


# -- pl.pad_ref -------------------------------------------------------------------------


def _read_whole_tiles(pl_mod, shape):
    def kernel(x_ref, o_ref):
        o_ref[...] = pl_mod.pad_ref(x_ref, shape)[...] * 2

    return kernel


@pytest.mark.parametrize("mode", list(INTERPRETS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_pad_ref_reads_whole_tiles_past_the_end(mode, dtype):
    x = rand(0, (10, 200), dtype) if dtype != jnp.int32 else jnp.arange(2000, dtype=dtype).reshape(10, 200)
    out = pl.pallas_call(
        _read_whole_tiles(pl, (16, 256)),
        out_shape=jax.ShapeDtypeStruct((16, 256), dtype),
        interpret=INTERPRETS[mode],
    )(x)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(padded(x, (16, 256)) * 2, np.float32)
    )


@pytest.mark.parametrize("mode", list(INTERPRETS))
def test_pad_ref_slices_and_writes(mode):
    """A window of the padded view straddling the edge reads real rows then padding;
    a write through a padded view keeps the part inside the Ref."""
    x = rand(1, (10, 200))

    def kernel(x_ref, o_ref):
        v = pl.pad_ref(x_ref, (16, 256))
        w = pl.pad_ref(o_ref, (16, 256))
        w[...] = v[...] + 1.0
        w[pl.ds(8, 8), :] = v[pl.ds(8, 8), :] * 3.0  # rows 8, 9 real, 10..15 padding

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=INTERPRETS[mode]
    )(x)
    want = (x + 1.0).at[8:].set(x[8:] * 3.0)
    np.testing.assert_allclose(out, want, rtol=1e-6)


@pytest.mark.parametrize("mode", list(INTERPRETS))
def test_pad_ref_of_a_view(mode):
    """``pl.pad_ref`` of ``x_ref.at[...]``: the view's rows, padded."""
    x = rand(2, (32, 100))

    def kernel(x_ref, o_ref):
        o_ref[...] = pl.pad_ref(x_ref.at[pl.ds(8, 8)], (8, 128))[...]

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype), interpret=INTERPRETS[mode]
    )(x)
    np.testing.assert_array_equal(out, padded(x[8:16], (8, 128)))


@pytest.mark.skipif(
    not JAX_HAS_PAD_REF, reason=f"JAX {jax.__version__} has no pl.pad_ref (JAX 0.12.1 added it)"
)
@pytest.mark.parametrize("mode", list(INTERPRETS))
def test_pad_ref_like_jaxs(mode):
    x = rand(3, (10, 200))
    out_shape = jax.ShapeDtypeStruct((16, 256), x.dtype)
    theirs = jpl.pallas_call(_read_whole_tiles(jpl, (16, 256)), out_shape=out_shape, interpret=True)(x)
    ours = pl.pallas_call(_read_whole_tiles(pl, (16, 256)), out_shape=out_shape, interpret=INTERPRETS[mode])(
        x
    )
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((16,), r"pl\.pad_ref: Padded shape rank 1 does not match ref rank 2"),
        ((8, 256), r"pl\.pad_ref: Padded dim 8 cannot be smaller than original dim 10 \(dimension 0"),
    ],
)
def test_pad_ref_refuses_a_shape_that_does_not_pad(shape, match):
    def kernel(x_ref, o_ref):
        o_ref[...] = pl.pad_ref(x_ref, shape)[...]

    with pytest.raises(ValueError, match=match) as e:
        pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 256), jnp.float32), interpret=True)(
            jnp.zeros((10, 200), jnp.float32)
        )
    assert "in kernel 'kernel'" in str(e.value) and "test_jax0121_names.py:" in str(e.value)


def test_pad_ref_refuses_an_array():
    with pytest.raises(TypeError, match=r"pl\.pad_ref: ref must be a reference"):
        pl.pad_ref(jnp.zeros((2, 2)), (4, 4))


def _lowered(fn, *args):
    return str(pltpu.mosaic_modules(fn, *args))


def test_pad_ref_lowers_to_memref_pad():
    x = rand(4, (10, 200))
    f = pl.pallas_call(_read_whole_tiles(pl, (16, 256)), out_shape=jax.ShapeDtypeStruct((16, 256), x.dtype))
    if not hasattr(mosaic_tpu, "MemRefPadOp"):
        with pytest.raises(
            Exception, match=r"pl\.pad_ref \(tpu\.memref_pad\) needs .*JAX/jaxlib >= 0\.12\.1"
        ):
            _lowered(f, x)
        return
    text = _lowered(f, x)
    assert "tpu.memref_pad" in text, text


# -- pltpu.request_p_state --------------------------------------------------------------


def _p_state_kernel(pltpu_mod, p_state):
    def kernel(x_ref, o_ref):
        pltpu_mod.request_p_state(p_state)
        o_ref[...] = x_ref[...] + 1.0

    return kernel


@pytest.mark.parametrize("mode", list(INTERPRETS))
def test_request_p_state_runs_as_nothing_in_interpret_mode(mode):
    x = rand(5, (8, 128))
    out = pl.pallas_call(
        _p_state_kernel(pltpu, 2),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=INTERPRETS[mode],
    )(x)
    np.testing.assert_array_equal(out, x + 1.0)


def test_request_p_state_inside_control_flow():
    x = rand(6, (8, 128))

    def kernel(x_ref, o_ref):
        @pl.when(x_ref[0, 0] > -100.0)
        def _():
            pltpu.request_p_state(1)

        o_ref[...] = x_ref[...]

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=pltpu.InterpretParams()
    )(x)
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize(
    "p_state, exc, match",
    [
        (-1, ValueError, r"p_state must be non-negative, got -1"),
        (1.5, TypeError, r"p_state must be an int, got <class 'float'>"),
    ],
)
def test_request_p_state_refuses_what_jax_refuses(p_state, exc, match):
    with pytest.raises(exc, match=match):
        pl.pallas_call(
            _p_state_kernel(pltpu, p_state),
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            interpret=True,
        )(jnp.zeros((8, 128), jnp.float32))


@pytest.mark.skipif(
    not JAX_HAS_P_STATE, reason=f"JAX {jax.__version__} has no pltpu.request_p_state (JAX 0.12.1 added it)"
)
def test_request_p_state_refuses_like_jaxs():
    for p_state, exc in ((-1, ValueError), (1.5, TypeError)):
        for mod in (jpltpu, pltpu):
            with pytest.raises(exc):
                jax.make_jaxpr(lambda: mod.request_p_state(p_state))()


@pytest.mark.parametrize("chip", ["v5e", "7x"])
def test_request_p_state_lowering(chip):
    x = rand(7, (8, 128))
    f = pl.pallas_call(_p_state_kernel(pltpu, 3), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
    with tpu_info.modeled_chip(chip) if chip != "v5e" else contextlib.nullcontext():
        if chip == "v5e":
            with pytest.raises(Exception, match=r"request_p_state is only supported on TPU7x\+"):
                _lowered(f, x)
        elif not hasattr(mosaic_tpu, "RequestPStateOp"):
            with pytest.raises(Exception, match=r"pltpu\.request_p_state .* needs .*JAX/jaxlib >= 0\.12\.1"):
                _lowered(f, x)
        else:
            assert "tpu.request_p_state" in _lowered(f, x)
