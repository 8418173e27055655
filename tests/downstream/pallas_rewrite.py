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
are (``KEPT``): Mosaic GPU (out of our scope), SparseCore (``tpu_sc``) and ``fuser``.
A kernel that uses one of them still runs on JAX's module for that part, and its test
shows whether that mixes with ours. Anything else that still names JAX's Pallas after
the rewrite (``jax._src.pallas``, ``jax.experimental.pallas.X`` used inline) makes the
module refuse to load (:class:`CannotRunUnchanged`), so nothing runs half on JAX's
Pallas unnoticed.

Nothing is copied: the sources are read from the installed package at import time.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import io
import re
import sys
import tokenize

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
    "mosaic_gpu": "Mosaic GPU: out of our scope (pallas-gpu lowers to Triton)",
    "tpu_sc": "SparseCore (jax.experimental.pallas.tpu_sc): pallas-tpu has no SparseCore",
    "fuser": "jax.experimental.pallas.fuser: no counterpart (kernel fusion helpers)",
}
_KEPT_LINE = re.compile(
    r"^\s*(?:from jax\.experimental\.pallas import ({0})\b|import jax\.experimental\.pallas\.({0})\b)".format(
        "|".join(KEPT)
    )
)
FORBIDDEN = re.compile(r"jax\.experimental\.pallas|jax\._src\.pallas|jax\.experimental import pallas")


class CannotRunUnchanged(ImportError):
    """The module uses JAX's Pallas beyond the imports we rewrite."""


def _code_lines(src: str) -> dict[int, str]:
    """Each line's code without its strings and comments, tokens joined by spaces
    (``a . b`` joined back to ``a.b``)."""
    skip = {tokenize.COMMENT, tokenize.STRING, tokenize.FSTRING_MIDDLE, tokenize.NL, tokenize.NEWLINE}
    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip and tok.string.strip():
            lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: " ".join(t).replace(" . ", ".") for n, t in lines.items()}


def port_source(src: str, origin: str) -> str:
    """``src`` with its Pallas imports rewritten to ours; raises :class:`CannotRunUnchanged`
    if JAX's Pallas is still named in its code (not its strings or comments) anywhere
    but in a ``KEPT`` import."""
    for pattern, replacement in REWRITES:
        src = pattern.sub(replacement, src)
    left = [
        code for code in _code_lines(src).values() if FORBIDDEN.search(code) and not _KEPT_LINE.match(code)
    ]
    if left:
        raise CannotRunUnchanged(f"{origin} still uses JAX's Pallas after the import rewrite: {left}")
    return src


def kept_imports(src: str) -> set[str]:
    """The ``KEPT`` JAX Pallas modules that ``src`` imports."""
    found = set()
    for code in _code_lines(src).values():
        m = _KEPT_LINE.match(code)
        if m:
            found.add(m.group(1) or m.group(2))
    return found


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles the file's source after :func:`port_source` (never from a cached .pyc,
    which holds the unrewritten code)."""

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        src = importlib.util.decode_source(self.get_data(path))
        return compile(port_source(src, path), path, "exec", dont_inherit=True)


class RewritingFinder(importlib.abc.MetaPathFinder):
    """Loads every module of the ``packages`` (top-level names) with :func:`port_source`."""

    def __init__(self, *packages: str):
        self.packages = frozenset(packages)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in self.packages:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or type(spec.loader) is not importlib.machinery.SourceFileLoader:
            return spec
        spec.loader = _RewritingLoader(name, spec.origin)
        return spec


def install(*packages: str) -> RewritingFinder:
    """Rewrites the ``packages``' Pallas imports from now on (first on ``sys.meta_path``);
    refuses if one of them is already imported (it would stay on JAX's Pallas)."""
    loaded = [n for n in sys.modules if n.partition(".")[0] in packages]
    if loaded:
        raise RuntimeError(f"already imported before the rewrite was installed: {sorted(loaded)[:5]}")
    finder = RewritingFinder(*packages)
    sys.meta_path.insert(0, finder)
    return finder
