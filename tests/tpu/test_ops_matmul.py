"""``pallas_tpu.ops.matmul`` against ``jnp.dot`` (precision highest) and against
JAX's op of the same name (``jax.experimental.pallas.ops.tpu.matmul``, in JAX's
TPU interpret mode), on fresh random data, run every way of an op (tests/ways'
``every_way(op=True)``: TPU interpret mode, our Mosaic lowering by ``run_mosaic``, and
compiled by libtpu for the compile-only TPUs of ``ways.compiled.COMPILE_CHIPS`` first, the op
choosing its blocks for each chip; on a TPU run on the chip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.mosaic
from ways import compile_op, every_way

import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops import matmul as mm
from pallas_tpu.ops.matmul import _kernel as mm_kernel


def rand(seed, shape, dtype=jnp.float32):
    key = jax.random.key(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(key, shape, -128, 128, jnp.int32).astype(dtype)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def reference(x, y, out_dtype):
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.dot(x.astype(jnp.int32), y.astype(jnp.int32)).astype(out_dtype)
    product = jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return product.astype(out_dtype)


def close(out, ref, tol):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    if jnp.issubdtype(out.dtype, jnp.integer):
        np.testing.assert_array_equal(out, ref)
    else:
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), rtol=tol, atol=tol)


# (x dtype, out_dtype, tolerance): a 32-bit result accumulates in the output block,
# a narrower one in the f32 scratch.
CASES = {
    "bf16_to_f32": (jnp.bfloat16, jnp.float32, 1e-4),
    "bf16": (jnp.bfloat16, jnp.bfloat16, 3e-2),
    "f32": (jnp.float32, jnp.float32, 1e-4),
    "int8_to_int32": (jnp.int8, jnp.int32, 0),
}


@pytest.mark.parametrize("case", CASES)
@every_way(op=True)
def test_matmul_blocks_given(way, case):
    dtype, out_dtype, tol = CASES[case]
    x, y = rand(0, (256, 384), dtype), rand(1, (384, 256), dtype)
    out = way.op(mm.matmul, x, y, block_shape=(128, 128), block_k=128, out_dtype=out_dtype)
    close(out, reference(way.mxu_operand(x), way.mxu_operand(y), out_dtype), tol * np.sqrt(384))


@every_way(op=True)
def test_matmul_chooses_blocks_and_pads(way):
    # 300 and 200 are no multiples of 128 but shorter than a block: whole-axis blocks;
    # 1100 has no 128-multiple divisor and is longer than a v5e block: padded to 1152.
    x, y = rand(2, (200, 1100), jnp.bfloat16), rand(3, (1100, 300), jnp.bfloat16)
    out = way.op(mm.matmul, x, y, out_dtype=jnp.float32)
    close(out, reference(x, y, jnp.float32), 1e-4 * np.sqrt(1100))


@every_way(op=True)
def test_matmul_skinny_whole_row_panels(way):
    # A decode projection: y's panels are whole rows (bn = n = 1000, no 128 multiple), two k
    # steps of 1024 rows.
    x, y = rand(4, (8, 2048), jnp.bfloat16), rand(5, (2048, 1000), jnp.bfloat16)
    v5e = pltpu.get_tpu_info("v5e")
    assert mm.choose_blocks(8, 2048, 1000, jnp.bfloat16, jnp.float32, v5e) == (8, 1024, 1000)
    out = way.op(mm.matmul, x, y, out_dtype=jnp.float32)
    close(out, reference(x, y, jnp.float32), 1e-4 * np.sqrt(2048))


def test_matmul_default_out_dtype_is_x_dtype():
    x, y = rand(4, (128, 256), jnp.int8), rand(5, (256, 128), jnp.int8)
    out = mm.matmul(x, y, block_shape=(128, 128), block_k=128, interpret=True)
    # JAX's op: the int32 sums converted to int8 (wrapping), as astype does.
    close(out, reference(x, y, jnp.int32).astype(jnp.int8), 0)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_matmul_fp8(dtype):
    """fp8 operands: to the MXU as they are where the chip takes them (e5m2 on the
    v5e/v6e), else widened to bf16 in VMEM (e4m3fn on the v5e/v6e); f32 sums."""
    x, y = rand(6, (256, 256), dtype), rand(7, (256, 256), dtype)
    out = mm.matmul(
        x, y, block_shape=(128, 128), block_k=128, out_dtype=jnp.float32, interpret=pltpu.InterpretParams()
    )
    close(out, reference(x, y, jnp.float32), 1e-4 * 16)
    (out,) = ways.mosaic.run_with_mosaic(lambda a, b: mm.matmul(a, b, out_dtype=jnp.float32), x, y)
    close(out, reference(x, y, jnp.float32), 1e-4 * 16)
    compile_op(lambda a, b: mm.matmul(a, b, out_dtype=jnp.float32), (x, y))


def test_matmul_matches_jax_op():
    """JAX's example kernel (in JAX's TPU interpret mode) and ours on the same blocks."""
    jax_matmul = pytest.importorskip("jax.experimental.pallas.ops.tpu.matmul")
    from jax.experimental.pallas import tpu as jax_pltpu

    x, y = rand(8, (256, 512), jnp.bfloat16), rand(9, (512, 256), jnp.bfloat16)
    kw = dict(block_shape=(128, 128), block_k=256, out_dtype=jnp.float32)
    with jax_pltpu.force_tpu_interpret_mode():
        theirs = jax_matmul.matmul(x, y, **kw)
    ours = mm.matmul(x, y, interpret=pltpu.InterpretParams(), **kw)
    close(ours, theirs, 1e-5)
    # The same names and keywords as JAX's module (an import change away).
    assert {"matmul", "matmul_kernel"} <= set(dir(mm))


def test_matmul_kernel_in_a_users_pallas_call():
    """``matmul_kernel`` as JAX's module has it, in a ``pallas_call`` of the caller's own."""
    import pallas as pl

    x, y = rand(10, (256, 256), jnp.bfloat16), rand(11, (256, 256), jnp.bfloat16)
    out = pl.pallas_call(
        mm.matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(2, 2, 2),
            in_specs=[
                pl.BlockSpec((128, 128), lambda i, j, k: (i, k)),
                pl.BlockSpec((128, 128), lambda i, j, k: (k, j)),
            ],
            out_specs=pl.BlockSpec((128, 128), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((128, 128), jnp.float32)],
        ),
        interpret=pltpu.InterpretParams(),
    )(x, y)
    close(out, reference(x, y, jnp.float32), 1e-3)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4", "v5p"])
def test_choose_blocks_fit_each_chip(chip):
    info = pltpu.get_tpu_info(chip)
    for dtype, out_dtype in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.int8, jnp.int32)):
        bm, bk, bn = mm.choose_blocks(8192, 8192, 8192, dtype, out_dtype, info)
        assert 8192 % bm == 0 and 8192 % bk == 0 and 8192 % bn == 0
        assert bm % info.mxu_column_size == 0 and bn % info.mxu_column_size == 0
        need = mm.vmem_bytes(bm, bn, bk, dtype, out_dtype, scratch=np.dtype(out_dtype).itemsize < 4)
        assert need <= _policy.vmem_budget("matmul", info), (chip, bm, bk, bn)
    for m, k, n in ((256, 8192, 8192), (128, 8192, 28672), (8, 4096, 11008)):  # skinny: whole-row panels
        for dtype, out_dtype in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)):
            bm, bk, bn = mm.choose_blocks(m, k, n, dtype, out_dtype, info)
            assert m % bm == 0 and k % bk == 0 and n % bn == 0, (chip, m, k, n, bm, bk, bn)
            need = mm.vmem_bytes(bm, bn, bk, dtype, out_dtype, scratch=np.dtype(out_dtype).itemsize < 4)
            assert need <= _policy.vmem_budget("matmul", info), (chip, m, k, n, bm, bk, bn)
    if chip == "v5e":
        assert mm.choose_blocks(8192, 8192, 8192, jnp.bfloat16, jnp.bfloat16, info) == (1024, 1024, 1024)
        assert mm.choose_blocks(256, 8192, 8192, jnp.bfloat16, jnp.bfloat16, info) == (256, 256, 8192)
    # A megacore chip gets at least two output tiles when m fits one block.
    if info.num_cores > 1:
        bm, _, bn = mm.choose_blocks(256, 4096, 4096, jnp.bfloat16, jnp.bfloat16, info)
        assert (256 // bm) * (4096 // bn) >= 2


def test_default_blocks_compile_for_each_chip():
    """The blocks chosen for a large product compile for every chip of the compiled way."""
    s = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    compile_op(lambda a, b: mm.matmul(a, b), (s, s))


BAD_CALLS = {
    "x not 2-d": (
        lambda: mm.matmul(jnp.ones((2, 128, 128)), jnp.ones((128, 128))),
        ValueError,
        "must be 2-d",
    ),
    "k differs": (
        lambda: mm.matmul(jnp.ones((128, 256)), jnp.ones((128, 128))),
        ValueError,
        r"x.shape\[1\]=256",
    ),
    "bm does not divide": (
        lambda: mm.matmul(jnp.ones((384, 128)), jnp.ones((128, 128)), block_shape=(256, 128)),
        ValueError,
        r"block_shape\[0\]=256 does not divide x.shape\[0\]=384",
    ),
    "bk does not divide": (
        lambda: mm.matmul(jnp.ones((128, 384)), jnp.ones((384, 128)), block_shape=(128, 128), block_k=256),
        ValueError,
        r"block_k=256 does not divide x.shape\[1\]=384",
    ),
    "bn off the lane tile": (
        lambda: mm.matmul(jnp.ones((128, 128)), jnp.ones((128, 384)), block_shape=(128, 192)),
        ValueError,
        r"block_shape\[1\]=192 must be a multiple of 128",
    ),
    "mixed dtypes": (
        lambda: mm.matmul(jnp.ones((128, 128)), jnp.ones((128, 128), jnp.bfloat16)),
        TypeError,
        "pass out_dtype",
    ),
    "unsigned": (
        lambda: mm.matmul(jnp.ones((128, 128), jnp.uint8), jnp.ones((128, 128), jnp.uint8)),
        ValueError,
        "x is uint8",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_matmul_bad_arguments(case):
    call, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("case", ["bf16", "bf16_to_f32"])
def test_matmul_first_step_zeroing_switch(monkeypatch, case):
    """``matmul._kernel.FIRST_STEP = "zero"`` (the earlier kernel, kept for the benchmark's
    comparison: zero the accumulator, then add) gives the same result as the default."""
    dtype, out_dtype, tol = CASES[case]
    x, y = rand(4, (128, 384), dtype), rand(5, (384, 256), dtype)
    kw = dict(block_shape=(128, 128), block_k=128, out_dtype=out_dtype, interpret=pltpu.InterpretParams())
    monkeypatch.setattr(mm_kernel, "FIRST_STEP", "zero")
    out = mm.matmul.__wrapped__(x, y, **kw)  # traced afresh: the jitted op caches the default's
    close(out, reference(x, y, out_dtype), tol * np.sqrt(384))


@pytest.mark.parametrize("m, k, n", [(8, 0, 128), (0, 128, 128), (8, 128, 0)])
@pytest.mark.parametrize("blocks", [None, (8, 128, 128)], ids=["default_blocks", "given_blocks"])
def test_empty_dimension(m, k, n, blocks):
    """k = 0: zeros (an empty sum); m or n = 0: an empty result; with or without blocks."""
    x = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 20))), (m, k))
    y = jnp.ones((k, n), jnp.float32)
    kw = {} if blocks is None else dict(block_shape=blocks[:2], block_k=blocks[2])
    out = mm.matmul(x, y, interpret=True, **kw)
    np.testing.assert_array_equal(out, jnp.dot(x, y, precision="highest"))
    assert out.shape == (m, n) and out.dtype == x.dtype
