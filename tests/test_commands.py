"""``trio-pd engine``, ``trio-pd proxy`` and ``trio-pd serve`` as an operator runs
them: real processes, their ready files, exit statuses, messages and signals."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_pd._cli import main
from trio_pd._serve.binding import bind_listener
from trio_pd._serve.discovery import EngineAnnouncement, EngineSet
from trio_pd._serve.engine import EngineSettings
from trio_pd._serve.process import serve_engine

from .http_clients import http_client
from .test_serve import complete, stream

pytestmark = pytest.mark.slow

TRIO_PD = [sys.executable, "-m", "trio_pd"]
ENV = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
SECRET = "5e" * 32  # (hex, as an operator would put it in the environment)
INTERNAL_KEY = "an-internal-key-for-the-commands-0123456789"


@asynccontextmanager
async def running(
    *commands: tuple[list[str], Path] | tuple[list[str], Path, str],
    env: dict[str, str] | None = None,
) -> AsyncIterator[list[tuple[trio.Process, dict[str, Any]]]]:
    """``trio-pd ARGS --ready-file READY`` for each ``(ARGS, READY)`` or ``(ARGS,
    READY, NETNS)``, started at once (output into ``READY.log``; in network
    namespace ``NETNS`` if given): each process and its ready file's content,
    once all appeared; then SIGTERM each one still running."""
    processes = []
    try:
        for args, ready, *netns in commands:
            prefix = ["ip", "netns", "exec", *netns] if netns else []  # (ip execs the command)
            with ready.with_suffix(".log").open("wb") as log:
                processes.append(
                    await trio.lowlevel.open_process(
                        [*prefix, *TRIO_PD, *args, "--ready-file", str(ready)],
                        env=env or ENV,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        start_new_session=True,
                    )
                )
        with trio.fail_after(60):
            for process, (_, ready, *_) in zip(processes, commands, strict=True):
                while not await trio.Path(ready).exists():  # (the process writes it)
                    log = await trio.Path(ready.with_suffix(".log")).read_text()
                    assert process.poll() is None, log
                    await trio.sleep(0.02)
        yield [
            (process, json.loads(await trio.Path(ready).read_text()))
            for process, (_, ready, *_) in zip(processes, commands, strict=True)
        ]
    finally:
        with trio.move_on_after(30, shield=True):
            for process in processes:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
            for process in processes:
                with trio.move_on_after(20):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


def one_line_error(stderr: str) -> str:
    """The command's error: its last line; no traceback anywhere."""
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


async def test_engines_and_a_proxy_started_as_separate_commands_serve_what_one_engine_serves(
    tmp_path: Path,
) -> None:
    # (the internal key: CURVE on the side channel, from a pair derived from it)
    env = {**ENV, "TRIO_PD_EXPOSURE_SECRET": SECRET, "TRIO_PD_INTERNAL_KEY": INTERNAL_KEY}
    engine = ["engine", "--port", "0", "--num-blocks", "64"]
    p, d, x = (tmp_path / f"{name}.json" for name in ("prefill", "decode", "proxy"))
    with trio.fail_after(90):
        async with (
            running(
                ([*engine, "--role", "prefill"], p), ([*engine, "--role", "decode"], d), env=env
            ) as [(prefill_process, prefill), (decode_process, decode)],
            # (the engines answer only the deployment: the test calls one directly)
            http_client(30, headers={"authorization": f"Bearer {INTERNAL_KEY}"}) as client,
        ):
            # A ready file appears only once its engine accepts requests.
            for url in (prefill["url"], decode["url"]):
                assert (await client.get(f"{url}/health")).json()["status"] == "ok"
            proxy_args = ["proxy", "--port", "0", "--prefill", prefill["url"]]
            async with running(([*proxy_args, "--decode", decode["url"]], x), env=env) as [
                (proxy_process, proxy)
            ]:
                for i, prompt in enumerate(["a", "y" * 17, "three separate commands " * 4]):
                    body = {"prompt": prompt, "max_tokens": 5 + i}
                    pd = await complete(client, proxy["url"], **body)
                    whole = await complete(client, decode["url"], **body)
                    assert pd["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
                    streamed = await stream(client, proxy["url"], **body)
                    assert streamed == pd["choices"][0]["token_ids"]
                # The engine's id is derived from its role, address and port.
                port = decode["url"].rsplit(":", 1)[1]
                assert f"-decode-127.0.0.1-{port}-" in whole["id"]
                for process in (proxy_process, decode_process, prefill_process):
                    process.send_signal(signal.SIGTERM)
                    assert await process.wait() == 0
    for ready in (p, d, x):  # no ready file outlives its server
        assert not ready.exists()
    engine_log = d.with_suffix(".log").read_text()
    assert "no exposure secret" not in engine_log
    assert f"engine decode-127.0.0.1-{port}: SIGTERM: draining" in engine_log


@pytest.mark.parametrize(
    ("args", "status", "words"),
    [
        (["serve", "--num-blocks", "0"], 2, "--num-blocks must be at least 1"),
        (["engine", "--role", "prefill", "--host", "0.0.0.0"], 2, "--advertise-host"),
        (["engine", "--role", "decode", "--etcd", "127.0.0.1:2379"], 2, "not an http(s) URL"),
        (["proxy", "--prefill", "http://127.0.0.1:1"], 2, "--decode URL"),
        (["proxy", "--prefill", "http://a:1", "--decode", "http://[::1"], 2, "--decode 'http://"),
        (["proxy", "--prefill", "http://a:99999", "--decode", "http://b:1"], 2, "not a port"),
        (
            ["proxy", "--etcd", "http://127.0.0.1:1", "--etcd-prefix", "/foo"],
            2,
            "--etcd-prefix '/foo' must end with '/'",
        ),
        (
            ["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--ready-file", "/no/r"],
            2,
            "is not a writable folder",
        ),
        (
            [
                "proxy",
                "--prefill",
                "http://a:1",
                "--decode",
                "http://b:1",
                "--api-key",
                "k" * 20,
                "--internal-key-file",
                "KEYFILE",
            ],
            2,
            "must not be the engines' internal key",
        ),
        # (issue 30, fault 7: each of these was a traceback)
        (["proxy", "--port", "0", "--etcd", "http://127.0.0.1:1"], 1, "etcd at http://127.0.0"),
        (
            [
                "proxy",
                "--port",
                "0",
                "--prefill",
                "http://a:1",
                "--decode",
                "http://b:1",
                "--ready-file",
                "BLOCKED",
            ],
            1,
            "cannot write the ready file",
        ),
        (
            [
                "proxy",
                "--prefill",
                "http://a:1",
                "--decode",
                "http://b:1",
                "--ready-file",
                "DIRECTORY",
            ],
            2,
            "is a folder",
        ),
        (
            ["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--idle-timeout", "nan"],
            2,
            "--idle-timeout must be > 0",
        ),
        (["engine", "--role", "decode", "--send-timeout", "0"], 2, "--send-timeout must be > 0"),
        (["engine", "--role", "prefill"], 2, "the side channel would be plain text"),
        (
            ["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--send-timeout", "nan"],
            2,
            "--send-timeout must be > 0",
        ),
        (["serve", "--send-timeout", "inf"], 2, "--send-timeout must be > 0"),
        (
            ["engine", "--role", "prefill", "--prefill-url", "http://a:1"],
            2,
            "it needs --role decode",
        ),
        (["engine", "--role", "decode", "--api-key", "k" * 20], 2, "it needs --prefill-url"),
        (["engine", "--role", "decode", "--prefill-url", "ftp://a:1"], 2, "--prefill-url"),
        (
            ["engine", "--role", "decode", "--prefill-url", "http://a:1", "--etcd", "http://e:1"],
            2,
            "not together yet",
        ),
        (
            ["engine", "--role", "decode", "--prefill-url", "http://a:1", "--prefill-timeout", "0"],
            2,
            "--prefill-timeout must be",
        ),
        (["engine", "--role", "prefill", "--admission-timeout", "0"], 2, "--admission-timeout"),
        (
            ["engine", "--role", "decode", "--admission-timeout", "31"],
            2,
            "must be at most the exposure's cap (30 s)",
        ),
        (["serve", "--admission-timeout", "inf"], 2, "--admission-timeout must be"),
        (
            ["serve", "--dispatch", "decode-first", "--hosts", "1"],
            2,
            "--dispatch decode-first and --hosts: not together",
        ),
        (
            ["serve", "--dispatch", "decode-first", "--decode", "2", "--port", "65535"],
            2,
            "need ports past 65535",
        ),
        # (decode-first is serve's alone: no proxy dispatches so)
        (
            [
                "proxy",
                "--prefill",
                "http://a:1",
                "--decode",
                "http://b:1",
                "--dispatch",
                "decode-first",
            ],
            2,
            "invalid choice: 'decode-first'",
        ),
        # 192.0.2.1 (TEST-NET-1) is no address of this machine: serve fails
        # before it starts an engine.
        (["serve", "--port", "0", "--host", "192.0.2.1"], 1, "cannot bind 192.0.2.1:0"),
        (
            ["serve", "--dispatch", "decode-first", "--port", "0", "--host", "192.0.2.1"],
            1,
            "decode-0: cannot bind 192.0.2.1:0",
        ),
    ],
)
def test_bad_arguments_exit_2_and_an_address_that_is_not_ours_exits_1_in_one_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    status: int,
    words: str,
) -> None:
    (tmp_path / "key").write_text("k" * 20)
    (tmp_path / "r.json.tmp").mkdir()  # (where the ready file is written first)
    replaced = {
        "KEYFILE": str(tmp_path / "key"),
        "DIRECTORY": str(tmp_path),
        "BLOCKED": str(tmp_path / "r.json"),
    }
    args = [replaced.get(arg, arg) for arg in args]
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == status
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"trio-pd {args[0]}: "), line
    assert words in line, line


def test_serves_admission_timeout_is_each_engines() -> None:
    """``serve --admission-timeout`` reaches every engine's command line, and
    the engine's parser makes it the engine's setting."""
    from trio_pd._cli import _parser
    from trio_pd._cli.engine import settings_from_args
    from trio_pd._cli.engine_processes import EngineProcess
    from trio_pd._cli.serve import ServeOptions, _engine_command

    args = _parser().parse_args(["serve", "--admission-timeout", "25"])
    assert args.admission_timeout == 25.0
    engine = EngineProcess("decode", 0, "/tmp/ready.json")
    command = _engine_command(ServeOptions(admission_timeout=25.0), engine, None, {})
    assert "--admission-timeout=25.0" in command
    at = command.index("engine")
    settings = settings_from_args(_parser().parse_args(command[at:]))
    assert settings.admission_timeout == 25.0
    engine_default = settings_from_args(_parser().parse_args(["engine", "--role", "prefill"]))
    assert engine_default.admission_timeout == 10.0


def test_no_proxy_dispatches_decode_first() -> None:
    """``decode-first`` is ``trio-pd serve``'s alone (it starts no proxy):
    the proxy's options refuse it, naming the flag, as its parser does."""
    from trio_pd._cli.proxy import ProxyOptions

    with pytest.raises(ValueError, match="--dispatch 'decode-first': a proxy dispatches"):
        ProxyOptions(dispatch="decode-first").check()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
@pytest.mark.parametrize(("seconds", "milliseconds"), [(2.5, 2500), (0.0001, 1)])
def test_accepted_connections_inherit_the_listeners_send_timeout(
    host: str, seconds: float, milliseconds: int
) -> None:
    listener = bind_listener(host, 0, send_timeout=seconds)
    listener.listen()
    with listener, socket.create_connection(listener.getsockname()[:2]):
        accepted, _ = listener.accept()
        with accepted:
            option = accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
    assert option == milliseconds  # (a fraction of a millisecond is one, not 0: off)


async def test_an_engine_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    ready.write_text('{"url": "http://127.0.0.1:9"}')  # (stale: left by a killed engine)
    command = [*TRIO_PD, "engine", "--role", "prefill", "--host", "192.0.2.1", "--no-curve"]
    with trio.fail_after(30):
        result = await trio.run_process(
            [*command, "--ready-file", str(ready)], check=False, env=ENV, capture_stderr=True
        )
    stderr = result.stderr.decode()
    assert result.returncode == 1
    line = one_line_error(stderr)
    assert line == (
        "trio-pd engine prefill: could not start: "
        "HTTP: cannot bind 192.0.2.1:0: Cannot assign requested address"
    )
    assert "WARNING: no exposure secret" in stderr  # (none was given)
    assert not ready.exists()


async def test_serve_fails_with_the_engines_named_when_their_connectors_cannot_open(
    tmp_path: Path,
) -> None:
    # No UCX transport is usable: each engine's lifespan fails. (hypercorn
    # still reports its server started; serve used to print "serving".)
    ready = tmp_path / "ready.json"
    command = [*TRIO_PD, "serve", "--port", "0", "--ready-file", str(ready)]
    with trio.fail_after(60):
        result = await trio.run_process(
            command, check=False, env={**ENV, "UCX_TLS": "nonexistent"}, capture_stderr=True
        )
    stderr = result.stderr.decode()
    assert result.returncode == 1
    assert "serving" not in stderr
    line = one_line_error(stderr)
    assert line.startswith("trio-pd serve: engine ")
    assert "exited with status 1 before it accepted requests" in line
    assert "could not start: BackendError" in stderr  # (each engine's own line)
    assert not ready.exists()


def engines_of(pid: int) -> list[int]:
    """The engine processes that serve ``pid`` started and that still run."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"--parent-pid={pid}".encode() in arguments:
            found.append(int(entry.name))
    return found


async def test_sigterm_during_start_up_stops_serve_without_serving(tmp_path: Path) -> None:
    log, ready = tmp_path / "serve.log", tmp_path / "ready.json"
    with log.open("wb") as output:
        process = await trio.lowlevel.open_process(
            [*TRIO_PD, "serve", "--port", "0", "--ready-file", str(ready)],
            env=ENV,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
        )
    try:
        with trio.fail_after(30):
            while True:  # (until serve started both engine processes)
                started = "starting 2 engines" in await trio.Path(log).read_text()
                if started and len(engines_of(process.pid)) == 2:
                    break
                await trio.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
    text = log.read_text()
    assert "start-up abandoned" in text
    assert "serving" not in text
    assert not ready.exists()
    assert engines_of(process.pid) == []


async def test_ctrl_c_reaches_only_serve_which_drains_the_proxy_then_the_engines(
    tmp_path: Path,
) -> None:
    log = tmp_path / "ready.log"
    serve = ["serve", "--port", "0", "--host", "0.0.0.0", "--grace", "20"]
    body: dict[str, Any] = {"prompt": "drain me", "max_tokens": 150, "stream": True}
    tokens, done = 0, False
    with trio.fail_after(90):
        async with (
            running((serve, tmp_path / "ready.json")) as [(process, ready)],
            http_client(30) as client,
        ):
            proxy = ready["proxy"]
            assert proxy.startswith("http://127.0.0.1:")  # (advertised for the wildcard)
            async with (
                client.stream("POST", f"{proxy}/v1/completions", json=body) as response,
                aclosing(response.aiter_lines()) as stream_lines,
            ):
                async for line in stream_lines:
                    if line.startswith("data: {"):
                        if not tokens:  # decoding: Ctrl-C, to serve's process group
                            os.killpg(process.pid, signal.SIGINT)
                        tokens += 1
                    done = done or line == "data: [DONE]"
            # The drain ends with the request (not at --grace 20: the
            # request's last send closes its connection, uncancelled).
            with trio.fail_after(10):
                assert await process.wait() == 0
    assert (tokens, done) == (150, True)
    lines = log.read_text().splitlines()
    assert "note: --host 0.0.0.0 binds every interface" in lines[0]

    def at(words: str) -> int:
        return next(i for i, line in enumerate(lines) if words in line)

    # The engines got no SIGINT: serve sent them SIGTERM once the proxy drained.
    assert not any("engine" in line and "SIGINT" in line for line in lines)
    drained = at("the proxy drained")
    assert at("trio-pd serve: SIGINT: draining") < drained
    for name in ("prefill-0", "decode-0"):
        assert drained < at(f"engine {name}: SIGTERM: draining") < at(f"engine {name} stopped")
    assert not (tmp_path / "ready.json").exists()


class RecordingMembership:
    """A membership that records what the engine did, and when."""

    def __init__(self, ready: Path) -> None:
        self.ready = ready
        self.events: list[str] = []

    async def hold_registration(
        self,
        engine: EngineAnnouncement,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with http_client(10) as client:
            health = (await client.get(f"{engine.url}/health")).status_code
            self.events.append(
                f"registered {engine.role} ready_file={self.ready.exists()} {health}"
            )
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):  # (while the engine still serves)
                    health = (await client.get(f"{engine.url}/health")).status_code
                    self.events.append(f"withdrawn {health}")

    async def watch_engines(
        self,
        update: Callable[[EngineSet], None],
        *,
        task_status: trio.TaskStatus[EngineSet] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        raise NotImplementedError  # (the engine does not watch)


async def test_an_engine_registers_before_its_ready_file_and_withdraws_while_it_serves(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready.json"
    membership = RecordingMembership(ready)
    settings = EngineSettings(engine_id="", http_port=0, num_blocks=8, ready_file=str(ready))
    lines: list[str] = []
    serving = trio.Event()

    def report(line: str) -> None:
        lines.append(line)
        if "ready at" in line:
            serving.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(
                    serve_engine, settings, "decode", membership=membership, report=report
                )
            )
            await serving.wait()
            url = json.loads(await trio.Path(ready).read_text())["url"]
            port = url.rsplit(":", 1)[1]
            assert lines == [
                f"engine decode-127.0.0.1-{port}: decode, ready at {url} (bound {url})"
            ]
            os.kill(os.getpid(), signal.SIGTERM)  # (serve_engine receives it)
    assert membership.events == ["registered decode ready_file=False 200", "withdrawn 200"]
    assert lines[-1].endswith(": stopped")
    assert not ready.exists()


def test_the_serving_commands_never_load_the_testing_toolkit() -> None:
    """``trio-pd engine``, ``proxy``, ``serve`` and ``demo`` run without
    ``trio_pd.testing`` (the demo's harness is the package's own:
    ``_harness._prefill_worker`` and the modules next to it; see the next test for
    what the commands import later, inside functions)."""
    names = ("_cli", "_cli.engine", "_cli.proxy", "_cli.serve", "_cli.demo", "_serve.process")
    harness = tuple(
        f"_harness.{name}"
        for name in (
            "_prefill_worker",
            "_prefill_child",
            "_prefill_spec",
            "_delay_relay",
            "_child_process",
            "_raw_nixl",
            "_stall_monitor",
            "_seeded_blocks",
        )
    )
    modules = ", ".join(f"trio_pd.{name}" for name in (*names, *harness))
    check = (
        f"import sys, {modules}; "
        "loaded = [m for m in sys.modules if m.startswith('trio_pd.testing')]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", check], check=True, env=ENV)


def test_the_proxy_and_serve_start_without_importing_torch() -> None:
    """``trio-pd proxy`` and ``trio-pd serve`` never compute on tensors: their
    modules (and the engine command's, which the parser reads for its flags)
    leave torch to the engine processes (``_serve.model`` imports it where a
    model computes), so they start about 1.5 s sooner."""
    check = (
        "import sys, trio_pd._cli, trio_pd._cli.proxy, trio_pd._cli.serve; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", check], check=True, env=ENV)


SRC = Path(__file__).resolve().parents[1] / "src"


async def test_an_engine_id_that_a_live_engine_holds_exits_2_in_one_line(tmp_path: Path) -> None:
    from trio_pd._membership import Member, register, signing_key
    from trio_pd.testing import open_etcd

    key = "an-internal-key-for-this-test-0123456789"
    held = Member(
        "decode", "decode-7", "http://127.0.0.1:8107", "127.0.0.1:5607", incarnation="live"
    )
    ready = tmp_path / "ready.json"
    env = {**ENV, "TRIO_PD_INTERNAL_KEY": key, "TRIO_PD_EXPOSURE_SECRET": SECRET}
    with trio.fail_after(60):
        async with (
            open_etcd() as etcd,
            register(etcd.url, held, ttl=5, signing_key=signing_key(key)),
        ):
            command = ["engine", "--role", "decode", "--engine-id", "decode-7", "--etcd", etcd.url]
            result = await trio.run_process(
                [*TRIO_PD, *command, "--ready-file", str(ready)],
                check=False,
                env=env,
                capture_stderr=True,
            )
    assert result.returncode == 2
    assert one_line_error(result.stderr.decode()) == (
        "trio-pd engine decode-7: could not start: engine id 'decode-7' is held by a live "
        "engine (http://127.0.0.1:8107, incarnation 'live'); it is free once that engine leaves"
    )
    assert not ready.exists()


async def test_the_proxy_reaches_an_etcd_with_tls_and_authentication_or_says_why(
    tmp_path: Path,
) -> None:
    from trio_pd.testing import open_etcd

    password = "etcd-root-password-0123"
    (tmp_path / "wrong").write_text("not-the-password\n")
    ready = tmp_path / "proxy.json"
    with trio.fail_after(60):
        async with open_etcd(tls=True, password=password) as etcd:
            proxy = ["proxy", "--port", "0", "--etcd", etcd.url, "--etcd-user", "root"]
            env = {**ENV, "TRIO_PD_INTERNAL_KEY": INTERNAL_KEY, "TRIO_PD_ETCD_PASSWORD": password}
            for flags, words in [
                (["--etcd-ca-file", etcd.ca_file, "--etcd-password-file", str(tmp_path / "wrong")],
                 "rejected: etcdserver: authentication failed, invalid user ID or password"),
                ([], "unreachable: TLS: unable to get local issuer certificate"),
            ]:  # fmt: skip
                result = await trio.run_process(
                    [*TRIO_PD, *proxy, *flags], check=False, env=env, capture_stderr=True
                )
                assert result.returncode == 1
                line = one_line_error(result.stderr.decode())
                assert line.startswith(
                    f"trio-pd proxy: could not start: membership: etcd at {etcd.url}/"
                ), line
                assert line.endswith(words) or words in line, line
            engine = ["engine", "--role", "decode", "--engine-id", "decode-9", "--etcd", etcd.url]
            result = await trio.run_process(
                [
                    *TRIO_PD,
                    *engine,
                    "--etcd-ca-file",
                    etcd.ca_file,
                    "--etcd-user",
                    "root",
                    "--etcd-password-file",
                    str(tmp_path / "wrong"),
                ],
                check=False,
                env=env,
                capture_stderr=True,
            )
            assert result.returncode == 1
            assert one_line_error(result.stderr.decode()) == (
                "trio-pd engine decode-9: could not start: MembershipError: etcd at "
                f"{etcd.url}/v3/auth/authenticate: rejected: etcdserver: authentication failed, "
                "invalid user ID or password (HTTP 400)"
            )
            async with running(([*proxy, "--etcd-ca-file", etcd.ca_file], ready), env=env) as [
                (process, ready_file)
            ]:
                async with http_client(10) as client:
                    health = await client.get(f"{ready_file['url']}/health")
                assert "status" in health.json()  # (it serves, watching etcd: no engines yet)
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0


def test_serves_scratch_left_by_a_killed_serve_is_removed_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (issue 30, fault 7: after SIGKILL of serve its CURVE secret keys stayed)
    import tempfile

    from trio_pd._cli import serve as serve_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    child = subprocess.Popen(["true"])  # (a PID that ran and ended)
    child.wait()
    dead = tmp_path / f"trio-pd-serve-{child.pid}-abc"
    alive = tmp_path / f"trio-pd-serve-{os.getpid()}-def"
    other = tmp_path / "trio-pd-serve-notes"
    for folder in (dead, alive, other):
        folder.mkdir()
    (dead / "decode-0.curve.json").write_text('{"secret_key": "x"}')
    (alive / "decode-0.curve.json").write_text('{"secret_key": "y"}')
    serve_module.remove_stale_scratch()
    assert not dead.exists()
    assert alive.exists()
    assert other.exists()


def test_the_engine_command_freezes_its_heap_once_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``trio-pd engine`` asks :func:`serve_engine` to freeze the start-up heap
    (a full collection of an engine's heap took 79-95 ms); the function itself
    does not unless asked (a test's process goes on with other work)."""
    import inspect

    import trio_pd._cli.engine as engine_command

    asked: list[dict[str, object]] = []

    async def fake_serve(*args: object, **kwargs: object) -> None:
        asked.append(kwargs)
        await trio.lowlevel.checkpoint()

    monkeypatch.setattr(engine_command, "serve_engine", fake_serve)
    (tmp_path / "key").write_text("k" * 32)
    with pytest.raises(SystemExit) as exited:
        main(["engine", "--role", "prefill", "--internal-key-file", str(tmp_path / "key")])
    assert exited.value.code == 0
    assert [kwargs.get("freeze_heap") for kwargs in asked] == [True]
    assert inspect.signature(serve_engine).parameters["freeze_heap"].default is False
