"""The docs cannot drift silently: the tests they name exist, their programs run
and print what the pages show, their diagrams come from the code, and they build
with warnings as errors."""

from __future__ import annotations

import ast
import html as html_module
import importlib
import json
import os
import posixpath
import re
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import msgspec
import pytest

import trio_pd
import trio_pd._core._protocol as protocol
import trio_pd._core._public_values
import trio_pd.testing
from trio_pd._config import Tuning
from trio_pd._core._remote_engine import (
    TRANSITIONS,
    EngineEvent,
    EngineRecord,
    EngineState,
    PullAction,
)

from .conftest import run_here, run_in_terminal_order

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def test_every_test_named_in_the_failure_table_exists() -> None:
    text = (ROOT / "docs" / "failure-semantics.md").read_text()
    references = REFERENCE.findall(text)
    assert len(references) >= 25
    for file, name in references:
        path = ROOT / file
        assert path.is_file(), file
        if name:
            assert name in _test_names(path), f"{file}::{name}"


# ---- the documentation's programs, diagrams and build ----------------------

DOCS = ROOT / "docs"
EXAMPLES = {
    # program in docs/examples -> the page that shows it and its output
    "hello.py": "index.md",
    "primer_nursery.py": "trio-primer.md",
    "primer_start.py": "trio-primer.md",
    "primer_cancel.py": "trio-primer.md",
    "primer_shield.py": "trio-primer.md",
    "primer_event.py": "trio-primer.md",
    "primer_errors.py": "trio-primer.md",
    "primer_blocking.py": "trio-primer.md",
    "why_asyncio.py": "why-structured-concurrency.md",
    "why_trio.py": "why-structured-concurrency.md",
    "tutorial_frontend.py": "tutorial.md",
    "handshake_failure.py": "tutorial.md",
    "shutdown.py": "tutorial.md",
    "curve_auth.py": "tutorial.md",
    "engine_states.py": "design.md",
    "wire_protocol.py": "protocol.md",
    "engine_bridge.py": "embedding.md",
    "embed_hypercorn.py": "embedding.md",
    "embed_quart_trio.py": "embedding.md",
    "mini_connector.py": "build-a-connector.md",
}
# What may differ from run to run: free ports, how often ZeroMQ retried, and in
# the log lines a backoff's jittered delay, an incarnation and a CURVE key.
VARIABLE = [
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:PORT"),
    (re.compile(r"\(\d+ attempts\)"), "(N attempts)"),
    (re.compile(r"allowed in \d+\.\d+ s"), "allowed in T s"),
    (re.compile(r"incarnation [0-9a-f]{16}"), "incarnation INCARNATION"),
    (re.compile(r"consumer key \S{40} from"), "consumer key KEY from"),
]


def _normalized(text: str) -> str:
    for pattern, replacement in VARIABLE:
        text = pattern.sub(replacement, text)
    return text


def run_in_terminal(path: Path) -> str:
    """What a docs program shows in a terminal (``conftest.run_in_terminal_order``).
    It must exit 0 and print something."""
    status, output = run_in_terminal_order(path, timeout=60)
    assert status == 0, output
    assert output.strip()
    return output


# Run in this process (``run_here``), not in an interpreter of their own: the
# same output, without a second start of torch and NIXL (seconds on 2 cores).
IN_PROCESS = {"embed_hypercorn.py", "embed_quart_trio.py"}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_runs_and_prints_what_its_page_shows(example: str) -> None:
    path = DOCS / "examples" / example
    output = _normalized(run_here(path) if example in IN_PROCESS else run_in_terminal(path)).strip()
    page = _normalized((DOCS / EXAMPLES[example]).read_text())
    assert output in page, f"{EXAMPLES[example]} does not show the output of {example}:\n{output}"


def test_every_example_is_tested_and_included_in_its_page() -> None:
    assert {p.name for p in (DOCS / "examples").glob("*.py")} == set(EXAMPLES)
    for example, page in EXAMPLES.items():
        assert f"{{literalinclude}} examples/{example}" in (DOCS / page).read_text(), example


MISTAKES = [
    # docs/mistakes: each a wrong and a right version, run in this process
    "forgot_await.py",
    "blocking_call.py",
    "swallowed_cancel.py",
    "start_soon_not_start.py",
    "except_star.py",
    "bare_shield.py",
    "freed_too_early.py",
]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_common_mistake_runs_wrong_and_right_and_prints_what_its_page_shows(
    mistake: str,
) -> None:
    output = _normalized(run_here(DOCS / "mistakes" / mistake)).strip()
    assert output.startswith("-- wrong"), output
    assert "\n-- right" in output, output
    page = _normalized((DOCS / "common-mistakes.md").read_text())
    assert output in page, f"common-mistakes.md does not show the output of {mistake}:\n{output}"


def test_every_common_mistake_is_tested_and_shown_wrong_and_right() -> None:
    assert {p.name for p in (DOCS / "mistakes").glob("*.py")} == set(MISTAKES)
    page = (DOCS / "common-mistakes.md").read_text()
    for mistake in MISTAKES:
        for version in ("wrong", "right"):
            shown = f"{{literalinclude}} mistakes/{mistake}\n:caption: docs/mistakes/{mistake}"
            assert f"{shown} ({version})\n:language: python\n:pyobject: {version}" in page, (
                mistake,
                version,
            )


def test_the_vllm_field_map_names_every_key_trio_pd_sends() -> None:
    """for-vllm-engineers.md's table of ``kv_transfer_params`` has a row for
    every key ``to_kv_transfer_params()`` sends, each with the attribute of
    ``RemoteBlocks`` it comes from; vLLM's ``do_remote_prefill`` is said to be
    missing, as it is."""
    remote = trio_pd.RemoteBlocks(
        engine_id="prefill-0", host="127.0.0.1", port=5557, block_ids=(1,), request_id="r"
    )
    params = remote.to_kv_transfer_params()
    assert "do_remote_prefill" not in params
    page = (DOCS / "for-vllm-engineers.md").read_text()
    section = page[page.index("## `kv_transfer_params`") : page.index("## vLLM's KV tensors")]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    second = {row.split(" | ")[1] for row in rows}
    for key, name in trio_pd._core._public_values.KV_TRANSFER_PARAMS.items():
        assert key in params, key
        assert any(f"`{key}`" in cell and f"`{name}`" in cell for cell in second), key
    assert "| `do_remote_prefill` | **not set** by `to_kv_transfer_params()` |" in section


# The asyncio-to-trio table (trio-primer.md): each row's trio spellings, one of
# which every file its last column names must hold.
TABLE_SPELLINGS = {
    "`asyncio.run(main())`": ("trio.run(",),
    "`asyncio.create_task(coro)`": (".start_soon(",),
    "`asyncio.TaskGroup()`": ("nursery.start(",),
    "`asyncio.gather(*aws)`": (".start_soon(",),
    "`asyncio.timeout(s)`": ("trio.fail_after(", "trio.move_on_after("),
    "`asyncio.CancelledError`": ("trio.CancelScope(shield=True)",),
    "`asyncio.shield(aw)`": ("shield=True)",),
    "`asyncio.Future`": ("AttemptDone",),
    "`asyncio.Event`": ("trio.Event",),
    "`asyncio.Queue(maxsize)`": ("trio.open_memory_channel",),
    "`asyncio.Semaphore(n)`": ("trio.Semaphore(", "trio.CapacityLimiter("),
    "`asyncio.Lock`": ("trio.Lock()",),
    "`asyncio.sleep(0)`": ("trio.lowlevel.checkpoint()",),
    "`asyncio.to_thread(fn)`": ("trio.to_thread.run_sync(", "abandon_on_cancel=True"),
    "`loop.call_soon_threadsafe(cb)`": (".run_sync_soon(", "trio.from_thread.run_sync("),
}


def test_each_row_of_the_asyncio_table_names_files_that_use_its_trio_spelling() -> None:
    text = (DOCS / "trio-primer.md").read_text()
    table = text[text.index("| asyncio | trio |") : text.index("The table is a map")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(TABLE_SPELLINGS) + 1  # (and get_running_loop: nothing to use)
    for row in rows:
        asyncio_cell, _, uses = (cell.strip() for cell in row.strip("|").split(" | "))
        first = asyncio_cell.split(",")[0].split(" (")[0]
        if first == "`asyncio.get_running_loop()`":
            continue
        files = re.findall(r"`((?:src|docs)/[\w/.]+\.py)`", uses)
        assert files, row
        for file in files:
            code = (ROOT / file).read_text()
            assert any(spelling in code for spelling in TABLE_SPELLINGS[first]), (file, first)
    without = [p.name for p in (DOCS / "examples").glob("*.py") if "trio.run" not in p.read_text()]
    assert without == ["why_asyncio.py"]  # ("every program in docs/examples/ but the asyncio one")


def test_the_api_reference_documents_all_of_the_public_api() -> None:
    api = (DOCS / "api.rst").read_text()
    documented = set(
        re.findall(r"^\.\. auto(?:function|class|exception):: (\w+)(?![.\w])", api, re.M)
    )
    assert documented == set(trio_pd.__all__)
    testing = r"^\.\. auto(?:function|class|exception):: trio_pd\.testing\.(\w+)"
    in_testing = re.findall(testing, api, re.M)
    assert set(in_testing) == set(trio_pd.testing.__all__)


def _diagrams() -> ModuleType:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import pd_diagrams
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return pd_diagrams


def test_the_state_diagram_is_drawn_from_the_transition_table() -> None:
    diagrams = _diagrams()
    dot = diagrams.engine_state_dot()
    shared = diagrams.shared_events(TRANSITIONS)
    assert shared == {EngineEvent.CONNECTOR_CLOSED: EngineState.CLOSED}
    edges = re.findall(r"^  (\w+) -> (\w+) \[label=\"([^\"]+)\"", dot, re.M)
    expected = [
        (state.name, target.name, event.value)
        for (state, event), target in TRANSITIONS.items()
        if event not in shared
    ] + [("ANY_CONNECTOR_CLOSED", "CLOSED", "connector closed")]
    assert sorted(edges) == sorted(expected)
    # A different table gives a different picture: nothing is drawn by hand.
    fewer = dict(TRANSITIONS)
    del fewer[EngineState.READY, EngineEvent.INCARNATION_MISMATCH]
    assert "incarnation mismatch" not in diagrams.engine_state_dot(fewer)


def test_the_failure_path_is_what_the_record_does_and_drift_fails_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    diagrams = _diagrams()
    dot = diagrams.failure_path_dot()
    for action in (PullAction.START, PullAction.WAIT, PullAction.FAIL_FAST):
        assert f"-> {action.name}" in dot, action
    assert "BACKOFF for" in dot
    assert "attempt 2" in dot
    assert dot.count("raise HandshakeError('prefill-1',") == 2  # each waiter its own
    # A record that answered otherwise (here: a pull in backoff would wait) fails the build.
    real = EngineRecord.on_pull

    def waits_in_backoff(self: EngineRecord, incarnation: str, now: float) -> PullAction:
        if self.state is EngineState.BACKOFF and now < self.retry_at:
            return PullAction.WAIT
        return real(self, incarnation, now)

    monkeypatch.setattr(EngineRecord, "on_pull", waits_in_backoff)
    with pytest.raises(diagrams.DocsDrift, match="pull C's action"):
        diagrams.failure_path_dot()


def test_fetches_vs_loads_is_drawn_from_the_code_and_drift_fails_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    diagrams = _diagrams()
    dot = diagrams.fetch_load_dot()
    default = attrs.fields(trio_pd.ConnectorConfig).max_concurrent_fetches.default
    assert f"at most {default} at once" in dot
    assert "backend_stuck_call = " in dot
    assert (
        "add_remote_agent for agent 'agent-prefill-0' (5.0 s; abandoned at its handshake's "
        "deadline)" in dot
    )
    text = " ".join(dot.replace("\\n", " ").split())  # (labels are wrapped)
    assert "of the handshake's start (1 loads queued); the transfer backend is stuck" in text
    # A handshake task that loaded without the deadline would fail the build.
    import trio_pd._consumer._handshakes as handshakes

    async def load_without_deadline(self: object, batch: object) -> None:
        pass

    monkeypatch.setattr(handshakes.Handshakes, "_load", load_without_deadline)
    with pytest.raises(diagrams.DocsDrift, match=r"engine\.deadline"):
        diagrams.fetch_load_dot()


def _extension(name: str) -> ModuleType:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(DOCS / "_ext"))


def test_the_shutdown_timeline_is_read_from_the_code_and_drift_fails_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timelines = _extension("pd_shutdown")
    dot = timelines.shutdown_timeline_dot()
    close = attrs.fields(trio_pd.ConnectorConfig).close_timeout.default
    shield = f"2 * config.close_timeout = {2 * close:g} s from here"
    # The scopes nest as in the source: the release and ZeroMQ's end are inside the shield.
    assert dot.index(shield) < dot.index("NixlBackend.aclose()") < dot.index("channel.close")
    assert dot.count("shielded: the cancellation outside does not reach in") == 2
    tasks = ("channel.serve_auth", "producer.serve_listener", "consumer.run_handshakes")
    for task in (*tasks, "leases.run"):
        assert task in dot, task
    assert "Leases.begin_close(): Refuse new holds and" in dot  # (its docstring)
    # Other deadlines, another picture: nothing is typed by hand.
    other = timelines.shutdown_timeline_dot(trio_pd.ConnectorConfig(close_timeout=2.0))
    assert "2 * config.close_timeout = 4 s from here" in other
    # A release that is no longer shielded fails the build.
    import trio

    import trio_pd._connector as opening_module
    from trio_pd._connector import _release

    @asynccontextmanager
    async def unshielded(config: Any, transfers: Any, connector: Any, *args: Any) -> Any:
        try:
            async with trio.open_nursery() as nursery:
                try:
                    yield connector
                finally:
                    connector._begin_close()
                    nursery.cancel_scope.cancel()
        finally:
            transfers.begin_close()
            with trio.move_on_after(2 * config.close_timeout):  # (unshielded on purpose)
                await _release(*args)  # noqa: ASYNC102

    monkeypatch.setattr(opening_module, "open_connector", unshielded)
    with pytest.raises(timelines.DocsDrift, match=r"transfers\.aclose no longer runs shielded"):
        timelines.shutdown_timeline_dot()


def test_the_deadline_budget_adds_up_the_code_s_deadlines_and_drift_fails_the_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trio_pd._consumer._handshakes import HANDSHAKES_PER_PULL, Handshakes

    timelines = _extension("pd_budget")
    for config in (trio_pd.ConnectorConfig(), trio_pd.ConnectorConfig(handshake_timeout=7.0)):
        dot = timelines.deadline_budget_dot(config)
        text = " ".join(dot.replace("\\n", " ").split())
        wait = max(config.handshake_timeout, config.backoff_initial)
        worst = HANDSHAKES_PER_PULL * wait + config.transfer_timeout + 2 * config.close_timeout
        assert f"handshake_timeout = {config.handshake_timeout:g} s, for all four phases" in text
        assert f"HANDSHAKES_PER_PULL = {HANDSHAKES_PER_PULL} waits" in text
        assert f"= {worst:g} s several remote ranks: {worst + HANDSHAKES_PER_PULL * wait:g} s" in (
            text
        )
    # An attempt that no longer sets its one deadline fails the build.
    real = Handshakes._start_attempt

    def start_without_a_deadline(self: Handshakes, engine: Any) -> None:
        real(self, engine)

    monkeypatch.setattr(Handshakes, "_start_attempt", start_without_a_deadline)
    with pytest.raises(timelines.DocsDrift, match=r"no longer has .engine\.deadline = "):
        timelines.deadline_budget_dot()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 4), (4, 2), (2, 2)])
def test_the_tp_picture_is_drawn_from_the_plan_and_moves_each_head_home(
    prefill_tp: int, decode_tp: int
) -> None:
    heads = 8
    dot = _diagrams().tp_mapping_dot(prefill_tp, decode_tp, heads)
    edges = re.findall(r"prefill(\d+):h(\d+):e -> decode(\d+):h(\d+):w", dot)
    per_prefill, per_decode = heads // prefill_tp, heads // decode_tp
    moved = sorted(
        (int(r) * per_prefill + int(h), int(d) * per_decode + int(k)) for r, h, d, k in edges
    )
    assert moved == [(g, g) for g in range(heads)]


def _facts() -> ModuleType:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import pd_facts
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return pd_facts


def _wire() -> ModuleType:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import pd_facts_wire
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return pd_facts_wire


def test_the_fact_tables_have_every_flag_field_metric_and_key() -> None:
    facts = _facts()
    for command, parser in facts.command_parsers().items():
        shown = {row[0].split()[0] for row in facts.flag_rows(parser)}
        hidden = {"--parent-pid"} if command == "engine" else set()
        every = {
            a.option_strings[0] for a in parser._actions if a.option_strings[0] != "-h"
        } - hidden
        assert shown == every, command
    assert [row[0] for row in facts.config_rows()] == [
        f.name for f in attrs.fields(trio_pd.ConnectorConfig) if not f.name.startswith("_")
    ]
    assert [row[0] for row in facts.config_rows(Tuning)] == [f.name for f in attrs.fields(Tuning)]
    engine = {row.name for row in facts.engine_metric_rows()}
    assert {"trio_pd_serve_requests_total", "trio_pd_pulls_succeeded_total"} <= engine
    assert "trio_pd_engines_ready" in engine  # a gauge: no _total
    stats = {f.name for f in attrs.fields(trio_pd.ConnectorStatistics)} - {"backend_stuck_call"}
    assert {name.removeprefix("trio_pd_").removesuffix("_total") for name in engine} >= stats
    proxy = {row.name: row.labels for row in facts.proxy_metric_rows()}
    assert proxy["trio_pd_proxy_engine_errors_total"] == ("role", "engine", "kind")
    wire = _wire()
    keys = [row[0] for row in wire.message_rows(protocol.LeaseEntry)]
    assert keys == [f.name for f in msgspec.structs.fields(protocol.LeaseEntry)]
    assert wire.message_rows(protocol.MetadataRequest)[:2] == [
        ("type", "string", '`"metadata_request"`'),
        ("protocol_version", "integer", f"`{protocol.PROTOCOL_VERSION}`"),
    ]


def test_the_envelope_table_names_every_message_and_the_version() -> None:
    wire = _wire()
    (type_key, type_kind, tags), (version_key, _, version) = wire.envelope_rows()
    assert (type_key, type_kind, version_key) == ("type", "string", "protocol_version")
    named = re.findall(r'`"(\w+)"`', tags)
    assert named == [
        "metadata_request",
        "lease",
        "lease_reply",
        "confirm",
        "confirm_reply",
        "metadata_reply",
        "error",
    ]
    assert version.startswith(f"`{protocol.PROTOCOL_VERSION}` ")


def test_a_message_without_the_envelope_fails_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    class Planted(msgspec.Struct, tag="planted", tag_field="type"):
        said: str

    monkeypatch.setattr(protocol, "Planted", Planted, raising=False)
    with pytest.raises(ValueError, match="Planted has no 'protocol_version'"):
        _wire().envelope_rows()


def test_the_kv_transfer_params_table_is_what_the_parser_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The keys the table shows are those the producer sends, and a key the
    table calls optional is one the consumer's parser lets go (with the default
    shown), a required one is one it refuses to go without."""
    import trio_pd._core._public_values as records

    rows = _wire().kv_param_rows()
    sent = trio_pd.RemoteBlocks("p", "h", 5, [1, 2], "r", "i", 2, "t").to_kv_transfer_params()
    assert [key for key, _, _ in rows] == list(sent)
    for key, kind, meaning in rows:
        assert meaning, key
        without = {k: v for k, v in sent.items() if k != key}
        optional = re.search(r"optional \(absent or null: `(.*)`\)", kind)
        if optional is None:
            with pytest.raises(ValueError, match=f"lacks '{key}'"):
                trio_pd.RemoteBlocks.from_kv_transfer_params(without)
            continue
        name = records.KV_TRANSFER_PARAMS[key]
        for absent in (without, {**without, key: None}):
            parsed = trio_pd.RemoteBlocks.from_kv_transfer_params(absent)
            assert getattr(parsed, name) == json.loads(optional.group(1)), key
    monkeypatch.setitem(records.KV_TRANSFER_PARAMS, "remote_token", "signature")
    with pytest.raises(ValueError, match="KV_TRANSFER_PARAMS carries"):
        _wire().kv_param_rows()


def test_the_error_tables_have_every_row_of_the_code() -> None:
    from trio_pd._serve.errors import ERROR_STATUSES

    wire = _wire()
    rows = {w: wire.error_status_rows(w) for w in ("engine", "proxy")}
    shown = {name for w in rows for row in rows[w] for name in row.exceptions}
    assert shown == {wire.exception_name(cls) for cls in ERROR_STATUSES}
    assert "trio_pd.HandshakeError" in shown
    assert "Exception" in shown
    [pulls] = [row for row in rows["engine"] if "trio_pd.TransferError" in row.exceptions]
    assert (pulls.status, pulls.type) == ("502", "the exception's class name")
    [busy] = [row for row in rows["engine"] if row.status.startswith("503")]
    assert busy.status == "503, Retry-After: 1"


def test_the_logger_table_has_every_logger_the_sources_use() -> None:
    import trio_pd._loggers as loggers

    facts = _facts()
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import pd_loggers  # (the check that reads the sources; pd_facts runs it)
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    assert [name for name, _ in facts.logger_rows()] == sorted(
        pd_loggers.loggers_used(), key=list(loggers.LOGGERS).index
    )


def test_the_exit_statuses_cover_every_command_and_only_the_exit_constants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trio_pd._cli.common as common

    facts = _facts()
    rows = facts.exit_status_rows(["engine", "proxy", "serve"])
    assert [status for status, _ in rows] == [common.EXIT_OK, common.EXIT_FAILED, common.EXIT_USAGE]
    engine, proxy, serve = rows[2][1]
    assert (proxy, serve) == ("bad arguments", "bad arguments")
    assert engine.startswith("bad arguments, or its ``--engine-id`` is held by a live engine")
    assert facts.exit_status_rows(["keygen"])[1] == (common.EXIT_USAGE, ["bad arguments"])
    planted = {**common.EXIT_STATUSES, "serve": {**common.EXIT_STATUSES["serve"], 3: "x"}}
    monkeypatch.setattr(common, "EXIT_STATUSES", planted)
    with pytest.raises(ValueError, match=r"EXIT_STATUSES\['serve'\]: \[0, 1, 2, 3\]"):
        facts.exit_status_rows(["serve"])
    del planted["keygen"]
    with pytest.raises(ValueError, match="the parser's commands are"):
        facts.exit_status_rows(["engine"])


def test_the_commands_exit_with_the_exit_constants_only() -> None:
    """No ``return 1`` or ``sys.exit(0)`` in the CLI: a status is an ``EXIT_*``
    constant, so the table the docs render from ``EXIT_STATUSES`` names it."""
    for path in (ROOT / "src" / "trio_pd" / "_cli").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Return):
                statuses = [node.value] if node.value is not None else []
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "sys.exit":
                statuses = [n for arg in node.args for n in ast.walk(arg)]
            else:
                continue
            literal = [n for n in statuses if isinstance(n, ast.Constant) and type(n.value) is int]
            assert not literal, f"{path.name}:{node.lineno}: a literal exit status"


def test_a_default_that_the_docstring_misstates_fails_the_build() -> None:
    @attrs.frozen
    class Planted:
        """A planted config.

        Attributes:
            timeout: how long. Default 5.0.
            size: how much. Default 1 MiB.
            name: which. Default ``"a"``.
        """

        timeout: float = 5.0
        size: int = 2 << 20
        name: str = "a"

    with pytest.raises(ValueError, match=r"Planted.size: the docstring says 'Default 1 MiB'"):
        _facts().config_rows(Planted)
    Planted.__doc__ = (Planted.__doc__ or "").replace("Default 1 MiB", "Default 2 MiB")
    rows = _facts().config_rows(Planted)
    assert rows == [
        ("timeout", "5.0", "how long."),
        ("size", "2 MiB", "how much."),
        ("name", "'a'", "which."),
    ]


def test_a_protocol_field_without_a_docstring_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "planted_protocol.py").write_text(
        "import msgspec\n\n"
        "class Planted(msgspec.Struct, tag='planted', tag_field='type'):\n"
        "    protocol_version: int\n"
        "    said: str\n"
        '    """Documented."""\n'
        "    unsaid: int\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import planted_protocol
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(ValueError, match=r"Planted\.unsaid has no docstring"):
        _wire().message_rows(planted_protocol.Planted)


def test_the_offline_inventories_point_at_the_public_docs(tmp_path: Path) -> None:
    sys.path.insert(0, str(DOCS))
    try:
        from make_trio_inventory import write_inventories
    finally:
        sys.path.remove(str(DOCS))
    from sphinx.util.inventory import InventoryFile

    mapping = write_inventories(tmp_path)
    base, path = mapping["trio"]
    assert base == "https://trio.readthedocs.io/en/stable/"
    with open(path, "rb") as f:
        inventory = InventoryFile.load(f, base, posixpath.join)

    def uri(kind: str, name: str) -> str:
        item = inventory[kind][name]
        return str(getattr(item, "uri", None) or item[2])  # Sphinx >= 8.2 or older

    assert uri("py:exception", "trio.Cancelled") == base + "reference-core.html#trio.Cancelled"
    assert uri("py:function", "trio.lowlevel.wait_readable") == (
        base + "reference-lowlevel.html#trio.lowlevel.wait_readable"
    )
    assert "trio.from_thread.check_cancelled" in inventory["py:function"]
    assert "trio.TASK_STATUS_IGNORED" in inventory["py:data"]


def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    html = tmp_path / "html"
    strict = ["-E", "-W", "--keep-going", "-n", "-q"]  # fresh, warnings are errors
    where = ["-d", str(tmp_path / "doctrees"), str(DOCS), str(html)]
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", *strict, "-b", "html", *where],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    # trio-aware signatures, as a caller writes them
    api = (html / "api.html").read_text()
    open_connector = _signature(api, "trio_pd.open_connector")
    assert open_connector.startswith("async with trio_pd.open_connector(engine_id: str,")
    assert open_connector.endswith(") as connector")
    assert _signature(api, "trio_pd.Connector.pull").startswith("await pull(request_id: str,")
    assert _signature(api, "trio_pd.Connector.expose").startswith("expose(request_id: str,")

    # The diagrams were rendered by Graphviz: on the design page the task tree,
    # first pull, failure path, state diagram (with every state), fetches vs
    # loads and the shutdown timeline; two TP mappings (with every decode rank)
    # on the internals page; the deadline budget on the timeouts page.
    def images(page: str) -> list[str]:
        found = re.findall(r'data="(_images/graphviz-\w+\.svg)"', (html / page).read_text())
        return [(html / image).read_text() for image in found]

    svgs = images("design.html")
    assert len(svgs) == 6, len(svgs)
    assert any("nursery.cancel_scope.cancel()" in svg for svg in svgs)
    internals_svgs = images("internals.html")  # two TP mappings, the packages
    assert len(internals_svgs) == 3, len(internals_svgs)
    assert any("_transfer/_nixl/" in svg and "_remote_engine" in svg for svg in internals_svgs)
    assert any("HANDSHAKES_PER_PULL" in svg for svg in images("timeouts.html"))
    # The tables rendered from the code are on their pages.
    facts = _facts()
    serving = html_module.unescape((html / "serving.html").read_text())
    for command in ("engine", "proxy", "serve"):
        for flag, _, what in facts.flag_rows(facts.command_parsers()[command]):
            assert f'<span class="pre">{flag.split()[0]}</span>' in serving, flag
            assert what in serving, what
    timeouts = (html / "timeouts.html").read_text()
    for name, _, _ in facts.config_rows():
        assert f'<span class="pre">{name}</span>' in timeouts, name
    operations = (html / "operations.html").read_text()
    for row in facts.proxy_metric_rows():
        assert f'<span class="pre">{row.name}</span>' in operations, row.name
    for status, whats in facts.exit_status_rows(["engine", "proxy", "serve"]):
        assert f"<td><p>{status}</p></td>" in serving, status
        assert all(what.replace("``", "") in re.sub(r"<[^>]+>", "", serving) for what in whats)
    for name, _ in facts.logger_rows():
        assert f'<span class="pre">{name}</span></code></p></td>' in operations, name
    protocol_page = (html / "protocol.html").read_text()
    for key, _, _ in [*_wire().envelope_rows(), *_wire().kv_param_rows()]:
        assert f'<span class="pre">{key}</span>' in protocol_page, key
    for where in ("engine", "proxy"):
        for row in _wire().error_status_rows(where):
            for name in row.exceptions:
                assert f'<span class="pre">{name}</span>' in serving, name
    assert any(all(state.name in svg for state in EngineState) for svg in svgs)
    assert any(all(f"decode rank {d}" in svg for d in range(4)) for svg in internals_svgs)


def _signature(page: str, object_id: str) -> str:
    """The text of the signature of ``object_id`` on an HTML page, tags removed."""
    match = re.search(rf'<dt[^>]* id="{re.escape(object_id)}">(.*?)</dt>', page, re.S)
    assert match, object_id
    text = re.sub(r"<[^>]+>", "", match.group(1))
    return " ".join(html_module.unescape(text).split()).rstrip("\uf0c1¶ ")
