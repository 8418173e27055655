"""jax-triton's autotuning winners live in jax_kernel_runtime's shared winner
cache: damaged files are misses that get rewritten, an unwritable directory
costs only the cache, and a tuning result goes to the package that asked for
it (pallas-gpu and jax-triton no longer take each other's records)."""

from __future__ import annotations

import json
import warnings

import pytest

from jax_kernel_runtime.triton import _cache
from jax_triton._src import autotune


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_TRITON_AUTOTUNE_DIR", str(tmp_path / "jt"))
    monkeypatch.setenv("PALLAS_GPU_CACHE_DIR", str(tmp_path / "pg"))
    monkeypatch.delenv("PALLAS_GPU_DISABLE_CACHE", raising=False)
    monkeypatch.setattr(_cache, "_pending", {})
    monkeypatch.setattr(_cache, "_seen_records", 0)
    autotune.WINNERS.forget()
    yield tmp_path
    autotune.WINNERS.forget()


CORRUPT = [b"[1, 2]", b'{"chosen": null}', b"-1", b"1e400", b'{"chosen": 1e400}', b'{"chosen": -2}',
           b'{"chosen": false}', b"\xff\xfe\x80", b"{", b"[" * 100000]  # fmt: skip


@pytest.mark.parametrize("data", CORRUPT, ids=range(len(CORRUPT)))
def test_corrupt_winner_file_is_a_miss_that_is_rewritten(fresh, data):
    path = fresh / "jt" / "k.json"
    path.parent.mkdir()
    path.write_bytes(data)
    assert autotune.lookup_winner("k") is None
    autotune.record_winner("k", 1, [2.0, 1.0])
    autotune.WINNERS.forget()
    assert autotune.lookup_winner("k") == 1
    assert json.loads(path.read_text()) == {"chosen": 1, "times_ms": [2.0, 1.0]}


def test_winner_out_of_range_is_a_miss(fresh):
    autotune.record_winner("k", 5)
    autotune.WINNERS.forget()
    assert autotune.lookup_winner("k", num_configs=2) is None
    assert autotune.lookup_winner("k", num_configs=6) == 5


def test_unwritable_dir_warns_once_and_keeps_winners_in_memory(fresh, monkeypatch):
    blocker = fresh / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("JAX_TRITON_AUTOTUNE_DIR", str(blocker / "winners"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autotune.record_winner("a", 0)
        autotune.record_winner("b", 1)
    msgs = [str(w.message) for w in caught if "cannot write to the cache directory" in str(w.message)]
    assert len(msgs) == 1 and "jax_triton (JAX_TRITON_AUTOTUNE_DIR)" in msgs[0] and str(blocker) in msgs[0]
    assert autotune.lookup_winner("a") == 0 and autotune.lookup_winner("b") == 1


def test_records_go_to_the_package_that_expects_them(fresh, monkeypatch):
    from pallas_gpu._src.compile import autotune as pallas_autotune

    records = [("jt_key", 0, 1, [2.0, 1.0]), ("pg_key", 0, 0, [1.0, 3.0]), ("nobody", 0, 1, [])]
    monkeypatch.setattr(_cache, "tune_records", lambda: list(records))
    pallas_autotune.winners().forget()
    autotune.expect_tuning("jt_key")
    pallas_autotune.expect_tuning("pg_key")
    assert autotune.lookup_winner("jt_key") == 1
    assert sorted(p.name for p in (fresh / "jt").iterdir()) == ["jt_key.json"]
    assert sorted(p.name for p in (fresh / "pg" / "autotune").iterdir()) == ["pg_key.json"]
    assert autotune.lookup_winner("pg_key") is None  # not jax-triton's
    assert pallas_autotune.lookup_winner("pg_key") == 0
