"""Shared pytest setup: the `gpu` marker skips cleanly on machines with no GPU."""

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
    _args = re.sub(r"--xla_mosaic_dump_to=\S+", "", os.environ.get("LIBTPU_INIT_ARGS", ""))  # the controller's
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
