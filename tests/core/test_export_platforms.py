"""jax.export of a pallas_call for several platforms at once, and
``pallas_call(metadata=...)`` in the exported TPU custom call.

A module exported for ("cpu", "tpu") holds one branch per platform, chosen by
the platform it runs on: the CPU branch is the kernel in interpret mode, the TPU
branch pallas-tpu's ``tpu_custom_call``, the CUDA branch pallas-gpu's launch
through jax-kernel-runtime's FFI target. Each branch must be what a
single-platform export gives, and the CPU branch must run after a serialize /
deserialize round trip.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from jax.interpreters import mlir
from jaxlib.mlir import ir
from pallas_test_base import PallasTest, assert_allclose

import pallas as pl
from pallas._src import backends

SHAPE = (16, 256)
TPU_TARGET = "tpu_custom_call"


def _sds(shape=SHAPE, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _kernel(x_ref, y_ref, o_ref):
    i = pl.program_id(0).astype(jnp.float32)
    o_ref[...] = jnp.sin(x_ref[...]) * y_ref[...] + i


def _reference(x, y):
    # Block (16, 128) over a grid of 2 along the columns: column block j adds j.
    return jnp.sin(x) * y + jnp.repeat(jnp.arange(2.0, dtype=jnp.float32), 128)[None, :]


def _call(**kwargs):
    spec = pl.BlockSpec((16, 128), lambda j: (0, j))
    return pl.pallas_call(
        _kernel, _sds(), grid=(2,), in_specs=[spec, spec], out_specs=spec, name="sin_mul", **kwargs
    )


def _runtime_target():
    jkr = pytest.importorskip("jax_kernel_runtime")
    return jkr.TARGET_NAME


def _export(fn, platforms, *args):
    """``jax.export`` of ``jax.jit(fn)`` (a fresh wrapper, so no cached lowering is reused)."""
    checks = []
    if "cuda" in platforms:
        checks = pytest.importorskip("jax_kernel_runtime").export_disabled_checks()

    def wrapper(*a):
        return fn(*a)

    return jax.export.export(jax.jit(wrapper), platforms=platforms, disabled_checks=checks)(*args)


def _run_on_cpu(exported, *args):
    """Runs the exported function on the CPU (on a GPU machine too, where the
    default device is a GPU): the branch for platform 'cpu'."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return exported.call(*(jax.device_put(a, cpu) for a in args))


@dataclasses.dataclass(frozen=True)
class CustomCall:
    target: str
    attributes: dict[str, str]  # every attribute, printed
    backend_config: str
    kernel_metadata: dict[str, str] | None  # from mhlo.frontend_attributes


def custom_calls(exported) -> list[CustomCall]:
    """Every ``stablehlo.custom_call`` of the exported module, read through the
    MLIR bindings, in program order."""
    found = []
    with mlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())

        def visit(op):
            if op.name == "stablehlo.custom_call":
                attrs = op.attributes
                names = [attrs[i].name for i in range(len(attrs))]
                metadata = None
                if "mhlo.frontend_attributes" in names:
                    frontend = ir.DictAttr(attrs["mhlo.frontend_attributes"])
                    if "kernel_metadata" in frontend:
                        metadata = json.loads(ir.StringAttr(frontend["kernel_metadata"]).value)
                config = attrs["backend_config"] if "backend_config" in names else None
                found.append(
                    CustomCall(
                        ir.StringAttr(attrs["call_target_name"]).value,
                        {n: str(attrs[n]) for n in names},
                        ir.StringAttr(config).value if isinstance(config, ir.StringAttr) else str(config),
                        metadata,
                    )
                )
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
    return found


def _kernel_calls(exported) -> dict[str, list[CustomCall]]:
    """The kernels' custom calls (tpu_custom_call, the runtime's) by target."""
    kernels = {TPU_TARGET, "jax_kernel_runtime_launch"}
    by_target: dict[str, list[CustomCall]] = {}
    for call in custom_calls(exported):
        if call.target in kernels:
            by_target.setdefault(call.target, []).append(call)
    return by_target


@pytest.fixture
def cuda_without_gpu(monkeypatch):
    """Lower for CUDA on this machine: pallas-gpu compiles for sm_90 without asking a device."""
    pytest.importorskip("pallas_gpu")
    pytest.importorskip("triton")
    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "90")


def _need(platform):
    if platform == "tpu":
        pytest.importorskip("pallas_tpu")


class TestExportWithCpu(PallasTest):
    """Pairs with the CPU: exported, serialized, deserialized and run on the CPU."""

    @pytest.mark.parametrize(
        "platforms", [("cpu", "tpu"), ("tpu", "cpu"), ("cuda", "cpu"), ("cpu", "cuda")], ids="-".join
    )
    def test_round_trip_runs_the_cpu_branch(self, platforms, request):
        if "cuda" in platforms:
            request.getfixturevalue("cuda_without_gpu")
        for p in platforms:
            _need(p)
        exported = _export(_call(), list(platforms), _sds(), _sds())
        restored = jax.export.deserialize(exported.serialize())
        assert restored.platforms == platforms
        x, y = self.rand(SHAPE), self.rand(SHAPE)
        assert_allclose(_run_on_cpu(restored, x, y), _reference(x, y))

        hw = next(p for p in platforms if p != "cpu")
        target = TPU_TARGET if hw == "tpu" else _runtime_target()
        calls = _kernel_calls(restored)
        assert list(calls) == [target], calls.keys()
        assert len(calls[target]) == 1
        # The hardware branch is what an export for that platform alone holds.
        (alone,) = _kernel_calls(_export(_call(), [hw], _sds(), _sds()))[target]
        assert calls[target][0].attributes == alone.attributes

    def test_tpu_compiler_params_with_the_cpu(self):
        # The TPU branch uses the CompilerParams; the CPU branch runs the kernel in
        # interpret mode (a single-platform CPU lowering still refuses them below).
        pltpu = pytest.importorskip("pallas_tpu")
        cp = pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=3 * 2**20)
        exported = _export(_call(compiler_params=cp), ["cpu", "tpu"], _sds(), _sds())
        restored = jax.export.deserialize(exported.serialize())
        x, y = self.rand(SHAPE), self.rand(SHAPE)
        assert_allclose(_run_on_cpu(restored, x, y), _reference(x, y))
        (call,) = _kernel_calls(restored)[TPU_TARGET]
        config = json.loads(call.backend_config)
        assert config["scoped_memory_configs"] == [{"memory_space": 1, "offset": 0, "size": 3 * 2**20}]
        with pytest.raises(ValueError, match=r"pallas_call 'sin_mul'.*are for 'tpu'.*lowered for the CPU"):
            _export(_call(compiler_params=cp), ["cpu"], _sds(), _sds())

    def test_interpret_mode_lowers_once_for_every_platform(self):
        # As JAX's Pallas: interpret=True is plain JAX on each platform, no custom call.
        exported = _export(_call(interpret=True), ["tpu", "cpu"], _sds(), _sds())
        assert _kernel_calls(exported) == {}
        x, y = self.rand(SHAPE), self.rand(SHAPE)
        assert_allclose(_run_on_cpu(jax.export.deserialize(exported.serialize()), x, y), _reference(x, y))

    def test_jnp_around_the_kernel(self):
        # The kernel's branch sits inside a larger program; the rest is shared.
        _need("tpu")

        def fn(x, y):
            return jnp.cumsum(_call()(x * 2.0, y), axis=1)

        exported = _export(fn, ["tpu", "cpu"], _sds(), _sds())
        restored = jax.export.deserialize(exported.serialize())
        x, y = self.rand(SHAPE), self.rand(SHAPE)
        assert_allclose(_run_on_cpu(restored, x, y), jnp.cumsum(_reference(x * 2.0, y), axis=1), scale=10)

    def test_vmap_of_the_kernel(self):
        _need("tpu")
        exported = _export(jax.vmap(_call()), ["cpu", "tpu"], _sds((3, *SHAPE)), _sds((3, *SHAPE)))
        restored = jax.export.deserialize(exported.serialize())
        x, y = self.rand((3, *SHAPE)), self.rand((3, *SHAPE))
        assert_allclose(_run_on_cpu(restored, x, y), jax.vmap(_reference)(x, y))

    @pytest.mark.gpu
    def test_each_device_runs_its_branch(self):
        # On a GPU machine the CUDA branch (compiled for this GPU) runs on the GPU and
        # the CPU branch on the CPU, from one deserialized export.
        pytest.importorskip("pallas_gpu")
        exported = _export(_call(), ["cuda", "cpu"], _sds(), _sds())
        restored = jax.export.deserialize(exported.serialize())
        x, y = self.rand(SHAPE), self.rand(SHAPE)
        gpu = jax.devices("gpu")[0]
        out = restored.call(jax.device_put(x, gpu), jax.device_put(y, gpu))
        assert out.devices() == {gpu}
        assert_allclose(out, _reference(x, y))
        assert_allclose(_run_on_cpu(restored, x, y), _reference(x, y))


class TestExportWithoutCpu(PallasTest):
    def test_cuda_and_tpu(self, cuda_without_gpu):
        _need("tpu")
        exported = _export(_call(), ["cuda", "tpu"], _sds(), _sds())
        restored = jax.export.deserialize(exported.serialize())
        assert restored.platforms == ("cuda", "tpu")
        calls = _kernel_calls(restored)
        target = _runtime_target()
        assert sorted(calls) == sorted([TPU_TARGET, target])
        assert len(calls[TPU_TARGET]) == len(calls[target]) == 1
        for platform, tgt in (("tpu", TPU_TARGET), ("cuda", target)):
            (alone,) = _kernel_calls(_export(_call(), [platform], _sds(), _sds()))[tgt]
            assert calls[tgt][0].attributes == alone.attributes, platform
        # Exported for neither, this machine's CPU cannot run it.
        x = self.rand(SHAPE)
        with pytest.raises(ValueError, match="platform"):
            _run_on_cpu(restored, x, x)


class TestMissingBackend:
    @pytest.fixture
    def without(self, monkeypatch):
        """Hides the installed backends that lower for ``platform``."""

        def hide(platform):
            keep = lambda found: {  # noqa: E731
                n: b for n, b in found.items() if platform not in getattr(b, "PLATFORMS", ())
            }
            # Load every entry point first: importing a backend registers it.
            from_entry_points = backends._load()
            monkeypatch.setattr(backends, "_registered", keep(backends._registered))
            monkeypatch.setattr(backends, "_backends", keep(from_entry_points))

        return hide

    @pytest.mark.parametrize(
        "platforms, missing, dist",
        [
            (("cpu", "tpu"), "tpu", "jax-pallas-tpu"),
            (("cuda", "cpu"), "cuda", "jax-pallas-gpu"),
            (("cuda", "tpu"), "tpu", "jax-pallas-tpu"),
        ],
        ids=["cpu-tpu", "cuda-cpu", "cuda-tpu"],
    )
    def test_names_the_distribution_to_install(self, platforms, missing, dist, without, request):
        if "cuda" in platforms and missing != "cuda":
            request.getfixturevalue("cuda_without_gpu")
        without(missing)
        with pytest.raises(
            ValueError, match=rf"no Pallas backend is installed for platform '{missing}'"
        ) as e:
            _export(_call(), list(platforms), _sds(), _sds())
        text = str(e.value) + "".join(getattr(e.value, "__notes__", []))
        assert f"pip install {dist}" in text
        assert "pallas_call 'sin_mul'" in text
        assert f"the '{missing}' branch failed" in text

    def test_cpu_branch_that_needs_host_callbacks(self):
        # A kernel with a TPU scratch runs on the CPU in pallas-tpu's interpreter,
        # which calls back into Python: jax.export cannot serialize that.
        pltpu = pytest.importorskip("pallas_tpu")

        def kernel(x_ref, o_ref, s_ref):
            s_ref[...] = x_ref[...] * 3.0
            o_ref[...] = s_ref[...] + 1.0

        call = pl.pallas_call(
            kernel, _sds((8, 128)), scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)], name="scratchy"
        )
        with pytest.raises(
            NotImplementedError, match=r"pallas_call 'scratchy'.*on the CPU.*pallas_tpu's interp"
        ):
            _export(call, ["cpu", "tpu"], _sds((8, 128)))
        interpreted = pl.pallas_call(
            kernel,
            _sds((8, 128)),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
            name="scratchy",
            interpret=True,
        )
        with pytest.raises(NotImplementedError, match=r"pallas_call 'scratchy'.*in interpret mode"):
            _export(interpreted, ["cpu"], _sds((8, 128)))
        # For the TPU alone it exports.
        assert list(_kernel_calls(_export(call, ["tpu"], _sds((8, 128))))) == [TPU_TARGET]


# ---------------------------------------------------------------------------
# pallas_call(metadata=...)


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def _kernel_metadata(exported) -> list[dict | None]:
    return [call.kernel_metadata for call in _kernel_calls(exported).get(TPU_TARGET, [])]


class TestMetadata(PallasTest):
    METADATA = {"model": "decoder layer 3", "shape": "(8, 128)", "owner": "ñ team"}
    # JSON scalars besides strings, as tokamax's gmm_v2 passes them ({"dims.size_group": 8}).
    SCALARS = {"dims.size_group": 8, "ratio": 0.5, "fused": True, "bias": None, "name": "gmm"}

    def test_tpu_custom_call_carries_metadata(self):
        _need("tpu")
        call = pl.pallas_call(_add_one, _sds((8, 128)), metadata=self.METADATA)
        assert _kernel_metadata(_export(call, ["tpu"], _sds((8, 128)))) == [self.METADATA]
        # And in the TPU branch of a multi-platform export, whose CPU branch runs.
        exported = _export(call, ["cpu", "tpu"], _sds((8, 128)))
        assert _kernel_metadata(exported) == [self.METADATA]
        x = self.rand((8, 128))
        assert_allclose(_run_on_cpu(jax.export.deserialize(exported.serialize()), x), x + 1.0)

    def test_same_frontend_attributes_as_jax(self):
        # JAX's own Pallas is the reference: the same kernel_metadata attribute, with
        # metadata and without ("{}").
        _need("tpu")
        from jax.experimental import pallas as jax_pl

        for metadata in (self.METADATA, self.SCALARS, None):
            ours = pl.pallas_call(_add_one, _sds((8, 128)), metadata=metadata)
            theirs = jax_pl.pallas_call(_add_one, _sds((8, 128)), metadata=metadata)
            (a,) = _kernel_calls(_export(ours, ["tpu"], _sds((8, 128))))[TPU_TARGET]
            (b,) = _kernel_calls(_export(theirs, ["tpu"], _sds((8, 128))))[TPU_TARGET]
            assert a.attributes["mhlo.frontend_attributes"] == b.attributes["mhlo.frontend_attributes"]
            assert a.kernel_metadata == (metadata or {})

    def test_pl_kernel_passes_metadata(self):
        pltpu = pytest.importorskip("pallas_tpu")

        def body(x_hbm, o_hbm):
            pltpu.sync_copy(x_hbm, o_hbm)

        run = pl.kernel(
            body,
            _sds((8, 128)),
            mesh=pltpu.TensorCoreMesh(axis_name="core", num_cores=1),
            metadata={"k": "v", "n": 8},
        )
        assert _kernel_metadata(_export(run, ["tpu"], _sds((8, 128)))) == [{"k": "v", "n": 8}]

    def test_interpret_mode_accepts_metadata(self):
        x = self.rand((8, 128))
        for metadata in (self.METADATA, self.SCALARS):
            call = pl.pallas_call(_add_one, _sds((8, 128)), metadata=metadata, interpret=True)
            assert_allclose(jax.jit(call)(x), x + 1.0)

    @pytest.mark.parametrize(
        "metadata, message",
        [
            (
                {"layers": [3]},
                r"metadata: values must be str, int, float, bool or None \(written as JSON\), "
                r"got the list \[3\] for key 'layers'",
            ),
            ({3: "layers"}, r"metadata: keys must be str, got the int key 3"),
            ([("a", "b")], r"metadata: expected a dict of str to str, got \[\('a', 'b'\)\]"),
            ("a=b", r"metadata: expected a dict of str to str, got 'a=b'"),
        ],
        ids=["list-value", "int-key", "list", "str"],
    )
    def test_bad_metadata(self, metadata, message):
        call = pl.pallas_call(_add_one, _sds((8, 128)), metadata=metadata, interpret=True, name="add_one")
        with pytest.raises(
            TypeError, match=rf"pallas_call 'add_one' at test_export_platforms.py:\d+: {message}"
        ):
            call(self.rand((8, 128)))
