"""Every package's imports form a DAG that runs down its floors.

Read from the source's AST: every import of a module of the same package, at module
level, inside a function or under ``if TYPE_CHECKING:`` (a circle that only a type
checker follows is still a circle for the reader), is an arrow. A package's modules sit
on floors (``FLOORS``, bottom first); a floor holds one or more wings. A module imports
modules of its own wing and of the floors below, never a floor above (an arrow back up)
nor another wing of its own floor (an arrow sideways): the engines of one floor
(pallas-tpu's interpreter, Mosaic lowering and executor) stand side by side."""

from __future__ import annotations

import ast
import pathlib

import pytest
from test_private_names import PACKAGES as SRC  # each package's src/ folder

# Per package, its floors, bottom first; each floor a tuple of wings, each wing a module or a
# package of modules (named relative to the top package). A module belongs to the longest wing
# that names it or a package above it; "" (the package itself, its public modules) sits on top.
FLOORS: dict[str, list[tuple[str, ...]]] = {
    "pallas": [("_src",), ("",)],
    "pallas_tpu": [
        ("_src", "_src.compat", "_src.removed"),  # the shared floor: JAX's internals, data
        ("_src.language",),  # the kernel language: types, primitives, pipelines
        ("_src.checks",),  # what the interpreter and the Mosaic lowering both refuse
        ("_src.interpret", "_src.mosaic", "_src.executor"),  # the engines, side by side
        ("_src.pallas_call_registration", "_src.estimate"),  # the Backend; estimate reads libtpu's compile
        ("",),  # pltpu and pallas_tpu.ops
    ],
    "pallas_gpu": [
        ("_src", "_src.compat"),
        ("_src.language",),  # CompilerParams, GPU-only primitives, GPU facts
        ("_src.lowering", "_src.interpret"),  # jaxpr -> Triton source; libdevice for Triton's interpreter
        ("_src.compile",),  # Triton source -> kernel images; autotuning
        ("_src.pallas_call_registration",),  # the Backend: the call record to a launch
        ("",),  # plgpu and pallas_gpu.ops
    ],
    "jax_triton": [("_src",), ("",)],
    "jax_kernel_runtime": [
        ("_config", "_version", "_jax_kernel_runtime"),  # launch configs; the native extension
        ("_call",),  # the FFI custom call
        ("triton",),  # the shared Triton layer
        ("",),
    ],
}


def _modules(top: str) -> dict[str, pathlib.Path]:
    out = {}
    for p in [*(SRC[top] / top).rglob("*.py"), *(SRC[top] / top).rglob("*.pyi")]:
        parts = list(p.relative_to(SRC[top]).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if p.suffix == ".py" or ".".join(parts) not in out:  # a native module by its stub
            out[".".join(parts)] = p
    return out


def import_graph(top: str) -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the modules of ``top`` it imports (every import, TYPE_CHECKING ones too);
    and the imports made inside functions."""
    mods = _modules(top)

    def resolve(name: str) -> str | None:  # "a.b.c" names a module or an attribute of "a.b"
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    local = []
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_function = {id(n) for f in functions for n in ast.walk(f)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:  # relative: from the package, up level - 1
                    up = package
                    for _ in range(n.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                names = [f"{base}.{a.name}" for a in n.names]  # a module, or a name in one
            else:
                continue
            targets = {resolve(t) for t in names if t.split(".")[0] == top} - {None, m}
            graph[m] |= {t for t in targets if t is not None}
            if targets and id(n) in in_function:
                local.append(f"{m}:{n.lineno}")
    return graph, local


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: the strongly connected components of more than one module
    (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def wing_of(top: str, module: str, floors: list[tuple[str, ...]] | None = None) -> tuple[int, str]:
    """(floor, wing) of ``module``: the longest wing naming it or a package above it."""
    rel = module[len(top) + 1 :] if module != top else ""
    best: tuple[int, str] | None = None
    for f, wings in enumerate(floors if floors is not None else FLOORS[top]):
        for w in wings:
            if (w == "" or rel == w or rel.startswith(w + ".")) and (best is None or len(w) > len(best[1])):
                best = (f, w)
    assert best is not None, f"{module} is on no floor of {top}"
    return best


def arrows_against_floors(top: str, floors: list[tuple[str, ...]] | None = None) -> list[str]:
    """``importer -> imported`` for each import of a floor above (back up) or of
    another wing of the same floor (sideways)."""
    graph, _ = import_graph(top)
    bad = []
    for m, targets in sorted(graph.items()):
        fm, wm = wing_of(top, m, floors)
        for t in sorted(targets):
            ft, wt = wing_of(top, t, floors)
            if ft > fm or (ft == fm and wt != wm):
                bad.append(f"{m} -> {t} ({'back up' if ft > fm else 'sideways'})")
    return bad


@pytest.mark.parametrize("top", sorted(SRC))
def test_no_import_circle(top):
    graph, _ = import_graph(top)
    assert not circles(graph), circles(graph)


@pytest.mark.parametrize("top", sorted(SRC))
def test_no_arrow_back_up(top):
    bad = arrows_against_floors(top)
    assert not bad, f"{top}: imports against the floors {FLOORS[top]}:\n" + "\n".join(bad)


@pytest.mark.parametrize("top", sorted(SRC))
def test_every_module_is_on_a_floor(top):
    graph, _ = import_graph(top)
    for m in graph:
        wing_of(top, m)  # raises for a module on no floor


def test_pallas_tpu_imports_no_module_inside_a_function():
    _, local = import_graph("pallas_tpu")
    assert not local, f"pallas_tpu modules imported inside functions: {local}"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """A circle made only of TYPE_CHECKING imports, an arrow back up and one sideways are found."""
    pkg = tmp_path / "p"
    for d in ("_src/low", "_src/left", "_src/right"):
        (pkg / d).mkdir(parents=True)
    for f in ("__init__", "_src/__init__", "_src/low/__init__", "_src/left/__init__", "_src/right/__init__"):
        (pkg / f"{f}.py").write_text("")
    (pkg / "_src/low/a.py").write_text("from p._src.left import b  # back up\n")
    (pkg / "_src/left/b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p._src.left.c import C\n"
    )
    (pkg / "_src/left/c.py").write_text("from p._src.left import b\nfrom p._src.right import d  # sideways\n")
    (pkg / "_src/right/d.py").write_text("")
    monkeypatch.setitem(SRC, "p", tmp_path)
    monkeypatch.setitem(FLOORS, "p", [("_src", "_src.low"), ("_src.left", "_src.right"), ("",)])
    graph, _ = import_graph("p")
    assert circles(graph) == [["p._src.left.b", "p._src.left.c"]]
    assert arrows_against_floors("p") == [
        "p._src.left.c -> p._src.right.d (sideways)",
        "p._src.low.a -> p._src.left.b (back up)",
    ]
