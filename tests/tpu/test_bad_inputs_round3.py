"""Bad input to TPU kernels gets a clear error that names
the kernel and the user's line, the same in TPU interpret mode and in our
Mosaic lowering; what a TPU can run (vmap over an HBM operand, jacfwd) runs.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_tpu as pltpu

pytestmark = pytest.mark.interpret_only(reason="error paths of interpret mode and the lowering")


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def both_refuse(make, args, exc, pattern):
    """``make(interpret)`` builds the call; interpret mode and the Mosaic
    lowering must both refuse it with ``exc`` matching ``pattern``."""
    with pytest.raises(exc, match=pattern) as interp:
        jax.jit(make(pltpu.InterpretParams())).lower(*args)
    with pytest.raises(exc, match=pattern) as lowering:
        pltpu.mosaic_modules(make(False), *args)
    strip = lambda e: re.sub(r"test_bad_inputs_round3.py:\d+: ", "", str(e.value), count=1)  # noqa: E731
    assert strip(interp) == strip(lowering)  # one check, one message
    return str(interp.value)


SDS = jax.ShapeDtypeStruct((16, 128), jnp.float32)
SDS_U32 = jax.ShapeDtypeStruct((16, 128), jnp.uint32)


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


def corner_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[:8, :128] + 1


def _call(kernel, in_specs, out_specs, out_shape=SDS, **kw):
    return lambda interpret: pl.pallas_call(  # noqa: E731
        kernel, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, interpret=interpret, **kw
    )


# -- b: memory spaces ------------------------------------------------------------------------


@pytest.mark.parametrize("space", [pl.ANY, pltpu.HBM], ids=["ANY", "HBM"])
def test_vector_load_of_hbm_without_dma(space):
    def load_hbm(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1  # the line

    make = _call(load_hbm, [pl.BlockSpec(memory_space=space)], pl.BlockSpec(memory_space=pltpu.VMEM))
    msg = both_refuse(make, [SDS], TypeError, r"reads a Ref float32\[16, 128\] in .*HBM.* directly")
    assert "pallas_call 'load_hbm'" in msg and "the kernel at test_bad_inputs_round3.py:" in msg
    assert "make_async_copy" in msg


def test_vector_store_into_hbm_output():
    def store_hbm(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    make = _call(store_hbm, [pl.BlockSpec(memory_space=pltpu.VMEM)], pl.BlockSpec(memory_space=pl.ANY))
    both_refuse(make, [SDS], TypeError, r"pallas_call 'store_hbm'.*writes a Ref float32\[16, 128\] in pl.ANY")


def test_hbm_access_inside_a_loop_is_found():
    def loop_hbm(x_ref, o_ref):
        def body(i, c):
            o_ref[pl.ds(i * 8, 8), :] = x_ref[pl.ds(i * 8, 8), :]
            return c

        jax.lax.fori_loop(0, 2, body, 0)

    make = _call(loop_hbm, [pl.BlockSpec(memory_space=pl.ANY)], pl.BlockSpec(memory_space=pltpu.VMEM))
    both_refuse(make, [SDS], TypeError, r"reads a Ref float32\[8, 128\]|reads a Ref float32\[16, 128\]")


def test_smem_input_used_as_a_vector():
    def smem_vector(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    make = _call(
        smem_vector,
        [pl.BlockSpec((8, 128), lambda: (0, 0), memory_space=pltpu.SMEM)],
        pl.BlockSpec((8, 128), lambda: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    )
    both_refuse(
        make, [jax.ShapeDtypeStruct((8, 128), jnp.float32)], TypeError, r"\[8, 128\] vector .* pltpu.SMEM"
    )


def test_smem_scalars_still_run():
    x = rand(1, (8, 128))

    def smem_scalar(x_ref, o_ref):
        o_ref[...] = jnp.full((8, 128), x_ref[1, 2] + x_ref[3, 4])

    out = pl.pallas_call(
        smem_scalar,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=pltpu.InterpretParams(),
    )(x)
    np.testing.assert_allclose(out, jnp.full((8, 128), x[1, 2] + x[3, 4]), rtol=1e-6)


def test_data_input_in_semaphore_space():
    make = _call(
        copy_kernel, [pl.BlockSpec(memory_space=pltpu.SEMAPHORE)], pl.BlockSpec(memory_space=pltpu.VMEM)
    )
    msg = both_refuse(
        make, [SDS], TypeError, r"in_specs\[0\]: an array float32\[16, 128\] placed in pltpu.SEMAPHORE"
    )
    assert "scratch_shapes=[pltpu.SemaphoreType.DMA" in msg


# -- c: tiling ------------------------------------------------------------------------------


def test_block_not_a_multiple_of_the_tile():
    make = _call(
        copy_kernel,
        [pl.BlockSpec((8, 64), lambda i: (0, i))],
        pl.BlockSpec((8, 64), lambda i: (0, i)),
        grid=(2,),
    )
    msg = both_refuse(
        make,
        [SDS],
        ValueError,
        r"in_specs\[0\]: block_shape .* dimension 1 of the block is 64; .*multiples of 8 and 128",
    )
    assert "pallas_call 'copy_kernel'" in msg


def test_tile_rules_follow_jax():
    """bf16 and int8 blocks of (8, 128) and whole dims are fine (JAX's lowering takes them)."""
    for dtype in (jnp.bfloat16, jnp.int8):
        x = (rand(2, (32, 256)) * 10).astype(dtype)
        spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
        out = pl.pallas_call(
            copy_kernel,
            grid=(4, 2),
            in_specs=[spec],
            out_specs=spec,
            out_shape=jax.ShapeDtypeStruct(x.shape, dtype),
            interpret=pltpu.InterpretParams(),
        )(x)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x + 1, np.float32))


# -- d: VMEM --------------------------------------------------------------------------------


def test_whole_array_vmem_block_over_the_scoped_limit():
    big = jax.ShapeDtypeStruct((8192, 2048), jnp.float32)  # 64 MiB
    make = _call(
        corner_kernel,
        [pl.BlockSpec(memory_space=pltpu.VMEM)],
        pl.BlockSpec((8, 128), lambda: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    )
    msg = both_refuse(make, [big], ValueError, r"VMEM: the kernel needs 67112960 bytes \(64.0 MiB\) of VMEM")
    assert "default scoped VMEM limit of a TPU v5e (16.0 MiB" in msg and "vmem_limit_bytes" in msg


def test_vmem_limit_bytes_raises_the_limit():
    big = jax.ShapeDtypeStruct((8192, 2048), jnp.float32)
    f = pl.pallas_call(
        corner_kernel,
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec((8, 128), lambda: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=100 * 2**20),
    )
    assert pltpu.mosaic_modules(f, big)


def test_scratch_over_the_chip():
    def with_scratch(x_ref, o_ref, s_ref):
        o_ref[...] = x_ref[...]

    small = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    make = lambda interpret: pl.pallas_call(  # noqa: E731
        with_scratch,
        out_shape=small,
        scratch_shapes=[pltpu.VMEM((256 * 2**20,), jnp.float32)],  # 1 GiB
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=128 * 2**20),
        interpret=interpret,
    )
    both_refuse(
        make, [small], ValueError, r"1073741824 for VMEM scratch .*more than a TPU v5e has \(128.0 MiB\)"
    )
    # A vmem_limit_bytes above the chip's VMEM is accepted, as libtpu accepts it
    # (tests/tpu/test_errors_bad_inputs.py compiles it for each chip).
    over = pl.pallas_call(
        with_scratch,
        out_shape=small,
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=2**30),
    )
    assert pltpu.mosaic_modules(over, small)


def test_vmem_of_the_modelled_chip():
    """v6e's default scoped limit is 32 MiB: a 24 MiB block is fine there, not on v5e."""
    x = jax.ShapeDtypeStruct((3072, 2048), jnp.float32)  # 24 MiB
    f = lambda chip: pl.pallas_call(  # noqa: E731
        corner_kernel,
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec((8, 128), lambda: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=pltpu.InterpretParams(chip_version=chip),
    )
    jax.jit(f("v6e")).lower(x)
    with pytest.raises(ValueError, match="scoped VMEM limit of a TPU v5e"):
        jax.jit(f("v5e")).lower(x)


# -- e: run_mosaic -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doubling_module():
    f = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2), out_shape=SDS)
    return pltpu.mosaic_modules(f, SDS)[0]


def test_run_mosaic_runs(doubling_module):
    x = rand(3, (16, 128))
    np.testing.assert_allclose(pltpu.run_mosaic(doubling_module, x, out_shape=SDS), x * 2)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bfloat16])
def test_run_mosaic_operand_dtype(doubling_module, dtype):
    x = rand(4, (16, 128)).astype(dtype)
    with pytest.raises(
        TypeError, match=rf"operand 0 has dtype {np.dtype(dtype).name}, but the module's memref"
    ):
        pltpu.run_mosaic(doubling_module, x, out_shape=SDS)


def test_run_mosaic_unsigned_is_a_signless_memref():
    """Mosaic's integers are signless: a uint32 array is an i32 memref (no error, no conversion)."""
    f = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 3), out_shape=SDS_U32)
    (module,) = pltpu.mosaic_modules(f, SDS_U32)
    x = jax.random.bits(jax.random.key(21), (16, 128), jnp.uint32)
    np.testing.assert_array_equal(pltpu.run_mosaic(module, x, out_shape=SDS_U32), x * 3)


def test_run_mosaic_out_shape_dtype(doubling_module):
    with pytest.raises(
        TypeError, match=r"run_mosaic of kernel @\w+: out_shape\[0\] has dtype int32.*give it dtype float32"
    ):
        pltpu.run_mosaic(
            doubling_module, rand(5, (16, 128)), out_shape=jax.ShapeDtypeStruct((16, 128), jnp.int32)
        )


@pytest.mark.parametrize("n", [0, -1, 1.5])
def test_run_mosaic_num_devices(doubling_module, n):
    with pytest.raises(ValueError, match="num_devices must be a positive int"):
        pltpu.run_mosaic(doubling_module, rand(6, (16, 128)), out_shape=SDS, num_devices=n)


def test_run_mosaic_module_type():
    with pytest.raises(TypeError, match=r"module must be a Mosaic module .* got int 42"):
        pltpu.run_mosaic(42, rand(7, (16, 128)), out_shape=SDS)


# -- f: vmap over an HBM operand with a manual DMA --------------------------------------------


def dma_kernel(x_hbm, y_ref, o_ref, buf, sem):
    pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], buf, sem).start()
    pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], buf, sem).wait()
    o_ref[...] = buf[...] * 2 + y_ref[...]


def _dma_call(interpret):
    return pl.pallas_call(
        dma_kernel,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        interpret=interpret,
    )


def _dma_ref(x, y):
    return x[..., 8:, :] * 2 + y


@pytest.mark.parametrize("y_batched", [True, False])
def test_vmap_over_hbm_operand_interpret(y_batched):
    xs, y = rand(8, (3, 16, 128)), rand(9, (3, 8, 128) if y_batched else (8, 128))
    out = jax.vmap(_dma_call(pltpu.InterpretParams()), in_axes=(0, 0 if y_batched else None))(xs, y)
    np.testing.assert_allclose(out, _dma_ref(xs, y), rtol=1e-6)


def test_vmap_over_hbm_operand_nested():
    xs, y = rand(10, (2, 3, 16, 128)), rand(11, (8, 128))
    f = jax.vmap(jax.vmap(_dma_call(pltpu.InterpretParams()), in_axes=(0, None)), in_axes=(0, None))
    np.testing.assert_allclose(f(xs, y), _dma_ref(xs, y), rtol=1e-6)


def test_vmap_over_hbm_operand_lowering():
    """Our Mosaic lowering slices the batched HBM array at the batch index; run by run_mosaic."""
    xs, ys = rand(12, (3, 16, 128)), rand(13, (3, 8, 128))
    f = jax.vmap(_dma_call(False))
    (module,) = pltpu.mosaic_modules(f, xs, ys)
    assert "memref<3x16x128xf32, #tpu.memory_space<any>>" in module and "tpu.memref_slice" in module
    out = pltpu.run_mosaic(module, xs, ys, out_shape=jax.ShapeDtypeStruct((3, 8, 128), jnp.float32))
    np.testing.assert_allclose(out, _dma_ref(xs, ys), rtol=1e-6)


def test_hbm_operand_with_a_block_shape_is_refused():
    make = _call(
        copy_kernel,
        [pl.BlockSpec((8, 128), lambda: (1, 0), memory_space=pl.ANY)],
        pl.BlockSpec(memory_space=pltpu.VMEM),
    )
    msg = both_refuse(
        make, [SDS], ValueError, r"in_specs\[0\]: block_shape .* in memory space pl.ANY: an operand in HBM"
    )
    assert "pallas_call 'copy_kernel' at test_bad_inputs_round3.py:" in msg and "takes no block_shape" in msg


# -- g: lowering a kernel that asks for interpret mode -----------------------------------------


def test_export_for_tpu_of_an_interpret_kernel():
    f = pl.pallas_call(copy_kernel, out_shape=SDS, interpret=pltpu.InterpretParams())
    with pytest.raises(
        ValueError,
        match=r"pallas_call 'copy_kernel' at .*lowering for tpu: the kernel asks for TPU interpret mode",
    ):
        jax.export.export(jax.jit(f), platforms=["tpu"])(SDS)
    with pytest.raises(
        ValueError, match=r"pltpu.mosaic_modules: the kernel asks for TPU interpret mode.*Drop interpret="
    ):
        pltpu.mosaic_modules(f, SDS)


# -- i: options ----------------------------------------------------------------------------


def test_allow_input_fusion_length():
    make = lambda interpret: pl.pallas_call(  # noqa: E731
        copy_kernel,
        out_shape=SDS,
        compiler_params=pltpu.CompilerParams(allow_input_fusion=[True, False]),
        interpret=interpret,
    )
    both_refuse(make, [SDS], ValueError, r"allow_input_fusion: got 2 entries for a pallas_call of 1 inputs")
    ok = pl.pallas_call(
        copy_kernel, out_shape=SDS, compiler_params=pltpu.CompilerParams(allow_input_fusion=[True])
    )
    # the config is JSON inside an MLIR string: its quotes print as \22, as with JAX's Pallas
    assert r"\22allow_input_fusion\22: [true]" in str(
        jax.export.export(jax.jit(ok), platforms=["tpu"])(SDS).mlir_module()
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: pltpu.InterpretParams(detect_races="no"),
        lambda: pltpu.InterpretParams(skip_floating_point_ops="no"),
        lambda: pl.InterpretParams(vectorize="no"),
        lambda: pltpu.CompilerParams(allow_input_fusion=["no"]),
        lambda: pltpu.CompilerParams(disable_bounds_checks="no"),
    ],
)
def test_truthy_strings_for_bool_options(make):
    with pytest.raises(TypeError, match=r"must be True or False, got 'no'|one True/False per input.*'no'"):
        make()


# -- j: forward-mode Jacobians --------------------------------------------------------------


def two_out_kernel(x_ref, y_ref, a_ref, b_ref):
    x, y = x_ref[...], y_ref[...]
    a_ref[...] = jnp.sin(x) * y
    b_ref[...] = x * x


def _two_out(interpret, x, y):
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(
        two_out_kernel,
        grid=(2,),
        in_specs=[spec, spec],
        out_specs=[spec, spec],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
        interpret=interpret,
    )(x, y)


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams()], ids=["core", "tpu"])
def test_jacfwd(interpret):
    x, y = rand(14, (16, 128)), rand(15, (16, 128))
    ref = lambda x, y: [jnp.sin(x) * y, x * x]  # noqa: E731
    got = jax.jacfwd(lambda x, y: _two_out(interpret, x, y), argnums=(0, 1))(x[:, :], y)
    want = jax.jacfwd(ref, argnums=(0, 1))(x, y)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_vmap_output_not_depending_on_the_batch_is_unbatched():
    x, ys = rand(16, (16, 128)), rand(17, (3, 16, 128))
    a, b = jax.vmap(lambda y: tuple(_two_out(True, x, y)), out_axes=(0, None))(ys)
    np.testing.assert_allclose(a, jnp.sin(x) * ys, rtol=1e-6)
    np.testing.assert_allclose(b, x * x, rtol=1e-6)


def test_vmap_output_through_scratch_across_steps_is_batched():
    """A value carried by scratch from one grid step to the next is batched."""

    def carry(x_ref, o_ref, s_ref):
        @pl.when(pl.program_id(0) > 0)
        def _():
            o_ref[...] = s_ref[...]

        s_ref[...] = x_ref[...]

    spec = pl.BlockSpec((8, 128), lambda i: (0, 0))
    f = pl.pallas_call(
        carry,
        grid=(2,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
        interpret=pltpu.InterpretParams(),
    )
    xs = rand(18, (3, 8, 128))
    np.testing.assert_allclose(jax.vmap(f)(xs), xs, rtol=1e-6)


def test_vmap_output_aliased_to_a_batched_input_is_batched():
    """An aliased output starts as its input: batched even where the kernel writes nothing batched."""

    def partial_write(x_ref, y_ref, o_ref):
        o_ref[0:8, :] = y_ref[...]  # rows 8: keep the (batched) input's values

    f = pl.pallas_call(
        partial_write,
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        input_output_aliases={0: 0},
        interpret=True,
    )
    xs, y = rand(19, (3, 16, 128)), rand(20, (8, 128))
    out = jax.vmap(f, in_axes=(0, None))(xs, y)
    np.testing.assert_allclose(out, xs.at[:, 0:8, :].set(y), rtol=1e-6)
