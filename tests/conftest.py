"""Shared pytest setup: the `gpu` marker skips cleanly on machines with no GPU,
and tests without it run on JAX's CPU device on a machine with a GPU too."""

import functools
import glob
import os
import re
import sys

import pytest

# tests/ways/ (one kernel body, every way) is imported as ``ways`` by the suites.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Four CPU devices, so TPU kernels that talk to other devices (remote DMAs,
# barrier semaphores) run inside jax.shard_map. XLA reads the flag when JAX's
# CPU backend starts, so it is set before anything imports jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()


# Google's PCI device ids of TPU chips (JAX's jax._src.hardware_utils lists the same).
_TPU_PCI_IDS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076", "0x007c", "0x0083"}


def _quiet_libtpu_without_a_tpu() -> None:
    """With no TPU attached (no ``/dev/accel*``, no TPU on the PCI bus: JAX's test), libtpu asks
    the absent cloud metadata for the worker hostnames and host bounds when JAX starts and
    prints an ``E0000 ... unexpected worker hostname`` block: tell it it is one host alone.
    The compile-only TPU devices of the compiled way are unaffected; on a TPU nothing is set.
    Read when libtpu starts, so set before anything imports jax (noxfile.py does the same)."""
    if glob.glob("/dev/accel*"):
        return
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
                if f.read().strip() == "0x1ae0" and g.read().strip() in _TPU_PCI_IDS:
                    return
        except OSError:
            continue
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


_quiet_libtpu_without_a_tpu()

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
    config.addinivalue_line(
        "markers", "skip_way(name, reason, ids): tests/ways: the test does not apply to that way"
    )
    config.addinivalue_line(
        "markers", "xfail_way(name, reason, raises, ids): tests/ways: that way's gap (strict)"
    )


def _way_of(item):
    """The tests/ways way an item runs (None: not run every way)."""
    way = getattr(getattr(item, "callspec", None), "params", {}).get("way")
    # The class's attribute: the instance's ``engine`` property skips when the way's package
    # (libtpu, Triton) is missing, which at collection would stop the whole session.
    return way if hasattr(type(way), "engine") else None


def _marks_this_way(mark, way, item) -> bool:
    """Whether a ``skip_way``/``xfail_way`` mark applies to ``item``: its way, and one of its
    ``ids`` (none: every parametrization) among the item's."""
    ids = mark.kwargs.get("ids") or ()
    return mark.args[0] == way.name and (not ids or bool(set(ids) & set(item.callspec.id.split("-"))))


def pytest_collection_modifyitems(config, items):
    for item in items:  # tests/ways' per-way marks on tests of a class run every way
        way = _way_of(item)
        for mark in item.iter_markers("skip_way") if way else ():
            if _marks_this_way(mark, way, item):
                item.add_marker(pytest.mark.skip(reason=f"{way.name} way: {mark.kwargs['reason']}"))
        for mark in item.iter_markers("xfail_way") if way else ():
            if _marks_this_way(mark, way, item):
                reason, raises = f"{way.name} way: {mark.kwargs['reason']}", mark.kwargs.get("raises")
                item.add_marker(pytest.mark.xfail(strict=True, reason=reason, raises=raises))
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU: none found by jax.devices()")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A way's engine may run something before the test body (tests/ways/engine.py's
    ``before_call``): the compiled way, where JAX's lowering is wanted beside ours, runs the
    body once first with JAX's modules (compiled and recorded, never asserted) and the test
    then runs with JAX's kernels kept beside its way."""
    way = _way_of(pyfuncitem)
    if way is not None and "way" in pyfuncitem.funcargs:
        pyfuncitem.funcargs["way"] = way.engine.before_call(way, pyfuncitem)
    yield


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


@pytest.fixture(autouse=True)
def _interpreter_state_isolated():
    """Each test starts with no interpreter state left by an earlier one in this worker:
    a kernel's error never outlives its test, and no test depends on the order. A failed TPU
    interpret-mode kernel leaves its error on JAX's runtime tokens (re-raised by every
    later ``jax.effects_barrier()``), and the multi-device interpreter keeps its kernel
    sessions and the races found so far; pending effects of any interpreter are waited
    for here, so they land in the test that made them (a package not imported yet has
    no state to clear)."""
    if "jax" in sys.modules:
        import jax

        try:
            jax.effects_barrier()
        except Exception:  # an earlier test's error: already reported there
            pass
    if "pallas_tpu" in sys.modules:
        sys.modules["pallas_tpu"].reset_tpu_interpret_mode_state()
    yield


@pytest.fixture
def way(request):
    """The way a test runs its kernels (tests/ways' ``every_way``, which parametrizes this
    fixture); None in a test that is not run every way."""
    return getattr(request, "param", None)


@pytest.fixture(autouse=True)
def _way_runs_the_pallas_test(request, way):
    """A ``PallasTest`` (tests/core) run every way calls ``self.pallas_call`` that way:
    ``every_way()`` on its class or method is the whole change. ``INTERPRET`` is what that
    way passes as ``interpret=`` (None in the Mosaic way)."""
    if hasattr(way, "pallas_call"):
        way.skip_if_missing()
        if request.instance is not None:
            request.instance.pallas_call = way.pallas_call
            request.instance.INTERPRET = way.interpret()
    yield


# The run's profile (README, "Where CI's time goes"): pytest's --durations names single tests;
# these sum each test's setup, call and teardown by file and by way (the way's name in the test's
# id, e.g. ``test_ways[tpu_interpret-causal]``). Under xdist the workers' reports reach this
# hook in the controller, so the sums are of the whole run (CPU time of both workers).
_TIME_BY_FILE: dict[str, float] = {}
_TIME_BY_WAY: dict[str, float] = {}
_WAY_ID = re.compile(r"^(core_steps|core|triton|tpu_interpret|mosaic|jax_mosaic|compiled)(:|$)")


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _TIME_BY_FILE[path] = _TIME_BY_FILE.get(path, 0.0) + report.duration
    ids = report.nodeid.partition("[")[2].rstrip("]").split("-")
    way = next((m.group(1) for m in map(_WAY_ID.match, ids) if m), "(not every way)")
    _TIME_BY_WAY[way] = _TIME_BY_WAY.get(way, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _TIME_BY_FILE:
        return
    tr, total = terminalreporter, sum(_TIME_BY_FILE.values())
    tr.write_sep("=", f"time by test file: {total:.0f} s of tests in all (the 20 largest)")
    for path, t in sorted(_TIME_BY_FILE.items(), key=lambda kv: -kv[1])[:20]:
        tr.write_line(f"{t:8.1f} s  {100 * t / total:5.1f} %  {path}")
    tr.write_sep("=", "time by way")
    for way, t in sorted(_TIME_BY_WAY.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{t:8.1f} s  {100 * t / total:5.1f} %  {way}")
