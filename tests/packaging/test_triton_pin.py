"""jax-triton-bridge's Triton pin (commit + libtriton.so hash, checked at import)
and its refusal to share the ``jax_triton`` package with upstream jax-triton."""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import subprocess
import sys
import textwrap
import warnings
from importlib import metadata

import pytest

from jax_triton._src import triton_pin


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_KERNEL_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _record(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture
def fake_libtriton(tmp_path, monkeypatch):
    """A stand-in libtriton.so of random bytes, declared to be the installed one."""
    path = tmp_path / "libtriton.so"
    path.write_bytes(os.urandom(100_000))
    monkeypatch.setattr(triton_pin, "_libtriton_path", lambda: str(path))
    monkeypatch.setattr(triton_pin, "VALIDATED_TRITON_VERSION", metadata.version("triton"))
    return path


def _pin_to(monkeypatch, digest: str, size: int) -> None:
    key = (f"cp{sys.version_info[0]}{sys.version_info[1]}", platform.machine())
    monkeypatch.setattr(triton_pin, "VALIDATED_LIBTRITON", {key: (digest, size)})


def test_installed_triton_against_the_pin(cache_dir):
    installed = metadata.version("triton")
    problem = triton_pin.pin_problem()
    if installed == triton_pin.VALIDATED_TRITON_VERSION:
        # The PyPI wheel (CI and the dev machines install it): the hash matches, and the
        # second look reads the memo instead of hashing 400 MB again.
        assert problem is None
        memos = list(cache_dir.glob("libtriton-sha256-*.json"))
        key = (f"cp{sys.version_info[0]}{sys.version_info[1]}", platform.machine())
        assert len(memos) == (1 if key in triton_pin.VALIDATED_LIBTRITON else 0)
    else:  # tests_newest runs the newest Triton on purpose
        assert problem == f"triton {installed} is installed"
        assert (
            triton_pin.fix_command(problem) == f'pip install "triton=={triton_pin.VALIDATED_TRITON_VERSION}"'
        )


def test_hash_is_the_wheel_record_form_and_memoized(cache_dir, fake_libtriton, monkeypatch):
    expected = _record(fake_libtriton.read_bytes())
    assert triton_pin.libtriton_sha256(str(fake_libtriton)) == expected
    (memo,) = cache_dir.glob("libtriton-sha256-*.json")
    # A memo hit does not read the file: make reading it fail.
    real_open = open

    def no_library_reads(path, *a, **k):
        assert str(path) != str(fake_libtriton), "hashed again despite the memo"
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", no_library_reads)
    assert triton_pin.libtriton_sha256(str(fake_libtriton)) == expected
    monkeypatch.setattr("builtins.open", real_open)
    # A damaged memo is a miss, rewritten.
    memo.write_bytes(b"\xff not json")
    assert triton_pin.libtriton_sha256(str(fake_libtriton)) == expected
    # A changed file (new size and mtime) is hashed again.
    fake_libtriton.write_bytes(os.urandom(50_000))
    assert triton_pin.libtriton_sha256(str(fake_libtriton)) == _record(fake_libtriton.read_bytes())


def test_same_version_other_build_is_named_with_the_fix(cache_dir, fake_libtriton, monkeypatch):
    data = fake_libtriton.read_bytes()
    _pin_to(monkeypatch, _record(data), len(data))
    assert triton_pin.pin_problem() is None
    other = _record(data + b"x")
    _pin_to(monkeypatch, other, len(data))
    problem = triton_pin.pin_problem()
    assert f"sha256 {_record(data)}, expected {other}" in problem and str(fake_libtriton) in problem
    assert "--force-reinstall" in triton_pin.fix_command(problem)
    _pin_to(monkeypatch, _record(data), len(data) + 1)  # another size: no hashing needed
    assert f"(size {len(data)}, expected {len(data) + 1})" in triton_pin.pin_problem()


def test_warns_once_with_the_fix_and_can_be_silenced(cache_dir, fake_libtriton, monkeypatch):
    _pin_to(monkeypatch, "not-the-hash", fake_libtriton.stat().st_size)
    monkeypatch.setattr(triton_pin, "_checked", False)
    monkeypatch.delenv("JAX_TRITON_PIN_CHECK", raising=False)  # tests_newest sets it to 0
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        triton_pin.check_triton_pin()
        triton_pin.check_triton_pin()
    assert len(w) == 1 and issubclass(w[0].category, RuntimeWarning)
    message = str(w[0].message)
    assert triton_pin.VALIDATED_TRITON_COMMIT[:12] in message
    assert 'Fix: pip install --force-reinstall --no-deps --only-binary=:all: "triton==' in message
    monkeypatch.setattr(triton_pin, "_checked", False)
    monkeypatch.setenv("JAX_TRITON_PIN_CHECK", "0")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        triton_pin.check_triton_pin()
    assert w == []


def _import_with_fake_dist(tmp_path, name: str, version: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    script = "import warnings; warnings.simplefilter('ignore'); import jax_triton; print('imported')"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True
    )


def test_upstream_jax_triton_installed_beside_us_is_an_import_error(tmp_path):
    r = _import_with_fake_dist(tmp_path, "jax-triton", "0.4.1")
    assert r.returncode != 0
    assert (
        "ImportError: jax-triton 0.4.1 (the upstream project) and jax-triton-bridge are both installed"
        in r.stderr
    )
    assert "pip uninstall -y jax-triton jax-triton-bridge && pip install jax-triton-bridge" in r.stderr


def test_other_distributions_do_not_trip_the_upstream_check(tmp_path):
    r = _import_with_fake_dist(tmp_path, "jax-triton-extras", "0.1.0")
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr
