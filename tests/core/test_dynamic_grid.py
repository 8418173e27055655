"""Dynamic (traced) grid sizes: ``grid=(n, ...)`` with ``n`` a traced int32 scalar, run
every way (tests/ways: the Mosaic way exports the jitted function, the sizes its
module's first operands), under jit/vmap/jvp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_test_base import PallasTest, assert_allclose
from ways import every_way

import pallas as pl

B = 8  # rows per block


def rows_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + pl.num_programs(0) * 10.0 + pl.program_id(0) + pl.program_id(1) / 8


def rows_call(x, n, pallas_call, cols=2):
    """``rows_kernel`` over a grid of ``(n, cols)``, by ``pallas_call`` (a way's, or
    ``pl.pallas_call`` with an ``interpret=``)."""
    spec = pl.BlockSpec((B, x.shape[1] // cols), lambda i, j: (i, j))
    return pallas_call(
        rows_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(n, cols),
        in_specs=[spec],
        out_specs=spec,
    )(x)


def interpreted(interpret):
    """``pl.pallas_call`` with ``interpret=interpret``."""
    return lambda *a, **kw: pl.pallas_call(*a, interpret=interpret, **kw)


def rows_ref(x, n, cols=2):
    """Block rows < n computed, the rest uninitialized (NaN)."""
    x = np.asarray(x)
    out = np.full(x.shape, np.nan, np.float32)
    w = x.shape[1] // cols
    for i in range(int(n)):
        for j in range(cols):
            blk = np.s_[B * i : B * (i + 1), w * j : w * (j + 1)]
            out[blk] = x[blk] * 2 + int(n) * 10 + i + j / 8
    return out


_NO_DYNAMIC_GRID_IN_TRITON = (
    "pallas-gpu lowers no dynamic grid (Triton's launch grid is static; its interpreter runs that"
    " lowering): a clear error (test_hardware_lowering_is_a_clear_error)"
)


@every_way(xfail={"triton": _NO_DYNAMIC_GRID_IN_TRITON}, raises=NotImplementedError)
class TestDynamicGrid(PallasTest):
    def test_jit_against_numpy(self, way):
        x = self.rand((48, 256))
        f = way.jit(lambda x, n: rows_call(x, n, way.pallas_call))
        for n in (1, 4, 6, 0):  # one compiled function, any trip count
            np.testing.assert_allclose(f(x, n), rows_ref(x, n), rtol=1e-6)

    def test_negative_size_runs_no_step(self, way):
        x = self.rand((16, 128))
        out = way.jit(lambda x, n: rows_call(x, n, way.pallas_call, cols=1))(x, -3)
        assert np.isnan(np.asarray(out)).all()

    def test_vmap_unbatched_size(self, way):
        xs = self.rand((3, 32, 256))
        out = jax.vmap(lambda x: rows_call(x, jnp.int32(3), way.pallas_call), in_axes=0)(xs)
        f = jax.jit(lambda xs, n: jax.vmap(lambda x: rows_call(x, n, way.pallas_call))(xs))
        for i in range(3):
            np.testing.assert_allclose(f(xs, 3)[i], rows_ref(xs[i], 3), rtol=1e-6)
            np.testing.assert_allclose(out[i], rows_ref(xs[i], 3), rtol=1e-6)

    def test_vmap_batched_sizes(self, way):
        xs = self.rand((3, 32, 256))
        ns = jnp.array([4, 1, 2], jnp.int32)
        out = jax.jit(jax.vmap(lambda x, n: rows_call(x, n, way.pallas_call)))(xs, ns)
        for i in range(3):
            np.testing.assert_allclose(out[i], rows_ref(xs[i], ns[i]), rtol=1e-6)

    def test_jvp(self, way):
        x, t = self.rand((32, 256)), self.rand((32, 256))
        f = lambda x, t, n: jax.jvp(lambda x: rows_call(x, n, way.pallas_call), (x,), (t,))  # noqa: E731
        out, tan = way.jit(f)(x, t, 4)
        np.testing.assert_allclose(out, rows_ref(x, 4), rtol=1e-6)
        assert_allclose(tan, 2 * t)

    def test_accumulate_over_dynamic_axis(self, way):
        """A reduction axis of traced length (the k axis of a matmul)."""
        x, y = self.rand((16, 512)), self.rand((512, 128))

        def kernel(x_ref, y_ref, o_ref):
            @pl.when(pl.program_id(0) == 0)
            def _():
                o_ref[...] = jnp.zeros_like(o_ref)

            o_ref[...] += jnp.dot(x_ref[...], y_ref[...], precision="highest")

        @way.jit
        def f(x, y, k):
            return way.pallas_call(
                kernel,
                out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                grid=(k,),
                in_specs=[
                    pl.BlockSpec((16, 128), lambda k: (0, k)),
                    pl.BlockSpec((128, 128), lambda k: (k, 0)),
                ],
                out_specs=pl.BlockSpec((16, 128), lambda k: (0, 0)),
            )(x, y)

        for k in (1, 3, 4):
            want = jnp.dot(x[:, : 128 * k], y[: 128 * k], precision="highest")
            assert_allclose(f(x, y, k), want, scale=10)

    def test_aliased_output_keeps_unvisited_blocks(self, way):
        x = self.rand((32, 128))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1

        @way.jit
        def f(x, n):
            spec = pl.BlockSpec((B, 128), lambda i: (i, 0))
            return way.pallas_call(
                kernel,
                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                grid=(n,),
                in_specs=[spec],
                out_specs=spec,
                input_output_aliases={0: 0},
            )(x)

        for n in (0, 2, 4):
            ref = jnp.concatenate([x[: B * n] + 1, x[B * n :]])
            assert_allclose(f(x, n), ref)


@every_way()
def test_concrete_array_size_is_static(way):
    x = jax.random.normal(jax.random.key(1), (32, 256), jnp.float32)
    np.testing.assert_allclose(rows_call(x, jnp.int32(3), way.pallas_call), rows_ref(x, 3), rtol=1e-6)


class TestDynamicGridErrors(PallasTest):
    def test_float_size(self):
        x = self.rand((16, 128))
        with pytest.raises(
            TypeError,
            match=r"pallas_call 'rows_kernel' at .*grid\[0\]: a dynamic grid size must be an integer scalar, got float32\[\]",
        ):
            jax.jit(lambda x, n: rows_call(x, n, interpreted(True)))(x, 2.0)

    def test_vector_size(self):
        x = self.rand((16, 128))
        with pytest.raises(
            TypeError, match=r"grid\[0\]: a dynamic grid size must be an integer scalar, got int32\[2\]"
        ):
            jax.jit(lambda x, n: rows_call(x, n, interpreted(True)))(x, jnp.array([1, 2]))

    def test_named_axis_needs_static_size(self):
        x = self.rand((16, 128))

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        @jax.jit
        def f(x, n):
            return pl.pallas_call(kernel, out_shape=x, grid=(("i", n),), interpret=True)(x)

        with pytest.raises(
            NotImplementedError, match=r"grid\[0\]: the named grid axis 'i' needs a static size"
        ):
            f(x, 2)


pltpu = pytest.importorskip("pallas_tpu")


def test_tpu_interpreter_multi_core_is_an_error():
    x = jax.random.normal(jax.random.key(0), (16, 256), jnp.float32)
    params = pltpu.InterpretParams(num_cores_or_threads=2)
    with pytest.raises(
        NotImplementedError, match=r"rows_kernel.*dynamic \(traced\) sizes.*num_cores_or_threads > 1"
    ):
        jax.jit(lambda x, n: rows_call(x, n, interpreted(params)))(x, 2)


def test_hardware_lowering_is_a_clear_error():
    """Backends lower dynamic grids for hardware only if they say so (DYNAMIC_GRID): the
    Triton backend does not (a clear error); the TPU backend does (the sizes become the
    custom call's first operands; tests/tpu runs such modules with run_mosaic)."""
    pytest.importorskip("pallas_gpu")
    x = jnp.ones((16, 256), jnp.float32)
    traced = jax.jit(lambda x, n: rows_call(x, n, interpreted(False))).trace(x, 2)
    with pytest.raises(
        NotImplementedError,
        match=r"'rows_kernel'.*grid \(dynamic, 2\) has dynamic \(traced\) sizes, which the cuda backend does not lower",
    ):
        traced.lower(lowering_platforms=("cuda",))
    pytest.importorskip("pallas_tpu")
    assert "tpu_custom_call" in traced.lower(lowering_platforms=("tpu",)).as_text()
