"""The Mosaic lowering of TPU kernels (no TPU needed).

Every module our lowering builds is parsed back and passes the MLIR verifier
with the tpu dialect registered. Where JAX's own Pallas can lower the same
kernel on a CPU (``jax.export`` for platform tpu with ``debug=True`` prints
its module), the kernel function's signature and attributes
(``iteration_bounds``, ``window_params``, ``dimension_semantics``, ...) and
the index-map functions' signatures are compared with JAX's.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu
from jax.interpreters import mlir
from jaxlib.mlir import ir
from jaxlib.mosaic.python import tpu as tpu_dialect

import pallas as pl
import pallas_tpu as pltpu

ATTRS = ("dimension_semantics", "iteration_bounds", "scalar_prefetch", "scratch_operands", "window_params")


def _parse(text: str) -> ir.Module:
    ctx = mlir.make_ir_context()
    tpu_dialect.register_dialect(ctx)
    with ctx:
        module = ir.Module.parse(text)
        assert module.operation.verify()
    return module


def ours(fn, *args) -> list[ir.Module]:
    """Our modules of ``fn(*args)``, parsed and verified."""
    return [_parse(t) for t in pltpu.mosaic_modules(fn, *args)]


def jax_modules(fn, *args) -> list[ir.Module]:
    """JAX's modules of ``fn`` (which calls JAX's pallas_call with debug=True)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    parts = buf.getvalue().split("The Mosaic module for pallas_call")[1:]
    texts = [p[p.index("\nmodule") :].split("\nThe kernel jaxpr")[0] for p in parts]
    return [_parse(t) for t in texts]


def funcs(module: ir.Module) -> dict:
    return {str(op.attributes["sym_name"]).strip('"'): op for op in module.body.operations}


def structure(module: ir.Module) -> dict:
    """What must match JAX: every function's type, the kernel's attributes."""
    fs = funcs(module)
    kernel = next(iter(fs.values()))
    out = {"kernel": str(kernel.attributes["function_type"])}
    for a in ATTRS:
        out[a] = str(kernel.attributes[a]) if a in kernel.attributes else None
    for name, op in fs.items():
        if name.startswith("transform_"):
            out[name] = str(op.attributes["function_type"])
    return out


def op_counts(module: ir.Module) -> collections.Counter:
    """How often each op occurs, constants aside (the comparison with JAX)."""
    return collections.Counter(o for o in ops(module) if o != "arith.constant")


def ops(module: ir.Module) -> list[str]:
    """Op names in the module, in order (nested regions included)."""
    return re.findall(r"\b((?:arith|math|vector|tpu|memref|scf)\.[a-z_0-9]+)\b", str(module))


def matmul_kernel(P):
    """The kernel written with ``P`` (ours or JAX's Pallas)."""

    def kernel(x_ref, y_ref, o_ref, acc_ref):
        @P.when(P.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @P.when(P.program_id(2) == P.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    kernel.__name__ = "matmul_kernel"
    return kernel


def matmul(P, TP, x, y, **kw):
    return P.pallas_call(
        matmul_kernel(P),
        out_shape=jax.ShapeDtypeStruct((256, 256), jnp.float32),
        grid=(2, 2, 2),
        in_specs=[
            P.BlockSpec((128, 128), lambda i, j, k: (i, k)),
            P.BlockSpec((128, 128), lambda i, j, k: (k, j)),
        ],
        out_specs=P.BlockSpec((128, 128), lambda i, j, k: (i, j)),
        scratch_shapes=[TP.VMEM((128, 128), jnp.float32)],
        compiler_params=TP.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        **kw,
    )(x, y)


def _rand(shape, dtype, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def test_matmul_matches_jax_structure():
    x, y = _rand((256, 256), jnp.bfloat16), _rand((256, 256), jnp.bfloat16, 1)
    [m] = ours(lambda a, b: matmul(pl, pltpu, a, b), x, y)
    [ref] = jax_modules(lambda a, b: matmul(jpl, jpltpu, a, b, debug=True), x, y)
    assert structure(m) == structure(ref)
    assert op_counts(m) == op_counts(ref)
    assert ops(m).count("tpu.matmul") == 1 and ops(m).count("scf.if") == 2
    # jaxlib 0.12.1 prints the numbers without the attribute's name (#tpu.dot_dimension_numbers).
    assert "<[1], [0], [0], [1], [0, 0, 1, 1], [], []>" in str(m)


def test_export_has_tpu_custom_call_with_mosaic_body():
    x, y = _rand((256, 256), jnp.bfloat16), _rand((256, 256), jnp.bfloat16, 1)
    exp = jax.export.export(jax.jit(lambda a, b: matmul(pl, pltpu, a, b)), platforms=["tpu"])(x, y)
    text = exp.mlir_module()
    assert "stablehlo.custom_call @tpu_custom_call" in text
    config = re.search(r'backend_config = "(.*?)"[,}]', text).group(1)
    config = json.loads(re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), config))
    assert config["custom_call_config"]["body"]  # the serialized module
    assert exp.out_avals[0].shape == (256, 256)
    # The kernel's name is the custom call's.
    assert 'kernel_name = "matmul_kernel"' in text


def test_custom_call_aliases_cost_and_side_effects():
    def add_in_place(x_ref, o_ref):
        i = pl.multiple_of(pl.program_id(0) * 8, 8)
        o_ref[pl.ds(i, 8), :] = x_ref[pl.ds(i, 8), :] + 1.0

    def fn(x):
        return pl.pallas_call(
            add_in_place,
            out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
            grid=(2,),
            in_specs=[pl.BlockSpec((16, 128), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((16, 128), lambda i: (0, 0)),
            input_output_aliases={0: 0},
            cost_estimate=pl.CostEstimate(flops=2048, transcendentals=0, bytes_accessed=16384),
            compiler_params=pltpu.CompilerParams(has_side_effects=True, vmem_limit_bytes=1 << 20),
        )(x)

    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(x).mlir_module()
    call = re.search(r"stablehlo.custom_call @tpu_custom_call.*", text).group(0)
    assert (
        "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 0"
        in call
    )
    assert "has_side_effect = true" in call
    config = re.search(r'backend_config = "(.*?)"[,}]', call).group(1)
    config = json.loads(re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), config))
    assert config["custom_call_config"]["cost_estimate"]["flops"] == 2048
    assert config["scoped_memory_configs"][0]["size"] == 1 << 20  # vmem_limit_bytes
    [m] = ours(fn, x)
    assert "tpu.assume_multiple" in str(m)


def test_interpret_mode_still_runs():
    x, y = _rand((256, 256), jnp.float32), _rand((256, 256), jnp.float32, 1)
    out = matmul(pl, pltpu, x, y, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(out, x @ y, rtol=1e-4, atol=1e-3)


def test_debug_prints_jaxpr_and_module(capsys):
    x, y = _rand((256, 256), jnp.bfloat16), _rand((256, 256), jnp.bfloat16, 1)
    jax.export.export(jax.jit(lambda a, b: matmul(pl, pltpu, a, b, debug=True)), platforms=["tpu"])(x, y)
    out = capsys.readouterr().out
    assert "The kernel jaxpr for pallas_call 'matmul_kernel'" in out
    text = out.split("The Mosaic module for pallas_call 'matmul_kernel'")[1]
    _parse(text[text.index("\nmodule") :])
    assert "func.func @matmul_kernel" in text


def test_mosaic_modules_two_kernels_in_order():
    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def call(k, x):
        return pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    def fn(x):
        return call(double, call(add_one, x))

    x = _rand((8, 128), jnp.float32)
    texts = pltpu.mosaic_modules(fn, x)
    assert [re.search(r"func.func @(\w+)", t).group(1) for t in texts] == ["add_one", "double"]
    assert all(isinstance(t, str) for t in texts)
    assert "arith.addf" in texts[0] and "arith.mulf" in texts[1]
    assert pltpu.mosaic_modules(fn, x) == texts  # not hidden by JAX's caches
    for t in texts:
        _parse(t)


# ---------------------------------------------------------------------------
# Values


def _elementwise(dtype, f, n_in=2):
    def kernel(*refs):
        refs[-1][...] = f(*(r[...] for r in refs[:-1]))

    shape = (16, 128)

    def fn(*xs):
        out = jax.eval_shape(f, *xs)
        return pl.pallas_call(kernel, out_shape=out)(*xs)

    xs = [jax.ShapeDtypeStruct(shape, dtype) for _ in range(n_in)]
    return ours(fn, *xs)[0]


@pytest.mark.parametrize(
    "dtype,f,expect",
    [
        (jnp.float32, lambda a, b: a / b, "arith.divf"),
        (jnp.int32, lambda a, b: a // b, "arith.divsi"),
        (jnp.uint32, lambda a, b: a // b, "arith.divui"),
        (jnp.uint32, lambda a, b: jnp.maximum(a, b), "arith.maxui"),
        (jnp.int32, lambda a, b: jnp.minimum(a, b), "arith.minsi"),
        (jnp.bfloat16, lambda a, b: jnp.maximum(a, b), "arith.maximumf"),
        (jnp.float32, lambda a, b: a**b, "math.powf"),
        (jnp.int32, lambda a, b: a << b, "arith.shli"),
        (jnp.uint32, lambda a, b: a >> b, "arith.shrui"),
        (jnp.int32, lambda a, b: a >> b, "arith.shrsi"),
        (jnp.int32, lambda a, b: a ^ b, "arith.xori"),
        (jnp.float32, lambda a, b: jnp.where(a < b, a, b), "arith.select"),
        (jnp.uint32, lambda a, b: (a < b).astype(jnp.int32), "arith.cmpi ult"),
        # negated: Mosaic has no cmpf une
        (jnp.float32, lambda a, b: (a != b).astype(jnp.float32), "arith.cmpf oeq"),
        (jnp.float32, lambda a, b: jnp.arctan2(a, b), "math.atan2"),
    ],
)
def test_binary_ops(dtype, f, expect):
    assert expect in str(_elementwise(dtype, f))


@pytest.mark.parametrize(
    "dtype,f,expect",
    [
        (jnp.float32, jnp.exp, "math.exp"),
        (jnp.float32, jnp.log, "math.log"),
        (jnp.float32, jnp.tanh, "math.tanh"),
        (jnp.float32, lax.rsqrt, "math.rsqrt"),
        (jnp.bfloat16, jnp.sin, "math.sin"),
        (jnp.float32, jax.nn.sigmoid, "math.exp"),
        (jnp.float32, jnp.abs, "math.absf"),
        (jnp.int32, jnp.abs, "math.absi"),
        (jnp.int32, lambda a: -a, "arith.subi"),
        (jnp.float32, lambda a: a**3, "arith.mulf"),
        (jnp.float32, jnp.floor, "math.floor"),
        (jnp.float32, jnp.round, "math.roundeven"),
        (jnp.float32, lambda a: a.astype(jnp.bfloat16), "arith.truncf"),
        (jnp.bfloat16, lambda a: a.astype(jnp.float32), "arith.extf"),
        (jnp.float32, lambda a: a.astype(jnp.int32), "arith.fptosi"),
        (jnp.uint32, lambda a: a.astype(jnp.float32), "arith.uitofp"),
        (jnp.int8, lambda a: a.astype(jnp.int32), "arith.extsi"),
        (jnp.int32, lambda a: a.astype(jnp.int16), "arith.trunci"),
        (jnp.float32, lambda a: lax.bitcast_convert_type(a, jnp.int32), "tpu.bitcast"),  # as JAX, for vectors
        (jnp.float32, lambda a: jnp.clip(a, -1.0, 1.0), "arith.minimumf"),
        (jnp.int32, lambda a: ~a, "arith.xori"),
        (jnp.float32, jnp.sign, "tpu.bitcast"),  # 1.0 with x's sign bit: Mosaic has no copysign
    ],
)
def test_unary_ops_and_casts(dtype, f, expect):
    assert expect in str(_elementwise(dtype, f, n_in=1))


def test_shapes_reductions_iota():
    def f(x):
        row = jnp.sum(x, axis=0, keepdims=True)  # (1, 128)
        col = jnp.max(x, axis=1, keepdims=True)  # (16, 1)
        io = lax.broadcasted_iota(jnp.int32, (16, 128), 1).astype(jnp.float32)
        t = jnp.swapaxes(x.reshape(16, 8, 16), 1, 2).reshape(16, 128)
        return row + col + io + t + jnp.min(x)

    s = str(_elementwise(jnp.float32, f, n_in=1))
    for op in ("vector.multi_reduction <add>", "<maximumf>", "<minimumf>", "tpu.iota", "vector.broadcast"):
        assert op in s
    assert "tpu.transpose" in s and "vector.shape_cast" in s


def test_dot_transposed_rhs():
    def f(a, b):
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def kernel(a, b, o):
        o[...] = f(a[...], b[...])

    fn = lambda a, b: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32))(a, b)
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    [m] = ours(fn, x, x)
    assert "<[1], [1], [0], [0], [0, 0, 1, 0], [], []>" in str(m)  # with or without the name


# ---------------------------------------------------------------------------
# Memory, grid and control flow, compared with JAX where it lowers on a CPU


def dyn_kernel(P):
    """The kernel written with ``P`` (ours or JAX's Pallas)."""

    def kernel(x_ref, o_ref):
        i = P.program_id(0)
        v = x_ref[P.ds(i * 8, 8), :]
        o_ref[...] = v + x_ref[1][None, :]

    kernel.__name__ = "dyn_kernel"
    return kernel


def dyn(P, TP, x, **kw):
    return P.pallas_call(
        dyn_kernel(P),
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid=(2,),
        in_specs=[P.BlockSpec((16, 128), lambda i: (0, 0))],
        out_specs=P.BlockSpec((8, 128), lambda i: (i, 0)),
        **kw,
    )(x)


def test_dynamic_slices_match_jax():
    x = _rand((16, 128), jnp.float32)
    [m] = ours(lambda a: dyn(pl, pltpu, a), x)
    [ref] = jax_modules(lambda a: dyn(jpl, jpltpu, a, debug=True), x)
    assert structure(m) == structure(ref)
    assert op_counts(m) == op_counts(ref)
    s = str(m)
    assert "arith.index_cast" in s and "vector.load" in s and "tpu.vector_store" in s


def element_call(P, TP, x, **kw):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    return P.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32),
        grid=(4,),
        in_specs=[P.BlockSpec((P.Element(8, (0, 8)), P.Element(128)), lambda i: (i * 8, 0))],
        out_specs=P.BlockSpec((8, 128), lambda i: (i, 0)),
        **kw,
    )(x)


def test_element_windows_match_jax():
    x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    [m] = ours(lambda a: element_call(pl, pltpu, a), x)
    [ref] = jax_modules(lambda a: element_call(jpl, jpltpu, a, debug=True), x)
    assert structure(m) == structure(ref)
    assert "#tpu.element_window<[0, 0], [8, 0]>" in structure(m)["window_params"]


def test_element_mixed_with_blocked_is_an_error():
    def mixed(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    msg = _lowering_error(
        mixed,
        (32, 128),
        grid=(4,),
        in_specs=[pl.BlockSpec((pl.Element(8), 128), lambda i: (i * 8, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
    )
    assert "in_specs[0]" in msg and "all pl.Element" in msg


def prefetch_kernel(P):
    """The kernel written with ``P`` (ours or JAX's Pallas)."""

    def kernel(idx_ref, x_ref, o_ref, s_ref, sem):
        s_ref[0] = idx_ref[P.program_id(0)] + 1
        o_ref[...] = x_ref[...] * s_ref[0].astype(jnp.float32)
        P.semaphore_signal(sem, 1)
        P.semaphore_wait(sem, 1)

        def body(i, c):
            return c + x_ref[...]

        o_ref[...] += lax.fori_loop(0, 3, body, jnp.zeros((8, 128)))
        n = lax.while_loop(lambda v: v < 10, lambda v: v + s_ref[0], 0)
        o_ref[0:8, :] += n.astype(jnp.float32)

    kernel.__name__ = "prefetch_kernel"
    return kernel


def prefetch(P, TP, idx, x, **kw):
    return P.pallas_call(
        prefetch_kernel(P),
        out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid_spec=TP.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(2,),
            in_specs=[P.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
            out_specs=P.BlockSpec((8, 128), lambda i, idx: (i, 0)),
            scratch_shapes=[TP.SMEM((1,), jnp.int32), TP.SemaphoreType.REGULAR],
        ),
        **kw,
    )(idx, x)


def test_scalar_prefetch_smem_semaphores_loops_match_jax():
    idx, x = jnp.array([1, 0], jnp.int32), _rand((16, 128), jnp.float32)
    [m] = ours(lambda i, a: prefetch(pl, pltpu, i, a), idx, x)
    [ref] = jax_modules(lambda i, a: prefetch(jpl, jpltpu, i, a, debug=True), idx, x)
    assert structure(m) == structure(ref)
    assert op_counts(m) == op_counts(ref)
    s = ops(m)
    for op in ("memref.load", "memref.store", "tpu.sem_signal", "tpu.sem_wait", "scf.for", "scf.while"):
        assert op in s
    # the index map reads the prefetched indices from SMEM
    assert "memref.load" in str(funcs(m)["transform_0"])


def test_cond_switch_three_branches():
    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        o_ref[...] = lax.switch(i, [lambda v: v, lambda v: v * 2.0, lambda v: v + 1.0], x_ref[...])

    fn = lambda x: pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(3,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
    )(x)
    [m] = ours(fn, jax.ShapeDtypeStruct((8, 128), jnp.float32))
    assert ops(m).count("scf.if") == 2


# JAX 0.12 waits for DMAs with tpu.wait_dma, JAX 0.11 with tpu.wait_dma2; we follow.
WAIT_DMA = "tpu.wait_dma" if jax.__version_info__ >= (0, 12) else "tpu.wait_dma2"

# JAX's lowering asks the device for its TPU generation for DMAs: name one.
TPU_V5E = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
)


def dma_call(P, TP, x, **kw):
    def kernel(x_hbm, o_ref, buf, sem):
        c = TP.make_async_copy(x_hbm.at[P.ds(0, 8)], buf, sem)
        c.start()
        c.wait()

        def inner(sems, tmp):
            copy = TP.make_async_copy(x_hbm.at[P.ds(8, 8)], tmp, sems.at[1])
            copy.start()
            copy.wait()
            return tmp[0, 0]

        z = P.run_scoped(inner, TP.SemaphoreType.DMA((2,)), TP.VMEM((8, 128), jnp.float32))
        o_ref[...] = buf[...] * z + TP.roll(buf[...], 3, 1)

    return P.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[P.BlockSpec(memory_space=P.ANY)],
        scratch_shapes=[TP.VMEM((8, 128), jnp.float32), TP.SemaphoreType.DMA],
        **kw,
    )(x)


def test_dma_run_scoped_semaphores_match_jax():
    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    [m] = ours(lambda a: dma_call(pl, pltpu, a), x)
    with jax.sharding.use_abstract_mesh(TPU_V5E):
        [ref] = jax_modules(lambda a: dma_call(jpl, jpltpu, a, debug=True), x)
    assert structure(m) == structure(ref)
    assert op_counts(m) == op_counts(ref)
    s = ops(m)
    for op in ("tpu.enqueue_dma", WAIT_DMA, "tpu.sem_alloc", "memref.alloca", "tpu.region"):
        assert op in s, op
    assert s.count("tpu.memref_slice") >= 3 and "tpu.dynamic_rotate" in s
    kernel_type = str(funcs(m)["kernel"].attributes["function_type"])
    assert "#tpu.memory_space<any>" in kernel_type and "!tpu.dma_semaphore" in kernel_type


def test_remote_dma_and_signal_in_shard_map():
    from jax.sharding import PartitionSpec as PS

    mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices("cpu")[:4])

    def kernel(x_ref, o_ref, send_sem, recv_sem, sem):
        me = lax.axis_index("y")
        right = lax.rem(me + 1, 2)
        c = pltpu.make_async_remote_copy(x_ref, o_ref, send_sem, recv_sem, device_id={"y": right})
        c.start()
        c.wait()
        pl.semaphore_signal(sem, 1, device_id=(0, right))
        pl.semaphore_signal(sem, 1, device_id=3, device_id_type=pl.DeviceIdType.LOGICAL)
        pl.semaphore_wait(sem, 2)

    def per_shard(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.REGULAR],
        )(x)

    f = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=PS(("x", "y")), out_specs=PS(("x", "y"))))
    x = jax.device_put(jnp.zeros((32, 128)), jax.NamedSharding(mesh, PS(("x", "y"))))
    [m] = ours(f, x)
    s = str(m)
    # axis_index('y') = device_id % 2; {"y": right} keeps this device's x: x * 2 + right
    assert "tpu.device_id" in s and "arith.divsi" in s and "arith.remsi" in s
    assert re.search(r"tpu.enqueue_dma .*source_semaphore.*target_semaphore.*device_id", s)
    waits = re.findall(WAIT_DMA + r" .*", s)
    assert len(waits) == 2
    if WAIT_DMA == "tpu.wait_dma2":
        assert "core_id" in waits[0]  # wait_send: device 0, core 0
    else:
        assert "wait_target = false" in waits[0] and "device_id" in waits[0]
    assert len(re.findall(r"tpu.sem_signal .* device_id", s)) == 2


def test_remote_dma_outside_shard_map_is_an_error():
    def ring(x_ref, o_ref, sem):
        pl.semaphore_signal(sem, 1, device_id=(1,))
        o_ref[...] = x_ref[...]

    msg = _lowering_error(ring, (8, 128), scratch_shapes=[pltpu.SemaphoreType.REGULAR])
    assert "not lowered inside jax.shard_map" in msg and "pallas_call 'ring'" in msg
    assert "Cannot use communication in pallas_call without shard_map." in msg  # JAX's words


# ---------------------------------------------------------------------------
# Errors


def _lowering_error(kernel, *shapes, out=(8, 128), **kw):
    fn = lambda *xs: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out, jnp.float32), **kw)(*xs)
    with pytest.raises(pltpu.LoweringException) as e:
        pltpu.mosaic_modules(fn, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    return str(e.value)


def test_unsupported_primitive_names_it_the_kernel_and_line():
    def my_igamma_kernel(x_ref, o_ref):
        o_ref[...] = lax.igamma(x_ref[...], x_ref[...])  # the line

    msg = _lowering_error(my_igamma_kernel, (8, 128))
    assert "primitive 'igamma'" in msg
    assert "pallas_call 'my_igamma_kernel'" in msg
    assert re.search(r"test_lowering.py:\d+", msg)
    assert "no Mosaic lowering" in msg


def test_error_inside_rule_names_the_line():
    def unsigned_dot(x_ref, o_ref):
        x = x_ref[...].astype(jnp.uint32)
        ones = jnp.ones((128, 128), jnp.uint32)
        o_ref[...] = jnp.dot(x, ones, preferred_element_type=jnp.uint32).astype(jnp.float32)

    msg = _lowering_error(unsigned_dot, (8, 128))
    assert "dot_general of unsigned integers" in msg and "lowering 'dot_general'" in msg, msg
    assert "test_lowering.py:" in msg


def test_dimension_semantics_rank_mismatch():
    def k(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    msg = _lowering_error(
        k,
        (8, 128),
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    )
    assert "dimension_semantics has 2 entries for a grid of rank 1" in msg


# ---------------------------------------------------------------------------
# TPU ops with side effects, PRNG, named grids


def _one_kernel(kernel, *shapes, out=(8, 128), **kw):
    fn = lambda *xs: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out, jnp.float32), **kw)(*xs)
    [m] = ours(fn, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    return m


def test_prng_delay_debug_print():
    def kernel(o_ref):
        pltpu.prng_seed(pl.program_id(0), 7)
        bits = pltpu.prng_random_bits((8, 128))
        pl.delay(100)
        pl.debug_print("step {} of {}", pl.program_id(0), 2)
        pl.debug_print("no placeholders")
        o_ref[...] = bits.astype(jnp.float32)

    m = _one_kernel(kernel, grid=(2,), out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)))
    s = str(m)
    assert "tpu.prng_set_seed_32" in s and "tpu.prng_random_bits" in s and "tpu.delay" in s
    assert 'tpu.log %arg0, %c2_i32 {formatted = true, tag = "step $s0 of $s1"}' in s or "step $s0 of $s1" in s
    assert "no placeholders" in s


def test_debug_print_of_an_array():
    def print_array(x_ref, o_ref):
        pl.debug_print("x: {}", x_ref[...])
        o_ref[...] = x_ref[...]

    s = str(_one_kernel(print_array, (8, 128)))
    assert "tpu.log_buffer" in s and '"x: "' in s and "memref.alloca" in s


def test_debug_print_of_two_arrays_is_an_error():
    def print_arrays(x_ref, o_ref):
        pl.debug_print("x: {} {}", x_ref[...], x_ref[...])
        o_ref[...] = x_ref[...]

    msg = _lowering_error(print_arrays, (8, 128))
    assert "lowering 'debug_print'" in msg and "one array with a format ending in {}" in msg


def test_concatenate_bool_reductions_bitcast():
    def kernel(x_ref, o_ref):
        x = x_ref[...]
        both = jnp.concatenate([x[:, :64], x[:, 64:]], axis=1)
        anyp = jnp.any(x > 0, axis=0, keepdims=True)
        allp = jnp.all(x > -10, axis=1, keepdims=True)
        bits = pltpu.bitcast(x, jnp.int32)
        o_ref[...] = both + anyp.astype(jnp.float32) + allp.astype(jnp.float32) + bits.astype(jnp.float32)

    s = ops(_one_kernel(kernel, (8, 128)))
    assert "tpu.concatenate" in s and "tpu.bitcast" in s
    assert s.count("vector.multi_reduction") == 2


def test_named_grid_and_barrier_semaphore():
    mesh = pltpu.TensorCoreMesh(axis_name="core", num_cores=2)

    @pl.kernel(
        out_type=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        mesh=mesh,
        compiler_params=pltpu.CompilerParams(collective_id=0),
    )
    def body(x_hbm, o_hbm):
        c = lax.axis_index("core")
        sem = pltpu.get_barrier_semaphore()
        pl.semaphore_signal(sem, 1)
        pl.semaphore_wait(sem, 1)
        pltpu.sync_copy(x_hbm.at[pl.ds(c * 8, 8)], o_hbm.at[pl.ds(c * 8, 8)])

    [m] = ours(body, jax.ShapeDtypeStruct((16, 128), jnp.float32))
    k = funcs(m)["body"]
    # "parallel", as JAX marks a TensorCoreMesh's axis (Mosaic refuses "core_parallel" with
    # more steps than a one-core chip's cores)
    assert str(k.attributes["dimension_semantics"]) == "[#tpu.dimension_semantics<parallel>]"
    assert str(k.attributes["window_params"]) == "[{}, {}]"  # whole arrays in HBM
    assert "tpu.sem_barrier" in str(m) and "tpu.enqueue_dma" in str(m)


def test_barrier_semaphore_without_collective_id():
    def uses_barrier(x_ref, o_ref):
        pl.semaphore_signal(pltpu.get_barrier_semaphore(), 1)
        o_ref[...] = x_ref[...]

    msg = _lowering_error(uses_barrier, (8, 128))
    assert "pallas_call 'uses_barrier'" in msg and "pltpu.CompilerParams(collective_id=<int>)" in msg


def test_einshape_reciprocal_trace_value_touch():
    def kernel(x_ref, o_ref):
        x = x_ref[...]
        pltpu.trace_value("x00", x[0, 0])
        pltpu.touch(o_ref)
        y = pltpu.reciprocal(x, approx=True)
        o_ref[...] = pltpu.einshape("a(bc)->(ba)c", y, b=2)  # (8, 128) -> (16, 64)

    m = _one_kernel(kernel, (8, 128), out=(16, 64))
    s = ops(m)
    assert "tpu.reciprocal" in s and "tpu.trace_value" in s and "tpu.transpose" in s
    assert '"x00"' in str(m)


def _k_unsigned_dot(x_ref, o_ref):
    x = x_ref[...].astype(jnp.uint32)
    o_ref[...] = jnp.dot(x, jnp.ones((128, 128), jnp.uint32), preferred_element_type=jnp.uint32).astype(
        jnp.float32
    )


def _k_wait_no_decrement(x_ref, o_ref, sem):
    pl.semaphore_wait(sem, 1, decrement=False)
    o_ref[...] = x_ref[...]


def _k_dma_add(x_ref, o_ref, buf, sem):
    pltpu.async_copy(x_ref, buf, sem, add=True).wait()
    o_ref[...] = buf[...]


def _k_strided_view(x_ref, o_ref, buf, sem):
    pltpu.async_copy(x_ref.at[pl.ds(0, 8, stride=2)], buf, sem).wait()
    o_ref[...] = buf[...]


def _k_scatter(x_ref, o_ref):
    o_ref[lax.broadcasted_iota(jnp.int32, (8, 128), 0)[:, 0]] = x_ref[...]


def _k_print_f16(x_ref, o_ref):
    pl.debug_print("v={}", x_ref[0, 0].astype(jnp.float16))
    o_ref[...] = x_ref[...]


VMEM_DMA = dict(scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA])


@pytest.mark.parametrize(
    "kernel,kw,shape,expect",
    [
        (_k_unsigned_dot, {}, (8, 128), "dot_general of unsigned integers"),
        (
            _k_wait_no_decrement,
            dict(scratch_shapes=[pltpu.SemaphoreType.REGULAR]),
            (8, 128),
            "decrement=False",
        ),
        (_k_dma_add, VMEM_DMA, (8, 128), "add=True"),
        (_k_strided_view, VMEM_DMA, (16, 128), "strided views"),
        (_k_scatter, {}, (8, 128), "through an array index (a scatter"),
        (_k_print_f16, {}, (8, 128), "32-bit ints and floats"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_unsupported_forms_are_errors(kernel, kw, shape, expect):
    msg = _lowering_error(kernel, shape, **kw)
    assert expect in msg, msg
    assert f"pallas_call '{kernel.__name__}'" in msg and "test_lowering.py:" in msg


def test_argmax_argmin():
    def kernel(x_ref, o_ref):
        x = x_ref[...]
        am = jnp.argmax(x, axis=1).astype(jnp.float32)  # (8,)
        an = jnp.argmin(x, axis=0).astype(jnp.float32)  # (128,)
        o_ref[...] = am[:, None] + an[None, :]

    s = str(_one_kernel(kernel, (8, 128)))
    # jaxlib 0.12.1 prints the kind bare (``kind = arg_max``), older jaxlibs as the attribute.
    for kind in ("arg_max", "arg_min"):
        assert re.search(rf"tpu.reduce_index .*kind = (#tpu.reduction_kind<)?{kind}\b", s), s


def dynamic_grid_call(P, TP, n, s, x, **kw):
    """A grid of (n, 2) with n traced, scalar prefetch and an aliased output."""

    def kernel(s_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + (P.num_programs(0) * 10 + P.program_id(1) + s_ref[0]).astype(
            jnp.float32
        )

    gs = TP.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n, 2),
        in_specs=[P.BlockSpec((8, 128), lambda i, j, s: (i, j))],
        out_specs=P.BlockSpec((8, 128), lambda i, j, s: (i, j)),
    )
    return P.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=gs,
        input_output_aliases={1: 0},
        **kw,
    )(s, x)


def test_dynamic_grid_matches_jax():
    n, s, x = jnp.int32(3), jnp.array([7], jnp.int32), _rand((32, 256), jnp.float32)
    [m] = ours(lambda n, s, x: dynamic_grid_call(pl, pltpu, n, s, x), n, s, x)
    [ref] = jax_modules(lambda n, s, x: dynamic_grid_call(jpl, jpltpu, n, s, x, debug=True), n, s, x)
    assert structure(m) == structure(ref)
    assert op_counts(m) == op_counts(ref)
    assert "iteration_bounds = array<i64: -9223372036854775808, 2>" in str(m)
    assert ops(m).count("tpu.iteration_bound") == 1
    # The custom call takes the traced size first; the alias points past it.
    hlo = jax.export.export(
        jax.jit(lambda n, s, x: dynamic_grid_call(pl, pltpu, n, s, x)), platforms=["tpu"]
    )(n, s, x).mlir_module()
    call = re.search(r"stablehlo.custom_call @tpu_custom_call\(([^)]*)\)", hlo)
    assert call and len(call.group(1).split(",")) == 3, hlo
    assert "operand_index = 2" in hlo, hlo


def test_aliases_count_scalar_prefetch_operands():
    """The custom call's operand alias counts the scalar-prefetch operands (as JAX's)."""

    def call(P, TP, s, x):
        gs = TP.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(4,),
            in_specs=[P.BlockSpec((8, 128), lambda i, s: (i, 0))],
            out_specs=P.BlockSpec((8, 128), lambda i, s: (i, 0)),
        )
        kernel = lambda s_ref, x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] + s_ref[0].astype(jnp.float32))  # noqa: E731
        return P.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid_spec=gs,
            input_output_aliases={1: 0},
        )(s, x)

    s, x = jnp.array([3], jnp.int32), _rand((32, 128), jnp.float32)
    found = []
    for P, TP in ((pl, pltpu), (jpl, jpltpu)):
        hlo = jax.export.export(jax.jit(lambda s, x: call(P, TP, s, x)), platforms=["tpu"])(
            s, x
        ).mlir_module()
        found.append(re.findall(r"operand_index = \d+", hlo))
    assert found[0] == found[1] == ["operand_index = 1"], found
