"""``trio-pd proxy``: the P/D proxy in front of engines that run elsewhere.

The engines are static (``--prefill URL... --decode URL...``) or, once
wired, what a :class:`~trio_pd._serve.discovery.Membership` reports
(``--etcd``). ``trio-pd serve`` runs the same :func:`serve_proxy` in its
own process.

Exit status: 0 after a drain, 1 when the proxy could not start, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import httpx2
import trio

from trio_pd._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    add_address_arguments,
    add_dispatch_argument,
    add_etcd_arguments,
    add_internal_key_argument,
    add_send_timeout_argument,
    client_keys,
    internal_key,
    membership_from_args,
)
from trio_pd._exception_groups import unwrapped_errors
from trio_pd._membership import MembershipError
from trio_pd._serve import defaults
from trio_pd._serve.asgi import response_completes
from trio_pd._serve.binding import (
    SEND_TIMEOUT,
    BindError,
    base_url,
    bind_listener,
    check_send_timeout,
    hypercorn_bind,
    is_wildcard,
    remove_file,
    write_json_atomically,
)
from trio_pd._serve.defaults import MAX_ATTEMPTS
from trio_pd._serve.discovery import EngineSet, Membership
from trio_pd._serve.heap import freeze_start_up_heap
from trio_pd._serve.keys import API_KEY_ENV, BearerKeys
from trio_pd._serve.openai import MAX_MODEL_LEN
from trio_pd._serve.proxy import (
    BODY_TIMEOUT,
    DISPATCH,
    MAX_CLIENT_REQUESTS,
    Proxy,
    ProxyTimeouts,
    check_dispatch,
    open_client,
)
from trio_pd._serve.routing import url_problem
from trio_pd._serve.stopping import StopRequest, stop_requests


class ProxyStartError(Exception):
    """The proxy could not start (one line: why)."""


@attrs.frozen
class ProxyOptions:
    """Where the proxy listens, and how it drains."""

    host: str = "127.0.0.1"
    port: int = 8000
    advertise_host: str = ""  # the address in its URL (default: host)
    grace: float = defaults.GRACE
    send_timeout: float = SEND_TIMEOUT  # (a client that stopped reading: reset, then cancelled)
    max_model_len: int | None = None  # (None: the engines judge each request)
    timeouts: ProxyTimeouts = attrs.Factory(ProxyTimeouts)
    api_keys: BearerKeys | None = None  # (None: /v1/* open to anyone who connects)
    internal_key: str | None = attrs.field(default=None, repr=False)  # (sent to the engines)
    max_attempts: int = MAX_ATTEMPTS  # (engines of a role one request tries)
    body_timeout: float = BODY_TIMEOUT  # (a request's body, then 408)
    max_client_requests: int = MAX_CLIENT_REQUESTS  # (open at once per client address)
    dispatch: str = DISPATCH  # (when a decode request is sent: sequential or concurrent)

    def check(self) -> None:
        """Raises ValueError naming the flag that is wrong."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a port")
        if not self.grace > 0:  # (NaN too)
            raise ValueError("--grace must be > 0")
        check_send_timeout(self.send_timeout)
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be at least 1")
        if not (self.body_timeout > 0 and math.isfinite(self.body_timeout)):
            raise ValueError("--body-timeout must be > 0")
        if self.max_client_requests < 0:
            raise ValueError("--max-client-requests must be at least 0 (0: no cap)")
        if self.max_model_len is not None and not 1 <= self.max_model_len <= MAX_MODEL_LEN:
            raise ValueError(f"--max-model-len must be in [1, {MAX_MODEL_LEN}]")
        for flag, seconds in _timeout_flags(self.timeouts).items():
            if not seconds > 0:  # (NaN too)
                raise ValueError(f"{flag} must be > 0")
        check_dispatch(self.dispatch, self.timeouts, self.max_attempts)
        if is_wildcard(self.advertise_host or self.host):
            raise ValueError(
                f"--host {self.host!r} binds every interface: pass --advertise-host "
                "<the address clients dial> (it names the proxy in its ready file)"
            )


async def serve_proxy(
    options: ProxyOptions,
    engines: EngineSet | None,
    shutdown: Callable[[], Awaitable[None]],
    *,
    membership: Membership | None = None,
    sock: socket.socket | None = None,
    freeze_heap: bool = False,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the proxy until ``shutdown()`` returns, then drain it (at most ``options.grace`` s).

    The engines are ``engines``, or -- with ``membership`` -- the ones it
    reports, as they change. ``sock``: a socket bound already (from
    :func:`~trio_pd._serve.binding.bind_listener` with ``options.send_timeout``;
    closed on return) instead
    of binding ``options.host:options.port``. ``task_status.started(url)``
    once it accepts requests (``url``: the advertised address); just before,
    with ``freeze_heap`` (a process of its own: ``trio-pd proxy``, ``trio-pd
    serve``), :func:`~trio_pd._serve.heap.freeze_start_up_heap`.

    Raises:
        ProxyStartError: its address cannot be bound, or it has no engines.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    if sock is None:
        try:
            sock = bind_listener(options.host, options.port, send_timeout=options.send_timeout)
        except BindError as exc:
            raise ProxyStartError(str(exc)) from None
    url = base_url(options.advertise_host or options.host, sock.getsockname()[1])
    config = Config()
    config.bind = [hypercorn_bind(sock)]
    config.graceful_timeout = options.grace
    config.accesslog = None
    config.loglevel = "WARNING"
    config.keep_alive_timeout = defaults.SERVER_KEEP_ALIVE  # (clients close theirs sooner)
    with sock:
        async with (
            unwrapped_errors(),
            open_client(options.timeouts) as client,
            trio.open_nursery() as watching,
        ):
            router = _Router(client, options)
            if membership is not None:
                from trio_pd._membership import MembershipError

                try:
                    engines = await watching.start(membership.watch_engines, router.proxy.follow)
                except (MembershipError, ValueError) as exc:
                    raise ProxyStartError(f"membership: {exc}") from None
            assert engines is not None
            if membership is None and (not engines.prefill or not engines.decode):
                raise ProxyStartError(f"no engines to serve: {engines}")
            router.proxy.follow(engines)
            app: Any = router.app
            async with trio.open_nursery() as serving:
                await serving.start(
                    functools.partial(serve, app, config, shutdown_trigger=shutdown)
                )
                sock.close()  # (hypercorn serves on its duplicate)
                if freeze_heap:
                    freeze_start_up_heap()
                task_status.started(url)
                await shutdown()
                router.proxy.accepting = False
                # Leaving the nursery waits for hypercorn to drain.
            watching.cancel_scope.cancel()


class _Router:
    """One :class:`Proxy` whose engines follow the membership's updates."""

    def __init__(self, client: httpx2.AsyncClient, options: ProxyOptions) -> None:
        self.proxy = Proxy(
            [],
            [],
            client,
            max_model_len=options.max_model_len,
            timeouts=options.timeouts,
            send_timeout=options.send_timeout,
            api_keys=options.api_keys,
            internal_key=options.internal_key,
            max_attempts=options.max_attempts,
            body_timeout=options.body_timeout,
            max_client_requests=options.max_client_requests,
            dispatch=options.dispatch,
        )
        self.app = response_completes(self.proxy.app())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ProxyOptions()
    add_address_arguments(
        parser,
        host=defaults.host,
        binds="bind address",
        advertise="the address in the ready file's URL (default: --host; required with a wildcard)",
        port=defaults.port,
        port_help="the proxy's port (0: any free port)",
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="the prefill engines' base URLs (repeatable); required unless --etcd is given",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        default=[],
        metavar="URL",
        help="the decode engines' base URLs (repeatable); required unless --etcd is given",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        metavar="TOKENS",
        help="refuse longer requests (prompt + max_tokens) before any prefill (default: "
        "the engines judge)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=defaults.grace,
        metavar="SECONDS",
        help="how long requests in flight may finish after SIGTERM/SIGINT",
    )
    parser.add_argument(
        "--ready-file",
        default="",
        metavar="PATH",
        help='written with {"url": ...} once the proxy accepts requests; removed on exit',
    )
    timeouts = ProxyTimeouts()
    for flag, what in (
        (
            "--connect-timeout",
            "connecting to an engine (then the next one is tried; a decode engine's is cut to "
            "what the prefill's exposure lease leaves)",
        ),
        ("--prefill-timeout", "a whole prefill request (then a 504)"),
        ("--first-byte-timeout", "a decode request until its answer starts (then a 504)"),
        ("--idle-timeout", "the longest gap in a decode stream"),
    ):
        default = getattr(timeouts, _timeout_field(flag))
        help_text = f"{what} (default {default:g})"
        parser.add_argument(flag, type=float, default=default, metavar="SECONDS", help=help_text)
    add_send_timeout_argument(parser, defaults.send_timeout)
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=defaults.max_attempts,
        metavar="N",
        help="the most engines of a role one request tries (an engine that refused a "
        "connection is left out for a backoff: 1 s, doubled up to 30 s; default "
        f"{defaults.max_attempts})",
    )
    add_dispatch_argument(parser, defaults.dispatch)
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.body_timeout,
        metavar="SECONDS",
        help="how long a client may take to send a request's body, then 408 and its "
        f"connection closed (default {defaults.body_timeout:g})",
    )
    parser.add_argument(
        "--max-client-requests",
        type=int,
        default=defaults.max_client_requests,
        metavar="N",
        help="the most requests open at once from one client address, then 429 (0: no cap; "
        "behind a gateway every client has its address: raise it; /health and /metrics are "
        f"not counted; default {defaults.max_client_requests})",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"a client key, repeatable (default: ${API_KEY_ENV}); /v1/* then needs "
        "'Authorization: Bearer KEY', 401 otherwise; /health and /metrics stay open (prefer "
        "the variable: flags show in ps)",
    )
    add_internal_key_argument(parser, "sent to the engines")
    add_etcd_arguments(
        parser,
        "route to the engines registered under the prefix as they come and go (instead of "
        "--prefill/--decode); keep the last view while etcd is away (/health says so)",
        "accepted and unused (it is the engines' lease)",
    )


def _timeout_field(flag: str) -> str:
    """``--first-byte-timeout`` -> ``first_byte``."""
    return flag.removeprefix("--").removesuffix("-timeout").replace("-", "_")


def _timeout_flags(timeouts: ProxyTimeouts) -> dict[str, float]:
    """Each timeout by its flag."""
    return {
        f"--{field.replace('_', '-')}-timeout": getattr(timeouts, field)
        for field in attrs.fields_dict(ProxyTimeouts)
    }


def _engine_urls(flag: str, urls: Sequence[str]) -> tuple[str, ...]:
    for url in urls:
        problem = url_problem(url)
        if problem is not None:
            raise UsageError(f"{flag} {url!r}: {problem}")
    return tuple(url.rstrip("/") for url in urls)


def run(args: argparse.Namespace) -> int:
    """``trio-pd proxy``: the exit status.

    Raises:
        UsageError: a bad flag.
    """
    options = ProxyOptions(
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        grace=args.grace,
        send_timeout=args.send_timeout,
        max_model_len=args.max_model_len or None,
        timeouts=ProxyTimeouts(
            **{name: getattr(args, f"{name}_timeout") for name in attrs.fields_dict(ProxyTimeouts)}
        ),
        api_keys=client_keys(args.api_key),
        internal_key=internal_key(args.internal_key_file),
        max_attempts=args.max_attempts,
        body_timeout=args.body_timeout,
        max_client_requests=args.max_client_requests,
        dispatch=args.dispatch,
    )
    try:
        options.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    engines = EngineSet(
        _engine_urls("--prefill", args.prefill), _engine_urls("--decode", args.decode)
    )
    keys, internal = options.api_keys, options.internal_key
    if keys is not None and internal is not None and keys.accepts(internal):
        raise UsageError("a client key (--api-key) must not be the engines' internal key")
    if args.etcd and not args.etcd_prefix.endswith("/"):
        raise UsageError(f"--etcd-prefix {args.etcd_prefix!r} must end with '/'")
    if args.ready_file:
        if os.path.isdir(args.ready_file):
            raise UsageError(f"--ready-file {args.ready_file!r} is a folder")
        folder = os.path.dirname(os.path.abspath(args.ready_file))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"--ready-file {args.ready_file!r}: {folder} is not a writable folder")
    membership = membership_from_args(args, options.internal_key)
    if membership is None and not (engines.prefill and engines.decode):
        raise UsageError("give the engines: --prefill URL... and --decode URL... (or --etcd URL)")
    if membership is not None and (engines.prefill or engines.decode):
        raise UsageError("give either --prefill/--decode URLs or --etcd, not both")
    try:
        trio.run(_main, options, engines, membership, args.ready_file)
    except (ProxyStartError, MembershipError) as exc:  # (etcd refused: a password, a CA)
        print(f"trio-pd proxy: could not start: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK


async def _main(
    options: ProxyOptions, engines: EngineSet, membership: Membership | None, ready_file: str
) -> None:
    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    remove_file(ready_file)
    stop = StopRequest("trio-pd proxy", report)
    try:
        async with unwrapped_errors(), stop_requests(stop, None), trio.open_nursery() as nursery:
            with stop.starting:
                url = await nursery.start(
                    functools.partial(
                        serve_proxy,
                        options,
                        None if membership else engines,
                        stop.requested.wait,
                        membership=membership,
                        freeze_heap=True,
                    )
                )
                if ready_file:
                    try:
                        write_json_atomically(ready_file, {"url": url})
                    except OSError as exc:
                        raise ProxyStartError(
                            f"cannot write the ready file {ready_file}: {exc.strerror or exc}"
                        ) from None
                stop.ready = True
                report(f"trio-pd proxy: ready at {url}")
    finally:
        remove_file(ready_file)
    report("trio-pd proxy: stopped" if stop.ready else "trio-pd proxy: stopped before it was ready")
