"""The import rewrite's rules that ejkernel needed, and (with ejkernel installed) its
Pallas modules loading on our packages and two of its kernels run both ways.

ejkernel's own sources are read from the installed package at run time
(``run_ejkernel.py``); nothing of it is copied here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pallas_rewrite  # noqa: E402


def test_splash_mask_modules_keep_their_import():
    src = textwrap.dedent(
        """\
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_mask_info as mask_info_lib,
        )
        """
    )
    assert pallas_rewrite.port_source(src, "m.py") == src
    assert pallas_rewrite.kept_imports(src) == {"splash_attention_mask", "splash_attention_mask_info"}


def test_splash_kernel_import_still_refuses():
    # Split over lines, the kernel module beside a kept one: the check reads the import, not a line.
    src = "from jax.experimental.pallas.ops.tpu.splash_attention import (\n    splash_attention_mask,\n    splash_attention_kernel,\n)\n"
    with pytest.raises(pallas_rewrite.CannotRunUnchanged, match="line 1"):
        pallas_rewrite.port_source(src, "m.py")


def test_private_masked_load_store_of_a_triton_kernel():
    # ejkernel's GPU ragged decode attention: JAX's private primitives module for pl.load/pl.store.
    src = textwrap.dedent(
        """\
        from jax._src.pallas import primitives as pp
        from jax.experimental.pallas import triton as ptriton
        def k(x_ref, o_ref, m):
            pp.store(o_ref, (), pp.load(x_ref, (), mask=m), mask=m)
        """
    )
    out = pallas_rewrite.port_source(src, "m.py")
    assert out.splitlines()[0] == "import pallas_gpu as pp" and "import pallas_gpu as ptriton" in out
    # Another name of the private module, the module passed around, or no Triton import: refused.
    for bad in (
        src.replace("pp.load(", "pp.program_id(0) + pp.load("),
        src + "f = pp\n",
        src.replace("from jax.experimental.pallas import triton as ptriton\n", ""),
    ):
        with pytest.raises(pallas_rewrite.CannotRunUnchanged, match="jax._src.pallas"):
            pallas_rewrite.port_source(bad, "m.py")


def test_annotations_may_name_jax_types():
    src = "import jax\ndef f(op: jax._src.pallas.mosaic.primitives.AsyncCopyDescriptor) -> None:\n    op.wait()\n"
    assert pallas_rewrite.port_source(src, "m.py") == src
    with pytest.raises(pallas_rewrite.CannotRunUnchanged, match="line 3"):
        pallas_rewrite.port_source("import jax\nx = 1\nT = jax._src.pallas.mosaic.primitives.X\n", "m.py")


def test_refused_module_loads_as_a_stub(tmp_path):
    pkg = tmp_path / "downstream_fake_refusing"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .bad import kernel\nfrom .good import pl\n")
    (pkg / "bad.py").write_text("from jax._src.pallas import primitives\ndef kernel(): ...\n")
    (pkg / "good.py").write_text("from jax.experimental import pallas as pl\n")
    code = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r}); sys.path.insert(0, {str(HERE)!r})
import pallas_rewrite
refused = {{}}
pallas_rewrite.install("downstream_fake_refusing", refused=refused)
import downstream_fake_refusing as p, pallas
assert p.pl is pallas
assert list(refused) == ["downstream_fake_refusing.bad"], refused
try:
    p.kernel()
except pallas_rewrite.CannotRunUnchanged as e:
    assert "jax._src.pallas" in str(e), e
else:
    raise AssertionError("a refused module's names must raise when called")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


needs_ejkernel = pytest.mark.skipif(
    importlib.util.find_spec("ejkernel") is None,
    reason="ejkernel is not installed (pip install --no-deps ejkernel)",
)


@needs_ejkernel
def test_ejkernel_runs_both_ways(tmp_path):
    """Two kernels through the driver: each runs on JAX's Pallas and on ours and they agree."""
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "run_ejkernel.py"),
            "--out",
            str(tmp_path),
            "flash_attention",
            "page_attention",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "imports on ours: " in out.stdout
    rows = [x.split("\t") for x in (tmp_path / "ejkernel.tsv").read_text().splitlines()[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("flash_attention", "ran", "ran"),
        ("page_attention", "ran", "ran"),
    ]
