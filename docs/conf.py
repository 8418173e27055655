"""Sphinx configuration of the documentation site (built by ``./dev docs``)."""

import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "Pallas + jax-triton, maintained"
author = "the project's authors"
copyright = "the project's authors, Apache-2.0"

extensions = [
    "myst_nb",  # MyST Markdown and executed notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "apigen",  # docs/_ext/apigen.py: the API pages, and the check that every public name is documented
    "external_links",  # docs/_ext/external_links.py: every link to the outside, listed on links.md
    "repo_pages",  # docs/_ext/repo_pages.py: ARCHITECTURE.md and CONTRIBUTING.md as pages, their links made the site's
]

exclude_patterns = ["_build", "README.md", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}

# Warnings are errors (-W): references that do not resolve are warnings too.
nitpicky = True
nitpick_ignore_regex = [
    # Types from other projects (no intersphinx: CI has no network) and typing internals.
    (r"py:.*", r"(jax|jaxlib|numpy|np|triton|typing|collections|enum|dataclasses|types|jnp|lax)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|Hashable|Literal|Union|Optional)(\[.*)?"),
    (r"py:.*", r"(int|float|str|bool|bytes|tuple|list|dict|set|object|None|type|complex|slice)"),
    (r"py:.*", r".*\._src\..*"),  # private implementation modules named in signatures
    (r"py:class", r".*"),  # annotation strings autodoc cannot resolve without intersphinx
]

autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# MyST and MyST-NB: every notebook is executed at each build; a failing cell fails the build.
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 180
nb_execution_show_tb = True
nb_merge_streams = True

# The notebooks' kernels start with an IPython profile of this build's own (not the user's
# ~/.ipython, whose startup files would run in every guide) in which the kernel logs errors
# only: ipykernel 7 warns at each kernel's start that it talks to the build over TCP without
# encryption (on localhost, for this build alone), a line per guide, six per build.
_ipython_dir = tempfile.mkdtemp(prefix="pallas-docs-ipython-")
os.makedirs(os.path.join(_ipython_dir, "profile_default"))
with open(os.path.join(_ipython_dir, "profile_default", "ipython_kernel_config.py"), "w") as _f:
    _f.write('c.IPKernelApp.log_level = "ERROR"\nc.HistoryManager.enabled = False\n')
del _f
os.environ["IPYTHONDIR"] = _ipython_dir
atexit.register(shutil.rmtree, _ipython_dir, True)

html_theme = "sphinx_book_theme"
html_title = "Pallas + jax-triton"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "home_page_in_toc": True,
    # The sidebar shows the current page's branch, not all 250 pages on every page: the
    # build wrote its pages in 96 s instead of 247 s (2 cores, execution off).
    "collapse_navbar": True,
}
html_static_path = ["_static"]
# Search summaries from each page's article text, not the theme's header buttons (the file says why).
html_js_files = ["search_summary.js"]
# Wide tables wrap their cells to the article's width, long names in the sidebar wrap (the file says why).
html_css_files = ["tables.css"]
templates_path = ["_templates"]
suppress_warnings = ["mystnb.unknown_mime_type"]
