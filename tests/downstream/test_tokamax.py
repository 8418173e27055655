"""The downstream driver's own tests, and a fixed subset of tokamax's tests on our Pallas.

The import rewrite is tested on sources written here (always). With tokamax
installed (the ``downstream`` nox session installs it; the default ``tests``
session does not, and these tests skip), its kernel modules are checked to load on
our packages, and the fixed subset ``subsets/ci.txt`` runs on JAX's Pallas and on
ours through ``run_tokamax.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pallas_rewrite  # noqa: E402
import run_tokamax  # noqa: E402

needs_tokamax = pytest.mark.skipif(
    importlib.util.find_spec("tokamax") is None,
    reason="tokamax is not installed (the downstream nox session installs it)",
)


# ---------------------------------------------------------------------------
# The rewrite, on sources written here.


def test_every_import_spelling_is_rewritten():
    src = textwrap.dedent(
        """\
        from jax.experimental import pallas as pl
        import jax.experimental.pallas as pl2  # pylint: disable=g-import
        from jax.experimental.pallas import tpu as pltpu
        import jax.experimental.pallas.tpu as pltpu2
        from jax.experimental.pallas import triton as plgpu
        import jax.experimental.pallas.triton as plgpu2
        def f():
            from jax.experimental import pallas as pl3
        """
    )
    assert pallas_rewrite.port_source(src, "m.py") == textwrap.dedent(
        """\
        import pallas as pl
        import pallas as pl2  # pylint: disable=g-import
        import pallas_tpu as pltpu
        import pallas_tpu as pltpu2
        import pallas_gpu as plgpu
        import pallas_gpu as plgpu2
        def f():
            import pallas as pl3
        """
    )


def test_modules_without_a_counterpart_keep_their_import():
    src = (
        "from jax.experimental.pallas import mosaic_gpu as plgpu\n"
        "from jax.experimental.pallas import tpu_sc as plsc\n"
        "from jax.experimental.pallas import fuser\n"
        "from jax.experimental import xla_metadata\n"
    )
    assert pallas_rewrite.port_source(src, "m.py") == src
    assert pallas_rewrite.kept_imports(src) == {"mosaic_gpu", "tpu_sc", "fuser"}


def test_a_mosaic_gpu_module_stays_wholly_on_jax():
    # tokamax's ragged_dot sm80 kernel builds pl.Element blocks for JAX's Mosaic GPU
    # pipeline, which refuses ours: the whole module keeps JAX's Pallas.
    src = (
        "from jax.experimental import pallas as pl\nfrom jax.experimental.pallas import mosaic_gpu as plgpu\n"
    )
    assert pallas_rewrite.port_source(src, "m.py") == src
    other = "from jax.experimental import pallas as pl\nfrom jax.experimental.pallas import tpu_sc as plsc\n"
    assert pallas_rewrite.port_source(other, "m.py").startswith("import pallas as pl\n")


@pytest.mark.parametrize(
    "line",
    [
        "from jax._src.pallas import core",
        "from jax._src.pallas.mosaic import lowering",
        "x = jax.experimental.pallas.tpu.VMEM",
        "from jax.experimental.pallas import tpu, triton",  # several names at once: not rewritten
    ],
)
def test_what_cannot_be_rewritten_refuses_to_load(line):
    with pytest.raises(pallas_rewrite.CannotRunUnchanged, match="still uses JAX's Pallas"):
        pallas_rewrite.port_source(line + "\n", "m.py")


def test_comments_and_strings_are_not_code():
    src = '"""Like jax._src.pallas.core."""\n# from jax._src.pallas import core\nx = 1  # jax.experimental.pallas\n'
    assert pallas_rewrite.port_source(src, "m.py") == src


def test_finder_loads_a_package_rewritten(tmp_path):
    pkg = tmp_path / "downstream_fake_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text(
        "from jax.experimental import pallas as pl\nfrom jax.experimental.pallas import tpu as pltpu\n"
    )
    # A .pyc of the unrewritten source must not be used: compile one first.
    code = f"""
import sys, compileall, importlib
compileall.compile_dir({str(pkg)!r}, quiet=1)
sys.path.insert(0, {str(tmp_path)!r}); sys.path.insert(0, {str(HERE)!r})
import pallas_rewrite
pallas_rewrite.install("downstream_fake_pkg")
import downstream_fake_pkg.kernels as k, pallas, pallas_tpu
assert k.pl is pallas and k.pltpu is pallas_tpu, (k.pl, k.pltpu)
try:
    pallas_rewrite.install("downstream_fake_pkg")
except RuntimeError as e:
    assert "already imported" in str(e)
else:
    raise AssertionError("a second install over imported modules must refuse")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# ---------------------------------------------------------------------------
# The comparison.


def test_compare_counts_and_reasons():
    jax = {
        "a::t1": ["passed", "", 1],
        "a::t2": ["passed", "", 2],
        "a::t3": ["passed", "", 0],
        "a::t4": ["failed", "E", 1],
        "a::t5": ["skipped", "no TPU", 0],
    }
    ours = {
        "a::t1": ["passed", "", 1],
        "a::t2": ["failed", "AssertionError", 2],
        "a::t3": ["error", "ImportError", 0],
        "a::t4": ["passed", "", 1],
        "a::t5": ["skipped", "no TPU", 0],
    }
    known = [("t3's cause", ["a::t3"]), ("a cause nothing shows", ["b::*"])]
    r = run_tokamax.compare(jax, ours, known)
    c = r["counts"]
    assert (c["tests"], c["run on the CPU"], c["pass on JAX"], c["pass on JAX and ours"]) == (5, 4, 3, 1)
    assert c["pass on JAX, calling a Pallas kernel"] == 2
    assert r["unexplained"] == ["a::t2"]
    assert [t for t, _ in r["fixed_on_ours"]] == ["a::t4"]
    assert r["stale"] == ["a cause nothing shows"]


def test_known_differences_file_parses():
    known = run_tokamax.load_known()
    for reason, patterns in known:
        assert reason.strip() and patterns, reason
        assert all(p.startswith("tokamax/") for p in patterns), patterns


def test_known_compiled_differences_parse():
    for reason, patterns in run_tokamax.load_known(table="compiled"):
        assert reason.strip() and patterns, reason
        assert all(p.startswith(("tokamax/", "ejkernel::")) for p in patterns), patterns


def test_compare_compiled_finds_kernels_only_jax_compiles():
    ok = ["compiled", ""]
    jax = {
        "t1": ["passed", "", 1, 0.1, [["k at a.py:1", "v5e", *ok], ["k at a.py:1", "v6e", *ok]]],
        "t2": ["passed", "", 1, 0.1, [["q at b.py:2", "v5e", *ok]]],
        "t3": ["failed", "", 1, 0.1, [["r at c.py:3", "v5e", "refused by lowering", "x"]]],
    }
    ours = {
        "t1": [
            "passed",
            "",
            1,
            0.1,
            [["k at a.py:9", "v5e", *ok], ["k at a.py:9", "v6e", "refused by Mosaic", "m"]],
        ],
        "t2": ["passed", "", 1, 0.1, []],
        "t3": ["passed", "", 1, 0.1, [["r at c.py:3", "v5e", *ok]]],
    }
    r = run_tokamax.compare_compiled(jax, ours, [("why", ["t2::q"])])
    assert [(d[0], d[1], d[2], d[4]) for d in r["differences"]] == [
        ("t1::k", "v6e", "refused by Mosaic", None),
        ("t2::q", "v5e", "missing", "why"),
    ]
    assert r["unexplained"] == ["t1::k"] and r["stale"] == []
    assert r["counts"][("ours", "v5e")]["compiled"] == 2 and r["tests"] == {"jax": 3, "ours": 2}


# ---------------------------------------------------------------------------
# tokamax itself.


@needs_tokamax
def test_tokamax_kernel_modules_load_on_our_packages():
    """The Pallas Triton attention and a Pallas TPU kernel module, rewritten, hold our
    modules (in a fresh process: tokamax must not be imported before the rewrite)."""
    code = f"""
import sys; sys.path.insert(0, {str(HERE)!r})
import pallas_rewrite; pallas_rewrite.install("tokamax")
import pallas, pallas_gpu, pallas_tpu
from tokamax._src.ops.attention import pallas_triton
from tokamax._src.ops.attention import pallas_mosaic_tpu
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
assert pallas_triton.pl is pallas and pallas_triton.plgpu is pallas_gpu
assert pallas_mosaic_tpu.pltpu is pallas_tpu
assert splash.pl is pallas and splash.pltpu is pallas_tpu
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@needs_tokamax
def test_selection_finds_pallas_tests_and_lists_mosaic_gpu_ones():
    root = Path(importlib.util.find_spec("tokamax").origin).parent
    sel = run_tokamax.select(root)
    names = {str(f.relative_to(root)) for f in sel.run}
    assert "_src/ops/attention/pallas_triton_test.py" in names
    assert "_src/ops/attention/pallas_mosaic_tpu_test.py" in names
    skipped = {str(f.relative_to(root)): r for f, r in sel.skipped.items()}
    assert "Mosaic GPU" in skipped["_src/ops/attention/pallas_mosaic_gpu_test.py"]


@needs_tokamax
def test_ci_subset_passes_on_ours_where_it_passes_on_jax(tmp_path):
    """The fixed subset (subsets/ci.txt) on both Pallas: every test that passes on
    JAX's passes on ours (or has its reason in known_differences.toml), and the
    subset really runs kernels: most of its tests pass on JAX calling one."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_tokamax.py"), "--subset", "ci", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(proc.stdout[-5000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    jax = json.loads((out / "jax.json").read_text())
    with_kernels = [t for t, (outcome, _, calls, *_) in jax.items() if outcome == "passed" and calls > 0]
    assert len(with_kernels) >= 0.8 * len(run_tokamax._subset("ci")), len(with_kernels)
