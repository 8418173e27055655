"""The TPU interpreter is built from parts that own their state (issue 50 §1): no
class in ``pallas_tpu/_src/interpret/`` reads a ``self.`` member that it neither
defines (assigns in its own methods, its class body or its dataclass fields, or
defines as a method or property) nor receives (a constructor parameter). A mixin
that reads its host's members, or an attribute set onto an object from outside,
fails here."""

from __future__ import annotations

import ast
import pathlib

import pytest

INTERPRET = pathlib.Path(__file__).resolve().parents[2] / "packages/pallas-tpu/src/pallas_tpu/_src/interpret"


def _self_name(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    args = fn.args.posonlyargs + fn.args.args
    if not args or any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return None
    return args[0].arg


def _targets(node: ast.AST):
    if isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _members(cls: ast.ClassDef) -> tuple[set[str], set[str], list[tuple[str, int]]]:
    """(what the class defines, what its constructor receives, the self. members it reads)."""
    defined: set[str] = set()
    received: set[str] = set()
    reads: list[tuple[str, int]] = []
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            defined.update(t.id for tgt in stmt.targets for t in _targets(tgt) if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            defined.add(stmt.target.id)
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        me = _self_name(fn)
        if me is None:
            continue
        if fn.name == "__init__":
            a = fn.args
            received.update(x.arg for x in a.posonlyargs + a.args[1:] + a.kwonlyargs)
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
                if isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                elif isinstance(node.ctx, ast.Load):
                    reads.append((node.attr, node.lineno))
    return defined, received, reads


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in cls.bases]


# Members Python's own bases give a class of interpret/ (an Exception's args).
_BUILTIN_BASES = {"Exception": set(dir(Exception)), "NamedTuple": set(), "Protocol": set()}


def undefined_reads(root: pathlib.Path = INTERPRET) -> list[str]:
    classes: dict[str, ast.ClassDef] = {}
    files: dict[str, str] = {}
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
                files[node.name] = path.name
    out = []
    for name, cls in classes.items():
        defined, received, reads = _members(cls)
        allowed = defined | received
        for base in _base_names(cls):
            if base in classes:
                b_defined, b_received, _ = _members(classes[base])
                allowed |= b_defined | b_received
            else:
                allowed |= _BUILTIN_BASES.get(base, set())
        for attr, line in reads:
            if attr not in allowed and not (attr.startswith("__") and attr.endswith("__")):
                out.append(
                    f"{files[name]}:{line}: {name} reads self.{attr}, which it neither defines nor receives"
                )
    return out


def test_every_member_read_is_defined_or_received():
    bad = undefined_reads()
    assert not bad, "\n".join(bad)


def test_no_mixin_bases():
    """The interpreter's classes derive from no other class of interpret/ (parts, not mixins)."""
    classes = {}
    for path in sorted(INTERPRET.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (path.name, node)
    mixed = [
        f"{file}: {name}({', '.join(_base_names(node))})"
        for name, (file, node) in classes.items()
        if sum(b in classes for b in _base_names(node)) > 0
    ]
    assert not mixed, "\n".join(mixed)


@pytest.mark.parametrize(
    "source, expect",
    [
        ("class A:\n    def f(self):\n        return self.x\n", ["reads self.x"]),
        (
            "class A:\n    def __init__(self):\n        self.x = 1\n    def f(self):\n        return self.x\n",
            [],
        ),
        (
            "class A:\n    x: int = 0\n    def f(self):\n        return self.x + self.g()\n    def g(self):\n        return 1\n",
            [],
        ),
        ("class A:\n    def __init__(self, x):\n        pass\n    def f(self):\n        return self.x\n", []),
        (
            "class B:\n    def f(self):\n        self.y = 1\nclass A(B):\n    def g(self):\n        return self.y\n",
            [],
        ),
    ],
)
def test_the_check_sees_reads(tmp_path, source, expect):
    (tmp_path / "m.py").write_text(source)
    got = undefined_reads(tmp_path)
    assert len(got) == len(expect) and all(e in g for e, g in zip(expect, got)), got
