"""Robustness of pallas-core: tracer errors inside kernels, negative indices, empty
arrays, backend names, captured constants, vmap of aliased calls, out-of-range
index maps (checked against jnp and against JAX's own interpret mode). The kernels run
every way (tests/ways); the errors, found while tracing, in the core way."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl  # the reference: JAX's interpret mode
from pallas_test_base import PallasTest, assert_allclose
from ways import every_way, skip_way, xfail_way

import pallas as pl
from pallas._src import backends


class TestTracerErrors(PallasTest):
    def test_python_if_on_a_ref_value(self):
        def branchy_kernel(x_ref, o_ref):
            if x_ref[0] > 0:
                o_ref[...] = x_ref[...]

        x = self.rand((8,))
        with pytest.raises(jax.errors.TracerBoolConversionError) as info:
            self.pallas_call(branchy_kernel, x)(x)
        msg = str(info.value)
        assert "in kernel 'branchy_kernel'" in msg and "test_robustness.py:" in msg
        assert "Attempted boolean conversion" in msg  # JAX's own explanation is kept

    def test_int_of_a_ref_value(self):
        def int_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * int(x_ref[0])

        x = self.rand((8,))
        with pytest.raises(jax.errors.ConcretizationTypeError, match=r"in kernel 'int_kernel'"):
            self.pallas_call(int_kernel, x)(x)


class TestNegativeIndices(PallasTest):
    @every_way()
    def test_against_numpy(self):
        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.zeros_like(o_ref)
            o_ref[0, 0] = x_ref[-1, -1]
            o_ref[-1, :] = x_ref[-3, :]
            o_ref[0, 1:4] = x_ref[-2, -5:-2]
            o_ref[1, -3:] = x_ref[0, :3] + x_ref[-4:-1, 2]

        x = self.rand((4, 8))
        out = self.pallas_call(kernel, x)(x)
        xn, ref = np.asarray(x), np.zeros((4, 8), np.float32)
        ref[0, 0] = xn[-1, -1]
        ref[-1, :] = xn[-3, :]
        ref[0, 1:4] = xn[-2, -5:-2]
        ref[1, -3:] = xn[0, :3] + xn[-4:-1, 2]
        assert_allclose(out, ref)

    def test_too_negative_is_an_error(self):
        def far_kernel(x_ref, o_ref):
            o_ref[0] = x_ref[-9]

        x = self.rand((8,))
        with pytest.raises(
            ValueError, match=r"'far_kernel'.*index -9 is out of bounds.*valid indices are -8\.\.7"
        ):
            self.pallas_call(far_kernel, x)(x)


def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


class TestEmptyArrays(PallasTest):
    @every_way(
        xfail={
            "mosaic": "our Mosaic lowering makes a zero-size vector of an empty block, which"
            " MLIR refuses (a kernel of empty outputs need not run)"
        }
    )
    def test_whole_array(self, way):
        z = jnp.zeros((0, 128), jnp.float32)
        f = self.pallas_call(add_one, z)
        assert f(z).shape == (0, 128)
        assert way.jit(f)(z).shape == (0, 128)

    @every_way()
    def test_whole_array_vmap(self):
        f = self.pallas_call(add_one, jnp.zeros((0, 128), jnp.float32))
        assert jax.vmap(f)(jnp.zeros((3, 0, 128))).shape == (3, 0, 128)

    @every_way()
    @pytest.mark.parametrize("grid", [0, 2])
    @skip_way(
        "tpu_interpret",
        "grid steps over an empty array: a TPU reports a block index outside the array (TPU interpret mode and run_mosaic check it): there is no block to clamp",
        ids=("2",),
    )
    @skip_way(
        "mosaic",
        "grid steps over an empty array: a TPU reports a block index outside the array (TPU interpret mode and run_mosaic check it): there is no block to clamp",
        ids=("2",),
    )
    def test_blocked(self, grid):
        z = jnp.zeros((0, 128), jnp.float32)
        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        f = self.pallas_call(add_one, z, grid=(grid,), in_specs=[spec], out_specs=spec)
        assert f(z).shape == (0, 128)

    def test_zero_block_on_a_nonempty_dim(self):
        x = self.rand((16, 128))
        spec = pl.BlockSpec((0, 128), lambda i: (i, 0))
        with pytest.raises(
            ValueError, match=r"'add_one'.*in_specs\[0\]\.block_shape\[0\]: block sizes must be positive"
        ):
            self.pallas_call(add_one, x, grid=(2,), in_specs=[spec], out_specs=spec)(x)


def lower_for(platform, backend):
    x = jnp.ones((8, 128), jnp.float32)
    f = pl.pallas_call(add_one, x, backend=backend)
    return jax.jit(f).trace(x).lower(lowering_platforms=(platform,))


class TestBackendNames(PallasTest):
    def test_unknown_name(self):
        with pytest.raises(
            ValueError,
            match=r"'add_one' at .*backend: unknown backend 'foo'; expected None .*'gpu'.*'mosaic_tpu'.*'tpu'.*'triton'",
        ):
            lower_for("cpu", "foo")

    def test_mosaic_gpu(self):
        with pytest.raises(
            ValueError, match=r"backend: 'mosaic_gpu' is JAX's Mosaic GPU backend.*backend='triton'"
        ):
            lower_for("cpu", "mosaic_gpu")

    def test_not_a_string(self):
        with pytest.raises(TypeError, match=r"backend: expected a backend name \(a str\) or None, got 3"):
            lower_for("cpu", 3)

    @pytest.mark.parametrize("name", ["mosaic_tpu", "mosaic", "tpu"])
    def test_tpu_names_select_pallas_tpu(self, name):
        pytest.importorskip("pallas_tpu")
        assert "tpu_custom_call" in lower_for("tpu", name).as_text()
        with pytest.raises(
            ValueError, match=r"backend='tpu' \(jax-pallas-tpu\) lowers for tpu, not for platform 'cuda'"
        ):
            lower_for("cuda", name)

    def test_triton_selects_pallas_gpu(self, monkeypatch):
        try:
            import pallas_gpu  # noqa: F401
        except ImportError as e:
            pytest.skip(f"pallas-gpu does not import: {e}")
        calls = []
        gpu = backends.backends()["gpu"]
        monkeypatch.setattr(gpu, "lower", lambda ctx, call, *a: calls.append(call.backend) or [None])
        with pytest.raises(Exception):  # noqa: B017 (the fake lowering returns no value)
            lower_for("cuda", "triton")
        assert calls == ["gpu"]

    def test_not_installed(self, monkeypatch):
        monkeypatch.setattr(backends, "_registered", {})
        monkeypatch.setattr(backends, "backends", lambda: {})
        with pytest.raises(
            ValueError,
            match=r"backend='gpu' selects jax-pallas-gpu, which is not installed \(pip install jax-pallas-gpu\)",
        ):
            lower_for("cuda", "triton")

    def test_interpret_ignores_backend(self):
        x = self.rand((8,))
        assert_allclose(pl.pallas_call(add_one, x, backend="triton", interpret=True)(x), x + 1)

    def test_entry_point_that_registers_on_import(self, monkeypatch):
        """Loading a backend's entry point imports the backend, which calls
        register_backend: this used to deadlock on the registry's lock."""

        class EntryPoint:
            name = "fake"

            def load(self):
                backends.register_backend("fake", object())
                return object()

        monkeypatch.setattr(backends, "_backends", None)
        monkeypatch.setattr(backends, "_registered", {})
        monkeypatch.setattr(backends.metadata, "entry_points", lambda group: [EntryPoint()])
        t = threading.Thread(target=backends.backends, daemon=True)
        t.start()
        t.join(timeout=20)
        assert not t.is_alive(), "backends() deadlocked"
        assert "fake" in backends._registered


class TestCapturedConstants(PallasTest):
    def _biased(self, scale, bias):
        def biased_kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * scale + bias

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        return self.pallas_call(
            biased_kernel,
            jax.ShapeDtypeStruct((32, 128), jnp.float32),
            grid=(4,),
            in_specs=[spec],
            out_specs=spec,
        )

    @every_way()
    @xfail_way(
        "mosaic",
        "a captured rank-0 constant (scale) is a rank-0 VMEM block, which Mosaic has no window"
        " for: our lowering refuses it (it could give it SMEM)",
        raises=Exception,
    )
    def test_against_jnp(self, way):
        x, bias, scale = self.rand((32, 128)), self.rand((8, 128)), jnp.float32(1.5)
        f = self._biased(scale, bias)
        ref = x * scale + jnp.tile(bias, (4, 1))
        assert_allclose(f(x), ref)
        assert_allclose(way.jit(f)(x), ref)

    @every_way()
    def test_under_vmap_and_jvp(self):
        bias, scale = self.rand((8, 128)), jnp.float32(1.5)
        f = self._biased(scale, bias)
        xs = self.rand((2, 32, 128))
        assert_allclose(jax.vmap(f)(xs), xs * scale + jnp.tile(bias, (4, 1)))
        x, t = self.rand((32, 128)), self.rand((32, 128))
        assert_allclose(jax.jvp(f, (x,), (t,))[1], t * scale)

    @every_way()
    def test_tracer_of_enclosing_jit(self, way):
        x, bias = self.rand((16, 128)), self.rand((16, 128))

        def g(x, bias):
            def kernel(x_ref, o_ref):
                o_ref[...] = x_ref[...] - bias

            return self.pallas_call(kernel, x)(x)

        g = way.jit(g)
        assert_allclose(g(x, bias), x - bias)
        assert_allclose(g(x, 2 * bias), x - 2 * bias)


@every_way()
class TestVmapAliased(PallasTest):
    @pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0)])
    def test_against_jnp(self, in_axes):
        def axpy_kernel(a_ref, y_ref, o_ref):
            o_ref[...] = y_ref[...] + 2 * a_ref[...]

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        f = self.pallas_call(
            axpy_kernel,
            jax.ShapeDtypeStruct((16, 128), jnp.float32),
            grid=(2,),
            in_specs=[spec, spec],
            out_specs=spec,
            input_output_aliases={1: 0},
        )
        a = self.rand((3, 16, 128) if in_axes[0] == 0 else (16, 128))
        y = self.rand((3, 16, 128) if in_axes[1] == 0 else (16, 128))
        out = jax.jit(jax.vmap(f, in_axes=in_axes))(a, y)
        assert_allclose(out, jnp.broadcast_to(y + 2 * a, (3, 16, 128)))


_TPU_BOUNDS = (
    "a TPU does not: TPU interpret mode and run_mosaic report a block index outside the array,"
    " and TPU interpret mode a dynamic slice past its Ref"
)


def out_of_range_ref(x, in_map, out_map, n_steps, block):
    """Runs the grid step by step in numpy with JAX's rule for block starts: a
    negative start counts once from the end, then the block is clamped inside."""
    x = np.asarray(x)
    out = np.full(x.shape, np.nan, np.float32)

    def start(b):
        s = b * block
        s = s + x.shape[0] if s < 0 else s
        return min(max(s, 0), x.shape[0] - block)

    for i in range(n_steps):
        si, so = start(in_map(i)), start(out_map(i))
        out[so : so + block] = x[si : si + block] * 2 + i
    return out


MAPS = {
    "out_past_end": (lambda i: i, lambda i: i + 1),
    "in_past_end": (lambda i: i + 2, lambda i: i),
    "in_negative": (lambda i: i - 1, lambda i: i),
    "out_negative": (lambda i: i, lambda i: i - 2),
    "both_far": (lambda i: 3 * i - 5, lambda i: 2 * i - 1),
}


@every_way(
    skip={
        "tpu_interpret": "JAX's interpret mode clamps what is out of range; " + _TPU_BOUNDS,
        "mosaic": "JAX's interpret mode clamps what is out of range; " + _TPU_BOUNDS,
    }
)
class TestOutOfRangeIndexMaps(PallasTest):
    @pytest.mark.parametrize("maps", MAPS)
    def test_against_numpy_and_jax(self, maps):
        in_map, out_map = MAPS[maps]
        x, n, block = self.rand((24, 128)), 5, 8

        def call(plmod, pallas_call):
            def kernel(x_ref, o_ref):
                o_ref[...] = x_ref[...] * 2 + plmod.program_id(0)

            return pallas_call(
                kernel,
                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                grid=(n,),
                in_specs=[plmod.BlockSpec((block, 128), lambda i: (in_map(i), 0))],
                out_specs=plmod.BlockSpec((block, 128), lambda i: (out_map(i), 0)),
            )(x)

        out = np.asarray(call(pl, self.pallas_call))
        ref = out_of_range_ref(x, in_map, out_map, n, block)
        np.testing.assert_allclose(out, ref, rtol=1e-6)
        np.testing.assert_allclose(out, np.asarray(call(jpl, _jax_interpret)), rtol=1e-6)

    def test_dynamic_ds_read_out_of_range(self):
        x = self.rand((32,))

        def call(plmod, pallas_call, start):
            def kernel(s_ref, x_ref, o_ref):
                o_ref[...] = x_ref[plmod.ds(s_ref[0], 8)]

            s = jnp.array([start], jnp.int32)
            return pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32))(s, x)

        for start in (-9, -3, 5, 27, 100):
            s = start + 32 if start < 0 else start
            s = min(max(s, 0), 24)
            out = call(pl, self.pallas_call, start)
            np.testing.assert_array_equal(out, x[s : s + 8])
            np.testing.assert_array_equal(out, call(jpl, _jax_interpret, start))


def _jax_interpret(kernel, out_shape, **kwargs):
    """JAX's own ``pallas_call`` in its interpret mode: the reference."""
    return jpl.pallas_call(kernel, out_shape, interpret=True, **kwargs)


class TestAliasWithScalarPrefetch(PallasTest):
    """As in JAX, input_output_aliases count the scalar-prefetch operands."""

    def call(self, plmod, tpu, pallas_call, aliases):
        def kernel(idx_ref, x_ref, y_ref, o_ref):
            o_ref[...] = y_ref[...] + x_ref[...] * idx_ref[0]

        spec = plmod.BlockSpec((8, 128), lambda i, idx: (i, 0))
        return pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
            grid_spec=tpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(2,), in_specs=[spec, spec], out_specs=spec
            ),
            input_output_aliases=aliases,
        )

    @every_way(skip={"triton": "scalar prefetch is a TPU feature: pallas-gpu refuses it, naming the fix"})
    def test_against_jnp_and_jax(self):
        pltpu = pytest.importorskip("pallas_tpu")
        from jax.experimental.pallas import tpu as jpltpu

        def jax_tpu_interpret(kernel, out_shape, **kwargs):
            return jpl.pallas_call(kernel, out_shape, interpret=jpltpu.InterpretParams(), **kwargs)

        idx, x, y = jnp.array([3], jnp.int32), self.rand((16, 128)), self.rand((16, 128))
        out = self.call(pl, pltpu, self.pallas_call, {2: 0})(idx, x, y)
        assert_allclose(out, y + 3 * x)
        with jax.enable_checks(False):
            theirs = self.call(jpl, jpltpu, jax_tpu_interpret, {2: 0})(idx, x, y)
        assert_allclose(out, theirs)

    def test_prefetch_operand_cannot_alias(self):
        pltpu = pytest.importorskip("pallas_tpu")
        idx, x = jnp.array([3], jnp.int32), self.rand((16, 128))
        with pytest.raises(
            ValueError, match=r"'kernel'.*input_output_aliases: input 0 is a scalar-prefetch operand"
        ):
            tpu_interpret = functools.partial(pl.pallas_call, interpret=pltpu.InterpretParams())
            self.call(pl, pltpu, tpu_interpret, {0: 0})(idx, x, x)
