"""pallas_tpu's imports form a DAG (issue 32): read from the source's AST, every
import of a pallas_tpu module, at module level or inside a function, goes one
way; the wings (language, interpret, mosaic, executor) keep their order."""

from __future__ import annotations

import ast
import pathlib

import pallas_tpu

SRC = pathlib.Path(pallas_tpu.__file__).parent.parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (SRC / "pallas_tpu").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the pallas_tpu modules it imports; and the imports made inside functions."""
    mods = _modules()

    def resolve(name: str) -> str | None:  # "a.b.c" names a module or an attribute of "a.b"
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    local = []
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        top = {id(n) for n in tree.body}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                names = [f"{n.module}.{a.name}" for a in n.names]  # a module, or a name in one
            else:
                continue
            targets = {resolve(t) for t in names if t.split(".")[0] == "pallas_tpu"} - {None, m}
            graph[m] |= targets
            if targets and id(n) not in top:
                local.append(f"{m}:{n.lineno}")
    return graph, local


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_circle():
    graph, _ = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_import_inside_a_function():
    _, local = _graph()
    assert not local, f"pallas_tpu modules imported inside functions: {local}"


def test_wings_in_order():
    """language imports no other wing but the interpreter's extension tables;
    executor (run_mosaic) imports neither interpret nor mosaic; interpret and mosaic
    do not import each other."""
    graph, _ = _graph()
    src = "pallas_tpu._src."

    def wing(m):  # a wing, or a module at the top of _src (compat, checks, ...)
        return m[len(src) :].split(".")[0] if m.startswith(src) else m

    shared = {"compat", "checks"}
    allowed = {
        "language": {"language", *shared},
        "executor": {"executor", "language", *shared},
        "interpret": {"interpret", "language", *shared},
        "mosaic": {"mosaic", "language", *shared},
    }
    bad = [
        f"{m} -> {t}"
        for m, ts in graph.items()
        for t in ts
        if wing(m) in allowed
        and wing(t) not in allowed[wing(m)]
        and not (wing(m) == "language" and t == src + "interpret.rules")
        and not (m == src + "mosaic.compile_check" and t == src + "pallas_call_registration")
    ]
    assert not bad, bad
