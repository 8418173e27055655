"""JAX 0.12's GPU facts on pallas-gpu: ``plgpu.GpuInfo``,
``GpuVersion``, ``get_gpu_info``, ``get_gpu_info_from_version``,
``is_gpu_device`` and ``CUSTOM_CALL_TARGET_NAME``, checked against JAX's own
(``jax.experimental.pallas.triton``) where the installed JAX has them, and on a
machine without a GPU through abstract devices."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallas as pl
import pallas_gpu as plgpu

jtriton = pytest.importorskip("jax.experimental.pallas.triton")
JAX_HAS = hasattr(jtriton, "get_gpu_info_from_version")
needs_jax_012 = pytest.mark.skipif(
    not JAX_HAS, reason=f"JAX {jax.__version__} has no GPU info names (JAX 0.11 added them)"
)


def _abstract(kind, platform="gpu"):
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def test_versions_are_device_kinds():
    assert plgpu.GpuVersion.H100.value == "NVIDIA H100" and str(plgpu.GpuVersion.T4) == "Tesla T4"
    assert plgpu.GpuVersion("NVIDIA GeForce RTX 4090") is plgpu.GpuVersion.RTX_4090


@pytest.mark.parametrize(
    "version, arch, cc",
    [("T4", "7.5", 75), ("A100", "8.0", 80), ("L4", "8.9", 89), ("H200", "9.0", 90), ("B300", "10.3", 103)],
)
def test_info_from_version(version, arch, cc):
    info = plgpu.get_gpu_info_from_version(plgpu.GpuVersion[version])
    assert info == plgpu.GpuInfo(gpu_version=plgpu.GpuVersion[version], arch_name=arch, compute_capability=cc)
    assert dataclasses.is_dataclass(info)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.arch_name = "x"


@needs_jax_012
@pytest.mark.parametrize("version", list(plgpu.GpuVersion), ids=lambda v: v.name)
def test_every_version_matches_jax(version):
    if version.name not in jtriton.GpuVersion.__members__:
        pytest.skip(f"JAX {jax.__version__} does not know {version.value} (a newer JAX does)")
    ours = plgpu.get_gpu_info_from_version(version)
    theirs = jtriton.get_gpu_info_from_version(jtriton.GpuVersion[version.name])
    assert (ours.arch_name, ours.compute_capability) == (theirs.arch_name, theirs.compute_capability)
    assert ours.gpu_version.value == theirs.gpu_version.value


@needs_jax_012
def test_every_jax_version_is_ours():
    assert {(v.name, v.value) for v in jtriton.GpuVersion} <= {(v.name, v.value) for v in plgpu.GpuVersion}


@pytest.mark.parametrize(
    "kind, version",
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA H200", "H200")],
)
def test_get_gpu_info_of_an_abstract_device(kind, version):
    with _abstract(kind):
        assert plgpu.is_gpu_device()
        info = plgpu.get_gpu_info()
    assert info.gpu_version is plgpu.GpuVersion[version]
    if JAX_HAS:
        with _abstract(kind):
            theirs = jtriton.get_gpu_info()
        assert (info.arch_name, info.compute_capability) == (theirs.arch_name, theirs.compute_capability)


def test_amd_gpu_kind_is_its_arch():
    with _abstract("gfx942"):
        info = plgpu.get_gpu_info()
    assert info == plgpu.GpuInfo(gpu_version=None, arch_name="gfx942", compute_capability=0)


def test_unknown_abstract_nvidia_gpu_and_cpu_are_refused():
    with (
        _abstract("NVIDIA Z9000"),
        pytest.raises(ValueError, match=r"cannot tell the architecture of the abstract"),
    ):
        plgpu.get_gpu_info()
    if jax.default_backend() == "cpu":
        assert not plgpu.is_gpu_device()
        with pytest.raises(
            ValueError, match=r"get_gpu_info: unsupported GPU device kind 'cpu'.*use_abstract_mesh"
        ):
            plgpu.get_gpu_info()


def test_get_gpu_info_from_version_checks_its_argument():
    with pytest.raises(TypeError, match=r"expected a plgpu.GpuVersion, got 'NVIDIA H100'"):
        plgpu.get_gpu_info_from_version("NVIDIA H100")


def test_custom_call_target_is_the_one_kernels_lower_to(monkeypatch):
    import jax_kernel_runtime as jkr

    monkeypatch.setenv("PALLAS_GPU_COMPUTE_CAPABILITY", "90")

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    f = lambda x: pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)  # noqa: E731
    spec = jax.ShapeDtypeStruct((128,), jnp.float32)
    text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=jkr.export_disabled_checks())(
        spec
    ).mlir_module()
    assert f'"{plgpu.CUSTOM_CALL_TARGET_NAME}"' in text or f"@{plgpu.CUSTOM_CALL_TARGET_NAME}" in text
    assert plgpu.CUSTOM_CALL_TARGET_NAME != jtriton.__dict__.get("CUSTOM_CALL_TARGET_NAME")
