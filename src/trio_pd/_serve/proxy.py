"""The disaggregation proxy: prefill on one engine, decode on another, on trio.

It plays vLLM's P/D proxy. For each ``POST /v1/completions`` it sends the
request to a prefill engine with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, takes the
``kv_transfer_params`` of the answer, and forwards the original request with
them to a decode engine, relaying the decode engine's answer -- streamed or
not -- to the client.

An operator can run it (see docs/serving.md):

* **Routing**: each request goes to the engine of its role with the fewest
  requests in flight (``_serve.routing``); the engine sets can change while
  it runs (:meth:`Proxy.set_engines`: membership).
* **Retries only where the request cannot have had an effect**: an engine
  that refuses the connection never saw the request, so the next one is
  tried (and the refusing one is left out for a backoff, exponential and
  capped: ``_serve.routing``); so is a prefill engine that answers 503
  (draining or out of blocks: it did no work). At most ``max_attempts``
  engines per role and request. A timeout or a broken connection after the request was sent is not
  retried (the work may have been done) and does not mark the engine down
  (a busy engine is slow, not gone). A decode engine's 503 is not retried
  either: it abandoned the prefill's blocks when it gave up.
* **Per-phase deadlines** (:class:`ProxyTimeouts`): connecting, the prefill,
  the decode's first byte, and the gaps in the stream; each passes as a 504
  that names the phase and the engine.
* **Request ids**: ``X-Request-Id`` is taken from the client (if printable
  and short) or minted, sent to both engines, returned in the response, and
  in every log line about the request.
* ``GET /metrics``: requests by outcome, time to first byte and end to end,
  requests in flight, engine errors by role, engine and kind.
* ``GET /health`` from what the proxy saw: 503 when a role has no engine,
  when every engine of a role failed its last request, or while two engines
  disagree (a :class:`~.errors.DeploymentFault`).
* ``Server-Timing`` on each answer: the prefill request, the decode request
  until its answer started, and the engines' own phases (``_serve.timing``).

A client that disconnects cancels its request's scope: the request to the
decode engine is closed, which cancels that engine's pull or decoding (before
the pull, the decode engine abandons the prefill's blocks). So does one that
stops reading, once the send timeout resets its connection
(:func:`~.binding.bind_listener`; counted as ``stalled``). An engine that
fails fails only the requests it held: the client gets a JSON error that
names the engine; the proxy goes on with the others.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import attrs
import httpx2
import trio
from prometheus_client import generate_latest

from trio_pd._exception_groups import unwrapped_errors
from trio_pd._serve import defaults
from trio_pd._serve.asgi import (
    Receive,
    RequestBody,
    Scope,
    Send,
    SendWatch,
    cancel_on_disconnect,
    read_json,
    send_event,
    send_json,
    send_text,
    trivial_lifespan,
)
from trio_pd._serve.binding import SEND_TIMEOUT
from trio_pd._serve.defaults import HOLD_MARGIN, MAX_ATTEMPTS, REPREFILLS
from trio_pd._serve.discovery import EngineSet as RegisteredEngines
from trio_pd._serve.dispatch import (
    KV_PARAMS,
    MOST_PARAMS_WITHIN,
    PARAMS_WITHIN_HEADER,
    first_line,
    second_line,
)
from trio_pd._serve.errors import (
    DeploymentFault,
    ExposureEnded,
    HTTPError,
    StreamStalled,
    error_status,
    http_error,
)
from trio_pd._serve.keys import BearerKeys, bearer_header
from trio_pd._serve.metrics import ProxyMetrics
from trio_pd._serve.openai import (
    GenerationRequest,
    parse_chat_request,
    parse_completions_request,
    request_id_from_headers,
)
from trio_pd._serve.prefill_channel import open_prefill_channels
from trio_pd._serve.prefilling import (
    BODY_SENT,
    REQUEST_ID_HEADER,
    Prefiller,
    judge,
    relayed_error,
    unavailable,
)
from trio_pd._serve.routing import EngineSet, url_problem
from trio_pd._serve.timing import PhaseTimes


@attrs.frozen(kw_only=True)
class ProxyTimeouts:
    """The proxy's per-phase deadlines, in seconds.

    Attributes:
        connect: connecting to an engine (a connection refused or not made
            in time: the next engine is tried); a decode engine's is cut to
            what the exposure's lease leaves (:mod:`.defaults`).
        prefill: the whole prefill request, from sending it to its answer.
        first_byte: a decode request, from sending it until its response
            starts (for a request that does not stream, the whole answer).
        idle: the longest gap between two chunks of a decode stream.
    """

    connect: float = defaults.CONNECT_TIMEOUT
    prefill: float = defaults.PREFILL_TIMEOUT
    first_byte: float = defaults.FIRST_BYTE_TIMEOUT
    idle: float = defaults.IDLE_TIMEOUT


def open_client(timeouts: ProxyTimeouts = ProxyTimeouts()) -> httpx2.AsyncClient:
    """The proxy's HTTP client: no cap on connections (the engines' own
    admission decides what they take); idle ones closed before the engines
    close them (:data:`~.defaults.CLIENT_KEEP_ALIVE`). It bounds connecting and writing;
    reads are bounded by the proxy per phase (prefill, first byte, each gap
    in a stream), so no read timeout cuts a phase short."""
    return httpx2.AsyncClient(
        timeout=httpx2.Timeout(connect=timeouts.connect, read=None, write=timeouts.idle, pool=None),
        limits=httpx2.Limits(
            max_connections=None,
            max_keepalive_connections=512,
            keepalive_expiry=defaults.CLIENT_KEEP_ALIVE,
        ),
    )


logger = logging.getLogger("trio_pd.proxy")

MODELS_ASKED = 4
"""The most engines of each role ``GET /v1/models`` asks (at once)."""

BODY_TIMEOUT = 30.0
"""How long a client may take to send a request's body (``--body-timeout``): then 408."""

MAX_CLIENT_REQUESTS = 64
"""The most requests one client address may have open at once
(``--max-client-requests``; 0: no cap): then 429 at once. ``/health`` and
``/metrics`` are not counted."""

DISPATCHES = ("sequential", "concurrent")
"""How the proxy sends a request's decode request (``--dispatch``): once the
prefill answered, or at once, its parameters following (:mod:`.dispatch`)."""

DISPATCH = "sequential"
"""The proxy's default dispatch: sequential, the simpler path. Concurrent
dispatch was measured no faster on the 2-core machine (time to first token
at 1 client over one engine's: +11.4 against +11.2 ms sequential in one full
run, +8.2 against +8.7 ms in another; docs/performance.md, benchmark 11) and
strands an exposure for its lease when a decode engine dies during the
prefill; it is ``--dispatch concurrent``. (A decode-first deployment, with
no proxy, measured +4.7 ms in the second run.)"""

EXPOSURE_ENDED = "exposure_ended"
"""The ``code`` of a decode engine's answer when the exposure it was to read ended."""

ROUTES = {
    "/v1/completions": parse_completions_request,
    "/v1/chat/completions": parse_chat_request,
}
"""The generation routes the proxy disaggregates, and how each body is checked."""


class Proxy:
    """The P/D proxy's ASGI application and its routing state.

    Args:
        prefill, decode: the engines' base URLs (may start empty and change:
            :meth:`set_engines`).
        client: the HTTP client (owned by the caller: close it after the
            proxy); :func:`open_client` makes a suitable one.
        max_model_len: the most tokens (prompt plus ``max_tokens``) every
            engine can hold: longer requests are a 400 before any prefill.
        timeouts: the per-phase deadlines (the client's own timeouts should
            match: :func:`open_client`).
        send_timeout: the listener's (:func:`~.binding.bind_listener`): a
            request cut off after waiting for its client counts as ``stalled``.
        api_keys: the client keys: ``/v1/*`` answers 401 to a request
            without one of them (``None``: open to anyone who can connect).
        internal_key: the deployment's internal key, sent to the engines
            (which refuse ``/v1/*`` without it, when they have one).
        hold_margin: what must be left of an exposure's lease once the
            proxy connected to a decode engine (for that engine to hold it);
            :data:`~.defaults.HOLD_MARGIN`.
        max_attempts: the most engines of a role one request tries
            (engines that refused lately are not among them).
        body_timeout: how long a request's body may take to arrive (408 then).
        max_client_requests: the most requests open at once from one
            client address (429 then; 0: no cap).
        dispatch: ``"concurrent"``: each decode request is sent with its
            prefill request, its parameters following as a second line of
            its body (:mod:`.dispatch`; the engines must be
            ``trio-pd engine`` processes); ``"sequential"``: once the prefill answered.
    """

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        client: httpx2.AsyncClient,
        *,
        max_model_len: int | None = None,
        timeouts: ProxyTimeouts = ProxyTimeouts(),
        send_timeout: float = SEND_TIMEOUT,
        api_keys: BearerKeys | None = None,
        internal_key: str | None = None,
        hold_margin: float = HOLD_MARGIN,
        max_attempts: int = MAX_ATTEMPTS,
        body_timeout: float = BODY_TIMEOUT,
        max_client_requests: int = MAX_CLIENT_REQUESTS,
        dispatch: str = DISPATCH,
    ):
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}")
        check_dispatch(dispatch, timeouts, max_attempts)
        self._dispatch = dispatch
        self._max_attempts = max_attempts
        self._body_timeout = body_timeout
        self._max_client_requests = max_client_requests
        self._client_requests: dict[str, int] = {}  # (open requests by client address)
        self._faults: dict[tuple[str, str], str] = {}  # (prefill, decode): the last refusal
        self._max_model_len = max_model_len
        self._hold_margin = hold_margin
        self._engines = {"prefill": EngineSet(), "decode": EngineSet()}
        self._client = client
        self._timeouts = timeouts
        self._send_timeout = send_timeout
        self._api_keys = api_keys
        self._upstream_headers = bearer_header(internal_key) if internal_key else {}
        self.metrics = ProxyMetrics()
        self.accepting = True
        self.membership_problem: str | None = None
        """Set by whoever keeps the engine sets (etcd): shown by /health."""
        self._prefiller = Prefiller(
            self._engines["prefill"],
            client,
            prefill_timeout=timeouts.prefill,
            max_attempts=max_attempts,
            headers=self._upstream_headers,
            count_error=self._counter("prefill"),
        )
        self.set_engines("prefill", prefill)
        self.set_engines("decode", decode)

    def set_engines(self, role: str, engines: Sequence[str]) -> None:
        """Route ``role``'s requests to ``engines`` from now on (a URL the
        HTTP client could not build a request to is left out, and logged)."""
        usable = []
        for engine in engines:
            problem = url_problem(engine)
            if problem is None:
                usable.append(engine.rstrip("/"))
            else:
                logger.warning("%s engine %r left out: %s", role, engine, problem)
        self._engines[role].update(usable)

    def engines(self, role: str) -> list[str]:
        return self._engines[role].engines

    def follow(self, engines: RegisteredEngines) -> None:
        """Route to the registered ``engines`` from now on (what
        :meth:`~.discovery.Membership.watch_engines` reports). A role with
        no live engine (keys deleted, leases expired) is empty: requests get
        a 503 naming it and ``/health`` says so. Only while the membership
        itself is unreachable (``engines.problem``, shown by ``/health`` as
        :attr:`membership_problem`) does an empty role keep its last view."""
        for role, urls in (("prefill", engines.prefill), ("decode", engines.decode)):
            if urls or engines.problem is None:
                self.set_engines(role, urls)
        self.membership_problem = engines.problem

    def app(self) -> Callable[[Scope, Receive, Send], Any]:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "lifespan":
                # (the prefill channels live as long as the server: requests
                # go over an engine's once its HTTP answer named it)
                async with open_prefill_channels() as channels:
                    self._prefiller.channels = channels
                    try:
                        await trivial_lifespan(receive, send)
                    finally:
                        self._prefiller.channels = None
                return
            if scope["type"] != "http":
                return
            method, path = scope["method"], scope["path"]
            request_id = request_id_from_headers(scope.get("headers", []))
            headers = [(REQUEST_ID_HEADER.encode(), request_id.encode())]
            started = False
            # (an answer that starts before the body was read reads it first:
            # the connection then takes the client's next request)
            body = RequestBody(receive, scope)
            receive, send = body, body.answering(send)

            async def sending(message: dict[str, Any]) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            counted = path not in ("/health", "/metrics")
            address = str((scope.get("client") or ("?",))[0])
            if counted:
                self._client_requests[address] = self._client_requests.get(address, 0) + 1
            try:
                if counted and 0 < self._max_client_requests < self._client_requests[address]:
                    raise HTTPError(
                        429,
                        f"more than {self._max_client_requests} requests open from {address} "
                        "(--max-client-requests)",
                        "too_many_requests",
                        retry_after=1,
                    )
                if self._api_keys is not None and self._api_keys.guards(path):
                    self._api_keys.check(scope.get("headers", []))
                if method == "POST" and path in ROUTES:
                    await self._generate(path, request_id, receive, sending)
                elif path == "/v1/models" or path.startswith("/v1/models/"):
                    if method != "GET":
                        error = HTTPError(
                            405,
                            f"{method} {path[:200]} is not allowed (use GET)",
                            "method_not_allowed",
                        )
                        error.headers.append((b"allow", b"GET"))
                        raise error
                    await self._models(path, sending, headers)
                elif (method, path) == ("GET", "/health"):
                    await self._health(send)
                elif (method, path) == ("GET", "/metrics"):
                    text = generate_latest(self.metrics.registry).decode()
                    await send_text(send, 200, text, "text/plain; version=0.0.4")
                elif path in (*ROUTES, "/health", "/metrics"):
                    allowed = "POST" if path in ROUTES else "GET"
                    error = HTTPError(
                        405, f"{method} {path} is not allowed (use {allowed})", "method_not_allowed"
                    )
                    error.headers.append((b"allow", allowed.encode()))
                    raise error
                else:
                    raise HTTPError(404, f"no route {scope['method']} {scope['path']}", "not_found")
            except HTTPError as exc:
                if not started:
                    await send_json(send, exc.status, exc.body, [*exc.headers, *headers])
            except Exception as exc:
                # A bug: answered in the same JSON shape (never hypercorn's bare 500).
                logger.exception("request %s: internal error", request_id)
                error = http_error(exc, row_of=Exception, request_id=request_id)
                if not started:
                    await send_json(send, error.status, error.body, [*error.headers, *headers])
                else:  # (a stream had started: its last event says so)
                    await send_event(send, json.dumps(error.body), last=True)
            finally:
                if counted:
                    self._client_requests[address] -= 1
                    if not self._client_requests[address]:
                        del self._client_requests[address]

        return app

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body, from what the proxy saw (see
        docs/operations.md): ``ok``; ``draining``; ``no engines`` (``missing``:
        the roles with none); ``failing`` (``failing``: the roles whose every
        engine failed its last request); ``degraded`` (``faults``: pairs of
        engines that disagree, until a request between them succeeds)."""
        health: dict[str, Any] = {
            "status": "ok",
            "prefill": len(self.engines("prefill")),
            "decode": len(self.engines("decode")),
        }
        if self.membership_problem is not None:
            health["membership"] = self.membership_problem
        missing = [role for role in ("prefill", "decode") if not health[role]]
        now = trio.current_time()
        failing = [role for role, engines in self._engines.items() if engines.failing(now)]
        faults = self.faults()
        if missing:
            health["missing"] = missing
        if failing:
            health["failing"] = failing
        if faults:
            health["faults"] = faults
        if not self.accepting:
            health["status"] = "draining"
        elif missing:
            health["status"] = "no engines"
        elif failing:
            health["status"] = "failing"
        elif faults:
            health["status"] = "degraded"
        return (200 if health["status"] == "ok" else 503), health

    def faults(self) -> list[dict[str, str]]:
        """The pairs of engines (still in the sets) whose last request failed
        as a :class:`~.errors.DeploymentFault`."""
        prefill, decode = set(self.engines("prefill")), set(self.engines("decode"))
        return [
            {"prefill": p, "decode": d, "error": why}
            for (p, d), why in sorted(self._faults.items())
            if p in prefill and d in decode
        ]

    async def _models(self, path: str, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """``GET /v1/models`` (and ``/v1/models/{id}``): the models the engines
        list, from their own answers (up to :data:`MODELS_ASKED` engines of each
        role, asked at once, each within ``--connect-timeout`` + ``--idle-timeout``);
        a model listed by several engines once, with the smallest ``max_model_len``."""
        cards: dict[str, dict[str, Any]] = {}

        async def ask(engine: str) -> None:
            with trio.move_on_after(self._timeouts.connect + self._timeouts.idle):
                try:
                    response = await self._client.get(
                        f"{engine}/v1/models", headers=self._upstream_headers
                    )
                    listed = json.loads(response.content)["data"] if response.is_success else []
                except (httpx2.HTTPError, ValueError, KeyError, TypeError, RecursionError):
                    return  # (an engine that cannot say: the others may)
                for card in listed if isinstance(listed, list) else []:
                    if not (isinstance(card, dict) and isinstance(card.get("id"), str)):
                        continue
                    known = cards.setdefault(card["id"], card)
                    lengths = [c.get("max_model_len") for c in (known, card)]
                    ints = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool)]
                    if len(ints) == 2:
                        known["max_model_len"] = min(ints)

        async with trio.open_nursery() as nursery:
            for role in ("decode", "prefill"):
                for engine in self._engines[role].candidates(trio.current_time(), MODELS_ASKED):
                    nursery.start_soon(ask, engine)
        if not cards:
            raise HTTPError(503, "no engine listed its models", "unavailable", retry_after=1)
        if path == "/v1/models":
            await send_json(send, 200, {"object": "list", "data": list(cards.values())}, headers)
            return
        model = path.removeprefix("/v1/models/")
        if model not in cards:
            raise HTTPError(
                404,
                f"The model `{model[:200]}` does not exist",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )
        await send_json(send, 200, cards[model], headers)

    async def _health(self, send: Send) -> None:
        status, health = self.health()
        await send_json(send, status, health)

    async def _generate(self, path: str, request_id: str, receive: Receive, send: Send) -> None:
        """A completions or chat request: prefill on one engine, decode on another."""
        started = trio.current_time()
        outcome = "error"
        self.metrics.in_flight.inc()
        try:
            body: dict[str, Any] | None = None
            with trio.move_on_after(self._body_timeout):
                body = await read_json(receive)
            if body is None:
                raise HTTPError(
                    408,
                    f"the request's body did not arrive within {self._body_timeout:g} s "
                    "(--body-timeout)",
                    "invalid_request_error",
                )
            if isinstance(body, dict):
                # The proxy sets kv_transfer_params itself (a client's own never
                # reach an engine): the body is checked without them, so a
                # request is checked the same whatever the client put there
                # (``do_remote_decode`` would skip ``min_tokens``, say).
                body = {key: value for key, value in body.items() if key != KV_PARAMS}
            # A bad request is a 400 here, before any engine does work for it.
            parsed: GenerationRequest = ROUTES[path](body)
            prompt, max_tokens = parsed.prompt, parsed.max_tokens
            total = len(prompt) + max_tokens
            if self._max_model_len is not None and total > self._max_model_len:
                raise HTTPError(
                    400,
                    f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} "
                    f"tokens, over the deployment's context of {self._max_model_len}",
                    "invalid_request_error",
                    param="max_tokens",
                )
            if not self.accepting:
                raise HTTPError(503, "the proxy is draining", "unavailable", retry_after=1)
            for role in ("prefill", "decode"):  # (no work for a request that cannot be served)
                self._check_available(role)
            outcome = "disconnected"

            async def send_tracked(message: dict[str, Any]) -> None:
                nonlocal outcome
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    # Answered: hypercorn reports the end of the exchange as a
                    # disconnect, which may cancel this very send.
                    outcome = "ok"
                await send(message)

            times = PhaseTimes()
            sending = SendWatch(send_tracked)
            async with cancel_on_disconnect(receive):
                await self._disaggregate(path, request_id, body, sending, started, times)
            if outcome == "disconnected" and sending.stalled(self._send_timeout):
                outcome = "stalled"
                sending.log_stall(
                    logger, request_id, self._send_timeout, "its decode request closed"
                )
        except HTTPError as exc:
            outcome = _outcome(exc.status)
            logger.warning("request %s: %d %s", request_id, exc.status, exc)
            raise
        except _EndedInStream as exc:  # (answered: the stream's last event)
            outcome = _outcome(exc.error.status)
            logger.warning("request %s: %d mid-stream: %s", request_id, exc.error.status, exc)
        except Exception:
            outcome = "server_error"
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()
            self.metrics.seconds.observe(trio.current_time() - started)

    async def _disaggregate(
        self,
        path: str,
        request_id: str,
        body: dict[str, Any],
        send: Send,
        started: float,
        times: PhaseTimes,
    ) -> None:
        """Prefill ``body`` on one engine, decode it on another; prefill it
        again, once, if its exposure ended before a decode engine read it
        (``exposure_ended``) or too little of its lease was left to start a
        decode on the next engine (see :mod:`.defaults`).

        With sequential dispatch the decode request starts once the prefill
        answered; with concurrent dispatch (:mod:`.dispatch`) both start at
        once, and the prefill's parameters follow the decode request as its
        body's second line. Either way a prefill that fails fails the
        request (with concurrent dispatch, the decode request is cancelled:
        its connection closes, and the decode engine lets go of what it
        admitted), and a decode request that cannot start (no decode engine
        takes the connection) cancels a prefill still running.

        The second round runs within the request's deadline: what one round
        may take (``prefill`` + ``first_byte``) from the request's arrival.
        """
        deadline = math.inf
        for round_ in range(1 + REPREFILLS):
            prefilled = _Prefilled()
            try:
                if self._dispatch == "sequential":
                    await self._prefill(path, request_id, body, times, prefilled, deadline)
                    await self._decode(
                        path, request_id, body, send, started, times, prefilled, deadline
                    )
                else:
                    async with unwrapped_errors(), trio.open_nursery() as nursery:
                        nursery.start_soon(
                            self._prefill, path, request_id, body, times, prefilled, deadline
                        )
                        await self._decode(
                            path,
                            request_id,
                            body,
                            send,
                            started,
                            times,
                            prefilled,
                            deadline,
                            concurrent=True,
                        )
                return
            except _PrefillAgain as again:
                if round_ == REPREFILLS:
                    if again.error is not None:
                        raise again.error from None
                    raise self._engine_error("decode", again.engine, ExposureEnded(again)) from None
                self.metrics.reprefills.labels(again.reason).inc()
                logger.warning("request %s: prefilled again: %s", request_id, again)
                deadline = started + self._timeouts.prefill + self._timeouts.first_byte

    async def _prefill(
        self,
        path: str,
        request_id: str,
        body: dict[str, Any],
        times: PhaseTimes,
        prefilled: _Prefilled,
        deadline: float = math.inf,
    ) -> None:
        """Set ``prefilled`` to the KV of ``body``'s prompt, from a prefill
        engine that answers (:meth:`.prefilling.Prefiller.prefill`: which
        engines it tries, and what it raises).

        ``times`` gets the phase ``prefill`` (every attempt) and the answering
        engine's phases. Each attempt ends at ``--prefill-timeout`` or
        ``deadline``, the earlier.
        """
        answer = await self._prefiller.prefill(
            path, request_id, body, times, deadline=deadline, trace=prefilled.trace
        )
        prefilled.set(answer.kv, answer.expires, answer.engine)

    async def _decode(
        self,
        path: str,
        request_id: str,
        body: dict[str, Any],
        send: Send,
        started: float,
        times: PhaseTimes,
        prefilled: _Prefilled,
        deadline: float = math.inf,
        *,
        concurrent: bool = False,
    ) -> None:
        """Relay ``body``'s decoding from a decode engine that can be reached,
        with the parameters of ``prefilled`` (set already with sequential
        dispatch; with ``concurrent`` dispatch they follow as the body's
        second line once it is set).

        One that refuses the connection (it died, say) is passed over for
        the next: it never saw the request, and the prefill engine's
        exposure is still there for another one to read -- while its lease
        (it runs out at ``prefilled.expires``) lasts. Once the prefill
        answered, each connection must be made by ``expires - hold_margin``,
        so that the decode engine holds the exposure before the lease runs
        out: its connect timeout is cut to that, and once nothing is left
        the next engine is not tried (:class:`_PrefillAgain`). Nor is it when
        the decode engine answers ``exposure_ended`` (the exposure is gone
        for every engine).
        """
        engines = self._engines["decode"]
        failure: HTTPError | None = None
        if concurrent:
            # The prefill request goes first (the proxy's one thread sends one
            # request at a time): the decode request is sent while the prefill
            # engine works, not in its way.
            await prefilled.sent.wait()
        for engine in engines.candidates(trio.current_time(), self._max_attempts):
            connect = self._timeouts.connect
            if prefilled.answered.is_set():
                left = prefilled.expires - self._hold_margin - trio.current_time()
                connect = min(connect, left)
            if connect <= 0:
                raise self._lease_too_short(engine, prefilled, failure)
            with engines.attempt(engine):
                try:
                    await self._decode_on(
                        engine,
                        path,
                        request_id,
                        body,
                        send,
                        started,
                        times,
                        connect,
                        deadline,
                        prefilled,
                        concurrent,
                    )
                except _Refused as exc:
                    engines.refused(engine, trio.current_time())
                    failure = exc.error
                    continue
            return
        raise failure or self._unavailable("decode")

    def _lease_too_short(
        self, engine: str, prefilled: _Prefilled, failure: HTTPError | None
    ) -> _PrefillAgain:
        left = max(prefilled.expires - trio.current_time(), 0)
        return _PrefillAgain(
            "lease",
            f"{left:.2f} s of the exposure's lease left, {self._hold_margin:g} s "
            f"needed to start a decode on {engine}",
            engine=engine,
            error=failure
            or HTTPError(
                503,
                f"no decode request could start within the exposure's lease "
                f"(a hold needs {self._hold_margin:g} s of it)",
                "unavailable",
                retry_after=1,
            ),
        )

    async def _decode_on(
        self,
        engine: str,
        path: str,
        request_id: str,
        body: dict[str, Any],
        send: Send,
        started: float,
        times: PhaseTimes,
        connect: float,
        deadline: float,
        prefilled: _Prefilled,
        concurrent: bool,
    ) -> None:
        streaming = False
        timeouts = self._timeouts
        headers = {REQUEST_ID_HEADER: request_id, **self._upstream_headers}
        # (connected within the lease, see _decode; reads bounded per phase here)
        timeout = httpx2.Timeout(connect=connect, read=None, write=timeouts.idle, pool=None)
        # The answer's deadline: from when the decode request is whole (its
        # parameters sent); until then the prefill's own deadline bounds it.
        answer_by = trio.CancelScope()
        first_byte = 0.0
        sent = 0.0  # (times' clock: when the parameters went)

        def parameters_sent() -> None:
            nonlocal first_byte, sent
            first_byte = max(min(timeouts.first_byte, deadline - trio.current_time()), 0)
            answer_by.deadline = trio.current_time() + first_byte
            sent = times.clock()

        connected = False  # (concurrent: line 1 is written, the engine has the request)

        def answered() -> None:
            # The prefill answered while this request was still connecting:
            # the connection is cut to what the exposure's lease leaves (see
            # _decode), as if its connect timeout had been that.
            if not connected:
                answer_by.deadline = min(answer_by.deadline, prefilled.expires - self._hold_margin)

        if not concurrent:  # (the whole request at once)
            parameters_sent()
            request = self._client.build_request(
                "POST",
                f"{engine}{path}",
                json={**body, KV_PARAMS: prefilled.kv},
                headers=headers,
                timeout=timeout,
            )
        else:
            # (the decode engine's deadline for line 2: the most the prefill's
            # attempts take; the proxy itself cancels this request sooner if the
            # prefill fails)
            most = self._max_attempts * (timeouts.connect + timeouts.prefill)
            within = min(most, deadline - trio.current_time()) + PARAMS_SLACK
            headers[PARAMS_WITHIN_HEADER] = f"{within:.3f}"
            headers["content-type"] = "application/x-ndjson"

            async def content() -> AsyncIterator[bytes]:
                nonlocal connected
                yield first_line(body)
                # (line 1 is written: the decode engine has the request)
                connected = True
                answer_by.deadline = math.inf
                await prefilled.answered.wait()
                if trio.current_time() > prefilled.expires - self._hold_margin:
                    # (connected too late in the lease: see _decode)
                    raise self._lease_too_short(engine, prefilled, None)
                parameters_sent()
                yield second_line(prefilled.kv)

            request = self._client.build_request(
                "POST", f"{engine}{path}", content=content(), headers=headers, timeout=timeout
            )
        response: httpx2.Response | None = None
        ended: HTTPError | None = None  # (an error after the 200 was sent)
        prefilled.on_answer.append(answered)
        try:
            with answer_by:
                response = await self._client.send(request, stream=True)
            if response is None and concurrent and not connected:
                cut = httpx2.ConnectTimeout("not connected within the exposure's lease")
                raise _Refused(self._engine_error("decode", engine, cut))
            if response is None:
                raise trio.TooSlowError
            times.add("decode", (times.clock() - sent) * 1e3)
            if response.status_code != 200:
                self._judge("decode", engine, response.status_code)
                try:
                    with trio.fail_after(timeouts.idle):  # (its error body, too)
                        text = (await response.aread()).decode(errors="replace")
                except trio.TooSlowError:
                    raise StreamStalled(
                        f"its {response.status_code} answer stalled for {timeouts.idle:g} s"
                    ) from None
                relayed = relayed_error("decode", engine, response.status_code, text)
                param = relayed.body["error"].get("param")
                if response.status_code == 400 and str(param).startswith(f"{KV_PARAMS}."):
                    # (the proxy set them, from the prefill's answer: not the client's fault)
                    message = str(relayed).removeprefix(f"decode engine {engine}: ")
                    raise DeploymentFault(f"{message} ({param})")
                if response.status_code == 409 and _code(relayed) == EXPOSURE_ENDED:
                    # (the exposure is gone: no other decode engine can read it)
                    message = str(relayed).removeprefix(f"decode engine {engine}: ")
                    raise _PrefillAgain(EXPOSURE_ENDED, message, engine=engine)
                raise relayed
            self._engines["decode"].answered(engine)
            self._faults.pop((prefilled.engine, engine), None)
            times.relay("decode.", response.headers.get("server-timing"))
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (
                            b"content-type",
                            response.headers.get("content-type", "application/json").encode(),
                        ),
                        (REQUEST_ID_HEADER.encode(), request_id.encode()),
                        times.header(),
                    ],
                }
            )
            streaming = True
            first = True
            async with aclosing(response.aiter_raw()) as chunks:
                while True:
                    try:
                        with trio.fail_after(self._timeouts.idle):
                            chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    except trio.TooSlowError:
                        raise StreamStalled(
                            f"no part of the answer for {self._timeouts.idle:g} s"
                        ) from None
                    if first:
                        self.metrics.first_byte.observe(trio.current_time() - started)
                        first = False
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            raise _Refused(self._engine_error("decode", engine, exc)) from None
        except DeploymentFault as exc:
            self._faults[(prefilled.engine, engine)] = str(exc)
            raise self._engine_error(
                "decode", engine, exc, prefill_engine=prefilled.engine
            ) from None
        except trio.TooSlowError as exc:
            self._engines["decode"].failed(engine, trio.current_time())
            raise self._engine_error(
                "decode",
                engine,
                exc,
                phase="not even the first byte of an answer",
                seconds=first_byte,
            ) from None
        except (httpx2.HTTPError, StreamStalled) as exc:
            self._engines["decode"].failed(engine, trio.current_time())
            error = self._engine_error("decode", engine, exc)
            if not streaming:
                raise error from None
            ended = error
        finally:
            prefilled.on_answer.remove(answered)
            if response is not None:
                with trio.CancelScope(shield=True):
                    await response.aclose()
        if ended is not None:
            # Mid-stream: the status is sent; end the stream with an error event.
            await send_event(send, json.dumps(ended.body), last=True)
            raise _EndedInStream(ended)

    def _engine_error(self, role: str, engine: str, exc: BaseException, **fields: Any) -> HTTPError:
        """The answer to ``exc`` from ``role``'s ``engine`` (its row of
        :data:`~.errors.ERROR_STATUSES`), counted in ``engine_errors``."""
        kind = error_status(exc).counted
        if kind is not None:
            self.metrics.engine_errors.labels(role, engine, kind).inc()
        return http_error(exc, role=role, engine=engine, **fields)

    def _judge(self, role: str, engine: str, status: int) -> None:
        """``role``'s ``engine`` answered an error ``status``
        (:meth:`.prefilling.Prefiller.judge`)."""
        judge(self._engines[role], engine, status, self._counter(role))

    def _counter(self, role: str) -> Callable[[str, str], None]:
        """Counts ``role``'s engine errors in ``engine_errors``, by engine and kind."""

        def count(engine: str, kind: str) -> None:
            self.metrics.engine_errors.labels(role, engine, kind).inc()

        return count

    def _check_available(self, role: str) -> None:
        """Raises the 503 of :meth:`_unavailable` unless ``role`` has an engine to try now."""
        engines = self._engines[role]
        if not engines.engines or engines.retry_in(trio.current_time()) > 0:
            raise self._unavailable(role)

    def _unavailable(self, role: str) -> HTTPError:
        """The 503 for a request no engine of ``role`` can take
        (:func:`.prefilling.unavailable`)."""
        return unavailable(self._engines[role], role)


PARAMS_SLACK = 1.0
"""Seconds a decode engine waits for its second line beyond the prefill's
deadline (concurrent dispatch): the proxy gives up first, and says why."""


def check_dispatch(dispatch: str, timeouts: ProxyTimeouts, max_attempts: int) -> None:
    """Raises ValueError (naming the flags) if ``dispatch`` is none of
    :data:`DISPATCHES` (``trio-pd serve``'s ``decode-first`` is no proxy's),
    or if with ``dispatch`` concurrent
    the prefill's attempts may outlast what a decode engine waits for a
    second line (:data:`~.dispatch.MOST_PARAMS_WITHIN`): it would answer 408
    while the prefill still ran (an infinite ``--prefill-timeout`` was a
    header the engines refuse: every request a 400)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"--dispatch {dispatch!r}: a proxy dispatches {' or '.join(DISPATCHES)}")
    if dispatch != "concurrent":
        return
    most = max_attempts * (timeouts.connect + timeouts.prefill) + PARAMS_SLACK
    if not most <= MOST_PARAMS_WITHIN:  # (NaN, inf too)
        raise ValueError(
            f"--max-attempts x (--connect-timeout + --prefill-timeout) + {PARAMS_SLACK:g} s "
            f"= {most:g} s: over the {MOST_PARAMS_WITHIN:g} s that a decode engine waits for "
            "a decode request's second line (--dispatch concurrent); shorten them, or use "
            "--dispatch sequential"
        )


class _Prefilled:
    """What a prefill answered (its parameters, when their lease runs out,
    the engine), once :attr:`answered` is set."""

    def __init__(self) -> None:
        self.sent = trio.Event()  # (the prefill request is sent whole, or answered)
        self.answered = trio.Event()
        self.kv: dict[str, Any] = {}
        self.expires = math.inf
        self.engine = ""
        self.on_answer: list[Callable[[], None]] = []  # (called once it is set)

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        """The prefill request's progress (httpx2's ``trace`` extension)."""
        if event == BODY_SENT:
            self.sent.set()

    def set(self, kv: dict[str, Any], expires: float, engine: str) -> None:
        self.kv, self.expires, self.engine = kv, expires, engine
        self.sent.set()
        self.answered.set()
        for call in self.on_answer:
            call()


class _PrefillAgain(Exception):
    """The request's exposure cannot be read by another decode engine: it
    ended (``reason`` ``"exposure_ended"``, said by ``engine``) or too little
    of its lease is left for ``engine`` (``"lease"``). ``error`` is the
    client's answer if the proxy does not prefill again (``None``: the
    :class:`~.errors.ExposureEnded` row)."""

    def __init__(
        self, reason: str, message: str, *, engine: str, error: HTTPError | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.engine = engine
        self.error = error


class _EndedInStream(Exception):
    """A decode answer failed after its 200 was sent: the stream's last event
    was ``error`` (the request is answered; counted by ``error``'s status)."""

    def __init__(self, error: HTTPError) -> None:
        super().__init__(str(error))
        self.error = error


class _Refused(Exception):
    """A decode engine refused the connection (``error`` says so, for the client)."""

    def __init__(self, error: HTTPError) -> None:
        super().__init__(str(error))
        self.error = error


def _code(error: HTTPError) -> object:
    """The ``code`` of an error answer."""
    return error.body["error"].get("code")


def _outcome(status: int) -> str:
    if status == 503:
        return "overloaded"
    if status == 504:
        return "timeout"
    if 400 <= status < 500:
        return "client_error"
    return "engine_error"
