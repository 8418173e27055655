"""Run JAX's own Pallas test files on JAX's Pallas and on ours, and compare.

Usage::

    python scripts/jax_pallas_tests.py JAX_TESTS_DIR [FILE ...] [-n 2] [-k EXPR] [--out DIR]

``JAX_TESTS_DIR`` holds test files of JAX's ``tests/pallas`` folder (``pallas_test.py``,
``indexing_test.py``, ``pallas_vmap_test.py``, ``ops_test.py``, ``tpu_pallas_test.py``,
``tpu_pallas_interpret_test.py``...). They are not in the jax wheel or sdist: fetch them
from JAX's repository at the tag of the installed jax, and keep them outside this repo
(never commit them). ``FILE`` picks some of them (default: every ``*_test.py`` there).
The Python running this script needs what JAX's tests import (``absl-py``,
``hypothesis``) and ``pytest-xdist`` (``pip install absl-py hypothesis pytest-xdist``, or
``pip install --target DIR absl-py`` and run with ``PYTHONPATH=DIR``).

Each file runs twice under pytest, on the CPU in interpret mode, with
``JAX_ENABLE_CHECKS=1`` (as JAX's CI runs them):

* **jax**: the file as it is, on ``jax.experimental.pallas``;
* **ours**: the file with its Pallas imports rewritten to our packages by
  ``tests/downstream/pallas_rewrite.py`` (``jax.experimental.pallas`` -> ``pallas``,
  ``.tpu`` -> ``pallas_tpu``, ``.triton`` -> ``pallas_gpu``), plus the few imports of
  JAX's private Pallas modules the tests make (``INTERNAL_OURS``) mapped to ours.

Both sides also get ``COMPAT`` (imports the test files make of JAX internals that
the installed jax no longer has, e.g. ``for_loop``, replaced by a few lines of
equivalent code), so that a file written for another jax still imports.

Per-test outcomes come from ``--junitxml``. The report prints, per file and in total:
tests passing on JAX, how many of those pass on ours, the percentage, and the tests that
pass on JAX but not on ours grouped by the first line of their error. A test that fails
on JAX itself is not counted. ``--out`` keeps the rewritten files and the XML reports.
``--side ours`` runs our side only and compares it with the ``jax.xml`` an earlier run left in
``--out`` (JAX's side changes only with jax or the test files: copy that report into a fresh
folder, one folder per file, and re-run ours alone).

Measured (CPU, jax 0.11.2, ``-n 1``/``-n 2``):

* 2026-12-03, the six files of jax-v0.11.0 (pallas_test, indexing_test,
  pallas_vmap_test, ops_test, tpu_pallas_interpret_test, tpu_pallas_test): 1554 of the
  1637 tests passing on JAX pass on ours (94.9 %).
* 2026-12-04, the error-message tests only ("messages in other words"), as
  excerpts of the files the index holds (pallas_test.py's ApiErrorTest and
  test_hoisted_consts at jax commit 01a110c4; tpu_pallas_test.py's two DMA semaphore
  error tests at 0173b5ee, in TPU interpret mode): 1 of 17 before (pallas_test's 15: 1;
  the DMA ones: 0 of 2, judged from the messages), 16 of 17 after. Left: a kernel that
  captures an array constant is hoisted into an input on ours, refused by JAX ("The
  kernel function ... captures constants"). The six whole files were not re-run then (they
  could not be fetched whole at jax-v0.11.0 in that session).
* 2026-12-04, whole files as the code index holds them, each at its own jax
  commit (not jax-v0.11.0; older files use APIs jax 0.11 removed, e.g. ``pl.load``, so
  fewer of their tests pass on JAX itself): pallas_test.py (01a110c4) 98 of 100;
  indexing_test.py (087c5d00) 42 of 42; pallas_vmap_test.py (151fb33b) 10 of 11 (9 before
  the vmap fix for an aliased Python-scalar operand); tpu_pallas_interpret_test.py
  (012f9b26) 5 of 10; ops_test.py (0035ffc4) 1045 of 1063; in all 1200 of 1226 (97.9 %).
  tpu_pallas_test.py (0173b5ee) does not import on jax 0.11.2 (it needs
  ``jax._src.pallas.pallas_test_util``), so it counts nothing. Left, by cause: kernels capturing array constants are hoisted into inputs on
  ours, refused by JAX (2); ``out_shape=[...]`` gave a list on ours, a tuple on JAX
  (since changed to a tuple, not rerun); no ``pl.core_map``; TPU interpret mode's
  ``skip_floating_point_ops`` ignored; uninitialized integers are ``iinfo.min`` on ours,
  ``iinfo.max`` in JAX's TPU interpret mode; a dynamic grid dimension marked "parallel" is
  accepted (JAX: ConcretizationTypeError); a test counting JAX's internal ``store`` callbacks;
  ops_test's uses of JAX's private ``primitives`` module (mapped to pallas_gpu): no ``swap``
  (8) and the printed jaxpr of ``load``/``store`` (pallas_gpu's own primitives, not JAX's
  state ``a[...] <-``; 10); both fixed 2026-12-06 (last entry).
* 2026-12-04, later, the same five files, our side re-run (``--side ours``)
  against the JAX reports of the run above (JAX's side unchanged: same jax, same rewritten
  files): pallas_test.py 99 of 100 (98 before); indexing_test.py 42 of 42 (42);
  pallas_vmap_test.py 10 of 11 (10); tpu_pallas_interpret_test.py 8 of 10 (5: ``pl.core_map``,
  ``skip_floating_point_ops``, a dynamic "parallel" axis); ops_test.py 1045 of 1063 (1045);
  in all 1204 of 1226 (98.2 %; 1200, 97.9 %, before). Fixed since the run above:
  ``out_shape=[...]`` gives a tuple; ``skip_floating_point_ops`` is honoured; ``pl.core_map``
  (over ``pltpu.create_tensorcore_mesh``, in TPU interpret mode and our Mosaic lowering);
  a traced grid size on a "parallel" axis is refused in TPU interpret mode with JAX's
  ``ConcretizationTypeError``. Left, each a deviation we keep: a kernel capturing an array
  constant runs (the array is hoisted into an input; JAX refuses it: 2, docs/differences.md);
  uninitialized integers are ``iinfo.min`` on ours in every engine, ``iinfo.max`` in JAX's TPU
  interpret mode (1, docs/differences.md); a test that counts JAX's interpreter's internal
  ``store`` callbacks (ours makes none: it interprets while tracing, 1); ops_test's 18 uses of
  JAX's private ``primitives.load/store/swap`` (the removed ``pl.load``/``pl.store``/``pl.swap``):
  ``pallas_gpu`` had masked ``load``/``store``, printed as its own primitives, and no ``swap``
  (all 18 pass since 2026-12-06: see the last entry).
* 2026-12-04, **on the H200** (jax 0.11.2 with CUDA, Triton 3.6.0), the four
  files pallas_test, indexing_test, pallas_vmap_test and ops_test as above, both sides, ``-n 16``.
  The script runs on the CPU unless ``JAX_PLATFORMS`` says otherwise: with
  ``JAX_PLATFORMS=cuda`` and ``-k "not Interpret"`` (JAX's GPU test classes, compiled on the GPU:
  JAX's Triton backend against pallas-gpu): indexing 14 of 14, ops 621 of 639, pallas 124 of
  138, vmap 12 of 13, **771 of 804 (95.9 %)**. Left: 9 block shapes that JAX's Triton backend
  refuses and ours computes (kept: a superset); the 18 private ``primitives`` uses above; the 2
  hoisted constants; 4 fixed since, each with a test of ours (2 loops (``fori_loop``) carrying
  Refs, refused under ``jax_enable_checks``: kernels now trace with JAX's mutable-array checks
  off, as JAX's do; a matrix-vector dot refused without JAX's "must be 2D"; ``jax.grad`` with
  our TypeError, now a ValueError saying "Linearization failed" too). Rerun of pallas_test and
  pallas_vmap_test after those fixes: 128 of 138 and 12 of 13, so **775 of 804 (96.4 %)**. The
  first run's interpret
  classes (``JAX_PLATFORMS`` unset, on the machine's CPU): 1196 of 1216 (98.4 %).
* 2026-12-06: at jax-v0.11.0's six files, 1592 of 1637 (97.3 %) before that day's fixes
  (main at db6cd82); not re-run after the fixes below. The code index hands out one stored
  version of each file at a time and the files reach this machine only by being re-typed from the
  look-up tool's answers (about 440,000 characters for the six), so this session fetched the newest
  stored ``tpu_pallas_interpret_test.py`` (jax 910e39bd, written for JAX 0.12) only: 9 of the 11
  tests passing on JAX 0.11.2 pass on ours, before and after the fixes (6 of its 17 fail on JAX 0.11.2
  itself: ``InterpretParams(num_cores_per_device=...)`` and ``pltpu.MemorySpace.ANY`` are JAX 0.12's,
  so its two-core race tests count on neither side). Left there: the count of JAX's internal
  ``store`` callbacks, and uninitialized int16 scratch (``iinfo.min`` on ours, ``iinfo.max`` on JAX).
  Fixed, each with a test in tests/tpu/test_jax_conformance.py: two cores along a "parallel" axis
  writing only their own blocks and scratch were reported as a race (the newest file's
  ``test_two_cores_along_parallel_dimension_no_race``, run by hand with JAX 0.11's parameter name:
  race-free on both now; the race of two cores writing one output block is still found, on both);
  ``jax.vmap`` over a scalar-prefetch operand (was NotImplementedError).
* 2026-12-06, ops_test.py (v0.11 copy) with ``-k "swap or pretty_print"``: 50 of 50 (32 before).
  The 18 uses of JAX's private ``primitives`` module (mapped to ``pallas_gpu``) pass: ``plgpu.swap``
  (a masked load of the old value, then a masked store; masked-off elements of the result are the
  new value, as JAX's), and ``plgpu.load``/``store``/``swap`` print as JAX's Ref accesses
  (``c:i32[4,3,2] <- a[:,:,:]``, ``a[:,:,:] <- c``, ``d:i32[4,3,2], a[:,:,:] <- a[:,:,:], c``,
  then ``mask=``/``other=`` and any Triton hints). tests/gpu/test_swap_and_pretty_print.py.
* 2026-12-06, later, the six files as the code index holds them, fetched whole
  (``read_file`` paged by offset; kept outside the repo): the versions closest to jax-v0.11.0 and
  the newest (JAX 0.12's ``tpu_pallas_test``/``tpu_pallas_interpret_test``), jax 0.11.2, ``-n 2``:
  **1290 of 1316 (98.0 %)** and **3795 of 3822 (99.3 %)** at 90cc2c3. After the fixes (specs as JAX
  reads them, ``pl.num_programs`` in an index map, ``plgpu.swap`` and the printed forms): our side
  re-run for pallas_test (111 of 112) and ops_test (1063 of 1063) whole and for the touched tests of
  both ``tpu_pallas_test`` versions: **1311 of 1316 (99.6 %)** and **3816 of 3822 (99.8 %)**. Left:
  captured constants (2, kept), JAX's internal ``store`` callback count (1 per set), uninitialized
  int16 scratch (1 per set, kept), ``pl.num_programs`` of a traced grid size in an index map (1 per
  set), ``dma_start`` under state discharge (JAX 0.12's file).
* 2026-12-07, jax 0.11.2, ``-n 2``, the tests where ours failed most, re-typed from the code index
  (no copy of the jax-v0.11.0 files was on the machine, and the index hands out versions by commit,
  not by tag): ``tpu_pallas_interpret_test.py`` in the version written for JAX 0.11's parameters
  (``num_cores_or_threads``, ``allow_hbm_allocation_in_run_scoped``) and ``pallas_vmap_test.py``
  (4a8420bb), whole; ``pallas_test.py`` (55793bdf) for ``test_hoisted_consts`` and ``ApiErrorTest``,
  JAX 0.12's ``tpu_pallas_test.py`` (0173b5ee) for its dynamic-grid classes and
  ``test_async_copy_slice``. Before that day's fixes (main at 9441a1f): **55 of 76** (interpret 17
  of 34, pallas 15 of 16, vmap 10 of 11, tpu_pallas 13 of 15); after: **71 of 76 (93.4 %)**
  (interpret 31, pallas 15, vmap 10, tpu_pallas 15; our side re-run after the last fix). Fixed: races as JAX reports them (8: ``on_race``,
  ``races`` afresh per call, ``force_tpu_interpret_mode`` over a call's own parameters, the write-back
  of whole-array outputs), ``out_of_bounds_reads="uninitialized"`` (2), the revisited output block and
  the block outside its array in JAX's words, found while tracing before the block shape's check (2),
  the HBM accesses' refusal in JAX's words and class (2), a DMA in scoped buffers under
  ``interpret=True`` (1), ``pl.num_programs`` of a traced grid size in an index map (1). Left: captured constants (2, kept), the ``store`` callback count (1), int16
  scratch (1, kept), (4, 128) blocks with ``out_of_bounds_reads="uninitialized"`` (1, kept: TPU
  interpret mode refuses a block shape a TPU refuses). Also fixed, in tests these files lack: JAX's words in the static out-of-bounds index
  error and in the "Attempting to pass a Ref" error; ``random_seed``'s grid order (JAX's tests of it
  fail on JAX 0.11.2 itself). The 1637 tests of jax-v0.11.0 were not re-run.
* 2026-12-07, later, the six files of each set fetched whole again from the code index at the
  commits the docs name (``read_file`` paged by offset, each page checked against the index's
  character count, every file parsed; kept outside the repo) and run whole, both sides, jax 0.11.2,
  ``-n 1``, on the working tree as others changed it (main 354fd5d to d980b03). Closest to
  jax-v0.11.0 (indexing_test 087c5d00, pallas_test 55793bdf, ops_test 0035ffc4, pallas_vmap_test
  151fb33b, tpu_pallas_interpret_test 012f9b26, tpu_pallas_test f464edd7): **1312 of 1316 (99.7 %)**
  (indexing 42/42, ops 1063/1063, pallas 111/112, vmap 10/11, interpret 8/10, tpu_pallas 78/78).
  Newest (pallas_vmap_test 4a8420bb, tpu_pallas_interpret_test 910e39bd, tpu_pallas_test 0173b5ee,
  the others the same): **3818 of 3822 (99.9 %)** (42/42, 1063/1063, 111/112, 10/11, 9/11,
  2583/2583). The same four fail on ours in both sets, each a kept deviation: the two captured
  constants, JAX's internal ``store`` callback count, uninitialized int16 scratch (``iinfo.min``);
  nothing else. The newest set took 7 minutes on JAX's side, 14 on ours. Fixed after, from a test
  failing on JAX 0.11.2 itself (the older ``test_randomization_of_parallel_dimensions``): TPU
  interpret mode refuses a "parallel" grid axis after one of another kind with JAX's ValueError
  (ours ran it); the ``tpu_pallas_interpret_test`` of both sets re-run on our side (``--side ours``):
  8 of 10 and 9 of 11, as before (the JAX test of that refusal passes on both sides for a shape
  error its kernel raises first).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "downstream"))
import pallas_rewrite  # noqa: E402

# Imports of JAX internals some versions of the test files make and the installed jax
# lacks; applied on both sides. (pattern, replacement)
_FOR_LOOP = """\
def for_loop(nsteps, body, init_state):  # compat (scripts/jax_pallas_tests.py)
  def _run(refs):
    lax.fori_loop(0, nsteps, lambda i, c: (body(i, refs), c)[1], None)
  return pl.run_state(_run)(init_state)
"""
# (jax 0.11's ``_trace_kernel_to_jaxpr`` has no cache to clear.)
_TRACE_STUB = "_trace_kernel_to_jaxpr = type('_NoCache', (), {'cache_clear': staticmethod(lambda: None)})"
_HYPOTHESIS = (
    "hp.settings.register_profile('jax_compat', max_examples=\\1, deadline=None)\n"
    "hp.settings.load_profile('jax_compat')"
)
# Test helpers of newer jax's test_util (GPU/TPU skips: no-ops on the CPU), and the Mosaic GPU
# switch (off: these runs are on the CPU).
_NEWER_JTU = """\
use_mosaic_gpu = False  # compat (scripts/jax_pallas_tests.py)
for _name in ("skip_if_mosaic_gpu_exceeds_shared_memory", "skip_if_triton_exceeds_shared_memory"):
  if not hasattr(jtu, _name):
    setattr(jtu, _name, lambda **_: (lambda f: f))
if not hasattr(jtu, "hypothesis_is_thread_safe"):
  jtu.hypothesis_is_thread_safe = lambda: False"""
# JAX 0.12's test files take their base classes from ``jax._src.pallas.pallas_test_util``, which
# jax 0.11 lacks: two classes of the same contract (``INTERPRET``, ``self.pallas_call``), inline.
_PALLAS_TEST_UTIL = """\
def _pallas_test_util_compat():  # compat (scripts/jax_pallas_tests.py)
  import types as _types

  class PallasTest(jtu.JaxTestCase):
    INTERPRET = False

    def setUp(self):
      # interpret-mode cases on the CPU only, compiled ones on an accelerator only
      if self.INTERPRET != jtu.test_device_matches(["cpu"]):
        self.skipTest("interpret mode on the CPU, compiled kernels on an accelerator")
      super().setUp()

    def pallas_call(self, *args, **kwargs):
      return pl.pallas_call(*args, **kwargs, interpret=self.INTERPRET)

  class PallasTPUTest(PallasTest):
    def setUp(self):
      if not (self.INTERPRET or jtu.test_device_matches(["tpu"])):
        self.skipTest("needs a TPU")
      super().setUp()

  return _types.SimpleNamespace(PallasTest=PallasTest, PallasTPUTest=PallasTPUTest)
\\1 = _pallas_test_util_compat()"""
# ``jtu.if_cloud_tpu_at_least(y, m, d)`` (libtpu build-date gates in older test files), gone from
# jax 0.11's test_util; off a Cloud TPU it was always True.
_CLOUD_TPU_AT_LEAST = """\\1
if "jtu" in globals() and not hasattr(jtu, "if_cloud_tpu_at_least"):  # compat (scripts/jax_pallas_tests.py)
  jtu.if_cloud_tpu_at_least = lambda *_: True"""
COMPAT = (
    (r"^from jax\._src\.pallas import pallas_test_util as (\w+)$", _PALLAS_TEST_UTIL),
    (r"^(jax\.config\.parse_flags_with_absl\(\))$", _CLOUD_TPU_AT_LEAST),
    (r"^from jax\._src\.pallas\.pallas_call import _trace_kernel_to_jaxpr$", _TRACE_STUB),
    (r"^from jax\._src\.lax\.control_flow\.for_loop import for_loop\n", _FOR_LOOP),
    (r"^jtu\.setup_hypothesis\(max_examples=(\d+)\)$", _HYPOTHESIS),
    (r"^use_mosaic_gpu = pallas_call\._PALLAS_USE_MOSAIC_GPU\.value$", _NEWER_JTU),
    # Names older test files use for what jax 0.11 calls pltpu.InterpretParams, CompilerParams
    # and MemorySpace.
    (r"\b\w+\.TPUInterpretParams\b", "pltpu.InterpretParams"),
    (r"\bpltpu\.TPUCompilerParams\b", "pltpu.CompilerParams"),
    (r"\bpltpu\.TPUMemorySpace\b", "pltpu.MemorySpace"),
)
# JAX side only: older test files import TPU interpret mode's package, whose names
# (``races``, ``store``) jax 0.11 keeps in its interpret_pallas_call module.
COMPAT_JAX = (
    (
        r"^import jax\._src\.pallas\.mosaic\.interpret as (\w+)$",
        r"import jax._src.pallas.mosaic.interpret.interpret_pallas_call as \1",
    ),
)

# Imports of JAX's private Pallas modules made by the tests, mapped to ours (ours only).
INTERNAL_OURS = (
    (
        r"^from jax\._src\.pallas\.mosaic\.interpret import interpret_pallas_call as (\w+)$",
        r"from pallas_tpu._src.interpret import multi as \1",
    ),
    (
        r"^import jax\._src\.pallas\.mosaic\.interpret as (\w+)$",
        r"from pallas_tpu._src.interpret import multi as \1",
    ),
    # pallas_call_p (pallas_test's jaxpr search); the masked load/store of ops_test.
    (r"^from jax\._src\.pallas import pallas_call$", "import pallas as pallas_call"),
    (r"^from jax\._src\.pallas import primitives as (\w+)$", r"import pallas_gpu as \1"),
    # tpu_pallas_test's MosaicError (our run_mosaic's error of that name), and its one-kernel
    # module for the MLIR-location test (JAX's, whose ``pl`` is JAX's: the same kernel on ours).
    (r"^from jax\._src\.pallas\.mosaic import error_handling$", "import pallas_tpu as error_handling"),
    (
        r"^from jax\.experimental\.pallas\.ops\.tpu import example_kernel$",
        "import types as _types  # compat (scripts/jax_pallas_tests.py): JAX's example_kernel\n"
        "def _double_kernel(x_ref, y_ref):\n"
        "  y_ref[:] = x_ref[:] * 2\n"
        "example_kernel = _types.SimpleNamespace(\n"
        "    double_kernel=_double_kernel,\n"
        "    double=lambda x: pl.pallas_call(_double_kernel, out_shape=x)(x))",
    ),
)


def rewrite(src: str, side: str, origin: str) -> str:
    for pattern, replacement in COMPAT:
        src = re.sub(pattern, replacement, src, flags=re.M)
    if side == "jax":
        for pattern, replacement in COMPAT_JAX:
            src = re.sub(pattern, replacement, src, flags=re.M)
    if side == "ours":
        for pattern, replacement in INTERNAL_OURS:
            src = re.sub(pattern, replacement, src, flags=re.M)
        src = pallas_rewrite.port_source(src, origin)
    return src


def run_side(files: list[Path], side: str, work: Path, workers: int, kexpr: str | None) -> Path:
    """Writes the (rewritten) files under ``work/side`` and runs pytest there."""
    where = work / side
    where.mkdir(parents=True, exist_ok=True)
    for f in files:
        (where / f.name).write_text(rewrite(f.read_text(), side, str(f)))
    xml = work / f"{side}.xml"
    env = dict(
        os.environ,
        JAX_ENABLE_CHECKS="1",
        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(where),
        "-c",
        os.devnull,
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit1",
    ]
    cmd += ["-n", str(workers)] if workers > 1 else ["-p", "no:xdist"]
    if kexpr:
        cmd += ["-k", kexpr]
    cmd += [f.name for f in files]
    print(f"[{side}] {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, cwd=where, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return xml


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """``file::Class::test`` -> (passed|failed|skipped, first line of the error)."""
    result = {}
    if not xml.exists():
        return result
    for case in ET.parse(xml).iter("testcase"):
        module, _, klass = case.get("classname", "").partition(".")
        key = f"{module}.py::{klass}::{case.get('name')}"
        status, first = "passed", ""
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                status = "failed"
                text = (el.get("message") or el.text or "").strip()
                first = text.splitlines()[0] if text else tag
                break
        else:
            if case.find("skipped") is not None:
                status = "skipped"
        result[key] = (status, first)
    return result


def _norm(line: str, width: int = 150) -> str:
    line = re.sub(r"0x[0-9a-f]+", "0x..", line)
    return line[:width]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests_dir", type=Path)
    ap.add_argument("files", nargs="*")
    ap.add_argument("-n", type=int, default=2, help="pytest-xdist workers per side (default 2)")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--out", type=Path, default=None, help="keep rewritten files and XML here")
    ap.add_argument("--side", choices=("both", "jax", "ours"), default="both")
    ap.add_argument("--show", type=int, default=5, help="tests listed per error group")
    args = ap.parse_args(argv)

    names = args.files or sorted(p.name for p in args.tests_dir.glob("*_test.py"))
    files = [args.tests_dir / n for n in names]
    work = args.out or Path(tempfile.mkdtemp(prefix="jax_pallas_tests_"))
    work.mkdir(parents=True, exist_ok=True)
    sides = ("jax", "ours") if args.side == "both" else (args.side,)
    for side in sides:
        run_side(files, side, work, args.n, args.k)
    jax_res = outcomes(work / "jax.xml")
    ours_res = outcomes(work / "ours.xml")

    per_file = collections.defaultdict(lambda: [0, 0])
    groups = collections.defaultdict(list)
    for key, (status, _) in sorted(jax_res.items()):
        if status != "passed":
            continue
        fname = key.split("::")[0]
        per_file[fname][0] += 1
        o_status, o_first = ours_res.get(key, ("missing", "not run on ours (collection error?)"))
        if o_status == "passed":
            per_file[fname][1] += 1
        else:
            groups[_norm(o_first or o_status)].append(key)

    print(f"\n{'file':40} {'JAX passes':>10} {'ours':>6} {'%':>7}")
    tj = to = 0
    for fname, (j, o) in sorted(per_file.items()):
        tj, to = tj + j, to + o
        print(f"{fname:40} {j:10d} {o:6d} {100 * o / max(j, 1):6.1f}%")
    print(f"{'total':40} {tj:10d} {to:6d} {100 * to / max(tj, 1):6.1f}%")
    ours_only = sum(
        1 for k, (s, _) in ours_res.items() if s == "passed" and jax_res.get(k, ("",))[0] != "passed"
    )
    print(f"(passing on ours but not on JAX: {ours_only}; results in {work})")
    print("\nFailing on ours, passing on JAX, by first error line:")
    for line, keys in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"\n[{len(keys)}] {line}")
        for k in keys[: args.show]:
            print(f"    {k}")
        if len(keys) > args.show:
            print(f"    ... {len(keys) - args.show} more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
