"""pallas-core's bad inputs that gave a confusing message (or
none) get our usual sentence: the kernel, the user's line, what was expected.

* ``pl.lower_as_mlir(platforms="tpu")`` (read letter by letter) and ``platforms=[]``
  (silently TPU);
* ``pl.cdiv`` of a symbolic dimension in ``out_shape`` (now a symbolic dimension, as
  JAX's: the export runs), and a traced value there;
* a symbolic dimension reaching a scratch shape, a captured array, a whole-array block
  or a ``block_shape``;
* ``pallas_call(debug="False")``.

(The TPU and GPU parts: ``tests/tpu/test_errors_bad_inputs.py``, ``tests/gpu/test_errors_bad_options.py``.)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl

HERE = re.compile(r"test_errors_bad_inputs\.py:\d+")


def rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def export_cpu(f, shape_spec: str):
    shape = jax.export.symbolic_shape(shape_spec)
    return jax.export.export(jax.jit(f), platforms=["cpu"])(jax.ShapeDtypeStruct(shape, jnp.float32))


def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


# -- pl.lower_as_mlir(platforms=...) ------------------------------------------------------------


def test_lower_as_mlir_platforms_as_a_string():
    f = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)
    with pytest.raises(TypeError) as info:
        pl.lower_as_mlir(f, jax.ShapeDtypeStruct((8, 128), jnp.float32), platforms="cpu")
    msg = str(info.value)
    assert "pl.lower_as_mlir of 'add_one'" in msg and HERE.search(msg), msg
    assert "expected a list of platform names, got the str 'cpu'" in msg and "platforms=['cpu']" in msg


def test_lower_as_mlir_empty_platforms():
    f = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)
    with pytest.raises(
        ValueError, match=r"'add_one' at test_errors_bad_inputs\.py:\d+: platforms: expected at least one"
    ):
        pl.lower_as_mlir(f, jax.ShapeDtypeStruct((8, 128), jnp.float32), platforms=[])
    with pytest.raises(TypeError, match=r"platforms: expected platform names \(str, e.g. 'tpu'\), got 3"):
        pl.lower_as_mlir(f, jax.ShapeDtypeStruct((8, 128), jnp.float32), platforms=["cpu", 3])


def test_lower_as_mlir_platforms_list_still_lowers():
    f = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)
    text = pl.lower_as_mlir(f, jax.ShapeDtypeStruct((8, 128), jnp.float32), platforms=("cpu",))
    assert "func.func public @main" in text


def test_lower_as_mlir_dynamic_shapes_must_be_a_bool():
    f = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)
    with pytest.raises(TypeError) as info:
        pl.lower_as_mlir(
            f, jax.ShapeDtypeStruct((8, 128), jnp.float32), dynamic_shapes="no", platforms=["cpu"]
        )
    msg = str(info.value)
    assert "dynamic_shapes must be a bool, got 'no' (str)" in msg and HERE.search(msg), msg
    text = pl.lower_as_mlir(
        f, jax.ShapeDtypeStruct((8, 128), jnp.float32), dynamic_shapes=False, platforms=["cpu"]
    )
    assert "func.func public @main" in text


# -- a grid too large to interpret ---------------------------------------------------------------


@pytest.mark.parametrize("tpu", [False, True], ids=["core", "tpu_interpret"])
def test_grid_too_large_to_interpret_is_refused_before_allocating(tpu):
    """A grid of 2**31 steps once allocated a 16 GiB table of its points and was killed by the OOM
    killer; now it is refused, naming the kernel, the user's line and the limit."""
    interpret = True
    if tpu:
        pltpu = pytest.importorskip("pallas_tpu")
        interpret = pltpu.InterpretParams()
    f = pl.pallas_call(
        add_one,
        grid=(2**16, 2**15),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=interpret,
    )
    with pytest.raises(ValueError) as info:
        jax.jit(f)(rand(0, (8, 128)))
    msg = str(info.value)
    assert "pallas_call 'add_one'" in msg and "(65536, 32768)'s 2147483648 steps" in msg, msg
    assert "at most 67108864 steps" in msg and "32.0 GiB" in msg, msg


def test_grid_just_below_the_limit_still_plans():
    """The check is on the step count alone: a large grid of cheap steps below it still runs."""
    x = rand(1, (8, 128))
    f = pl.pallas_call(
        add_one,
        grid=(4096,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=True,
    )
    np.testing.assert_allclose(jax.jit(f)(x), x + 1)


# -- symbolic dimensions ---------------------------------------------------------------------


def first_rows(x):
    """One output row per block of 8 input rows: its first row, doubled; out_shape from pl.cdiv."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(0, 1), :] * 2.0

    blocks = pl.cdiv(x.shape[0], 8)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((blocks, 128), x.dtype),
        grid=(blocks,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, 128), lambda i: (i, 0)),
        interpret=True,
    )(x)


def test_cdiv_of_a_symbolic_dimension_in_out_shape_exports_and_runs():
    exported = export_cpu(first_rows, "n, 128")
    for seed, rows in enumerate((8, 43, 64)):
        x = rand(seed, (rows, 128))
        np.testing.assert_allclose(exported.call(x), np.asarray(x)[::8] * 2.0, rtol=1e-6)


def test_cdiv_of_symbolic_dimensions_is_symbolic_and_of_ints_an_int():
    (n,) = jax.export.symbolic_shape("n")
    assert jax.export.is_symbolic_dim(pl.cdiv(n, 8))
    assert pl.cdiv(43, 8) == 6 and isinstance(pl.cdiv(43, 8), int)


def test_traced_dimension_in_out_shape():
    def f(x, n):
        return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((n, 128), jnp.float32), interpret=True)(
            x
        )

    with pytest.raises(TypeError) as info:
        jax.jit(f)(rand(0, (8, 128)), 8)
    msg = str(info.value)
    assert "pallas_call 'add_one'" in msg and HERE.search(msg) and "out_shape[0]" in msg, msg
    assert "dimension 0 of its shape is a traced value (int32[])" in msg and "pl.cdiv" in msg


def test_symbolic_dimension_in_a_scratch_shape():
    def f(x):
        def kernel(x_ref, o_ref, s_ref):
            s_ref[...] = x_ref[...]
            o_ref[...] = s_ref[...]

        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(x.shape[0] // 8,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
            scratch_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],  # the array's shape, not the block's
            interpret=True,
        )(x)

    with pytest.raises(ValueError) as info:
        export_cpu(f, "8*n, 128")
    msg = str(info.value)
    assert "pallas_call 'kernel'" in msg and HERE.search(msg) and "scratch_shapes[0]" in msg, msg
    assert "dimension 0 is the symbolic dimension 8*n" in msg and "size it by the block" in msg


def test_symbolic_dimension_in_a_run_scoped_shape():
    def f(x):
        def kernel(x_ref, o_ref):
            def body(s_ref):
                o_ref[...] = x_ref[...]

            pl.run_scoped(body, jax.ShapeDtypeStruct(x.shape, x.dtype))

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
            in_specs=[spec], out_specs=spec, interpret=True,
        )(x)  # fmt: skip

    with pytest.raises(
        ValueError, match=r"kernel 'kernel' at test_errors_bad_inputs\.py:\d+: pl.run_scoped: .*8\*n"
    ):
        export_cpu(f, "8*n, 128")


def test_symbolic_dimension_of_a_captured_array():
    def f(x):
        bias = jnp.ones(x.shape, x.dtype)

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + bias[:8]

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
            in_specs=[spec], out_specs=spec, interpret=True,
        )(x)  # fmt: skip

    with pytest.raises(ValueError) as info:
        export_cpu(f, "8*n, 128")
    msg = str(info.value)
    assert "pallas_call 'kernel'" in msg and HERE.search(msg) and "constant 0 captured by the kernel" in msg
    assert (
        "closes over an array float32[8*n, 128]" in msg and "pass the array to pallas_call as an input" in msg
    )


def test_symbolic_dimension_of_a_whole_array_block():
    def f(x):
        return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    with pytest.raises(ValueError) as info:
        export_cpu(f, "8*n, 128")
    msg = str(info.value)
    assert (
        "pallas_call 'add_one'" in msg and HERE.search(msg) and "in_specs[0]: no block_shape was given" in msg
    )
    assert "whole array float32[8*n, 128]" in msg and "grid=(pl.cdiv(x.shape[0], 8),)" in msg
    assert "block_shape[0]: expected an int" not in msg  # the old message, about a block_shape never written


def test_symbolic_dimension_in_a_block_shape():
    def f(x):
        spec = pl.BlockSpec((x.shape[0], 128), lambda: (0, 0))
        return pl.pallas_call(
            add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[spec], out_specs=spec,
            interpret=True,
        )(x)  # fmt: skip

    with pytest.raises(ValueError, match=r"in_specs\[0\]\.block_shape\[0\]: the symbolic dimension 8\*n"):
        export_cpu(f, "8*n, 128")


# -- boolean options -----------------------------------------------------------------------------


@pytest.mark.parametrize("debug", ["False", 0, None])
def test_debug_takes_a_bool(debug):
    with pytest.raises(TypeError) as info:
        pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), debug=debug)
    msg = str(info.value)
    assert "pallas_call 'add_one'" in msg and HERE.search(msg), msg
    assert f"debug: expected True or False, got {debug!r}" in msg


def test_debug_false_runs():
    f = pl.pallas_call(
        add_one, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), debug=np.bool_(False), interpret=True
    )
    x = rand(1, (8, 128))
    np.testing.assert_allclose(f(x), x + 1)
