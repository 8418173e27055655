"""``pl.core_map`` on two (and four) TensorCores: the kernels of JAX's
own tests (``tpu_pallas_interpret_test.py``: ``test_core_map``,
``test_allocate_shared_buffer_in_core_map`` and its race) written anew, against
jnp on fresh random data and against JAX's TPU interpret mode.

What is checked: the mesh's cores run in interpret mode without
``num_cores_or_threads`` (JAX sets it from the mesh); a barrier of semaphores that
each core signals on every core (``core_index``) passes only if the cores run
together; a ``pl.run_scoped(pltpu.HBM(...))`` is one buffer that both cores share
(a core waits, in a ``pl.when`` on its index, for the other to fill it) and
unsynchronized use of it is a race; VMEM, SMEM and ``VMEM_SHARED`` scoped buffers
stay each core's own, as in JAX's interpret mode; the barrier kernel lowers and
compiles for a megacore chip (v5p: two TensorCores) and runs by ``run_mosaic`` on two
cores; a scoped HBM buffer is refused by Mosaic (as JAX's lowering is), naming the line.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ways import every_way
from ways.jax_mosaic import jax_namespaces, tensorcore_mesh

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.interpret import multi as interpret_multi
from pallas_tpu._src.mosaic.compile_check import MosaicCompileError

ROWS = 16


def rand_int(seed, shape):
    return jax.random.randint(jax.random.key(seed), shape, -1000, 1000, jnp.int32)


def _mesh(pltpu_mod, num_cores):
    return tensorcore_mesh(pltpu_mod, "x", num_cores)


def _core_map(pl_mod):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pl_mod.core_map


def _jax_interpret_params(**kw):
    _, jpltpu = jax_namespaces()
    return jpltpu.InterpretParams(**kw)


def _jax_reset():
    _, jpltpu = jax_namespaces()
    jpltpu.reset_tpu_interpret_mode_state()


# -- a barrier between the cores, then each core its rows ------------------------------


def build_barrier(pl_mod, pltpu_mod, num_cores, interpret=False):
    """``f(x, y) -> y'``: every core signals a semaphore on every core and waits for all of
    them (it deadlocks unless the cores run together), then adds ``x`` rows of its own
    to its index plus one."""
    mesh, core_map = _mesh(pltpu_mod, num_cores), _core_map(pl_mod)

    def f(x, y):
        def inner(refs):
            x_ref, y_ref = refs

            @core_map(mesh, interpret=interpret)
            def _():
                n = lax.psum(1, "x")
                rows = ROWS // n

                def scoped(x_vmem, y_vmem, dma_sem, sem):
                    for c in range(num_cores):
                        pl_mod.semaphore_signal(sem, 1, core_index=c)
                    pl_mod.semaphore_wait(sem, n)
                    part = pl_mod.ds(lax.axis_index("x") * rows, rows)
                    pltpu_mod.async_copy(x_ref.at[part], x_vmem, dma_sem).wait()
                    y_vmem[...] = x_vmem[...] * 3 + lax.axis_index("x") + 1
                    pltpu_mod.async_copy(y_vmem, y_ref.at[part], dma_sem).wait()

                pl_mod.run_scoped(
                    scoped,
                    pltpu_mod.VMEM((rows, 128), x_ref.dtype),
                    pltpu_mod.VMEM((rows, 128), y_ref.dtype),
                    pltpu_mod.SemaphoreType.DMA,
                    pltpu_mod.SemaphoreType.REGULAR,
                )

        _, y = pl_mod.run_state(inner)((x, y))
        return y

    return f


def expected_barrier(x, num_cores):
    core = (jnp.arange(ROWS) // (ROWS // num_cores)).astype(jnp.int32)[:, None]
    return x * 3 + core + 1


@pytest.mark.parametrize("forced", [False, True], ids=["interpret=params", "force_tpu_interpret_mode"])
@pytest.mark.parametrize("num_cores", [1, 2, 4])
def test_barrier_across_cores_interpret(num_cores, forced):
    """The mesh's cores run together without ``num_cores_or_threads``, also under
    ``force_tpu_interpret_mode`` (JAX's ``test_core_map``)."""
    x = rand_int(num_cores, (ROWS, 128))
    interpret = False if forced else pltpu.InterpretParams()
    f = jax.jit(build_barrier(pl, pltpu, num_cores, interpret=interpret))
    if forced:
        with pltpu.force_tpu_interpret_mode():
            y = f(x, jnp.zeros_like(x))
    else:
        y = f(x, jnp.zeros_like(x))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected_barrier(x, num_cores)))
    jpl, jpltpu = jax_namespaces()
    theirs = jax.jit(build_barrier(jpl, jpltpu, num_cores, interpret=_jax_interpret_params()))(
        x, jnp.zeros_like(x)
    )
    np.testing.assert_array_equal(np.asarray(y), np.asarray(theirs))


# The interpret way: test_barrier_across_cores_interpret, on 1, 2 and 4 cores.
@every_way(only=("mosaic", "jax_mosaic", "compiled"))
def test_barrier_across_cores_lowered(way):
    """The barrier kernel lowered (ours, and JAX's as a check of ``run_mosaic``) and run
    by ``run_mosaic`` on two cores; compiled by libtpu for a megacore chip (v5p) too."""
    way = way.with_params(num_cores=2)
    x = rand_int(7, (ROWS, 128))
    y = way.jit(build_barrier(*way.modules(), 2))(x, jnp.zeros_like(x))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected_barrier(x, 2)))


# -- an HBM buffer of run_scoped, shared by the two cores -------------------------------


def build_shared_hbm(pl_mod, pltpu_mod, first, interpret):
    """``f(x) -> (y, z)``: core ``first`` copies ``x`` into a scoped HBM buffer and then
    signals the other core, which waits (in a ``pl.when`` on its index) and copies the
    buffer, doubled, to ``z``; core ``first`` also copies the buffer to ``y``."""
    mesh, core_map = _mesh(pltpu_mod, 2), _core_map(pl_mod)
    second = 1 - first

    def f(x):
        def inner(refs):
            x_ref, y_ref, z_ref = refs

            @core_map(mesh, interpret=interpret)
            def _():
                def body(sem):
                    @pl_mod.when(lax.axis_index("x") == second)
                    def _():
                        pl_mod.semaphore_wait(sem, 1)

                    def use(hbm, vmem):
                        @pl_mod.when(lax.axis_index("x") == first)
                        def _():
                            pltpu_mod.sync_copy(x_ref, hbm)
                            pltpu_mod.sync_copy(hbm, y_ref)

                        @pl_mod.when(lax.axis_index("x") == second)
                        def _():
                            pltpu_mod.sync_copy(hbm, vmem)
                            vmem[...] = vmem[...] * 2
                            pltpu_mod.sync_copy(vmem, z_ref)

                    pl_mod.run_scoped(
                        use, pltpu_mod.HBM(x_ref.shape, x_ref.dtype), pltpu_mod.VMEM(x_ref.shape, x_ref.dtype)
                    )

                    @pl_mod.when(lax.axis_index("x") == first)
                    def _():
                        pl_mod.semaphore_signal(sem, 1, core_index=second)

                pl_mod.run_scoped(body, pltpu_mod.SemaphoreType.REGULAR)

        _, y, z = pl_mod.run_state(inner)((x, jnp.zeros_like(x), jnp.zeros_like(x)))
        return y, z

    return f


@pytest.mark.interpret_only(reason="a scoped HBM buffer exists in interpret mode only (Mosaic refuses it)")
@pytest.mark.parametrize("dma", ["eager", "on_wait"])
@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("detect_races", [False, True])
def test_scoped_hbm_buffer_is_shared(first, dma, detect_races):
    """JAX's ``test_allocate_shared_buffer_in_core_map``: the buffer exists for both
    cores until both leave its scope; the signal orders them (no race)."""
    x = rand_int(10 + first, (ROWS, 128))
    kw = dict(allow_hbm_allocation_in_run_scoped=True, dma_execution_mode=dma, detect_races=detect_races)
    y, z = jax.jit(build_shared_hbm(pl, pltpu, first, pltpu.InterpretParams(**kw)))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(z), np.asarray(x * 2))
    if detect_races:
        assert not interpret_multi.races.races_found
    jpl, jpltpu = jax_namespaces()
    ty, tz = jax.jit(build_shared_hbm(jpl, jpltpu, first, _jax_interpret_params(**kw)))(x)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(tz))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ty))


def build_racy_hbm(pl_mod, pltpu_mod, slow, interpret):
    """Both cores copy ``x`` through one scoped HBM buffer to ``z`` with nothing between
    them; core ``slow`` first squares a block (``o``)."""
    mesh, core_map = _mesh(pltpu_mod, 2), _core_map(pl_mod)

    def f(x, w):
        def inner(refs):
            x_ref, w_ref, z_ref, o_ref = refs

            @core_map(mesh, interpret=interpret)
            def _():
                def body(hbm, vmem, out):
                    @pl_mod.when(lax.axis_index("x") == slow)
                    def _():
                        pltpu_mod.sync_copy(w_ref, vmem)
                        out[...] = vmem[...] * vmem[...]
                        pltpu_mod.sync_copy(out, o_ref)

                    pltpu_mod.sync_copy(x_ref, hbm)
                    pltpu_mod.sync_copy(hbm, z_ref)

                pl_mod.run_scoped(
                    body,
                    pltpu_mod.HBM(x_ref.shape, x_ref.dtype),
                    pltpu_mod.VMEM(w_ref.shape, w_ref.dtype),
                    pltpu_mod.VMEM(w_ref.shape, w_ref.dtype),
                )

        init = (x, w, jnp.zeros_like(x), jnp.zeros_like(w))
        _, _, z, o = pl_mod.run_state(inner)(init)
        return z, o

    return f


@pytest.mark.interpret_only(reason="race detection")
@pytest.mark.parametrize("dma", ["eager", "on_wait"])
@pytest.mark.parametrize("slow", [0, 1])
def test_scoped_hbm_buffer_race(slow, dma):
    """JAX's ``..._with_race``: both cores write the one buffer unsynchronized. Ours,
    with ``on_race="raise"``, raises the race naming both writers (JAX 0.11's detector
    sets a flag and goes on, JAX 0.12's raises); both find it."""
    x, w = rand_int(20, (ROWS, 128)), rand_int(21, (8, 128))
    kw = dict(allow_hbm_allocation_in_run_scoped=True, dma_execution_mode=dma, detect_races=True)
    pltpu.reset_tpu_interpret_mode_state()
    with pytest.raises(
        Exception, match=r"data race: write of pl.run_scoped buffer 0 .*core \d.*core \d"
    ) as e:
        params = pltpu.InterpretParams(**kw, on_race="raise")
        jax.block_until_ready(jax.jit(build_racy_hbm(pl, pltpu, slow, params))(x, w))
    assert re.search(r"core 0", str(e.value)) and re.search(r"core 1", str(e.value))
    assert interpret_multi.races.races_found
    pltpu.reset_tpu_interpret_mode_state()
    jpl, jpltpu = jax_namespaces()
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as jax_interp

    _jax_reset()
    try:
        _, o = jax.jit(build_racy_hbm(jpl, jpltpu, slow, _jax_interpret_params(**kw)))(x, w)
    except Exception as e:  # JAX 0.12's interpret mode raises where 0.10 and 0.11 set a flag
        assert "RACE DETECTED" in str(e), e
    else:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(w * w))
        assert jax_interp.races.races_found
    _jax_reset()


@every_way(only=("compiled",))
def test_scoped_hbm_buffer_refused_when_lowered(way):
    """Mosaic allocates scoped buffers in VMEM and SMEM only (JAX's lowering meets the
    same refusal): the error names the kernel's line."""
    way = way.with_params(num_cores=2)
    x = rand_int(30, (ROWS, 128))
    with pytest.raises(
        MosaicCompileError, match=r"(?s)Cannot allocate ref in non-VMEM/SMEM memory space.*memory_space<hbm>"
    ):
        way.jit(build_shared_hbm(*way.modules(), 0, False))(x)


# -- what stays each core's own ---------------------------------------------------------


def build_private(pl_mod, pltpu_mod, space_name, interpret):
    """Core 0 fills a scoped buffer in ``space_name`` and signals core 1, which copies
    its own buffer of that scope out: ``y`` is ``x`` only if the buffer is shared."""
    mesh, core_map = _mesh(pltpu_mod, 2), _core_map(pl_mod)

    def f(x):
        def inner(refs):
            x_ref, y_ref = refs

            @core_map(mesh, interpret=interpret)
            def _():
                def body(buf, sem):
                    @pl_mod.when(lax.axis_index("x") == 0)
                    def _():
                        pltpu_mod.sync_copy(x_ref, buf)
                        pl_mod.semaphore_signal(sem, 1, core_index=1)

                    @pl_mod.when(lax.axis_index("x") == 1)
                    def _():
                        pl_mod.semaphore_wait(sem, 1)
                        pltpu_mod.sync_copy(buf, y_ref)

                space = getattr(pltpu_mod, space_name)
                pl_mod.run_scoped(body, space(x_ref.shape, x_ref.dtype), pltpu_mod.SemaphoreType.REGULAR)

        _, y = pl_mod.run_state(inner)((x, jnp.zeros_like(x)))
        return y

    return f


@pytest.mark.interpret_only(reason="which scoped buffers the interpreter shares between cores")
@pytest.mark.parametrize("space", ["VMEM", "VMEM_SHARED", "HBM"])
def test_which_scoped_buffers_are_shared(space):
    """HBM is one buffer for both cores; VMEM and VMEM_SHARED are each core's own (core 1
    reads its own, never written: uninitialized), as in JAX's interpret mode."""
    x = rand_int(40, (ROWS, 128))
    kw = dict(allow_hbm_allocation_in_run_scoped=True, uninitialized_memory="zero")
    y = jax.jit(build_private(pl, pltpu, space, pltpu.InterpretParams(**kw)))(x)
    want = x if space == "HBM" else jnp.zeros_like(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    jpl, jpltpu = jax_namespaces()
    theirs = jax.jit(build_private(jpl, jpltpu, space, _jax_interpret_params(**kw)))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(theirs))


# -- pl.kernel over two cores; a pallas_call split over two cores -------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_kernel_scratch_semaphore_handshake(dtype):
    """``pl.kernel`` over a two-core mesh: core 1 waits on its scratch semaphore for
    core 0's signal, then each writes its half; ours against jnp and JAX's."""
    x = jax.random.normal(jax.random.key(50), (ROWS, 128), jnp.float32).astype(dtype)

    def build(pl_mod, pltpu_mod, interpret):
        mesh = _mesh(pltpu_mod, 2)

        def body(x_ref, o_ref, vmem, sem):
            c = lax.axis_index("x")

            @pl_mod.when(c == 1)
            def _():
                pl_mod.semaphore_wait(sem, 1)

            part = pl_mod.ds(c * (ROWS // 2), ROWS // 2)
            pltpu_mod.sync_copy(x_ref.at[part], vmem)
            vmem[...] = vmem[...] + (c + 1).astype(dtype)
            pltpu_mod.sync_copy(vmem, o_ref.at[part])

            @pl_mod.when(c == 0)
            def _():
                pl_mod.semaphore_signal(sem, 1, core_index=1)

        return pl_mod.kernel(
            body,
            out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
            mesh=mesh,
            scratch_types=[pltpu_mod.VMEM((ROWS // 2, 128), dtype), pltpu_mod.SemaphoreType.REGULAR],
            interpret=interpret,
        )

    y = jax.jit(build(pl, pltpu, pltpu.InterpretParams()))(x)
    core = (jnp.arange(ROWS) // (ROWS // 2) + 1).astype(dtype)[:, None]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x + core))
    jpl, jpltpu = jax_namespaces()
    theirs = jax.jit(build(jpl, jpltpu, _jax_interpret_params()))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(theirs))


@pytest.mark.interpret_only(reason="InterpretParams(num_cores_or_threads=2)")
def test_pallas_call_on_two_cores_shares_scoped_hbm():
    """A ``pallas_call`` whose parallel axis is split over ``num_cores_or_threads=2``:
    the scoped HBM buffer is one for both cores (core 1 reads what core 0 wrote after
    core 0's signal)."""
    x = rand_int(60, (8, 128))

    def kernel(x_ref, o_ref, sem):
        def body(hbm):
            i = pl.program_id(0)

            @pl.when(i == 0)
            def _():
                pltpu.sync_copy(x_ref, hbm)
                pl.semaphore_signal(sem, 1, core_index=1)

            @pl.when(i == 1)
            def _():
                pl.semaphore_wait(sem, 1)
                pltpu.sync_copy(hbm, o_ref)

        pl.run_scoped(body, pltpu.HBM(x_ref.shape, x_ref.dtype))

    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(2,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.REGULAR],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams(num_cores_or_threads=2, allow_hbm_allocation_in_run_scoped=True),
    )(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


# -- errors -----------------------------------------------------------------------------


@pytest.mark.interpret_only(reason="the interpreter's error message")
def test_scoped_hbm_refused_without_the_option():
    """JAX's ``test_hbm_allocation_in_run_scoped_raises``: our sentence with JAX's words."""
    mesh = _mesh(pltpu, 1)
    x = rand_int(70, (8, 128))

    def inner(refs):
        x_ref, y_ref = refs

        @pl.core_map(mesh, interpret=pltpu.InterpretParams())
        def copy_through_hbm():
            def body(hbm):
                pltpu.sync_copy(x_ref, hbm)
                pltpu.sync_copy(hbm, y_ref)

            pl.run_scoped(body, pltpu.HBM(x_ref.shape, x_ref.dtype))

    with pytest.raises(
        ValueError, match=r"Cannot allocate HBM in `run_scoped`\..*allow_hbm_allocation_in_run_scoped"
    ):
        jax.jit(pl.run_state(inner))((x, jnp.zeros_like(x)))


@pytest.mark.interpret_only(reason="the interpreter's error message")
def test_signal_to_a_core_outside_the_mesh():
    """A ``core_index`` past the mesh's cores names the index and the count."""
    mesh = _mesh(pltpu, 2)
    x = rand_int(80, (8, 128))

    def inner(x_ref):
        @pl.core_map(mesh, interpret=pltpu.InterpretParams())
        def _():
            def body(sem):
                pl.semaphore_signal(sem, 1, core_index=2)
                pl.semaphore_wait(sem, 1)

            pl.run_scoped(body, pltpu.SemaphoreType.REGULAR)

    pltpu.reset_tpu_interpret_mode_state()
    with pytest.raises(Exception, match=r"core_index 2 is outside the 2 cores of a device"):
        jax.block_until_ready(jax.jit(pl.run_state(inner))(x))
    pltpu.reset_tpu_interpret_mode_state()
