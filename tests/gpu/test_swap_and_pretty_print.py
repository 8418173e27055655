"""``plgpu.swap`` (a masked load of the old value, then a masked store) under
Triton's interpreter and pallas-core's interpret mode against jnp, and the
printed form of ``plgpu.load``/``store``/``swap`` in jaxprs (JAX's ``a[...] <-``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import assert_close, fresh_key, lowered, random, triton_mode

import pallas as pl
import pallas_gpu as plgpu

# The generated kernel under Triton's interpreter (compiled on the GPU with
# PALLAS_GPU_TESTS=gpu), and pallas-core's interpret mode (the discharge rules).
MODES = {"triton": triton_mode(), "pallas_interpret": True}


def _swap_call(kernel, shape, dtype, mode, n_in, block=None):
    """``kernel(*inputs, x_ref, y_ref)`` over row blocks, x and y aliased in place."""
    block = block or shape
    spec = pl.BlockSpec(block, lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        (jax.ShapeDtypeStruct(shape, dtype),) * 2,
        grid=(pl.cdiv(shape[0], block[0]),),
        in_specs=[spec] * n_in,
        out_specs=(spec, spec),
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        interpret=MODES[mode],
    )


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16, jnp.bool_])
@pytest.mark.parametrize("shape,block", [((16, 32), (8, 32)), ((13, 20), (5, 20))])
@pytest.mark.parametrize("masked", [False, True])
def test_swap(masked, shape, block, dtype, mode):
    x, y, keep = random(shape, dtype), random(shape, dtype), random(shape, jnp.bool_)

    def kernel(*refs):
        if masked:
            keep_ref, _, _, x_ref, y_ref = refs
            old = plgpu.swap(y_ref, (slice(None),), x_ref[...], mask=keep_ref[...])
        else:
            _, _, x_ref, y_ref = refs
            old = plgpu.swap(y_ref, (slice(None),), x_ref[...])
        x_ref[...] = old

    args = (keep, x, y) if masked else (x, y)
    new_x, new_y = _swap_call(kernel, shape, dtype, mode, len(args), block)(*args)
    if masked:  # masked-off elements neither read nor written: the result there is the new value
        assert_close(new_x, jnp.where(keep, y, x), dtype)
        assert_close(new_y, jnp.where(keep, x, y), dtype)
    else:
        assert_close(new_x, y, dtype)
        assert_close(new_y, x, dtype)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_masked_swap_window_past_the_end(mode):
    """The Triton idiom: a pl.ds window running past the end of the Ref, kept
    inside by the mask (pallas-core's interpret mode must not clamp it)."""
    m, n = 32, 16
    x, y = random((n,), jnp.float32), random((m,), jnp.float32)
    start = int(jax.random.randint(fresh_key(), (), m - n + 1, m))

    def kernel(start_ref, x_in, y_in, x_ref, y_ref):
        s = start_ref[0]
        x_ref[...] = plgpu.swap(y_ref, pl.ds(s, n), x_ref[...], mask=s + jnp.arange(n) < m)

    f = pl.pallas_call(
        kernel,
        (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.float32)),
        input_output_aliases={1: 0, 2: 1},
        interpret=MODES[mode],
    )
    new_x, new_y = f(jnp.array([start], jnp.int32), x, y)
    rows = np.arange(n) + start
    inside = rows < m
    want_x, want_y = np.array(x), np.array(y)
    want_x[inside] = np.asarray(y)[rows[inside]]
    want_y[rows[inside]] = np.asarray(x)[inside]
    np.testing.assert_array_equal(new_x, want_x)
    np.testing.assert_array_equal(new_y, want_y)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_swap_result_unused_is_a_store(mode):
    x, y = random((8, 16), jnp.float32), random((8, 16), jnp.float32)

    def kernel(x_ref, y_in, y_ref):
        plgpu.swap(y_ref, x_ref[...] * 2)  # JAX's store(ref, val) form

    f = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32), input_output_aliases={1: 0}, interpret=MODES[mode]
    )
    assert_close(f(x, y), x * 2)


def test_swap_lowers_to_a_load_then_a_store():
    x, keep = random((16,), jnp.float32), random((16,), jnp.bool_)

    def kernel(keep_ref, x_ref, o_ref):
        o_ref[...] = plgpu.swap(
            x_ref, None, jnp.zeros((16,), jnp.float32), mask=keep_ref[...], eviction_policy="evict_last"
        )

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,), jnp.float32), interpret=triton_mode())
    src = lowered(f, keep, x).body
    load = re.search(r"(v\d+) = tl.load\((ptr\d+), mask=(mask\d+), other=(v\d+)\)", src)
    assert load, src
    store = f"tl.store({load[2]}, {load[4]}, mask={load[3]}, eviction_policy='evict_last')"
    assert store in src[load.end() :], src


# ---------------------------------------------------------------------------
# Printed jaxprs: as JAX's Ref accesses, ``a[...] <- v``


def _kernel_text(body) -> str:
    """The printed jaxpr of a kernel ``body(x_ref, o_ref)`` on (4, 3, 2) int32 Refs."""
    f = pl.pallas_call(body, jax.ShapeDtypeStruct((4, 3, 2), jnp.int32), interpret=True)
    (eqn,) = jax.make_jaxpr(f)(jnp.zeros((4, 3, 2), jnp.int32)).eqns
    return str(eqn.params["jaxpr"])


@pytest.mark.parametrize(
    "index,printed,shape",
    [
        (lambda: (pl.ds(0, 4), slice(None), slice(None)), "a[:,:,:]", "i32[4,3,2]"),
        (lambda: (pl.ds(0, 3), slice(None), slice(None)), "a[:3,:,:]", "i32[3,3,2]"),
        (lambda: (pl.ds(1, 3), slice(None), pl.ds(0, 1)), "a[1:,:,:1]", "i32[3,3,1]"),
        (lambda: (pl.ds(0, 2, stride=2), 1, slice(None)), "a[:3:2,1,:]", "i32[2,2]"),
    ],
)
def test_load_store_swap_print_as_ref_accesses(index, printed, shape):
    def body(x_ref, o_ref):
        v = plgpu.load(x_ref, index())
        plgpu.store(x_ref, index(), v)
        plgpu.swap(x_ref, index(), v)
        o_ref[...] = jnp.zeros((4, 3, 2), jnp.int32) + plgpu.swap(o_ref, index(), v).sum()

    lines = [line.strip() for line in _kernel_text(body).splitlines()]
    assert f"c:{shape} <- {printed}" in lines, lines  # a, b: the Refs
    assert f"{printed} <- c" in lines, lines
    assert lines.count(f"{printed} <- c") == 2, lines  # the first swap's old value is unused: a store
    out = printed.replace("a[", "b[")
    assert any(line.endswith(f":{shape}, {out} <- {out}, c") for line in lines), lines


def test_printed_mask_other_hints_and_dynamic_windows():
    def body(x_ref, o_ref):
        i = x_ref[0, 0, 0]
        v = plgpu.load(x_ref, (pl.ds(i, 2), 0, slice(None)), mask=x_ref[:2, 0, :] > 0, other=7)
        plgpu.store(o_ref, (1, pl.ds(i, 2), slice(None)), v, mask=v > 1, eviction_policy="evict_last")

    lines = [line.strip() for line in _kernel_text(body).splitlines()]
    assert "g:i32[2,2] <- a[c:c+2,0,:] mask=e other=f" in lines, lines
    assert "h:bool[2,2] = gt g 1:i32[]" in lines, lines
    assert "b[1,c:c+2,:] <- g mask=h eviction_policy='evict_last'" in lines, lines


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("what", ["mask", "value"])
def test_swap_operand_of_the_wrong_shape(what):
    def kernel(x_ref, o_ref):
        val, mask = jnp.zeros((8, 16), jnp.float32), jnp.ones((8, 16), bool)
        if what == "mask":
            mask = jnp.ones((3,), bool)
        else:
            val = jnp.zeros((8, 3), jnp.float32)
        o_ref[...] = plgpu.swap(x_ref, None, val, mask=mask)

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 16), jnp.float32), interpret=triton_mode())
    bad = "(3,)" if what == "mask" else "(8, 3)"
    with pytest.raises(
        ValueError,
        match=rf"kernel 'kernel' at test_swap_and_pretty_print.py:\d+: plgpu.swap: {what} of shape "
        rf"{re.escape(bad)} does not broadcast to the shape \(8, 16\) of the indexed Ref; give a {what} "
        r"of shape \(8, 16\)",
    ):
        f(random((8, 16), jnp.float32))


def test_swap_needs_a_value():
    def kernel(x_ref, o_ref):
        o_ref[...] = plgpu.swap(x_ref)

    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), interpret=triton_mode())
    with pytest.raises(TypeError, match=r"plgpu.swap takes \(ref, val\) or \(ref, idx, val\)"):
        f(random((8,), jnp.float32))
