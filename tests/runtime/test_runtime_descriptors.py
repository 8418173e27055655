"""jax-kernel-runtime on bad input: descriptors refuse bad fields, and a
kernel_call lowered for a platform other than CUDA fails when lowering."""

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kernel_runtime as jkr

CFG = jkr.KernelConfig(image=b"\x7fELF", function="f")


def call(x):
    return jkr.kernel_call(x, configs=[CFG], grid=2, out_shapes=[x], name="scale")[0]


def test_kernel_call_on_the_cpu_fails_when_lowering():
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    traced = jax.jit(call).trace(x)
    with pytest.raises(
        NotImplementedError, match=r"kernel_call 'scale' cannot run on platform cpu.*needs a CUDA GPU"
    ):
        traced.lower(lowering_platforms=("cpu",))
    with pytest.raises(NotImplementedError, match=r"jax_triton.triton_call.*interpret=True"):
        with jax.default_device(jax.devices("cpu")[0]):
            call(jnp.ones(8))  # eager
    assert "jax_kernel_runtime_launch" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "dtype, value, err, message",
    [("i8", 1000, ValueError, r"out of range \[-128, 127\] of i8"),
     ("u8", -1, ValueError, r"out of range \[0, 255\]"),
     ("i32", 2**31, ValueError, "out of range"), ("u64", 2**64, ValueError, "out of range"),
     ("u1", 2, ValueError, r"out of range \[0, 1\]"),
     ("i32", 1.5, TypeError, "integer dtype needs an int"),
     ("i32", "3", TypeError, "must be a Python or numpy bool/int/float"),
     ("fp16", 1e6, ValueError, "overflows fp16"), ("fp32", 1e39, ValueError, "overflows fp32"),
     ("bf16", 3.5e38, ValueError, "overflows bf16"), ("int32", 1, TypeError, "unsupported scalar")],
)  # fmt: skip
def test_scalar_refuses_values_its_dtype_cannot_hold(dtype, value, err, message):
    with pytest.raises(err, match=message):
        jkr.Scalar(dtype, value)


def test_scalars_in_range_encode_their_value():
    rng = np.random.default_rng(0)
    for dtype, np_dtype in (("i8", np.int8), ("u16", np.uint16), ("i32", np.int32), ("i64", np.int64)):
        info = np.iinfo(np_dtype)
        for v in (int(info.min), int(info.max), int(rng.integers(info.min, info.max))):
            size, bits = jkr.Scalar(dtype, v).encode()
            assert size == np.dtype(np_dtype).itemsize
            assert np.array([bits], np.int64).view(np.uint8)[:size].view(np_dtype)[0] == v


def test_bf16_scalar_rounds_to_nearest_even():
    for v in np.random.default_rng(1).standard_normal(200) * 100:
        size, bits = jkr.Scalar("bf16", float(v)).encode()
        expected = np.array([v], np.float32).astype(jnp.bfloat16).view(np.uint16)[0]
        assert size == 2 and bits == expected, v
    assert jkr.Scalar("fp32", 2.5).encode() == (4, struct.unpack("<i", struct.pack("<f", 2.5))[0])


@pytest.mark.parametrize(
    "kwargs, err, message",
    [({"operand": -1}, ValueError, "Buffer.operand is -1"),
     ({"operand": 1.0}, TypeError, "Buffer.operand must be an int"),
     ({"operand": True}, TypeError, "Buffer.operand must be an int"),
     ({"operand": 0, "alignment": 3}, ValueError, "Buffer.alignment is 3; it must be a power of 2"),
     ({"operand": 0, "alignment": 0}, ValueError, "Buffer.alignment is 0")],
)  # fmt: skip
def test_buffer_refuses_bad_fields(kwargs, err, message):
    with pytest.raises(err, match=message):
        jkr.Buffer(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"function": ""}, "KernelConfig.function"), ({"shared_memory_bytes": -1}, "shared_memory_bytes"),
     ({"global_scratch_bytes": -8}, "global_scratch_bytes"), ({"profile_scratch_bytes": 1.5}, "profile_scratch")],
)  # fmt: skip
def test_kernel_config_refuses_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jkr.KernelConfig(image=b"\x7fELF", **{"function": "f", **kwargs})


@pytest.mark.gpu
def test_eager_kernel_call_on_the_gpu():
    from test_runtime_cpu import compile_scale

    major, minor = jax.devices("cuda")[0].compute_capability.split(".")
    cfg = jkr.config_from_triton(compile_scale(int(major) * 10 + int(minor)))
    for seed in range(2):  # the second call reuses the first one's executable
        x = jax.random.normal(jax.random.key(seed), (1000,))
        params = [jkr.Buffer(0), jkr.Buffer(1), jkr.Scalar("i32", 1000), jkr.Scalar("fp32", 1.5)]
        (out,) = jkr.kernel_call(x, configs=[cfg], grid=4, out_shapes=[x], params=params, name="scale")
        np.testing.assert_allclose(out, np.asarray(x) * 1.5, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, err, message",
    [({"out_shapes": [jax.ShapeDtypeStruct((8,), np.float64)]}, TypeError,
      r"out_shapes 0 has dtype float64, but with x64 off JAX passes float32"),
     ({"args": (np.zeros(8, np.int64),)}, TypeError, "argument 0 has dtype int64, but with x64 off JAX passes int32"),
     ({"out_shapes": [jax.ShapeDtypeStruct((4,), np.float32)], "input_output_aliases": {0: 0}}, ValueError,
      r"entry 0: 0: input 0 is float32\[8\] but output 0 is float32\[4\]"),
     ({"input_output_aliases": {0: 1}}, ValueError, "entry 0: 1 is out of range"),
     ({"params": [jkr.Buffer(0), 3]}, TypeError, r"params\[1\] is 3; expected jax_kernel_runtime.Buffer or Scalar"),
     ({"params": [jkr.Buffer(2)]}, ValueError, "operand 2 but there are 2"),
     ({"zeroed_outputs": [0.5]}, ValueError, r"zeroed output 0.5 out of range \(outputs 0..0\)"),
     ({"configs": [b"\x7fELF"]}, TypeError, r"configs\[0\] is bytes; expected a KernelConfig"),
     ({"out_shapes": ["f32"]}, TypeError, "out_shapes 0 is 'f32'; expected an array"),
     ({"grid": [(1,), (2,)]}, ValueError, "2 grids for 1 configs")],
)  # fmt: skip
def test_kernel_call_refuses_bad_arguments(kwargs, err, message):
    x = jnp.asarray(np.random.default_rng(3).standard_normal(8), jnp.float32)
    kw = {"args": (x,), "configs": [CFG], "grid": 1, "out_shapes": [x], "name": "scale", **kwargs}
    args = kw.pop("args")
    with jax.enable_x64(False), pytest.raises(err, match=rf"kernel_call 'scale': .*{message}"):
        jkr.kernel_call(*args, **kw)  # checked before anything is bound
