"""First calls of TPU kernels in interpret mode (a kernel of public model code took 29-73 s on its first call): what makes them cheaper
must not change what a kernel computes or which errors it reports, and a slow
trace or compile says so on stderr.

* Ref indices known while tracing are Python ints: no bounds check or dynamic slice
  in the program, yet a static index out of bounds is still an error.
* A traced index checked once in a jaxpr is not checked again there, but a check made
  inside a ``pl.when`` branch does not stand for one outside it.
* ``PALLAS_TPU_PROGRESS_S``: progress lines while a kernel is traced and while XLA
  compiles the program that holds it.
* Checks gathered along a straight run and folded into the error record where control
  flow begins and ends still report the first failure in program order, also from a
  run of more checks than one select chain folds.
* An on_wait DMA wait lands its own descriptor's region first, every DMA on its
  semaphore only when that region held too few bytes (no byte counters kept).

``benchmarks/tpu_first_call.py`` times the first call against JAX's interpret mode.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas as pl
import pallas_tpu as pltpu

pytestmark = pytest.mark.interpret_only("TPU interpret mode's checks and progress lines")


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _raises(match, fn):
    with pytest.raises(Exception) as info:
        jax.block_until_ready(fn())
    assert re.search(match, str(info.value)), str(info.value)[-2000:]
    return str(info.value)


def _smem_vmem_call(kernel, scalars, x, out_shape=(8, 128)):
    """``kernel(s_ref, x_ref, o_ref)`` in TPU interpret mode: int32 ``scalars`` in SMEM,
    ``x`` and the f32 output of ``out_shape`` in VMEM."""
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        interpret=pltpu.InterpretParams(),
    )(jnp.array(scalars, jnp.int32), x)


def test_static_and_repeated_dynamic_indices_match_jnp():
    x = rand(1, (4, 16, 128))
    seed = np.random.default_rng().integers(1 << 30)
    shift = int(seed % 8)

    def kernel(s_ref, x_ref, o_ref, acc):
        i = s_ref[0]
        acc[...] = x_ref[1]  # a static index: a slice
        acc[pl.ds(0, 8), :] += x_ref[3, pl.ds(8, 8), :]  # static starts
        acc[pl.ds(i, 8), :] += 2.0 * x_ref[0, pl.ds(i, 8), :]  # one traced index, read and written
        acc[pl.ds(i, 8), :] += x_ref[2, pl.ds(i, 8), :]
        o_ref[...] = acc[...]  # the whole buffer

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((16, 128), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((16, 128), jnp.float32)],
        interpret=pltpu.InterpretParams(),
    )(jnp.array([shift], jnp.int32), x)
    ref = (
        x[1]
        .at[:8]
        .add(x[3, 8:16])
        .at[shift : shift + 8]
        .add(2.0 * x[0, shift : shift + 8] + x[2, shift : shift + 8])
    )
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_static_index_out_of_bounds_is_still_an_error():
    x = rand(2, (16, 128))

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(12, 8), :]  # rows 12..20 of 16, known while tracing

    call = lambda: pl.pallas_call(  # noqa: E731
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        interpret=pltpu.InterpretParams(),
    )(x)
    # Refused while the kernel is traced (JAX's indexing), before the interpreter sees it.
    _raises(r"kernel 'kernel' \(test_first_call.py:\d+\).*Out of bound slice: start=12, size=8", call)


@pytest.mark.parametrize("taken", [False, True])
def test_a_check_inside_a_branch_does_not_stand_for_one_after_it(taken):
    """The same traced index read in a ``pl.when`` branch and then after it: when the
    branch does not run, the read after it must still be checked."""
    x = rand(3, (16, 128))

    def kernel(s_ref, x_ref, o_ref):
        i = s_ref[0]

        @pl.when(s_ref[1] == 1)
        def _():
            o_ref[...] = x_ref[pl.ds(i, 8), :]

        o_ref[...] = x_ref[pl.ds(i, 8), :] + 1.0

    def call(start):
        return _smem_vmem_call(kernel, [start, int(taken)], x)

    start = int(np.random.default_rng().integers(0, 9))
    np.testing.assert_allclose(call(start), x[start : start + 8] + 1.0, rtol=1e-6)
    msg = _raises(r"Out-of-bounds read of in_specs\[1\]", lambda: call(12))
    assert "[12, 12 + 8)" in msg


def test_progress_lines_while_tracing_and_compiling(monkeypatch, capfd):
    monkeypatch.setenv("PALLAS_TPU_PROGRESS_S", "0")  # every phase is "long"
    x = rand(4, (16, 128))

    def slow_to_build(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...]) * 2.0

    f = jax.jit(
        lambda x: pl.pallas_call(
            slow_to_build,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=pltpu.InterpretParams(),
        )(x)
    )
    np.testing.assert_allclose(f(x), jnp.tanh(x) * 2.0, rtol=1e-6)
    err = capfd.readouterr().err
    assert (
        "pallas_tpu: XLA is compiling a program with 1 TPU kernel in interpret mode ('slow_to_build')" in err
    )
    assert "pallas_tpu: XLA compiled the program with TPU kernels in interpret mode in " in err
    monkeypatch.setenv("PALLAS_TPU_PROGRESS_S", "60")  # a quiet second compile
    g = jax.jit(lambda x: f(x) + 1.0)
    np.testing.assert_allclose(g(x), jnp.tanh(x) * 2.0 + 1.0, rtol=1e-6)
    assert "pallas_tpu" not in capfd.readouterr().err


def test_the_first_failed_check_is_reported_around_branches():
    """Checks are gathered and folded into the error record where control flow
    begins and ends: the one reported is still the first in program order, before,
    inside and after a ``pl.when``."""
    x = rand(5, (16, 128))

    def kernel(s_ref, x_ref, o_ref):
        a, b, c = s_ref[0], s_ref[1], s_ref[2]
        o_ref[...] = x_ref[pl.ds(a, 8), :]

        @pl.when(s_ref[3] == 1)
        def _():
            o_ref[...] += x_ref[pl.ds(b, 8), :]

        o_ref[...] += x_ref[pl.ds(c, 8), :]

    def call(a, b, c, taken=1):
        return _smem_vmem_call(kernel, [a, b, c, taken], x)

    a, b, c = (int(v) for v in np.random.default_rng().integers(0, 9, 3))
    np.testing.assert_allclose(call(a, b, c), x[a : a + 8] + x[b : b + 8] + x[c : c + 8], rtol=1e-6)
    assert "[11, 11 + 8)" in _raises("Out-of-bounds read", lambda: call(11, 12, 13))
    assert "[12, 12 + 8)" in _raises("Out-of-bounds read", lambda: call(a, 12, 13))
    assert "[13, 13 + 8)" in _raises("Out-of-bounds read", lambda: call(a, 12, 13, taken=0))
    assert "[13, 13 + 8)" in _raises("Out-of-bounds read", lambda: call(a, b, 13))


@pytest.mark.parametrize("n", [12, 80])
def test_the_first_failed_of_many_checks_is_reported(n):
    """A straight run of more checks than the error record's select chain folds
    (``errors._CHAIN_MAX``) picks the record's words by the number of the first failed
    check, and of very many (``errors._PICK_MAX``) looks it up in a table: still the
    first failure in program order, with its values."""
    x = rand(6, (16, 128))

    def kernel(s_ref, x_ref, o_ref):
        acc = x_ref[pl.ds(s_ref[0], 8), :]
        for i in range(1, n):
            acc = acc + x_ref[pl.ds(s_ref[i], 8), :]
        o_ref[...] = acc

    def call(starts):
        return _smem_vmem_call(kernel, starts, x)

    rng = np.random.default_rng()
    starts = [int(v) for v in rng.integers(0, 9, n)]
    np.testing.assert_allclose(call(starts), sum(x[a : a + 8] for a in starts), rtol=1e-5)
    for first in (0, int(rng.integers(1, n - 1)), n - 1):
        bad = list(starts)
        for i in range(first, n, 2):
            bad[i] = 9 + i
        assert f"[{9 + first}, {9 + first} + 8)" in _raises("Out-of-bounds read", lambda: call(bad))


@pytest.mark.parametrize("wait", ["own", "other_slot"])
def test_on_wait_lands_the_waited_region_first(wait):
    """Two DMAs on one semaphore into the two slots of a buffer: a wait for one
    slot's bytes with that slot's descriptor lands that slot only (the other still
    shows its old contents); with the other slot's descriptor (a region that holds
    none of the semaphore's data) every DMA on the semaphore lands."""
    x = rand(6, (2, 8, 128))

    def kernel(x_hbm, o_ref, buf, sem):
        buf[...] = jnp.zeros_like(buf)
        pltpu.make_async_copy(x_hbm.at[0], buf.at[0], sem).start()
        pltpu.make_async_copy(x_hbm.at[1], buf.at[1], sem).start()
        if wait == "own":
            pltpu.make_async_copy(x_hbm.at[0], buf.at[0], sem).wait()
        else:
            pltpu.make_async_copy(x_hbm.at[0], o_ref.at[0], sem).wait()  # names no buffer of the DMAs
        o_ref[...] = buf[...]
        pltpu.make_async_copy(x_hbm.at[1], buf.at[1], sem).wait()
        o_ref[1] += buf[1]

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(dma_execution_mode="on_wait"),
    )(x)
    first = x[1] if wait == "other_slot" else jnp.zeros_like(x[1])
    np.testing.assert_allclose(out, jnp.stack([x[0], first + x[1]]), rtol=1e-6)


def test_a_loop_condition_that_reads_a_ref():
    """A ``while`` loop's condition reads an SMEM Ref at a traced index: the checks
    gathered there end with the condition (it returns its predicate only)."""
    x = rand(7, (8, 128))
    k = int(np.random.default_rng().integers(1, 4))

    def kernel(s_ref, x_ref, o_ref):
        def body(c):
            i, acc = c
            return i + 1, acc + x_ref[...]

        _, acc = lax.while_loop(lambda c: s_ref[c[0]] > 0, body, (s_ref[0], jnp.zeros_like(x_ref[...])))
        o_ref[...] = acc

    s = jnp.array([1] * (k + 1) + [0] * (4 - k), jnp.int32)  # from index 1, k positive entries
    out = _smem_vmem_call(kernel, s, x, x.shape)
    np.testing.assert_allclose(out, k * x, rtol=1e-6)


@pytest.mark.parametrize("mode", ["on_wait", "eager"])
def test_dmas_as_flat_runs_land_where_started(mode):
    """DMAs move one contiguous run of a cell as a flat run (slots of buffers of one size
    and different shapes share XLA kernels): runs between a column block of HBM and a
    slot, and a column block of VMEM (not one run), land where started; before its
    wait a destination keeps its old contents (on_wait)."""
    x, w = rand(8, (16, 128)), rand(9, (128, 16))

    def kernel(x_hbm, w_hbm, oa_ref, ob_ref, oc_ref, a, b, c, sems):
        i = pl.program_id(0)
        slot = i % 2
        c[...] = jnp.zeros_like(c)
        copies = [
            pltpu.make_async_copy(x_hbm.at[pl.ds(8 * i, 8)], a.at[slot], sems.at[0]),
            pltpu.make_async_copy(w_hbm.at[:, pl.ds(8 * i, 8)], b.at[slot], sems.at[1]),
            pltpu.make_async_copy(
                x_hbm.at[pl.ds(8 * i, 8), pl.ds(0, 64)], c.at[:, pl.ds(64, 64)], sems.at[2]
            ),
        ]
        for copy in copies:
            copy.start()
        oc_ref[0] = c[...]  # before the waits
        for copy in copies:
            copy.wait()
        oa_ref[0] = a[slot]
        ob_ref[0] = b[slot]
        oc_ref[1] = c[...]

    oa, ob, oc = pl.pallas_call(
        kernel,
        grid=(2,),
        out_shape=[
            jax.ShapeDtypeStruct((2, 8, 128), jnp.float32),
            jax.ShapeDtypeStruct((2, 128, 8), jnp.float32),
            jax.ShapeDtypeStruct((2, 2, 8, 128), jnp.float32),
        ],
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=[
            pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0)),
            pl.BlockSpec((1, 128, 8), lambda i: (i, 0, 0)),
            pl.BlockSpec((None, 2, 8, 128), lambda i: (i, 0, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((2, 8, 128), jnp.float32),
            pltpu.VMEM((2, 128, 8), jnp.float32),
            pltpu.VMEM((8, 128), jnp.float32),
            pltpu.SemaphoreType.DMA((3,)),
        ],
        interpret=pltpu.InterpretParams(dma_execution_mode=mode),
    )(x, w)
    np.testing.assert_array_equal(oa, x.reshape(2, 8, 128))
    np.testing.assert_array_equal(ob, jnp.stack([w[:, :8], w[:, 8:]]))
    after = jnp.zeros((2, 8, 128)).at[:, :, 64:].set(x.reshape(2, 8, 128)[:, :, :64])
    before = jnp.zeros((2, 8, 128)) if mode == "on_wait" else after
    np.testing.assert_array_equal(oc, jnp.stack([before, after], axis=1))
