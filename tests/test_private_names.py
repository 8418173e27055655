"""Private names stay in their modules: read from the source's AST, the
underscore names one module of a package imports from another module of ours (``from m
import _x``) or reads as a module attribute (``m._x``) number fewer than 10 per package.
A name of a private module (``_tiles.tile_for``) that is not itself underscored is fine;
so are private modules themselves and dunder names."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {
    "pallas": ROOT / "packages/pallas-core/src",
    "pallas_tpu": ROOT / "packages/pallas-tpu/src",
    "pallas_gpu": ROOT / "packages/pallas-gpu/src",
    "jax_triton": ROOT / "packages/jax-triton/src",
    "jax_kernel_runtime": ROOT / "src",
}
LIMIT = 10


def _modules() -> dict[str, tuple[pathlib.Path, bool, str]]:
    """Module name -> (file, is a package, top package); native modules by their stubs."""
    out = {}
    for top, src in PACKAGES.items():
        for p in [*(src / top).rglob("*.py"), *(src / top).rglob("*.pyi")]:
            parts = list(p.relative_to(src).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            name = ".".join(parts)
            if p.suffix == ".py" or name not in out:
                out[name] = (p, is_pkg, top)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _uses(module: str, mods) -> set[tuple[str, str]]:
    """(defining module, private name) pairs ``module`` takes from another module of ours."""
    path, is_pkg, _ = mods[module]
    if path.suffix == ".pyi":
        return set()
    tree = ast.parse(path.read_text())
    package = module if is_pkg else module.rpartition(".")[0]
    alias: dict[str, str] = {}  # local name -> one of our modules
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name in mods and a.asname:
                    alias[a.asname] = a.name
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = package
                for _ in range(n.level - 1):
                    base = base.rpartition(".")[0]
                src = f"{base}.{n.module}" if n.module else base
            else:
                src = n.module or ""
            if src not in mods:
                continue
            for a in n.names:
                if f"{src}.{a.name}" in mods:  # a submodule, not a name
                    alias[a.asname or a.name] = f"{src}.{a.name}"
                elif _private(a.name) and src != module:
                    out.add((src, a.name))
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr):
            chain, v = [], n.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name):
                base = alias.get(v.id, v.id if v.id in mods else None)
                full = ".".join([base, *reversed(chain)]) if base else None
                if full in mods and full != module:
                    out.add((full, n.attr))
    return out


def private_names_across_modules() -> dict[str, list[str]]:
    """Per package: ``user -> defining.name`` for each private name used across modules."""
    mods = _modules()
    found: dict[str, list[str]] = {top: [] for top in PACKAGES}
    for m in sorted(mods):
        for src, name in sorted(_uses(m, mods)):
            found[mods[m][2]].append(f"{m} -> {src}.{name}")
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_fewer_than_ten_private_names_across_modules(package):
    uses = private_names_across_modules()[package]
    assert len(uses) < LIMIT, f"{package}: {len(uses)} private names used across modules:\n" + "\n".join(uses)


def test_the_count_sees_imports_and_attributes(tmp_path, monkeypatch):
    """The walk counts ``from m import _x`` and ``m._x`` (a test that can fail)."""
    pkg = tmp_path / "pallas"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _x(): pass\n_y = 1\n__version__ = '1'\n")
    (pkg / "b.py").write_text("from pallas.a import _x, __version__\nfrom pallas import a\nprint(a._y)\n")
    monkeypatch.setitem(globals(), "PACKAGES", {"pallas": tmp_path})
    assert private_names_across_modules()["pallas"] == ["pallas.b -> pallas.a._x", "pallas.b -> pallas.a._y"]


def test_backends_use_pallas_core_through_its_contract():
    """pallas-tpu and pallas-gpu use pallas-core through ``pallas.backend`` or the public
    ``pallas``, never ``pallas._src`` (pallas/backend.py's rule)."""
    bad = []
    for top in ("pallas_tpu", "pallas_gpu"):
        for p in (PACKAGES[top] / top).rglob("*.py"):
            for n in ast.walk(ast.parse(p.read_text())):
                names = (
                    [a.name for a in n.names]
                    if isinstance(n, ast.Import)
                    else [n.module or ""]
                    if isinstance(n, ast.ImportFrom) and not n.level
                    else []
                )
                bad += [f"{p.relative_to(ROOT)}:{n.lineno} {m}" for m in names if m.startswith("pallas._src")]
    assert not bad, bad
