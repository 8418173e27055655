"""The shape of ``jax_kernel_runtime.triton``: its modules import one way (no
circle, counting imports inside functions too), the GPU packages use its public
names only, and ``import jax_kernel_runtime`` loads neither it nor Triton."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]
RUNTIME = REPO / "src" / "jax_kernel_runtime"


def module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the runtime modules it imports, at top level or in a function."""
    modules = {module_name(p): p for p in RUNTIME.rglob("*.py")}
    stubs = {module_name(p) for p in RUNTIME.rglob("*.pyi")}  # the native extension

    def owner(name: str) -> str | None:  # the module that ``a.b.c`` or ``from a.b import c`` names
        while name and name not in modules and name not in stubs:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {owner(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = {t for t in targets if t and t != name and t.startswith("jax_kernel_runtime")}
    return graph | {stub: set() for stub in stubs}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                found.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_runtime_modules_import_one_way():
    graph = import_graph()
    assert "jax_kernel_runtime.triton._state" in graph
    assert cycles(graph) == []
    # The interpreter's layers: _state below _patches and _batched, which _interpret applies.
    assert graph["jax_kernel_runtime.triton._state"] == set()
    assert "jax_kernel_runtime.triton._interpret" not in graph["jax_kernel_runtime.triton._patches"]
    assert "jax_kernel_runtime.triton._patches" not in graph["jax_kernel_runtime.triton._batched"]


def test_packages_use_the_public_names_only():
    import jax_kernel_runtime.triton as layer

    names = {n for n in vars(layer) if not n.startswith("_")}
    used = set()
    for package in ("pallas-gpu", "jax-triton"):
        for path in (REPO / "packages" / package / "src").rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_kernel_runtime"):
                    imported = node.module.split(".")[1:] + [a.name for a in node.names]
                    assert not any(p.startswith("_") for p in imported), f"{path}: from {node.module} import"
                    if node.module == "jax_kernel_runtime.triton":
                        used |= {a.name for a in node.names}
                elif isinstance(node, ast.Import):
                    assert not any(a.name.startswith("jax_kernel_runtime._") for a in node.names), path
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    if node.value.id == "jkr_triton":  # from jax_kernel_runtime import triton as jkr_triton
                        used.add(node.attr)
    assert used and used <= names, used - names


def test_import_loads_neither_the_layer_nor_triton():
    code = (
        "import sys, jax_kernel_runtime as jkr\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', "
        "'jax_kernel_runtime.triton'))))\n"
        "assert callable(jkr.prepare_triton) and 'jax_kernel_runtime.triton' in sys.modules\n"
        "print('triton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "False"]
