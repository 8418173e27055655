"""``pallas_tpu.ops.all_gather`` on a mesh of four CPU devices (``tests/conftest.py``),
every device's copy of the result against the input (the gather of fresh random data
is the data), and against JAX's op of the same name (JAX's TPU interpret mode), every
way of an op (tests/ways' ``every_way(op=True)``; the op takes its mesh, so ``gather``
runs each way here):

* ``tpu_interpret``: our multi-device TPU interpret mode, inside the op's ``shard_map``;
* ``mosaic``: the op exported for a mesh of TPU v5e devices, its Mosaic module run by
  ``run_mosaic`` on every device at once (remote DMAs and semaphores between them);
* ``compiled``: the op compiled by libtpu for a mesh of compile-only TPUs of each chip
  of ``ways.compiled.COMPILE_CHIPS`` (four devices of their 2x2 topologies: ``ways.compile_op``),
  then run as ``mosaic``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.chip
import ways.compare
import ways.compiled
import ways.mosaic
from jax import export
from jax.sharding import PartitionSpec as P
from ways import Way, compile_op, every_way

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.executor import run as executor
from pallas_tpu._src.interpret import multi as interpret_multi
from pallas_tpu._src.mosaic import compile_check
from pallas_tpu.ops import all_gather as ag

pytestmark = ways.chip.needs_devices(4)
NAMES = ("x", "y")


@pytest.fixture(autouse=True)
def _fresh_state(fresh_sessions):
    yield


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def cpu_mesh(shape):
    n = math.prod(shape)
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]).reshape(shape), NAMES[: len(shape)])


def ring_positions(mesh_shape, axes):
    """Each device's (row-major mesh order) position on the ring over ``axes``."""
    sizes = dict(zip(NAMES, mesh_shape))
    out = []
    for d in range(math.prod(mesh_shape)):
        coords = dict(zip(NAMES, np.unravel_index(d, mesh_shape)))
        pos = 0
        for a in axes:
            pos = pos * sizes[a] + int(coords[a])
        out.append(pos)
    return out


def gather_mosaic(x, mesh_shape, axis_name, memory_space, compiled):
    """Every device's result, from the op's Mosaic module run by ``run_mosaic``."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    names = NAMES[: len(mesh_shape)]
    for chip in ways.compiled.COMPILE_CHIPS if compiled else ():
        devices = np.array(compile_check.tpu_devices(chip)[: math.prod(mesh_shape)]).reshape(mesh_shape)
        mesh = jax.sharding.Mesh(devices, names)
        placed = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, P(axes)))
        compile_op(
            lambda a, mesh=mesh: ag.all_gather(a, mesh=mesh, axis_name=axis_name, memory_space=memory_space),
            [placed],
            chips=(chip,),
        )
    mesh = jax.sharding.AbstractMesh(
        mesh_shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(names),
        abstract_device=ways.mosaic.TPU_V5E.abstract_device,
    )
    with jax.sharding.use_abstract_mesh(mesh):
        text = export.export(
            jax.jit(lambda a: ag.all_gather(a, mesh=mesh, axis_name=axis_name, memory_space=memory_space)),
            platforms=["tpu"],
        )(x).mlir_module()
    (body,) = executor.custom_call_bodies(text)
    n = math.prod(dict(zip(names, mesh_shape))[a] for a in axes)
    shard = (x.shape[0] // n, *x.shape[1:])
    kernel_shard = shard if len(shard) >= 2 else (1, *shard)
    shards = np.asarray(x).reshape(n, *kernel_shard)
    operands = np.stack([shards[p] for p in ring_positions(mesh_shape, axes)]).reshape(
        *mesh_shape, *kernel_shard
    )
    out = pltpu.run_mosaic(
        body, operands, out_shape=jax.ShapeDtypeStruct((n, *kernel_shard), x.dtype), mesh_shape=mesh_shape
    )
    return list(np.asarray(out).reshape(-1, *x.shape))


def gather(x, way, mesh_shape=(4,), axis_name="x", memory_space=pltpu.VMEM):
    """Every device's copy of ``all_gather(x)`` run the ``way`` way (a ``ways.Way``)."""
    if way.name == "tpu_interpret":
        mesh = cpu_mesh(mesh_shape)
        with pltpu.force_tpu_interpret_mode(way.interpret()):
            out = ag.all_gather(x, mesh=mesh, axis_name=axis_name, memory_space=memory_space)
        assert out.sharding.is_fully_replicated
        return [np.asarray(s.data) for s in out.addressable_shards]
    return gather_mosaic(x, mesh_shape, axis_name, memory_space, compiled=way.name == "compiled")


def check_every_copy(copies, x, devices):
    assert len(copies) == devices
    for copy in copies:
        ways.compare.equal(copy, x)


# (x shape, dtype, memory space): VMEM shards of f32 and bf16 rows, HBM (pl.ANY) shards,
# an odd shard (3 rows: JAX's op needs an even one), a 1-d array, a 3-d one.
CASES = {
    "f32": ((32, 128), jnp.float32, pltpu.VMEM),
    "bf16": ((64, 256), jnp.bfloat16, pltpu.VMEM),
    "hbm": ((16, 8, 128), jnp.float32, pl.ANY),
    "odd_shard": ((12, 128), jnp.float32, pltpu.VMEM),
    "1d": ((1024,), jnp.int32, pltpu.VMEM),
}


@pytest.mark.parametrize("case", CASES)
@every_way(op=True)
def test_all_gather_four_devices(way, case):
    shape, dtype, memory_space = CASES[case]
    x = (
        rand(len(shape) + 3, shape, dtype)
        if dtype != jnp.int32
        else jax.random.randint(jax.random.key(5), shape, -(2**31), 2**31 - 1, jnp.int32)
    )
    check_every_copy(gather(x, way, memory_space=memory_space), x, 4)


@pytest.mark.parametrize(
    "axis_name", ["y", ("x", "y"), ("y", "x")], ids=["one_axis", "both", "both_reversed"]
)
@every_way(op=True)
def test_all_gather_on_a_2d_mesh(way, axis_name):
    """On a (2, 2) mesh: over one axis (a ring per row, the other axis keeps its own
    coordinate) and over both axes in either order (one ring of four)."""
    x = rand(11, (16, 128))
    check_every_copy(gather(x, way, mesh_shape=(2, 2), axis_name=axis_name), x, 4)


@pytest.mark.parametrize("devices", [2, 3])
@every_way(op=True)
def test_all_gather_rings_of_two_and_three(way, devices):
    """Two devices (one hop, one direction) and three (one hop each way)."""
    x = rand(devices, (devices * 8, 128))
    check_every_copy(gather(x, way, mesh_shape=(devices,)), x, devices)


def test_all_gather_matches_jax_op():
    """JAX's op (in its TPU interpret mode, DMAs eager) and ours on the same sharded input."""
    from jax.experimental.pallas import tpu as jax_pltpu
    from jax.experimental.pallas.ops.tpu import all_gather as jax_ag

    x = rand(21, (32, 256))
    mesh = cpu_mesh((4,))
    with jax_pltpu.force_tpu_interpret_mode(jax_pltpu.InterpretParams(dma_execution_mode="eager")):
        theirs = jax_ag.all_gather(x, mesh=mesh, axis_name="x")
    ours = gather(x, Way("tpu_interpret"))
    check_every_copy(ours, np.asarray(theirs), 4)
    assert {"all_gather", "ag_kernel", "get_neighbor"} <= set(dir(ag))


@pytest.mark.interpret_only(reason="race detection")
def test_all_gather_is_race_free():
    x = rand(22, (32, 128))
    check_every_copy(gather(x, Way("tpu_interpret").with_params(detect_races=True)), x, 4)
    assert not interpret_multi.races.races_found


def test_one_device_returns_x():
    x = rand(23, (8, 128))
    np.testing.assert_array_equal(ag.all_gather(x, mesh=cpu_mesh((1,)), axis_name="x"), x)


def test_jitted_as_jax_op():
    """A ``jax.jit`` as JAX's op: ``.lower`` (and ``.trace``) with the mesh and axes static."""
    x = rand(24, (8, 128))
    lowered = ag.all_gather.lower(x, mesh=cpu_mesh((1,)), axis_name="x")
    assert "func" in lowered.as_text()


def test_get_neighbor():
    """Ring neighbours as mesh coordinates, on a (2, 2) mesh over ('x', 'y')."""
    mesh = cpu_mesh((2, 2))

    def neighbours(_):
        me = jax.lax.axis_index("x") * 2 + jax.lax.axis_index("y")
        right = ag.get_neighbor(me, mesh, ("x", "y"), direction="right")
        left = ag.get_neighbor(me, mesh, ("x", "y"), direction="left")
        return jnp.stack([jnp.asarray(c) for c in (*right, *left)]).reshape(1, 4)

    out = jax.shard_map(neighbours, mesh=mesh, in_specs=P(("x", "y")), out_specs=P(("x", "y")))(jnp.zeros(4))
    # device (i, j) at ring position 2i + j: right is position + 1, left position - 1 (mod 4)
    expected = [[(p + 1) % 4 // 2, (p + 1) % 4 % 2, (p - 1) % 4 // 2, (p - 1) % 4 % 2] for p in range(4)]
    np.testing.assert_array_equal(np.asarray(out), expected)


def bad_calls():
    mesh = cpu_mesh((4,))
    x = jnp.ones((32, 128))
    big = jax.ShapeDtypeStruct((4 * 2048, 8192), jnp.float32)  # 4 x 64 MiB shards: not in VMEM
    return {
        "axis not in mesh": (
            lambda: ag.all_gather(x, mesh=mesh, axis_name="z"),
            ValueError,
            "'z' is not an axis",
        ),
        "axis twice": (
            lambda: ag.all_gather(x, mesh=mesh, axis_name=("x", "x")),
            ValueError,
            "names an axis twice",
        ),
        "axis not a name": (
            lambda: ag.all_gather(x, mesh=mesh, axis_name=(0,)),
            ValueError,
            "mesh axis name",
        ),
        "leading dim": (
            lambda: ag.all_gather(jnp.ones((30, 128)), mesh=mesh, axis_name="x"),
            ValueError,
            r"x.shape\[0\]=30 must be divisible by the 4 devices",
        ),
        "scalar": (
            lambda: ag.all_gather(jnp.float32(1), mesh=mesh, axis_name="x"),
            ValueError,
            "got a scalar",
        ),
        "memory space": (
            lambda: ag.all_gather(x, mesh=mesh, axis_name="x", memory_space=pltpu.SMEM),
            ValueError,
            "memory_space must be pltpu.VMEM",
        ),
        "mesh": (
            lambda: ag.all_gather(x, mesh=("x",), axis_name="x"),
            TypeError,
            "must be a jax.sharding.Mesh",
        ),
        "too big for VMEM": (
            lambda: jax.eval_shape(lambda a: ag.all_gather(a, mesh=mesh, axis_name="x"), big),
            ValueError,
            "pass memory_space=pl.ANY",
        ),
        "direction": (
            lambda: ag.get_neighbor(0, mesh, "x", direction="up"),
            ValueError,
            "direction must be 'left' or 'right'",
        ),
    }


BAD = (
    "axis not in mesh",
    "axis twice",
    "axis not a name",
    "leading dim",
    "scalar",
    "memory space",
    "mesh",
    "too big for VMEM",
    "direction",
)


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments(case):
    call, error, message = bad_calls()[case]
    with pytest.raises(error, match=message):
        call()


def test_hbm_gather_of_any_size_traces():
    """The same size in HBM (``pl.ANY``) is fine."""
    mesh = cpu_mesh((4,))
    big = jax.ShapeDtypeStruct((4 * 2048, 8192), jnp.float32)
    out = jax.eval_shape(lambda a: ag.all_gather(a, mesh=mesh, axis_name="x", memory_space=pl.ANY), big)
    assert out.shape == big.shape
