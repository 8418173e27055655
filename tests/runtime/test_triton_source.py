"""``load_source``: generated Triton source runs from memory under a fixed
file name (no directory: it ends up in the cubin's line table), and Triton
can read it back even after ``linecache`` was cleared."""

from __future__ import annotations

import inspect
import linecache

import pytest

pytest.importorskip("triton")

from jax_kernel_runtime import triton as jkr_triton  # noqa: E402

SOURCE = (
    "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef k(x_ptr):\n    tl.store(x_ptr, 1.0)\n"
)


def test_source_is_served_from_memory_with_a_fixed_name(tmp_path):
    disk = jkr_triton.DiskCache("test", lambda: str(tmp_path))
    module = jkr_triton.load_source("jkr_test_kernel", SOURCE, disk)
    filename = module.k.fn.__code__.co_filename
    assert filename.startswith("jkr_test_kernel_") and "/" not in filename
    (copy,) = (tmp_path / "src").iterdir()
    assert copy.name == filename and copy.read_text() == SOURCE
    linecache.clearcache()
    assert "tl.store(x_ptr, 1.0)" in inspect.getsource(module.k.fn)


def test_no_disk_writes_nothing(tmp_path):
    disk = jkr_triton.DiskCache("test", lambda: str(tmp_path), enabled=lambda: False)
    module = jkr_triton.load_source("jkr_test_nodisk", SOURCE.replace("1.0", "2.0"), disk)
    assert module.k.fn.__name__ == "k"
    assert not list(tmp_path.iterdir())
