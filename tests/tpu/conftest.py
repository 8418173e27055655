"""pytest configuration for the pallas-tpu tests.

Puts this folder on ``sys.path`` so test modules can import its helpers
(``chip_bundle``) under both pytest import modes (the
ways, tests/ways, are on it from tests/conftest.py), and registers the
``interpret_only`` marker: a test that checks what only TPU interpret mode does
(race detection, uninitialized-memory poisoning, DMA execution order, the
interpreter's error messages and ``InterpretParams`` knobs, deadlock detection)
and so does not run the TPU ways. ``pytest -m interpret_only --collect-only -q``
counts them. The terminal summary sums the compiled way's compile report.
"""

import collections
import json
import os
import sys
import tempfile

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    # The compiled way records each libtpu compile here (ways.compiled.record_compile); set before
    # pytest-xdist starts its workers, which inherit it.
    if not os.environ.get("PALLAS_TPU_COMPILE_REPORT"):
        os.environ["PALLAS_TPU_COMPILE_REPORT"] = tempfile.mkdtemp(prefix="pallas-tpu-compiles-")
    config.addinivalue_line(
        "markers",
        "interpret_only(reason): checks TPU-interpret-mode-only behaviour, so it does not run three ways",
    )


def pytest_terminal_summary(terminalreporter):
    """Counts of the compiled way: per chip, the kernels libtpu compiled from our
    lowering and from JAX's, and those only ours gets through."""
    folder = os.environ.get("PALLAS_TPU_COMPILE_REPORT")
    rows = []
    for name in os.listdir(folder) if folder and os.path.isdir(folder) else ():
        with open(os.path.join(folder, name)) as fh:
            rows += [json.loads(line) for line in fh if line.strip()]
    if not rows:
        return
    tr = terminalreporter
    on_chip = [r for r in rows if r["chip"] == "chip"]
    rows = [r for r in rows if r["chip"] != "chip"]
    if on_chip:
        tr.section("TPU kernels run on this chip (the compiled way): ours against JAX's lowering")
        agreement = collections.Counter(r["agreement"].split(" (")[0] for r in on_chip)
        tr.write_line(f"{len(on_chip)} kernels: " + ", ".join(f"{k} {v}" for k, v in agreement.most_common()))
        for r in on_chip:
            if not r["agreement"].startswith(("equal", "close")):
                tr.write_line(f"  {r['test']}: {r['agreement']}")
    by = collections.defaultdict(dict)  # (chip, test) -> lowering -> outcome
    for r in rows:
        by[r["chip"], r["test"]][r["lowering"]] = r["outcome"]
    if not by:
        return
    tr.section("TPU kernels compiled by libtpu (the compiled way)")
    for chip in sorted({c for c, _ in by}):
        tests = [v for (c, _), v in by.items() if c == chip]
        count = collections.Counter
        ours, jax_ = count(t.get("ours") for t in tests), count(t.get("jax") for t in tests)
        only = sum(1 for t in tests if t.get("ours") == "compiled" and t.get("jax") != "compiled")
        theirs = (
            f"JAX's compiled {jax_['compiled']}, refused by Mosaic {jax_['refused by Mosaic']}, "
            f"refused by JAX's lowering {jax_['refused by its lowering']}; compiled from ours only {only}"
            if any("jax" in t for t in tests)
            else "JAX's lowering not compiled beside ours (PALLAS_TPU_JAX_BESIDE=1 does: ways.jax_beside.wanted)"
        )
        tr.write_line(
            f"{chip}: {len(tests)} tests; ours compiled {ours['compiled']}, refused by Mosaic "
            f"{ours['refused by Mosaic']}; {theirs}"
            + (
                f"; the chip lacks a feature the kernel needs: {ours['lacks the feature']}"
                if ours["lacks the feature"]
                else ""
            )
        )


@pytest.fixture(autouse=True)
def _no_kernel_error_outlives_its_test():
    """A kernel's error stays on JAX's runtime tokens and would fail the next test's
    effects_barrier() in this worker: each test starts clean."""
    yield
    from pallas_tpu._src import compat

    compat.forget_failed_effects()


@pytest.fixture
def fresh_sessions():
    """Multi-device TPU interpret mode with no sessions left from earlier tests and a
    20 s deadlock timeout, restored afterwards."""
    from pallas_tpu._src.interpret import multi as interpret_multi

    old = interpret_multi.set_deadlock_timeout(20)
    interpret_multi.reset_tpu_interpret_mode_state()
    yield
    interpret_multi.reset_tpu_interpret_mode_state()
    interpret_multi.set_deadlock_timeout(old)
