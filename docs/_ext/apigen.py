"""The API reference pages, generated from the public modules, and the check that
every public name has documentation.

A module's public names are its ``__all__`` where it has one, else those its source
binds at top level without a leading underscore: ``from x import Name as Name`` (the
re-export idiom of CONTRIBUTING.md, "Style"), ``def``, ``class`` and assignments; plain
imports (``import jax``) are not. Functions and classes need a docstring of their own
(a dataclass's generated ``Name(field, ...)`` does not count); a ``functools.partial``
is documented by the docstring of the function it binds (as autodoc shows it). Any
other object (a primitive, an enum member, a constant, a type alias) needs a ``#:``
comment or a string literal after its assignment, or a ``#`` comment block just above
it, where it is defined. A function of JAX's that we re-export (it has no docstring of
its own, and none of ours can be attached to it in the source) is documented by the
``#`` comment just above its assignment in our source, which is shown as its
docstring. A public name without any of these is a warning, which ``-W`` turns into an
error.

At ``config-inited`` this writes ``api/_generated/<module>.rst`` (an autosummary
table of the functions and classes, one page each, and the data with their
comments) before autosummary generates its stubs.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys
import types
import warnings

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

logger = logging.getLogger(__name__)

# The pallas_tpu.ops modules with a page (each the module a user imports, as from JAX's
# ``ops.tpu``), and the line shown above its table.
TPU_OPS = [
    (
        "splash_attention.splash_attention_mask",
        "The masks splash attention takes, the API of JAX's ``splash_attention_mask``.",
    ),
    ("paged_attention", "Paged attention for decoding, the API of JAX's ``ops.tpu.paged_attention``."),
    ("paged_attention.paged_attention_kernel", "The paged attention op and JAX's kernel names."),
    ("paged_attention.quantization_utils", "int8 KV pages: ``QuantizedTensor`` and its codes."),
    ("paged_attention.util", "The plain-JAX reference of paged attention."),
    (
        "ragged_paged_attention",
        "Ragged paged attention (mixed prefill and decode), the API of JAX's ``ops.tpu.ragged_paged_attention``.",
    ),
    ("ragged_paged_attention.kernel", "The ragged paged attention op, its checks and its reference."),
    (
        "ragged_paged_attention.tuned_block_sizes",
        "The ragged kernel's block sizes: measured rows, else a rule.",
    ),
    (
        "ragged_paged_attention.v3",
        "Ragged paged attention as vLLM's TPU backend calls it (the cache update too).",
    ),
    ("matmul", "Blocked matmul on the TensorCore, the API of JAX's ``ops.tpu.matmul``."),
    (
        "megablox",
        "Grouped matmuls for mixture-of-experts layers (the differentiable ``gmm``), the API of JAX's ``ops.tpu.megablox``.",
    ),
    ("megablox.gmm", "The grouped matmul kernels ``gmm`` and ``tgmm``."),
    ("megablox.ops", "The differentiable grouped matmul."),
    ("megablox.common", "Chip and dtype helpers of megablox."),
    ("all_gather", "All-gather over a ring of TPU devices, the API of JAX's ``ops.tpu.all_gather``."),
    ("random", "Counter-based PRNG kernels, the API of JAX's ``ops.tpu.random``."),
    ("random.threefry", "Threefry-2x32: ``jax.random``'s bits from a Pallas kernel."),
    ("random.philox", "Philox-4x32-10 from a Pallas kernel."),
    ("random.prng_utils", "What the PRNG kernels share: counters and blocks of the output."),
]
# The pages of TPU_OPS without a module of JAX's to mirror (vLLM's call).
TPU_OPS_OURS_ONLY = {"ragged_paged_attention.v3"}

# (module, its line in the API index's table). The order is the index's. A module's page shows
# its docstring (the line too only where it has none: a page said the same thing three times).
MODULES = [
    ("pallas", "The kernel language (``import pallas as pl``): the API of ``jax.experimental.pallas``."),
    (
        "pallas_gpu",
        "The Triton backend (``import pallas_gpu as plgpu``): GPU-only primitives, compiler and interpreter parameters, autotuning.",
    ),
    (
        "pallas_gpu.ops",
        "The GPU ops: one module per op, each with the API of its namesake in JAX's ``ops.gpu``.",
    ),
    ("pallas_gpu.ops.attention", "Flash attention (``mha``), the API of JAX's ``ops.gpu.attention``."),
    (
        "pallas_gpu.ops.decode_attention",
        "Decode attention (``mqa``, ``gqa``), the API of JAX's ``ops.gpu.decode_attention``.",
    ),
    ("pallas_gpu.ops.paged_attention", "Paged attention, the API of JAX's ``ops.gpu.paged_attention``."),
    (
        "pallas_gpu.ops.attention_fp8",
        "Flash attention forward on fp8 e4m3 inputs with per-tensor scales (``mha_fp8``; JAX's GPU ops have none).",
    ),
    ("pallas_gpu.ops.layer_norm", "Layer norm, the API of JAX's ``ops.gpu.layer_norm``."),
    ("pallas_gpu.ops.rms_norm", "RMS norm, the API of JAX's ``ops.gpu.rms_norm``."),
    ("pallas_gpu.ops.softmax", "Softmax, the API of JAX's ``ops.gpu.softmax``."),
    ("pallas_gpu.ops.matmul", "The autotuned matmul (JAX's GPU ops have none)."),
    (
        "pallas_tpu",
        "The TPU kernel language (``import pallas_tpu as pltpu``): the API of ``jax.experimental.pallas.tpu``, TPU interpret mode, the Mosaic lowering, ``run_mosaic``, ``compile_check`` and ``estimate``.",
    ),
    *[(f"pallas_tpu.ops.{m}", intro) for m, intro in TPU_OPS],
    ("jax_triton", "``triton_call`` for ``@triton.jit`` kernels (``import jax_triton as jt``)."),
    (
        "jax_kernel_runtime",
        "The native runtime: XLA FFI launch of compiled kernel images, shared by the GPU packages.",
    ),
    (
        "jax_kernel_runtime.triton",
        "The Triton layer pallas-gpu and jax-triton share: compiling, caches, Triton's interpreter on host arrays.",
    ),
    (
        "jax_kernel_runtime.jax_plugin",
        "The hook JAX calls when it starts (the ``jax_plugins`` entry point): registers the runtime's FFI targets.",
    ),
    (
        "pallas.backend",
        "What a backend package may use of pallas-core (for backend authors, not kernel writers).",
    ),
]

# Our module -> the JAX module whose API it mirrors.
MIRRORS = {
    "pallas": "jax.experimental.pallas",
    "pallas_gpu": "jax.experimental.pallas.triton",
    "pallas_tpu": "jax.experimental.pallas.tpu",
    **{
        f"pallas_gpu.ops.{m}": f"jax.experimental.pallas.ops.gpu.{m}"
        for m in ("attention", "decode_attention", "paged_attention", "layer_norm", "rms_norm", "softmax")
    },
    **{
        f"pallas_tpu.ops.{m}": f"jax.experimental.pallas.ops.tpu.{m}"
        for m, _ in TPU_OPS
        if m not in TPU_OPS_OURS_ONLY
    },
}

# "module.name" -> the labels of docs/differences.md that say how it differs from JAX's.
DIFFERS = {
    "pallas.pallas_call": [
        "diff-interpret",
        "diff-index-maps",
        "diff-dynamic-grid",
        "diff-grad",
        "diff-errors",
        "diff-export",
        "diff-backend",
    ],
    "pallas.program_id": ["diff-program-id"],
    "pallas.num_programs": ["diff-num-programs"],
    "pallas.BlockSpec": ["diff-index-maps", "diff-not-yet"],
    "pallas.Buffered": ["diff-not-yet"],
    "pallas.GridSpec": ["diff-dynamic-grid"],
    "pallas.kernel": ["diff-interpret-params"],
    "pallas_tpu.InterpretParams": ["diff-tpu-interpret"],
    "pallas_tpu.TensorCoreMesh": ["diff-tpu-create-tensorcore-mesh"],
    "pallas_gpu.CompilerParams": ["diff-gpu-params"],
    "pallas_gpu.ops.decode_attention.mqa": ["diff-decode"],
    "pallas_gpu.ops.decode_attention.gqa": ["diff-decode"],
    "pallas_gpu.ops.paged_attention.paged_attention": ["diff-decode"],
}

# Public modules (no name part with a leading underscore) without a page of their own, by
# prefix, with the reason. The build fails on any other public module without a page.
NO_PAGE = {
    # The op modules that mirror JAX's ops.tpu have their pages in TPU_OPS; their helper
    # modules (megablox.common, paged_attention.util, ...) are JAX's layout, not API.
    "pallas_tpu.ops.": "TPU_OPS lists the pages of the ops",
    # New (its author decides its page): the command line ``python -m pallas_tpu.estimate``;
    # its function is ``pltpu.estimate``, on the pallas_tpu page.
    "pallas_tpu.estimate.": "the command line of pltpu.estimate",
}

OUT = os.path.join("api", "_generated")
_OURS = ("pallas", "pallas_gpu", "pallas_tpu", "jax_triton", "jax_kernel_runtime")


def _source_module(mod: types.ModuleType, name: str) -> str:
    """The module that defines ``name`` bound in ``mod`` by ``from X import name as name``."""
    tree = ast.parse(inspect.getsource(mod))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            if any((a.asname or a.name) == name for a in node.names):
                if node.level == 0:
                    return node.module
                package = mod.__name__ if hasattr(mod, "__path__") else mod.__package__
                return importlib.util.resolve_name("." * node.level + node.module, package)
    return mod.__name__


def public_names(mod: types.ModuleType) -> list[str]:
    """``mod.__all__``, or the names ``mod``'s source binds publicly at top level, in source order."""
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
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
    # custom_vjp / custom_jvp functions are callables with a __name__, not routines;
    # a functools.partial has no __name__, and autodoc documents it as a function
    return (
        inspect.isclass(obj)
        or inspect.isroutine(obj)
        or isinstance(obj, functools.partial)
        or (callable(obj) and hasattr(obj, "__name__"))
    )


def _own_doc(obj, name: str) -> str | None:
    while isinstance(obj, functools.partial):  # autodoc shows the bound function's docstring
        obj = obj.func
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


def _comment_doc(mod: types.ModuleType, name: str) -> str | None:
    """The ``#`` comment block just above ``name = ...`` in the module defining it."""
    src = importlib.import_module(_source_module(mod, name))
    lines = inspect.getsource(src).splitlines()
    for node in ast.parse("\n".join(lines)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            comment = []
            i = node.lineno - 2
            while i >= 0 and lines[i].lstrip().startswith("#"):
                comment.insert(0, lines[i].lstrip().lstrip("#:").strip())
                i -= 1
            return "\n".join(comment) or None
    return None


# id(class) -> "module.name" of the page that documents it (the first module exporting it).
FIRST_PAGE: dict[int, str] = {}

# "module.name" of every function and class page autosummary writes (api/_generated/_autosummary).
STUB_NAMES: set[str] = set()

# "module.name" -> docstring text for the re-exported JAX functions (see above).
COMMENT_DOCS: dict[str, str] = {}


def _page(modname: str, intro: str) -> tuple[str, list[str]]:
    mod = importlib.import_module(modname)
    routines, data, undocumented, also = [], [], [], []
    for name in public_names(mod):
        obj = getattr(mod, name)
        if inspect.isclass(obj):
            # A class re-exported by a later module is documented once, under its first
            # module (two pages for one class would be two descriptions of its canonical name).
            first = FIRST_PAGE.setdefault(id(obj), f"{modname}.{name}")
            if first != f"{modname}.{name}":
                also.append((name, first))
                continue
        if _is_routine_or_class(obj):
            if not _own_doc(obj, name):
                doc = (
                    _comment_doc(mod, name) if not getattr(obj, "__module__", "").startswith(_OURS) else None
                )
                if doc:
                    COMMENT_DOCS[f"{modname}.{name}"] = doc
                else:
                    undocumented.append(name)
            routines.append(name)
        else:
            doc = _data_doc(mod, name) or _comment_doc(mod, name)
            if not doc:
                undocumented.append(name)
            data.append((name, doc or ""))
    title = f"``{modname}``"
    lines = [title, "=" * len(title), ""]
    if not inspect.getdoc(mod):
        lines += [intro, ""]
    lines += [f".. automodule:: {modname}", "   :no-members:"]
    parent, _, leaf = modname.rpartition(".")
    if parent and getattr(importlib.import_module(parent), leaf, mod) is not mod:
        # Its parent's name of the same dotted name, e.g. megablox.gmm (the function, JAX's):
        # that one is the indexed object.
        lines.append("   :no-index:")
    lines.append("")
    children = [m for m, _ in MODULES if m.rpartition(".")[0] == modname]
    if children:
        lines += ["Its modules: " + ", ".join(f":doc:`{m}`" for m in children) + ".", ""]
    if routines:
        lines += [
            ".. currentmodule:: " + modname,
            "",
            ".. autosummary::",
            "   :toctree: _autosummary",
            "",
        ]
        lines += [f"   {n}" for n in routines]
        STUB_NAMES.update(f"{modname}.{n}" for n in routines)
        lines.append("")
    if data:
        if not routines:
            lines += [".. currentmodule:: " + modname, ""]
        lines += ["Constants and objects", "---------------------", ""]
        for name, doc in data:
            lines += [f".. py:data:: {name}", ""]
            lines += ["   " + line for line in doc.splitlines()]
            lines.append("")
    if also:
        lines += [
            "Also exported here (documented where they are first exported): "
            + ", ".join(f":py:class:`{modname}.{n} <{first}>`" for n, first in also)
            + ".",
            "",
        ]
    lines += _mirror_section(modname, mod, dict(also))
    return "\n".join(lines), undocumented


def _mirror_section(modname: str, mod: types.ModuleType, elsewhere: dict[str, str]) -> list[str]:
    """A table of the names that mirror JAX's, each with the sections saying what differs."""
    names = public_names(mod)
    if modname not in MIRRORS or not names:  # (a package of modules only: pallas_tpu.ops.random)
        return []
    jax_mod = importlib.import_module(MIRRORS[modname])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX's deprecated names warn on getattr
        mirrored = [n for n in names if hasattr(jax_mod, n)]
    ours = [n for n in names if n not in mirrored]
    unknown = [k for k in DIFFERS if k.rpartition(".")[0] == modname and k.rpartition(".")[2] not in mirrored]
    if unknown:
        raise ValueError(f"apigen.DIFFERS names {unknown}, which are not mirrors of {MIRRORS[modname]}")
    lines = [
        "Names that mirror JAX's",
        "-----------------------",
        "",
        f"{len(mirrored)} of the {len(names)} public names mirror ``{MIRRORS[modname]}``: they behave as JAX "
        "documents them except where the last column links to a difference "
        "(all of them: :doc:`/differences`).",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "",
        "   * - ours",
        "     - JAX's",
        "     - differs",
    ]
    for n in mirrored:
        labels = DIFFERS.get(f"{modname}.{n}", [])
        differs = ", ".join(f":ref:`{label}`" for label in labels) or "no"
        ours_ref = f":py:obj:`{n} <{elsewhere[n]}>`" if n in elsewhere else f":py:obj:`{n}`"
        lines += [f"   * - {ours_ref}", f"     - ``{MIRRORS[modname]}.{n}``", f"     - {differs}"]
    lines.append("")
    if ours:
        lines += [
            "Ours only (no JAX counterpart): "
            + ", ".join(
                f":py:obj:`{n} <{elsewhere[n]}>`" if n in elsewhere else f":py:obj:`{n}`" for n in ours
            )
            + ".",
            "",
        ]
    return lines


def public_modules() -> list[str]:
    """Every public module of our packages: each package's ``__init__`` and the modules
    and subpackages under it whose names have no leading underscore."""
    found = []
    todo = list(_OURS)
    while todo:
        name = todo.pop()
        found.append(name)
        parent, _, leaf = name.rpartition(".")
        before = getattr(sys.modules.get(parent), leaf, None) if parent else None
        mod = importlib.import_module(name)
        if before is not None and not isinstance(before, types.ModuleType):
            # A submodule named as a function of its package (``python -m pallas_tpu.estimate``
            # beside ``pltpu.estimate``): importing it rebinds the package's name; the page
            # documents the function.
            setattr(sys.modules[parent], leaf, before)
        for info in pkgutil.iter_modules(getattr(mod, "__path__", [])):
            if not info.name.startswith("_"):
                todo.append(f"{name}.{info.name}")
    return sorted(found)


def _check_every_module_has_a_page() -> None:
    pages = {m for m, _ in MODULES}
    for name in public_modules():
        if name not in pages and not any(name.startswith(p) or name == p[:-1] for p in NO_PAGE):
            logger.warning(
                f"public module {name} has no API page: add it to apigen.MODULES (and to "
                "docs/api/index.md's toctree), or to NO_PAGE with the reason",
                type="apigen",
                subtype="no_page",
            )


def generate(app, config=None) -> None:
    out = os.path.join(app.srcdir, OUT)
    os.makedirs(out, exist_ok=True)
    index = []
    total = 0
    FIRST_PAGE.clear()
    STUB_NAMES.clear()
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
    # The API index's table (api/index.md includes it): each module's page and line.
    table = [
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 35 65",
        "",
        "   * - module",
        "     - what it is",
    ]
    for modname, intro in MODULES:
        table += [f"   * - :doc:`{modname} </api/_generated/{modname}>`", f"     - {intro}"]
    path = os.path.join(out, "modules.inc")
    text = "\n".join(table) + "\n"
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    # Stubs of names no longer on a page (removed, or now documented under another module)
    # would be orphan pages: autosummary writes the stubs but never deletes them.
    stubs = os.path.join(out, "_autosummary")
    wanted = {f"{p}.rst" for p in STUB_NAMES}
    for stale in set(os.listdir(stubs) if os.path.isdir(stubs) else ()) - wanted:
        os.remove(os.path.join(stubs, stale))
    _check_every_module_has_a_page()
    logger.info(f"apigen: {total} public names in {len(MODULES)} modules")


def _fill_docstring(app, what, name, obj, options, lines) -> None:
    if not lines and name in COMMENT_DOCS:
        lines.extend(COMMENT_DOCS[name].splitlines())


def setup(app):
    # config-inited: before Sphinx looks for the source files, so the pages are found on a first build
    app.connect("config-inited", generate)
    app.connect("autodoc-process-docstring", _fill_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
