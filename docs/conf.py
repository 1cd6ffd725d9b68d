"""Sphinx configuration of trio_pd's documentation.

Build with ``nox -s docs`` (HTML in ``docs/_build/html``; warnings are errors).
Pages are Markdown (MyST); the API reference is autodoc with trio-aware
signatures (sphinxcontrib-trio); diagrams are Graphviz, rendered at build
time. There is no network at build time: the intersphinx inventories for trio
and Python are written by ``make_trio_inventory.py`` into the doctree folder.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import attrs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "_ext"))

from make_trio_inventory import write_inventories  # noqa: E402
from sphinxcontrib_trio import sniff_options  # noqa: E402

import trio_pd  # noqa: E402

project = "trio_pd"
author = "the trio_pd authors"
copyright = "the trio_pd authors"
release = version = trio_pd.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.graphviz",
    "sphinxcontrib_trio",
    "myst_parser",
    "pd_diagrams",
    "pd_facts",
    "pd_shutdown",
    "pd_budget",
    "pd_facts_wire",
    "pd_packages",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "examples", "diagrams", "README.md"]
nitpicky = True
# Third-party types that appear in signatures and have no inventory here (no
# network at build time): torch and numpy.
nitpick_ignore = [
    ("py:class", "torch.Tensor"),
    ("py:class", "trio_pd._transfer._nixl._backend._T"),
    # the backend seam's internal exceptions (see TransferBackend's docstring)
    ("py:exc", "TransferTimeout"),
    ("py:exc", "BackendClosing"),
    ("py:exc", "RemoteRetired"),
    # the side channel's testing seam: private types (open_connector's
    # side_channel= and MemoryFabric.side_channel document them in words)
    ("py:class", "SideChannelFactory"),
    ("py:class", "trio_pd.testing._memory_side_channel.MemorySideChannel"),
    # CurveAuth.peers: the keys membership publishes, kept by trio-pd engine (internal)
    ("py:class", "trio_pd._curve_keys.PeerKeys"),
]
# no offline inventory of the standard library: its types stay unlinked
nitpick_ignore_regex = [
    ("py:class", r"numpy\.\w+"),
    ("py:class", r"(collections\.abc|contextlib)\.\w+"),
]

# -- autodoc / napoleon / sphinxcontrib-trio --------------------------------

# sphinxcontrib-trio plugs its documenters (``await``, ``async with``) into
# autodoc's class-based implementation.
autodoc_use_legacy_class_based = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
python_use_unqualified_type_names = True  # "Sequence", linked to collections.abc
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not as duplicate object entries
napoleon_use_rtype = False
napoleon_attr_annotations = False

# -- MyST --------------------------------------------------------------------

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- diagrams ----------------------------------------------------------------

graphviz_output_format = "svg"

# -- intersphinx (offline) ---------------------------------------------------

intersphinx_mapping: dict[str, tuple[str, str]] = {}

# -- HTML ----------------------------------------------------------------------

html_theme = "sphinx_rtd_theme"
html_title = "trio_pd"
html_static_path = ["_static"]
html_css_files = ["trio_pd.css"]
html_theme_options = {"navigation_depth": 3, "collapse_navigation": False}


def _offline_inventories(app: Any, config: Any) -> None:
    """Write the trio and Python inventories, and point intersphinx at them."""
    config.intersphinx_mapping = write_inventories(Path(app.doctreedir) / "inventories")


def _tidy_signature(
    app: Any,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str | None, str | None]:
    """Show signatures as a reader uses them.

    * An async context manager is used as ``async with f(...) as x``: its
      ``AsyncIterator[...]`` return annotation is the generator's type, not
      what ``x`` is, so it is dropped (the docstring says what ``x`` is).
    * attrs fields with a ``factory`` default show ``NOTHING`` (attrs'
      sentinel) in the generated signature; show what the factory makes.
    * A private attrs field (``ConnectorConfig._tuning``) is not shown.
    """
    if "async-with" in sniff_options(obj):
        return_annotation = None
    if signature is not None and isinstance(obj, type) and attrs.has(obj):
        for field in attrs.fields(obj):
            if field.alias.startswith("_"):
                signature = re.sub(rf",\s*{field.alias}: [^,()]*(?=[,)])", "", signature)
                continue
            if isinstance(field.default, attrs.Factory) and not field.default.takes_self:
                made = field.default.factory()
                signature = signature.replace("= NOTHING", f"= {made!r}", 1)
    return signature, return_annotation


def setup(app: Any) -> None:
    # Before intersphinx validates the mapping (priority 800).
    app.connect("config-inited", _offline_inventories, priority=100)
    app.connect("autodoc-process-signature", _tidy_signature)
