"""What JAX's own TPU Pallas tests (``scripts/jax_pallas_tests.py``) expect of TPU interpret mode: SMEM
operands of 8- and 16-bit types, and the words of JAX's interpreter ("Out-of-bounds
read"/"Out-of-bounds write") first in the Python exception of a bad access."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_tpu as pltpu


@pytest.mark.interpret_only(reason="SMEM of 8/16-bit types: what TPU interpret mode accepts (as JAX's)")
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.bfloat16, jnp.float16, jnp.bool_])
def test_smem_operands_of_8_and_16_bit_types(dtype):
    rng = np.random.default_rng(7)
    s = jnp.asarray(rng.integers(0, 2 if dtype == jnp.bool_ else 50, (5,)).astype(dtype))
    x = jax.random.normal(jax.random.key(1), (8, 128), jnp.float32)

    def kernel(s_ref, x_ref, o_ref, t_ref):
        t_ref[0] = s_ref[1]
        t_ref[1] = s_ref[3]
        o_ref[...] = x_ref[...] * t_ref[0].astype(jnp.float32) + t_ref[1].astype(jnp.float32)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
        scratch_shapes=[pltpu.SMEM((2,), dtype)],
        interpret=pltpu.InterpretParams(),
    )(s, x)
    f32 = s.astype(jnp.float32)
    np.testing.assert_allclose(out, x * f32[1] + f32[3], rtol=1e-6, atol=1e-4)


@pytest.mark.interpret_only(reason="an error raised as the kernel runs: TPU interpret mode's bounds checks")
@pytest.mark.parametrize("access", ["read", "write"])
def test_out_of_bounds_access_arrives_as_kernel_error_message_first(access):
    x = jax.random.normal(jax.random.key(2), (16, 128), jnp.float32)

    def kernel(x_ref, o_ref):
        start = pl.program_id(0) * 8 + 8  # step 1 reaches rows [16, 24) of 16
        if access == "read":
            o_ref[...] = x_ref[pl.ds(start, 8), :]
        else:
            o_ref[pl.ds(start, 8), :] = x_ref[pl.ds(0, 8), :]

    out_rows = 8 if access == "read" else 16
    f = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((out_rows, 128), jnp.float32),
        grid=(2,),
        interpret=pltpu.InterpretParams(),
    )
    with pytest.raises(pltpu.KernelError) as info:
        jax.block_until_ready(f(x))
    first = str(info.value).splitlines()[0]
    assert f"Out-of-bounds {access}" in first, first
    assert "in TPU kernel 'kernel'" in first and "test_jax_wording_tpu.py:" in first, first
    # A kernel that stays in bounds runs as jnp says.
    g = pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[pl.ds(pl.program_id(0) * 8, 8), :] * 2),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(2,),
        interpret=pltpu.InterpretParams(),
    )
    np.testing.assert_allclose(g(x), x[8:] * 2, rtol=1e-6)


def _dma_through(sem_type, index_sem: bool = False):
    def kernel(x_hbm_ref, y_hbm_ref):
        def body(x_ref, sem):
            pltpu.async_copy(x_hbm_ref, x_ref, sem.at[0] if index_sem else sem).wait()
            pltpu.async_copy(x_ref, y_hbm_ref, sem.at[0] if index_sem else sem).wait()

        pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32), sem_type)

    return pl.pallas_call(
        kernel,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=pltpu.InterpretParams(),
    )


@pytest.mark.interpret_only(reason="DMA semaphore checks at trace time, worded as JAX's TPU interpret mode")
def test_dma_semaphore_misuse_says_what_jax_says():
    x = jax.random.normal(jax.random.key(3), (8, 128), jnp.float32)
    np.testing.assert_array_equal(_dma_through(pltpu.SemaphoreType.DMA((1,)), index_sem=True)(x), x)
    with pytest.raises(
        ValueError, match=r"Cannot signal on a non-\(\)-shaped semaphore: \(1,\).*sem\.at\[i\]"
    ):
        _dma_through(pltpu.SemaphoreType.DMA((1,)))(x)
    for exc in (ValueError, TypeError):  # JAX: ValueError; pallas-tpu raised TypeError
        with pytest.raises(
            exc, match=r"DMAs signal DMA semaphores.*dma_wait requires a DMA semaphore.*semaphore_wait"
        ):
            _dma_through(pltpu.SemaphoreType.REGULAR)(x)
