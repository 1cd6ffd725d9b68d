"""Asking a prefill engine for a prompt's KV: the request, which engine, its answer.

Both callers of a prefill engine use it: the proxy (:mod:`.proxy`) and a
decode-first engine (:func:`~.app.build_app`), which runs its requests'
prefill on a prefill engine itself. A :class:`Prefiller` sends the request
with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``
to the engine of its set with the fewest requests in flight -- over the
engine's prefill channel when the caller's :class:`~.prefill_channel.PrefillChannels`
has a connected one, else over HTTP -- and returns what the engine
answered: its ``kv_transfer_params`` (which carry the first token,
:data:`~.openai.FIRST_TOKEN_PARAM`), when their lease runs out, and the
engine.

Retries only where the request cannot have had an effect: an engine that
refuses the connection never saw it (the next is tried, the refusing one
backs off: :mod:`.routing`), nor did one that answers 503 (draining, or out
of KV blocks). Anything else fails the request, naming the engine: a
timeout, a broken connection, a 5xx (502), the engine's own 4xx (relayed),
an answer that is too long or has no parameters (502).

What it owns: nothing but its engine set's bookkeeping; the HTTP client and
the prefill channels are the caller's. A request that could not be written
whole to a channel, or that the engine closed the channel without reading,
did not run: it goes over HTTP in the same attempt. What it raises:
:class:`~.errors.HTTPError`, the client's answer. Cancelled with its
caller (the request's scope): the response is closed, shielded, on every
exit (a channel request sends a cancel).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import attrs
import httpx2
import trio

from trio_pd._serve.asgi import parse_json
from trio_pd._serve.defaults import (
    CLIENT_KEEP_ALIVE,
    CONNECT_TIMEOUT,
    IDLE_TIMEOUT,
    LEASE_INITIAL,
    MAX_ATTEMPTS,
)
from trio_pd._serve.dispatch import BODY_LIMIT, KV_PARAMS
from trio_pd._serve.errors import HTTPError, MalformedAnswer, error_status, http_error
from trio_pd._serve.keys import bearer_header
from trio_pd._serve.openai import LEASE_PARAM
from trio_pd._serve.prefill_channel import ChannelAnswer, PrefillChannels, open_prefill_channels
from trio_pd._serve.routing import EngineSet
from trio_pd._serve.timing import PhaseTimes

ANSWER_LIMIT = BODY_LIMIT // 2
"""The most bytes of a prefill engine's answer that are read (then: a 502
naming the engine). Its ``kv_transfer_params`` go on in a decode request's
body, whose limit (with the request's own fields) is
:data:`~.dispatch.BODY_LIMIT`; an engine's are a few hundred bytes."""

REQUEST_ID_HEADER = "x-request-id"

Trace = Callable[[str, dict[str, Any]], Any]
"""httpx2's ``trace`` extension: called with each step of a request."""

BODY_SENT = "http11.send_request_body.complete"
"""The step of ``trace`` that says the request was written whole (httpx2's
name; a request over a prefill channel reports it too, once its frame is
written)."""


@attrs.frozen
class Prefill:
    """A prefill engine's answer.

    Attributes:
        kv: its ``kv_transfer_params`` (checked by the decode engine that reads them).
        expires: when its exposure's lease runs out (``trio.current_time()``'s
            clock, counted from the answer: :func:`lease_of`).
        engine: the engine that answered.
    """

    kv: dict[str, Any]
    expires: float
    engine: str


class Prefiller:
    """Prefill requests to a set of prefill engines (see the module docstring).

    Args:
        engines: the prefill engines (the caller may change them while it runs).
        client: the HTTP client (the caller's: it bounds connecting and
            writing; a prefill's whole answer is bounded here).
        prefill_timeout: each attempt's deadline, from sending it to its answer.
        max_attempts: the most engines one request tries.
        headers: sent with every request (the deployment's internal key).
        count_error: ``(engine, kind)`` for each error an engine caused
            (``kind``: its row's ``counted``, or ``"status"`` for a 5xx, 401 or 403).
        caller: who sends the requests, in the error for an engine that
            refuses its internal key.
        channels: prefill channels to the engines (:mod:`.prefill_channel`):
            a request goes over its engine's when that is connected (the
            proxy sets them for its server's life, a decode-first engine
            at its start).
    """

    def __init__(
        self,
        engines: EngineSet,
        client: httpx2.AsyncClient,
        *,
        prefill_timeout: float,
        max_attempts: int,
        headers: dict[str, str] | None = None,
        count_error: Callable[[str, str], None] = lambda engine, kind: None,
        caller: str = "the proxy",
        channels: PrefillChannels | None = None,
    ) -> None:
        self.engines = engines
        self._caller = caller
        self._client = client
        self._prefill_timeout = prefill_timeout
        self._max_attempts = max_attempts
        self._headers = dict(headers or {})
        self._count_error = count_error
        self.channels = channels

    async def prefill(
        self,
        path: str,
        request_id: str,
        body: dict[str, Any],
        times: PhaseTimes,
        *,
        deadline: float = math.inf,
        trace: Trace | None = None,
    ) -> Prefill:
        """The KV of ``body``'s prompt, from the first prefill engine that answers.

        ``times`` gets the phase ``prefill`` (every attempt) and the answering
        engine's phases (``prefill.*``). Each attempt ends at the prefill
        timeout or ``deadline``, the earlier. ``trace`` follows the request's
        steps (the proxy's concurrent dispatch waits for its body to be sent).

        Raises:
            HTTPError: no engine answered, or the one that did failed or
                refused the request (see the module docstring).
        """
        request = {
            **body,
            "max_tokens": 1,
            "stream": False,
            KV_PARAMS: {"do_remote_decode": True},
        }
        if "max_completion_tokens" in body:  # (chat: it wins over max_tokens)
            request["max_completion_tokens"] = 1
        engines = self.engines
        failure: HTTPError | None = None
        # (as httpx2 encodes a json= body: compact, UTF-8, no NaN)
        encoded = json.dumps(
            request, ensure_ascii=False, separators=(",", ":"), allow_nan=False
        ).encode()
        for engine in engines.candidates(trio.current_time(), self._max_attempts):
            with engines.attempt(engine):
                limit = min(self._prefill_timeout, deadline - trio.current_time())
                try:
                    with times.phase("prefill"), trio.fail_after(max(limit, 0)):
                        response, content = await self._post(
                            engine,
                            path,
                            encoded,
                            {REQUEST_ID_HEADER: request_id, **self._headers},
                            trace,
                        )
                except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
                    engines.refused(engine, trio.current_time())
                    failure = self.error(engine, exc)
                    continue
                except trio.TooSlowError as exc:
                    engines.failed(engine, trio.current_time())
                    seconds = max(limit, 0)
                    raise self.error(engine, exc, phase="no answer", seconds=seconds) from None
                except httpx2.HTTPError as exc:
                    engines.failed(engine, trio.current_time())
                    raise self.error(engine, exc) from None
            if response.status_code == 503:
                engines.failed(engine, trio.current_time())
                failure = relayed_error("prefill", engine, 503, answer_text(content), self._caller)
                continue
            if response.status_code != 200:
                self.judge(engine, response.status_code)
                text = answer_text(content)
                raise relayed_error("prefill", engine, response.status_code, text, self._caller)
            answered = trio.current_time()
            try:
                kv = kv_of(content)
            except MalformedAnswer as exc:
                engines.failed(engine, trio.current_time())
                raise self.error(engine, exc) from None
            engines.answered(engine)
            times.relay("prefill.", response.headers.get("server-timing"))
            return Prefill(kv, answered + lease_of(kv), engine)
        raise failure or unavailable(engines, "prefill")

    def error(self, engine: str, exc: BaseException, **fields: Any) -> HTTPError:
        """The answer to ``exc`` from prefill ``engine`` (its row of
        :data:`~.errors.ERROR_STATUSES`), counted."""
        kind = error_status(exc).counted
        if kind is not None:
            self._count_error(engine, kind)
        return http_error(exc, role="prefill", engine=engine, **fields)

    def judge(self, engine: str, status: int) -> None:
        """``engine`` answered an error ``status``: counted, and remembered
        (:meth:`~.routing.EngineSet.failed`), when it is the engine's fault
        (a 5xx) or the deployment's (401, 403: the internal key); a 4xx is
        the request's."""
        judge(self.engines, engine, status, self._count_error)

    async def _post(
        self, engine: str, path: str, request: bytes, headers: dict[str, str], trace: Trace | None
    ) -> tuple[httpx2.Response | ChannelAnswer, bytes | None]:
        """POST ``request`` (JSON) to ``engine``: over its prefill channel when
        it has a connected one, else over HTTP (whose answer may name the
        channel's port). The answer, and its body -- ``None`` if it is over
        :data:`ANSWER_LIMIT` bytes. ``trace`` is told when the request is
        written whole (:data:`BODY_SENT`), over either.

        Raises:
            ChannelLost: the channel broke while the request waited.
            httpx2.HTTPError: the HTTP request failed.
        """
        channels = self.channels
        if channels is not None:

            async def written() -> None:  # (as httpx2 tells ``trace`` the body went)
                if trace is not None:
                    await trace(BODY_SENT, {})

            answer = await channels.post(engine, path, request, headers, written=written)
            if answer is not None:
                capped = answer.content if len(answer.content) <= ANSWER_LIMIT else None
                return answer, capped
        extensions = {} if trace is None else {"trace": trace}
        built = self._client.build_request(
            "POST",
            f"{engine}{path}",
            content=request,
            headers={"content-type": "application/json", **headers},
            extensions=extensions,
        )
        response = await self._client.send(built, stream=True)
        try:
            if channels is not None and response.status_code == 200:
                channels.learn(engine, response.headers)
            content = bytearray()
            async with aclosing(response.aiter_bytes()) as chunks:
                async for chunk in chunks:
                    content += chunk
                    if len(content) > ANSWER_LIMIT:
                        return response, None
            return response, bytes(content)
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()


@asynccontextmanager
async def open_prefiller(
    urls: Sequence[str],
    *,
    prefill_timeout: float,
    internal_key: str | None,
    caller: str,
    channels: bool = True,
    orphaned: Callable[[ChannelAnswer], None] | None = None,
) -> AsyncIterator[Prefiller]:
    """A :class:`Prefiller` for the prefill engines at ``urls`` with an HTTP
    client of its own (a decode-first engine's), and -- with ``channels`` --
    prefill channels to them (:mod:`.prefill_channel`; ``orphaned`` gets
    the answers that came after their caller stopped waiting), closed on exit.

    It sends ``internal_key`` (if any), bounds connecting
    (:data:`~.defaults.CONNECT_TIMEOUT`) and writing, and closes idle
    connections before the engines do (:data:`~.defaults.CLIENT_KEEP_ALIVE`); each prefill attempt
    ends at ``prefill_timeout``. ``caller`` names it in errors (an engine that
    refuses its key)."""
    timeout = httpx2.Timeout(connect=CONNECT_TIMEOUT, read=None, write=IDLE_TIMEOUT, pool=None)
    limits = httpx2.Limits(
        max_connections=None, max_keepalive_connections=64, keepalive_expiry=CLIENT_KEEP_ALIVE
    )
    async with (
        httpx2.AsyncClient(timeout=timeout, limits=limits) as client,
        open_prefill_channels(orphaned) as opened,
    ):
        yield Prefiller(
            EngineSet(urls),
            client,
            prefill_timeout=prefill_timeout,
            max_attempts=MAX_ATTEMPTS,
            headers=bearer_header(internal_key) if internal_key else {},
            caller=caller,
            channels=opened if channels else None,
        )


def judge(
    engines: EngineSet, engine: str, status: int, count_error: Callable[[str, str], None]
) -> None:
    """``engine`` of ``engines`` answered an error ``status``: see :meth:`Prefiller.judge`."""
    if status >= 500 or status in (401, 403):
        count_error(engine, "status")
        engines.failed(engine, trio.current_time())
    else:
        engines.answered(engine)


def unavailable(engines: EngineSet, role: str) -> HTTPError:
    """The 503 for a request no engine of ``role`` can take: it has none,
    or every one refused lately (``Retry-After``: when one is tried again)."""
    if not engines.engines:
        message = f"no {role} engine: none is registered"
        return HTTPError(503, message, "unavailable", retry_after=1, role=role)
    wait = engines.retry_in(trio.current_time())
    return HTTPError(
        503,
        f"no {role} engine: every one refused its last connection; the next is tried "
        f"again in {wait:.1f} s",
        "unavailable",
        retry_after=max(1, math.ceil(wait)),
        role=role,
    )


def lease_of(kv: dict[str, Any]) -> float:
    """How long (seconds) the exposure of a prefill answer's ``kv`` waits for
    a decode engine's hold: its ``remote_lease_initial`` (the prefill
    engine's ``--lease-initial``), or :data:`~.defaults.LEASE_INITIAL` when
    it does not say (another engine) or says something that is not a
    positive, finite number of seconds."""
    lease = kv.get(LEASE_PARAM) if isinstance(kv, dict) else None
    if isinstance(lease, int | float) and not isinstance(lease, bool) and lease > 0:
        return float(lease) if math.isfinite(lease) else LEASE_INITIAL
    return LEASE_INITIAL


def kv_of(content: bytes | None) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill engine's 200 answer (its body,
    ``None`` if it was too long).

    Raises:
        MalformedAnswer: the body is too long, not JSON, or has no such object.
    """
    if content is None:
        raise MalformedAnswer(f"over {ANSWER_LIMIT} bytes")
    try:
        answer = parse_json(content)
    except (ValueError, RecursionError) as exc:
        raise MalformedAnswer(f"not JSON ({type(exc).__name__}: {str(exc)[:100]})") from None
    kv = answer.get(KV_PARAMS) if isinstance(answer, dict) else None
    if not isinstance(kv, dict):
        raise MalformedAnswer(f"no {KV_PARAMS} object in {content[:200]!r}")
    return kv


def answer_text(content: bytes | None) -> str:
    """An error answer's body, as text (one over :data:`ANSWER_LIMIT` bytes: unread)."""
    if content is None:
        return f"(an answer over {ANSWER_LIMIT} bytes)"
    return content.decode(errors="replace")


_NOT_RELAYED = frozenset({"message", "type", "status", "kind", "retry_after"})
"""Keys of an engine's error body that the relay sets itself."""


def relayed_error(
    role: str, engine: str, status: int, text: str, caller: str = "the proxy"
) -> HTTPError:
    """An engine's error answer, for the client.

    A 4xx is the request's fault: relayed as is (the engine named) -- but
    not a 401 or 403: those refuse the *caller* (the proxy, or a decode-first
    engine: its internal key is not the engine's), so the client gets a 502
    saying so, not an "invalid API key" it can do nothing about. A 503 (the
    engine is overloaded or draining) stays a 503 with ``Retry-After``: the
    client may retry. Anything else is the engine failing: a 502.
    """
    try:
        error = json.loads(text)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError, RecursionError):
        error, message = {}, text
    if not isinstance(error, dict):
        error = {}
    if status in (401, 403):
        return HTTPError(
            502,
            f"{role} engine {engine} refused {caller} ({status}): its internal key "
            "is not this engine's (--internal-key-file / TRIO_PD_INTERNAL_KEY)",
            f"{role}_failed",
            engine=engine,
        )
    if 400 <= status < 500 or status == 503:
        extra = {k: v for k, v in error.items() if k not in _NOT_RELAYED}
        return HTTPError(
            status,
            f"{role} engine {engine}: {message}",
            str(error.get("type", f"{role}_failed")),
            retry_after=1 if status == 503 else None,
            **{"engine": engine, **extra},
        )
    return HTTPError(
        502, f"{role} engine {engine} failed: {status} {message}", f"{role}_failed", engine=engine
    )
