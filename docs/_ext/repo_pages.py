"""Pages of the site that are files of the repository outside ``docs/``: ``design.md`` and
``contributing.md`` include the root's ``ARCHITECTURE.md`` and ``CONTRIBUTING.md`` (one text, read
on GitHub and on the site).

Their links are written for the repository (``[RUNTIME.md](RUNTIME.md)``,
``[docs/tpu_ops.md](docs/tpu_ops.md)``). When the site includes them (Sphinx's
``include-read`` event), a link to a file that is also a page of the site is pointed at that
page, and a link to any other file of the repository becomes its text: the site has no copy
of that file to link to, and a link it cannot resolve would fail the build.
"""

from __future__ import annotations

import os
import re

# Root files the site includes, by their path relative to docs/ as the include names them.
INCLUDED = ("../ARCHITECTURE.md", "../CONTRIBUTING.md")

# Repository files (relative to the root) that are pages of the site, and the page (relative to docs/).
PAGES = {
    "ARCHITECTURE.md": "design.md",
    "CONTRIBUTING.md": "contributing.md",
    "benchmarks/README.md": "benchmarks.md",
    "RUNTIME_CHANGELOG.md": "changelogs/runtime.md",
    **{
        f"packages/{p}/CHANGELOG.md": f"changelogs/{p}.md"
        for p in ("pallas-core", "pallas-gpu", "pallas-tpu", "jax-triton")
    },
}

_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def _page(target: str, srcdir: str) -> str | None:
    """The site's page for the repository path ``target``, or None."""
    if target in PAGES:
        return PAGES[target]
    if target.startswith("docs/") and target != "docs/README.md":
        page = target.removeprefix("docs/")
        if os.path.exists(os.path.join(srcdir, page)):
            return page
    return None


def rewrite_links(text: str, srcdir: str) -> str:
    """``text`` with its repository links pointed at the site's pages, or made plain text."""

    def repl(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if "://" in target or target.startswith(("#", "mailto:")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        page = _page(path, srcdir)
        if page is None:
            return label
        return f"[{label}]({page}{'#' + anchor if anchor else ''})"

    return _LINK.sub(repl, text)


def _include_read(app, relative_path, parent_docname, content) -> None:
    if str(relative_path) in INCLUDED:
        content[0] = rewrite_links(content[0], app.srcdir)


def setup(app):
    app.connect("include-read", _include_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
