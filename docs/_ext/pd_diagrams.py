"""Sphinx extension: pictures and tables drawn from trio_pd's own code.

The engine state diagram is generated from :data:`trio_pd._core._remote_engine.TRANSITIONS`
every time the docs are built (the idea of h11's ``make-state-diagrams.py``):
the picture cannot drift from the table the connector actually runs.

Directives:

``.. engine-state-diagram::``
    The state machine as a Graphviz graph, rendered by ``sphinx.ext.graphviz``.
``.. engine-transition-table::``
    The same table as text: state, event, next state.
``.. tp-mapping-diagram::`` with ``:prefill-tp:``, ``:decode-tp:``, ``:heads:``
    Which KV heads of which prefill rank land where in which decode rank,
    drawn from :func:`trio_pd._core._tensor_parallel.plan_pull` (the function pulls run).
``.. failure-path-diagram::``
    A handshake that fails, played on a real :class:`trio_pd._core._remote_engine.EngineRecord`
    with a fake clock: every state, action and error in the picture is what
    the record returned (see :func:`failure_path`).
``.. fetch-load-diagram::``
    Parallel metadata fetches feeding the one handshake task that loads
    agents in order, and what a stuck load does (see :func:`fetch_load_dot`).
"""

from __future__ import annotations

import inspect
import random
import textwrap
import types
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.ext.graphviz import Graphviz
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective

import trio_pd._consumer._handshakes as handshakes
import trio_pd._core._remote_engine as engines
import trio_pd._core._tensor_parallel as tp
from trio_pd._config import ConnectorConfig
from trio_pd._core._remote_engine import (
    TRANSITIONS,
    Backoff,
    EngineEvent,
    EngineRecord,
    EngineState,
    FailureCause,
    PullAction,
)
from trio_pd._core._errors import HandshakeError
from trio_pd._core._public_values import ConsumerStatistics

SOURCE = "trio_pd._core._remote_engine.TRANSITIONS"
ANY = "any other state"

_FILL = {
    EngineState.UNKNOWN: "#ffffff",
    EngineState.FETCHING: "#dbe9f8",
    EngineState.LOADING: "#dbe9f8",
    EngineState.READY: "#cdebc5",
    EngineState.VERIFYING: "#e2f2d8",
    EngineState.BACKOFF: "#fbe3b8",
    EngineState.STALE: "#e4e4e4",
    EngineState.CLOSED: "#c9c9c9",
}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _label(text: str) -> str:
    """A quoted Graphviz label; each newline in ``text`` starts a centred line."""
    return _quote(text).replace("\n", "\\n")


def _tooltip(state: EngineState) -> str:
    """The state's attribute docstring in ``_remote_engine.py``, on one line."""
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


def tp_mapping_dot(prefill_tp: int, decode_tp: int, total_heads: int) -> str:
    """Graphviz source: every head's way from its prefill rank to its decode rank.

    Drawn from :func:`trio_pd._core._tensor_parallel.plan_pull`: one edge per head, from the
    head's slot in the prefill rank's block to its slot in the decode rank's.
    """
    per_prefill, per_decode = total_heads // prefill_tp, total_heads // decode_tp

    def rank_node(name: str, rank: int, heads: int, first: int, fill: str) -> str:
        rows = "".join(
            f'<tr><td port="h{h}" bgcolor="{fill}">head {first + h}</td></tr>' for h in range(heads)
        )
        label = (
            '<table border="0" cellborder="1" cellspacing="0">'
            f"<tr><td><b>{name} rank {rank}</b></td></tr>{rows}</table>"
        )
        return f"  {name}{rank} [shape=plaintext, label=<{label}>];"

    lines = [
        "digraph tp_mapping {",
        '  graph [rankdir=LR, nodesep=0.2, ranksep=1.0, bgcolor="transparent",'
        ' fontname="Helvetica"];',
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [color="#555555", arrowsize=0.5];',
    ]
    for r in range(prefill_tp):
        lines.append(rank_node("prefill", r, per_prefill, r * per_prefill, "#fbe3b8"))
    for d in range(decode_tp):
        lines.append(rank_node("decode", d, per_decode, d * per_decode, "#cdebc5"))
    for side, count in (("prefill", prefill_tp), ("decode", decode_tp)):
        chain = " -> ".join(f"{side}{r}" for r in range(count))
        lines.append(f"  {{rank=same; {chain} [style=invis];}}" if count > 1 else "")
    for d in range(decode_tp):
        for part in tp.plan_pull(d, decode_tp, prefill_tp):
            n = per_prefill // part.remote_slice.count
            for i in range(n):
                src = part.remote_slice.index * n + i
                dst = part.local_slice.index * n + i
                lines.append(f"  prefill{part.remote_rank}:h{src}:e -> decode{d}:h{dst}:w;")
    lines.append("}")
    return "\n".join(lines) + "\n"


class TPMappingDiagram(Graphviz):
    """``tp_mapping_dot`` for the given sizes, rendered by sphinx.ext.graphviz."""

    has_content = False
    required_arguments = 0
    option_spec: ClassVar[dict[str, Any]] = {
        **Graphviz.option_spec,
        "prefill-tp": int,
        "decode-tp": int,
        "heads": int,
    }

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(inspect.getsourcefile(tp) or "")
        prefill_tp, decode_tp = self.options["prefill-tp"], self.options["decode-tp"]
        dot = tp_mapping_dot(prefill_tp, decode_tp, self.options["heads"])
        self.content = StringList(
            dot.splitlines(), source="trio_pd._core._tensor_parallel.plan_pull"
        )
        self.options.setdefault(
            "alt", f"KV heads from prefill TP {prefill_tp} to decode TP {decode_tp}"
        )
        self.options.setdefault("align", "center")
        return super().run()


# -- the failure path ------------------------------------------------------------

ENGINE, HOST, PORT = "prefill-1", "10.0.0.2", 5600


class DocsDrift(RuntimeError):
    """The code no longer does what a generated picture shows: fix the picture's prose."""


def _expect(what: str, got: object, wanted: object) -> None:
    if got != wanted:
        raise DocsDrift(f"failure path: {what} is {got!r}, the docs say {wanted!r}")


@attrs.frozen
class Step:
    """One step of the failure path, as the record played it."""

    key: str
    actor: str
    text: str
    fill: str = "#ffffff"


def failure_path() -> list[Step]:
    """Play a failed handshake on a real ``EngineRecord`` (fake clock, defaults of
    ``ConnectorConfig``) and return each step with what the record answered.

    Two pulls wait on one attempt, its fetch fails (no reply in time), the
    record backs off and the attempt's event is set; both waiters raise their
    own copy of the error; a pull within the backoff fails fast; the first
    pull after it starts attempt 2. If the record answers otherwise (a state
    or action renamed, the policy changed), :class:`DocsDrift` fails the build.
    """
    defaults = {f.name: f.default for f in attrs.fields(ConnectorConfig)}
    timeout: float = defaults["handshake_timeout"]
    backoff = Backoff(
        defaults["backoff_initial"], defaults["backoff_max"], defaults["backoff_jitter"]
    )
    record = EngineRecord(ENGINE, HOST, PORT)
    event = attrs.fields(handshakes.RemoteEngine).attempt_done.name
    stats = {f.name for f in attrs.fields(ConsumerStatistics)}
    by_cause, in_backoff = "handshake_failures_by_cause", "pulls_rejected_in_backoff"
    _expect("a consumer statistic", {by_cause, in_backoff} <= stats, True)
    failing = inspect.getsource(handshakes.Handshakes._handshake_failed)
    ending = inspect.getsource(handshakes.Handshakes._end_attempt)
    _expect(
        "'the record is updated before the event is set'",
        failing.index("record.failed(") < failing.rindex("self._end_attempt(engine)")
        and f"{event}.set()" in ending,
        True,
    )
    steps: list[Step] = []

    def pull(key: str, name: str, now: float, wanted: PullAction, state: EngineState) -> None:
        action = record.on_pull("", now)
        _expect(f"{name}'s action at t={now:g}", action, wanted)
        _expect(f"the state after {name}", record.state, state)
        text = (
            f"{name}, t = {now:.2f} s\n"
            f"{EngineRecord.on_pull.__qualname__}() -> {action.name}\n"
            f"record: {record.state.name}, attempt {record.attempts}"
        )
        steps.append(Step(key, name, text, _FILL[record.state]))

    pull("a", "pull A", 0.0, PullAction.START, EngineState.FETCHING)
    attempt = record.attempts
    pull("b", "pull B", 0.1, PullAction.WAIT, EngineState.FETCHING)
    steps[-1] = attrs.evolve(steps[-1], text=steps[-1].text + f"\nawaits {event}.wait()")
    reason = f"no reply from {HOST}:{PORT} within {timeout:g} s: connection refused"
    error = HandshakeError(ENGINE, reason)
    fetch_causes = [c for c in FailureCause if c not in (FailureCause.TIMEOUT, FailureCause.NIXL)]
    causes = (
        ", ".join(c.value for c in fetch_causes) + f"; a failed load: {FailureCause.NIXL.value}"
    )
    steps.append(
        Step(
            "fetch",
            "fetch worker",
            f"the fetch fails at t = {timeout:g} s (handshake_timeout)\n"
            f"cause {FailureCause.TIMEOUT.value!r} (others: {causes})",
            "#f6d0cc",
        )
    )
    delay = record.failed(error, timeout, backoff, random.Random(0))
    _expect("the state after a failed attempt", record.state, EngineState.BACKOFF)
    steps.append(
        Step(
            "failed",
            "Handshakes",
            f"{handshakes.Handshakes._handshake_failed.__qualname__}()\n"
            f"{by_cause}[{FailureCause.TIMEOUT.value!r}] += 1\n"
            f"{EngineRecord.failed.__qualname__}() -> {record.state.name} "
            f"for {delay:.2f} s\n(backoff {backoff.initial:g} s, doubling to "
            f"{backoff.maximum:g} s, up to {backoff.jitter:.0%} shorter)\n"
            f"then {event}.set()",
            _FILL[record.state],
        )
    )
    seen: list[HandshakeError] = []
    for key, name in (("raise_a", "pull A"), ("raise_b", "pull B")):
        raised = record.attempt_error(attempt)
        _expect(f"{name}'s attempt error", raised, error)
        assert raised is not None
        own = handshakes._copy(raised)
        seen.append(own)
        steps.append(
            Step(
                key,
                name,
                f"{EngineRecord.attempt_error.__qualname__}({attempt}) -> its own copy:\n"
                f"raise {type(own).__name__}({own.engine_id!r},\n{own.reason!r})",
                "#f6d0cc",
            )
        )
    _expect("'each waiter raises its own object'", seen[0] is not seen[1], True)
    pull("c", "pull C", timeout + delay / 2, PullAction.FAIL_FAST, EngineState.BACKOFF)
    fast = handshakes._copy(record.fail_fast_error())
    _expect("pull C's error", (fast.engine_id, fast.reason), (ENGINE, reason))
    steps.append(
        Step(
            "raise_c",
            "pull C",
            f"at once: raise {EngineRecord.fail_fast_error.__qualname__}() (a copy)\n"
            f"no new attempt; {in_backoff} += 1",
            "#f6d0cc",
        )
    )
    pull("d", "pull D", record.retry_at, PullAction.START, EngineState.FETCHING)
    _expect("pull D's attempt", record.attempts, attempt + 1)
    steps[-1] = attrs.evolve(steps[-1], text=steps[-1].text + "\na new event: a fresh fetch")
    return steps


def failure_path_dot() -> str:
    """Graphviz source of :func:`failure_path`: one node per step, in order."""
    steps = {s.key: s for s in failure_path()}
    edges = [
        ("a", "b", "meanwhile"),
        ("a", "fetch", "starts"),
        ("fetch", "failed", "FetchFailure"),
        ("failed", "raise_a", "event set"),
        ("failed", "raise_b", "event set"),
        ("b", "failed", "waits"),
        ("failed", "c", "within the backoff"),
        ("c", "raise_c", ""),
        ("c", "d", "after the backoff"),
    ]
    lines = [
        "digraph failure_path {",
        '  graph [rankdir=TB, nodesep=0.35, ranksep=0.45, fontname="Helvetica", '
        'bgcolor="transparent"];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11, '
        'margin="0.15,0.06"];',
        '  edge [fontname="Helvetica", fontsize=10, color="#444444", arrowsize=0.7];',
    ]
    for step in steps.values():
        lines.append(
            f"  {step.key} [label={_label(step.text)}, fillcolor={_quote(step.fill)}, "
            f"tooltip={_quote(step.actor)}];"
        )
    for src, dst, label in edges:
        lines.append(f"  {src} -> {dst} [label={_quote(label)}];")
    lines.append("  {rank=same; a; b;}")
    lines.append("  {rank=same; raise_a; raise_b; c;}")
    lines.append("}")
    return "\n".join(lines) + "\n"


class FailurePathDiagram(Graphviz):
    """:func:`failure_path_dot`, rendered by sphinx.ext.graphviz."""

    has_content = False
    required_arguments = 0
    optional_arguments = 0

    def run(self) -> list[nodes.Node]:
        for module in (engines, handshakes):
            self.env.note_dependency(inspect.getsourcefile(module) or "")
        self.arguments = []
        self.content = StringList(failure_path_dot().splitlines(), source="failure_path")
        self.options.setdefault("alt", "a failed handshake, its backoff and its waiters")
        self.options.setdefault("align", "center")
        return super().run()


# -- fetches vs loads ------------------------------------------------------------


def _must_say(function: object, *fragments: str) -> None:
    """Fail the build if ``function``'s source no longer contains what a picture shows."""
    source = inspect.getsource(function)  # type: ignore[arg-type]
    for fragment in fragments:
        if fragment not in source:
            name = getattr(function, "__qualname__", function)
            raise DocsDrift(f"fetches vs loads: {name} no longer has {fragment!r}")


def fetch_load_dot() -> str:
    """Graphviz source: parallel fetches, the one handshake task, a stuck load.

    Drawn from the code: the fetch limit is ``ConnectorConfig``'s default, the
    names are the functions' own, the deadline error is the text
    ``Handshakes._deadline_error`` writes and ``backend_stuck_call`` the text
    ``NixlRemotes.stuck_call`` writes; :class:`DocsDrift` fails the build if
    the handshake task stops loading one at a time under the deadline, or a
    stuck load stops failing later loads fast.
    """
    from trio_pd._transfer._nixl import _remotes as remotes

    hs = handshakes.Handshakes
    defaults = {f.name: f.default for f in attrs.fields(ConnectorConfig)}
    limit, timeout = defaults["max_concurrent_fetches"], defaults["handshake_timeout"]
    _must_say(hs.__init__, "AttemptRunner[RemoteEngine](", "config.max_concurrent_fetches")
    _must_say(hs.run, "async for queued in self._loads_receive", "await self._load(")
    _must_say(hs._load, "engine.deadline", "load_remotes(")
    _must_say(hs._loaded, "FailureCause.NIXL")
    batch = remotes.NixlRemotes._load_batch
    _must_say(batch, "trio.move_on_at(load.request.deadline)", "_stuck_error", "self.stuck_call")
    _must_say(remotes.NixlRemotes._run_thread, "abandon_on_cancel=True")
    _must_say(remotes.NixlRemotes._stuck_error, "an earlier load is stuck in {stuck}")
    stuck_field = attrs.fields(ConsumerStatistics).backend_stuck_call.name
    # The stuck call as NixlRemotes reports it, a handshake_timeout after it began.
    nixl = remotes.NixlRemotes.__new__(remotes.NixlRemotes)
    progress = remotes.LoadProgress("agent-prefill-0")
    progress.call = "add_remote_agent"
    progress.started -= timeout
    progress.why = remotes.AT_DEADLINE
    nixl._stuck = progress
    stuck = nixl.stuck_call
    # The error of a load still queued at its deadline, as the shell writes it.
    record = EngineRecord("prefill-1", HOST, PORT, state=EngineState.LOADING)
    queued = types.SimpleNamespace(record=record, rank_label="")
    shell = types.SimpleNamespace(
        _config=ConnectorConfig.__new__(ConnectorConfig),
        _loads_queued=1,
        _backend=types.SimpleNamespace(stuck_call=stuck),
    )
    object.__setattr__(shell._config, "handshake_timeout", timeout)
    late = hs._deadline_error(shell, queued)  # type: ignore[arg-type]
    engines_ = ["prefill-0", "prefill-1", "prefill-2"]
    fetching = f"fetch workers, in parallel: at most {limit} at once (max_concurrent_fetches)"
    lines = [
        "digraph fetch_load {",
        '  graph [rankdir=TB, nodesep=0.3, ranksep=0.4, fontname="Helvetica", '
        'bgcolor="transparent", compound=true];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11, '
        'fillcolor="#ffffff", margin="0.15,0.06"];',
        '  edge [fontname="Helvetica", fontsize=10, color="#444444", arrowsize=0.7];',
        "  subgraph cluster_fetches {",
        f"    label={_label(fetching)};",
        '    style="rounded,dashed"; color="#888888"; fontsize=11;',
    ]
    for i, engine in enumerate(engines_):
        text = f"{hs._fetch_metadata.__qualname__}()\n{engine}: metadata round trip"
        lines.append(
            f"    fetch{i} [label={_label(text)}, fillcolor={_quote(_FILL[EngineState.FETCHING])}];"
        )
    lines.append("  }")
    channel = "memory channel: loads in the order their metadata arrived"
    lines.append(f"  queue [shape=cds, label={_label(channel)}];")
    for i in range(len(engines_)):
        lines.append(f"  fetch{i} -> queue;")
    lines += [
        "  subgraph cluster_task {",
        f"    label={_label(f'the handshake task ({hs.run.__qualname__}): one load at a time')};",
        '    style="rounded"; color="#444444"; fontsize=11;',
    ]
    load0 = (
        f"{hs._load.__qualname__}(prefill-0)\nNIXL add_remote_agent never returns:\n"
        f"cancelled at its handshake's deadline ({timeout:g} s), thread abandoned\n"
        f"its waiters: HandshakeError, cause {FailureCause.NIXL.value!r}\n"
        f"{stuck_field} = {stuck!r}"
    )
    load1 = (
        f"{hs._load.__qualname__}(prefill-1)\n"
        "fails fast: an earlier load is stuck in ...\n"
        "(or, still queued at its own deadline:\n"
        f"{textwrap.fill(repr(late.reason), 64)})\n"
        f"its waiters: HandshakeError, cause {FailureCause.NIXL.value!r}; backoff"
    )
    load2 = (
        f"{hs._load.__qualname__}(prefill-2)\nfails fast too, while {stuck_field} is set;\n"
        "an engine already READY needs no load: its pulls go on"
    )
    stuck_fill, failed_fill = "#f6d0cc", _FILL[EngineState.BACKOFF]
    lines.append(f"    load0 [label={_label(load0)}, fillcolor={_quote(stuck_fill)}];")
    lines.append(f"    load1 [label={_label(load1)}, fillcolor={_quote(failed_fill)}];")
    lines.append(f"    load2 [label={_label(load2)}, fillcolor={_quote(failed_fill)}];")
    lines.append('    load0 -> load1 -> load2 [label="next", style="bold"];')
    lines += ["  }", "  queue -> load0 [lhead=cluster_task];", "}"]
    return "\n".join(lines) + "\n"


class FetchLoadDiagram(Graphviz):
    """:func:`fetch_load_dot`, rendered by sphinx.ext.graphviz."""

    has_content = False
    required_arguments = 0
    optional_arguments = 0

    def run(self) -> list[nodes.Node]:
        for module in (handshakes, engines):
            self.env.note_dependency(inspect.getsourcefile(module) or "")
        self.arguments = []
        self.content = StringList(fetch_load_dot().splitlines(), source="fetch_load_dot")
        self.options.setdefault(
            "alt", "parallel metadata fetches, one load at a time, a stuck load"
        )
        self.options.setdefault("align", "center")
        return super().run()


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.graphviz")
    app.add_directive("engine-state-diagram", EngineStateDiagram)
    app.add_directive("engine-transition-table", EngineTransitionTable)
    app.add_directive("tp-mapping-diagram", TPMappingDiagram)
    app.add_directive("failure-path-diagram", FailurePathDiagram)
    app.add_directive("fetch-load-diagram", FetchLoadDiagram)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
