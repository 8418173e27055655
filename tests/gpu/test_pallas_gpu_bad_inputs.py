"""Bad inputs to the GPU path fail with errors that name the kernel, the
user's line and the fix. Runs on the CPU: kernels are lowered for CUDA
through ``jax.export`` (``PALLAS_GPU_COMPUTE_CAPABILITY`` picks the target)
or compiled through ``compiler.compiled_configs``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import has_gpu
from jax import lax

import jax_kernel_runtime as jkr
import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src.compile import compiler
from pallas_gpu._src.pallas_call_registration import lowered_kernel

cpu_only = pytest.mark.skipif(has_gpu(), reason="checks what happens on a machine without a GPU")


def export_for_cuda(f, *args):
    return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=jkr.export_disabled_checks())(
        *args
    )


def lowered(f, *args):
    eqn = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive.name == "pallas_call"][0]
    gm = eqn.params["grid_mapping"]
    return lowered_kernel(eqn.params["jaxpr"], gm), gm


def scale_call(dtype, **kw):
    def scale(x_ref, o_ref):
        o_ref[...] = (x_ref[...].astype(jnp.float32) * 2.0).astype(o_ref.dtype)

    return pl.pallas_call(scale, jax.ShapeDtypeStruct((256,), dtype), **kw)


def test_too_many_warps_in_compiler_params():
    with pytest.raises(ValueError, match=r"num_warps must be a power of two between 1 and 32.*got 64"):
        plgpu.CompilerParams(num_warps=64)


def test_too_many_warps_through_pallas_call_names_kernel(monkeypatch):
    # Params restored without __init__ (unpickled, say) are checked again
    # when the kernel is lowered, and the error names the kernel.
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "90")
    cp = plgpu.CompilerParams()
    object.__setattr__(cp, "num_warps", 64)
    f = scale_call(jnp.float32, compiler_params=cp)
    x = jax.random.normal(jax.random.key(0), (256,))
    with pytest.raises(ValueError) as e:
        export_for_cuda(f, x)
    msg = str(e.value)
    assert re.search(
        r"pallas_call 'scale' at test_pallas_gpu_bad_inputs\.py:\d+: compiler_params: num_warps", msg
    )
    assert "power of two between 1 and 32" in msg and "got 64" in msg


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_needs_sm89(dtype):
    x = jax.random.normal(jax.random.key(1), (256,)).astype(dtype)
    f = scale_call(dtype)
    lk, gm = lowered(f, x)
    with pytest.raises(ValueError) as e:
        compiler.compiled_configs(lk, 80, [plgpu.CompilerParams()], gm.where)
    msg = str(e.value)
    assert re.search(r"pallas_call 'scale' at test_pallas_gpu_bad_inputs\.py:\d+", msg)
    assert "compute capability 8.9" in msg and "sm_80" in msg
    assert "Cast to bfloat16 or float16" in msg
    # sm_89+ compiles the same kernel.
    ((_, cfg),) = compiler.compiled_configs(lk, 90, [plgpu.CompilerParams()], gm.where)
    assert cfg.image[:4] == b"\x7fELF"


def test_fp8_on_sm80_through_lowering(monkeypatch):
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "8.0")
    x = jax.random.normal(jax.random.key(2), (256,)).astype(jnp.float8_e4m3fn)
    with pytest.raises(
        ValueError, match=r"pallas_call 'scale' at test_pallas_gpu_bad_inputs\.py:\d+.*fp8.*sm_80"
    ):
        export_for_cuda(scale_call(jnp.float8_e4m3fn), x)


def test_dot_of_a_matrix_and_a_vector_is_refused_in_jax_words():
    # JAX's Triton backend: "must be 2D"; ours also names the kernel, the line and the fix.
    def dot_kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...])

    f = pl.pallas_call(dot_kernel, jax.ShapeDtypeStruct((32,), jnp.float32))
    x = jax.random.normal(jax.random.key(4), (32, 64), jnp.float32)
    y = jax.random.normal(jax.random.key(5), (64,), jnp.float32)
    with pytest.raises(Exception, match=r"(?s)kernel 'dot_kernel' at .*must be 2D.*reshape vectors"):
        export_for_cuda(f, x, y)


def big_matmul(num_stages):
    """256x256 output blocks of bf16, k blocks of 128: 128 KiB of operands
    per pipelining stage."""

    def matmul(a_ref, b_ref, o_ref):
        def body(k, acc):
            s = pl.multiple_of(k * 128, 128)
            a, b = a_ref[:, pl.ds(s, 128)], b_ref[pl.ds(s, 128), :]
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

        o_ref[...] = lax.fori_loop(0, 8, body, jnp.zeros((256, 256), jnp.float32)).astype(o_ref.dtype)

    a = jax.random.normal(jax.random.key(3), (512, 1024)).astype(jnp.bfloat16)
    cps = [plgpu.CompilerParams(num_warps=8, num_stages=n) for n in num_stages]
    f = pl.pallas_call(
        matmul,
        jax.ShapeDtypeStruct((512, 512), jnp.bfloat16),
        grid=(2, 2),
        in_specs=[
            pl.BlockSpec((256, 1024), lambda i, j: (i, 0)),
            pl.BlockSpec((1024, 256), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((256, 256), lambda i, j: (i, j)),
        # TODO(lead): pass the list once pallas-core's pallas_call accepts one.
        compiler_params=cps[0],
    )
    return f, (a, a.T), cps


@pytest.mark.parametrize("cc,limit", [(80, 166912), (90, 232448)])
def test_too_much_shared_memory(cc, limit):
    f, args, cps = big_matmul([4])
    lk, gm = lowered(f, *args)
    with pytest.raises(ValueError) as e:
        compiler.compiled_configs(lk, cc, cps, gm.where)
    msg = str(e.value)
    assert re.search(r"pallas_call 'matmul' at test_pallas_gpu_bad_inputs\.py:\d+", msg)
    assert f"sm_{cc} allows ({limit} bytes" in msg
    assert "plgpu.CompilerParams(num_warps=8, num_stages=4" in msg
    assert "smaller block shapes or fewer num_stages" in msg


def test_autotune_drops_configs_that_do_not_fit():
    f, args, cps = big_matmul([4, 1])
    lk, gm = lowered(f, *args)
    kept = compiler.compiled_configs(lk, 80, cps, gm.where)
    assert [cp for cp, _ in kept] == [cps[1]]
    assert kept[0][1].shared_memory_bytes <= 166912


def test_too_much_shared_memory_through_lowering(monkeypatch):
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "90")
    f, args, _ = big_matmul([4])
    with pytest.raises(
        ValueError, match=r"pallas_call 'matmul' at test_pallas_gpu_bad_inputs\.py:\d+.*shared memory"
    ):
        export_for_cuda(f, *args)


@cpu_only
def test_no_gpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("PALLAS_GPU_COMPUTE_CAPABILITY", raising=False)
    x = jax.random.normal(jax.random.key(4), (256,))
    with pytest.raises(RuntimeError) as e:
        export_for_cuda(scale_call(jnp.float32), x)
    msg = str(e.value)
    assert re.search(r"pallas_call 'scale' at test_pallas_gpu_bad_inputs\.py:\d+", msg)
    assert "JAX sees no GPU" in msg
    assert "interpret=True" in msg and "interpret=plgpu.InterpretParams()" in msg
    assert "machine with an NVIDIA GPU" in msg


@cpu_only
def test_gpu_compiler_params_on_cpu_suggest_interpreter():
    x = jax.random.normal(jax.random.key(5), (256,))
    f = scale_call(jnp.float32, compiler_params=plgpu.CompilerParams())
    with pytest.raises(
        ValueError, match=r"pallas_call 'scale' at test_pallas_gpu_bad_inputs\.py:\d+.*InterpretParams"
    ):
        f(x)


def test_bad_compute_capability_override(monkeypatch):
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "hopper")
    x = jax.random.normal(jax.random.key(6), (256,))
    with pytest.raises(ValueError, match=r"pallas_call 'scale'.*PALLAS_GPU_COMPUTE_CAPABILITY='hopper'"):
        export_for_cuda(scale_call(jnp.float32), x)
