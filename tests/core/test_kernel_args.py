"""How ``pl.kernel`` hands Refs to its body: as JAX's ``pl.kernel`` does.

Found by running tokamax's gmm_v2 on our packages (tests/downstream): its body
takes scratch slots that are ``None`` (``scratch_types=[..., None, None]``), and
ours dropped them (``kernel_main() missing 1 required positional argument``).
Each case runs in TPU interpret mode and is compared with a ``jnp`` reference and
with JAX's own ``pl.kernel`` on the same body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ways.jax_mosaic import tensorcore_mesh

import pallas as pl

pltpu = pytest.importorskip("pallas_tpu")
jpl = pytest.importorskip("jax.experimental.pallas")
from jax.experimental.pallas import tpu as jpltpu  # noqa: E402

SHAPE = (8, 128)


def _rand(seed):
    return jax.random.normal(jax.random.key(seed), SHAPE, jnp.float32)


def _both(build, *args):
    """``build(pl, pltpu)`` run on ours and on JAX's Pallas, both in TPU interpret mode."""
    ours = build(pl, pltpu)(*args)
    with jax.enable_checks(False):  # JAX's interpreter's callbacks fail the checks
        theirs = build(jpl, jpltpu)(*args)
    return ours, theirs


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_none_scratch_slots_are_passed_as_none():
    x = _rand(0)

    def build(pl_, pltpu_):
        def body(x_hbm, o_hbm, buf, unused_a, sem, unused_b):
            assert unused_a is None and unused_b is None and sem is not None
            pltpu_.sync_copy(x_hbm, buf)
            buf[...] = buf[...] * 3.0
            pltpu_.sync_copy(buf, o_hbm)

        return pl_.kernel(
            body,
            out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32),
            mesh=tensorcore_mesh(pltpu_, num_cores=1),
            interpret=pltpu_.InterpretParams(),
            scratch_types=[pltpu_.VMEM(SHAPE, jnp.float32), None, pltpu_.SemaphoreType.DMA, None],
        )

    ours, theirs = _both(build, x)
    _close(ours, 3.0 * x)
    _close(ours, theirs)


def test_pytree_operands_outputs_and_dict_scratch():
    x, y = _rand(1), _rand(2)

    def build(pl_, pltpu_):
        def body(xy, outs, *, acc):
            # One argument per operand (a dict of Refs), the tuple out_type one per
            # element, a dict of scratch types as keyword arguments.
            o_twice, o_y = outs
            pltpu_.sync_copy(xy["x"], acc)
            acc[...] = acc[...] * 2.0
            pltpu_.sync_copy(acc, o_twice)
            pltpu_.sync_copy(xy["y"], o_y)

        sds = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
        return pl_.kernel(
            body,
            out_type=((sds, sds),),
            mesh=tensorcore_mesh(pltpu_, num_cores=1),
            interpret=pltpu_.InterpretParams(),
            scratch_types={"acc": pltpu_.VMEM(SHAPE, jnp.float32)},
        )

    ours, theirs = _both(build, {"x": x, "y": y})
    _close(ours, ((2.0 * x, y),))
    _close(ours, theirs)


def test_single_output_is_one_argument():
    x = _rand(3)

    def build(pl_, pltpu_):
        def body(x_hbm, o_hbm):
            pltpu_.sync_copy(x_hbm, o_hbm)

        return pl_.kernel(
            body,
            out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32),
            mesh=tensorcore_mesh(pltpu_, num_cores=1),
            interpret=pltpu_.InterpretParams(),
        )

    ours, theirs = _both(build, x)
    _close(ours, x)
    _close(ours, theirs)
