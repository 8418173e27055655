"""pytest plugin for running tokamax's own tests on one Pallas or the other.

Loaded by ``run_tokamax.py`` into a pytest run over tokamax's installed test files
(``-p tokamax_plugin``, this folder on ``PYTHONPATH``):

``--pallas=ours``
    tokamax's modules, its tests included, are loaded with their Pallas imports
    rewritten to ours (``pallas_rewrite``); ``--pallas=jax`` leaves them on JAX's.
``--way=gpu``
    Pallas Triton kernels compile and run on the GPU as tokamax wrote them (the
    default ``--way=interpret`` runs them in interpret mode, for a CPU).
``--way=compiled``
    as ``interpret``, and after each test every TPU ``pallas_call`` it traced is
    lowered by the side's Pallas and compiled by libtpu's Mosaic for v5e and v6e
    (``tpu_compiled.py``); the outcomes go to the report.
``--tpu-kind=v5e`` (also ``v6e``, ``v5p``, ``v4``)
    tokamax is shown a TPU of that generation while every kernel still runs in TPU
    interpret mode on the CPU: ``jax.default_backend()`` says ``"tpu"`` and each test
    runs under ``jax.sharding.use_abstract_mesh`` of an empty mesh whose abstract
    device has that device kind (what JAX's and our ``get_tpu_info()`` read), so the
    tests tokamax gates on a TPU backend or generation run. Anything that asks a
    device itself (``jax.devices()[0].device_kind``) still sees the CPU.
``--downstream-report=PATH``
    writes ``{test id: [outcome, message, kernels, seconds, compiled]}`` as JSON at
    the end of the run: outcome ``passed``, ``failed``, ``skipped`` or ``error``;
    kernels: how many ``pallas_call``/``pl.kernel`` calls the test made (0 where
    tokamax reused a kernel a test before it traced); compiled (``--way=compiled``):
    ``[[kernel, chip, outcome, message], ...]`` of the TPU kernels it traced.

What the two runs share, so that tokamax's kernels run on a CPU at all:

* TPU interpret mode is the default for every kernel (``set_tpu_interpret_mode`` of
  JAX's or of our TPU package): on a CPU, JAX's Pallas runs nothing else.
* A kernel whose compiler params are the Triton backend's runs in plain interpret
  mode (``interpret=True``), the interpreter JAX has for Triton kernels.
* tokamax's own ``cross_compile`` option is on: its ops otherwise refuse a CPU device
  (``NotImplementedError: Not supported on cpu``) before any kernel is traced.
"""

from __future__ import annotations

import collections
import functools
import json
import os

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("downstream")
    group.addoption("--pallas", choices=("jax", "ours"), default="jax", help="whose Pallas tokamax runs on")
    group.addoption("--downstream-report", default=None, help="JSON file of outcomes per test")
    group.addoption(
        "--way",
        choices=("interpret", "gpu", "compiled"),
        default="interpret",
        help="interpret: Pallas Triton kernels in interpret mode (a CPU); gpu: compiled and run on the GPU;"
        " compiled: interpret, and each TPU kernel traced lowered and compiled by libtpu for v5e and v6e",
    )
    group.addoption(
        "--tpu-kind",
        choices=tuple(_TPU_KINDS),
        default=None,
        help="show tokamax a TPU of this generation (default backend 'tpu', an abstract mesh of its device"
        " kind); kernels still run in TPU interpret mode",
    )


# --tpu-kind: the device kind JAX names each generation by, and its TensorCores per device.
_TPU_KINDS = {
    "v4": ("TPU v4", 2),
    "v5e": ("TPU v5 lite", 1),
    "v5p": ("TPU v5p", 2),
    "v6e": ("TPU v6 lite", 1),
}


def _show_tpu() -> None:
    import jax

    jax.default_backend = lambda: "tpu"  # tokamax's gate; JAX's internals use their own


def _tpu_context(kind: str | None):
    import contextlib

    if kind is None:
        return contextlib.nullcontext()
    import jax

    device_kind, cores = _TPU_KINDS[kind]
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=cores, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def _is_triton(compiler_params, triton_params_type) -> bool:
    return isinstance(compiler_params, triton_params_type) or (
        isinstance(compiler_params, dict) and "triton" in compiler_params
    )


_CALLS = [0]  # pallas_call and pl.kernel calls made by the running test


def _counted(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _CALLS[0] += 1
        return fn(*args, **kwargs)

    return wrapper


def _interpret_jax(triton_interpreted: bool = True) -> None:
    import jax.experimental.pallas as jpl
    from jax.experimental.pallas import tpu as jpltpu
    from jax.experimental.pallas import triton as jpltriton

    original = jpl.pallas_call
    if not triton_interpreted:
        # On a GPU: kernels compile as tokamax wrote them (its TPU tests skip there); only counted.
        jpl.pallas_call = _counted(original)
        jpl.kernel = _counted(jpl.kernel)
        return
    jpltpu.set_tpu_interpret_mode(jpltpu.InterpretParams())

    @functools.wraps(original)
    def pallas_call(*args, **kwargs):
        if not _is_triton(kwargs.get("compiler_params"), jpltriton.CompilerParams):
            return original(*args, **kwargs)
        kwargs["interpret"] = kwargs.get("interpret") or True

        # JAX's forced TPU interpret mode wins over `interpret=`: lift it for this kernel.
        with jpltpu.force_tpu_interpret_mode(None):
            call = original(*args, **kwargs)

        @functools.wraps(call)
        def run(*a, **k):
            with jpltpu.force_tpu_interpret_mode(None):
                return call(*a, **k)

        return run

    jpl.pallas_call = _counted(pallas_call)
    jpl.kernel = _counted(jpl.kernel)


def _interpret_ours(triton_interpreted: bool = True) -> None:
    import pallas as pl
    import pallas_gpu
    import pallas_tpu as pltpu

    original = pl.pallas_call
    if not triton_interpreted:
        pl.pallas_call = _counted(original)
        pl.kernel = _counted(pl.kernel)
        return
    pltpu.set_tpu_interpret_mode(pltpu.InterpretParams())

    @functools.wraps(original)
    def pallas_call(*args, **kwargs):
        if not _is_triton(kwargs.get("compiler_params"), pallas_gpu.CompilerParams):
            return original(*args, **kwargs)
        kwargs["interpret"] = kwargs.get("interpret") or True

        # The forced TPU interpret mode wins over `interpret=` (as JAX's): lift it for this kernel.
        with pltpu.force_tpu_interpret_mode(None):
            call = original(*args, **kwargs)

        @functools.wraps(call)
        def run(*a, **k):
            with pltpu.force_tpu_interpret_mode(None):
                return call(*a, **k)

        return run

    pl.pallas_call = _counted(pallas_call)
    pl.kernel = _counted(pl.kernel)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _CALLS[0] = 0
    with _tpu_context(item.config.getoption("tpu_kind")):
        yield
    item.user_properties.append(("pallas_calls", _CALLS[0]))
    if item.config.getoption("way") == "compiled":
        import tpu_compiled

        rows = tpu_compiled.compile_recorded(item.config.getoption("pallas"))
        item.user_properties.append(("tpu_compiled", rows))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Before tokamax's conftest.py, the first tokamax module pytest imports.
    ns = early_config.known_args_namespace
    interpreted = ns.way in ("interpret", "compiled")
    if ns.tpu_kind is not None:
        _show_tpu()
    if ns.way == "compiled":
        import tpu_compiled

        tpu_compiled.record(ns.pallas)
    if ns.pallas == "ours":
        import pallas_rewrite

        pallas_rewrite.install("tokamax")
        _interpret_ours(interpreted)
    else:
        _interpret_jax(interpreted)


def pytest_configure(config):
    config.addinivalue_line("markers", "long: tokamax's mark for long tests")
    from absl import flags
    from tokamax._src import config as tokamax_config  # noqa: F401  (defines the flag)

    # On a CPU only: on a GPU tokamax's ops run where they are.
    flags.FLAGS.tokamax_cross_compile = config.getoption("way") != "gpu"
    config._downstream = {}


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid or "?", "error", _message(report))


def _message(report) -> str:
    """The exception's type and first line, as pytest's short summary shows it."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.strip().splitlines()[0][:300] if crash.message.strip() else ""
    lines = str(report.longrepr).strip().splitlines()
    errs = [x[2:].strip() for x in lines if x.startswith("E ")]
    return (errs[0] if errs else (lines[-1] if lines else ""))[:300]


_OUTCOMES: dict[str, list] = {}
_SUBTESTS: dict[str, collections.Counter] = {}
_SKIPPED_SUBTEST: dict[str, str] = {}


def _skip_reason(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return str(reason)[:300]


def _resolve_subtests() -> None:
    """A test whose subtests all skipped ran nothing: it counts as skipped, not passed."""
    for nodeid, counts in _SUBTESTS.items():
        out = _OUTCOMES.get(nodeid)
        if out is not None and out[0] == "passed" and counts["passed"] == 0 and counts["skipped"]:
            out[0], out[1] = "skipped", f"every subtest skipped: {_SKIPPED_SUBTEST.get(nodeid, '')}"


def _record(nodeid: str, outcome: str, msg: str, calls: int = 0, seconds: float = 0.0) -> None:
    old = _OUTCOMES.get(nodeid)
    seconds = round(seconds + (old[3] if old else 0.0), 2)
    if old is not None and old[0] in ("failed", "error", "skipped"):
        old[3] = seconds  # the first bad phase decides
        return
    _OUTCOMES[nodeid] = [outcome, msg, max(calls, old[2] if old else 0), seconds]


_COMPILED: dict[str, list] = {}  # test id -> [[kernel, chip, outcome, message], ...]


def pytest_runtest_logreport(report):
    calls = dict(report.user_properties).get("pallas_calls", 0)
    if type(report).__name__ != "SubtestReport" and report.when == "call":
        _COMPILED.setdefault(report.nodeid, []).extend(dict(report.user_properties).get("tpu_compiled", []))
    if type(report).__name__ == "SubtestReport":  # unittest's subTest, pytest >= 9
        _SUBTESTS.setdefault(report.nodeid, collections.Counter())[report.outcome] += 1
        if report.failed:
            _record(
                report.nodeid,
                "failed",
                f"subtest {getattr(getattr(report, 'context', None), 'msg', None) or ''}: {_message(report)}",
            )
        elif report.skipped and report.nodeid not in _SKIPPED_SUBTEST:
            _SKIPPED_SUBTEST[report.nodeid] = _skip_reason(report)
        return
    if report.when == "call" or report.failed or report.skipped:
        if report.skipped:
            _record(report.nodeid, "skipped", _skip_reason(report), 0, report.duration)
        elif report.failed:
            _record(
                report.nodeid,
                "failed" if report.when == "call" else "error",
                _message(report),
                calls,
                report.duration,
            )
        else:
            _record(report.nodeid, "passed", "", calls, report.duration)


def pytest_sessionfinish(session):
    path = session.config.getoption("downstream_report")
    if path and not hasattr(session.config, "workerinput"):
        _resolve_subtests()
        if session.config.getoption("way") == "compiled":
            for nodeid, out in _OUTCOMES.items():
                out.append(_COMPILED.get(nodeid, []))
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(_OUTCOMES, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
