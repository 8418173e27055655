"""Section 4 of the issue: every bad input gives a clear Python error."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from kernels import add_kernel, broken_kernel

import jax_triton as jt


def call_add(*args, grid=(4,), out_shape=None, **meta):
    x = jnp.ones(256, jnp.float32)
    meta.setdefault("BLOCK_SIZE", 64)
    return jt.triton_call(
        *args,
        kernel=add_kernel,
        out_shape=out_shape or jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=grid,
        **meta,
    )


def xs():
    k = jax.random.split(jax.random.key(0))
    return jax.random.normal(k[0], (256,)), jax.random.normal(k[1], (256,))


def test_wrong_number_of_arguments():
    x, y = xs()
    with pytest.raises(TypeError, match=r"leaving \['output_ptr'\] without a value"):
        call_add(x, y)  # `length` forgotten: the output lands on it
    with pytest.raises(TypeError, match="has 5 parameters"):
        call_add(x, y, 256, x, x)


def test_unsupported_dtype():
    x = jnp.ones(256, jnp.complex64)
    with pytest.raises(TypeError, match="dtype complex64"):
        call_add(x, x, 256)


@pytest.mark.parametrize(
    "grid, err, match",
    [((0, -1), ValueError, "entry 1 is -1"), ((-3,), ValueError, "entry 0 is -3"),
     ((1, 2**17), ValueError, "65535"), ((2**31,), ValueError, "2147483647"),
     ("4", TypeError, "grid"), ((4.0,), TypeError, "Python ints"), ((1, 1, 1, 1), TypeError, "1-3 ints"),
     (lambda meta: "x", TypeError, "grid")],
)  # fmt: skip
def test_bad_grid(grid, err, match):
    x, y = xs()
    with pytest.raises(err, match=match):
        call_add(x, y, 256, grid=grid)


def test_metaparam_that_is_not_a_kernel_parameter():
    x, y = xs()
    with pytest.raises(
        TypeError,
        match=r"\['BLOCK'\] of triton_call are not parameters of kernel 'add_kernel'",
    ):
        call_add(x, y, 256, BLOCK=64)


def test_kernel_that_fails_to_compile_shows_source_line():
    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    f = jax.jit(lambda x: jt.triton_call(x, kernel=broken_kernel, out_shape=x, grid=1, BLOCK=64))
    with pytest.raises(jt.TritonCompilationError, match=r"(?s)broken_kernel.*undefined_name"):
        f.trace(x).lower(lowering_platforms=("cuda",))


def test_more_shared_memory_than_the_device_has():
    import triton_matmul

    a = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)

    def f(a):
        return jt.triton_call(
            a, a, kernel=triton_matmul.matmul_kernel.fn, out_shape=a, grid=1, num_stages=8,
            M=4096, N=4096, K=4096, stride_am=4096, stride_ak=1, stride_bk=4096, stride_bn=1,
            stride_cm=4096, stride_cn=1, BLOCK_M=256, BLOCK_N=256, BLOCK_K=128, GROUP_M=8,
            compute_capability=80,
        )  # fmt: skip

    with pytest.raises(
        ValueError,
        match=r"bytes of shared memory per block but sm_80 allows at most 166912",
    ):
        jax.jit(f).trace(a).lower(lowering_platforms=("cuda",))


def test_non_array_pytree_leaves():
    x, y = xs()
    with pytest.raises(TypeError, match="argument 1 is list"):
        call_add(x, [y], 256)
    with pytest.raises(TypeError, match="out_shape leaf 0 is 'float32'"):
        call_add(x, y, 256, out_shape=["float32"])


def test_platform_with_neither_gpu_nor_interpreter():
    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    with pytest.raises(NotImplementedError, match="cannot run on platform tpu"):
        jax.export.export(jax.jit(lambda a, b: call_add(a, b, 256)), platforms=["tpu"])(x, x)


def test_shard_map_on_two_cpu_devices():
    script = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {__file__.rsplit("/", 1)[0]!r})
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        from test_bad_inputs import call_add
        mesh = jax.make_mesh((2,), ("x",))
        f = jax.jit(jax.shard_map(lambda a, b: call_add(a, b, 256), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        k = jax.random.split(jax.random.key(0))
        a, b = jax.random.normal(k[0], (512,)), jax.random.normal(k[1], (512,))
        sharding = jax.sharding.NamedSharding(mesh, P("x"))
        out = f(jax.device_put(a, sharding), jax.device_put(b, sharding))
        np.testing.assert_array_equal(out, a + b)
        assert len(out.sharding.device_set) == 2
        print("shard-map-ok")
        """
    )
    env = {
        **__import__("os").environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert "shard-map-ok" in r.stdout, r.stderr[-3000:]
