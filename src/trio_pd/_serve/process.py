"""One engine process: hypercorn's trio worker serving the engine's app until a signal.

``trio-pd engine`` runs :func:`serve_engine` (``trio-pd serve`` starts one
such command per engine).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import attrs
import trio
from prometheus_client import disable_created_metrics

from trio_pd._curve_keys import CurveAuth, PeerKeys
from trio_pd._serve import defaults
from trio_pd._serve.app import build_app
from trio_pd._serve.binding import (
    BindError,
    base_url,
    bind_listener,
    hypercorn_bind,
    remove_file,
    write_json_atomically,
)
from trio_pd._serve.discovery import (
    EngineAnnouncement,
    EngineIdTaken,
    EngineSet,
    Membership,
    Role,
)
from trio_pd._serve.engine import Engine, EngineSettings
from trio_pd._serve.heap import freeze_start_up_heap
from trio_pd._serve.keys import BearerKeys
from trio_pd._serve.model import ModelConfig, TinyLlama
from trio_pd._serve.stopping import StopRequest, stop_requests

logger = logging.getLogger("trio_pd.serve")


class EngineStartError(Exception):
    """The engine could not start; the message says why, in one line.

    ``status``: the command's exit status (2 when its engine id is held by
    a live engine, 1 otherwise).
    """

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


async def serve_engine(
    settings: EngineSettings,
    role: Role,
    *,
    exposure_secret: bytes | None = None,
    internal_keys: BearerKeys | None = None,
    client_keys: BearerKeys | None = None,
    internal_key: str | None = None,
    curve: CurveAuth | None = None,
    membership: Membership | None = None,
    parent_pid: int | None = None,
    report: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    freeze_heap: bool = False,
) -> None:
    """Serve one engine until SIGTERM or SIGINT, then drain it.

    An empty ``settings.engine_id`` becomes ``ROLE-ADVERTISED_HOST-PORT``.

    Start-up, in order: bind the HTTP socket, open the connectors (the
    lifespan), accept requests, register with ``membership`` (if any), and
    only then write ``settings.ready_file`` (``{"url": ...}``, the advertised
    address). A signal during start-up abandons it (whatever opened is
    closed) and returns. A signal afterwards drains: withdraw from
    ``membership``, stop accepting, let requests in flight finish and the
    exposures handed out be read (another engine may still be pulling them;
    all of it within ``settings.grace`` s of the signal), close the connectors. Further signals are
    reported and ignored. With ``parent_pid``, the engine also drains when
    that process is no longer its parent (the deployment that started it
    died). With ``freeze_heap`` (the engine's own process: ``trio-pd
    engine``), the process's heap is frozen once the engine started
    (:func:`~.heap.freeze_start_up_heap`; not for a caller whose process
    goes on with other work, a test say).

    The ready file is removed on every exit path (a stale one, left by an
    engine that was killed, is removed before start-up).

    ``exposure_secret`` signs and checks ``kv_transfer_params``;
    ``internal_keys``: only callers presenting one may use ``/v1/*`` (the
    deployment's proxy) -- for a decode-first engine (``settings.prefill_urls``),
    ``client_keys`` instead, and it sends ``internal_key`` to its prefill
    engines; ``curve``: the side channel's CURVE keys. When
    ``curve.peers`` is set, the engine follows ``membership``'s verified
    members before it accepts requests, and keeps ``curve.peers`` to what
    they publish: a prefill engine lets in exactly the decode engines'
    keys, a decode engine expects each prefill engine's own; its own public
    key goes into its registration.

    ``report`` gets the engine's one-line status messages (stderr by default).

    Raises:
        EngineStartError: the engine could not start (its address, its
            connectors or ``membership``): one line saying why.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    remove_file(settings.ready_file)
    try:
        sock = bind_listener(settings.host, settings.http_port, send_timeout=settings.send_timeout)
    except BindError as exc:
        raise EngineStartError(f"HTTP: {exc}") from None
    port = sock.getsockname()[1]
    url = base_url(settings.advertised(), port)
    if not settings.engine_id:
        settings = attrs.evolve(settings, engine_id=f"{role}-{settings.advertised()}-{port}")
    disable_created_metrics()  # type: ignore[no-untyped-call]  # (a process of its own)
    engine = Engine(
        settings,
        TinyLlama(ModelConfig()),
        exposure_secret=exposure_secret,
        internal_keys=internal_keys,
        curve=curve,
        client_keys=client_keys,
        internal_key=internal_key,
    )
    config = Config()
    config.bind = [hypercorn_bind(sock)]
    config.graceful_timeout = settings.grace  # (set again when the drain starts: what is left)
    # hypercorn bounds the lifespan's shutdown by this: it waits for exposures
    # within the drain's deadline, so never cut it short.
    config.shutdown_timeout = settings.grace + 5
    config.accesslog = None
    config.loglevel = "WARNING"
    config.keep_alive_timeout = defaults.SERVER_KEEP_ALIVE  # (clients close theirs sooner)
    app: Any = build_app(engine)  # (hypercorn's ASGI types are stricter than plain dicts)
    stop = StopRequest(f"engine {settings.engine_id}", report)
    drain = trio.Event()  # (hypercorn's shutdown trigger: set once the engine withdrew)
    withdraw, withdrawn = trio.CancelScope(), trio.Event()
    following = trio.CancelScope()
    try:
        async with stop_requests(stop, parent_pid), trio.open_nursery() as nursery:
            with stop.starting:
                if membership is not None and curve is not None and curve.peers is not None:
                    await nursery.start(_follow_peers, membership, curve.peers, following)
                binds = await nursery.start(
                    functools.partial(serve, app, config, shutdown_trigger=drain.wait)
                )
                sock.close()  # (hypercorn serves on its duplicate)
                if not engine.started:
                    # The lifespan failed, and hypercorn reported a start
                    # regardless (its own error follows).
                    raise EngineStartError(engine.startup_failure or "the lifespan did not start")
                if freeze_heap:  # (the model and the connectors are made)
                    freeze_start_up_heap()
                if membership is not None:
                    _, side_port = engine.connectors[0].address
                    host = settings.advertise_host or settings.host
                    side_channel = f"[{host}]:{side_port}" if ":" in host else f"{host}:{side_port}"
                    announcement = EngineAnnouncement(
                        settings.engine_id,
                        role,
                        url,
                        settings.tp_size,
                        side_channel,
                        curve_public_key=curve.public_key if curve is not None else "",
                    )
                    await nursery.start(_held, membership, announcement, withdraw, withdrawn)
                if settings.ready_file:
                    write_json_atomically(settings.ready_file, {"url": url})
                stop.ready = True
                report(f"{stop.name}: {role}, ready at {url} (bound {binds[0]})")
            await stop.requested.wait()
            engine.drain_deadline = trio.current_time() + settings.grace
            if membership is not None:  # (the proxy learns first that the engine leaves)
                withdraw.cancel()
                with trio.move_on_at(engine.drain_deadline):
                    await withdrawn.wait()
            engine.accepting = False
            # One deadline for the whole drain: requests get what the withdrawal left.
            config.graceful_timeout = max(0.0, engine.drain_deadline - trio.current_time())
            drain.set()
            following.cancel()  # (the peers' keys stay as last seen)
            # hypercorn stops accepting and drains; leaving the nursery waits for it.
    except Exception as exc:
        if engine.startup_failure:
            raise EngineStartError(engine.startup_failure) from None
        if not stop.ready and not stop.requested.is_set():
            taken = _lone_error(exc)
            if isinstance(taken, EngineIdTaken):
                raise EngineStartError(str(taken), status=2) from None
            raise EngineStartError(_one_line(exc)) from exc
        raise
    finally:
        sock.close()
        remove_file(settings.ready_file)
    report(f"{stop.name}: stopped" if stop.ready else f"{stop.name}: stopped before it was ready")


async def _follow_peers(
    membership: Membership,
    peers: PeerKeys,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``peers`` to the CURVE keys of the verified members until ``scope`` is
    cancelled; started once the first view is in."""

    def update(engines: EngineSet) -> None:
        peers.update(
            (m.curve_public_key for m in engines.members if m.role == "decode"),
            {m.engine_id: m.curve_public_key for m in engines.members if m.role == "prefill"},
        )

    with scope:
        async with trio.open_nursery() as nursery:
            update(await nursery.start(membership.watch_engines, update))
            task_status.started()


async def _held(  # noqa: ASYNC128  (hold_registration calls started)
    membership: Membership,
    announcement: EngineAnnouncement,
    scope: trio.CancelScope,
    withdrawn: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        with scope:
            await membership.hold_registration(announcement, task_status=task_status)
    finally:
        withdrawn.set()


def _lone_error(exc: BaseException) -> BaseException:
    """The lone real error of a group, if that is what ``exc`` is; else ``exc``."""
    while isinstance(exc, BaseExceptionGroup):
        real = exc.split(trio.Cancelled)[1]
        if real is None or len(real.exceptions) != 1:
            break
        exc = real.exceptions[0]
    return exc


def _one_line(exc: BaseException) -> str:
    """A start-up error in one line (the lone real error of a group, if that is what it is)."""
    exc = _lone_error(exc)
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
