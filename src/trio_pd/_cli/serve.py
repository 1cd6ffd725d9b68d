"""``trio-pd serve``: a one-host deployment, built from ``trio-pd engine`` and the proxy.

Each engine is a ``trio-pd engine`` command in a session of its own (so
Ctrl-C in a terminal reaches only this process); the proxy is
:func:`~trio_pd._cli.proxy.serve_proxy`, in this process. The command's
nursery owns them all. The proxy starts once every engine wrote its ready
file, which an engine does only once it accepts requests; if an engine
exits first, the others are stopped and the command fails, naming it.

SIGINT or SIGTERM drains in order: the proxy stops accepting and finishes
its requests in flight (at most ``--grace`` s), then every engine gets
SIGTERM and drains the same way (``--grace`` is passed to it), closing its
connectors last; one still running ``--grace`` + 5 s later is killed.
During start-up a signal abandons the start (nothing is served).

``--dispatch decode-first`` starts no proxy: the prefill engines start
first, then each decode engine as a decode-first engine (``trio-pd engine
--prefill-url``, one for every prefill engine; the client keys in its
environment), and clients call the decode engines (the ready file's
``"clients"``). The drain: the decode engines first (their requests in
flight still prefill, and read exposures, on the prefill engines), then the
prefill engines (each waits, within ``--grace``, until what it exposed was
read or given up).

``--hosts N`` (root) shows the cluster shape on one machine: the engines
run on N test hosts (network namespaces joined by veth links, routed to each
other through this one, see :mod:`trio_pd._harness._netns`), engine ``k`` on host
``k mod N`` (prefill engines first), each bound to its host's address; an
etcd runs on one more test host of its own (reachable through the links
only, as on a cluster network; HTTPS with a CA made for the run, and its
authentication on); every engine registers on it and the proxy
(here) routes to what it finds there,
as ``trio-pd engine --etcd`` and ``trio-pd proxy --etcd`` do across
machines. The hosts and etcd outlive the engines' drain and are removed
last.

An engine that fails while serving (exits non-zero) fails only its own
requests; the deployment goes on with the others while both roles have one.
The exit status is 0 when nothing failed, 1 when an engine failed (at start,
while serving, or in its drain) or the proxy could not start, 2 for bad
arguments.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import attrs
import trio
from rich.console import Console
from rich.table import Table

from trio_pd._cli.common import DECODE_FIRST, ETCD_PASSWORD_ENV
from trio_pd._cli.engine_processes import (
    EngineBoard,
    EngineProcess,
    notify_when,
    run_engine_process,
)
from trio_pd._cli.proxy import ProxyOptions, ProxyStartError, serve_proxy
from trio_pd._curve_keys import generate_keypair
from trio_pd._exception_groups import unwrapped_errors
from trio_pd._harness._etcd_server import EtcdServer, EtcdUnavailable, open_etcd
from trio_pd._harness._netns import TestHost, TestHostsUnavailable, open_test_hosts
from trio_pd._serve import defaults
from trio_pd._serve.binding import (
    SEND_TIMEOUT,
    BindError,
    bind_listener,
    check_send_timeout,
    is_wildcard,
    remove_file,
    write_json_atomically,
)
from trio_pd._serve.discovery import EngineSet, EtcdMembership, Membership
from trio_pd._serve.engine import EXPOSURE_SECRET_ENV
from trio_pd._serve.keys import API_KEY_ENV, INTERNAL_KEY_ENV, BearerKeys
from trio_pd._serve.model import ModelConfig
from trio_pd._serve.openai import MAX_MODEL_LEN
from trio_pd._serve.proxy import DISPATCH, DISPATCHES
from trio_pd._serve.stopping import StopRequest, stop_requests


class ServeError(Exception):
    """The deployment failed: the message names each engine that failed, and how."""


@attrs.frozen
class ServeOptions:
    """What ``trio-pd serve`` runs (its command-line options)."""

    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = "127.0.0.1"
    advertise_host: str = ""  # (default: host; 127.0.0.1 when host is a wildcard)
    port: int = 8000
    ready_file: str = ""
    grace: float = defaults.GRACE
    send_timeout: float = SEND_TIMEOUT  # (the proxy's and every engine's)
    lease_initial: float = defaults.LEASE_INITIAL  # (every engine's; the proxy reads it)
    admission_timeout: float = defaults.ADMISSION_TIMEOUT  # (every engine's)
    num_blocks: int = 1024
    start_timeout: float = 120.0
    hosts: int = 0  # (> 0: the engines on that many test hosts, found through etcd)
    etcd_ttl: float = 10.0  # (with hosts: each engine's lease)
    api_keys: BearerKeys | None = None  # (the proxy's client keys; None: open)
    curve: bool = True  # (CURVE on the engines' side channels, keys made per run)
    prefill_channel: bool = True  # (False: prefill requests over HTTP only)
    dispatch: str = DISPATCH  # (the proxy's: when it sends a decode request; or DECODE_FIRST)
    # The engines' internal key (--internal-key-file or $TRIO_PD_INTERNAL_KEY;
    # by default one made for this run).
    internal_key: str = attrs.field(factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def decode_first(self) -> bool:
        """No proxy: clients call the decode engines, decode-first."""
        return self.dispatch == DECODE_FIRST

    def decode_port(self, index: int) -> int:
        """Decode engine ``index``'s HTTP port: 0 (any free one) but with
        decode-first and a ``--port``, ``--port`` + ``index``."""
        return self.port + index if self.decode_first and self.port else 0

    def max_model_len(self) -> int:
        """What every engine can hold: the model's context, or the pool if smaller."""
        return min(MAX_MODEL_LEN, self.num_blocks * ModelConfig().block_size)

    def advertised(self) -> str:
        """The address the engines and the proxy are dialled at."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if is_wildcard(self.host) else self.host

    def check(self) -> None:
        """Raises ValueError naming the flag that is wrong."""
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode need at least one engine each")
        if not self.grace > 0:  # (NaN too)
            raise ValueError("--grace must be > 0")
        check_send_timeout(self.send_timeout)
        defaults.check_lease(self.lease_initial, defaults.CONNECT_TIMEOUT, defaults.HOLD_MARGIN)
        defaults.check_admission(self.admission_timeout, defaults.ABORT_TIMEOUT)
        if self.num_blocks < 1:
            raise ValueError(f"--num-blocks must be at least 1 (got {self.num_blocks})")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a port")
        if self.dispatch not in (*DISPATCHES, DECODE_FIRST):
            raise ValueError(
                f"--dispatch {self.dispatch!r} is none of sequential, concurrent, {DECODE_FIRST}"
            )
        if self.decode_first and self.hosts:
            raise ValueError(
                f"--dispatch {DECODE_FIRST} and --hosts: not together (decode-first engines "
                "do not follow etcd yet)"
            )
        if self.decode_port(self.decode - 1) > 65535:
            raise ValueError(
                f"--port {self.port}: the {self.decode} decode engines (decode-first) would "
                "need ports past 65535"
            )
        if not 0 <= self.hosts <= 254:  # (and one more host runs etcd)
            raise ValueError(f"--hosts must be in [0, 254] (got {self.hosts})")
        if not self.etcd_ttl > 0:
            raise ValueError("--etcd-ttl must be > 0")
        if self.api_keys is not None and self.api_keys.accepts(self.internal_key):
            raise ValueError("a client key (--api-key) must not be the engines' internal key")
        if is_wildcard(self.advertised()):
            raise ValueError("--advertise-host must be an address clients can dial")
        heads = ModelConfig().kv_heads
        for flag, tp in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)):
            if tp < 1 or heads % tp:
                raise ValueError(f"{flag} {tp} must divide the model's {heads} KV heads")


async def run_serve(options: ServeOptions, console: Console) -> None:
    """Run the deployment until SIGINT or SIGTERM (or until a role has no
    engine left), then drain it.

    Raises:
        ServeError: an engine failed (at start, while serving or in its drain),
            or the proxy could not start (decode-first: a decode engine's
            address is not ours, or in use); one line.
    """
    env = {
        # (the client keys are the proxy's, or the decode-first engines': see
        # _deploy_decode_first; the prefill engines never take them)
        **{k: v for k, v in os.environ.items() if k != API_KEY_ENV},
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        # This deployment's exposure secret, shared by its engines.
        EXPOSURE_SECRET_ENV: secrets.token_bytes(32).hex(),
        # Its internal key: the engines answer /v1/* only to the proxy (decode-first:
        # the prefill engines only to the decode engines, which send it).
        INTERNAL_KEY_ENV: options.internal_key,
    }
    if is_wildcard(options.host) and not options.advertise_host:
        console.print(
            f"note: --host {options.host} binds every interface; the servers "
            "are dialled at 127.0.0.1 (--advertise-host names another address)"
        )
    stop = StopRequest("trio-pd serve", console.print)
    remove_file(options.ready_file)
    if options.decode_first:
        _check_decode_addresses(options)
        sock = None
    else:
        try:
            # The proxy's address first: one that is not ours, or in use, fails
            # at once (and the port stays reserved while the engines start).
            sock = bind_listener(options.host, options.port, send_timeout=options.send_timeout)
        except BindError as exc:
            raise ServeError(f"the proxy: {exc}") from None
    with sock if sock is not None else nullcontext():
        async with unwrapped_errors(), stop_requests(stop, None):
            if not options.hosts:
                await _deploy(options, sock, env, stop, console, [], None)
                return
            try:
                async with AsyncExitStack() as stack:
                    # The hosts, and etcd on a host of its own (reachable through
                    # the links only, as on a cluster network); a stop request
                    # abandons this set-up at once.
                    with _cancelled_by(stop) as setting_up:
                        hosts = await stack.enter_async_context(
                            open_test_hosts(options.hosts + 1, routed=True)
                        )
                        *hosts, etcd_host = hosts
                        # (as operators run it: HTTPS with a CA of this run, and users)
                        env[ETCD_PASSWORD_ENV] = secrets.token_urlsafe(24)
                        etcd = await stack.enter_async_context(
                            open_etcd(
                                addresses=[etcd_host.address],
                                netns=etcd_host.netns,
                                tls=True,
                                password=env[ETCD_PASSWORD_ENV],
                            )
                        )
                    if setting_up.cancelled_caught or stop.requested.is_set():
                        return
                    console.print(
                        f"{len(hosts)} test hosts ({', '.join(h.address for h in hosts)}), "
                        f"etcd at {etcd.url} (a host of its own)"
                    )
                    await _deploy(options, sock, env, stop, console, hosts, etcd)
            except (TestHostsUnavailable, EtcdUnavailable) as exc:
                raise ServeError(f"--hosts: {exc}") from None


def _check_decode_addresses(options: ServeOptions) -> None:
    """Decode-first: each decode engine's address (the clients'), bound and
    let go, so that one that is not ours, or a port in use, fails before any
    engine starts (the engine binds it itself a moment later).

    Raises:
        ServeError: naming the engine.
    """
    for index in range(options.decode if options.port else 1):
        port = options.decode_port(index)
        try:
            bind_listener(options.host, port, send_timeout=options.send_timeout).close()
        except BindError as exc:
            raise ServeError(f"decode-{index}: {exc}") from None


@contextmanager
def _cancelled_by(stop: StopRequest) -> Iterator[trio.CancelScope]:
    """A cancel scope that ``stop`` cancels (its ``starting`` scope is the
    deployment's own, and a scope is entered once)."""
    with trio.CancelScope() as scope:
        stop.also_cancel(scope)
        try:
            yield scope
        finally:
            stop.also_cancel(None)


async def _deploy(
    options: ServeOptions,
    sock: socket.socket | None,
    env: dict[str, str],
    stop: StopRequest,
    console: Console,
    hosts: list[TestHost],
    etcd: EtcdServer | None,
) -> None:
    """Start the engines (on ``hosts`` when given, registered on ``etcd``), then
    the proxy on ``sock`` (decode-first: no proxy, no ``sock``; the decode
    engines once the prefill engines serve); serve until ``stop``; drain.
    Raises ServeError (see :func:`run_serve`)."""
    failures: list[str] = []
    remove_stale_scratch()
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as scratch:
        curve = _write_curve_keys(Path(scratch), options) if options.curve else {}
        board = EngineBoard(
            [
                EngineProcess(
                    role,
                    i,
                    str(Path(scratch) / f"{role}-{i}.json"),
                    hosts[k % len(hosts)] if hosts else None,
                )
                for k, (role, i) in enumerate(_roles(options))
            ]
        )
        try:
            if options.decode_first:
                await _deploy_decode_first(options, board, env, stop, failures, console, curve)
            else:
                assert sock is not None
                await _deploy_behind_proxy(
                    options, sock, board, env, stop, failures, console, etcd, curve
                )
        finally:
            remove_file(options.ready_file)
    failures += [failure for engine in board.engines if (failure := engine.failure())]
    console.print("[bold]stopped[/]")
    if failures:
        raise ServeError("; ".join(dict.fromkeys(failures)))


async def _deploy_behind_proxy(
    options: ServeOptions,
    sock: socket.socket,
    board: EngineBoard,
    env: dict[str, str],
    stop: StopRequest,
    failures: list[str],
    console: Console,
    etcd: EtcdServer | None,
    curve: dict[str, list[str]],
) -> None:
    """Every engine at once, then the proxy once they all serve; serve until
    ``stop``; drain the proxy, then every engine."""
    async with trio.open_nursery() as engines:
        engines.start_soon(notify_when, stop.requested.wait, board.notify)
        for engine in board.engines:
            command = _engine_command(options, engine, etcd, curve)
            _start_engine(engines, options, engine, command, env, board, console)
        console.print(f"starting {len(board.engines)} engines")
        with stop.starting:
            with trio.move_on_after(options.start_timeout) as waiting:
                failures += await _wait_for_engines(board, board.engines)
            if waiting.cancelled_caught:
                late = ", ".join(e.name for e in board.engines if not e.url)
                failures.append(f"{late} did not start within {options.start_timeout:g} s")
            if not failures:
                membership = (
                    EtcdMembership(
                        etcd.url,
                        ttl=options.etcd_ttl,
                        internal_key=options.internal_key,
                        ca_file=etcd.ca_file,
                        user=etcd.user,
                        password=etcd.password,
                    )
                    if etcd
                    else None
                )
                await _serve_proxy(options, sock, board, stop, failures, console, membership)
        console.print("draining the engines")
        _stop_engines(engines, board.engines)


async def _deploy_decode_first(
    options: ServeOptions,
    board: EngineBoard,
    env: dict[str, str],
    stop: StopRequest,
    failures: list[str],
    console: Console,
    curve: dict[str, list[str]],
) -> None:
    """The prefill engines, then (once they all serve) the decode engines,
    decode-first in front of them; serve until ``stop``; drain the decode
    engines, then the prefill engines: a decode engine's requests in flight
    still prefill, and read the blocks exposed for them, on the prefill engines."""
    prefill = [e for e in board.engines if e.role == "prefill"]
    decode = [e for e in board.engines if e.role == "decode"]
    decode_env = {**env}
    if options.api_keys is not None:  # (the environment: flags show in ps)
        decode_env[API_KEY_ENV] = options.api_keys.joined()
    deadline = trio.current_time() + options.start_timeout
    async with trio.open_nursery() as prefilling:
        prefilling.start_soon(notify_when, stop.requested.wait, board.notify)
        for engine in prefill:
            command = _engine_command(options, engine, None, curve)
            _start_engine(prefilling, options, engine, command, env, board, console)
        console.print(f"starting {len(prefill)} prefill engines")
        async with trio.open_nursery() as decoding:
            waited = prefill  # (the engines being waited for)
            with stop.starting:
                with trio.move_on_at(deadline) as waiting:
                    failures += await _wait_for_engines(board, prefill)
                    if not failures:
                        urls = list(board.urls("prefill"))
                        waited = decode
                        for engine in decode:
                            command = _engine_command(options, engine, None, curve, urls)
                            _start_engine(
                                decoding, options, engine, command, decode_env, board, console
                            )
                        console.print(f"starting {len(decode)} decode-first engines")
                        failures += await _wait_for_engines(board, decode)
                        # (a prefill engine that exited meanwhile fails the start too)
                        failures += [failure for e in prefill if (failure := e.failure())]
                if waiting.cancelled_caught:
                    late = ", ".join(e.name for e in waited if not e.url)
                    failures.append(f"{late} did not start within {options.start_timeout:g} s")
                if not failures:
                    await _serve_decode_first(options, board, stop, console)
            if waited is decode:
                console.print("draining the decode engines")
            _stop_engines(decoding, decode)
        console.print("draining the prefill engines")
        _stop_engines(prefilling, prefill)


def _start_engine(
    nursery: trio.Nursery,
    options: ServeOptions,
    engine: EngineProcess,
    command: list[str],
    env: dict[str, str],
    board: EngineBoard,
    console: Console,
) -> None:
    nursery.start_soon(run_engine_process, engine, command, env, options.grace, board, console)


def _stop_engines(nursery: trio.Nursery, engines: list[EngineProcess]) -> None:
    """SIGTERM to each of ``engines`` still running (see run_engine_process):
    the ``nursery`` that runs them is cancelled."""
    for engine in engines:
        engine.stopping = engine.status is None
    nursery.cancel_scope.cancel()


async def _wait_for_engines(board: EngineBoard, engines: list[EngineProcess]) -> list[str]:
    """Until each of ``engines`` accepts requests (``[]``) or one exited: why
    each that exited failed."""
    await board.wait_until(lambda: all(e.url or e.status is not None for e in engines))
    return [failure for e in engines if (failure := e.failure())]


async def _serve_decode_first(
    options: ServeOptions, board: EngineBoard, stop: StopRequest, console: Console
) -> None:
    """Announce the decode engines to clients, and serve until ``stop`` or
    until a role has no engine left."""
    decode = list(board.urls("decode"))
    ready = {
        "dispatch": DECODE_FIRST,
        "clients": decode,  # (what clients call: the decode engines)
        "proxy": None,  # (none)
        "prefill": list(board.urls("prefill")),
        "decode": decode,
    }
    if options.ready_file:
        write_json_atomically(options.ready_file, ready)
    console.print(_endpoints_table(ready))  # (without client keys each engine warned)
    console.print(
        "[bold green]serving[/]: clients call the decode engines; Ctrl-C or SIGTERM "
        "drains and stops"
    )
    stop.ready = True
    await _until_stopped(board, stop, console)


async def _until_stopped(board: EngineBoard, stop: StopRequest, console: Console) -> None:
    """Until ``stop``, or until a role has no engine left (said on ``console``)."""
    await board.wait_until(
        lambda: (
            stop.requested.is_set() or not (board.serving("prefill") and board.serving("decode"))
        )
    )
    if not stop.requested.is_set():
        console.print("[red]a role has no engine left: stopping[/]")


async def _serve_proxy(
    options: ServeOptions,
    sock: socket.socket,
    board: EngineBoard,
    stop: StopRequest,
    failures: list[str],
    console: Console,
    membership: Membership | None,
) -> None:
    """Serve the proxy while every role has an engine, until ``stop``; drain it.
    It routes to the engines on ``board``, or to what ``membership`` reports."""
    proxy_options = ProxyOptions(
        host=options.host,
        port=options.port,
        advertise_host=options.advertised(),
        grace=options.grace,
        send_timeout=options.send_timeout,
        max_model_len=options.max_model_len(),
        api_keys=options.api_keys,
        internal_key=options.internal_key,
        dispatch=options.dispatch,
    )
    engines = EngineSet(board.urls("prefill"), board.urls("decode"))
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        try:
            url = await nursery.start(
                functools.partial(
                    serve_proxy,
                    proxy_options,
                    None if membership else engines,
                    done.wait,
                    membership=membership,
                    sock=sock,
                    freeze_heap=True,  # (serve's own process: the proxy's)
                )
            )
        except ProxyStartError as exc:
            failures.append(f"the proxy could not start: {exc}")
        else:
            ready = {
                "dispatch": options.dispatch,
                "clients": [url],  # (what clients call: the proxy)
                "proxy": url,
                "prefill": list(engines.prefill),
                "decode": list(engines.decode),
            }
            if options.ready_file:
                write_json_atomically(options.ready_file, ready)
            console.print(_endpoints_table(ready))
            console.print("[bold green]serving[/]: Ctrl-C or SIGTERM drains and stops")
            stop.ready = True
            await _until_stopped(board, stop, console)
            console.print("draining the proxy")
            done.set()
            # Leaving the nursery waits for the proxy to drain.
    if stop.ready:
        console.print("the proxy drained")


def _roles(options: ServeOptions) -> list[tuple[str, int]]:
    return [("prefill", i) for i in range(options.prefill)] + [
        ("decode", i) for i in range(options.decode)
    ]


SCRATCH_PREFIX = "trio-pd-serve-"
"""``serve``'s scratch directory (mode 0700, in the temp dir), named
``trio-pd-serve-PID-*``: the engines' CURVE key files. Removed on exit; one
left by a ``serve`` that was killed (SIGKILL) is removed at the next start."""


def remove_stale_scratch() -> None:
    """Remove the scratch directories of this user's ``serve`` commands that
    are gone (their PID runs no process), and the key files in them."""
    root = Path(tempfile.gettempdir())
    for directory in root.glob(f"{SCRATCH_PREFIX}*"):
        pid = directory.name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
        try:
            if directory.is_symlink() or directory.stat().st_uid != os.getuid():
                continue
            if pid.isdigit():
                try:
                    os.kill(int(pid), 0)
                    continue  # (that serve still runs)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    continue
            elif not any(directory.glob("*.curve.json")):
                continue  # (not one of ours)
            else:
                # (from before PIDs were in the name: only if no process has it open)
                if time.time() - directory.stat().st_mtime < STALE_UNNAMED:
                    continue
            shutil.rmtree(directory, ignore_errors=True)
        except OSError:
            continue


STALE_UNNAMED = 24 * 3600.0
"""Seconds after which a scratch directory without a PID in its name is stale."""


def _write_curve_keys(directory: Path, options: ServeOptions) -> dict[str, list[str]]:
    """A CURVE key pair per engine, each in a file of its own (mode 0600, in
    ``directory``), and one file of the public keys that every engine reads:
    the prefill engines let the decode engines in, the decode engines expect
    each prefill engine's key. Returns each engine's ``trio-pd engine`` flags
    by name."""
    pairs = {f"{role}-{i}": generate_keypair() for role, i in _roles(options)}
    peers = {
        "consumers": [public for name, (public, _) in pairs.items() if name.startswith("decode")],
        "producers": {n: public for n, (public, _) in pairs.items() if n.startswith("prefill")},
    }
    peers_file = directory / "curve-peers.json"
    peers_file.write_text(json.dumps(peers))
    flags = {}
    for name, (public, secret) in pairs.items():
        key_file = directory / f"{name}.curve.json"
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            json.dump({"public_key": public, "secret_key": secret}, out)
        flags[name] = [f"--curve-key-file={key_file}", f"--curve-peers-file={peers_file}"]
    return flags


def _engine_command(
    options: ServeOptions,
    engine: EngineProcess,
    etcd: EtcdServer | None,
    curve_files: dict[str, list[str]],
    prefill_urls: list[str] | None = None,
) -> list[str]:
    """The ``trio-pd engine`` command line that runs ``engine`` (in its test
    host's namespace, registered on ``etcd``, when it has one; with its CURVE
    key files, when ``curve_files`` has them; decode-first, in front of
    ``prefill_urls``, when given)."""
    tp = options.prefill_tp if engine.role == "prefill" else options.decode_tp
    host = engine.host.address if engine.host else options.host
    flags: dict[str, object] = {
        "--role": engine.role,
        "--engine-id": engine.name,
        "--tp": tp,
        "--host": host,
        "--advertise-host": host if engine.host else options.advertised(),
        "--port": options.decode_port(engine.index) if engine.role == "decode" else 0,
        "--num-blocks": options.num_blocks,
        "--max-model-len": options.max_model_len(),
        "--grace": options.grace,
        "--send-timeout": options.send_timeout,
        "--lease-initial": options.lease_initial,
        "--admission-timeout": options.admission_timeout,
        "--ready-file": engine.ready_file,
        "--parent-pid": os.getpid(),  # (it drains if this command dies)
    }
    if engine.host is not None and etcd is not None:
        flags["--etcd"] = etcd.url
        flags["--etcd-ttl"] = options.etcd_ttl
        if etcd.ca_file:
            flags["--etcd-ca-file"] = etcd.ca_file
        if etcd.user:  # (its password in the environment)
            flags["--etcd-user"] = etcd.user
    command = [sys.executable, "-m", "trio_pd", "engine", *(f"{k}={v}" for k, v in flags.items())]
    command += [f"--prefill-url={url}" for url in prefill_urls or ()]
    command += curve_files.get(engine.name, []) if options.curve else ["--no-curve"]
    command += [] if options.prefill_channel else ["--no-prefill-channel"]
    if engine.host is not None:
        # (ip execs the command: the engine is this command's child, and its signals reach it)
        return ["ip", "netns", "exec", engine.host.netns, *command]
    return command


def _endpoints_table(ready: dict[str, Any]) -> Table:
    """The servers of the ready file, those that clients call marked."""
    table = Table(title=f"trio-pd serve (--dispatch {ready['dispatch']})")
    table.add_column("role")
    table.add_column("URL")
    table.add_column("clients call")
    rows = [("proxy", ready["proxy"])] if ready["proxy"] else []
    rows += [(role, url) for role in ("prefill", "decode") for url in ready[role]]
    for role, url in rows:
        name = "decode-first" if role == "decode" and ready["dispatch"] == DECODE_FIRST else role
        table.add_row(name, url, "yes" if url in ready["clients"] else "")
    return table
