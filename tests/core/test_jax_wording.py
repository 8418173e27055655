"""What JAX's own Pallas tests (``scripts/jax_pallas_tests.py``) expect of pallas-core: ``pl.run_state``,
and errors that keep our wording (kernel, line, fix) while also saying what JAX's
Pallas says, so code matching JAX's messages keeps working."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl


def _rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_run_state_returns_the_final_values_of_its_refs():
    x, y = _rand(0, (8, 16)), _rand(1, (8, 16))

    def body(refs):
        x_ref, y_ref = refs
        y_ref[...] = x_ref[...] * 2 + y_ref[...]
        x_ref[...] = jnp.sin(x_ref[...])

    for f in (pl.run_state(body), jax.jit(pl.run_state(body))):
        ox, oy = f((x, y))
        np.testing.assert_allclose(ox, jnp.sin(x), rtol=1e-6)
        np.testing.assert_allclose(oy, 2 * x + y, rtol=1e-6)


def test_run_state_inside_a_kernel_accumulates_like_jnp():
    x = _rand(2, (4, 128))

    def kernel(x_ref, o_ref):
        def acc(acc_ref):
            def step(i, c):
                acc_ref[...] += x_ref[i] * (i + 1).astype(jnp.float32)
                return c

            lax.fori_loop(0, x_ref.shape[0], step, None)

        o_ref[...] = pl.run_state(acc)(jnp.zeros((128,), jnp.float32))

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32), interpret=True)(x)
    np.testing.assert_allclose(out, (x * jnp.arange(1, 5.0)[:, None]).sum(0), rtol=1e-5)


def test_run_state_forward_mode_ad_like_jnp():
    x, t = _rand(3, (16,)), _rand(4, (16,))

    def body(ref):
        ref[...] = jnp.sin(ref[...]) * ref[...]

    got = jax.jvp(pl.run_state(body), (x,), (t,))
    want = jax.jvp(lambda x: jnp.sin(x) * x, (x,), (t,))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


# -- messages: ours (kernel, culprit, line) and JAX's wording, both in one message ---------

import re  # noqa: E402

import pytest  # noqa: E402

A = np.arange(256, dtype=np.int32)
HERE = r"test_jax_wording\.py:\d+"


def _raises(exc, jax_pattern, ours, call, *args):
    with pytest.raises(exc) as info:
        call(*args)
    msg = str(info.value)
    assert re.search(jax_pattern, msg, re.DOTALL), msg
    for part in ours:
        assert re.search(part, msg), (part, msg)
    return info.value


def test_kernel_returning_a_value_says_should_return_none():
    def my_kernel(x_ref, o1_ref, o2_ref):
        return 0

    f = pl.pallas_call(my_kernel, out_shape=(A, A), interpret=True)
    _raises(
        ValueError,
        r"The kernel function .* my_kernel at .*test_jax_wording\.py:.* should return None",
        [rf"pallas_call 'my_kernel' at {HERE}", "returned int", "output Refs"],
        f,
        A,
    )


def test_index_map_with_wrong_result_count_says_must_return_n_values():
    def my_index_map():
        return 0, 0

    f = pl.pallas_call(
        lambda x_ref, o_ref: None,
        out_shape=A,
        in_specs=[{"one": pl.BlockSpec((4,), my_index_map)}],
        interpret=True,
    )
    _raises(
        ValueError,
        r"Index map function my_index_map at .*test_jax_wording\.py.* for args\[0\]\['one'\] must return 1 "
        r"values to match .*Currently returning 2 values\.",
        [HERE, r"in_specs\[0\]\['one'\]\.index_map"],
        f,
        {"one": A},
    )


@pytest.mark.parametrize(
    "result, type_", [(5.0, r"float32\[\]"), (jnp.arange(4, dtype=jnp.int32), r"int32\[4\]")]
)
def test_index_map_returning_non_integer_scalars_is_a_value_and_type_error(result, type_):
    def my_index_map(i):
        return jnp.asarray(result)

    f = pl.pallas_call(
        lambda x_ref, o_ref: None,
        out_shape=A,
        grid=(1,),
        in_specs=[pl.BlockSpec((4,), my_index_map)],
        interpret=True,
    )
    for exc in (ValueError, TypeError):  # JAX raises ValueError, pallas-core raised TypeError
        _raises(
            exc,
            rf"Index map function my_index_map at .* for args\[0\] must return integer scalars\. Output\[0\] has type {type_}",
            [HERE, r"in_specs\[0\]\.index_map"],
            f,
            A,
        )


def test_index_map_missing_arguments_says_what_python_says():
    f = pl.pallas_call(
        lambda x_ref, o_ref: None, out_shape=A, in_specs=[pl.BlockSpec((4,), lambda i, j: 0)], interpret=True
    )
    _raises(
        TypeError,
        r"missing 2 required positional arguments: 'i' and 'j'",
        [HERE, r"in_specs\[0\]\.index_map", "the grid has 0 axes"],
        f,
        A,
    )
    g = pl.pallas_call(
        lambda x_ref, o_ref: None,
        out_shape=A,
        grid=(2, 2),
        in_specs=[pl.BlockSpec((128,), lambda i: (i,))],
        interpret=True,
    )
    _raises(TypeError, r"takes 1 positional argument but 2 were given", [HERE], g, A)


def test_block_rank_against_array_rank_says_same_number_of_dimensions():
    f = pl.pallas_call(
        lambda x_ref, o_ref: None,
        out_shape=[A],
        in_specs=[pl.BlockSpec((1, 1), lambda: (0, 0))],
        interpret=True,
    )
    _raises(
        ValueError,
        r"Block shape for args\[0\] .* must have the same number of dimensions as the array shape",
        [HERE, r"in_specs\[0\]", "has 2 dims"],
        f,
        A,
    )
    g = pl.pallas_call(
        lambda x_ref, o_ref: None, out_shape=[A], out_specs=[pl.BlockSpec((1, 1), lambda: 0)], interpret=True
    )
    _raises(
        ValueError,
        r"Block shape for outputs\[0\] .* must have the same number of dimensions as the array shape",
        [HERE, r"out_specs\[0\]"],
        g,
        A,
    )


def test_input_output_aliases_out_of_range_or_mismatched():
    x = np.arange(8 * 128, dtype=np.int32).reshape((8, 128))
    kernel = lambda x_ref, y_ref, o_ref: None  # noqa: E731
    cases = [
        (
            {2: 0},
            [x],
            (x, x),
            r"input_output_aliases contains the mapping '2:0' with input index 2 outside the range",
        ),
        (
            {1: 1},
            [x],
            (x, x),
            r"input_output_aliases contains the mapping '1:1' with output index 1 outside the range",
        ),
        (
            {1: 0},
            [x],
            (x, np.concatenate([x, x])),
            r"input_output_aliases contains the mapping '1:0' referring to input\[1\] with abstract value "
            r".*int32\[16,128\].* output\[0\] with a different abstract value .*int32\[8,128\]",
        ),
        (
            {1: 0},
            [jax.ShapeDtypeStruct(x.shape, jnp.float32)],
            (x, x),
            r"input_output_aliases contains the mapping '1:0' referring to input\[1\] with abstract value "
            r".*int32\[8,128\].* output\[0\] with a different abstract value .*float32\[8,128\]",
        ),
    ]
    for aliases, out_shape, args, pattern in cases:
        f = pl.pallas_call(kernel, out_shape=out_shape, input_output_aliases=aliases, interpret=True)
        _raises(ValueError, pattern, [HERE], f, *args)


def test_out_specs_against_out_shape_pytree_mismatch():
    f = pl.pallas_call(
        lambda x_ref, o1_ref, o2_ref: None,
        out_shape=[A, A],
        out_specs=[pl.BlockSpec((8,), lambda i: i)],
        grid=(32,),
        interpret=True,
    )
    _raises(
        ValueError,
        r"Pytree for `out_specs` and `out_shape` do not match\. There are 1 mismatches, including:"
        r".* `out_specs` is a tuple of length 1 but `out_shape` is a tuple of length 2",
        [HERE, "out_specs: got 1 block specs but pallas_call has 2 outputs"],
        f,
        A,
    )


def test_index_map_closing_over_a_scalar_runs_and_over_an_array_is_refused():
    # Under jax_enable_checks (as the suite runs) both once failed an internal assertion.
    x = _rand(5, (8, 128))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def call(index_map):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((4, 128), x.dtype),
            grid=(4,),
            in_specs=[pl.BlockSpec((1, 128), index_map)],
            out_specs=pl.BlockSpec((1, 128), lambda i: (i, 0)),
            interpret=True,
        )

    offset = jnp.int32(3)
    out = call(lambda i: (i + offset, 0))(x)
    np.testing.assert_allclose(out, x[3:7] * 2, rtol=1e-6)
    order = np.array([3, 1, 0, 2], dtype=np.int32)
    _raises(
        ValueError,
        r"Index map function .* for args\[0\] must not capture constants:",
        [HERE, r"in_specs\[0\]\.index_map", "PrefetchScalarGridSpec"],
        call(lambda i: (jnp.asarray(order)[i], 0)),
        x,
    )


def test_an_error_raised_while_the_kernel_runs_arrives_message_first():
    # A host callback's exception reaches Python wrapped by XLA ("INTERNAL: CpuCallback
    # error calling callback: Traceback ...", the message last); a backend records the
    # error it raises there, and the pallas_call raises it as it was.
    from pallas._src import errors

    x = _rand(6, (8, 128))

    def check(v):
        if v > 0:
            raise errors.record_runtime_error(ValueError(f"the kernel saw {float(v):.3f} > 0"))

    def kernel(x_ref, o_ref):
        jax.debug.callback(check, jnp.max(x_ref[...]))
        o_ref[...] = x_ref[...] + 1

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)
    np.testing.assert_allclose(f(-jnp.abs(x)), 1 - jnp.abs(x), rtol=1e-6)
    with pytest.raises(ValueError) as info:
        jax.block_until_ready(f(jnp.abs(x)))
    assert str(info.value).splitlines()[0] == f"the kernel saw {float(jnp.max(jnp.abs(x))):.3f} > 0"


def test_in_specs_must_be_a_sequence_as_in_jax():
    spec = pl.BlockSpec((128,), lambda i: (i,))
    with pytest.raises(ValueError, match=r"`in_specs` must be a tuple or a list") as info:
        pl.pallas_call(lambda x_ref, o_ref: None, out_shape=A, grid=(2,), in_specs=spec, interpret=True)
    assert re.search(HERE, str(info.value)) and "in_specs=[spec]" in str(info.value)
    x = _rand(7, (256,))
    out = pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 3),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2,),
        in_specs=[spec],
        out_specs=spec,  # one spec for the one output stays accepted, as in JAX
        interpret=True,
    )(x)
    np.testing.assert_allclose(out, x * 3, rtol=1e-6)


@pytest.mark.parametrize("access", ["read", "write"])
def test_static_index_past_the_block_says_out_of_bounds_read_or_write(access):
    """JAX's interpreters' words ("Out-of-bounds read" / "Out-of-bounds write") and ours
    (the kernel, the line, the dimension, the valid range) in one message."""

    def kernel(x_ref, o_ref):
        if access == "read":
            o_ref[...] = x_ref[10][None, :] * jnp.ones_like(o_ref)
        else:
            o_ref[10] = x_ref[0]

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((10, 128), jnp.float32), interpret=True)
    _raises(
        ValueError,
        rf"Out-of-bounds {access}",
        [
            r"pallas_call 'kernel'",
            HERE,
            r"index 10 is out of bounds for dimension 0 of a Ref of shape \(10, 128\) \(the block\)",
            r"valid indices are -10\.\.9",
        ],
        f,
        jnp.zeros((10, 128), jnp.float32),
    )
    ok = pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(9, x_ref[9] * 2),
        out_shape=jax.ShapeDtypeStruct((10, 128), jnp.float32),
        interpret=True,
    )(x := _rand(8, (10, 128)))
    np.testing.assert_allclose(np.asarray(ok)[9], np.asarray(x)[9] * 2, rtol=1e-6)


def test_ref_passed_to_a_primitive_says_what_jax_says():
    """A Ref where an array is wanted: JAX's message (its ``Ref<default>{...}``, its
    "-- did you forget to unpack") after ours (the kernel, the line)."""

    def dot_general_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(x_ref, y_ref, (((1,), (0,)), ((), ())))

    x, y = _rand(9, (8, 32)), _rand(10, (32, 16))
    f = pl.pallas_call(
        dot_general_kernel, out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32), interpret=True
    )
    _raises(
        ValueError,
        r"Attempting to pass a Ref Ref<default>\{float32\[8,32\]\} to a primitive: dot_general -- did you "
        r"forget to unpack \(\[\.\.\.\]\) the ref\?",
        [r"in kernel 'dot_general_kernel'", HERE],
        f,
        x,
        y,
    )
    g = pl.pallas_call(
        lambda x_ref, y_ref, o_ref: o_ref.__setitem__(..., jnp.dot(x_ref[...], y_ref[...])),
        out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32),
        interpret=True,
    )
    np.testing.assert_allclose(g(x, y), x @ y, rtol=1e-5, atol=1e-5)
