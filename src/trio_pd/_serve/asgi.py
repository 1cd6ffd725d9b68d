"""The little ASGI that the engine and the proxy need, trio-native.

hypercorn's trio worker runs ASGI applications on trio; the applications
here are three or four routes each, so they are plain ASGI callables rather
than a framework's: every request runs in hypercorn's task for it, in trio
nurseries and cancel scopes of its own, and a client that disconnects
cancels its request's scope (:func:`cancel_on_disconnect`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from trio_pd._exception_groups import unwrapped_errors
from trio_pd._serve.errors import BodyNotJSON, HTTPError, http_error

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

CANCEL_SCOPES = "trio_pd.cancel_scopes"
"""The ASGI extension of a transport that cancels a request itself when its
caller goes away (:func:`cancel_on_disconnect`)."""


def parse_json(data: bytes | bytearray | str) -> Any:
    """``data`` as one JSON document -- as :func:`json.loads` reads it, except
    that a number must be finite: Python's parser takes ``NaN``,
    ``Infinity`` and ``1e999`` (infinite), which JSON does not have, and
    which therefore could not be sent on (the proxy's HTTP client refuses
    them: that was an "internal error").

    Raises:
        ValueError: not JSON (:class:`RecursionError`: nested too deeply).
    """
    return json.loads(data, parse_constant=_not_finite, parse_float=_finite)


def _not_finite(text: str) -> Any:
    raise ValueError(f"{text} is not a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _not_finite(text[:20])
    return value


DRAIN_SECONDS = 0.5
"""How long an answer that did not read its request's body waits for the rest
of it (:meth:`RequestBody.finish`)."""

DRAIN_LIMIT = 1 << 20
"""How many bytes of such a body it reads at most (then: ``connection: close``)."""


CLOSE_AT_ONCE = frozenset({408, 413, 429})
"""Answers whose request's unread body is not waited for: too slow, too
large, too many requests (the connection closes after them)."""


class RequestBody:
    """A request's ``receive``, which knows whether the body was read to its
    end, and a ``send`` that reads the rest before an answer starts.

    hypercorn takes a client's next request on the same connection only if
    the request's body had come whole when the answer ended; otherwise it
    closes the connection, without saying so in the answer, and a client
    that had already sent its next request on it sees that one cut
    ("Server disconnected without sending a response"; measured: a 401 to a
    client whose body came 50 ms after its headers, and a ``GET /health``
    that carried a body). So an answer that starts before the body was read
    whole -- a missing key, an unknown path or method, a route that takes
    no body -- first reads the rest (:meth:`finish`), except where waiting
    makes no sense (:data:`CLOSE_AT_ONCE`; and with ``drain=False``: a
    decode request whose second line carries an exposure's parameters, which
    only its own reader may take); an answer whose body did not end then
    says ``connection: close``. A request whose headers announce no body
    (every ``content-length`` 0, no ``transfer-encoding``) has none to read.

    Use the object as the application's ``receive`` and :meth:`answering`
    of its ``send`` as its ``send``.
    """

    def __init__(self, receive: Receive, scope: Scope, *, drain: bool = True) -> None:
        self._receive = receive
        self._drain = drain
        self.ended = not _announces_body(scope.get("headers", ()))

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.ended = True  # (the body's last part, or the client went away)
        return message

    def answering(self, send: Send) -> Send:
        """``send``, except that a response's start first reads what is left of
        the body (:meth:`finish`) and says ``connection: close`` if it did not end."""

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start" and not self.ended:
                closing = await self.finish(int(message["status"]))
                message = {**message, "headers": [*message.get("headers", ()), *closing]}
            await send(message)

        return answer

    async def finish(self, status: int = 200) -> list[tuple[bytes, bytes]]:
        """Read what is left of the body (at most :data:`DRAIN_LIMIT` bytes
        more, within :data:`DRAIN_SECONDS`; nothing for a ``status`` in
        :data:`CLOSE_AT_ONCE` or a body not to drain) and return the headers
        the answer needs: none once the body ended (the connection takes the
        client's next request), else ``connection: close`` (the client knows
        not to send another on it; hypercorn closes it after the answer)."""
        read = 0
        if self._drain and status not in CLOSE_AT_ONCE:
            with trio.move_on_after(DRAIN_SECONDS):
                while not self.ended and read <= DRAIN_LIMIT:
                    read += len((await self()).get("body", b""))
        return [] if self.ended else [(b"connection", b"close")]


def _announces_body(headers: Any) -> bool:
    """Whether any ``transfer-encoding``, or a ``content-length`` other than 0,
    is among ``headers`` (ASGI's: lowercase names, bytes)."""
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
        for name, value in headers
    )


async def read_json(receive: Receive, limit: int = 1 << 20) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        HTTPError: 413 if it is larger than ``limit``, 400 if it is not a JSON
            object (not JSON, :func:`parse_json`: :class:`~.errors.BodyNotJSON`'s row), 499 if
            the client went away.
    """
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(499, "the client went away", "disconnect")
        body += message.get("body", b"")
        if len(body) > limit:
            raise HTTPError(413, f"request body over {limit} bytes", "invalid_request_error")
        if not message.get("more_body"):
            break
    try:
        data = parse_json(body)
    except ValueError as exc:
        raise http_error(BodyNotJSON(f"body is not JSON: {exc}")) from None
    except RecursionError:
        raise http_error(BodyNotJSON("body is nested too deeply")) from None
    if not isinstance(data, dict):
        raise HTTPError(400, "body must be a JSON object", "invalid_request_error")
    return data


async def send_json(
    send: Send, status: int, data: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await _send_whole(send, status, json.dumps(data).encode(), b"application/json", headers)


async def send_text(send: Send, status: int, text: str, content_type: str) -> None:
    await _send_whole(send, status, text.encode(), content_type.encode())


async def _send_whole(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A whole response, its ``Content-Length`` given: HTTP/1.1 then sends it
    unchunked, so the body's one write completes it (no closing chunk: one
    write and, for the peer, one read fewer -- the prefill answer is on every
    disaggregated request's way to its first token)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def start_events(send: Send, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Start a server-sent-events response (then :func:`send_event` each chunk)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-cache"),
                *(headers or []),
            ],
        }
    )


async def send_event(send: Send, data: Any, *, last: bool = False) -> None:
    payload = data if isinstance(data, str) else json.dumps(data)
    body = f"data: {payload}\n\n".encode()
    await send({"type": "http.response.body", "body": body, "more_body": not last})


@asynccontextmanager
async def cancel_on_disconnect(
    receive: Receive, after: trio.Event | None = None, scope: Scope | None = None
) -> AsyncIterator[None]:
    """Run the block in a scope that the client's disconnect cancels.

    Call it after the request body was read: from then on, the only message
    ASGI delivers is ``http.disconnect``. (It also arrives after a complete
    response: run the application under :func:`response_completes`, so that
    it never cancels the last ``send``.) With ``after``, the watch starts
    once it is set: the block itself reads the rest of the body until then
    (and sees a disconnect there), and the watch takes what is left of it.

    A transport that cancels its requests itself (the request's ASGI
    ``scope`` has the extension :data:`CANCEL_SCOPES`: a set, to which the
    block's cancel scope is added while it runs) needs no watching task:
    the block's scope is cancelled by the transport instead
    (:mod:`.prefill_channel`, which saves a task per request).
    """
    scopes = None if scope is None else scope.get("extensions", {}).get(CANCEL_SCOPES)
    if scopes is not None and after is None:
        cancel = trio.CancelScope()
        scopes.add(cancel)
        try:
            with cancel:
                yield
        finally:
            scopes.discard(cancel)
        return

    async def watch(scope: trio.CancelScope) -> None:
        if after is not None:
            await after.wait()
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with unwrapped_errors(), trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        yield
        nursery.cancel_scope.cancel()  # (the block is done: stop watching)


class SendWatch:
    """An ASGI ``send`` that remembers how long its messages waited to be sent.

    hypercorn's ``send`` returns once the message is in the kernel's socket
    buffer: one waits only while the client is not reading. When a client
    stops reading, the kernel resets its connection after the server's send
    timeout (``TCP_USER_TIMEOUT``, :func:`~.binding.bind_listener`), and the
    disconnect that cancels the request arrives while (or just after) a send
    waited about that long -- which is how :meth:`stalled` tells that case
    from a client that simply hung up.
    """

    def __init__(self, send: Send) -> None:
        self._send = send
        self._since: float | None = None  # (when the message being sent was handed over)
        self.longest = 0.0  # the longest a message waited, in seconds

    async def __call__(self, message: Message) -> None:
        self._since = started = trio.current_time()
        try:
            await self._send(message)
        finally:
            self._since = None
            self.longest = max(self.longest, trio.current_time() - started)

    def waited(self) -> float:
        """The longest a message waited so far (the one being sent included)."""
        if self._since is None:
            return self.longest
        return max(self.longest, trio.current_time() - self._since)

    def stalled(self, send_timeout: float) -> bool:
        """Whether a message waited at least half of ``send_timeout``: the
        client stopped reading (a disconnect then is the kernel's reset)."""
        return self.waited() >= send_timeout / 2

    def log_stall(
        self, log: logging.Logger, request_id: str, send_timeout: float, then: str
    ) -> None:
        """One warning: ``request_id`` stalled, and what cancelling it did (``then``)."""
        log.warning(
            "request %s: stalled: its client stopped reading (an answer waited %.1f s for it; "
            "--send-timeout %g s) and its connection closed: the request is cancelled, %s",
            request_id,
            self.waited(),
            send_timeout,
            then,
        )


def response_completes(app: App) -> App:
    """``app``, except that a disconnect after its complete response is not delivered.

    When hypercorn drains, the application's last ``send`` closes the
    connection itself and delivers ``http.disconnect`` on the way: under
    :func:`cancel_on_disconnect`, that cancelled the ``send`` halfway and
    left the connection open until the drain's deadline (every drain then
    took its whole grace period). Once the last body message is on its way,
    the request has nothing left to cancel: its ``receive`` waits instead.
    """

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        complete = False

        async def sending(message: Message) -> None:
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and complete:
                await trio.sleep_forever()  # (until the request's block ends)
            return message

        await app(scope, receiving, sending)

    return wrapped


async def trivial_lifespan(receive: Receive, send: Send) -> None:
    """Answer ASGI lifespan messages (an application with nothing to start or stop)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
        else:  # pragma: no cover
            await trio.lowlevel.checkpoint()
