"""The rule that picks what CI's two other ends of the version range run (tests/version_dependent.py,
noxfile.py's docstring): on files written here, and on the suite itself."""

from __future__ import annotations

import os
import textwrap

import pytest
import version_dependent as vd


def write(folder, name, text):
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("from jax._src import core\n", "jax"),
        ("import jax\nOLD = jax.__version_info__ < (0, 11)\n", "jax"),
        ("import jax\nHAS = hasattr(jax.lax, 'pvary')\n", "jax"),
        ("import importlib.util\nimportlib.util.find_spec('libtpu')\n", "libtpu"),
        ("import triton.language as tl\n", "triton"),
        (
            "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'from jax._src import core'])\n",
            "jax",
        ),
        ("import pallas\n", "jax"),  # through pallas-core's compat module
    ],
)
def test_a_site_is_found_in_the_file_its_helpers_and_our_packages(tmp_path, source, kind):
    path = write(tmp_path, "test_x.py", source)
    chain = vd.why(path, (kind,))
    assert chain is not None and chain[-1].startswith(f"{kind}: "), chain
    others = tuple(k for k in ("jax", "libtpu", "triton") if k != kind)
    if kind != "jax" or "pallas" not in source:
        assert vd.why(path, others) is None


def test_prose_and_strings_of_a_file_that_runs_no_subprocess_are_not_code(tmp_path):
    path = write(
        tmp_path,
        "test_x.py",
        '''\
        """Checks what ``from jax._src import core`` would do; jax.__version__ is not read."""
        import ast
        SOURCE = "from jax._src import core"  # parsed, never run
        def test_it():
            """import triton"""
            assert ast.parse(SOURCE)
        ''',
    )
    assert vd.why(path, ("jax", "libtpu", "triton")) is None


def test_the_ends_run_what_reaches_a_site_and_the_reference_all():
    files = vd.test_files()
    assert "tests/test_version_dependent.py" in files and len(files) > 100
    oldest, newest = set(vd.selected("oldest")), set(vd.selected("newest"))
    assert oldest <= newest <= set(files)
    # Through the packages' compat modules, a helper script, the code a test runs in a subprocess.
    for f in (
        "tests/gpu/test_lowering.py",
        "tests/tpu/test_distributed.py",
        "tests/runtime/test_prepare_triton.py",
    ):
        assert f in oldest
    # Checks of our sources that never import JAX run in `tests` only.
    for f in ("tests/test_layering.py", "tests/test_version_dependent.py"):
        assert f not in newest
