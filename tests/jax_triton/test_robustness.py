"""triton_call on odd or bad input: the right answer or a clear error at trace time.

Each error names the argument, the kernel and the caller's line (this file).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from kernels import add_kernel, broken_kernel

import jax_triton as jt

HERE = "test_robustness.py"


@triton.jit
def typo_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + x_ptr)  # pointer + pointer


@triton.jit
def annotated_kernel(x_ptr, n: tl.int32, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@triton.jit
def scale_by_ref_kernel(x_ptr, s_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * tl.load(s_ptr))


@triton.jit
def assert_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.device_assert(x < 100.0, "x must stay below 100")
    tl.store(out_ptr + offs, x)


@triton.jit(debug=True)
def assert_debug_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.device_assert(x < 100.0, "x must stay below 100")
    tl.store(out_ptr + offs, x)


@triton.jit
def add_const_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 0.1)


def rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def add(x, y, n=None, grid=None, out_shape=None, **kw):
    n = x.size if n is None else n
    return jt.triton_call(
        x, y, n, kernel=add_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype) if out_shape is None else out_shape,
        grid=(jt.cdiv(x.size, 64),) if grid is None else grid, BLOCK_SIZE=64, **kw,
    )  # fmt: skip


# ------------------------------------------------------------ 64-bit inputs


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_64_bit_numpy_inputs_without_x64_use_what_jax_passes(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(300) * 100).astype(dtype)
    y = (rng.standard_normal(300) * 100).astype(dtype)
    with jax.enable_x64(False):
        out = add(x, y)
        jitted = jax.jit(add)(x, y)
    expected = x.astype(jax.dtypes.canonicalize_dtype(dtype)) + y.astype(jax.dtypes.canonicalize_dtype(dtype))
    assert out.dtype == expected.dtype == jitted.dtype
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(jitted, expected)


def test_64_bit_out_shape_without_x64_is_canonicalized():
    x = rand((200,), 1)
    with jax.enable_x64(False):
        out = add(x, x, out_shape=jax.ShapeDtypeStruct(x.shape, np.float64))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.asarray(x) + np.asarray(x))


def test_non_contiguous_numpy_input():
    base = np.random.default_rng(1).standard_normal((400,)).astype(np.float32)
    x, y = base[::2], base[1::2]
    assert not x.flags.c_contiguous
    np.testing.assert_array_equal(add(x, y), x + y)


# ------------------------------------------------------------ compile errors


@pytest.mark.parametrize(
    "kernel, meta, message",
    [(broken_kernel, {"BLOCK": 64}, "undefined_name is not defined"),
     (typo_kernel, {"BLOCK": 64}, "invalid operands"),
     (broken_kernel, {"BLOCK": 60}, "must be a power of 2")],
)  # fmt: skip
def test_compile_errors_raise_when_lowering_for_the_cpu(kernel, meta, message):
    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    f = jax.jit(lambda x: jt.triton_call(x, kernel=kernel, out_shape=x, grid=1, **meta))
    traced = f.trace(x)  # tracing is fine; lowering runs Triton's front end
    with pytest.raises(jt.TritonCompilationError) as e:
        traced.lower(lowering_platforms=("cpu",))
    msg = str(e.value)
    assert message in msg and f"kernel {kernel.__name__!r} (defined at " in msg
    assert f"triton_call {kernel.__name__!r} at {HERE}:" in msg
    with pytest.raises(jt.TritonCompilationError, match=message):  # eager: no JaxRuntimeError
        jt.triton_call(rand((64,), 2), kernel=kernel, out_shape=x, grid=1, **meta)


# ------------------------------------------------------------ scalars


def test_scalar_that_does_not_fit_int64():
    x = rand((64,), 3)
    for big in (2**70, -(2**63) - 1, 2**64):
        with pytest.raises(
            ValueError, match=rf"argument 2 \('length'\) is {big}, which does not fit in int64"
        ):
            add(x, x, n=big)
    np.testing.assert_array_equal(add(x, x, n=2**63), x + x)  # uint64 is fine
    with pytest.raises(ValueError, match=r"argument 2 \('length'\) is 1e\+300, which overflows float32"):
        add(x, x, n=1e300)


def test_0d_array_where_an_annotated_scalar_is_expected():
    x = rand((64,), 4)
    with pytest.raises(TypeError, match=rf"at {HERE}:\d+: argument 1 \('n'\) is annotated i32 \(a scalar\)"):
        jt.triton_call(x, jnp.int32(64), kernel=annotated_kernel, out_shape=x, grid=1, BLOCK=64)
    with pytest.raises(ValueError, match=r"argument 1 \('n'\) is annotated i32 but got 4294967296"):
        jt.triton_call(x, 2**32, kernel=annotated_kernel, out_shape=x, grid=1, BLOCK=64)
    out = jt.triton_call(x, 50, kernel=annotated_kernel, out_shape=x, grid=1, BLOCK=64)
    np.testing.assert_array_equal(out, jnp.where(jnp.arange(64) < 50, 2 * x, 0))


def test_0d_array_where_an_unannotated_scalar_is_expected():
    x = rand((64,), 5)
    with pytest.raises(
        jt.TritonCompilationError, match=r"\['length'\] got 0-d arrays, which are passed as pointers"
    ):
        add(x, x, n=jnp.asarray(64, jnp.int32))


def test_0d_array_for_a_scalar_when_compiling_for_the_gpu():
    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    f = jax.jit(lambda x: add(x, x, n=jnp.asarray(64, jnp.int32), compute_capability=90))
    with pytest.raises(jt.TritonCompilationError, match=rf"(?s)at {HERE}:\d+: .*\['length'\] got 0-d arrays"):
        f.trace(x).lower(lowering_platforms=("cuda",))


@triton.jit
def typed_kernel(x_ptr: tl.pointer_type(tl.float32), k: tl.int8, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * k)


@triton.jit
def flag_kernel(x_ptr, flag: tl.int1, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * 2 if flag else x)


@pytest.mark.parametrize(
    "args, meta, err, message",
    [((1.0, 3), {}, TypeError, r"argument 0 \('x_ptr'\) is annotated \*fp32 \(a pointer\) but got the scalar"),
     ((None, 300), {}, ValueError, r"argument 1 \('k'\) is annotated i8 but got 300, which is not an integer in \[-128, 127\]"),
     ((None, 2.5), {}, ValueError, r"argument 1 \('k'\) is annotated i8 but got 2.5"),
     ((None, 3), {"BLOCK": jnp.ones(2)}, TypeError, r"metaparam 'BLOCK' is a tl.constexpr parameter but got an array float32\[2\]"),
     ((None, 3), {"out_ptr": 1}, TypeError, "has 4 parameters"),
     ((None, np.longdouble(3)), {}, TypeError, r"argument 1 \('k'\) is a float128 scalar"),
     ((None, "3"), {}, TypeError, r"argument 1 is str \('3'\); triton_call takes arrays and Python/numpy scalars")],
)  # fmt: skip
def test_arguments_that_do_not_fit_their_parameter(args, meta, err, message):
    x = rand((64,), 21)
    args = tuple(x if a is None else a for a in args)
    with pytest.raises(err, match=rf"triton_call 'typed_kernel' at {HERE}:\d+: .*{message}"):
        jt.triton_call(*args, kernel=typed_kernel, out_shape=x, grid=1, **{"BLOCK": 64, **meta})
    out = jt.triton_call(x, 3, kernel=typed_kernel, out_shape=x, grid=1, BLOCK=64)
    np.testing.assert_array_equal(out, x * 3)


@triton.jit
def tail_scalar_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.mark.parametrize(
    "n, err, message",
    # A keyword naming a runtime parameter is an argument (the published jax-triton's
    # current API): an array there is a pointer, which `offs < n` cannot compare.
    [(jnp.ones(2), jt.TritonCompilationError, r"[\s\S]*'n': '\*fp32'[\s\S]*invalid operands of type pointer"),
     ("64", TypeError, r"keyword argument 'n' is str \('64'\); triton_call takes arrays and Python/numpy scalars")],
)  # fmt: skip
def test_bad_keyword_argument_for_a_runtime_parameter(n, err, message):
    x = rand((64,), 25)
    with pytest.raises(err, match=rf"triton_call 'tail_scalar_kernel' at {HERE}:\d+: {message}"):
        jt.triton_call(x, kernel=tail_scalar_kernel, out_shape=x, grid=1, n=n, BLOCK=64)
    out = jt.triton_call(x, kernel=tail_scalar_kernel, out_shape=x, grid=1, n=40, BLOCK=64)
    np.testing.assert_array_equal(out, jnp.where(jnp.arange(64) < 40, x, 0))


def test_bool_parameter_annotated_int1_refuses_other_ints():
    x = rand((64,), 23)
    with pytest.raises(ValueError, match=r"argument 1 \('flag'\) is annotated u1 \(a bool\) but got 2"):
        jt.triton_call(x, 2, kernel=flag_kernel, out_shape=x, grid=1, BLOCK=64)


@triton.jit
def unannotated_flag_kernel(x_ptr, flag, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, tl.where(flag, x * 3, x - 1))


@pytest.mark.parametrize("flag", [True, False, np.bool_(True), np.bool_(False)])
def test_bool_scalar_in_the_interpreter(flag):
    x = rand((64,), 24)
    out = jt.triton_call(x, flag, kernel=flag_kernel, out_shape=x, grid=1, BLOCK=64)
    np.testing.assert_array_equal(out, x * 2 if flag else x)


@pytest.mark.parametrize("flag", [True, False])
def test_unannotated_bool_scalar_in_the_interpreter(flag):
    x = rand((64,), 25)
    out = jt.triton_call(x, flag, kernel=unannotated_flag_kernel, out_shape=x, grid=1, BLOCK=64)
    np.testing.assert_allclose(out, x * 3 if flag else x - 1, rtol=1e-6)


def test_autotune_configs_with_and_without_programs():
    configs = [triton.Config({"BLOCK_SIZE": 64}), triton.Config({"BLOCK_SIZE": 128})]
    kernel = triton.autotune(configs, key=["length"])(add_kernel)
    x = rand((64,), 22)
    with pytest.raises(ValueError, match=r"autotune configs give grids \[\(1, 1, 1\), \(0, 1, 1\)\]"):
        jt.triton_call(x, x, 64, kernel=kernel, out_shape=x, grid=lambda meta: (64 // meta["BLOCK_SIZE"],))


def test_0d_array_as_a_pointer_to_one_element():
    x, s = rand((64,), 6), rand((), 7)
    out = jt.triton_call(x, s, kernel=scale_by_ref_kernel, out_shape=x, grid=1, BLOCK=64)
    np.testing.assert_allclose(out, np.asarray(x) * np.asarray(s), rtol=1e-6)


# ------------------------------------------------------------ options, debug


@pytest.mark.parametrize(
    "options, message",
    [({"num_warps": 3}, "num_warps=3, but num_warps must be a power of 2"),
     ({"num_warps": 64}, "num_warps=64"), ({"num_ctas": 3}, "num_ctas=3"),
     ({"num_stages": -1}, "num_stages=-1"), ({"num_warps": 4.0}, "num_warps=4.0")],
)  # fmt: skip
def test_bad_compile_options(options, message):
    x = rand((64,), 8)
    with pytest.raises(ValueError, match=rf"triton_call 'add_kernel' at {HERE}:\d+: {message}"):
        add(x, x, **options)


def test_bad_num_warps_in_an_autotune_config():
    kernel = triton.autotune([triton.Config({"BLOCK_SIZE": 64}, num_warps=6)], key=["length"])(add_kernel)
    x = rand((64,), 9)
    with pytest.raises(ValueError, match="num_warps=6, but num_warps must be a power of 2"):
        jt.triton_call(x, x, 64, kernel=kernel, out_shape=x, grid=1)


def test_device_assert_fires_in_the_interpreter_with_debug():
    x = rand((64,), 10).at[17].set(1000.0)
    with pytest.raises(Exception, match=r"(?s)triton_call 'assert_kernel' at .*x must stay below 100"):
        jt.triton_call(x, kernel=assert_kernel, out_shape=x, grid=1, BLOCK=64, debug=True).block_until_ready()
    with pytest.raises(Exception, match="x must stay below 100"):  # @triton.jit(debug=True)
        jt.triton_call(x, kernel=assert_debug_kernel, out_shape=x, grid=1, BLOCK=64).block_until_ready()
    # Without debug the assert is compiled out, on the GPU and in the interpreter.
    out = jt.triton_call(x, kernel=assert_kernel, out_shape=x, grid=1, BLOCK=64)
    np.testing.assert_array_equal(out, x)
    small = rand((64,), 11)
    out = jt.triton_call(small, kernel=assert_kernel, out_shape=small, grid=1, BLOCK=64, debug=True)
    np.testing.assert_array_equal(out, small)


def test_debug_compiles_device_asserts_for_the_gpu():
    x = jax.ShapeDtypeStruct((64,), jnp.float32)

    def hlo(debug):
        f = jax.jit(lambda x: jt.triton_call(x, kernel=assert_kernel, out_shape=x, grid=1, BLOCK=64,
                                             debug=debug, compute_capability=90))  # fmt: skip
        return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()

    message = b"x must stay below 100".hex().upper()  # images are hex in the HLO
    assert message in hlo(True) and message not in hlo(False)


def test_bf16_plus_python_float_in_the_interpreter():
    x = rand((64,), 12, jnp.bfloat16)
    out = jt.triton_call(x, kernel=add_const_kernel, out_shape=x, grid=1, BLOCK=64)
    # Triton makes the Python float a bf16 constant (as on the GPU), then adds in f32 and rounds.
    c = np.float32(jnp.asarray(0.1, jnp.bfloat16))
    np.testing.assert_array_equal(out, (x.astype(jnp.float32) + c).astype(jnp.bfloat16))


# ------------------------------------------------------------ aliases, outputs, grids


@pytest.mark.parametrize(
    "aliases, err, message",
    [({2: 0}, ValueError, "input index 2 is out of range; there are 2 array inputs"),
     ({0: 1}, ValueError, "output index 1 is out of range; there are 1 outputs"),
     ({-1: 0}, ValueError, "input index -1 is out of range"),
     ({0: 0, 1: 0}, ValueError, "output 0 is already aliased to input 0"),
     ({"0": 0}, TypeError, "indices must be ints"), ([(0, 0)], TypeError, "expected a dict")],
)  # fmt: skip
def test_bad_input_output_aliases(aliases, err, message):
    x = rand((64,), 13)
    with pytest.raises(err, match=rf"triton_call 'add_kernel' at {HERE}:\d+: .*{message}"):
        add(x, x, input_output_aliases=aliases)


def test_bad_zeroed_outputs():
    x = rand((64,), 14)
    with pytest.raises(
        ValueError, match=rf"at {HERE}:\d+: zeroed_outputs has 1, but outputs are numbered 0..0"
    ):
        add(x, x, zeroed_outputs=(1,))
    with pytest.raises(TypeError, match="zeroed_outputs is 3; expected output indices"):
        add(x, x, zeroed_outputs=3)


@pytest.mark.parametrize(
    "out_shape, err, message",
    [(jax.ShapeDtypeStruct((64,), jnp.complex64), TypeError, r"output 0 \('output_ptr'\) has dtype complex64"),
     (np.zeros((64,), np.str_), TypeError, "dtype <U1"),
     (type("S", (), {"shape": (-1,), "dtype": np.float32})(), ValueError, r"out_shape leaf 0 has shape \(-1,\)"),
     (type("S", (), {"shape": (64.0,), "dtype": np.float32})(), ValueError, "non-negative Python ints"),
     (type("S", (), {"shape": (64,), "dtype": "nope"})(), TypeError, "has dtype 'nope', which is not a dtype")],
)  # fmt: skip
def test_bad_out_shape(out_shape, err, message):
    x = rand((64,), 15)
    with pytest.raises(err, match=rf"triton_call 'add_kernel' at {HERE}:\d+: .*{message}"):
        add(x, x, out_shape=out_shape)


def test_column_major_out_shape_is_refused():
    from jax.experimental.layout import Format, Layout

    x = rand((8, 8), 16)
    fmt = Format(Layout((1, 0)), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(ValueError, match=r"out_shape leaf 0 asks for layout major_to_minor=\(1, 0\)"):
        add(x, x, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fmt))
    row_major = Format(Layout((0, 1)), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    np.testing.assert_array_equal(
        add(x, x, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=row_major)), x + x
    )


@pytest.mark.parametrize("jit", [False, True])
def test_zero_size_arrays(jit):
    x = jnp.zeros((0,), jnp.float32)
    for grid in (None, (2,)):  # cdiv(0, 64) == 0: no programs; or programs that mask all out
        f = jax.jit(lambda a, b: add(a, b, grid=grid)) if jit else lambda a, b: add(a, b, grid=grid)
        assert f(x, x).shape == (0,)


def test_empty_grid_runs_no_program():
    x, y = rand((64,), 17), rand((64,), 18)
    np.testing.assert_array_equal(add(x, y, grid=(0,)), np.zeros(64, np.float32))
    aliased = add(x, y, grid=(4, 0), input_output_aliases={1: 0})
    np.testing.assert_array_equal(aliased, y)  # an aliased output keeps its input


def test_negative_grid_entry():
    x = rand((64,), 19)
    with pytest.raises(ValueError, match=rf"at {HERE}:\d+: grid \(0, -2\): entry 1 is -2"):
        add(x, x, grid=(0, -2))
    with pytest.raises(TypeError, match=rf"at {HERE}:\d+: grid of kernel 'add_kernel': entry 0 is 1.5"):
        add(x, x, grid=lambda meta: (1.5,))


def test_wrong_number_of_arguments_names_the_call_site():
    x = rand((64,), 20)
    with pytest.raises(
        TypeError, match=rf"triton_call 'add_kernel' at {HERE}:\d+: kernel 'add_kernel' has 5"
    ):
        jt.triton_call(x, x, 64, x, x, kernel=add_kernel, out_shape=x, grid=1, BLOCK_SIZE=64)
