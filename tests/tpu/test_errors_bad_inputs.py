"""pallas-tpu's bad inputs that gave a confusing message (or
none) get our usual sentence (the kernel, the user's line, what was expected), the same
in TPU interpret mode and in our Mosaic lowering; what libtpu's compiler accepts, we
accept, and per-generation decisions follow the TPU a lowering compiles for.

* a symbolic dimension in a ``pltpu.VMEM(...)`` scratch shape;
* a semaphore read (or written) as data;
* VMEM and SMEM capacity: ``pl.run_scoped`` buffers count, SMEM is checked, and a
  ``vmem_limit_bytes`` above the chip's VMEM is accepted (libtpu compiles it); each
  generation libtpu offers agrees with libtpu's own verdict, and the refusal names the
  chip compiled for;
* ``pltpu.CompilerParams(has_side_effects="False")``;
* a kernel with ``interpret=pltpu.InterpretParams()`` exported for ``["cpu", "tpu"]``;
* zero-stride writes (the lowering and ``run_mosaic`` too) and zero-stride DMA views;
* ``pltpu.CompilerParams`` without ``interpret=`` on a CPU: the hint names pallas_tpu;
* a caught kernel error leaves nothing on stderr;
* a subclass of JAX's own ``BufferedRef`` given to ``emit_pipeline``.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.compiled

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src import checks
from pallas_tpu._src.mosaic import compile_check

pytestmark = pytest.mark.interpret_only(reason="error paths of interpret mode, the lowering and libtpu")

MiB = 2**20
SDS = jax.ShapeDtypeStruct((8, 128), jnp.float32)
HERE = re.compile(r"test_errors_bad_inputs\.py:\d+")
# Every generation libtpu gives compile-only devices of (compile_check.TOPOLOGIES).
GENERATIONS = tuple(compile_check.TOPOLOGIES)
needs_libtpu = pytest.mark.skipif(
    not compile_check.libtpu_available(), reason='needs libtpu (pip install "jax[tpu]")'
)


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def both_refuse(make, args, exc, pattern):
    """``make(interpret)`` builds the call; TPU interpret mode and the Mosaic lowering
    both refuse it with ``exc`` matching ``pattern``, with one message."""
    with pytest.raises(exc, match=pattern) as interp:
        jax.jit(make(pltpu.InterpretParams())).lower(*args)
    with pytest.raises(exc, match=pattern) as lowering:
        pltpu.mosaic_modules(make(False), *args)
    strip = lambda e: HERE.sub("", str(e.value), count=1)  # noqa: E731
    assert strip(interp) == strip(lowering)
    assert HERE.search(str(interp.value)), str(interp.value)
    return str(interp.value)


# -- a symbolic dimension in a scratch shape -------------------------------------------------------


def test_symbolic_dimension_in_a_vmem_scratch_shape():
    def f(x):
        def kernel(x_ref, o_ref, s_ref):
            o_ref[...] = x_ref[...]

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
            in_specs=[spec], out_specs=spec, scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)],
        )(x)  # fmt: skip

    shape = jax.export.symbolic_shape("8*n, 128")
    with pytest.raises(ValueError) as info:
        jax.export.export(jax.jit(f), platforms=["tpu"])(jax.ShapeDtypeStruct(shape, jnp.float32))
    msg = str(info.value)
    assert HERE.search(msg) and "pltpu.VMEM(...) of shape (8*n, 128)" in msg, msg
    assert "dimension 0 is the symbolic dimension 8*n" in msg and "size it by the block" in msg


# -- semaphores are not data -----------------------------------------------------------------------


def sem_call(kernel, sem_type):
    return lambda interpret: pl.pallas_call(  # noqa: E731
        kernel, out_shape=SDS, scratch_shapes=[sem_type], interpret=interpret
    )


def test_dma_semaphore_read_as_data():
    def read_sem(x_ref, o_ref, sem):
        o_ref[...] = x_ref[...] + sem[0]

    msg = both_refuse(sem_call(read_sem, pltpu.SemaphoreType.DMA((2,))), [SDS], TypeError, "semaphore")
    assert "pallas_call 'read_sem'" in msg and "in the kernel at test_errors_bad_inputs.py:" in msg
    assert "reads the DMA semaphore Ref dma_sem[2] as data" in msg and "pl.semaphore_read" in msg


def test_regular_semaphore_written_as_data_inside_a_loop():
    def write_sem(x_ref, o_ref, sem):
        def body(i, c):
            sem[...] = jnp.int32(i)
            return c

        jax.lax.fori_loop(0, 2, body, 0)
        o_ref[...] = x_ref[...]

    msg = both_refuse(
        sem_call(write_sem, pltpu.SemaphoreType.REGULAR), [SDS], TypeError, "writes the REGULAR"
    )
    assert "pallas_call 'write_sem'" in msg


def test_semaphore_read_keeps_working():
    def signal_read(x_ref, o_ref, sem):
        pl.semaphore_signal(sem, 3)
        o_ref[...] = x_ref[...] + pl.semaphore_read(sem).astype(jnp.float32)
        pl.semaphore_wait(sem, 3)

    x = rand(0, (8, 128))
    out = sem_call(signal_read, pltpu.SemaphoreType.REGULAR)(pltpu.InterpretParams())(x)
    np.testing.assert_allclose(out, x + 3)


# -- VMEM and SMEM capacity --------------------------------------------------------------------------


def copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


def test_run_scoped_buffers_count_against_vmem():
    def scoped(x_ref, o_ref):
        def body(s_ref):
            s_ref[pl.ds(0, 8), :] = x_ref[...]
            o_ref[...] = s_ref[pl.ds(0, 8), :]

        pl.run_scoped(body, pltpu.VMEM((2 * MiB, 128), jnp.float32))  # 1 GiB

    make = lambda interpret: pl.pallas_call(scoped, out_shape=SDS, interpret=interpret)  # noqa: E731
    msg = both_refuse(make, [SDS], ValueError, r"VMEM: the kernel needs 1073750016 bytes")
    assert "1073741824 for pl.run_scoped buffers" in msg and "more than a TPU v5e has (128.0 MiB)" in msg


def test_nested_run_scoped_buffers_add_up_and_siblings_do_not():
    def nested(x_ref, o_ref):
        def outer(a_ref):
            def inner(b_ref):
                o_ref[...] = x_ref[...]

            pl.run_scoped(inner, pltpu.VMEM((8 * 1024, 128), jnp.float32))  # 4 MiB

        for _ in range(3):  # one after another: 8 MiB at most live, not 24
            pl.run_scoped(outer, pltpu.VMEM((8 * 1024, 128), jnp.float32))

    f = pl.pallas_call(nested, out_shape=SDS)
    assert pltpu.mosaic_modules(f, SDS)  # under the v5e's default limit (16 MiB)
    over = pl.pallas_call(
        nested, out_shape=SDS, compiler_params=pltpu.CompilerParams(vmem_limit_bytes=8 * MiB)
    )
    with pytest.raises(ValueError, match=r"and 8388608 for pl.run_scoped buffers \(those live at once\)"):
        pltpu.mosaic_modules(over, SDS)


def test_smem_scratch_over_the_chip():
    def smem_kernel(x_ref, o_ref, s_ref):
        s_ref[0] = 1.0
        o_ref[...] = x_ref[...] + s_ref[0]

    make = lambda interpret: pl.pallas_call(  # noqa: E731
        smem_kernel, out_shape=SDS, scratch_shapes=[pltpu.SMEM((4 * MiB,), jnp.float32)], interpret=interpret
    )
    msg = both_refuse(make, [SDS], ValueError, r"SMEM: the kernel needs 16777216 bytes \(16.0 MiB\) of SMEM")
    assert "pallas_call 'smem_kernel'" in msg and "more than a TPU v5e has (1048576 bytes" in msg


@pytest.mark.parametrize("limit_mib", [256, 1024])
def test_vmem_limit_above_the_chip_is_accepted(limit_mib):
    make = lambda interpret: pl.pallas_call(  # noqa: E731
        copy_kernel, out_shape=SDS, interpret=interpret,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=limit_mib * MiB),
    )  # fmt: skip
    x = rand(1, (8, 128))
    np.testing.assert_allclose(make(pltpu.InterpretParams())(x), x + 1)
    assert pltpu.mosaic_modules(make(False), SDS)
    if compile_check.libtpu_available():  # and libtpu compiles it, for each chip
        for chip in ways.compiled.COMPILE_CHIPS:
            compile_check.compile_for(make(False), [SDS], chip)


def vmem_kernel(block_mib, scratch_mib, limit):
    """A grid of 2 over blocks taking ``block_mib`` MiB of VMEM in all (in and out, two
    buffers each), with ``scratch_mib`` MiB of VMEM scratch and ``vmem_limit_bytes=limit``."""
    rows = block_mib * MiB // 4 // 512

    def kernel(x_ref, o_ref, *scratch):
        acc = x_ref[...] + 1
        if scratch:
            scratch[0][pl.ds(0, 8), :] = x_ref[pl.ds(0, 8), :]
            acc = acc + scratch[0][pl.ds(0, 1), :]  # the scratch is used: Mosaic keeps it
        o_ref[...] = acc

    x = jax.ShapeDtypeStruct((rows * 2, 128), jnp.float32)
    spec = pl.BlockSpec((rows, 128), lambda i: (i, 0))
    f = pl.pallas_call(
        kernel, out_shape=x, grid=(2,), in_specs=[spec], out_specs=spec,
        scratch_shapes=[pltpu.VMEM((scratch_mib * MiB // 512, 128), jnp.float32)] if scratch_mib else [],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=limit) if limit else None,
    )  # fmt: skip
    return f, x


# (block MiB, scratch MiB, vmem_limit_bytes): over the default scoped limit (16 MiB; v6e's 32),
# over the chip's VMEM with a limit above it (v4's 16 MiB), under a limit above the chip's.
VMEM_CASES = {
    "blocks-24": (24, 0, None),
    "scratch-40-limit-1g": (8, 40, 2**30),
    "scratch-4-limit-4m": (4, 4, 4 * MiB),
}


@needs_libtpu
@pytest.mark.parametrize("case", VMEM_CASES)
@pytest.mark.parametrize("chip", GENERATIONS)
def test_vmem_refusals_follow_libtpu(chip, case, monkeypatch):
    """Ours refuses (naming the chip compiled for) exactly where libtpu's compiler refuses."""
    f, x = vmem_kernel(*VMEM_CASES[case])
    try:
        compile_check.compile_for(f, [x], chip)
        ours = None
    except ValueError as e:
        ours = str(e)
    if ours is None:
        return  # libtpu compiled it, with our checks passed
    assert "pallas_call 'kernel'" in ours and "VMEM" in ours
    if "vmem_limit_bytes (" not in ours:
        assert f"TPU {chip}" in ours, ours
    monkeypatch.setattr(checks, "check_vmem", lambda *a, **k: None)
    with pytest.raises(compile_check.MosaicCompileError, match="RESOURCE_EXHAUSTED"):
        compile_check.compile_for(f, [x], chip)  # libtpu refuses it too


@needs_libtpu
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_lowering_for_a_compile_only_device_names_its_chip(chip):
    """jit onto a compile-only device (no abstract mesh, no compile_check): the lowering takes
    the chip's facts from that device, not from the modelled v5e."""
    f, x = vmem_kernel(40, 0, None)  # over both chips' default scoped limits
    device = compile_check.tpu_devices(chip)[0]
    arg = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    with pytest.raises(ValueError, match=f"default scoped VMEM limit of a TPU {chip} "):
        jax.jit(f).lower(arg)


# -- CompilerParams --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["False", 0, None])
def test_has_side_effects_takes_a_bool(value):
    with pytest.raises(
        TypeError, match=f"has_side_effects must be True, False or a pltpu.SideEffectType, got {value!r}"
    ):
        pltpu.CompilerParams(has_side_effects=value)
    with pytest.raises(TypeError, match="use_tc_tiling_on_sc must be True, False or None, got 'no'"):
        pltpu.CompilerParams(use_tc_tiling_on_sc="no")
    with pytest.raises(ValueError, match="vmem_limit_bytes must be a positive int, got True"):
        pltpu.CompilerParams(vmem_limit_bytes=True)


@pytest.mark.parametrize("value", [True, np.bool_(True), pltpu.SideEffectType.SIDE_EFFECTING])
def test_has_side_effects_values_lower(value):
    f = pl.pallas_call(
        copy_kernel, out_shape=SDS, compiler_params=pltpu.CompilerParams(has_side_effects=value)
    )
    text = jax.export.export(jax.jit(f), platforms=["tpu"])(SDS).mlir_module()
    assert "tpu_custom_call" in text


# -- export and interpret mode ---------------------------------------------------------------------


def test_export_for_cpu_and_tpu_in_tpu_interpret_mode():
    f = pl.pallas_call(copy_kernel, out_shape=SDS, interpret=pltpu.InterpretParams())
    with pytest.raises(NotImplementedError) as info:
        jax.export.export(jax.jit(f), platforms=["cpu", "tpu"])(SDS)
    msg = str(info.value)
    assert "pallas_call 'copy_kernel'" in msg and HERE.search(msg), msg
    assert "jax.export for the platforms cpu, tpu" in msg and "host callbacks" in msg
    assert "interpret=True" in msg and "concatenate" not in msg


def test_export_for_cpu_and_tpu_with_interpret_true_runs():
    x = rand(2, (8, 128))
    exported = jax.export.export(
        jax.jit(pl.pallas_call(copy_kernel, out_shape=SDS, interpret=True)), platforms=["cpu", "tpu"]
    )(SDS)
    np.testing.assert_allclose(exported.call(x), x + 1)


def test_tpu_compiler_params_on_a_cpu_hint_names_pallas_tpu():
    f = pl.pallas_call(copy_kernel, out_shape=SDS, compiler_params=pltpu.CompilerParams())
    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU the kernel lowers for it")
    with pytest.raises(ValueError) as info:
        f(rand(3, (8, 128)))
    msg = str(info.value)
    assert "pallas_call 'copy_kernel'" in msg and HERE.search(msg), msg
    assert "interpret=pallas_tpu.InterpretParams()" in msg and "pallas_gpu" not in msg


def test_caught_kernel_error_leaves_stderr_clean(capfd):
    def oob(i_ref, x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(i_ref[0], 8), :]

    f = pl.pallas_call(
        oob, out_shape=SDS, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()],
        interpret=pltpu.InterpretParams(),
    )  # fmt: skip
    capfd.readouterr()
    with pytest.raises(pltpu.KernelError, match=r"in TPU kernel 'oob' .*Out-of-bounds read"):
        f(jnp.array([12], jnp.int32), rand(4, (16, 128)))
    err = capfd.readouterr().err
    assert "jax.debug.callback failed" not in err and "Traceback" not in err, err


# -- zero strides ----------------------------------------------------------------------------------


def test_zero_stride_write_is_refused_by_the_lowering_too():
    def write0(x_ref, o_ref):
        o_ref[pl.ds(0, 8, 0), :] = x_ref[...]

    make = lambda interpret: pl.pallas_call(write0, out_shape=SDS, interpret=interpret)  # noqa: E731
    msg = both_refuse(make, [SDS], NotImplementedError, "a write through pl.ds")
    assert "pallas_call 'write0'" in msg and "in the kernel at test_errors_bad_inputs.py:" in msg


def test_run_mosaic_refuses_a_zero_stride_store():
    def write2(x_ref, o_ref):
        o_ref[...] = jnp.zeros((16, 128), jnp.float32)
        o_ref[pl.ds(0, 8, 2), :] = x_ref[...]

    out = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    text = str(pltpu.mosaic_modules(pl.pallas_call(write2, out_shape=out), SDS)[0])
    # jaxlib 0.12.1 prints the strides as [2, 1], older ones as array<i32: 2, 1>.
    strides = re.search(r"strides = (array<i32: 2, 1>|\[2, 1\])", text)
    assert strides, text
    x = rand(5, (8, 128))
    (ok,) = pltpu.run_mosaic(text, x, out_shape=[out])
    np.testing.assert_array_equal(np.asarray(ok)[::2], x)
    zero = text.replace(strides.group(0), strides.group(0).replace("2, 1", "0, 1"))
    # Mosaic's verifier refuses the module as run_mosaic parses it, or run_mosaic the store.
    with pytest.raises(Exception, match=r"Strides\[0\]=0 must be >= 1|zero stride"):
        pltpu.run_mosaic(zero, x, out_shape=[out])


@pytest.mark.parametrize("side", ["src", "dst"])
def test_zero_stride_dma_view(side):
    def dma(x_hbm, o_hbm, buf, sem):
        zero, one = pl.ds(0, 8, 0), pl.ds(0, 8)
        src, dst = (x_hbm.at[zero], o_hbm.at[one]) if side == "src" else (x_hbm.at[one], o_hbm.at[zero])
        pltpu.sync_copy(src, buf)
        copy = pltpu.make_async_copy(buf, dst, sem)
        copy.start()
        copy.wait()

    make = lambda interpret: pl.pallas_call(  # noqa: E731
        dma, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA], interpret=interpret,
    )  # fmt: skip
    msg = both_refuse(make, [jax.ShapeDtypeStruct((16, 128), jnp.float32)], ValueError, "stride=0")
    assert "in kernel 'dma'" in msg and f"{side}_ref is a view through pl.ds(start, size, stride=0)" in msg
    assert "ZeroDivisionError" not in msg


# -- emit_pipeline and JAX's own BufferedRef ---------------------------------------------------------


def test_jax_buffered_ref_subclass_is_refused_by_name():
    from jax._src.pallas.mosaic import pipeline as jax_pipeline
    from jax.experimental import pallas as jpl

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class GatherRef(jax_pipeline.BufferedRef):
        pass

    def kernel(x_hbm, o_hbm):
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        theirs = jax_pipeline.BufferedRef.create(
            jpl.BlockSpec((8, 128), lambda i: (i, 0)), jnp.float32, jax_pipeline.BufferType.INPUT, 2
        )
        alloc = GatherRef(**{f.name: getattr(theirs, f.name) for f in dataclasses.fields(theirs)})
        ours = pltpu.BufferedRef.output(spec, jnp.float32, 2)
        pipeline = pltpu.emit_pipeline(lambda a, b: None, grid=(2,), in_specs=[spec], out_specs=[spec])
        pl.run_scoped(lambda o: pipeline(x_hbm, o_hbm, allocations=[alloc, o]), ours)

    f = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY),
        interpret=pltpu.InterpretParams(),
    )  # fmt: skip
    with pytest.raises(TypeError) as info:
        jax.jit(f).lower(jax.ShapeDtypeStruct((16, 128), jnp.float32))
    msg = str(info.value)
    assert "allocations[0] is a GatherRef, a subclass of JAX's own BufferedRef" in msg, msg
    assert "Derive the class from pltpu.BufferedRef" in msg
