"""Sphinx configuration of the ferrompi documentation.

Build (warnings are errors; no network access needed)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Pages are Markdown (MyST). The API reference (``api.md``) uses autodoc with
numpydoc; at build time every name in ``ferrompi.__all__`` must be documented
there, and every name documented there must be public (see
``_check_api_page`` below), so a new public name fails the ``-W`` build until
it has an entry.

Adding a page: write ``docs/<page>.md`` and list it in a toctree of
``index.md``. Code examples are ``pycon`` blocks (doctests run on the
simulated backend) or ``python`` scripts; ``tests/test_docs.py`` runs both.

Intersphinx is off by default (it fetches inventories). To link to Python,
numpy and mpi4py, put their ``objects.inv`` files in ``docs/_inventories/``
as ``python.inv``, ``numpy.inv``, ``mpi4py.inv`` (used offline), or set
``FERROMPI_DOCS_INTERSPHINX=1`` to fetch them.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

import ferrompi  # noqa: E402

project = "ferrompi"
author = "ferrompi contributors"
copyright = "ferrompi contributors"
release = ferrompi.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "numpydoc",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_inventories", "Thumbs.db", ".DS_Store"]

# -- MyST ---------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- autodoc / numpydoc ---------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpydoc sections give the types
autodoc_preserve_defaults = True
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
autosummary_generate = False  # numpydoc loads autosummary; no stub pages are generated

# -- intersphinx: offline unless asked ------------------------------------------
_INVENTORIES = {
    "python": "https://docs.python.org/3",
    "numpy": "https://numpy.org/doc/stable",
    "mpi4py": "https://mpi4py.readthedocs.io/en/stable",
}
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
for _name, _url in _INVENTORIES.items():
    _local = DOCS / "_inventories" / f"{_name}.inv"
    if _local.is_file():
        intersphinx_mapping[_name] = (_url, str(_local))
    elif os.environ.get("FERROMPI_DOCS_INTERSPHINX") == "1":
        intersphinx_mapping[_name] = (_url, None)
if intersphinx_mapping:
    extensions.append("sphinx.ext.intersphinx")

# -- HTML -----------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"ferrompi {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "torch.distributed-style collectives over MPI",
    "fixed_sidebar": True,
}


# -- the API page documents exactly ferrompi.__all__ -----------------------------
_API_ENTRY = re.compile(
    r"^\.\. (?:auto(?:function|class|exception|data)|py:data)::\s+ferrompi\.(\w+)\s*$", re.M
)


def api_page_names() -> list[str]:
    """Names documented in ``api.md`` by autodoc directives (``ferrompi.NAME``)."""
    return _API_ENTRY.findall((DOCS / "api.md").read_text(encoding="utf-8"))


def _check_api_page(app) -> None:
    from sphinx.util import logging

    logger = logging.getLogger("ferrompi.docs")
    documented = api_page_names()
    public = list(ferrompi.__all__)
    for name in public:
        if name not in documented:
            logger.warning("api.md does not document ferrompi.%s (it is in __all__)", name)
    for name in documented:
        if name not in public:
            logger.warning("api.md documents ferrompi.%s, which is not in __all__", name)
    for name in {n for n in documented if documented.count(n) > 1}:
        logger.warning("api.md documents ferrompi.%s more than once", name)


# -- signatures: hide what users do not pass ------------------------------------
# Classes that users receive but never construct: no constructor signature.
_NO_SIGNATURE = {"ferrompi.PendingCollective", "ferrompi.ReduceOp"}
_PRIVATE_PARAM = re.compile(r",\s*_\w+=[^,)]*")


def _public_signature(app, what, name, obj, options, signature, return_annotation):
    if name in _NO_SIGNATURE:
        return "", None
    if signature:
        signature = _PRIVATE_PARAM.sub("", signature)
    return signature, return_annotation


def setup(app):
    app.connect("builder-inited", _check_api_page)
    app.connect("autodoc-process-signature", _public_signature)
    return {"parallel_read_safe": True}
