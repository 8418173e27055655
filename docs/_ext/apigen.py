"""The API reference pages, generated from the public modules, and the check that
every public name has documentation.

A module's public names are those its source binds at top level without a leading
underscore: ``from x import Name as Name`` (the re-export idiom of STYLE.md), ``def``,
``class`` and assignments; plain imports (``import jax``) are not. Functions and
classes need a docstring of their own (a dataclass's generated ``Name(field, ...)``
does not count); any other object (a primitive, an enum member, a constant, a type
alias) needs a ``#:`` comment or a string literal after its assignment where it is
defined. A public name without one is a warning, which ``-W`` turns into an error.

At ``builder-inited`` this writes ``api/_generated/<module>.rst`` (an autosummary
table of the functions and classes, one page each, and the data with their
comments) before autosummary generates its stubs.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import types

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

logger = logging.getLogger(__name__)

# (module, one line shown above its table). The order is the API index's.
MODULES = [
    ("pallas", "The kernel language (``import pallas as pl``): the API of ``jax.experimental.pallas``."),
    (
        "pallas_gpu",
        "The Triton backend (``import pallas_gpu as plgpu``): GPU-only primitives, compiler and interpreter parameters, autotuning.",
    ),
    ("pallas_gpu.ops.attention", "Flash attention (``mha``), the API of JAX's ``ops.gpu.attention``."),
    (
        "pallas_gpu.ops.decode_attention",
        "Decode attention (``mqa``, ``gqa``), the API of JAX's ``ops.gpu.decode_attention``.",
    ),
    ("pallas_gpu.ops.paged_attention", "Paged attention, the API of JAX's ``ops.gpu.paged_attention``."),
    ("pallas_gpu.ops.layer_norm", "Layer norm, the API of JAX's ``ops.gpu.layer_norm``."),
    ("pallas_gpu.ops.rms_norm", "RMS norm, the API of JAX's ``ops.gpu.rms_norm``."),
    ("pallas_gpu.ops.softmax", "Softmax, the API of JAX's ``ops.gpu.softmax``."),
    ("pallas_gpu.ops.matmul", "The autotuned matmul (JAX's GPU ops have none)."),
    (
        "pallas_tpu",
        "The TPU kernel language (``import pallas_tpu as pltpu``): the API of ``jax.experimental.pallas.tpu``, TPU interpret mode, the Mosaic lowering, ``run_mosaic`` and ``compile_check``.",
    ),
    ("jax_triton", "``triton_call`` for ``@triton.jit`` kernels (``import jax_triton as jt``)."),
    (
        "jax_kernel_runtime",
        "The native runtime: XLA FFI launch of compiled kernel images, shared by the GPU packages.",
    ),
    (
        "pallas.backend",
        "What a backend package may use of pallas-core (for backend authors, not kernel writers).",
    ),
]

OUT = os.path.join("api", "_generated")


def _source_module(mod: types.ModuleType, name: str) -> str:
    """The module that defines ``name`` bound in ``mod`` by ``from X import name as name``."""
    tree = ast.parse(inspect.getsource(mod))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if any((a.asname or a.name) == name for a in node.names):
                return node.module
    return mod.__name__


def public_names(mod: types.ModuleType) -> list[str]:
    """The names ``mod``'s source binds publicly at top level, in source order."""
    tree = ast.parse(inspect.getsource(mod))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names += [a.asname for a in node.names if a.asname and a.asname == a.name]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    seen: set[str] = set()
    out = []
    for n in names:
        if n.startswith("_") or n in seen or isinstance(getattr(mod, n, None), types.ModuleType):
            continue
        seen.add(n)
        out.append(n)
    return out


def _is_routine_or_class(obj) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, __import__("functools").partial)


def _own_doc(obj, name: str) -> str | None:
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        if doc and doc.startswith(f"{obj.__name__}(") and hasattr(obj, "__dataclass_fields__"):
            return None  # the signature a dataclass writes when it has no docstring
        return doc
    return getattr(obj, "__doc__", None)


def _data_doc(mod: types.ModuleType, name: str) -> str | None:
    """The ``#:`` comment or docstring of ``name``'s assignment where it is defined."""
    src = _source_module(mod, name)
    try:
        docs = ModuleAnalyzer.for_module(src).find_attr_docs()
    except Exception:  # noqa: BLE001
        return None
    lines = docs.get(("", name))
    return "\n".join(lines).strip() if lines else None


def _page(modname: str, intro: str) -> tuple[str, list[str]]:
    mod = importlib.import_module(modname)
    routines, data, undocumented = [], [], []
    for name in public_names(mod):
        obj = getattr(mod, name)
        if _is_routine_or_class(obj):
            if not _own_doc(obj, name):
                undocumented.append(name)
            routines.append(name)
        else:
            doc = _data_doc(mod, name)
            if not doc:
                undocumented.append(name)
            data.append((name, doc or ""))
    title = f"``{modname}``"
    lines = [title, "=" * len(title), "", intro, "", f".. automodule:: {modname}", "   :no-members:", ""]
    if routines:
        lines += [
            ".. currentmodule:: " + modname,
            "",
            ".. autosummary::",
            "   :toctree: _autosummary",
            "",
        ]
        lines += [f"   {n}" for n in routines]
        lines.append("")
    if data:
        if not routines:
            lines += [".. currentmodule:: " + modname, ""]
        lines += ["Constants and objects", "---------------------", ""]
        for name, doc in data:
            lines += [f".. py:data:: {name}", ""]
            lines += ["   " + line for line in doc.splitlines()]
            lines.append("")
    return "\n".join(lines), undocumented


def generate(app) -> None:
    out = os.path.join(app.srcdir, OUT)
    os.makedirs(out, exist_ok=True)
    index = []
    total = 0
    for modname, intro in MODULES:
        text, undocumented = _page(modname, intro)
        total += len(public_names(importlib.import_module(modname)))
        path = os.path.join(out, f"{modname}.rst")
        old = open(path).read() if os.path.exists(path) else None
        if old != text:  # unchanged pages keep their mtime: no rebuild
            with open(path, "w") as f:
                f.write(text)
        index.append(modname)
        for name in undocumented:
            logger.warning(
                f"public name {modname}.{name} has no documentation: add a docstring (function, "
                "class) or a '#:' comment above its assignment where it is defined",
                type="apigen",
                subtype="undocumented",
            )
    logger.info(f"apigen: {total} public names in {len(MODULES)} modules")


def setup(app):
    app.connect("builder-inited", generate, priority=400)  # before autosummary's stubs (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
