"""Sphinx extension: how the deadlines of one pull add up, from the code.

``.. deadline-budget::``
    The deadlines one pull can meet, in order, with ``ConnectorConfig``'s
    defaults and ``HANDSHAKES_PER_PULL``, summed into the worst case; each
    bound is checked against the code that keeps it (:class:`DocsDrift`
    otherwise). See :func:`deadline_budget`.
"""

from __future__ import annotations

from typing import Any

import attrs
from pd_diagrams import DocsDrift, _label, _quote
from pd_drawing import CodeDiagram, left_label, require
from sphinx.application import Sphinx

import trio_pd._consumer._fetch_queue as attempts
import trio_pd._consumer._pulls as consumer
import trio_pd._consumer._handshakes as handshakes
import trio_pd._core._remote_engine as engines
import trio_pd._exception_groups as groups
import trio_pd._side_channel._fetch as fetch
import trio_pd._transfer._backend as backend
import trio_pd._transfer._nixl._driver as driver
import trio_pd._transfer._nixl._jobs as jobs
import trio_pd._transfer._nixl._remotes as remotes
from trio_pd._config import ConnectorConfig

__all__ = ["Budget", "DocsDrift", "deadline_budget", "deadline_budget_dot"]


@attrs.frozen
class Budget:
    """The bounds one pull can meet, in seconds, and their sums."""

    handshake_timeout: float
    backoff_initial: float
    transfer_timeout: float
    close_timeout: float
    max_concurrent_fetches: int
    waits: int

    @property
    def wait(self) -> float:
        """The longest one wait of a pull for its engine: an attempt, or a verification slot."""
        return max(self.handshake_timeout, self.backoff_initial)

    @property
    def ready(self) -> float:
        return self.waits * self.wait

    @property
    def transfer(self) -> float:
        """The read (its deadline, then stopping what runs), then a retired agent's unload."""
        return self.transfer_timeout + 2 * self.close_timeout

    @property
    def worst(self) -> float:
        return self.ready + self.transfer

    @property
    def worst_several_ranks(self) -> float:
        return 2 * self.ready + self.transfer


def deadline_budget(config: ConnectorConfig | None = None) -> Budget:
    """The deadlines of a pull, with ``config`` (default ``ConnectorConfig()``).

    Each bound the picture draws is checked against the code that keeps it:
    the attempt's one deadline (set when it starts, kept by the watchdog
    while it waits for a fetch slot or in the load queue, by the fetch and
    by the load), the limit of
    ``HANDSHAKES_PER_PULL`` waits, a verification slot every
    ``backoff_initial``, the second round only for a pull of several parts,
    the transfer deadline from the hand-off, ``close_timeout`` to stop, and a
    retired agent's unload under ``close_timeout``.

    Raises:
        DocsDrift: one of those is no longer in the code.
    """
    config = ConnectorConfig() if config is None else config
    p, hs = "deadline budget", handshakes.Handshakes
    require(
        p,
        hs._start_attempt,
        "engine.deadline = trio.current_time() + self._config.handshake_timeout",
    )
    require(p, hs._start_attempt, "self._attempts.start(engine, record.attempts, engine.deadline)")
    require(p, attempts.AttemptRunner._watch_deadlines, "trio.CancelScope(deadline=deadline)")
    require(p, hs._deadline_passed, "if queued and", "unsent_failure(", "EngineState.LOADING")
    require(p, fetch.fetch_engine_metadata, "with trio.fail_at(deadline):")
    require(p, hs._load, "engine.deadline", "load_remotes(")
    require(p, remotes.NixlRemotes._load_batch, "trio.move_on_at(load.request.deadline)")
    require(p, backend.load_one_by_one, "with trio.move_on_at(request.deadline):")
    require(
        p,
        hs.ready_agent,
        "raise _copy(record.fail_fast_error())",
        "await trio.sleep_until(record.verify_again_at)",
        "if waits == HANDSHAKES_PER_PULL:",
        "await done.wait()",
    )
    require(p, hs.engine, "verify_interval=self._config.backoff_initial")
    require(p, engines.EngineRecord.on_pull, "self.verify_again_at = now + self.verify_interval")
    require(
        p,
        consumer.Consumer.pull,
        "await self._handshakes.ready_agent(",
        "await self._ready_parts(",
        "await first_failure_wins(transfers)",
    )
    require(
        p,
        consumer.Consumer._ready_parts,
        "await first_failure_wins(ready)",
        "await first_failure_wins([ready[i] for i in again])",
    )
    require(p, groups.first_failure_wins, "return [await calls[0]()]")
    require(p, jobs.job_for, "time.monotonic() + config.transfer_timeout")
    require(p, driver.TransferDriver._check_stop, "now + self._config.close_timeout")
    require(
        p,
        backend.RemoteAgents._unload_shielded,
        "trio.move_on_after(self._unload_timeout, shield=True)",
    )
    require(p, remotes.NixlRemotes.__init__, "RemoteAgents(self._unload, config.close_timeout)")
    return Budget(
        config.handshake_timeout,
        config.backoff_initial,
        config.transfer_timeout,
        config.close_timeout,
        config.max_concurrent_fetches,
        handshakes.HANDSHAKES_PER_PULL,
    )


def deadline_budget_dot(config: ConnectorConfig | None = None) -> str:
    """Graphviz source of :func:`deadline_budget`: a pull's phases, top to bottom."""
    b = deadline_budget(config)
    hs, n = handshakes.Handshakes, b.waits
    ht, bi, tt, ct = b.handshake_timeout, b.backoff_initial, b.transfer_timeout, b.close_timeout
    changed = f"the engine changed during {n} handshakes"
    attempt = (
        f"one handshake attempt: {hs._start_attempt.__qualname__}() sets ONE deadline,\n"
        f"its start + handshake_timeout = {ht:g} s, for all four phases\n"
        "(a pull that joins an attempt later waits less)"
    )
    ready = (
        f"1. the engine ready: {hs.ready_agent.__qualname__}(), each remote rank concurrently\n"
        f"at most HANDSHAKES_PER_PULL = {n} waits of at most {b.wait:g} s: {b.ready:g} s"
    )
    transfer = f"3. the transfers, every part concurrently: at most {b.transfer:g} s"
    nodes_ = {
        "pull": ("await connector.pull(...)", "#ffffff"),
        "slot": (
            f"wait for a fetch slot\n(max_concurrent_fetches = {b.max_concurrent_fetches})\n"
            f"{attempts.AttemptRunner._watch_deadlines.__qualname__}():\n"
            "the watchdog fails it at the deadline",
            "#dbe9f8",
        ),
        "fetch": (
            f"{fetch.fetch_engine_metadata.__name__}(): the metadata\nround trip"
            " (trio.fail_at(deadline))",
            "#dbe9f8",
        ),
        "queue": (
            "wait in the load queue (one load at a time)\n"
            "the same watchdog fails it at the deadline",
            "#dbe9f8",
        ),
        "load": (
            f"{hs._load.__qualname__}(): the NIXL load (with those queued with it)\n"
            "given up at the deadline: skipped, or abandoned in its call",
            "#dbe9f8",
        ),
        "defer": (
            f"or DEFER: wait for the next verification,\nat most backoff_initial = {bi:g} s"
            "\n(one per engine per backoff_initial)",
            "#ffffff",
        ),
        "fast": (
            "in BACKOFF: FAIL_FAST, at once:\nthe attempt's HandshakeError again, no wait",
            "#f6d0cc",
        ),
        "limit": (f"after {n} waits: HandshakeError\n{changed!r}", "#f6d0cc"),
        "again": (
            f"several remote ranks (Tp > Td): a part whose agent\nwas retired meanwhile"
            f" (a restart found by another part)\ngoes round once more: up to"
            f" {b.ready:g} s more",
            "#ffffff",
        ),
        "check": ("2. every part's block ids checked: at once\n(ParamsRejectedError)", "#ffffff"),
        "read": (
            f"the read goes to the transfer driver:\ntransfer_timeout = {tt:g} s from the hand-off",
            "#cdebc5",
        ),
        "stop": (
            "past it (or cancelled, or closing): no more chunks,\n"
            f"the running ones get close_timeout = {ct:g} s;\nstill running then:"
            " TransferError with settled",
            "#cdebc5",
        ),
        "unload": (
            "the lease on the agent ends: a retired agent's\nlast lease unloads it,"
            f" shielded, within close_timeout = {ct:g} s",
            "#cdebc5",
        ),
        "sum": (
            f"worst case, one remote rank:\n{n} x {b.wait:g} + {tt:g} + {ct:g} + {ct:g}"
            f" = {b.worst:g} s\nseveral remote ranks: {b.worst_several_ranks:g} s\n"
            f"a healthy new engine: one attempt, at most {ht:g} s, then the read",
            "#fbe3b8",
        ),
    }
    lines = [
        "digraph deadline_budget {",
        '  graph [rankdir=TB, nodesep=0.3, ranksep=0.3, fontname="Helvetica", '
        'bgcolor="transparent", compound=true];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, '
        'margin="0.12,0.05"];',
        '  edge [fontname="Helvetica", fontsize=9, color="#444444", arrowsize=0.6];',
    ]

    def node(key: str, pad: str = "  ") -> None:
        text, fill = nodes_[key]
        lines.append(f"{pad}{key} [label={_label(text)}, fillcolor={_quote(fill)}];")

    node("pull")
    lines += [
        "  subgraph cluster_ready {",
        f"    label={left_label(ready)}; labeljust=l; fontsize=10;",
        '    style="rounded"; color="#777777";',
        "    subgraph cluster_attempt {",
        f"      label={left_label(attempt)}; labeljust=l; fontsize=10;",
        '      style="rounded,filled"; fillcolor="#f5f8fc"; color="#777777";',
    ]
    for key in ("slot", "fetch", "queue", "load"):
        node(key, "      ")
    lines.append("    }")
    for key in ("fast", "defer", "limit", "again"):
        node(key, "    ")
    lines += [
        "  }",
        "  subgraph cluster_transfer {",
        f"    label={left_label(transfer)}; labeljust=l; fontsize=10;",
        '    style="rounded"; color="#777777";',
    ]
    for key in ("read", "stop", "unload"):
        node(key, "    ")
    lines.append("  }")
    node("check")
    node("sum")
    lines += [
        "  pull -> slot [lhead=cluster_ready];",
        "  slot -> fetch -> queue -> load;",
        "  fast -> defer -> limit -> again [style=invis];",
        "  load -> check [ltail=cluster_ready];",
        "  check -> read [lhead=cluster_transfer];",
        "  read -> stop -> unload;",
        "  unload -> sum [ltail=cluster_transfer];",
        "}",
    ]
    return "\n".join(lines) + "\n"


class DeadlineBudget(CodeDiagram):
    """:func:`deadline_budget_dot`, rendered by sphinx.ext.graphviz."""

    modules = (handshakes, fetch, consumer, jobs, driver, backend, engines, groups)
    alt = "how the deadlines of one pull add up"

    def dot(self) -> str:
        return deadline_budget_dot()


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.graphviz")
    app.add_directive("deadline-budget", DeadlineBudget)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
