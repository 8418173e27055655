"""Which test files depend on the version of JAX (or of Triton): the rule that picks what CI's
``tests_oldest`` and ``tests_newest`` run (noxfile.py); ``tests`` runs the whole suite.

The rule, read from the source, never from a list kept by hand:

1. What a test file uses is the closure of its imports: the modules it imports (anywhere in the
   file; in a file that imports ``subprocess``, also in the code among its strings, what it
   runs in another process, and a helper script named by its file name), the test helpers
   among them (``tests/ways``, a folder's helper modules), and, transitively, the modules of
   our five packages they import (importing ``a.b.c`` imports ``a`` and ``a.b``). conftest.py
   files are pytest's setup for every file and are not followed.
2. A file of that closure is where a version enters (a *site*) when it
   - imports JAX's internals or its unstable modules (``jax._src``, ``jaxlib``,
     ``jax.experimental`` with JAX's own Pallas and Mosaic, ``jax.extend``,
     ``jax.interpreters``, ``jax.core``, ``jax.lib``), reads JAX's version
     (``jax.__version__``, ``__version_info__``) or probes JAX for a name
     (``hasattr``/``getattr`` on ``jax``, ``lax``, ``jnp``): kind ``jax``;
   - looks libtpu up (``find_spec("libtpu")``, ``import libtpu``): kind ``libtpu``; the chips CI
     compiles for differ by end;
   - imports Triton: kind ``triton``.
3. ``tests_oldest`` (JAX 0.10.2, the pinned Triton) runs the files whose closure holds a site
   of kind ``jax`` or ``libtpu``; ``tests_newest`` (the newest JAX, the newest Triton, TPU v4 and
   v5p) those of any kind. A file with none runs at the reference end only: what it checks
   cannot change with the version (a source or metadata check that never imports JAX).

``python tests/version_dependent.py oldest|newest`` prints the files, one a line;
``--why`` prints each with the chain of imports that reaches its first site (or "none").
Standard library only: noxfile.py imports it in nox's own Python.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import textwrap
from collections.abc import Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
# Our packages' import names -> their folders.
PACKAGES = {
    "pallas": "packages/pallas-core/src/pallas",
    "pallas_tpu": "packages/pallas-tpu/src/pallas_tpu",
    "pallas_gpu": "packages/pallas-gpu/src/pallas_gpu",
    "jax_triton": "packages/jax-triton/src/jax_triton",
    "jax_kernel_runtime": "src/jax_kernel_runtime",
}
JAX_INTERNALS = (
    "jax._src", "jaxlib", "jax.experimental", "jax.extend", "jax.interpreters", "jax.core", "jax.lib",
)  # fmt: skip
# Names a module of ours gives JAX's public modules (a probe of one: ``hasattr(jax.lax, "x")``).
_JAX_NAMES = ("jax", "lax", "jnp")
KINDS = {"oldest": ("jax", "libtpu"), "newest": ("jax", "libtpu", "triton")}
_IMPORT_LINE = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+import\s+([\w, ]+)|import\s+([\w., ]+))", re.M)


def _package_modules() -> dict[str, str]:
    """Every module of our packages: dotted name -> file."""
    modules = {}
    for top, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel = os.path.relpath(dirpath, base)
            prefix = top if rel == "." else top + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    name = prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"
                    modules[name] = os.path.join(dirpath, f)
    return modules


MODULES = _package_modules()
_FILE_TO_MODULE = {path: name for name, path in MODULES.items()}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of ``tree`` (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _strings(tree: ast.AST) -> Iterable[str]:
    """The string constants of ``tree`` but its docstrings, an f-string's constant parts joined."""
    skip = _docstrings(tree)
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skip and id(node) not in parts:
                yield node.value
        elif isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)


def _imports_in(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(0, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", [a.name for a in node.names]))
    return found


def _code_in(text: str) -> list[tuple[int, str, list[str]]]:
    """The imports of a string that holds Python code (what a test runs in a subprocess)."""
    text = textwrap.dedent(text)
    try:
        return _imports_in(ast.parse(text))
    except SyntaxError:  # a fragment: its import lines
        found: list[tuple[int, str, list[str]]] = []
        for m in _IMPORT_LINE.finditer(text):
            if m.group(3):
                found += [(0, n.split(" as ")[0].strip(), []) for n in m.group(3).split(",") if n.strip()]
            else:
                mod = m.group(1)
                names = [n.split(" as ")[0].strip() for n in m.group(2).split(",") if n.strip()]
                found.append((len(mod) - len(mod.lstrip(".")), mod.lstrip("."), names))
        return found


def _read(path: str) -> tuple[list[tuple[int, str, list[str]]], ast.AST]:
    """(level, module, names) of each import in ``path`` (and, where it starts other processes, in
    the Python code among its strings and a helper script named by its file name), and its AST."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = _imports_in(tree)
    if not any(m.split(".")[0] in ("subprocess", "multiprocessing") for _, m, _ in found):
        return found, tree  # it runs no other process: its strings are not code it runs
    for text in _strings(tree):
        if "import" in text:
            found += _code_in(text)
        elif text.endswith(".py") and "/" not in text and " " not in text:
            found.append((0, text[:-3], []))  # a helper script run by its file name
    return found, tree


def _helper(name: str, near: str) -> list[str]:
    """The test helper files an import of ``name`` runs (top-level, as the tests import them:
    from the importing file's folder, or tests/, as ``ways``), if any."""
    first, *rest = name.split(".")
    for folder in (near, TESTS):
        if os.path.isfile(os.path.join(folder, first + ".py")) and first != "conftest":
            return [os.path.join(folder, first + ".py")]
        init = os.path.join(folder, first, "__init__.py")
        if os.path.isfile(init):
            sub = os.path.join(folder, first, *rest) + ".py"
            return [init] + ([sub] if rest and os.path.isfile(sub) else [])
    return []


def _resolve(path: str, level: int, module: str, names: list[str]) -> tuple[list[str], list[str]]:
    """(files of ours or of the tests, external module names) that one import names."""
    here = os.path.dirname(path)
    if level:  # relative: in our packages, or among the test helpers (tests/ways)
        own = _FILE_TO_MODULE.get(path)
        if own is None:
            base = here
            for _ in range(level - 1):
                base = os.path.dirname(base)
            targets = [os.path.join(base, *module.split("."))] if module else [base]
            targets += [os.path.join(t, n) for t in targets[:1] for n in names]
            files = [t + ".py" for t in targets if os.path.isfile(t + ".py")]
            files += [
                os.path.join(t, "__init__.py")
                for t in targets
                if os.path.isfile(os.path.join(t, "__init__.py"))
            ]
            return files, []
        parts = own.split(".")
        if not path.endswith("__init__.py"):
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)]
        module = ".".join(parts + ([module] if module else []))
    candidates = [module] + [f"{module}.{n}" for n in names]
    files: list[str] = []
    for cand in candidates:
        if cand.split(".")[0] in PACKAGES:
            parts = cand.split(".")
            files += [
                MODULES[".".join(parts[:i])]
                for i in range(1, len(parts) + 1)
                if ".".join(parts[:i]) in MODULES
            ]
        else:
            files += _helper(cand, here)
    external = [] if files or module.split(".")[0] in PACKAGES else candidates
    return files, external


def _root_name(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _sites(tree: ast.AST, external: list[str]) -> list[tuple[str, str]]:
    """(kind, what) of the places one file lets a version in."""
    sites = []
    for name in external:
        if name in JAX_INTERNALS or name.startswith(tuple(p + "." for p in JAX_INTERNALS)):
            sites.append(("jax", f"imports {name}"))
        elif name == "libtpu" or name.startswith("libtpu."):
            sites.append(("libtpu", f"imports {name}"))
        elif name == "triton" or name.startswith("triton."):
            sites.append(("triton", f"imports {name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("__version__", "__version_info__"):
            if "jax" in _root_name(node.value):
                sites.append(("jax", f"reads {_root_name(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Call) and node.args:
            name = node.func.id if isinstance(node.func, ast.Name) else ""
            if name in ("hasattr", "getattr") and _root_name(node.args[0]) in _JAX_NAMES:
                sites.append(("jax", f"probes {_root_name(node.args[0])} ({name})"))
            elif any(isinstance(a, ast.Constant) and a.value == "libtpu" for a in node.args):
                sites.append(("libtpu", "looks libtpu up"))  # find_spec("libtpu"), ...
    return sites


_GRAPH: dict[str, tuple[list[str], list[tuple[str, str]]]] = {}


def _node(path: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(files it imports, its sites) of one file, read once."""
    if path not in _GRAPH:
        imports, tree = _read(path)
        files: list[str] = []
        external: list[str] = []
        for level, module, names in imports:
            f, e = _resolve(path, level, module, names)
            files += f
            external += e
        _GRAPH[path] = (list(dict.fromkeys(f for f in files if f != path)), _sites(tree, external))
    return _GRAPH[path]


def why(test_file: str, kinds: Iterable[str]) -> list[str] | None:
    """The chain of files from ``test_file`` to the first site of one of ``kinds`` (the site last),
    breadth first; None when its closure holds none."""
    kinds = tuple(kinds)
    start = os.path.abspath(test_file)
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        path = queue.pop(0)
        files, sites = _node(path)
        hit = next((s for s in sites if s[0] in kinds), None)
        if hit:
            chain = [f"{hit[0]}: {hit[1]}"]
            node: str | None = path
            while node is not None:
                chain.insert(0, os.path.relpath(node, ROOT))
                node = parent[node]
            return chain
        for f in files:
            if f not in parent:
                parent[f] = path
                queue.append(f)
    return None


def test_files() -> list[str]:
    """Every test file of the suite (tests/**/test_*.py), relative to the repository."""
    out = []
    for dirpath, dirnames, files in os.walk(TESTS):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        out += [
            os.path.relpath(os.path.join(dirpath, f), ROOT)
            for f in files
            if f.startswith("test_") and f.endswith(".py")
        ]
    return sorted(out)


def selected(end: str) -> list[str]:
    """The test files ``end`` ("oldest" or "newest") runs: those that depend on its versions."""
    return [f for f in test_files() if why(os.path.join(ROOT, f), KINDS[end]) is not None]


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 1 or args[0] not in KINDS:
        print(f"usage: {os.path.basename(__file__)} oldest|newest [--why]", file=sys.stderr)
        return 2
    if "--why" in argv:
        for f in test_files():
            chain = why(os.path.join(ROOT, f), KINDS[args[0]])
            print(f"{f}: " + (" -> ".join(chain[1:]) if chain else "none"))
        return 0
    print("\n".join(selected(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
