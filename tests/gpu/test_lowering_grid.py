"""The grid on the Triton backend: output blocks revisited along sequential
grid axes (TPU-style k-loops), and out-of-range block indices and ``pl.ds``
starts, clamped as in interpret mode. Each kernel runs under Triton's
interpreter against jnp and compiles for sm_80/sm_90 (``Runner``); the
``gpu``-marked tests run it on a GPU. The revisit tests run the interpreter's
programs last-first (``reversed_programs``), so a grid that races on a GPU
gives a wrong answer on the CPU too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_test_base import Runner, assert_close, gpu, lowered, random

import pallas as pl
import pallas_gpu as plgpu

R = Runner()


@pytest.fixture
def reversed_programs(monkeypatch):
    """Triton's interpreter runs programs one at a time in launch order, which
    hides races between programs; run them last-first instead, as a GPU may."""
    from jax_kernel_runtime.triton import _interpret as ti

    def run_grid(rewritten, grid, call_args, bounds, interp):
        interp.interpreter_builder.set_grid_dim(*grid)
        for x in reversed(range(grid[0])):
            for y in reversed(range(grid[1])):
                for z in reversed(range(grid[2])):
                    interp.interpreter_builder.set_grid_idx(x, y, z)
                    bounds.program = (x, y, z)
                    rewritten(**call_args)

    monkeypatch.setattr(ti, "_run_grid", run_grid)


def matmul_revisit(m, k, n, bm, bk, bn, dtype=jnp.float32, call=R.call):
    """A TPU-style matmul: grid (M/bm, N/bn, K/bk), the output block (i, j)
    revisited along k and initialised under pl.when(k == 0)."""

    def kernel(a_ref, b_ref, o_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    return call(
        kernel,
        jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_revisited_output(dtype, reversed_programs):
    a, b = random((64, 128), dtype), random((128, 48), dtype)
    out = matmul_revisit(64, 128, 48, 32, 32, 16, dtype)(a, b)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32, precision="highest")
    assert_close(out, ref, rtol=2e-2, atol=5e-2)


def test_matmul_revisited_output_lowers_to_a_loop():
    a = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    b = jax.ShapeDtypeStruct((128, 48), jnp.float32)
    lk = lowered(matmul_revisit(64, 128, 48, 32, 32, 16, call=pl.pallas_call), a, b)
    body = lk.body.split("def kernel")[-1]
    assert lk.launch_grid == (2 * 3, 1, 1)  # k runs inside each program
    assert "for step" in body and body.count("tl.store") == 1  # stored once, after the loop


def test_reduction_revisited_output(reversed_programs):
    x = random((40, 96), jnp.float32)

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.sum(x_ref[...], axis=1)

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((40,), jnp.float32),
        grid=(5, 3),
        in_specs=[pl.BlockSpec((8, 32), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((8,), lambda i, j: (i,)),
    )(x)
    assert_close(out, x.sum(axis=1), rtol=1e-5, atol=1e-4)


def test_revisits_run_in_grid_order(reversed_programs):
    """A non-commutative update (o = 2 * o + x_k) over two sequential axes."""
    x = random((4, 3, 16), jnp.float32)

    def kernel(x_ref, o_ref):
        first = (pl.program_id(0) == 0) & (pl.program_id(1) == 0)

        @pl.when(first)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] = 2 * o_ref[...] + x_ref[...]

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((16,), jnp.float32),
        grid=(4, 3),
        in_specs=[pl.BlockSpec((None, None, 16), lambda i, j: (i, j, 0))],
        out_specs=pl.BlockSpec((16,), lambda i, j: (0,)),
    )(x)
    ref = jnp.zeros((16,))
    for row in x.reshape(12, 16):
        ref = 2 * ref + row
    assert_close(out, ref, rtol=1e-5, atol=1e-3)


def test_revisited_output_written_in_parts(reversed_programs):
    """pl.ds reads and writes of the revisited block (at starts that do not
    depend on k): it stays in memory between steps. (The two parts do not
    overlap: within one step, a read of what another thread of the program
    just stored is a race on a GPU, as in any Triton kernel.)"""
    x = random((16, 64), jnp.float32)
    s = jnp.array([4], jnp.int32)

    def kernel(s_ref, x_ref, o_ref):
        k = pl.program_id(1)

        @pl.when(k == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        rows = pl.ds(s_ref[0], 4)
        o_ref[pl.ds(0, 4), :] += x_ref[pl.ds(0, 4), :] * (k + 1).astype(jnp.float32)
        o_ref[rows, :] = o_ref[rows, :] * 0.5 + x_ref[rows, :]

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((16, 16), jnp.float32),
        grid=(2, 4),
        in_specs=[pl.BlockSpec((1,), lambda i, k: (0,)), pl.BlockSpec((8, 16), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((8, 16), lambda i, k: (i, 0)),
    )(s, x)
    blocks = np.asarray(x).reshape(2, 8, 4, 16)
    ref = np.zeros((2, 8, 16), np.float32)
    for k in range(4):
        ref[:, 0:4] += blocks[:, 0:4, k] * (k + 1)
        ref[:, 4:8] = ref[:, 4:8] * 0.5 + blocks[:, 4:8, k]
    assert_close(out, ref.reshape(16, 16), rtol=1e-5, atol=1e-4)


def test_outputs_addressed_by_program_id_stay_parallel(reversed_programs):
    """A Triton-style kernel over whole arrays: every program writes its own
    pl.ds(i * b, b) part of the output, so the grid stays parallel."""
    x = random((1000,), jnp.float32)

    def kernel(x_ref, o_ref):
        part = pl.ds(pl.program_id(0) * 128, 128)
        o_ref[part] = x_ref[part] * 3

    f = R.call(kernel, jax.ShapeDtypeStruct((1024,), jnp.float32), grid=(8,))
    out = f(jnp.pad(x, (0, 24)))
    assert_close(out[:1000], x * 3)
    lk = lowered(
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((1024,), jnp.float32), grid=(8,)),
        jax.ShapeDtypeStruct((1024,), jnp.float32),
    )
    assert lk.launch_grid == (8, 1, 1) and "for step" not in lk.body


def test_scratch_persists_across_sequential_steps(reversed_programs):
    x = random((3, 32), jnp.float32)

    def kernel(x_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] = jnp.maximum(acc_ref[...], x_ref[...])

        @pl.when(pl.program_id(0) == 2)
        def _():
            o_ref[...] = acc_ref[...]

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((32,), jnp.float32),
        grid=(3,),
        in_specs=[pl.BlockSpec((None, 32), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((32,), lambda i: (0,)),
        scratch_shapes=[jax.ShapeDtypeStruct((32,), jnp.float32)],
    )(x)
    assert_close(out, jnp.maximum(x.max(axis=0), 0.0))


def test_atomics_keep_the_grid_parallel():
    x = random((8, 32), jnp.float32)

    def kernel(x_ref, _, o_ref):
        plgpu.atomic_add(o_ref, slice(None), x_ref[...])

    f = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((32,), jnp.float32),
        grid=(8,),
        in_specs=[pl.BlockSpec((None, 32), lambda i: (i, 0)), pl.BlockSpec((32,), lambda i: (0,))],
        out_specs=pl.BlockSpec((32,), lambda i: (0,)),
        input_output_aliases={1: 0},
    )
    lk = lowered(f, x, jnp.zeros((32,), jnp.float32))
    assert lk.launch_grid == (8, 1, 1) and "for step" not in lk.body


# ---------------------------------------------------------------------------
# Out-of-range block indices: a negative one counts once from the end, then it is clamped.


@pytest.mark.parametrize("shift", [-1, 1, 100000, -100000])
def test_out_of_range_block_index_is_clamped(shift):
    n, b = 100, 16
    x = random((n,), jnp.float32)
    nb = pl.cdiv(n, b)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((nb * b,), jnp.float32),
        grid=(nb,),
        in_specs=[pl.BlockSpec((b,), lambda i: (i + shift,))],
        out_specs=pl.BlockSpec((b,), lambda i: (i,)),
    )(x)
    padded = jnp.pad(x, (0, nb * b - n))

    def block(i):  # JAX's interpret mode: a negative index counts once from the end, then clamps
        j = i + shift
        return min(max(j + nb if j < 0 else j, 0), nb - 1)

    blocks = [padded[block(i) * b :][:b] for i in range(nb)]
    ref = jnp.concatenate(blocks) * 2
    valid = np.concatenate([np.arange(b) + block(i) * b < n for i in range(nb)])
    assert_close(np.asarray(out)[valid], np.asarray(ref)[valid])


def test_out_of_range_element_offset_is_clamped():
    n, size, lo, hi = 40, 8, 2, 3
    x = random((n,), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((8 * size,), jnp.float32),
        grid=(8,),
        in_specs=[pl.BlockSpec((pl.Element(size, (lo, hi)),), lambda i: (i * 7 - 5,))],
        out_specs=pl.BlockSpec((size,), lambda i: (i,)),
    )(x)
    starts = [min(max(i * 7 - 5, 0), n + lo + hi - size) - lo for i in range(8)]  # in array coordinates
    idx = np.concatenate([s + np.arange(size) for s in starts])
    valid = (idx >= 0) & (idx < n)  # padding reads are unspecified
    assert_close(np.asarray(out)[valid], np.asarray(x)[idx[valid]] + 1)


def test_out_of_range_output_block_is_clamped():
    """Writes to an out-of-range block land in the clamped block, never outside."""
    x = random((4, 8), jnp.float32)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((4, 8), jnp.float32),
        grid=(4,),
        in_specs=[pl.BlockSpec((1, 8), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda i: (i + 1000 * (i == 3), 0)),
    )(x)
    assert_close(out, x + 1)


# ---------------------------------------------------------------------------
# Out-of-range dynamic indices inside the kernel: wrapped once if negative,
# then clamped so the slice lies inside the Ref (lax.dynamic_slice).


def _clamped_reference(block, s, size, stride=1):
    n = block.shape[0]
    if stride == 1:
        s = s + n if s < 0 else s
        s = min(max(s, 0), n - size)
        return block[s : s + size]
    idx = s + stride * np.arange(size)
    idx = np.where(idx < 0, idx + n, idx)
    return block[np.clip(idx, 0, n - 1)]


@pytest.mark.parametrize("s", [-20, -5, 3, 13, 100])
def test_dynamic_ds_is_clamped(s):
    x = random((32, 8), jnp.float32)
    starts = jnp.array([s], jnp.int32)

    def kernel(s_ref, x_ref, o_ref, p_ref, q_ref):
        st = s_ref[0]
        o_ref[...] = x_ref[pl.ds(st, 4), :]
        p_ref[...] = x_ref[pl.ds(st, 4, stride=3), :]
        q_ref[...] = x_ref[st, :]

    outs = R.call(
        kernel,
        [jax.ShapeDtypeStruct((4, 8), jnp.float32)] * 2 + [jax.ShapeDtypeStruct((8,), jnp.float32)],
        grid=(1,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((16, 8), lambda i: (1, 0))],
        out_specs=[pl.BlockSpec((4, 8), lambda i: (0, 0))] * 2 + [pl.BlockSpec((8,), lambda i: (0,))],
    )(starts, x)
    block = np.asarray(x[16:])
    assert_close(outs[0], _clamped_reference(block, s, 4))
    assert_close(outs[1], _clamped_reference(block, s, 4, stride=3))
    assert_close(outs[2], _clamped_reference(block, s, 1)[0])
    # The same as JAX's interpret mode (pallas-core's vectorized interpret
    # mode reads outside the block for starts below -block_size).
    from jax.experimental import pallas as jpl

    f = jpl.pallas_call(
        kernel,
        [jax.ShapeDtypeStruct((4, 8), jnp.float32)] * 2 + [jax.ShapeDtypeStruct((8,), jnp.float32)],
        grid=(1,),
        in_specs=[jpl.BlockSpec((1,), lambda i: (0,)), jpl.BlockSpec((16, 8), lambda i: (1, 0))],
        out_specs=[jpl.BlockSpec((4, 8), lambda i: (0, 0))] * 2 + [jpl.BlockSpec((8,), lambda i: (0,))],
        interpret=True,
    )
    for got, want in zip(outs, f(starts, x)):
        assert_close(got, want)


@pytest.mark.parametrize("s", [-3, 5, 40])
def test_dynamic_ds_store_is_clamped(s):
    x = random((4,), jnp.float32)

    def kernel(s_ref, x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[pl.ds(s_ref[0], 4)] = x_ref[...]

    out = R.call(
        kernel,
        jax.ShapeDtypeStruct((24,), jnp.float32),
        grid=(1,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((4,), lambda i: (0,))],
        out_specs=pl.BlockSpec((8,), lambda i: (1,)),
    )(jnp.array([s], jnp.int32), x)
    start = min(max(s + 8 if s < 0 else s, 0), 4)
    ref = np.asarray(out).copy()  # blocks 0 and 2 are never written
    ref[8:16] = 0
    ref[8 + start : 12 + start] = np.asarray(x)
    assert_close(np.asarray(out)[8:16], ref[8:16])


# ---------------------------------------------------------------------------
# On the GPU


@gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_revisited_output_on_gpu(dtype):
    a, b = random((512, 1024), dtype), random((1024, 256), dtype)
    out = jax.jit(matmul_revisit(512, 1024, 256, 64, 64, 64, dtype, call=pl.pallas_call))(a, b)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32, precision="highest")
    assert_close(out, ref, rtol=2e-2, atol=0.5)


@gpu
def test_reduction_and_clamped_blocks_on_gpu():
    x = random((256, 1024), jnp.float32)

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.sum(x_ref[...], axis=1)

    out = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((256,), jnp.float32),
        grid=(8, 8),
        in_specs=[pl.BlockSpec((32, 128), lambda i, j: (i - 1, j))],  # i - 1: -1 is the last block
        out_specs=pl.BlockSpec((32,), lambda i, j: (i,)),
    )(x)
    rows = jnp.concatenate([x[((i - 1) % 8) * 32 :][:32] for i in range(8)])
    assert_close(out, rows.sum(axis=1), rtol=1e-4, atol=1e-3)


@gpu
@pytest.mark.parametrize("s", [-5, 13, 100])
def test_dynamic_ds_is_clamped_on_gpu(s):
    x = random((32, 8), jnp.float32)

    def kernel(s_ref, x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(s_ref[0], 4), :]

    out = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((4, 8), jnp.float32),
        grid=(1,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((16, 8), lambda i: (1, 0))],
        out_specs=pl.BlockSpec((4, 8), lambda i: (0, 0)),
    )(jnp.array([s], jnp.int32), x)
    assert_close(out, _clamped_reference(np.asarray(x[16:]), s, 4))
