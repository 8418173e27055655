"""Sessions that build, test and demo every package of the monorepo.

Run through ./dev (it bootstraps nox in a Python 3.12 venv): ``./dev tests``.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = os.environ.get("PALLAS_PYTHON") or "3.12"
ROOT = os.path.dirname(os.path.abspath(__file__))

# The two ends of the supported JAX range (DESIGN.md, "Versions").
JAX_OLDEST = ["jax==0.11.2", "jaxlib==0.11.2"]
JAX_NEWEST = ["jax>=0.11.2,<0.13", "jaxlib>=0.11.2,<0.13"]
TRITON = ["triton==3.6.0"]
TEST_DEPS = ["pytest>=8", "pytest-xdist>=3", "flatbuffers", "hypothesis>=6"]

# The runtime (repo root) first: the others depend on it.
LOCAL_PACKAGES = [
    ".",
    "packages/pallas-core",
    "packages/jax-triton",
    "packages/pallas-gpu",
    "packages/pallas-tpu",
]


def _local_packages() -> list[str]:
    return [p for p in LOCAL_PACKAGES if os.path.exists(os.path.join(ROOT, p, "pyproject.toml"))]


def _install_all(session: nox.Session, jax_req: list[str]) -> None:
    session.install(*jax_req, *TRITON, *TEST_DEPS)
    # Regular (non-editable) installs: the tests see what users install.
    session.install(*_local_packages(), *jax_req, *TRITON)
    session.run("python", "-c", "import jax; print('jax', jax.__version__, jax.devices())")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Full test suite on the oldest supported JAX (the GPU machine's)."""
    _install_all(session, JAX_OLDEST)
    args = session.posargs or ["tests", "-n", "2", "-q", "-rs"]
    session.run("python", "-m", "pytest", *args)


@nox.session(python=PYTHON)
def tests_newest(session: nox.Session) -> None:
    """The whole test suite on the newest supported JAX, and one example.

    The runtime is built against the oldest jaxlib's FFI headers (its build-system
    requires pin them), so tests/runtime/test_registration.py checks here that
    that build registers its handlers in the newest jaxlib.
    """
    _install_all(session, JAX_NEWEST)
    args = session.posargs or ["tests", "-n", "2", "-q", "-rs"]
    session.run("python", "-m", "pytest", *args)
    session.run("python", "examples/add.py")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Runs every example (on the GPU if there is one, else on the CPU) and checks it against jnp."""
    _install_all(session, JAX_OLDEST)
    session.run("python", "examples/run_all.py", *session.posargs)


@nox.session(python=PYTHON)
def wheels(session: nox.Session) -> None:
    """Builds one wheel per package into dist/, installs them in a fresh venv and imports each."""
    dist = os.path.join(ROOT, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    session.install("build", "pip")
    for pkg in _local_packages():
        session.run("python", "-m", "build", "--wheel", "--outdir", dist, pkg)
    built = sorted(glob.glob(os.path.join(dist, "*.whl")))
    session.log("built:\n  " + "\n  ".join(os.path.basename(w) for w in built))
    with tempfile.TemporaryDirectory() as tmp:
        venv = os.path.join(tmp, "venv")
        session.run(PYTHON if os.path.isabs(PYTHON) else "python", "-m", "venv", venv, external=True)
        py = os.path.join(venv, "bin", "python")
        session.run(py, "-m", "pip", "install", "-q", *built, *JAX_OLDEST, *TRITON, external=True)
        # No source tree on the path: run from an empty folder, examples copied in.
        work = os.path.join(tmp, "work")
        shutil.copytree(os.path.join(ROOT, "examples"), os.path.join(work, "examples"))
        imports = "import pallas, jax_kernel_runtime, jax_triton; print('imported', pallas.__file__)"
        with session.chdir(work):
            session.run(py, "-c", imports, external=True)
            session.run(py, "examples/run_all.py", external=True)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
