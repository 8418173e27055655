"""``jax_kernel_runtime.prepare_triton``: the memoized Triton cache key is
the one Triton computes, is recomputed when Triton's files change, survives a
corrupt or unwritable memo, and the background preparation started by
``import pallas_gpu`` / ``import jax_triton`` is safe to fork over and can be
turned off.

Each case runs in a fresh interpreter: the memo replaces a Triton function
for the whole process, and the background thread starts at import."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")


def run(code: str, tmp_path, timeout: int = 120, **env: str) -> str:
    environ = {**os.environ, "JAX_KERNEL_RUNTIME_CACHE_DIR": str(tmp_path / "memo"), **env}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


MEMO_MATCHES_TRITON = """
    import jax_kernel_runtime as jkr
    from triton.runtime import cache
    assert jkr.memoize_triton_key()
    memo = cache.triton_key()
    print(memo == cache.triton_key.__wrapped__(), cache.triton_key.__wrapped__ is not cache.triton_key)
"""


def memo_files(tmp_path):
    d = tmp_path / "memo"
    return sorted(d.glob("triton-key-*.txt")) if d.exists() else []


def test_memoized_key_is_tritons_key_and_is_reused(tmp_path):
    assert run(MEMO_MATCHES_TRITON, tmp_path) == "True True"
    (path,) = memo_files(tmp_path)
    # A second process reads the memo instead of hashing Triton again: make
    # the stored key recognizable and check that it is what Triton now sees.
    real = path.read_text()
    path.write_text(real + "-read-from-memo")
    out = run(
        """
        import jax_kernel_runtime as jkr
        from triton.runtime import cache
        jkr.memoize_triton_key()
        print(cache.triton_key().endswith("-read-from-memo"))
        """,
        tmp_path,
    )
    assert out == "True"


def test_changed_triton_files_recompute_the_key(tmp_path):
    run(MEMO_MATCHES_TRITON, tmp_path)
    (path,) = memo_files(tmp_path)
    path.write_text(path.read_text() + "-stale")
    # Another fingerprint stands for a Triton whose files changed (size,
    # mtime or inode): the stale memo must not be used.
    out = run(
        """
        import jax_kernel_runtime.triton._prepare as t
        real = t._fingerprint
        t._fingerprint = lambda *a: "stale-" + real(*a)  # never the real one (a hex digest)
        from triton.runtime import cache
        t.memoize_triton_key()
        print(cache.triton_key() == cache.triton_key.__wrapped__())
        """,
        tmp_path,
    )
    assert out == "True"
    assert len(memo_files(tmp_path)) == 2


def test_corrupt_memo_is_recomputed(tmp_path):
    run(MEMO_MATCHES_TRITON, tmp_path)
    (path,) = memo_files(tmp_path)
    path.write_text("garbage")  # truncated or foreign: does not start with the version
    assert run(MEMO_MATCHES_TRITON, tmp_path) == "True True"
    assert path.read_text() != "garbage"


def test_memo_that_is_not_utf8_is_recomputed(tmp_path):
    run(MEMO_MATCHES_TRITON, tmp_path)
    (path,) = memo_files(tmp_path)
    path.write_bytes(b"\xff\xfe3.6.0\x80")
    assert run(MEMO_MATCHES_TRITON, tmp_path) == "True True"
    assert path.read_text(encoding="utf-8") != "3.6.0"


def test_unwritable_memo_dir_still_compiles_keys(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = run(MEMO_MATCHES_TRITON, tmp_path, JAX_KERNEL_RUNTIME_CACHE_DIR=str(blocker / "memo"))
    assert out == "True True"


@pytest.mark.parametrize("package", ["pallas_gpu", "jax_triton"])
def test_import_prepares_triton_in_the_background(tmp_path, package):
    out = run(
        f"""
        import sys, {package}
        import jax_kernel_runtime.triton._prepare as t
        assert t._background is not None
        t._background.join(60)
        print("triton.compiler.code_generator" in sys.modules, t._prepared)
        """,
        tmp_path,
    )
    assert out == "True True"
    assert len(memo_files(tmp_path)) == 1


def test_background_preparation_can_be_turned_off(tmp_path):
    out = run(
        """
        import sys, pallas_gpu
        import jax_kernel_runtime.triton._prepare as t
        print(t._background is None, "triton" in sys.modules)
        """,
        tmp_path,
        JAX_KERNEL_RUNTIME_BACKGROUND_PREPARE="0",
    )
    assert out == "True False"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_right_after_import_does_not_deadlock(tmp_path):
    # The child must not inherit a half-done import of Triton (a held import
    # lock would hang it): the fork waits for the background thread.
    out = run(
        """
        import os, sys, warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        import pallas_gpu
        pid = os.fork()
        if pid == 0:
            import triton.compiler.code_generator
            import triton.language as tl
            os._exit(0 if tl.arange is not None else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """,
        tmp_path,
        timeout=120,
    )
    assert out == "0"


def test_short_scripts_exit_cleanly_while_triton_is_being_prepared(tmp_path):
    # With a cold memo the background thread is still hashing Triton (inside
    # libtriton) when such a script ends; a daemon thread there aborted the
    # interpreter's shutdown about one run in six (pybind11 dec_ref without
    # the GIL, exit 134). Many at once, so the CPU is busy as in the report.
    procs, failures = [], []
    for i in range(24):
        env = {
            **os.environ,
            "JAX_KERNEL_RUNTIME_CACHE_DIR": str(tmp_path / f"memo{i}"),
            "JAX_PLATFORMS": "cpu",
        }
        package = ("pallas_gpu", "jax_triton")[i % 2]
        procs.append(
            subprocess.Popen([sys.executable, "-c", f"import {package}"], env=env, stderr=subprocess.PIPE)
        )
        if len(procs) >= 8 or i == 23:
            for p in procs:
                _, err = p.communicate(timeout=300)
                if p.returncode != 0:
                    failures.append((p.returncode, err.decode(errors="replace")[-500:]))
            procs = []
    assert not failures, failures
