"""triton_call with the published jax-triton's current API (``out_type=``,
keyword operands, outputs bound to the parameters left without an argument,
``backend_options``, Refs), beside the jax-triton 0.4 form (``out_shape=``).

On the CPU (Triton's interpreter) against jnp; the last test runs on a GPU.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from kernels import add_kernel

import jax_triton as jt

HERE = "test_triton_call_api.py"


def rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def like(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


@triton.jit
def fma_between_kernel(x_ptr, out_ptr, y_ptr, sq_ptr, n, scale, BLOCK: tl.constexpr = 64):
    """Outputs between inputs: out = x * scale + y, sq = x * x."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * scale + tl.load(y_ptr + offs, mask=mask), mask=mask)
    tl.store(sq_ptr + offs, x * x, mask=mask)


@triton.jit
def optional_bias_kernel(x_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A pointer that may be None (a constexpr None, as in Triton's JIT)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if b_ptr is not None:
        x += tl.load(b_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * 2, mask=mask)


@triton.jit
def scale_in_place_kernel(n, x_ptr, y_ptr, BLOCK: tl.constexpr):
    """x *= 3 in place; y = x + 1 (the old x)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(x_ptr + offs, x * 3, mask=mask)
    tl.store(y_ptr + offs, x + 1, mask=mask)


def test_out_type_positional_and_keyword_operands():
    x, y = rand((300,), 0), rand((300,), 1)
    grid = (jt.cdiv(300, 64),)
    out = jt.triton_call(x, y, 300, kernel=add_kernel, out_type=like(x), grid=grid, BLOCK_SIZE=64)
    np.testing.assert_array_equal(out, x + y)

    @jax.jit
    def by_keyword(x, y):
        return jt.triton_call(
            x, kernel=add_kernel, out_type=[like(x)], grid=grid, length=300, y_ptr=y, BLOCK_SIZE=64
        )

    (out,) = by_keyword(x, y)
    np.testing.assert_array_equal(out, x + y)


def test_outputs_between_inputs_and_constexpr_default():
    x, y = rand((200,), 2), rand((200,), 3)
    out, sq = jt.triton_call(
        x,
        y_ptr=y,
        n=200,
        scale=np.float32(1.5),
        kernel=fma_between_kernel,
        out_type=(like(x), like(x)),
        grid=lambda meta: (jt.cdiv(200, meta["BLOCK"]),),
    )  # BLOCK: the kernel's default, which the grid sees too
    np.testing.assert_allclose(out, x * 1.5 + y, rtol=1e-6)
    np.testing.assert_array_equal(sq, x * x)
    # The 0.4 form binds its outputs by the same rule, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, sq = jt.triton_call(
            x, y_ptr=y, n=200, scale=2.0, kernel=fma_between_kernel,
            out_shape=(like(x), like(x)), grid=(4,), BLOCK=64,
        )  # fmt: skip
    np.testing.assert_allclose(out, x * 2 + y, rtol=1e-6)


@triton.jit
def block_second_kernel(x_ptr, BLOCK: tl.constexpr, n, out_ptr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def test_positional_constexpr_is_a_metaparam():
    x = rand((200,), 16)
    grid = lambda meta: (jt.cdiv(200, meta["BLOCK"]),)  # noqa: E731
    out = jt.triton_call(x, 32, 200, kernel=block_second_kernel, out_type=like(x), grid=grid)
    np.testing.assert_array_equal(out, x * 2)


@triton.jit
def strided_sum_kernel(x_ptr, out_ptr, shape: tl.constexpr, strides: tl.constexpr, nested: tl.constexpr):
    """Tuple constexprs indexed, measured and compared, as tokamax's kernels do."""
    extra = tl.full((), 0, tl.float32)
    for i in tl.static_range(len(nested)):
        extra += len(nested[i])
    if nested == ((), ()):
        extra += 100.0
    offs_r = tl.arange(0, shape[0])
    offs_c = tl.arange(0, shape[1])
    x = tl.load(x_ptr + offs_r[:, None] * strides[0] + offs_c[None, :] * strides[1])
    tl.store(out_ptr + offs_r, tl.sum(x, axis=1) + extra)


@triton.jit
def unpacked_sum_kernel(x_ptr, out_ptr, shape: tl.constexpr):
    rows, cols = shape
    offs_r = tl.arange(0, rows)
    x = tl.load(x_ptr + offs_r[:, None] * cols + tl.arange(0, cols)[None, :])
    tl.store(out_ptr + offs_r, tl.sum(x, axis=1))


@pytest.mark.skipif(
    tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9),
    reason="Triton 3.9's code generator unpacks a tuple into tensors, not constexprs (Triton itself "
    "refuses tl.arange of an unpacked value there); indexing works in every Triton (test_tuple_constexprs)",
)
def test_tuple_constexpr_unpacked():
    x = rand((8, 16), 19)
    out = jt.triton_call(
        x, kernel=unpacked_sum_kernel, out_type=jax.ShapeDtypeStruct((8,), x.dtype), grid=1, shape=(8, 16)
    )
    np.testing.assert_allclose(out, x.sum(1), rtol=1e-5)


@pytest.mark.parametrize("nested", [((), ()), ((1,), (2, 3))])
def test_tuple_constexprs(nested):
    x = rand((8, 16), 18)
    kwargs = dict(
        kernel=strided_sum_kernel,
        grid=1,
        shape=(8, 16),
        strides=jt.strides_from_shape(x.shape),
        nested=nested,
    )
    out = jt.triton_call(x, out_type=jax.ShapeDtypeStruct((8,), x.dtype), **kwargs)
    extra = 100.0 if nested == ((), ()) else 3.0
    np.testing.assert_allclose(out, x.sum(1) + extra, rtol=1e-5)
    f = jax.jit(
        lambda x: jt.triton_call(
            x, out_type=jax.ShapeDtypeStruct((8,), x.dtype), compute_capability=90, **kwargs
        )
    )
    f.trace(x).lower(lowering_platforms=("cuda",))  # Triton compiles it for sm_90


@pytest.mark.parametrize("bias", [True, False])
def test_none_argument_is_a_constexpr(bias):
    x, b = rand((100,), 4), rand((100,), 5)
    kwargs = dict(kernel=optional_bias_kernel, out_type=like(x), grid=(2,), n=100, BLOCK=64)
    out = jt.triton_call(x, b if bias else None, **kwargs)
    np.testing.assert_allclose(out, (x + b if bias else x) * 2, rtol=1e-6)


def test_aliases_with_out_type_count_operands_and_leave_the_output_unbound():
    x = rand((100,), 6)
    # Operand 1 is x (operand 0 is the scalar n); output 0 is written through x_ptr.
    new_x, y = jax.jit(
        lambda x: jt.triton_call(
            100, x, kernel=scale_in_place_kernel, out_type=(like(x), like(x)), grid=(2,),
            input_output_aliases={1: 0}, BLOCK=64,
        )
    )(x)  # fmt: skip
    np.testing.assert_allclose(new_x, x * 3, rtol=1e-6)
    np.testing.assert_allclose(y, x + 1, rtol=1e-6)


def test_ref_argument_is_updated_in_place():
    x = rand((100,), 7)

    def f(x):
        ref = jax.new_ref(x)
        y = jt.triton_call(100, ref, kernel=scale_in_place_kernel, out_type=like(x), grid=(2,), BLOCK=64)
        return jax.freeze(ref), y

    for g in (f, jax.jit(f)):
        new_x, y = g(x)
        np.testing.assert_allclose(new_x, x * 3, rtol=1e-6)
        np.testing.assert_allclose(y, x + 1, rtol=1e-6)


def test_backend_options_merge_with_the_explicit_options():
    x = jax.ShapeDtypeStruct((256,), jnp.float32)

    def hlo(**options):
        def f(x):
            return jt.triton_call(
                x, x, 256, kernel=add_kernel, out_type=x, grid=(4,), BLOCK_SIZE=64,
                compute_capability=90, **options,
            )  # fmt: skip

        return jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()

    assert hlo(backend_options={"num_warps": 2}) == hlo(num_warps=2) != hlo()
    assert hlo(backend_options={"enable_fp_fusion": False, "maxnreg": 64}) != hlo()
    xs = rand((256,), 8)
    out = jt.triton_call(
        xs, xs, 256, kernel=add_kernel, out_type=like(xs), grid=(4,), BLOCK_SIZE=64,
        backend_options={"num_warps": 2, "num_stages": 1},
    )  # fmt: skip
    np.testing.assert_array_equal(out, xs + xs)


def test_vmap_of_a_call_with_keyword_operands():
    x, y = rand((3, 100), 9), rand((3, 100), 10)

    def f(x, y):
        return jt.triton_call(
            x, kernel=add_kernel, out_type=like(x), grid=(2,), y_ptr=y, length=100, BLOCK_SIZE=64
        )

    np.testing.assert_array_equal(jax.vmap(f)(x, y), x + y)


def _call(*args, **kwargs):
    x = rand((64,), 11)
    kwargs = {"kernel": add_kernel, "grid": (1,), "BLOCK_SIZE": 64, **kwargs}
    if "out_shape" not in kwargs:
        kwargs.setdefault("out_type", like(x))
    return jt.triton_call(*(args or (x, x, 64)), **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, err, message",
    [((), {"out_shape": jax.ShapeDtypeStruct((64,), jnp.float32), "out_type": jax.ShapeDtypeStruct((64,), jnp.float32)},
      TypeError, "give out_type= or out_shape="),
     ((), {"out_type": None}, TypeError, "triton_call needs out_type="),
     ((), {"num_warps": 2, "backend_options": {"num_warps": 4}}, ValueError,
      r"\['num_warps'\] given both as arguments and in backend_options"),
     ((), {"backend_options": {"ptx_options": ["-v"]}}, TypeError, r"backend_options\['ptx_options'\] is \['-v'\], which is not hashable"),
     ((), {"backend_options": {"num_wraps": 4}}, ValueError, r"backend_options\['num_wraps'\] is not a Triton compiler option"),
     ((), {"backend_options": [("num_warps", 4)]}, TypeError, "expected a mapping"),
     ((), {"out_type": (jax.ShapeDtypeStruct((64,), jnp.float32),) * 2}, TypeError,
      r"out_type has 2 unaliased outputs, but 1 kernel parameters are missing an argument \['output_ptr'\]"),
     (("x", "x"), {}, TypeError, r"out_type has 1 unaliased outputs, but 2 kernel parameters are missing an argument "
      r"\['length', 'output_ptr'\], leaving \['output_ptr'\] without a value"),
     (("x", "x", 64), {"y_ptr": 1}, TypeError, r"parameter 'y_ptr' got argument 1 and the keyword y_ptr="),
     ((), {"has_side_effect": True}, NotImplementedError, "has_side_effect=True is not supported"),
     ((), {"input_output_aliases": {2: 0}}, ValueError, r"operand 2 \('length'\) is a scalar; only arrays can be aliased"),
     ((), {"input_output_aliases": {3: 0}}, ValueError,
      r"input index 3 is out of range; indices count the non-constexpr operands in parameter order, \['x_ptr', 'y_ptr', 'length'\]"),
     (("x", "x", 64), {"length": 3}, TypeError, "parameter 'length' got argument 2"),
     (("x", "x", [64]), {}, TypeError, "argument 2 is list"),
     (("x", "x", 64, "x", 64, "x"), {}, TypeError, "kernel 'add_kernel' has 5 parameters .* got 6 positional arguments")],
)  # fmt: skip
def test_errors_name_the_kernel_and_the_line(args, kwargs, err, message):
    x = rand((64,), 12)
    args = tuple(x if a == "x" else a for a in args)
    with pytest.raises(err, match=rf"triton_call 'add_kernel' at {HERE}:\d+: .*{message}"):
        _call(*args, **kwargs)


def test_refs_and_aliases_do_not_mix():
    x = rand((64,), 13)
    with pytest.raises(
        ValueError, match=rf"at {HERE}:\d+: input_output_aliases cannot be combined with jax.new_ref"
    ):
        jt.triton_call(
            64, jax.new_ref(x), kernel=scale_in_place_kernel, out_type=(like(x), like(x)), grid=(1,),
            input_output_aliases={1: 0}, BLOCK=64,
        )  # fmt: skip


def _gpus():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(), reason="needs a CUDA GPU")
def test_current_api_on_the_gpu():
    x, y = rand((5000,), 14), rand((5000,), 15)
    grid = (jt.cdiv(5000, 128),)
    out, sq = jax.jit(
        lambda x, y: jt.triton_call(
            x, y_ptr=y, n=5000, scale=np.float32(0.5), kernel=fma_between_kernel,
            out_type=(like(x), like(x)), grid=grid, BLOCK=128, backend_options={"num_warps": 2},
        )
    )(x, y)  # fmt: skip
    np.testing.assert_allclose(out, x * 0.5 + y, rtol=1e-6)
    np.testing.assert_allclose(sq, x * x, rtol=1e-6)

    def in_place(x):
        ref = jax.new_ref(x)
        y = jt.triton_call(5000, ref, kernel=scale_in_place_kernel, out_type=like(x), grid=grid, BLOCK=128)
        return jax.freeze(ref), y

    new_x, y = jax.jit(in_place)(x)
    np.testing.assert_allclose(new_x, x * 3, rtol=1e-6)
    np.testing.assert_allclose(y, x + 1, rtol=1e-6)


def test_next_power_of_2():
    """jt.next_power_of_2 (Triton's, with 1 for x <= 1) against a plain loop, on fresh random ints."""
    xs = [-3, 0, 1, 2, 3, *map(int, np.random.default_rng().integers(4, 2**40, 200))]
    for x in xs:
        want = 1
        while want < x:
            want *= 2
        assert jt.next_power_of_2(x) == want, x
