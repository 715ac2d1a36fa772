"""Sphinx configuration of mpitf's documentation site (``bash run.sh docs``)."""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(DOCS))  # this checkout's mpitf, not an installed one
sys.path.insert(0, os.path.join(DOCS, "_ext"))

import mpitf  # noqa: E402

project = "mpitf"
release = version = mpitf.__version__
copyright = "the mpitf developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "mpitf_docs",
]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
# Flags in prose and help strings keep their "--" and straight quotes.
smartquotes = False

# The reference documents what the code says; a name the docstrings mention that is not
# documented here is a warning, and warnings fail the build (run.sh docs: -W -n).
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True}
# A private name (a leading underscore) is not part of the reference.
nitpick_ignore_regex = [(r"py:.*", r"(.*\.)?_\w+")]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"mpitf {version}"
