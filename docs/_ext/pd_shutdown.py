"""Sphinx extension: what happens when a connector closes, read from the code.

``.. shutdown-timeline::``
    What happens when ``async with open_connector(...)`` exits, in order: the
    cancel scopes (nursery, deadlines, shields) and the steps inside them are
    read from the source of ``open_connector``, ``_release`` and
    ``NixlBackend.aclose`` (its abstract syntax tree), so a scope that moves,
    a deadline that changes or a shield that goes changes the picture; a step
    the picture explains that is no longer called, or the release no longer
    shielded, fails the build (:class:`DocsDrift`). See :func:`shutdown_timeline`.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from pd_diagrams import DocsDrift, _label, _quote
from pd_drawing import WRAP, CodeDiagram, left_label, plain, require, source_of, wrapped
from sphinx.application import Sphinx

import trio_pd._connector as connector
import trio_pd._consumer._fetch_queue as attempts
import trio_pd._consumer._handshakes as handshakes
import trio_pd._connector as opening
import trio_pd._transfer._nixl._driver as driver
import trio_pd._transfer._nixl._backend as nixl
import trio_pd._transfer._nixl._notifications as notifications
import trio_pd._transfer._nixl._remotes as remotes
from trio_pd._config import ConnectorConfig

SCOPE_CALLS = frozenset(
    {
        "trio.open_nursery",
        "trio.move_on_after",
        "trio.move_on_at",
        "trio.fail_after",
        "trio.fail_at",
        "trio.CancelScope",
    }
)
"""The calls whose ``with`` block is a cancel scope (a nursery has one too)."""


@attrs.define(eq=False)
class Scope:
    """A cancel scope of the close path (or, ``call``, the body of a function it calls)."""

    code: str
    opened_by: str = ""
    deadline: str = ""
    seconds: float | None = None
    shielded: bool = False
    call: bool = False
    items: list[Scope | Step] = attrs.field(factory=list)
    tasks: list[str] = attrs.field(factory=list)


@attrs.define(eq=False)
class Step:
    """One statement of the close path, with what the picture says of it."""

    key: str
    code: str
    note: str
    scopes: tuple[Scope, ...]
    branch: bool = False
    jump: Step | None = None


def _callee(call: ast.Call) -> str:
    return ast.unparse(call.func)


class _Walk:
    """Walks functions' statements in execution order, keeping the cancel scopes.

    Only what ``notes`` names becomes a step (a call by its callee, ``yield``,
    or ``if <test>``); calls named in ``expand`` are walked into. A branch that
    returns jumps to the innermost ``finally`` of its function, or to what
    follows the call of its function.
    """

    def __init__(
        self,
        notes: Mapping[str, str],
        expand: Mapping[str, Callable[[], object]],
        values: Mapping[str, Any],
    ) -> None:
        self.notes, self.expand, self.values = notes, expand, values
        self.order: list[Step] = []
        self.found: dict[str, tuple[Scope, ...]] = {}
        self._returns: list[list[Step]] = []
        self._waiting: list[tuple[Step, int]] = []

    def function(self, function: object, scopes: tuple[Scope, ...]) -> None:
        tree = ast.parse(source_of(function))
        definition = tree.body[0]
        assert isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef)
        self._returns.append([])
        self._block(definition.body, scopes)
        self._resolve(self._returns.pop())

    def _resolve(self, branches: list[Step]) -> None:
        self._waiting += [(branch, len(self.order)) for branch in branches]

    def _block(self, statements: list[ast.stmt], scopes: tuple[Scope, ...]) -> None:
        for node in statements:
            if isinstance(node, ast.With | ast.AsyncWith):
                inner, wrappers = scopes, []
                for item in node.items:
                    call = item.context_expr
                    if not (isinstance(call, ast.Call) and _callee(call) in SCOPE_CALLS):
                        wrappers.append(ast.unparse(item))
                    else:
                        scope = self._scope(node, item, call, wrappers)
                        wrappers = []
                        inner[-1].items.append(scope)
                        inner = (*inner, scope)
                self._block(node.body, inner)
                if inner[-1] is not scopes[-1] and _callee_of(inner[-1]) == "trio.open_nursery":
                    self._step("<nursery exit>", "the nursery block ends", inner)
            elif isinstance(node, ast.Try):
                if node.finalbody:
                    self._returns.append([])
                self._block(node.body, scopes)
                if node.finalbody:
                    self._resolve(self._returns.pop())
                    self._block(node.finalbody, scopes)
            elif isinstance(node, ast.If):
                key = f"if {ast.unparse(node.test)}"
                if key in self.notes:
                    step = self._step(key, key + ":", scopes, branch=True)
                    if any(isinstance(s, ast.Return) for s in node.body):
                        self._returns[-1].append(step)
                else:
                    self._block(node.body, scopes)
                    self._block(node.orelse, scopes)
            elif isinstance(node, ast.Expr | ast.Assign):
                self._expression(node.value, scopes)

    def _expression(self, value: ast.expr, scopes: tuple[Scope, ...]) -> None:
        if isinstance(value, ast.Yield):
            self._step("yield", ast.unparse(value).strip("()"), scopes)
            return
        if isinstance(value, ast.Await):
            value = value.value
        if not isinstance(value, ast.Call):
            return
        callee = _callee(value)
        if callee in ("nursery.start", "nursery.start_soon"):
            scopes[-1].tasks.append(ast.unparse(value.args[0]))
            return
        first = ast.unparse(value.args[0]) if value.args else ""
        key = f"{callee}({first})" if f"{callee}({first})" in self.notes else callee
        if key in self.expand:
            function = self.expand[key]()
            name = getattr(function, "__qualname__", key)
            group = Scope(f"{name}()", call=True)
            scopes[-1].items.append(group)
            self.found[key] = (*scopes, group)
            self.function(function, (*scopes, group))
        elif key in self.notes:
            code = ast.unparse(value)
            if len(code) > WRAP:  # the callee and its first argument say enough
                more = ", ..." if len(value.args) + len(value.keywords) > 1 else ""
                code = f"{callee}({first}{more})"
            self._step(key, code, scopes)

    def _scope(
        self,
        node: ast.With | ast.AsyncWith,
        item: ast.withitem,
        call: ast.Call,
        wrappers: list[str],
    ) -> Scope:
        shielded = any(
            k.arg == "shield" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in call.keywords
        )
        deadline = ast.unparse(call.args[0]) if call.args else ""
        seconds = None
        if deadline:
            try:
                # (the code's own expression, with the config's values)
                seconds = float(eval(deadline, {}, dict(self.values)))
            except (NameError, AttributeError, TypeError):
                seconds = None
        head = "async with" if isinstance(node, ast.AsyncWith) else "with"
        header = ", ".join([*wrappers, ast.unparse(item)])
        return Scope(f"{head} {header}", _callee(call), deadline, seconds, shielded)

    def _step(self, key: str, code: str, scopes: tuple[Scope, ...], branch: bool = False) -> Step:
        if key in self.found:
            raise DocsDrift(f"shutdown timeline: {key!r} appears twice on the close path")
        step = Step(key, code, self.notes.get(key, ""), scopes, branch)
        scopes[-1].items.append(step)
        self.order.append(step)
        self.found[key] = scopes
        return step

    def finish(self) -> None:
        """Point each returning branch at the first step that runs after it."""
        for branch, at in self._waiting:
            after = [s for s in self.order[at:] if not s.branch]
            branch.jump = after[0] if after else None


def _callee_of(scope: Scope) -> str:
    """The call that made the scope (``trio.open_nursery``; ``""`` for a function's body)."""
    return scope.opened_by


def _first_sentence_of(method: Callable[..., object]) -> str:
    return plain(inspect.getdoc(method) or method.__qualname__)


def begin_close_lines() -> str:
    """What ``Connector._begin_close`` calls, each with its docstring's first sentence.

    The callees are read from its source; each ``self._role`` is typed by the
    ``role`` parameter of ``Connector.__init__``.
    """
    hints = typing.get_type_hints(connector.Connector.__init__)
    tree = ast.parse(source_of(connector.Connector._begin_close))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr.startswith("_"):
                cls = hints[owner.attr.lstrip("_")]
                method = getattr(cls, node.func.attr)
                lines.append(f"{method.__qualname__}(): {_first_sentence_of(method)}")
    if not lines:
        raise DocsDrift("shutdown timeline: Connector._begin_close calls no role any more")
    return "\n".join(lines)


def _fetch_tasks() -> list[str]:
    """The tasks handshake attempts start in the connector's nursery (their source:
    ``Handshakes._start_attempt`` hands each to ``AttemptRunner.start``)."""
    if "self._attempts.start(" not in source_of(handshakes.Handshakes._start_attempt):
        raise DocsDrift("shutdown timeline: a handshake attempt no longer goes to AttemptRunner")
    tree = ast.parse(source_of(attempts.AttemptRunner.start))
    started = [
        ast.unparse(node.args[0]).replace("self.", "AttemptRunner.")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _callee(node) == "self._nursery.start_soon"
    ]
    if not started:
        raise DocsDrift("shutdown timeline: a handshake attempt starts no task any more")
    return started


def shutdown_notes(config: ConnectorConfig) -> dict[str, str]:
    """What the picture says of each statement it shows, by callee (or ``if`` test)."""
    c = attrs.asdict(config)
    return {
        "yield": (
            "your async with body runs here, inside the nursery; it ends normally, "
            "by an exception or cancelled. Its waits are yours: a wait_released "
            f"resolves within lease_initial ({c['lease_initial']:g} s) if nobody holds "
            f"the exposure, abort_timeout ({c['abort_timeout']:g} s) at most"
        ),
        "connector._begin_close": begin_close_lines(),
        "nursery.cancel_scope.cancel": (
            "every task of the connector gets trio.Cancelled at its next checkpoint"
        ),
        "transfers.begin_close": (
            "(again: the nursery may have failed to start) "
            + _first_sentence_of(nixl.NixlBackend.begin_close)
        ),
        "consumer.wait_pulls_done": (
            "pulls in your other tasks let go: told CLOSING, each stops posting "
            f"and its running transfers get close_timeout ({c['close_timeout']:g} s)"
        ),
        "if scope.cancelled_caught": (
            "a pull still in flight: logged as an error, and the backend is NOT "
            "released (NIXL may still write that memory)"
        ),
        "self._driver.stop": "the transfer driver's thread ends (its jobs are over)",
        "self._remotes.wait_idle": (
            "a remote-agent load still in NIXL (its caller cancelled by the close, or "
            "given up at its deadline) returns, its thread releasing what it loaded: "
            f"until close_timeout ({c['close_timeout']:g} s) after begin_close"
        ),
        "if stuck": (
            "a load still in NIXL after that: the agent, its memory registration and "
            "the KV tensors are kept for the life of the process (logged, with why)"
        ),
        "if self._driver.transfers_kept": (
            "a transfer NIXL could not stop still runs: the agent, its memory "
            "registration and the KV tensors are kept for the life of the process (logged)"
        ),
        "trio.to_thread.run_sync(release_agent)": (
            "a worker thread unloads the remote agents, releases the descriptor "
            "lists and deregisters the memory: milliseconds, never abandoned, "
            "even past the deadline"
        ),
        "leases.wait_idle": (
            "abandons running in your tasks (each ending by close_timeout after "
            "begin_close) close their sockets"
        ),
        "channel.close": (
            "the side channel goes (ZeroMQ: its context, after every socket is closed)"
        ),
    }


def shutdown_timeline(config: ConnectorConfig | None = None) -> Scope:
    """The close path of ``open_connector`` as nested scopes of steps, read from the code.

    Walks ``open_connector``, ``_release`` and ``NixlBackend.aclose`` (the
    statements ``shutdown_notes`` names, inside every cancel scope around
    them), evaluates each scope's deadline with ``config`` (default:
    ``ConnectorConfig``'s defaults) and checks what the prose promises:

    * every step the notes explain is still on the path, once;
    * the body, ``_begin_close`` and the cancellation run inside the nursery, in order;
    * the release of the backend and of the side channel run shielded, and the wait for
      pulls under ``close_timeout``;
    * the nursery's tasks end promptly: a stuck load is abandoned, the
      notification poll returns at ``begin_close``, the driver stops each job
      within ``close_timeout``.

    Raises:
        DocsDrift: the code no longer does what the picture shows.
    """
    config = ConnectorConfig() if config is None else config
    notes = shutdown_notes(config)
    expand: dict[str, Callable[[], object]] = {
        "_release": lambda: opening._release,
        "transfers.aclose": lambda: nixl.NixlBackend.aclose,
    }
    values = {"config": config, "self": types.SimpleNamespace(_config=config)}
    walk = _Walk(notes, expand, values)
    root = Scope("open_connector()", call=True)
    walk.function(opening.open_connector, (root,))
    walk.finish()
    missing = [key for key in [*notes, *expand] if key not in walk.found]
    if missing:
        raise DocsDrift(f"shutdown timeline: the close path no longer has {missing}")
    keys = [step.key for step in walk.order]
    body_and_cancel = ["yield", "connector._begin_close", "nursery.cancel_scope.cancel"]
    if [k for k in keys if k in body_and_cancel] != body_and_cancel:
        raise DocsDrift(f"shutdown timeline: the order is now {keys}")
    for key in body_and_cancel:
        if not any(_callee_of(s) == "trio.open_nursery" for s in walk.found[key]):
            raise DocsDrift(f"shutdown timeline: {key} is no longer inside the nursery")
    for key in ("transfers.aclose", "channel.close", "leases.wait_idle"):
        if not any(s.shielded for s in walk.found[key]):
            raise DocsDrift(f"shutdown timeline: {key} no longer runs shielded")
    if walk.found["consumer.wait_pulls_done"][-1].seconds != config.close_timeout:
        raise DocsDrift("shutdown timeline: the wait for pulls is no longer close_timeout")
    picture = "shutdown timeline"
    require(picture, remotes.NixlRemotes._run_thread, "abandon_on_cancel=True")
    require(picture, notifications.NotificationPoller._poll_blocking, "self._closing.is_set()")
    require(picture, driver.TransferDriver._check_stop, "now + self._config.close_timeout")
    nursery = next(s for s in walk.found["yield"] if _callee_of(s) == "trio.open_nursery")
    exit_step = next(s for s in nursery.items if isinstance(s, Step) and s.key == "<nursery exit>")
    exit_step.note = (
        "its exit waits for every task: "
        + ", ".join([*nursery.tasks, *_fetch_tasks()])
        + ". Each closes its own sockets on the way out; the handshake task lets go "
        "of a remote-agent load in NIXL (abandon_on_cancel=True: the backend's close "
        "waits for its thread), the notification poll returns once closing is set"
    )
    return root


_SHIELDED, _NURSERY, _BRANCH = "#e2f2d8", "#f5f8fc", "#f6d0cc"


def shutdown_timeline_dot(config: ConnectorConfig | None = None) -> str:
    """Graphviz source of :func:`shutdown_timeline`: nested clusters, steps in order."""
    root = shutdown_timeline(config)
    lines = [
        "digraph shutdown {",
        '  graph [rankdir=TB, nodesep=0.3, ranksep=0.3, fontname="Helvetica", '
        'bgcolor="transparent", compound=true];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, '
        'fillcolor="#ffffff", margin="0.12,0.05"];',
        '  edge [fontname="Helvetica", fontsize=9, color="#444444", arrowsize=0.6];',
    ]
    ids: dict[int, str] = {}
    order: list[Step] = []

    def emit(scope: Scope, depth: int) -> None:
        pad = "  " * depth
        for item in scope.items:
            if isinstance(item, Step):
                ids[id(item)] = f"s{len(ids)}"
                order.append(item)
                fill = _BRANCH if item.branch else "#ffffff"
                text = f"{item.code}\n{wrapped(item.note)}" if item.note else item.code
                lines.append(
                    f"{pad}{ids[id(item)]} [label={_label(text)}, fillcolor={_quote(fill)}];"
                )
                continue
            name = f"cluster_{len(lines)}"
            if item.call:
                title, style, fill = item.code, "rounded,dashed", "none"
            else:
                bound = f"{item.seconds:g} s from here" if item.seconds is not None else ""
                title = item.code.replace(" as scope", "")
                if bound:
                    title += f"\n{item.deadline} = {bound}"
                if item.shielded:
                    title += "\nshielded: the cancellation outside does not reach in"
                nursery = _callee_of(item) == "trio.open_nursery"
                fill = _SHIELDED if item.shielded else (_NURSERY if nursery else "#ffffff")
                style = "rounded,filled"
            lines.extend(
                [
                    f"{pad}subgraph {name} {{",
                    f"{pad}  label={left_label(title)}; labeljust=l; fontsize=10;",
                    f'{pad}  style="{style}"; fillcolor={_quote(fill)}; color="#777777";',
                ]
            )
            emit(item, depth + 1)
            lines.append(f"{pad}}}")

    emit(root, 1)
    main = [s for s in order if not s.branch]
    for before, after in itertools.pairwise(main):
        lines.append(f"  {ids[id(before)]} -> {ids[id(after)]};")
    for i, step in enumerate(order):
        if not step.branch:
            continue
        before = next(s for s in reversed(order[:i]) if not s.branch)
        lines.append(f'  {ids[id(before)]} -> {ids[id(step)]} [style=dashed, label="or"];')
        if step.jump is not None:
            target = ids[id(step.jump)]
            lines.append(f'  {ids[id(step)]} -> {target} [style=dashed, label="return"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


class ShutdownTimeline(CodeDiagram):
    """:func:`shutdown_timeline_dot`, rendered by sphinx.ext.graphviz."""

    modules = (connector, nixl, driver, remotes, notifications, handshakes)
    alt = "what happens, in order, when a connector's async with block exits"

    def dot(self) -> str:
        return shutdown_timeline_dot()


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.graphviz")
    app.add_directive("shutdown-timeline", ShutdownTimeline)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
