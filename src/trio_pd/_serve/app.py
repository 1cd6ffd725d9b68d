"""The engine's ASGI application: routes, the lifespan that owns the connectors,
and the generation handlers (the exceptions they catch are answered by their
row of :data:`~.errors.ERROR_STATUSES`).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
/v1/models`` (and ``/v1/models/{id}``), ``GET /health``, ``GET /metrics``. A
known path with another method is a 405 with ``Allow``; any other path a
404. Every error is OpenAI's JSON error body; an exception that escapes a
handler -- none should, for any input -- is logged and answered with a 500
of the same shape.

Each request is named by its ``X-Request-Id`` header when it has a usable
one, else by a fresh id; the response carries it back in ``X-Request-Id``,
the engine's request id (the response's ``id``, the connector's request id)
contains it, and so do the log lines. ``Authorization`` is ignored.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import logging
import math
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any

import attrs
import trio
from prometheus_client import generate_latest

from trio_pd._config import ConnectorConfig
from trio_pd._connector import open_connector
from trio_pd._core._errors import (
    ExposureEndedError,
    HandshakeError,
    ParamsRejectedError,
    TransferError,
)
from trio_pd._serve.asgi import (
    App,
    Receive,
    RequestBody,
    Scope,
    Send,
    SendWatch,
    cancel_on_disconnect,
    read_json,
    response_completes,
    send_event,
    send_json,
    send_text,
    start_events,
)
from trio_pd._serve.defaults import REPREFILLS
from trio_pd._serve.dispatch import SecondLine, has_second_line, params_within
from trio_pd._serve.engine import Engine
from trio_pd._serve.errors import DeploymentFault, HTTPError, ParamsInUse, http_error
from trio_pd._serve.openai import (
    MODEL_NAME,
    GenerationRequest,
    first_token_of,
    parse_chat_request,
    parse_completions_request,
    request_id_from_headers,
)
from trio_pd._serve.pool import OutOfBlocks
from trio_pd._serve.ports import free_port_range
from trio_pd._serve.prefill_channel import PORT_HEADER, PrefillChannelServer
from trio_pd._serve.prefilling import open_prefiller
from trio_pd._serve.responses import Shapes, model_card, model_list
from trio_pd._serve.timing import PhaseTimes

logger = logging.getLogger("trio_pd.serve")

PULL_ERRORS = (
    OutOfBlocks,
    ParamsRejectedError,
    ParamsInUse,
    HandshakeError,
    ExposureEndedError,
    TransferError,
)
"""What a generation request may fail with besides its own refusals: answered
by their rows of :data:`~.errors.ERROR_STATUSES`."""

ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/models": ("GET",),
    "/health": ("GET",),
    "/metrics": ("GET",),
}
"""The engine's paths and the methods each takes."""


def build_app(engine: Engine) -> Callable[[Scope, Receive, Send], Any]:
    """The engine's ASGI application (lifespan: the connectors)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(engine, receive, send, completing)
            return
        if scope["type"] != "http":
            return
        request_id = request_id_from_headers(scope.get("headers", ()))
        # (an answer that starts before the body was read reads it first: the
        # connection then takes the client's next request; not a body whose
        # second line carries an exposure's parameters, see _give_back)
        body = RequestBody(receive, scope, drain=not has_second_line(scope.get("headers", ())))
        response = _Response(body.answering(send), request_id)
        try:
            await _route(engine, scope, body, response.send, request_id)
        except HTTPError as exc:
            level = logging.WARNING if exc.status >= 500 else logging.INFO
            logger.log(level, "request %s: %d %s", request_id, exc.status, exc)
            await response.error(exc)
        except Exception as exc:
            logger.exception(
                "request %s: %s %s failed unexpectedly",
                request_id,
                scope["method"],
                scope["path"][:200],
            )
            await response.error(http_error(exc, row_of=Exception, request_id=request_id))

    completing = response_completes(app)
    return completing


async def _route(engine: Engine, scope: Scope, receive: Receive, send: Send, rid: str) -> None:
    method, path = scope["method"], scope["path"]
    keys = engine.guard
    if keys is not None and keys.guards(path):
        keys.check(scope.get("headers", ()))
    if path.startswith("/v1/models/"):
        _allow(method, path, ("GET",))
        if path.removeprefix("/v1/models/") != MODEL_NAME:
            raise HTTPError(
                404,
                f"The model `{path[11:200]}` does not exist",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )
        await send_json(send, 200, model_card(engine.max_model_len()))
        return
    allowed = ROUTES.get(path)
    if allowed is None:
        raise HTTPError(404, f"Invalid URL ({method} {path[:200]})", "invalid_request_error")
    _allow(method, path, allowed)
    if path == "/v1/completions":
        await _generation(engine, scope, receive, send, rid, chat=False)
    elif path == "/v1/chat/completions":
        await _generation(engine, scope, receive, send, rid, chat=True)
    elif path == "/v1/models":
        await send_json(send, 200, model_list(engine.max_model_len()))
    elif path == "/health":
        await _health(engine, send)
    else:
        text = generate_latest(engine.registry).decode()
        await send_text(send, 200, text, "text/plain; version=0.0.4")


def _allow(method: str, path: str, allowed: tuple[str, ...]) -> None:
    """A 405 (with ``Allow``) unless ``method`` is one that ``path`` takes."""
    if method not in allowed:
        error = HTTPError(
            405,
            f"{method[:20]} is not allowed on {path}: use {', '.join(allowed)}",
            "invalid_request_error",
            code="method_not_allowed",
        )
        error.headers.append((b"allow", ", ".join(allowed).encode()))
        raise error


class _Response:
    """The ASGI ``send`` of one request: adds ``X-Request-Id`` to the response,
    and knows how far the response got (for an error that comes late)."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self._request_id = request_id
        self.started = self.finished = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (b"x-request-id", self._request_id.encode())]
            message = {**message, "headers": headers}
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            self.finished = True
        await self._send(message)

    async def error(self, error: HTTPError) -> None:
        """Answer with ``error``; mid-stream, end the stream with it as an event."""
        if not self.started:
            await send_json(self.send, error.status, error.body, error.headers)
        elif not self.finished:
            try:
                await send_event(self.send, error.body, last=True)
            except Exception:  # (the client is gone: nothing more to tell it)
                logger.debug("request %s: the error event was not sent", self._request_id)


async def _health(engine: Engine, send: Send) -> None:
    """200 while the engine serves; 503 draining, or while NIXL is stuck in a load.
    The body also names the process, rank 0's side-channel port and the
    engine's CURVE public key (when it has one).

    A decode-first engine says how many prefill engines it has
    (``"prefill"``), and is 503 ``failing`` (``"failing": ["prefill"]``)
    while every one of them failed its last request -- refused the
    connection, answered a 5xx, timed out -- as the proxy's ``/health`` is
    for a role: it cannot serve a request then, and a balancer in front of
    it should know. The first request a prefill engine answers makes it
    healthy again."""
    stuck = [c.statistics().backend_stuck_call for c in engine.connectors]
    stuck = [call for call in stuck if call]
    health: dict[str, Any] = {"pid": os.getpid()}
    if engine.connectors:  # (public facts: what kv_transfer_params and peers carry anyway)
        health["side_channel_port"] = engine.connectors[0].address[1]
    if engine.curve is not None:
        health["curve_public_key"] = engine.curve.public_key
    prefill = None if engine.prefiller is None else engine.prefiller.engines
    if prefill is not None:
        health["prefill"] = len(prefill.engines)
    if stuck:
        health.update(status="stuck", stuck_call=stuck[0])
    elif not (engine.accepting and engine.connectors):
        health.update(status="draining")
    elif prefill is not None and prefill.failing(trio.current_time()):
        health.update(status="failing", failing=["prefill"])
    else:
        health.update(status="ok")
    await send_json(send, 200 if health["status"] == "ok" else 503, health)


async def _lifespan(engine: Engine, receive: Receive, send: Send, app: App) -> None:
    """Open the connectors for the server's life; close them after the last request.

    A decode-first engine also opens its :class:`~.prefilling.Prefiller`
    (an HTTP client to its prefill engines, and its prefill channels to
    them), closed before the connectors. Any other engine (unless
    ``prefill_channel`` is off) answers prefill requests over its prefill
    channel too (:class:`~.prefill_channel.PrefillChannelServer`, with
    ``app``): a task of the nursery below, closed in order by the drain
    (:func:`_wait_for_exposures`), cancelled with the nursery.

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
                            auth=engine.curve,
                        ),
                        tp_rank=rank,
                        tp_size=settings.tp_size,
                    )
                )
                for rank, regions in enumerate(engine.cache)
            ]
            if settings.prefill_urls:  # (decode-first: its own HTTP client, closed first)
                engine.prefiller = await stack.enter_async_context(
                    open_prefiller(
                        settings.prefill_urls,
                        prefill_timeout=settings.prefill_timeout,
                        internal_key=engine.internal_key,
                        caller=f"decode-first engine {settings.engine_id}",
                        channels=settings.prefill_channel,
                        orphaned=engine.give_back_answer,
                    )
                )
            nursery = await stack.enter_async_context(trio.open_nursery())
            if settings.prefill_channel and not settings.prefill_urls:
                channel = PrefillChannelServer(app, in_flight=engine.channel_requests)
                engine.prefill_channel_port = await nursery.start(
                    functools.partial(
                        channel.serve, settings.host, send_timeout=settings.send_timeout
                    )
                )
                engine.prefill_channel = channel
            engine.connectors, engine.nursery, engine.accepting = connectors, nursery, True
            started = engine.started = True
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            engine.accepting = False
            await _wait_for_exposures(engine)
            engine.connectors, engine.prefill_channel_port = [], None
            engine.prefill_channel = None
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


async def _wait_for_exposures(engine: Engine) -> None:
    """Until every exposure handed out resolved (its reader read it, gave it
    up, or its lease expired), or the drain's deadline: a prefill engine that
    closed its connectors earlier would fail the pulls of requests that
    another engine is finishing. What is left at the deadline is logged (its
    readers then fail, naming this engine). The prefill channel's requests
    are waited for first, then the channel closes (each connection told so)."""
    deadline = engine.drain_deadline
    if deadline == math.inf:  # (a shutdown without a drain: wait up to --grace)
        deadline = trio.current_time() + engine.settings.grace
    with trio.move_on_at(deadline):
        # (prefill requests that came over the channel: hypercorn drained
        # the HTTP ones before the lifespan's shutdown, not these; then the
        # channel tells each peer it closes, so that a request it sent
        # meanwhile goes elsewhere, known not to have run)
        await engine.channel_requests.wait_value(0)
        if engine.prefill_channel is not None:
            await engine.prefill_channel.close()
        await engine.exposures_unresolved.wait_value(0)
    if engine.exposures_unresolved.value:
        logger.warning(
            "engine %s: closing with %d exposures not yet read (--grace is over): "
            "their readers fail",
            engine.settings.engine_id,
            engine.exposures_unresolved.value,
        )


async def _generation(
    engine: Engine, scope: Scope, receive: Receive, send: Send, rid: str, chat: bool
) -> None:
    """``POST /v1/completions`` or ``/v1/chat/completions``: prefill, decode or both.

    A decode request whose ``kv_transfer_params`` follow as a second line
    (concurrent dispatch, :mod:`.dispatch`) is admitted while they come; one
    refused for any reason reads them first, and gives their exposure back.

    On a decode-first engine a request without parameters has its prefill
    run on a prefill engine (:class:`~.prefilling.Prefiller`), then is
    decoded here (:func:`_decode_first`); prefilled once more if its
    exposure ended before the pull. Its clients' parameters are refused,
    and nothing they name is given back."""
    within = params_within(scope.get("headers", ()))
    second = None if within is None else SecondLine(receive, within)
    try:
        body = await (read_json(receive) if second is None else second.first())
    except HTTPError as exc:
        if second is not None and exc.status == 400:  # (a malformed first line, read whole)
            await _give_back(engine, {}, second)  # noqa: ASYNC120 (see _give_back)
        raise
    try:
        request = parse_chat_request(body) if chat else parse_completions_request(body)
        if second is not None:
            request = attrs.evolve(request, kind="decode")  # (its parameters: line 2)
        if not engine.accepting:
            raise HTTPError(503, "the engine is draining", "unavailable", retry_after=1)
    except HTTPError:
        # Refused before it held the prefill's blocks: give them back now
        # (a refusal while it holds them does so as it leaves the hold).
        await _give_back(engine, body, second)  # noqa: ASYNC120 (see _give_back)
        raise
    prefiller = engine.prefiller
    if prefiller is not None and (request.kind != "whole" or second is not None):
        # (refused without abandoning what they name: a client may replay
        # another request's parameters, and must not end its exposure)
        raise HTTPError(
            400,
            f"engine {engine.settings.engine_id} runs each request's prefill on a prefill "
            "engine itself (decode-first): it takes no kv_transfer_params from its clients",
            "invalid_request_error",
            param="kv_transfer_params",
        )
    if request.ignored:
        ignored = ", ".join(request.ignored)
        logger.warning("request %s: unknown fields ignored: %s", rid, ignored[:500])
    request_id = engine.request_id(rid, "chatcmpl" if chat else "cmpl")
    shapes = Shapes(request_id, chat, len(request.prompt))
    outcome, answered = "error", False

    async def send_tracked(message: dict[str, Any]) -> None:
        nonlocal answered
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered = True  # (the client may disconnect right after: still answered)
        await send(message)

    times = PhaseTimes()
    sending = SendWatch(send_tracked)
    try:
        try:
            async with cancel_on_disconnect(
                receive, None if second is None else second.read, scope
            ):
                if request.kind == "prefill":
                    first, kv = await engine.prefill_for_remote(request_id, request.prompt, times)
                    text = bytes([first]).decode(errors="replace")
                    whole = shapes.whole(text, [first], kv_transfer_params=kv)
                    headers = [times.header()]
                    if engine.prefill_channel_port is not None:  # (where to send the next)
                        headers.append((PORT_HEADER.encode(), b"%d" % engine.prefill_channel_port))
                    await send_json(sending, 200, whole, headers)
                elif prefiller is not None:  # (decode-first)
                    # (a request that can never run here: before the prefill,
                    # and before a stream could start with its first token)
                    engine.check_fits(request.prompt, request.max_tokens)
                    # (counted as a decode request, whatever becomes of its prefill)
                    request = attrs.evolve(request, kind="decode")
                    stream = _Stream()  # (what the client got, across prefills)
                    for round_ in range(1 + REPREFILLS):
                        answer = await prefiller.prefill(scope["path"], rid, body, times)
                        request = attrs.evolve(request, kind="decode", kv_transfer_params=answer.kv)
                        try:
                            await _decode_first(
                                engine, sending, shapes, request, times, answer.engine, stream
                            )
                            break
                        except ExposureEndedError as exc:
                            if round_ == REPREFILLS:
                                raise
                            # (as the proxy does: the exposure is gone for good,
                            # a new prefill gives the same first token and KV)
                            logger.warning(
                                "request %s: prefilled again: the exposure on %s ended "
                                "before its pull (%s)",
                                request_id,
                                answer.engine,
                                exc.outcome,
                            )
                else:
                    await _generate(engine, sending, shapes, request, times, second)
        except HTTPError as exc:
            if second is not None and exc.status == 499:  # (the proxy closed it: a failed prefill)
                outcome = "disconnected"
                return
            if second is not None and second.value is None:
                await _give_back(engine, body, second)  # noqa: ASYNC120 (see _give_back)
            raise
        except Exception:
            # Refused before its parameters came: read them, and give their
            # exposure back.
            if second is not None and second.value is None:
                await _give_back(engine, body, second)  # noqa: ASYNC120 (see _give_back)
            raise
        outcome = "ok" if answered else "disconnected"
        if not answered and sending.stalled(engine.settings.send_timeout):
            outcome = "stalled"
    except PULL_ERRORS as exc:
        params = request.kv_transfer_params if second is None else second.value or {}
        raise http_error(
            exc,
            engine=engine.settings.engine_id,
            remote_engine=params.get("remote_engine_id"),
            remote_request=params.get("remote_request_id"),
        ) from None
    finally:
        engine.requests.labels(request.kind, outcome).inc()
        if outcome == "stalled":
            sending.log_stall(logger, request_id, engine.settings.send_timeout, "its blocks freed")
        else:
            logger.info(
                "request %s: %s, %s (%d prompt tokens, max_tokens %d)",
                request_id,
                request.kind,
                outcome,
                len(request.prompt),
                request.max_tokens,
            )


async def _give_back(engine: Engine, body: dict[str, Any], second: SecondLine | None) -> None:
    """Abandon the exposure that a refused request's parameters name
    (:meth:`Engine.give_back`): its body's, or -- concurrent dispatch -- its
    second line's, read first (within its deadline; one that does not come,
    or does not parse, names nothing to give back; one in a body refused
    for its shape -- a third line, say -- still names one).

    Called from ``except`` blocks that re-raise the refusal: if the request is
    cancelled while this reads the second line, the cancellation replaces
    the refusal -- nothing would answer it any more (flake8-async's ASYNC120
    is silenced there for this reason).

    A decode-first engine gives nothing back: its clients' parameters are
    never its own (a replay of another request's must not end its exposure;
    it gives back its own prefill's itself, :meth:`Engine.generation`)."""
    if engine.settings.prefill_urls:
        return
    if second is None:
        engine.give_back(body)
        return
    try:
        kv = await second.params(whole=False)
    except HTTPError:
        if second.named is None:
            return
        kv = second.named
    engine.give_back({"kv_transfer_params": kv})


@attrs.define
class _Stream:
    """What a streamed answer has sent so far (a decode-first request may
    prefill twice: its first token goes out once)."""

    started: bool = False  # (the headers and the first token)
    decoder: codecs.IncrementalDecoder = attrs.field(
        factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )


async def _decode_first(
    engine: Engine,
    send: Send,
    shapes: Shapes,
    request: GenerationRequest,
    times: PhaseTimes,
    prefill_engine: str,
    stream: _Stream,
) -> None:
    """A decode-first engine's request, once its prefill engine answered
    (``request.kv_transfer_params``): pull and decode it here, its first
    token -- the prefill engine's -- streamed as soon as the blocks are held.

    Leaves the exposure to nobody: given back at once if the request fails
    or is cancelled before it held the blocks (the hold gives them back after).
    Nothing but the engine ever sees these parameters.

    Raises:
        HTTPError: a 502 (:class:`~.errors.DeploymentFault`) when this engine
            refuses the parameters its prefill engine issued (a 400 naming one,
            :class:`ParamsRejectedError` -- another exposure secret, say -- or
            :class:`~.errors.ParamsInUse`: the client sent none of them);
            the pull's and the request's own errors as for any decode request.
    """
    try:
        await _generate(engine, send, shapes, request, times, stream=stream)
    except (ParamsRejectedError, ParamsInUse) as exc:  # (their messages name the field)
        raise http_error(
            DeploymentFault(str(exc)),
            engine=engine.settings.engine_id,
            prefill_engine=prefill_engine,
        ) from None
    except HTTPError as exc:
        if exc.status == 400 and str(exc.body["error"].get("param")).startswith(
            "kv_transfer_params"
        ):
            raise http_error(
                DeploymentFault(f"{exc} ({exc.body['error']['param']})"),
                engine=engine.settings.engine_id,
                prefill_engine=prefill_engine,
            ) from None
        raise


async def _generate(
    engine: Engine,
    send: Send,
    shapes: Shapes,
    request: GenerationRequest,
    times: PhaseTimes,
    second: SecondLine | None = None,
    *,
    stream: _Stream | None = None,
) -> None:
    """Generate ``request``'s tokens (pulling its prompt's KV if it is a decode
    request) and send them, whole or as server-sent events; the response's
    ``Server-Timing`` names the phases before the first token (``times``).

    A decode-first request (``stream`` given, what was sent of it so far)
    starts its stream with the prefill engine's first token as soon as every
    rank holds the blocks, before admission and the pull (once: a second
    prefill's first token is not sent again); its exposure is given back if
    it ends before it held it (nobody else knows its parameters). With
    ``max_tokens`` 1 that token is the whole answer: the exposure is given
    back, nothing is admitted or pulled.

    A whole answer is sent once its KV blocks are back in the pool; a stream
    holds them until its last token is sent (a client that stops reading
    holds them until the send timeout resets its connection)."""
    remote = request.kv_transfer_params if request.kind == "decode" and second is None else None
    later = None if second is None else second.params
    # A decode-first engine streams the prefill's first token once the blocks
    # are held. Behind a proxy the answer starts after the pull: until then an
    # exposure_ended is a 409 that the proxy answers by prefilling again.
    decode_first = stream is not None
    sent = stream if stream is not None else _Stream()
    decoder = sent.decoder
    first = None
    if decode_first and remote is not None:
        with contextlib.suppress(HTTPError):  # (a bad one is refused once held)
            first = first_token_of(remote, engine.model.config.vocab)

    async def on_held() -> None:
        if first is None or not request.stream or sent.started:
            return
        await start_events(send, [times.header()])
        opening = shapes.first_chunk()
        if opening is not None:
            await send_event(send, opening)
        last = request.max_tokens == 1
        text = decoder.decode(bytes([first]), final=last)
        await send_event(send, shapes.chunk(text, [first], last, request.include_usage))
        sent.started = True

    @asynccontextmanager
    async def generating() -> AsyncIterator[AsyncIterator[int]]:
        if first is not None and request.max_tokens == 1:
            # (the prefill's token is the answer: nothing to pull or decode)
            engine.give_back({"kv_transfer_params": remote})
            yield _only(first)
            return
        async with (
            engine.generation(
                shapes.request_id,
                request.prompt,
                request.max_tokens,
                remote,
                times,
                params_later=later,
                held=on_held,
                give_back_unheld=decode_first,
            ) as tokens_,
            aclosing(tokens_) as tokens,  # (closed even when the client hangs up)
        ):
            yield tokens

    if not request.stream:
        async with generating() as tokens:
            ids = [token async for token in tokens]
        text = decoder.decode(bytes(ids), final=True)
        await send_json(send, 200, shapes.whole(text, ids), [times.header()])
        return
    async with generating() as tokens:
        early = sent.started
        if not early:
            await start_events(send, [times.header()])
            opening = shapes.first_chunk()
            if opening is not None:
                await send_event(send, opening)
        count = 0
        async for token in tokens:
            count += 1
            if count == 1 and early:  # (the prefill's first token: sent already)
                continue
            last = count == request.max_tokens
            text = decoder.decode(bytes([token]), final=last)
            await send_event(send, shapes.chunk(text, [token], last, request.include_usage))
        if request.include_usage:
            await send_event(send, shapes.usage_chunk(count))
        await send_event(send, "[DONE]", last=True)


async def _only(token: int) -> AsyncGenerator[int, None]:
    """A token stream of one token (a checkpoint first, as every token of a
    decoded stream is)."""
    await trio.lowlevel.checkpoint()
    yield token
