"""Sphinx extension: pictures and tables drawn from trio_pd's own code.

The engine state diagram is generated from :data:`trio_pd._engines.TRANSITIONS`
every time the docs are built (the idea of h11's ``make-state-diagrams.py``):
the picture cannot drift from the table the connector actually runs.

Directives:

``.. engine-state-diagram::``
    The state machine as a Graphviz graph, rendered by ``sphinx.ext.graphviz``.
``.. engine-transition-table::``
    The same table as text: state, event, next state.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.ext.graphviz import Graphviz
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective

import trio_pd._engines as engines
from trio_pd._engines import TRANSITIONS, EngineEvent, EngineState

SOURCE = "trio_pd._engines.TRANSITIONS"
ANY = "any other state"

_FILL = {
    EngineState.UNKNOWN: "#ffffff",
    EngineState.FETCHING: "#dbe9f8",
    EngineState.LOADING: "#dbe9f8",
    EngineState.READY: "#cdebc5",
    EngineState.BACKOFF: "#fbe3b8",
    EngineState.STALE: "#e4e4e4",
    EngineState.CLOSED: "#c9c9c9",
}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tooltip(state: EngineState) -> str:
    """The state's attribute docstring in ``_engines.py``, on one line."""
    docs = ModuleAnalyzer.for_module(EngineState.__module__).find_attr_docs()
    lines = docs.get(("EngineState", state.name), [state.name])
    return " ".join(" ".join(lines).split())


def shared_events(
    transitions: Mapping[tuple[EngineState, EngineEvent], EngineState],
) -> dict[EngineEvent, EngineState]:
    """Events that lead from *every* other state to one state (drawn once)."""
    sources: dict[tuple[EngineEvent, EngineState], set[EngineState]] = defaultdict(set)
    for (state, event), target in transitions.items():
        sources[event, target].add(state)
    everyone = set(EngineState)
    return {
        event: target
        for (event, target), states in sources.items()
        if states == everyone - {target} and len(states) > 1
    }


def engine_state_dot(
    transitions: Mapping[tuple[EngineState, EngineEvent], EngineState] = TRANSITIONS,
) -> str:
    """Graphviz source of the state machine in ``transitions``: one edge per entry.

    An event allowed in every state but one, all leading to that one state
    (``connector closed``), is drawn as a single edge from an "any other state" node.
    """
    shared = shared_events(transitions)
    lines = [
        "digraph engine_states {",
        '  graph [rankdir=TB, nodesep=0.5, ranksep=0.55, fontname="Helvetica", '
        'bgcolor="transparent"];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=12, '
        'penwidth=1.2, margin="0.18,0.08"];',
        '  edge [fontname="Helvetica", fontsize=11, color="#444444", arrowsize=0.8];',
    ]
    for state in EngineState:
        lines.append(
            f"  {state.name} [label={_quote(state.name)}, fillcolor={_quote(_FILL[state])}, "
            f"tooltip={_quote(_tooltip(state))}];"
        )
    for (state, event), target in transitions.items():
        if event in shared:
            continue
        lines.append(f"  {state.name} -> {target.name} [label={_quote(event.value)}];")
    for event, target in shared.items():
        anchor = f"ANY_{event.name}"
        lines.append(
            f"  {anchor} [label={_quote(ANY)}, shape=box, "
            'style="dashed,rounded", fillcolor="#ffffff", fontsize=11];'
        )
        lines.append(f'  {anchor} -> {target.name} [label={_quote(event.value)}, style="dashed"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


class EngineStateDiagram(Graphviz):
    """``sphinx.ext.graphviz``'s directive, fed with the generated source."""

    has_content = False
    required_arguments = 0
    optional_arguments = 0

    def run(self) -> list[nodes.Node]:
        # Rebuild this page whenever the table's module changes.
        self.env.note_dependency(inspect.getsourcefile(engines) or "")
        self.arguments = []
        self.content = StringList(engine_state_dot().splitlines(), source=SOURCE)
        self.options.setdefault("alt", "state diagram of a remote engine, from " + SOURCE)
        self.options.setdefault("align", "center")
        return super().run()


class EngineTransitionTable(SphinxDirective):
    """Every entry of the transition table as a docutils table."""

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {}

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(inspect.getsourcefile(engines) or "")
        shared = shared_events(TRANSITIONS)
        rows = [
            (state.name, event.value, target.name)
            for (state, event), target in TRANSITIONS.items()
            if event not in shared
        ]
        rows += [(ANY, event.value, target.name) for event, target in shared.items()]
        table = nodes.table(classes=["engine-transitions"])
        group = nodes.tgroup(cols=3)
        table += group
        for _ in range(3):
            group += nodes.colspec(colwidth=1)
        head = nodes.thead()
        group += head
        head += self._row(("state", "event", "next state"), header=True)
        body = nodes.tbody()
        group += body
        for row in rows:
            body += self._row(row)
        return [table]

    @staticmethod
    def _row(cells: tuple[str, str, str], *, header: bool = False) -> nodes.row:
        row = nodes.row()
        for text in cells:
            entry = nodes.entry()
            plain = header or text == ANY
            inner = nodes.Text(text) if plain else nodes.literal(text, text)
            entry += nodes.paragraph("", "", inner)
            row += entry
        return row


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.graphviz")
    app.add_directive("engine-state-diagram", EngineStateDiagram)
    app.add_directive("engine-transition-table", EngineTransitionTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
