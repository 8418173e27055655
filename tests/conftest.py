"""Shared pytest setup: the `gpu` marker skips cleanly on machines with no GPU,
and tests without it run on JAX's CPU device on a machine with a GPU too."""

import functools
import os
import re

import pytest

# Four CPU devices, so TPU kernels that talk to other devices (remote DMAs,
# barrier semaphores) run inside jax.shard_map. XLA reads the flag when JAX's
# CPU backend starts, so it is set before anything imports jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()


# libtpu (the TPU suites' compiled way) takes a lock file per machine: let each
# pytest worker load it. Read when libtpu starts, so set before anything imports jax.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# benchmarks/tpu_llo.py: each worker's libtpu dumps Mosaic's passes into its own folder.
if os.environ.get("PALLAS_TPU_LLO_DUMP"):
    _dump = os.path.join(os.environ["PALLAS_TPU_LLO_DUMP"], os.environ.get("PYTEST_XDIST_WORKER", "main"))
    _args = re.sub(
        r"--xla_mosaic_dump_to=\S+", "", os.environ.get("LIBTPU_INIT_ARGS", "")
    )  # the controller's
    os.environ["LIBTPU_INIT_ARGS"] = f"{_args} --xla_mosaic_dump_to={_dump}".strip()


@functools.cache
def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices())
    except Exception:
        return False


def pytest_configure(config):
    # JAX's own test suite runs with jaxpr checking on; so does ours (DEVELOPERS guide).
    import jax

    jax.config.update("jax_enable_checks", True)
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU: none found by jax.devices()")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request):
    """JAX's default device is the CPU for every test without the ``gpu`` marker.

    Those tests mean the CPU: Triton's interpreter (a ``triton_call`` runs where
    its arrays are), interpret mode (plain JAX, whose f32 dots would take TF32 on
    a GPU), TPU interpret mode and ``run_mosaic``. On a machine with a GPU they
    would otherwise run there: a kernel meant to fire a device assert in the
    interpreter poisoned the worker's CUDA context, and tolerances meant for CPU
    arithmetic failed. ``PALLAS_GPU_TESTS=gpu`` (scripts/gpu_check.sh) runs the
    tests/gpu suite on the GPU on purpose: there they keep the GPU.
    """
    on_purpose = os.environ.get("PALLAS_GPU_TESTS") == "gpu" and request.node.path.parent.name == "gpu"
    if request.node.get_closest_marker("gpu") is not None or on_purpose or not _has_gpu():
        yield
        return
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield
