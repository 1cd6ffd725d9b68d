"""Helpers for pictures drawn from trio_pd's code (``pd_shutdown``, ``pd_budget``).

``require`` fails the build when a function no longer says what a picture
shows; :class:`CodeDiagram` is a Graphviz directive fed by a function.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from typing import ClassVar

from docutils import nodes
from docutils.statemachine import StringList
from pd_diagrams import DocsDrift, _quote
from sphinx.ext.graphviz import Graphviz

WRAP = 46


def source_of(function: object) -> str:
    return textwrap.dedent(inspect.getsource(inspect.unwrap(function)))  # type: ignore[arg-type]


def require(picture: str, function: object, *fragments: str) -> None:
    """Fail the build unless ``function``'s source has each fragment, in this order."""
    source = source_of(function)
    name = getattr(function, "__qualname__", function)
    at = 0
    for fragment in fragments:
        found = source.find(fragment, at)
        if found < 0:
            where = "no longer has" if fragment not in source else "no longer has, in order,"
            raise DocsDrift(f"{picture}: {name} {where} {fragment!r}")
        at = found + len(fragment)


def plain(doc: str) -> str:
    """The first sentence of a docstring, reST roles and literals removed."""
    text = " ".join(doc.split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def left_label(text: str) -> str:
    """A quoted Graphviz label whose lines are left-justified (for a cluster's title)."""
    return _quote(text).replace("\n", "\\l")[:-1] + '\\l"'


def wrapped(text: str) -> str:
    return "\n".join(textwrap.fill(part, WRAP) for part in text.split("\n"))


class CodeDiagram(Graphviz):
    """A Graphviz directive whose source is ``dot()``, rebuilt when ``modules`` change."""

    has_content = False
    required_arguments = 0
    optional_arguments = 0
    modules: ClassVar[tuple[types.ModuleType, ...]] = ()
    alt: ClassVar[str] = ""

    def dot(self) -> str:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        for module in self.modules:  # rebuild the page when the code changes
            self.env.note_dependency(inspect.getsourcefile(module) or "")
        self.arguments = list[str]()
        self.content = StringList(self.dot().splitlines(), source=type(self).__name__)
        self.options.setdefault("alt", self.alt)
        self.options.setdefault("align", "center")
        return super().run()
