"""What a DMA does, whatever descriptor its wait is given (a pattern of public TPU kernels
that our interpret mode once got silently wrong).

On a TPU a DMA goes where its ``start`` said; a ``wait`` only takes its byte
count off the semaphore. Kernels wait on rebuilt or "dummy" descriptors of the
same size (another row, another slot of the buffer, another buffer, a local
descriptor for a remote copy), wait once for several DMAs on one semaphore, or
several times for one. Each kernel here runs every TPU way (tests/ways) that
lowers it (both DMA execution modes of our interpreter, and the Mosaic ways)
against a ``jnp`` reference on fresh random data, and in the interpret ways
also against JAX's own TPU interpret mode (a test-only reference). DMAs whose
size is traced (``pl.ds(start, n)`` with ``n`` read from SMEM) too, and DMAs
that add (interpret mode only: no lowering takes them). Then the error paths:
a wait for more bytes than will come (one device or two: reported, not hung),
bytes never waited for, a traced size out of bounds or differing between the
ends, and the waits the interpreter cannot tie to their DMA.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from ways import every_way, xfail_way
from ways.chip import needs_devices
from ways.compare import close
from ways.jax_mosaic import jax_namespaces

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.mosaic.compile_check import MosaicCompileError

interpret_only = pytest.mark.interpret_only
HERE = os.path.basename(__file__)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def dma_mode(way) -> str:
    """The DMA execution mode of the ``tpu_interpret`` way (tests/ways)."""
    return way.dma or "on_wait"


def check(fn, args, way, expected, **kw):
    """``fn`` run the ``way`` way equals ``expected``; in the interpret ways,
    JAX's interpret mode (same DMA mode) gives the same."""
    out = way.call(fn, *args, **kw)
    close(out, expected, 0)
    if way.name == "tpu_interpret":
        jpl, jpltpu = jax_namespaces()
        params = jpltpu.InterpretParams(dma_execution_mode=dma_mode(way))
        theirs = fn(jpl, jpltpu, *args, interpret=params, **kw)
        close(theirs, expected, 0)
        close(out, theirs, 0)


def hbm(pl):
    return pl.BlockSpec(memory_space=pl.ANY)


# ---------------------------------------------------------------------------
# HBM -> HBM, one semaphore per row, waits on rebuilt descriptors.

PERM = (2, 0, 3, 1)


def permute_rows(pl, pltpu, x, *, form, interpret):
    """o[PERM[r]] = x[r]: every copy started, then every one waited for."""

    def kernel(x_hbm, o_hbm, sems):
        for r, t in enumerate(PERM):
            pltpu.make_async_copy(x_hbm.at[r], o_hbm.at[t], sems.at[r]).start()
        for r in range(len(PERM)):
            if form == "same":
                pltpu.make_async_copy(x_hbm.at[r], o_hbm.at[PERM[r]], sems.at[r]).wait()
            elif form == "rebuilt":  # the unpermuted row: another region of the same buffers
                pltpu.make_async_copy(x_hbm.at[r], o_hbm.at[r], sems.at[r]).wait()
            else:  # "dummy": always row 0
                pltpu.make_async_copy(x_hbm.at[0], o_hbm.at[0], sems.at[r]).wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[pltpu.SemaphoreType.DMA((len(PERM),))],
        interpret=interpret,
    )(x)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("form", ["same", "rebuilt", "dummy"])
def test_hbm_copies_land_where_started(way, form):
    x = rand(0, (4, 8, 128))
    expected = jnp.zeros_like(x).at[jnp.array(PERM)].set(x)
    check(permute_rows, (x,), way, expected, form=form)


# ---------------------------------------------------------------------------
# HBM -> VMEM double buffering: a semaphore array indexed by the traced slot.


def double_buffered(pl, pltpu, x, *, form, interpret):
    """o = sum_i (i + 1) * x[i], x[i + 1] fetched into the other slot while
    x[i] is used."""
    n = x.shape[0]

    def kernel(x_hbm, o_ref, buf, other, sems):
        pltpu.async_copy(x_hbm.at[0], buf.at[0], sems.at[0])

        def body(i, acc):
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < n)
            def _():
                pltpu.make_async_copy(x_hbm.at[i + 1], buf.at[1 - slot], sems.at[1 - slot]).start()

            if form == "same":
                pltpu.make_async_copy(x_hbm.at[i], buf.at[slot], sems.at[slot]).wait()
            elif form == "dummy_slot":  # slot 0 of the buffer, whichever slot the copy went to
                pltpu.make_async_copy(x_hbm.at[0], buf.at[0], sems.at[slot]).wait()
            else:  # "dummy_buffer": a buffer no DMA goes to
                pltpu.make_async_copy(x_hbm.at[0], other, sems.at[slot]).wait()
            return acc + buf[slot] * (i + 1).astype(jnp.float32)

        o_ref[...] = lax.fori_loop(0, n, body, jnp.zeros(x.shape[1:], jnp.float32))

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
        in_specs=[hbm(pl)],
        scratch_shapes=[
            pltpu.VMEM((2, *x.shape[1:]), x.dtype),
            pltpu.VMEM(x.shape[1:], x.dtype),
            pltpu.SemaphoreType.DMA((2,)),
        ],
        interpret=interpret,
    )(x)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("form", ["same", "dummy_slot", "dummy_buffer"])
def test_vmem_copies_land_where_started(way, form):
    x = rand(1, (5, 8, 128))
    expected = jnp.einsum("i,ijk->jk", jnp.arange(1.0, 6.0), x)
    out = way.call(double_buffered, x, form=form)
    close(out, expected, 1e-5)
    if way.name == "tpu_interpret":
        jpl, jpltpu = jax_namespaces()
        params = jpltpu.InterpretParams(dma_execution_mode=dma_mode(way))
        close(out, double_buffered(jpl, jpltpu, x, form=form, interpret=params), 1e-6)


# ---------------------------------------------------------------------------
# Byte counts: one wait for two DMAs, two waits for one.


def byte_counts(pl, pltpu, x, *, form, space, interpret):
    """Copies x to the output through a VMEM buffer (doubled there) or straight
    into the HBM output, in halves or whole, waited for the other way."""
    half = x.shape[0] // 2

    def kernel(x_hbm, o_hbm, *scratch):
        buf, sem = scratch if space == "vmem" else (o_hbm, *scratch)
        top, bottom = pl.ds(0, half), pl.ds(half, half)
        if form == "two_starts_one_wait":
            pltpu.make_async_copy(x_hbm.at[top], buf.at[top], sem).start()
            pltpu.make_async_copy(x_hbm.at[bottom], buf.at[bottom], sem).start()
            pltpu.make_async_copy(x_hbm, buf, sem).wait()
        else:  # "one_start_two_waits", the bottom half first
            pltpu.make_async_copy(x_hbm, buf, sem).start()
            pltpu.make_async_copy(x_hbm.at[bottom], buf.at[bottom], sem).wait()
            pltpu.make_async_copy(x_hbm.at[top], buf.at[top], sem).wait()
        if space == "vmem":
            buf[...] = buf[...] * 2.0
            pltpu.sync_copy(buf, o_hbm)

    scratch = [pltpu.VMEM(x.shape, x.dtype)] if space == "vmem" else []
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA],
        interpret=interpret,
    )(x)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("space", ["vmem", "hbm"])
@pytest.mark.parametrize("form", ["two_starts_one_wait", "one_start_two_waits"])
def test_waits_take_byte_counts(way, form, space):
    x = rand(2, (16, 128))
    check(byte_counts, (x,), way, 2.0 * x if space == "vmem" else x, form=form, space=space)


def accumulate(pl, pltpu, x, y, *, dst, interpret):
    """y + x[0] + x[1] by DMAs that add (``async_copy(add=True)``) into the HBM
    output (aliased to y) or a VMEM buffer, each waited for on a descriptor
    rebuilt without ``add`` and naming the other row."""

    def kernel(x_hbm, y_hbm, o_hbm, buf, sem):
        target = buf if dst == "vmem" else o_hbm
        if dst == "vmem":
            pltpu.sync_copy(y_hbm, buf)
        for r in range(2):
            pltpu.async_copy(x_hbm.at[r], target, sem, add=True)
            pltpu.make_async_copy(x_hbm.at[1 - r], target, sem).wait()
        if dst == "vmem":
            pltpu.sync_copy(buf, o_hbm)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        in_specs=[hbm(pl), hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[pltpu.VMEM(y.shape, y.dtype), pltpu.SemaphoreType.DMA],
        input_output_aliases={1: 0},
        interpret=interpret,
    )(x, y)


@interpret_only(
    reason="DMAs that add: both Mosaic lowerings refuse add=True, and JAX's interpret mode (0.11) "
    "ignores it (it overwrites), so the reference is jnp alone"
)
@every_way(only=("tpu_interpret",), dma=True)
@pytest.mark.parametrize("dst", ["vmem", "hbm"])
def test_adding_copies_add_as_started(way, dst):
    x, y = rand(14, (2, 8, 128)), rand(15, (8, 128))
    close(way.call(accumulate, x, y, dst=dst), y + x[0] + x[1], 1e-6)


def accumulate_in_flight(pl, pltpu, x, y, *, interpret):
    """y + x[0] + x[1] by two adding DMAs into one VMEM buffer, both in flight
    (two semaphores) before either is waited for."""

    def kernel(x_hbm, y_hbm, o_hbm, buf, sems):
        pltpu.sync_copy(y_hbm, buf)
        for r in range(2):
            pltpu.async_copy(x_hbm.at[r], buf, sems.at[r], add=True)
        for r in range(2):
            pltpu.make_async_copy(x_hbm.at[r], buf, sems.at[r]).wait()
        pltpu.sync_copy(buf, o_hbm)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        in_specs=[hbm(pl), hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[pltpu.VMEM(y.shape, y.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=interpret,
    )(x, y)


@interpret_only(reason="DMAs that add (see test_adding_copies_add_as_started)")
@every_way(only=("tpu_interpret",), dma=True)
def test_adding_copies_in_flight_together_both_add(way):
    x, y = rand(16, (2, 8, 128)), rand(17, (8, 128))
    close(way.call(accumulate_in_flight, x, y), y + x[0] + x[1], 1e-6)


# ---------------------------------------------------------------------------
# DMAs whose size is traced: pl.ds(start, n) with n read from SMEM.


def params_x_y_call(pl, pltpu, kernel, params, x, y, interpret, **kw):
    """``kernel(params in SMEM, x and y in HBM, the output in HBM, a VMEM buffer of y's
    shape, a DMA semaphore)`` as a pallas_call returning an array like ``y``."""
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), hbm(pl), hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[pltpu.VMEM(y.shape, y.dtype), pltpu.SemaphoreType.DMA],
        interpret=interpret,
        **kw,
    )(params, x, y)


def traced_size(pl, pltpu, params, x, y, *, dst, wait, interpret):
    """params = [n, s, d]: the result is y with rows d:d+n replaced by x[s:s+n],
    through a VMEM buffer or straight into the HBM output (aliased to y)."""

    def kernel(p_ref, x_hbm, y_hbm, o_hbm, buf, sem):
        n, s, d = p_ref[0], p_ref[1], p_ref[2]
        if dst == "vmem":
            pltpu.sync_copy(y_hbm, buf)
            copy = pltpu.make_async_copy(x_hbm.at[pl.ds(s, n)], buf.at[pl.ds(d, n)], sem)
        else:
            copy = pltpu.make_async_copy(x_hbm.at[pl.ds(s, n)], o_hbm.at[pl.ds(d, n)], sem)
        copy.start()
        if wait == "same":
            copy.wait()
        else:  # "rebuilt": the same size from row 0 of both
            target = buf if dst == "vmem" else o_hbm
            pltpu.make_async_copy(x_hbm.at[pl.ds(0, n)], target.at[pl.ds(0, n)], sem).wait()
        if dst == "vmem":
            pltpu.sync_copy(buf, o_hbm)

    return params_x_y_call(pl, pltpu, kernel, params, x, y, interpret, input_output_aliases={2: 0})


def traced_size_params(seed, rows_x, rows_y):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, min(rows_x, rows_y) + 1))
    s, d = int(rng.integers(0, rows_x - n + 1)), int(rng.integers(0, rows_y - n + 1))
    return jnp.array([n, s, d], jnp.int32), (n, s, d)


@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("wait", ["same", "rebuilt"])
@pytest.mark.parametrize("dst", ["vmem", "hbm"])
def test_traced_size(way, dst, wait):
    x, y = rand(3, (24, 128)), rand(4, (16, 128))
    for seed in range(2):  # two sizes through one compiled kernel
        params, (n, s, d) = traced_size_params(seed, 24, 16)
        check(traced_size, (params, x, y), way, y.at[d : d + n].set(x[s : s + n]), dst=dst, wait=wait)


def row_gather(pl, pltpu, params, x, y, *, interpret):
    """params = [n, idx...]: y with rows r < n replaced by x[idx[r]], one DMA per row
    whose size is traced, ``jnp.where(r < n, 1, 0)`` (tokamax's routing gmm moves
    rows so, a Python loop over the rows of a tile): the interpreter moves each in a
    window of the size's static bound (1), not of the whole buffer."""
    rows = y.shape[0]

    def kernel(p_ref, x_hbm, y_hbm, o_hbm, buf, sem):
        n = p_ref[0]
        pltpu.sync_copy(y_hbm, buf)
        copies = []
        for r in range(rows):
            size = jnp.where(r < n, 1, 0)
            copies.append(
                pltpu.make_async_copy(x_hbm.at[pl.ds(p_ref[1 + r], size)], buf.at[pl.ds(r, size)], sem)
            )
            copies[-1].start()
        for c in copies:
            c.wait()
        pltpu.sync_copy(buf, o_hbm)

    return params_x_y_call(pl, pltpu, kernel, params, x, y, interpret)


def row_gather_params(seed, rows_x, rows_y, dead=None):
    """[n, idx...]; rows past n index ``dead`` when given (a sentinel, as tokamax's
    dead rows: their DMAs have size 0, so no row is read there)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, rows_y))
    idx = rng.integers(0, rows_x, rows_y)
    if dead is not None:
        idx[n:] = dead
    return jnp.array([n, *idx], jnp.int32), n, idx


@pytest.mark.parametrize("dead", [None, -(2**31), 1000], ids=["live", "int_min", "past_the_end"])
@every_way(tpu=True, dma=True)
def test_rows_moved_by_dmas_of_bounded_traced_size(way, dead):
    x, y = rand(5, (24, 128)), rand(6, (8, 128))
    for seed in range(2):
        params, n, idx = row_gather_params(seed, 24, 8, dead)
        expected = y.at[:n].set(x[idx[:n]])
        if dead == 1000:  # JAX's interpret mode calls an empty read past the end out of bounds
            close(way.call(row_gather, params, x, y), expected, 0)
        else:
            check(row_gather, (params, x, y), way, expected)


def overlapping_windows(pl, pltpu, p, x, *, space, interpret):
    """Two DMAs in flight at once into overlapping regions of one buffer, on two
    semaphores: x[a:a+2k] into win[0:2k] and x[a+k:a+3k] into win[k:3k] (the same
    data where they overlap), the first waited for and win[0:2k] read before the
    second is waited for (k = 4 SMEM words, 8 VMEM rows). tokamax's routing gmm
    prefetches its row indices so, into an SMEM ring window whose consecutive
    aligned ranges share a block."""
    k = 4 if space == "smem" else 8

    def kernel(p_ref, x_hbm, o_ref, win, sems):
        a = p_ref[0]
        first = pltpu.make_async_copy(x_hbm.at[pl.ds(a, 2 * k)], win.at[pl.ds(0, 2 * k)], sems.at[0])
        second = pltpu.make_async_copy(x_hbm.at[pl.ds(a + k, 2 * k)], win.at[pl.ds(k, 2 * k)], sems.at[1])
        first.start()
        second.start()
        first.wait()
        if space == "smem":
            for i in range(2 * k):
                o_ref[i] = win[i]
        else:
            o_ref[pl.ds(0, 2 * k)] = win[pl.ds(0, 2 * k)]
        second.wait()
        if space == "smem":
            for i in range(2 * k, 3 * k):
                o_ref[i] = win[i]
        else:
            o_ref[pl.ds(2 * k, k)] = win[pl.ds(2 * k, k)]

    mem = pltpu.SMEM if space == "smem" else pltpu.VMEM
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((3 * k, *x.shape[1:]), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), hbm(pl)],
        out_specs=pl.BlockSpec(memory_space=mem),
        scratch_shapes=[mem((3 * k, *x.shape[1:]), x.dtype), pltpu.SemaphoreType.DMA((2,))],
        interpret=interpret,
    )(p, x)


@every_way(tpu=True, dma=True)
@xfail_way(
    "compiled",
    "Mosaic (libtpu) refuses a DMA out of a 1-d HBM int32 array at an offset not a multiple of its "
    "128-element tiling ('Could not determine that the dynamic offset ... is a multiple "
    "of the word size')",
    raises=MosaicCompileError,
    ids=("smem",),
)
@pytest.mark.parametrize("space", ["vmem", "smem"])
def test_overlapping_dmas_in_flight_land_both(way, space):
    shape, dtype, n = ((40,), jnp.int32, 12) if space == "smem" else ((40, 128), jnp.float32, 24)
    x = jax.random.randint(jax.random.key(7), shape, -1000, 1000).astype(dtype)
    for a in (3, 16):
        check(overlapping_windows, (jnp.array([a], jnp.int32), x), way, x[a : a + n], space=space)


def test_intervals_of_traced_sizes():
    """The static intervals the interpreter reads off a kernel's jaxpr (facts.py)."""
    from pallas_tpu._src.interpret import facts

    def f(i, n, k):
        return (
            jnp.where(i < n, 1, 0),  # select_n of literals, through jnp.where's call
            jnp.minimum(k, 7),
            lax.rem(k, 4),
            jnp.clip(k, 0, 5) + jnp.where(i < n, 2, 1),
            k & 15,
            k,  # unknown
            i * 2,  # unknown: products are not followed
            jnp.where(i < n, 2**31 - 1, 0) + 1,  # would wrap: unknown
        )

    jaxpr = jax.make_jaxpr(f)(1, 2, 3).jaxpr
    got = facts.intervals(jaxpr, [(None, None)] * 3, {})
    assert got == [(0, 1), (None, 7), (-3, 3), (1, 7), (0, 15), (None, None), (None, None), (None, None)]


@interpret_only
def test_traced_size_past_its_bound_is_reported(monkeypatch):
    """The bound read off the jaxpr is checked as the kernel runs: a wrong one is an
    error, never a silently short copy (here the bounds are made wrong on purpose)."""
    from pallas_tpu._src.interpret import facts

    real = facts.dma_size_bounds

    def too_small(jaxpr):
        return {
            k: (e, {end: [(lo, None if hi is None else hi - 1) for lo, hi in bs] for end, bs in ends.items()})
            for k, (e, ends) in real(jaxpr).items()
        }

    monkeypatch.setattr(facts, "dma_size_bounds", too_small)
    params, _, _ = row_gather_params(0, 24, 8)
    with pytest.raises(Exception, match="exceeds 0, the bound"):
        jax.block_until_ready(
            row_gather(
                pl, pltpu, params, rand(5, (24, 128)), rand(6, (8, 128)), interpret=pltpu.InterpretParams()
            )
        )


# ---------------------------------------------------------------------------
# Two devices: remote copies waited for on rebuilt and dummy descriptors.


def all_gather(pl, pltpu, *, form, interpret=False):
    """Each of two devices: o[me] = x by a local DMA, o[me] on the other device
    = x by a remote one, so o = [x of device 0, x of device 1] on both.

    form: "same" waits on the start's descriptors; "rebuilt" on descriptors
    naming the other row (the receive's own row on this device); "local" waits
    for the remote copy with a local descriptor on its receive semaphore;
    "halves" sends two halves and waits for both with one descriptor of a
    scratch buffer no DMA goes to."""

    def kernel(x_hbm, o_hbm, dummy, send_sem, recv_sem, local_sem):
        me = lax.axis_index("x")
        other = 1 - me
        barrier = pltpu.get_barrier_semaphore()
        pl.semaphore_signal(barrier, 1, device_id=(other,), device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(barrier, 1)
        local = pltpu.make_async_copy(x_hbm, o_hbm.at[me], local_sem)
        local.start()

        def remote(src, dst):
            return pltpu.make_async_remote_copy(
                src, dst, send_sem, recv_sem, device_id=(other,), device_id_type=pl.DeviceIdType.MESH
            )

        if form == "halves":
            half = x_hbm.shape[0] // 2
            top, bottom = pl.ds(0, half), pl.ds(half, half)
            remote(x_hbm.at[top], o_hbm.at[me, top]).start()
            remote(x_hbm.at[bottom], o_hbm.at[me, bottom]).start()
        else:
            remote(x_hbm, o_hbm.at[me]).start()
        if form == "same":
            local.wait()
            remote(x_hbm, o_hbm.at[me]).wait_send()
            remote(x_hbm, o_hbm.at[me]).wait_recv()
        elif form == "rebuilt":
            pltpu.make_async_copy(x_hbm, o_hbm.at[other], local_sem).wait()
            remote(x_hbm, o_hbm.at[other]).wait_send()
            remote(x_hbm, o_hbm.at[other]).wait_recv()
        elif form == "local":
            local.wait()
            remote(x_hbm, o_hbm.at[me]).wait_send()
            pltpu.make_async_copy(x_hbm, o_hbm.at[other], recv_sem).wait()
        else:  # "halves"
            local.wait()
            remote(x_hbm, o_hbm.at[me]).wait_send()  # both halves' bytes
            remote(x_hbm, dummy).wait_recv()

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((2, *x.shape), x.dtype),
            in_specs=[hbm(pl)],
            out_specs=hbm(pl),
            scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)] + [pltpu.SemaphoreType.DMA] * 3,
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=interpret,
        )(x)

    return f


def jax_sharded(build, x, mode, n=2):
    """``build`` with JAX's Pallas, in JAX's interpret mode, over ``n`` CPU devices."""
    jpl, jpltpu = jax_namespaces()
    f = build(jpl, jpltpu, interpret=jpltpu.InterpretParams(dma_execution_mode=mode))
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]), ("x",))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)


def sharded(build, x, way, n=2, **kw):
    """``build(pl, pltpu, interpret=...)``'s kernel run the ``way`` way over ``n`` devices
    (``way.run_sharded``)."""
    pl, pltpu = way.modules()
    return way.run_sharded(build(pl, pltpu, interpret=way.interpret() or False), x, n, **kw)


@needs_devices(2)
@every_way(tpu=True, dma=True)
@pytest.mark.parametrize("form", ["same", "rebuilt", "local", "halves"])
def test_remote_copies_land_where_started(way, form, fresh_sessions):
    x = rand(5, (2 * 8, 128))
    build = lambda pl, pltpu, interpret=False: all_gather(pl, pltpu, form=form, interpret=interpret)  # noqa: E731
    out = sharded(build, x, way)
    rows = x.reshape(2, 8, 128)
    expected = jnp.concatenate([rows, rows])
    close(out, expected, 0)
    if way.name == "tpu_interpret":
        close(out, jax_sharded(build, x, dma_mode(way)), 0)


def ragged_send(pl, pltpu, *, interpret=False):
    """On each of two devices x holds 8 rows of data over 8 rows of zeros, and the
    output is x (aliased). Each device sends its first k data rows (k = 3 on device
    0, 5 on device 1) into the other's zero rows, one DMA per row of size
    ``where(r < k, 1, 0)``; a dead row's empty DMA is aimed at device 0, row 0
    (tokamax's routing gmm sends its dead rows so). The receiver waits for the
    live rows' bytes only: an empty DMA adds nothing to wait for."""

    def kernel(x_hbm, o_hbm, send_sem, recv_sem):
        me = lax.axis_index("x")
        other = 1 - me
        k = 3 + 2 * me
        half = x_hbm.shape[0] // 2
        for r in range(half):
            live = r < k
            size = jnp.where(live, 1, 0)
            pltpu.make_async_remote_copy(
                x_hbm.at[pl.ds(r, size)],
                o_hbm.at[pl.ds(jnp.where(live, half + r, 0), size)],
                send_sem,
                recv_sem,
                device_id=(jnp.where(live, other, 0),),
                device_id_type=pl.DeviceIdType.MESH,
            ).start()
        mine = x_hbm.at[pl.ds(0, k)]
        pltpu.make_async_copy(mine, mine, send_sem).wait()
        theirs = o_hbm.at[pl.ds(half, 3 + 2 * other)]
        pltpu.make_async_copy(theirs, theirs, recv_sem).wait()

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[hbm(pl)],
            out_specs=hbm(pl),
            scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
            input_output_aliases={0: 0},
            interpret=interpret,
        )(x)

    return f


@needs_devices(2)
@every_way(tpu=True, dma=True)
def test_empty_remote_dmas_need_no_wait(way, fresh_sessions):
    data = rand(8, (2, 8, 128))
    x = jnp.concatenate([data, jnp.zeros_like(data)], axis=1).reshape(32, 128)
    out = sharded(ragged_send, x, way, input_output_aliases={0: 0})
    got = jnp.zeros_like(data).at[0, :5].set(data[1, :5]).at[1, :3].set(data[0, :3])
    close(out, jnp.concatenate([data, got], axis=1).reshape(x.shape), 0)
    if way.name == "tpu_interpret":
        close(out, jax_sharded(ragged_send, x, dma_mode(way)), 0)


# ---------------------------------------------------------------------------
# Errors: what would hang or be wrong on a TPU is reported, naming the kernel and line.

DMA_MODES = ["on_wait", "eager"]


def mismatched_wait(x, *, start_rows, wait_rows, mode):
    """Starts a copy of ``start_rows`` rows of x, waits with a descriptor of ``wait_rows``."""

    def mismatched(x_hbm, o_hbm, sem):
        pltpu.make_async_copy(x_hbm.at[pl.ds(0, start_rows)], o_hbm.at[pl.ds(0, start_rows)], sem).start()
        pltpu.make_async_copy(x_hbm.at[pl.ds(0, wait_rows)], o_hbm.at[pl.ds(0, wait_rows)], sem).wait()

    return pl.pallas_call(
        mismatched,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(dma_execution_mode=mode),
    )(x)


@interpret_only(reason="the interpreter's deadlock report")
@pytest.mark.parametrize("mode", DMA_MODES)
def test_wait_for_more_bytes_than_started_is_a_deadlock(mode):
    x = rand(6, (16, 128))
    with pytest.raises(
        Exception,
        match=rf"TPU kernel 'mismatched' .* at {HERE}:\d+: waiting on DMA semaphore scratch_shapes\[0\] for "
        r"8192 but it holds 4096 .*deadlock",
    ):
        jax.block_until_ready(mismatched_wait(x, start_rows=8, wait_rows=16, mode=mode))


@interpret_only(reason="the interpreter's report of a DMA never waited for")
@pytest.mark.parametrize("mode", DMA_MODES)
def test_bytes_never_waited_for_are_reported(mode):
    x = rand(7, (16, 128))
    with pytest.raises(
        Exception,
        match=r"TPU kernel 'mismatched' .*semaphore scratch_shapes\[0\] is not zero when the kernel ends "
        r"\(a DMA or signal was not waited for; first nonzero value 4096\)",
    ):
        jax.block_until_ready(mismatched_wait(x, start_rows=16, wait_rows=8, mode=mode))


@interpret_only(reason="the interpreter's deadlock report across devices")
@needs_devices(2)
def test_remote_wait_for_more_bytes_than_sent_is_a_deadlock(fresh_sessions):
    def greedy(x_hbm, o_hbm, send_sem, recv_sem):
        other = 1 - lax.axis_index("x")
        copy = pltpu.make_async_remote_copy(x_hbm, o_hbm.at[0], send_sem, recv_sem, device_id=(other,))
        copy.start()
        copy.wait_send()
        pltpu.make_async_remote_copy(o_hbm, o_hbm, send_sem, recv_sem, device_id=(other,)).wait_recv()

    f = pl.pallas_call(
        greedy,
        out_shape=jax.ShapeDtypeStruct((2, 8, 128), jnp.float32),
        in_specs=[hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
        interpret=pltpu.InterpretParams(),
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("x",))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    x = rand(8, (16, 128))
    t0 = time.monotonic()
    with pytest.raises(
        Exception,
        match=rf"TPU kernel 'greedy' .*deadlock: device \d waits at {HERE}:\d+ on scratch_shapes\[1\]\[0\] "
        r"\(core 0\) for 8192 bytes more than it holds, and the remote DMAs sent to it carry 4096, and no "
        r"device can signal it any more \(device \d waits .* for 8192 bytes more than it holds, and the "
        r"remote DMAs sent to it carry 4096\)",
    ):
        jax.block_until_ready(g(x))
    assert time.monotonic() - t0 < 15  # found when both devices are stuck, not by the timeout


def traced_copy(params, x, *, dst_rows):
    """Copies x[s:s+n] into rows 0:m of a VMEM buffer (params = [n, s, m])."""

    def traced(p_ref, x_hbm, o_ref, sem):
        n, s, m = p_ref[0], p_ref[1], p_ref[2]
        o_ref[...] = jnp.zeros_like(o_ref)
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(s, n)], o_ref.at[pl.ds(0, m)], sem)
        copy.start()
        copy.wait()

    return pl.pallas_call(
        traced,
        out_shape=jax.ShapeDtypeStruct((dst_rows, x.shape[1]), x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), hbm(pl)],
        scratch_shapes=[pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(),
    )(params, x)


@interpret_only(reason="the interpreter's bounds check")
def test_traced_size_out_of_bounds_is_reported():
    x = rand(9, (16, 128))
    np.testing.assert_array_equal(  # in bounds: the check passes
        traced_copy(jnp.array([4, 12, 4], jnp.int32), x, dst_rows=8)[:4], x[12:16]
    )
    with pytest.raises(
        Exception,
        match=rf"TPU kernel 'traced' .* at {HERE}:\d+: Out-of-bounds read \(DMA read\) of the input x_hbm \(HBM\)"
        r"|TPU kernel 'traced' .* at "
        + HERE
        + r":\d+: Out-of-bounds read \(DMA read\) of .*: dimension 0 takes 5 elements from 12 \(stride 1\) but its size is 16",
    ):
        jax.block_until_ready(traced_copy(jnp.array([5, 12, 5], jnp.int32), x, dst_rows=8))


@interpret_only(reason="the interpreter's size check")
def test_traced_sizes_that_differ_are_reported():
    x = rand(10, (16, 128))
    with pytest.raises(
        Exception,
        match=rf"TPU kernel 'traced' .* at {HERE}:\d+: the DMA's source has 4 elements along dimension 0 and its "
        r"destination 3; they must be equal",
    ):
        jax.block_until_ready(traced_copy(jnp.array([4, 0, 3], jnp.int32), x, dst_rows=8))


@interpret_only(reason="the interpreter's error for a form it does not support")
def test_traced_size_with_an_index_array_is_refused():
    def traced(p_ref, x_hbm, o_ref, sem):
        cols = jnp.arange(128)
        copy = pltpu.make_async_copy(
            x_hbm.at[pl.ds(0, p_ref[0]), cols], o_ref.at[pl.ds(0, p_ref[0]), cols], sem
        )
        copy.start()
        copy.wait()

    f = pl.pallas_call(
        traced,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), hbm(pl)],
        scratch_shapes=[pltpu.SemaphoreType.DMA],
        interpret=pltpu.InterpretParams(),
    )
    with pytest.raises(
        NotImplementedError,
        match=rf"TPU kernel 'traced' .* at {HERE}:\d+: a DMA view with a traced size cannot also be indexed "
        "with an array of indices",
    ):
        f(jnp.array([4], jnp.int32), rand(11, (8, 128)))


@interpret_only(reason="on_wait: a wait the interpreter cannot tie to its DMA is reported")
def test_wait_before_its_start_naming_another_buffer_is_reported():
    """The wait (for the previous step's copy) comes before the start in the
    program and names a buffer no DMA on the semaphore went to before it: in
    on_wait mode the interpreter cannot tell where that copy lands, and says so
    (eager mode runs it)."""

    def late(x_hbm, o_ref, buf, other, sem):
        def body(i, acc):
            @pl.when(i > 0)
            def _():
                pltpu.make_async_copy(x_hbm.at[0], other, sem).wait()

            acc = acc + jnp.where(i > 0, buf[...], 0.0)

            @pl.when(i < 2)
            def _():
                pltpu.make_async_copy(x_hbm.at[i], buf, sem).start()

            return acc

        o_ref[...] = lax.fori_loop(0, 3, body, jnp.zeros((8, 128), jnp.float32))

    x = rand(12, (2, 8, 128))

    def run(mode):
        return pl.pallas_call(
            late,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            in_specs=[hbm(pl)],
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)] * 2 + [pltpu.SemaphoreType.DMA],
            interpret=pltpu.InterpretParams(dma_execution_mode=mode),
        )(x)

    close(run("eager"), x[0] + x[1], 1e-6)
    with pytest.raises(
        Exception,
        match=r"TPU kernel 'late' .*: a DMA into scratch_shapes\[0\] was waited for but never landed when its "
        r"scope ends: its wait named another buffer .* dma_execution_mode='eager'",
    ):
        jax.block_until_ready(run("on_wait"))


@interpret_only(reason="the interpreter's error for a remote copy it cannot tie to its wait")
@needs_devices(2)
def test_remote_copy_waited_before_its_start_on_another_buffer_is_reported(fresh_sessions):
    def hidden(x_hbm, o_hbm, dummy, send_sem, recv_sem):
        other = 1 - lax.axis_index("x")

        def body(i, carry):
            @pl.when(i > 0)
            def _():
                pltpu.make_async_remote_copy(dummy, dummy, send_sem, recv_sem, device_id=(other,)).wait_recv()

            @pl.when(i < 1)
            def _():
                copy = pltpu.make_async_remote_copy(x_hbm, o_hbm, send_sem, recv_sem, device_id=(other,))
                copy.start()
                copy.wait_send()

            return carry

        lax.fori_loop(0, 2, body, 0)

    f = pl.pallas_call(
        hidden,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[hbm(pl)],
        out_specs=hbm(pl),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)] + [pltpu.SemaphoreType.DMA] * 2,
        interpret=pltpu.InterpretParams(),
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("x",))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    with pytest.raises(
        Exception,
        match=rf"TPU kernel 'hidden' .*: the remote DMA started at {HERE}:\d+ \(device \d\) goes to out_specs\[0\] "
        rf"\(HBM\), but the wait at {HERE}:\d+ that takes its bytes names scratch_shapes\[0\]",
    ):
        jax.block_until_ready(g(rand(13, (16, 128))))
