"""``pltpu.with_memory_space_constraint`` on ``pl.kernel`` operands:
an operand constrained to SMEM comes to the body as an SMEM Ref, so its
elements are read as scalars (tokamax's gmm_v2 passes its group offsets so),
checked against jnp on fresh random data in every TPU way of tests/ways (our
TPU interpret mode, our Mosaic lowering run by ``run_mosaic``, JAX's lowering,
and ours compiled by libtpu). The constraint stays inside the kernel call: a
value returned from jit, or passed through another op first, is a plain array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ways import every_way
from ways.compare import close
from ways.jax_mosaic import tensorcore_mesh

import pallas as pl
import pallas_tpu as pltpu
from pallas._src import core as pallas_core

ROWS, GROUPS = 8, 6  # each group: ROWS rows of x from a random offset; GROUPS // 2 per core


def _data():
    seed = np.random.SeedSequence().entropy % 2**32
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    offsets = jnp.asarray(rng.integers(0, x.shape[0] - ROWS + 1, GROUPS), jnp.int32)
    scales = jnp.asarray(rng.standard_normal(GROUPS), jnp.float32)
    return seed, x, offsets, scales


def _reference(x, offsets, scales):
    return jnp.concatenate([x[o : o + ROWS] * s for o, s in zip(offsets.tolist(), scales.tolist())])


def _gather_groups(pl, pltpu, spaces=None):
    """``f(x, offsets, scales)``: group g is ``x[offsets[g]:][:ROWS] * scales[g]``,
    the offsets and scales read one by one from SMEM Refs (dynamic DMA slices)."""
    per_core = GROUPS // 2

    def body(offsets_smem, scales_smem, x_hbm, o_hbm, buf):
        if spaces is not None:
            spaces.extend(str(r.aval.memory_space).lower() for r in (offsets_smem, scales_smem, x_hbm))
        core = lax.axis_index("core")

        @pl.loop(0, per_core)
        def _(i):
            g = core * per_core + i
            pltpu.sync_copy(x_hbm.at[pl.ds(offsets_smem[g], ROWS)], buf)
            buf[...] = buf[...] * scales_smem[g]
            pltpu.sync_copy(buf, o_hbm.at[pl.ds(g * ROWS, ROWS)])

    def f(x, offsets, scales):
        offsets = pltpu.with_memory_space_constraint(offsets, pltpu.SMEM)
        scales = pltpu.with_memory_space_constraint(scales, pltpu.SMEM)
        return pl.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((GROUPS * ROWS, x.shape[1]), x.dtype),
            mesh=tensorcore_mesh(pltpu),
            scratch_types=[pltpu.VMEM((ROWS, x.shape[1]), x.dtype)],
        )(offsets, scales, x)

    return f


@every_way(
    tpu=True,
    xfail={
        "jax_mosaic": "run_mosaic: JAX's module gives its SMEM operand window_params with an affine_map"
        " transform_indices (run_mosaic reads a symbol there)"
    },
)
def test_smem_constrained_offsets_drive_dynamic_slices(way):
    seed, x, offsets, scales = _data()
    out = way.with_params(num_cores=2).jit(_gather_groups(*way.modules()))(x, offsets, scales)
    try:
        close(out, _reference(x, offsets, scales))
    except AssertionError as e:
        raise AssertionError(f"seed {seed}") from e


def test_the_body_gets_smem_refs():
    _, x, offsets, scales = _data()
    spaces = []
    jax.make_jaxpr(_gather_groups(pl, pltpu, spaces))(x, offsets, scales)
    assert spaces[:2] == ["smem", "smem"] and spaces[2] != "smem"  # x: the mesh's default (pl.ANY)


def test_an_unconstrained_operand_keeps_the_mesh_default():
    # The constraint is on the value it returned: the same value passed through
    # another op first is an ordinary operand (pl.ANY), as in JAX.
    spaces = []

    def body(a_ref, o_ref):
        spaces.append(str(a_ref.aval.memory_space).lower())
        pltpu.sync_copy(a_ref, o_ref)

    def f(a):
        a = pltpu.with_memory_space_constraint(a, pltpu.SMEM) + 0
        return pl.kernel(body, out_type=jax.ShapeDtypeStruct(a.shape, a.dtype), mesh=tensorcore_mesh(pltpu))(
            a
        )

    jax.make_jaxpr(f)(jnp.arange(8, dtype=jnp.int32))
    assert len(spaces) == 1 and spaces[0] != "smem"


def test_the_constraint_does_not_leak_out_of_jit():
    _, x, offsets, _ = _data()
    f = jax.jit(lambda o: pltpu.with_memory_space_constraint(o, pltpu.SMEM))
    out = f(offsets)
    np.testing.assert_array_equal(out, offsets)
    assert type(out) is type(offsets) and out.dtype == offsets.dtype
    (out_aval,) = jax.make_jaxpr(f)(offsets).out_avals
    assert str(getattr(out_aval, "memory_space", "device")).lower() in ("device", "memoryspace.device")
    # An eager value carries no record (and pl.kernel does not see one on it).
    before = len(pallas_core._memory_space_constraints)
    eager = pltpu.with_memory_space_constraint(offsets, pltpu.SMEM)
    assert pallas_core.constrained_memory_space(eager) is None
    assert len(pallas_core._memory_space_constraints) == before


def test_unknown_memory_space_is_refused_naming_the_argument():
    a = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(NotImplementedError, match="memory_space=semaphore"):
        pltpu.with_memory_space_constraint(a, "semaphore")

    def f(x, offsets):
        # "smem" is a name, not a memory space: pl.kernel names the operand.
        offsets = pltpu.with_memory_space_constraint(offsets, "smem")
        return pl.kernel(
            lambda x_ref, o_ref, out_ref: None,
            out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
            mesh=tensorcore_mesh(pltpu),
        )(x, offsets)

    with pytest.raises(TypeError, match=r"operand args\[1\] is constrained to memory space 'smem'"):
        jax.make_jaxpr(f)(jnp.zeros((8, 128), jnp.float32), a)
