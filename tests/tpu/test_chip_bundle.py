"""``scripts/tpu_chip_export.py`` and ``scripts/tpu_chip_run.py``: how our Mosaic kernels
reach the lent TPU v5e, whose JAX (0.10.2) is older than ours. Here the bundle is exported
and then compiled back by the runner with libtpu for a compile-only v5e: every Mosaic module
serialized again from its text, every kernel through libtpu's Mosaic compiler."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pallas_tpu._src.mosaic import compile_check

pytestmark = pytest.mark.skipif(
    not compile_check.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]"'
)
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _run(*args):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    exp = _run(SCRIPTS / "tpu_chip_export.py", "--out", out)
    assert exp.returncode == 0, exp.stderr[-3000:]
    return out


def _entries(bundle):
    return {p.name[: -len(".json")]: json.loads(p.read_text()) for p in bundle.glob("*.json")}


def test_exported_kernels_compile_again_from_their_mosaic_text(bundle, tmp_path):
    entries = _entries(bundle)
    assert len(entries) == 8
    assert sorted(e["custom_calls"] for e in entries.values()) == [1, 1, 1, 1, 1, 1, 3, 3]
    assert all(e["jax_custom_calls"] == e["custom_calls"] for e in entries.values())
    for stem, e in entries.items():
        assert (bundle / f"{stem}.exported").exists() and (bundle / f"{stem}.jax.exported").exists()
        assert 1 <= len(e["mosaic"]) <= 2 * e["custom_calls"]  # ours and JAX's, a shared module once
    run = _run(SCRIPTS / "tpu_chip_run.py", bundle, "--compile-only", "--out", tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "tpu_chip_run.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["ok"] for r in rows)
    assert "8 of 8 kernels ok" in run.stdout


def test_a_module_missing_from_the_bundle_fails_its_kernel(bundle, tmp_path):
    bundle = Path(shutil.copytree(bundle, tmp_path / "copy"))
    path = next(iter(sorted(bundle.glob("*.json"))))
    entry = json.loads(path.read_text())
    entry["mosaic"] = dict(list(entry["mosaic"].items())[1:])
    path.write_text(json.dumps(entry))
    run = _run(SCRIPTS / "tpu_chip_run.py", bundle, "--compile-only", "--out", tmp_path)
    assert run.returncode == 1
    assert "holds no text for the Mosaic module" in run.stdout
    assert "7 of 8 kernels ok" in run.stdout


def test_the_runner_compares_nans_infinities_and_integers_as_a_tpu_check_should():
    sys.path.insert(0, str(SCRIPTS))
    import tpu_chip_run as r

    nan, inf = float("nan"), float("inf")
    assert r._rel([1.0, nan, -inf], [1.0, nan, -inf]) == 0.0
    assert r._rel([1.0, nan], [1.0, 2.0]) == inf
    assert r._rel([1.0, inf], [1.0, -inf]) == inf
    assert r._rel([1.0, 2.5], [1.0, 2.0]) == 0.25
    assert r._rel([[1.0]], [1.0]) == inf
    ints = np.array([7, -3], np.int32)
    assert r._check([ints], [ints], 0.5) == ([0.0], True)
    assert r._check([ints + 1], [ints], 0.5)[1] is False  # integers must be equal, whatever the tolerance
    assert r._check([np.float32([1.0, 2.01])], [np.float32([1.0, 2.0])], 0.01)[1] is True
