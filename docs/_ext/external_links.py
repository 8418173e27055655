"""The site's links to the outside, listed on one page (CI has no network to check them).

Links inside the site are checked by Sphinx and MyST themselves: with ``-W`` a link to a
missing page, heading anchor or label fails the build. Links to the outside cannot be
checked without a network, so this extension collects every one (``http``, ``https``,
``mailto``) from every page and the ``external-links`` directive renders them, each
with the pages that use it; ``./dev docs --linkcheck`` checks them where there is a
network (Sphinx's ``linkcheck`` builder).
"""

from __future__ import annotations

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

_SCHEMES = ("http://", "https://", "mailto:")


class external_links_node(nodes.General, nodes.Element):
    """Placeholder replaced by the list once every page has been read."""


class ExternalLinks(SphinxDirective):
    def run(self):
        return [external_links_node()]


def _collect(app, doctree) -> None:
    env = app.env
    links = getattr(env, "external_links", {})
    urls = {n["refuri"] for n in doctree.findall(nodes.reference) if n.get("refuri", "").startswith(_SCHEMES)}
    if urls:
        links[env.docname] = urls
    else:
        links.pop(env.docname, None)
    env.external_links = links


def _purge(app, env, docname) -> None:
    getattr(env, "external_links", {}).pop(docname, None)


def _merge(app, env, docnames, other) -> None:
    links = getattr(env, "external_links", {})
    for docname in docnames:
        if docname in getattr(other, "external_links", {}):
            links[docname] = other.external_links[docname]
    env.external_links = links


def _render(app, doctree, fromdocname) -> None:
    by_url: dict[str, set[str]] = {}
    for docname, urls in getattr(app.env, "external_links", {}).items():
        for url in urls:
            by_url.setdefault(url, set()).add(docname)
    for node in list(doctree.findall(external_links_node)):
        if not by_url:
            node.replace_self(nodes.paragraph(text="No page links outside the site."))
            continue
        items = nodes.bullet_list()
        for url in sorted(by_url):
            para = nodes.paragraph()
            para += nodes.reference(url, url, refuri=url)
            para += nodes.Text(" — ")
            for i, docname in enumerate(sorted(by_url[url])):
                if i:
                    para += nodes.Text(", ")
                ref = nodes.reference(
                    "", app.env.titles[docname].astext() if docname in app.env.titles else docname
                )
                ref["refuri"] = app.builder.get_relative_uri(fromdocname, docname)
                para += ref
            items += nodes.list_item("", para)
        node.replace_self(items)


def setup(app):
    app.add_node(external_links_node)
    app.add_directive("external-links", ExternalLinks)
    app.connect("doctree-read", _collect)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("doctree-resolved", _render)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
