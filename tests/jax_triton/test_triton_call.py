"""jax_triton.triton_call on the CPU (Triton's interpreter) and lowering for CUDA."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernels import (
    add_kernel,
    atomic_sum_kernel,
    autotuned_copy_kernel,
    axpy_two_outputs_kernel,
    bf16_dot_kernel,
    heuristic_scale_kernel,
    inplace_add_kernel,
    loop_kernel,
    to_bf16_kernel,
)

import jax_triton as jt


def rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def add(x, y, block=64, **kw):
    return jt.triton_call(
        x, y, x.size, kernel=add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(jt.cdiv(x.size, block),), BLOCK_SIZE=block, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("jit", [False, True])
def test_add_matches_jnp(jit):
    x, y = rand((1000,), 0), rand((1000,), 1)
    f = jax.jit(add) if jit else add
    np.testing.assert_array_equal(f(x, y), x + y)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.int32, jnp.float64])
def test_add_dtypes(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        x = (rand((300,), 2) * 10).astype(dtype)
        y = (rand((300,), 3) * 10).astype(dtype)
        np.testing.assert_array_equal(add(x, y), x + y)


def test_examples_match_jnp():
    import triton_add
    import triton_flash_attention
    import triton_matmul
    import triton_softmax

    x, y = rand((777,), 4), rand((777,), 5)
    np.testing.assert_array_equal(triton_add.add(x, y, block_size=128), x + y)
    s = rand((16, 100), 6) * 3
    np.testing.assert_allclose(triton_softmax.softmax(s), jax.nn.softmax(s, -1), atol=1e-6)
    a, b = rand((96, 64), 7, jnp.bfloat16), rand((64, 80), 8, jnp.bfloat16)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(triton_matmul.matmul(a, b).astype(jnp.float32), ref, rtol=2e-2, atol=5e-2)
    q, k, v = (rand((1, 2, 64, 16), 9 + i, jnp.bfloat16) for i in range(3))
    for causal in (False, True):
        out = triton_flash_attention.attention(q, k, v, causal=causal, block_m=16, block_n=16, num_warps=4)
        ref = triton_flash_attention.reference(q, k, v, causal)
        np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=2e-2)


def test_scalars_pytree_outputs_and_grid_callable():
    x = rand((500,), 10)
    out = jt.triton_call(
        x, 2.5, x.size, kernel=axpy_two_outputs_kernel,
        out_shape={"ax": jax.ShapeDtypeStruct(x.shape, x.dtype), "sq": jax.ShapeDtypeStruct(x.shape, x.dtype)},
        grid=lambda meta: (jt.cdiv(x.size, meta["BLOCK"]),), BLOCK=128,
    )  # fmt: skip
    np.testing.assert_allclose(out["ax"], 2.5 * x, rtol=1e-6)
    np.testing.assert_allclose(out["sq"], x * x, rtol=1e-6)


def test_grid_as_int_and_input_output_aliases():
    x = rand((256,), 11)
    out = jt.triton_call(
        x,
        x.size,
        kernel=inplace_add_kernel,
        out_shape=x,
        grid=4,
        BLOCK=64,
        input_output_aliases={0: 0},
    )
    np.testing.assert_allclose(out, x + 1, rtol=1e-6)


def test_zeroed_outputs():
    x = rand((1000,), 12)
    out = jt.triton_call(
        x, x.size, kernel=atomic_sum_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.float32),
        grid=(jt.cdiv(1000, 128),), BLOCK=128, zeroed_outputs=(0,),
    )  # fmt: skip
    np.testing.assert_allclose(out[0], x.sum(), rtol=1e-5)


def test_heuristics_kernel():
    x = rand((200,), 13)
    out = jt.triton_call(
        x, x.size, kernel=heuristic_scale_kernel, out_shape=x,
        grid=lambda meta: (jt.cdiv(x.size, meta["BLOCK"]),),
    )  # fmt: skip
    np.testing.assert_allclose(out, 3 * x, rtol=1e-6)


def test_autotune_kernel_runs_on_cpu_with_first_config():
    x = rand((300,), 14)
    out = jt.triton_call(
        x,
        x.size,
        kernel=autotuned_copy_kernel,
        out_shape=x,
        grid=lambda meta: (jt.cdiv(x.size, meta["BLOCK"]),),
    )
    np.testing.assert_array_equal(out, x)


def test_interpreter_numpy_scalar_conversion_workaround():
    x = rand((1000,), 15)
    out = jt.triton_call(
        x,
        x.size,
        kernel=loop_kernel,
        out_shape=jax.ShapeDtypeStruct((64,), x.dtype),
        grid=1,
        BLOCK=64,
    )
    ref = jnp.pad(x, (0, 24)).reshape(-1, 64).sum(0)
    np.testing.assert_allclose(out, ref, rtol=1e-5)


def test_interpreter_rounds_fp32_to_bf16_to_nearest():
    # Triton 3.6's interpreter truncates; the GPU rounds to nearest even.
    x = rand((1024,), 18)
    out = jt.triton_call(
        x, kernel=to_bf16_kernel, out_shape=jax.ShapeDtypeStruct((1024,), jnp.bfloat16), grid=1, N=1024
    )
    np.testing.assert_array_equal(
        np.asarray(out).view(np.uint16), np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)
    )


def test_interpreter_bf16_dot_workaround():
    a, b = rand((16, 16), 16, jnp.bfloat16), rand((16, 16), 17, jnp.bfloat16)
    out = jt.triton_call(
        a,
        b,
        kernel=bf16_dot_kernel,
        out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
        grid=1,
        N=16,
    )
    np.testing.assert_allclose(out, jnp.dot(a, b, preferred_element_type=jnp.float32), rtol=1e-5, atol=1e-5)


def test_vmap_default_and_folded():
    x, y = rand((3, 100), 18), rand((3, 100), 19)
    np.testing.assert_array_equal(jax.vmap(add)(x, y), x + y)
    np.testing.assert_array_equal(jax.vmap(add, in_axes=(0, None))(x, y[0]), x + y[0])

    def fold(batch, grid, scalars):
        # add_kernel is elementwise over `length` (positional arg 2).
        n = scalars[2] * batch
        return (jt.cdiv(n, 64),), {2: n}

    jaxpr = jax.make_jaxpr(jax.vmap(lambda a, b: add(a, b, batch_fold=fold)))(x, y)
    assert "while" not in str(jaxpr)  # one launch, not a loop
    np.testing.assert_array_equal(jax.vmap(lambda a, b: add(a, b, batch_fold=fold))(x, y), x + y)


def test_grad_points_to_custom_vjp():
    x = rand((64,), 20)
    with pytest.raises(NotImplementedError, match="custom_vjp"):
        jax.grad(lambda x: add(x, x).sum())(x)


def test_lowering_for_cuda_embeds_cubin_and_is_exportable():
    import jax_kernel_runtime as jkr

    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    exp = jax.export.export(jax.jit(add), platforms=["cuda"], disabled_checks=jkr.export_disabled_checks())(
        x, x
    )
    blob = exp.serialize()
    again = jax.export.deserialize(blob)
    assert again.platforms == ("cuda",)
    assert "jax_kernel_runtime_launch" in again.mlir_module()


def test_autotune_lowering_carries_all_configs_then_winner(tmp_path, monkeypatch):
    from jax_triton._src import autotune

    monkeypatch.setenv("JAX_TRITON_AUTOTUNE_DIR", str(tmp_path))
    x = jax.ShapeDtypeStruct((1000,), jnp.float32)

    def lower():  # a fresh function each time: no lowering cache hit
        def f(x):
            return jt.triton_call(
                x, x.size, kernel=autotuned_copy_kernel, out_shape=x,
                grid=lambda meta: (jt.cdiv(x.size, meta["BLOCK"]),), compute_capability=90,
            )  # fmt: skip

        return jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()

    text = lower()
    assert (
        "num_configs = 2" in text
        and "grid_0 = dense<[16, 1, 1]>" in text
        and "grid_1 = dense<[8, 1, 1]>" in text
    )
    key = text.split('tune_key = "')[1].split('"')[0]
    autotune.record_winner(key, 1, [2.0, 1.0])  # what the runtime reports after tuning
    autotune.WINNERS.forget()  # a new process: only the disk cache remains
    text = lower()
    assert "num_configs = 1" in text and "grid = dense<[8, 1, 1]>" in text


def test_autotune_key_depends_on_shapes_and_device():
    from jax_triton._src import autotune

    fn = autotune.base_function(autotuned_copy_kernel)
    variants = autotune.expand(autotuned_copy_kernel, {}, {}, jt._src.compile.CompileOptions())
    assert [v.meta["BLOCK"] for v in variants] == [64, 128]
    assert [v.options.num_warps for v in variants] == [2, 4]
    variants = [(v.metaparams, v.options) for v in variants]
    a = jax.ShapeDtypeStruct((10,), jnp.float32)
    b = jax.ShapeDtypeStruct((11,), jnp.float32)
    k1 = autotune.tune_key(fn, variants, [a], (), [(1, 1, 1)], "sm_90")
    assert k1 == autotune.tune_key(fn, variants, [a], (), [(1, 1, 1)], "sm_90")
    assert k1 != autotune.tune_key(fn, variants, [b], (), [(1, 1, 1)], "sm_90")
    assert k1 != autotune.tune_key(fn, variants, [a], (), [(1, 1, 1)], "sm_80")


def test_uses_triton_cache_dir_and_keeps_it(tmp_path, monkeypatch):
    import triton

    cache = tmp_path / "triton-cache"
    monkeypatch.setattr(triton.knobs.cache, "dir", str(cache))
    x = jax.ShapeDtypeStruct((4096,), jnp.float32)
    jax.jit(lambda a, b: add(a, b, block=256)).trace(x, x).lower(lowering_platforms=("cuda",))
    assert cache.is_dir() and any(cache.rglob("*.cubin"))


def test_version_warning_once(monkeypatch):
    from jax_triton._src import triton_compat

    monkeypatch.setattr(triton_compat.triton, "__version__", "9.9.9")
    monkeypatch.setattr(triton_compat, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        triton_compat.check_triton_version()
        triton_compat.check_triton_version()
    assert len(w) == 1 and "triton==3.6.0" in str(w[0].message)


def test_version_info_is_the_version_as_ints():
    # Code written for the published jax-triton checks `jax_triton.__version_info__ >= (0, 4, 1)`
    # (tokamax's ragged_dot tests); ours errored with AttributeError.
    assert jt.__version_info__ == tuple(int(p) for p in jt.__version__.split("."))
    assert jt.__version_info__ >= (0, 4, 1)
