"""Compiler hints under the shared Triton interpreter: ``tl.multiple_of`` on a
scalar and ``tl.max_contiguous`` (so ``pl.multiple_of`` and
``plgpu.max_contiguous`` in Pallas kernels) are checked against the values.

The GPU compiler trusts a hint (it aligns and vectorizes accesses by it), so a
false one gives a wrong answer on the GPU and none under Triton's interpreter,
which ignored hints: one of the bugs of a GPU kernel that a CPU run could not
see. True hints run as before, on random data against NumPy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import jax_triton as jt  # noqa: E402
import pallas as pl  # noqa: E402
import pallas_gpu as plgpu  # noqa: E402


@triton.jit
def hinted_copy(
    x_ptr, o_ptr, STEP: tl.constexpr, ALIGN: tl.constexpr, RUN: tl.constexpr, BLOCK: tl.constexpr
):
    start = tl.multiple_of(tl.program_id(0) * STEP, ALIGN)
    offs = tl.max_contiguous(start + (tl.arange(0, BLOCK) // RUN) * RUN * 2 + tl.arange(0, BLOCK) % RUN, RUN)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs))


def _copy(x, step, align, run):
    return jt.triton_call(
        x,
        kernel=hinted_copy,
        out_shape=x,
        grid=4,
        STEP=step,
        ALIGN=align,
        RUN=run,
        BLOCK=16,
        zeroed_outputs=(0,),
    )


def _expected(x, step, run):
    want = np.zeros_like(np.asarray(x))
    for p in range(4):
        offs = p * step + (np.arange(16) // run) * run * 2 + np.arange(16) % run
        want[offs] = np.asarray(x)[offs]
    return want


@pytest.mark.parametrize("mode", ["batched", "one_by_one"])
def test_true_hints_run(mode, monkeypatch):
    if mode == "one_by_one":
        monkeypatch.setenv("JAX_KERNEL_RUNTIME_INTERPRET_BATCH", "1")
    x = jax.random.normal(jax.random.key(0), (256,), jnp.float32)
    np.testing.assert_array_equal(_copy(x, 64, 32, 4), _expected(x, 64, 4))
    np.testing.assert_array_equal(_copy(x, 48, 16, 1), _expected(x, 48, 1))


@pytest.mark.parametrize("mode", ["batched", "one_by_one"])
def test_false_multiple_of_is_an_error(mode, monkeypatch):
    if mode == "one_by_one":
        monkeypatch.setenv("JAX_KERNEL_RUNTIME_INTERPRET_BATCH", "1")
    x = jax.random.normal(jax.random.key(1), (256,), jnp.float32)
    with pytest.raises(Exception, match=r"hinted_copy.*multiple_of\(x, 32\) is false: x = 48"):
        jax.block_until_ready(_copy(x, 48, 32, 4))


def test_false_max_contiguous_is_an_error():
    x = jax.random.normal(jax.random.key(2), (256,), jnp.float32)
    # Runs of 4 consecutive offsets, hinted as runs of 8.
    with pytest.raises(Exception, match=r"hinted_copy.*max_contiguous\(x, \[8\]\) is false.*runs of 8"):
        jax.block_until_ready(_copy_run_hint(x))


@triton.jit
def _runs_of_four_hinted_eight(x_ptr, o_ptr, BLOCK: tl.constexpr):
    offs = tl.max_contiguous((tl.arange(0, BLOCK) // 4) * 8 + tl.arange(0, BLOCK) % 4, 8)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs))


def _copy_run_hint(x):
    f = jt.triton_call
    return f(x, kernel=_runs_of_four_hinted_eight, out_shape=x, grid=1, BLOCK=16, name="hinted_copy")


def _pallas_rows(align):
    def kernel(x_ref, o_ref):
        start = pl.multiple_of(pl.program_id(0) * 24, align)
        o_ref[...] = x_ref[pl.ds(start, 8), :] * 2

    return pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((32, 16), jnp.float32),
        grid=(4,),
        out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)),
        interpret=plgpu.InterpretParams(),
    )


def test_pallas_multiple_of_is_checked():
    x = jax.random.normal(jax.random.key(3), (96, 16), jnp.float32)
    want = np.concatenate([np.asarray(x)[24 * p : 24 * p + 8] * 2 for p in range(4)])
    np.testing.assert_allclose(_pallas_rows(8)(x), want)  # 24 * i is a multiple of 8
    with pytest.raises(Exception, match=r"kernel.*multiple_of\(x, 16\) is false: x = 24"):
        jax.block_until_ready(_pallas_rows(16)(x))


def test_pallas_max_contiguous_on_a_padded_value():
    # A (12,) value is held as 16 elements whose last 4 are padding: the hint
    # of runs of 4 holds for the 12 only, so the kernel does not pass it there.
    x = jax.random.normal(jax.random.key(4), (64,), jnp.float32)
    idx = (jnp.arange(12) // 4) * 8 + jnp.arange(12) % 4 + 3  # runs of 4 consecutive offsets

    def kernel(x_ref, i_ref, o_ref, h_ref):
        o_ref[...] = x_ref[plgpu.max_contiguous(i_ref[...], 4)]
        h_ref[...] = x_ref[plgpu.max_contiguous(i_ref[pl.ds(0, 8)], 4)]  # (8,): not padded

    out_shape = (jax.ShapeDtypeStruct((12,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))
    out, head = pl.pallas_call(kernel, out_shape, interpret=plgpu.InterpretParams())(x, idx.astype(jnp.int32))
    np.testing.assert_array_equal(out, np.asarray(x)[np.asarray(idx)])
    np.testing.assert_array_equal(head, np.asarray(x)[np.asarray(idx)[:8]])
