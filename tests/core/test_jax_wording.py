"""What JAX's own Pallas tests (issue 30 §3) expect of pallas-core: ``pl.run_state``,
and errors that keep our wording (kernel, line, fix) while also saying what JAX's
Pallas says, so code matching JAX's messages keeps working."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas as pl


def _rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_run_state_returns_the_final_values_of_its_refs():
    x, y = _rand(0, (8, 16)), _rand(1, (8, 16))

    def body(refs):
        x_ref, y_ref = refs
        y_ref[...] = x_ref[...] * 2 + y_ref[...]
        x_ref[...] = jnp.sin(x_ref[...])

    for f in (pl.run_state(body), jax.jit(pl.run_state(body))):
        ox, oy = f((x, y))
        np.testing.assert_allclose(ox, jnp.sin(x), rtol=1e-6)
        np.testing.assert_allclose(oy, 2 * x + y, rtol=1e-6)


def test_run_state_inside_a_kernel_accumulates_like_jnp():
    x = _rand(2, (4, 128))

    def kernel(x_ref, o_ref):
        def acc(acc_ref):
            def step(i, c):
                acc_ref[...] += x_ref[i] * (i + 1).astype(jnp.float32)
                return c

            lax.fori_loop(0, x_ref.shape[0], step, None)

        o_ref[...] = pl.run_state(acc)(jnp.zeros((128,), jnp.float32))

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32), interpret=True)(x)
    np.testing.assert_allclose(out, (x * jnp.arange(1, 5.0)[:, None]).sum(0), rtol=1e-5)


def test_run_state_forward_mode_ad_like_jnp():
    x, t = _rand(3, (16,)), _rand(4, (16,))

    def body(ref):
        ref[...] = jnp.sin(ref[...]) * ref[...]

    got = jax.jvp(pl.run_state(body), (x,), (t,))
    want = jax.jvp(lambda x: jnp.sin(x) * x, (x,), (t,))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
