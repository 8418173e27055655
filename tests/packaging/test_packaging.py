"""The packaging metadata of the five distributions agrees with itself: one
version source per package, sibling pins that contain the siblings' versions
(same minor release), one JAX range, one tested Triton range, the noxfile's
matrix at the ends of those ranges, changelogs headed by the version, the
Apache-2.0 LICENSE in every package, and error messages that name installable
distributions. (The built wheels and sdists themselves are checked by
``./dev wheels``.)"""

from __future__ import annotations

import ast
import os
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = {
    "jax-kernel-runtime": ".",
    "jax-pallas-core": "packages/pallas-core",
    "jax-pallas-gpu": "packages/pallas-gpu",
    "jax-pallas-tpu": "packages/pallas-tpu",
    "jax-triton-bridge": "packages/jax-triton",
}
IMPORTS = {
    "jax-kernel-runtime": "src/jax_kernel_runtime",
    "jax-pallas-core": "src/pallas",
    "jax-pallas-gpu": "src/pallas_gpu",
    "jax-pallas-tpu": "src/pallas_tpu",
    "jax-triton-bridge": "src/jax_triton",
}
CHANGELOGS = {d: "CHANGELOG.md" for d in FOLDERS} | {"jax-kernel-runtime": "RUNTIME_CHANGELOG.md"}


def pyproject(dist: str) -> dict:
    with open(os.path.join(ROOT, FOLDERS[dist], "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def version(dist: str) -> str:
    with open(os.path.join(ROOT, FOLDERS[dist], IMPORTS[dist], "_version.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    (value,) = [
        n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__version__"
    ]
    return value


def requirements(dist: str, extra: str | None = None) -> dict[str, Requirement]:
    project = pyproject(dist)["project"]
    reqs = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in reqs}


def noxfile_constants() -> dict:
    with open(os.path.join(ROOT, "noxfile.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id.isupper()
        and isinstance(n.value, (ast.List, ast.Dict, ast.Constant))
    }  # fmt: skip


def lower_bound(spec: SpecifierSet) -> str:
    (low,) = [s.version for s in spec if s.operator in (">=", "==")]
    return low


@pytest.mark.parametrize("dist", list(FOLDERS))
def test_one_version_source(dist):
    conf = pyproject(dist)
    assert conf["project"]["name"] == dist
    assert "version" not in conf["project"] and conf["project"]["dynamic"] == ["version"]
    provider = conf["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["input"] == f"{IMPORTS[dist]}/_version.py"
    Version(version(dist))  # a valid version
    with open(os.path.join(ROOT, FOLDERS[dist], IMPORTS[dist], "__init__.py"), encoding="utf-8") as f:
        init = f.read()
    pkg = IMPORTS[dist].split("/")[1]
    assert f"from {pkg}._version import __version__ as __version__" in init
    assert not re.search(r"^__version__\s*=", init, re.M), f"{dist}: a second version in __init__.py"


@pytest.mark.parametrize("dist", list(FOLDERS))
def test_sibling_pins_hold_the_siblings_minor_release(dist):
    for name, req in requirements(dist).items():
        if name not in FOLDERS:
            continue
        current = Version(version(name))
        assert req.specifier.contains(current), f"{dist} requires {req}, but {name} is {current}"
        next_minor = Version(f"{current.major}.{current.minor + 1}.0")
        assert not req.specifier.contains(next_minor), f"{dist}: {req} admits {name} {next_minor}"
        assert lower_bound(req.specifier) == f"{current.major}.{current.minor}.0", req


def test_what_each_distribution_depends_on():
    ours = {d: {n for n in requirements(d) if n in FOLDERS} for d in FOLDERS}
    assert ours == {d: set(s) for d, s in noxfile_constants()["SIBLINGS"].items()}
    assert ours == {
        "jax-kernel-runtime": set(),
        "jax-pallas-core": set(),
        "jax-pallas-gpu": {"jax-pallas-core", "jax-kernel-runtime"},
        "jax-pallas-tpu": {"jax-pallas-core"},
        "jax-triton-bridge": {"jax-kernel-runtime"},  # never Pallas
    }
    triton = {d for d in FOLDERS if "triton" in requirements(d)}
    assert triton == {"jax-pallas-gpu", "jax-triton-bridge"}


def test_one_jax_range_and_the_noxfile_matrix_at_its_ends():
    nox = noxfile_constants()
    jax_specs = {str(requirements(d)["jax"].specifier) for d in FOLDERS}
    assert len(jax_specs) == 1, jax_specs
    jaxlib_specs = {str(r["jaxlib"].specifier) for d in FOLDERS if "jaxlib" in (r := requirements(d))}
    assert jaxlib_specs == jax_specs
    spec = SpecifierSet(jax_specs.pop())
    oldest = {Requirement(r).name: str(Requirement(r).specifier) for r in nox["JAX_OLDEST"]}
    assert oldest == {"jax": f"=={lower_bound(spec)}", "jaxlib": f"=={lower_bound(spec)}"}
    assert {str(Requirement(r).specifier) for r in nox["JAX_NEWEST"]} == {str(spec)}
    # The runtime's build requires the oldest jaxlib's FFI headers.
    build = [Requirement(r) for r in pyproject("jax-kernel-runtime")["build-system"]["requires"]]
    assert [str(r.specifier) for r in build if r.name == "jaxlib"] == [f"=={lower_bound(spec)}"]


def test_one_tested_triton_range_and_the_bridge_pin():
    from jax_triton._src import triton_pin  # noqa: PLC0415 (the installed package)

    nox = noxfile_constants()
    gpu = requirements("jax-pallas-gpu")["triton"].specifier
    runtime_extra = requirements("jax-kernel-runtime", "triton")["triton"].specifier
    assert gpu == runtime_extra
    assert [str(Requirement(r).specifier) for r in nox["TRITON_NEWEST"]] == [str(gpu)]
    bridge = requirements("jax-triton-bridge")["triton"].specifier
    assert str(bridge) == f"=={triton_pin.VALIDATED_TRITON_VERSION}"
    assert [str(Requirement(r).specifier) for r in nox["TRITON_PINNED"]] == [str(bridge)]
    assert lower_bound(gpu) == triton_pin.VALIDATED_TRITON_VERSION  # the pin is in the tested range
    assert re.fullmatch(r"[0-9a-f]{40}", triton_pin.VALIDATED_TRITON_COMMIT)


@pytest.mark.parametrize("dist", ["jax-kernel-runtime", "jax-pallas-gpu", "jax-triton-bridge"])
@pytest.mark.parametrize("cuda", ["cuda12", "cuda13"])
def test_cuda_extras_pull_jax_with_that_cuda(dist, cuda):
    (req,) = requirements(dist, cuda).values()
    assert req.name == "jax" and req.extras == {cuda}
    assert req.specifier == requirements(dist)["jax"].specifier


@pytest.mark.parametrize("dist", list(FOLDERS))
def test_changelog_is_headed_by_the_version(dist):
    with open(os.path.join(ROOT, FOLDERS[dist], CHANGELOGS[dist]), encoding="utf-8") as f:
        text = f.read()
    first = re.search(r"^## (\S+)", text, re.M)
    assert first and first.group(1) == version(dist), f"{dist}: first entry {first and first.group(1)}"


@pytest.mark.parametrize("dist", list(FOLDERS))
def test_license_in_every_package(dist):
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        root = f.read()
    assert (
        "Apache License" in root
        and "Version 2.0, January 2004" in root
        and "END OF TERMS AND CONDITIONS" in root
    )
    with open(os.path.join(ROOT, FOLDERS[dist], "LICENSE"), encoding="utf-8") as f:
        assert f.read() == root
    conf = pyproject(dist)["project"]
    assert conf["license"] == "Apache-2.0" and conf["license-files"] == ["LICENSE"]


@pytest.mark.parametrize("dist", list(FOLDERS))
def test_sdist_takes_only_its_own_files(dist):
    sk = pyproject(dist)["tool"]["scikit-build"]
    assert sk["sdist"]["inclusion-mode"] == "explicit"
    include = sk["sdist"]["include"]
    src = f"/{IMPORTS[dist]}/"
    allowed = ("/pyproject.toml", "/LICENSE", "/README.md", "/CHANGELOG.md", src)
    if dist == "jax-kernel-runtime":
        allowed = (*allowed, "/CMakeLists.txt", "/cpp/", "/RUNTIME.md", "/RUNTIME_CHANGELOG.md")
    assert all(p.startswith(allowed) for p in include), include


def _package_sources():
    for dist in FOLDERS:
        top = os.path.join(ROOT, FOLDERS[dist], IMPORTS[dist])
        for dirpath, _, files in os.walk(top):
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)


def test_pip_install_hints_name_our_distributions():
    from pallas._src import backends  # noqa: PLC0415

    named = set(backends.PACKAGE_FOR_PLATFORM.values()) | set(backends.PACKAGE_FOR_BACKEND.values())
    assert named <= set(FOLDERS), named
    hints = []
    for path in _package_sources():
        with open(path, encoding="utf-8") as f:
            hints += [(path, m) for m in re.findall(r"pip install ([\w\[\]-]+)", f.read())]
    assert hints, "no pip install hint found: the scan is broken"
    third_party = {"triton", "jax", "jaxlib"}
    for path, name in hints:
        if name.startswith("-") or "{" in name:
            continue
        base = name.split("[")[0]
        assert base in FOLDERS or base in third_party, f"{os.path.relpath(path, ROOT)}: pip install {name}"
