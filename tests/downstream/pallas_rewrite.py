"""Running other people's Pallas code on our packages, unchanged: the import rewrite.

An installed package's modules are loaded from their own files with only their
Pallas imports rewritten (the approach of ``tests/tpu/test_jax_tpu_ops.py``, here for
every import spelling and for a whole installed package, its tests included):

    from jax.experimental import pallas as pl             -> import pallas as pl
    import jax.experimental.pallas as pl                  -> import pallas as pl
    from jax.experimental.pallas import tpu as pltpu      -> import pallas_tpu as pltpu
    import jax.experimental.pallas.tpu as pltpu           -> import pallas_tpu as pltpu
    from jax.experimental.pallas import triton as plgpu   -> import pallas_gpu as plgpu
    import jax.experimental.pallas.triton as plgpu        -> import pallas_gpu as plgpu

Imports of JAX Pallas modules that have no counterpart in our packages stay as they
are (``KEPT``): Mosaic GPU (out of our scope), SparseCore (``tpu_sc``), ``fuser``, and
splash attention's mask modules (numpy and jnp, no kernel); a module that imports Mosaic
GPU keeps all its Pallas imports (a Mosaic GPU kernel is JAX's, whole). A kernel that uses one of
them still runs on JAX's module for that part, and its test shows whether that mixes
with ours. Anything else that still names JAX's Pallas in code after the rewrite
(``jax._src.pallas``, ``jax.experimental.pallas.X`` used inline) makes the module refuse
to load (:class:`CannotRunUnchanged`), so nothing runs half on JAX's Pallas unnoticed.
One private module is rewritten where its use is narrow (``PRIVATE``):
``from jax._src.pallas import primitives as pp`` becomes ``import pallas_gpu as pp`` in a
module that also imports ``jax.experimental.pallas.triton`` and uses nothing of it but
``pp.load`` and ``pp.store`` (the masked loads and stores of a Pallas Triton kernel,
which JAX's public API has as ``triton.load``/``store``; ejkernel's GPU decode attention).
Annotations are not checked: they may name JAX's types (ejkernel annotates a helper's
argument ``jax._src.pallas.mosaic.primitives.AsyncCopyDescriptor``); nothing runs on
them, and a type checker that reads them fails loudly on our objects.

Nothing is copied: the sources are read from the installed package at import time.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys

# `from PARENT import NAME as alias` or `import PARENT.NAME as alias`, a comment allowed after.
_AS = r"^(?P<indent>[ \t]*)(?:from {parent} import {name}|import {parent}\.{name}) as (?P<alias>\w+)(?P<rest>[ \t]*(?:#.*)?)$"

# (JAX's parent module, its name there, our module)
_OURS = (
    ("jax.experimental", "pallas", "pallas"),
    ("jax.experimental.pallas", "tpu", "pallas_tpu"),
    ("jax.experimental.pallas", "triton", "pallas_gpu"),
)
REWRITES = tuple(
    (
        re.compile(_AS.format(parent=re.escape(parent), name=name), re.M),
        rf"\g<indent>import {ours} as \g<alias>\g<rest>",
    )
    for parent, name, ours in _OURS
)

# JAX Pallas modules without a counterpart in our packages: their imports stay.
KEPT = {
    "jax.experimental.pallas.mosaic_gpu": "Mosaic GPU: out of our scope (pallas-gpu lowers to Triton)",
    "jax.experimental.pallas.tpu_sc": "SparseCore (jax.experimental.pallas.tpu_sc): pallas-tpu has no SparseCore",
    "jax.experimental.pallas.fuser": "jax.experimental.pallas.fuser: no counterpart (kernel fusion helpers)",
    "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask": (
        "splash attention's mask classes (numpy, no Pallas)"
    ),
    "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info": (
        "splash attention's mask preprocessing (numpy and jnp, no Pallas)"
    ),
}
FORBIDDEN = re.compile(r"jax\.experimental\.pallas|jax\._src\.pallas")

# JAX Pallas private modules rewritten where a module uses only these names of them:
# (parent, name) -> (our module, the names, the module must also import, why).
PRIVATE = {
    ("jax._src.pallas", "primitives"): (
        "pallas_gpu",
        frozenset({"load", "store"}),
        "jax.experimental.pallas.triton",
        "masked load/store in a Pallas Triton kernel (JAX's public names: pallas.triton.load/store)",
    ),
}


class CannotRunUnchanged(ImportError):
    """The module uses JAX's Pallas beyond the imports we rewrite."""


def _kept(module: str) -> str | None:
    """The ``KEPT`` module that ``module`` is or lies in."""
    return next((k for k in KEPT if module == k or module.startswith(k + ".")), None)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules (or module attributes) an absolute import names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or not node.module:
        return []
    return [f"{node.module}.{a.name}" for a in node.names]


def _annotations(tree: ast.Module) -> set[int]:
    """ids of the annotation nodes of ``tree``."""
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.arg) and n.annotation is not None:
            found.add(id(n.annotation))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            found.add(id(n.returns))
        elif isinstance(n, ast.AnnAssign):
            found.add(id(n.annotation))
    return found


def _uses(src: str, origin: str) -> list[str]:
    """Where ``src``'s code (not its strings, comments or annotations)
    names JAX's Pallas outside a ``KEPT`` import: ``line N: code``."""
    tree = ast.parse(src, origin)
    skip = _annotations(tree)
    left = []

    def visit(node):
        if id(node) in skip:
            return
        bad = None
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bad = [m for m in _imported(node) if FORBIDDEN.search(m) and not _kept(m)]
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name is not None:
                bad = [name] if FORBIDDEN.search(name) and not _kept(name) else []
        if bad:
            left.append(f"line {node.lineno}: {ast.get_source_segment(src, node) or bad[0]}")
        if bad is None or isinstance(node, (ast.Import, ast.ImportFrom)):
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(tree)
    return left


def port_source(src: str, origin: str) -> str:
    """``src`` with its Pallas imports rewritten to ours; raises :class:`CannotRunUnchanged`
    if JAX's Pallas is still named in its code anywhere but in a ``KEPT`` import.
    A Mosaic GPU kernel module (one importing ``mosaic_gpu``) stays wholly on JAX's
    Pallas: its ``pl.Element``, ``pl.BlockSpec``, ... go to JAX's Mosaic GPU, which
    checks for JAX's classes (ours there gave "Unsupported block size type")."""
    if "mosaic_gpu" in kept_imports(src):
        return src
    src = _rewrite_private(src, origin)
    for pattern, replacement in REWRITES:
        src = pattern.sub(replacement, src)
    left = _uses(src, origin)
    if left:
        raise CannotRunUnchanged(f"{origin} still uses JAX's Pallas after the import rewrite: {left}")
    return src


def _rewrite_private(src: str, origin: str) -> str:
    """``PRIVATE`` imports rewritten to ours where the module uses only the listed
    names of them (``alias.load``, ``alias.store``) and imports the public module
    that says what kind of kernel it is; otherwise left for the check to refuse."""
    tree = ast.parse(src, origin)
    imported = {
        m for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for m in _imported(n)
    }
    for (parent, name), (ours, names, needs, _) in PRIVATE.items():
        pattern = re.compile(_AS.format(parent=re.escape(parent), name=name), re.M)
        for m in list(pattern.finditer(src)):
            alias = m.group("alias")
            names_of_alias = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == alias]
            attrs = [
                n.attr
                for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == alias
            ]
            # Every use is ``alias.<listed name>`` (never the module itself passed around).
            if set(attrs) <= names and len(attrs) == len(names_of_alias) and needs in imported:
                src = src.replace(
                    m.group(0), f"{m.group('indent')}import {ours} as {alias}{m.group('rest')}", 1
                )
    return src


def kept_imports(src: str) -> set[str]:
    """The ``KEPT`` JAX Pallas modules that ``src`` imports (last name: ``mosaic_gpu``)."""
    found = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(k.rpartition(".")[2] for m in _imported(node) if (k := _kept(m)))
    return found


class _Refused:
    """Stands for a name of a module that refused to load: calling it raises why."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def __call__(self, *args, **kwargs):
        raise CannotRunUnchanged(f"{self.name}: {self.why}")

    def __repr__(self):
        return f"<refused {self.name}>"


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles the file's source after :func:`port_source` (never from a cached .pyc,
    which holds the unrewritten code). With a ``refused`` dict, a module that cannot
    run unchanged loads as a stub whose every name raises :class:`CannotRunUnchanged`
    when called, and is recorded there (``{module: why}``), so that the rest of its
    package still loads."""

    def __init__(self, fullname, path, refused: dict[str, str] | None = None):
        super().__init__(fullname, path)
        self.refused = refused

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        src = importlib.util.decode_source(self.get_data(path))
        return compile(port_source(src, path), path, "exec", dont_inherit=True)

    def exec_module(self, module):
        try:
            code = self.get_code(module.__name__)
        except CannotRunUnchanged as e:
            if self.refused is None:
                raise
            name, why = module.__name__, str(e)
            self.refused[name] = why

            def __getattr__(attr):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _Refused(f"{name}.{attr}", why)

            module.__getattr__ = __getattr__
            return
        exec(code, module.__dict__)


class RewritingFinder(importlib.abc.MetaPathFinder):
    """Loads every module of the ``packages`` (top-level names) with :func:`port_source`."""

    def __init__(self, *packages: str, refused: dict[str, str] | None = None):
        self.packages = frozenset(packages)
        self.refused = refused

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in self.packages:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or type(spec.loader) is not importlib.machinery.SourceFileLoader:
            return spec
        spec.loader = _RewritingLoader(name, spec.origin, self.refused)
        return spec


def install(*packages: str, refused: dict[str, str] | None = None) -> RewritingFinder:
    """Rewrites the ``packages``' Pallas imports from now on (first on ``sys.meta_path``);
    refuses if one of them is already imported (it would stay on JAX's Pallas). With
    ``refused`` (a dict), a module that cannot run unchanged loads as a stub and is
    recorded there instead of failing its package's import."""
    loaded = [n for n in sys.modules if n.partition(".")[0] in packages]
    if loaded:
        raise RuntimeError(f"already imported before the rewrite was installed: {sorted(loaded)[:5]}")
    finder = RewritingFinder(*packages, refused=refused)
    sys.meta_path.insert(0, finder)
    return finder
