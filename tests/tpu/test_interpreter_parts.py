"""The TPU interpreter is built from parts that own their state: no
class in ``pallas_tpu/_src/interpret/`` reads a ``self.`` member that it neither
defines (assigns in its own methods, its class body or its dataclass fields, or
defines as a method or property) nor receives (a constructor parameter). A mixin
that reads its host's members, or an attribute set onto an object from outside,
fails here. And no part is handed the whole ``Interpreter`` (``interpreter_handoffs``):
each receives the parts it needs (memory, Ref access, checks, the cursor...); nor is
any part handed the object that builds it (``self_handoffs``): what an owner and its part
both use is a part of its own that both receive (the device's ``SessionLink``)."""

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


# Names the interpreter goes by where it is handed around (the rules' first argument).
_INTERP_NAMES = {"interp", "interpreter"}
# Classes that hold the interpreter because they drive it, not parts of it: pallas_call's
# record of the running call (``_Call``: the interpreter, the jaxpr, the grid mapping).
_OWNERS = {"_Call"}


def _is_rule_call(call: ast.Call) -> bool:
    """A call of a primitive's rule (``STATE_RULES[p](interp, eqn, ...)``, ``rule(...)``):
    rules are functions of the interpreter (``rules.py``), not parts that keep it."""
    callee = ast.unparse(call.func)
    return "RULES" in callee or callee == "rule"


def _names_interpreter(name: str, annotation: ast.expr | None) -> bool:
    return name in _INTERP_NAMES or (annotation is not None and "Interpreter" in ast.unparse(annotation))


def _holds(cls: ast.ClassDef) -> list[tuple[int, str]]:
    """Where ``cls`` receives or keeps the interpreter: a constructor parameter or a
    field named so or annotated ``Interpreter``, a ``self.interp`` member."""
    out = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if _names_interpreter(stmt.target.id, stmt.annotation):
                out.append((stmt.lineno, f"has a field {stmt.target.id}"))
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            a = stmt.args
            for arg in a.posonlyargs + a.args[1:] + a.kwonlyargs:
                if _names_interpreter(arg.arg, arg.annotation):
                    out.append((stmt.lineno, f"receives {arg.arg}"))
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and (me := _self_name(stmt)):
            for node in ast.walk(stmt):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in _INTERP_NAMES
                    and isinstance(node.value, ast.Name)
                    and node.value.id == me
                ):
                    out.append((node.lineno, f"keeps {me}.{node.attr}"))
    return out


def interpreter_handoffs(root: pathlib.Path = INTERPRET) -> list[str]:
    """Where a class of interpret/ other than the ``Interpreter`` (and the ``_OWNERS``
    that drive it) gets the interpreter itself (``_holds``), is constructed with it,
    or where the ``Interpreter`` hands ``self`` to anything but a rule."""
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(root.glob("*.py"))}
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    parts = classes - _OWNERS - {"Interpreter"}
    out = []
    for file, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in parts:
                out += [f"{file}:{line}: {node.name} {what} (the interpreter)" for line, what in _holds(node)]
            elif isinstance(node, ast.Call) and not _is_rule_call(node):
                callee = ast.unparse(node.func).rsplit(".", 1)[-1]
                args = [*node.args, *(k.value for k in node.keywords)]
                if callee in parts and any(isinstance(a, ast.Name) and a.id in _INTERP_NAMES for a in args):
                    out.append(f"{file}:{node.lineno}: {callee} is constructed with the interpreter")
            elif isinstance(node, ast.ClassDef) and node.name == "Interpreter":
                for call in ast.walk(node):
                    if not isinstance(call, ast.Call) or _is_rule_call(call):
                        continue
                    args = [*call.args, *(k.value for k in call.keywords)]
                    if any(isinstance(a, ast.Name) and a.id == "self" for a in args):
                        out.append(
                            f"{file}:{call.lineno}: the Interpreter hands itself to {ast.unparse(call.func)}"
                        )
    return out


def test_no_part_receives_the_interpreter():
    bad = interpreter_handoffs()
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source, found",
    [
        ("class A:\n    def __init__(self, interp):\n        self.x = interp.memory\n", 1),
        ("class A:\n    owner: Interpreter\n", 1),
        ("class _Call:\n    interp: Interpreter\n", 0),
        ("class A:\n    def __init__(self, owner: Interpreter):\n        pass\n", 1),
        ("class A:\n    def f(self):\n        return self.interp.memory\n", 1),
        ("class Interpreter:\n    def __init__(self):\n        self.t = (make or Local)(self)\n", 1),
        ("class B:\n    pass\ndef make(interp):\n    return B(interp)\n", 1),
        ("class Interpreter:\n    def f(self, eqn):\n        return RULES[eqn](self, eqn)\n", 0),
        ("class Interpreter:\n    def __init__(self):\n        self.a = A(self.memory, self.where)\n", 0),
        ("def rule(interp, eqn):\n    return interp.memory\n", 0),
    ],
)
def test_the_handoff_check_sees_handoffs(tmp_path, source, found):
    (tmp_path / "m.py").write_text(source)
    assert len(interpreter_handoffs(tmp_path)) == found, interpreter_handoffs(tmp_path)


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


def self_handoffs(root: pathlib.Path = INTERPRET) -> list[str]:
    """Where a method of a class of interpret/ constructs another class of interpret/
    with ``self``: the part built so holds its owner, and reads the owner's members
    (``RemoteDMAs`` read ten of its ``DeviceTransport``'s: its callbacks, session and
    device ids, semaphore keys, race records), a mixin by another name. (The
    ``Interpreter`` handing itself to anything is ``interpreter_handoffs``'s.)"""
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(root.glob("*.py"))}
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    out = []
    for file, tree in trees.items():
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not (me := _self_name(fn)):
                    continue
                for call in ast.walk(fn):
                    if not isinstance(call, ast.Call):
                        continue
                    callee = ast.unparse(call.func).rsplit(".", 1)[-1]
                    args = [*call.args, *(k.value for k in call.keywords)]
                    if callee in classes and any(isinstance(a, ast.Name) and a.id == me for a in args):
                        out.append(f"{file}:{call.lineno}: {cls.name} hands itself to the {callee} it builds")
    return out


def test_no_part_is_handed_its_owner():
    bad = self_handoffs()
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source, found",
    [
        ("class R:\n    pass\nclass T:\n    def __init__(self):\n        self.r = R(1, self)\n", 1),
        ("class R:\n    pass\nclass T:\n    def __init__(self):\n        self.r = R(owner=self)\n", 1),
        ("class R:\n    pass\nclass T:\n    def __init__(self, link):\n        self.r = R(link)\n", 0),
        ("class T:\n    def f(self):\n        return g(self)\n", 0),
        ("class R:\n    pass\nclass T:\n    @staticmethod\n    def f(x):\n        return R(x)\n", 0),
    ],
)
def test_the_self_handoff_check_sees_handoffs(tmp_path, source, found):
    (tmp_path / "m.py").write_text(source)
    assert len(self_handoffs(tmp_path)) == found, self_handoffs(tmp_path)
