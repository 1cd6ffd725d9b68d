"""The engine's ASGI application: routes, the lifespan that owns the connectors,
and the completions handler (errors mapped to HTTP statuses here)."""

from __future__ import annotations

import codecs
import logging
import os
from collections.abc import Callable
from contextlib import AsyncExitStack, aclosing
from typing import Any

import trio
from prometheus_client import generate_latest

from .._config import ConnectorConfig
from .._connector import open_connector
from .._errors import HandshakeError, ParamsRejectedError, TransferError
from .._ports import free_port_range
from .asgi import (
    HTTPError,
    Receive,
    Scope,
    Send,
    cancel_on_disconnect,
    read_json,
    response_completes,
    send_event,
    send_json,
    send_text,
    start_events,
)
from .engine import Engine
from .openai import completion, parse_completion_request
from .pool import OutOfBlocks

logger = logging.getLogger("trio_pd.serve")


def build_app(engine: Engine) -> Callable[[Scope, Receive, Send], Any]:
    """The engine's ASGI application (lifespan: the connectors)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(engine, receive, send)
            return
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"])
        try:
            if route == ("POST", "/v1/completions"):
                await _completions(engine, receive, send)
            elif route == ("GET", "/health"):
                await _health(engine, send)
            elif route == ("GET", "/metrics"):
                text = generate_latest(engine.registry).decode()
                await send_text(send, 200, text, "text/plain; version=0.0.4")
            else:
                raise HTTPError(404, f"no route {scope['method']} {scope['path']}", "not_found")
        except HTTPError as exc:
            await send_json(send, exc.status, exc.body, exc.headers)

    return response_completes(app)


async def _health(engine: Engine, send: Send) -> None:
    """200 while the engine serves; 503 draining, or while NIXL is stuck in a load."""
    stuck = [c.statistics().backend_stuck_call for c in engine.connectors]
    stuck = [call for call in stuck if call]
    health: dict[str, Any] = {"pid": os.getpid()}
    if stuck:
        health.update(status="stuck", stuck_call=stuck[0])
    elif engine.accepting and engine.connectors:
        health.update(status="ok")
    else:
        health.update(status="draining")
    await send_json(send, 200 if health["status"] == "ok" else 503, health)


async def _lifespan(engine: Engine, receive: Receive, send: Send) -> None:
    """Open the connectors for the server's life; close them after the last request.

    Inside it, a nursery holds the tasks that give exposed blocks back to the
    pool; at shutdown (hypercorn sends it once every request has drained)
    they are cancelled first, then the connectors close.
    """
    message = await receive()
    assert message["type"] == "lifespan.startup"
    settings = engine.settings
    started = False
    base_port = settings.side_channel_port
    if settings.tp_size > 1 and not base_port:
        base_port = free_port_range(settings.tp_size, settings.host)
    try:
        async with AsyncExitStack() as stack:
            connectors = [
                await stack.enter_async_context(
                    open_connector(
                        settings.engine_id,
                        regions,
                        host=settings.host,
                        port=base_port,
                        advertise_host=settings.advertise_host or None,
                        config=ConnectorConfig(
                            abort_timeout=settings.abort_timeout,
                            lease_initial=settings.lease_initial,
                            lease_renewal=settings.lease_renewal,
                            heartbeat_interval=settings.heartbeat_interval,
                            exposure_secret=engine.exposure_secret,
                        ),
                        tp_rank=rank,
                        tp_size=settings.tp_size,
                    )
                )
                for rank, regions in enumerate(engine.cache)
            ]
            nursery = await stack.enter_async_context(trio.open_nursery())
            engine.connectors, engine.nursery, engine.accepting = connectors, nursery, True
            started = engine.started = True
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            engine.accepting = False
            engine.connectors = []
            nursery.cancel_scope.cancel()
    except Exception as exc:
        if not started:
            # The engine process reports this in one line and exits non-zero.
            engine.startup_failure = f"{type(exc).__name__}: {exc}"
            logger.debug("engine %s: the connector failed", settings.engine_id, exc_info=True)
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        logger.exception("engine %s: the connector failed", settings.engine_id)
        await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
        return
    await send({"type": "lifespan.shutdown.complete"})


async def _completions(engine: Engine, receive: Receive, send: Send) -> None:
    body = await read_json(receive)
    prompt, max_tokens, stream, params = parse_completion_request(body)
    if not engine.accepting:
        raise HTTPError(503, "the engine is draining", "unavailable", retry_after=1)
    request_id = engine.request_id()
    if params.get("do_remote_decode"):
        kind = "prefill"
    elif params.get("do_remote_prefill"):
        kind = "decode"
    else:
        kind = "whole"
    outcome, answered = "error", False

    async def send_tracked(message: dict[str, Any]) -> None:
        nonlocal answered
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered = True  # (the client may disconnect right after: still answered)
        await send(message)

    try:
        async with cancel_on_disconnect(receive):
            if kind == "prefill":
                kv = await engine.prefill_for_remote(request_id, prompt)
                body = completion(request_id, "", [], len(prompt), kv_transfer_params=kv)
                await send_json(send_tracked, 200, body)
            else:
                await _generate(
                    engine, send_tracked, request_id, prompt, max_tokens, stream, kind, params
                )
        outcome = "ok" if answered else "disconnected"
    except OutOfBlocks as exc:
        raise HTTPError(
            503, f"engine {engine.settings.engine_id}: {exc}", "overloaded", retry_after=1
        ) from None
    except ParamsRejectedError as exc:
        raise HTTPError(
            400,
            f"engine {engine.settings.engine_id}: {exc}",
            "invalid_request_error",
            param=f"kv_transfer_params.{exc.field}",
        ) from None
    except (HandshakeError, TransferError) as exc:
        source = params.get("remote_engine_id")
        raise HTTPError(
            502,
            f"engine {engine.settings.engine_id}: pulling the KV cache from engine "
            f"{source!r} failed: {exc}",
            type(exc).__name__,
            engine=engine.settings.engine_id,
            remote_engine=source,
        ) from None
    finally:
        engine.requests.labels(kind, outcome).inc()


async def _generate(
    engine: Engine,
    send: Send,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    kind: str,
    params: dict[str, Any],
) -> None:
    remote = params if kind == "decode" else None
    async with (
        engine.generation(request_id, prompt, max_tokens, remote) as generator,
        aclosing(generator) as tokens,  # (closed even when the client hangs up)
    ):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if not stream:
            ids = [token async for token in tokens]
            text = decoder.decode(bytes(ids), final=True)
            await send_json(send, 200, completion(request_id, text, ids, len(prompt)))
            return
        await start_events(send)
        async for token in tokens:
            chunk = completion(request_id, decoder.decode(bytes([token])), [token], len(prompt))
            del chunk["usage"]
            chunk["choices"][0]["finish_reason"] = None
            await send_event(send, chunk)
        await send_event(send, "[DONE]", last=True)


# ---- the engine process -------------------------------------------------------
