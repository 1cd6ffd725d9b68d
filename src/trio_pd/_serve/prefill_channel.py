"""Prefill requests over a kept TCP connection: decode-first engines to prefill engines.

A decode-first engine (:mod:`.prefilling`) asks a prefill engine for every
request's KV before it can stream a first token, so that exchange is on
every request's time to first token. Over HTTP it cost 3-4 ms on this
project's 2-core machine, most of it hypercorn's and httpx2's own Python on
both sides (h11's parsing and framing, the send locks, the client's pool);
the prefill engine's forward is the rest. Here the same request is one
frame each way on a TCP connection that stays open, read and written by
trio on both sides. (ZeroMQ was measured first: its I/O threads add two
thread wake-ups to each direction, a round trip between two trio processes
took 0.57-0.66 ms where a plain trio stream took 0.23-0.25 ms; a prefill
request needs none of what ZeroMQ adds -- routing, reconnection, queueing
for a peer that is not there -- and is better off knowing at once that
its connection broke.)

Every engine that serves prefill requests also listens here (on its HTTP
host, bound as its HTTP socket is, a port of its own), and says where in
the ``x-trio-pd-prefill-port`` header of its HTTP prefill answers. What
arrives is the same request as over HTTP -- the path, the headers (the
deployment's internal key among them), the JSON body -- and it is answered
by the same ASGI application, in
process (:class:`PrefillChannelServer`): the same checks, the same keys, the
same errors, the same ``Server-Timing``. Only the transport differs, so
nothing else in the engine knows which one a request came by.

A decode-first engine keeps one connection per prefill engine
(:class:`PrefillChannels`), opened when an HTTP answer names the port (to
the host of the engine's URL: the header names a port only), and sends a
prefill over it while it is connected; while it is not -- before the first
answer, after the engine went away, a port that refuses -- the request goes
over HTTP, which tells a refused connection (the next engine is tried) from
a broken one. A connection that breaks while a request waits for its answer
fails that request as a broken HTTP connection would (:class:`ChannelLost`,
a 502 naming the engine: it may have run); a prefill engine whose host
died is found within :data:`DEAD_PEER_TIMEOUT` (keepalive,
``TCP_USER_TIMEOUT``), after which its requests go over HTTP. A request
whose caller stops waiting (its deadline, its client's disconnect) sends a
cancel: the prefill engine cancels it as it would on an HTTP disconnect; a
connection that closes cancels every request it sent. A draining engine
answers the requests it runs, then sends :class:`Closing` on each
connection: the requests still unanswered then were never read, and go
over HTTP (to the next engine).

Frames, each way: two 32-bit big-endian lengths (the head's, the body's),
the head -- a msgpack :class:`Request`, :class:`Cancel`, :class:`Answer` or
:class:`Closing` -- and the body (a request's JSON, an answer's body; empty
for the others). Whatever arrives may be hostile: a head that does not
parse is dropped (and logged at debug), a frame over :data:`HEAD_LIMIT` and
:data:`REQUEST_LIMIT` closes its connection, a request's path must be a
generation route, at most :data:`MAX_IN_FLIGHT` requests run at once
(then: a 503 answer), an answer over :data:`ANSWER_LIMIT` bytes is an error
answer instead, and an error answer is written before the connection's
next frame is read (a peer that does not read its answers stops only its
own connection, and is reset after the engine's send timeout). What a peer
sends fails its own requests and holds its own connection; every other
peer is served meanwhile.

Not encrypted: like the HTTP it replaces, the channel carries the internal
key as a bearer header, in clear (a deployment across untrusted networks
puts both on a private network, as it does HTTP).

What is owned: a :class:`PrefillChannelServer` its listener, its connections
and the tasks of the requests in flight (cancelled when it is; closed in
order by :meth:`~PrefillChannelServer.close`, which a drain calls); a
:class:`PrefillChannels` its connections and one task each (cancelled with
the nursery :func:`open_prefill_channels` opens). Every write of a frame is
shielded (a frame cut in half would break the connection for every request
on it) and bounded by :data:`SEND_TIMEOUT` (then the connection is closed):
a write may outlast its caller's deadline by up to that much.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import attrs
import httpx2
import msgspec
import trio
from trio_util import AsyncValue

from trio_pd._serve.asgi import CANCEL_SCOPES, App, Message
from trio_pd._serve.binding import bind_listener
from trio_pd._serve.defaults import CONNECT_TIMEOUT

logger = logging.getLogger("trio_pd.serve")

PORT_HEADER = "x-trio-pd-prefill-port"
"""The header of an engine's HTTP prefill answers that names its channel's port."""

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
"""The paths a channel request may name (any other: a 404 answer)."""

HEAD_LIMIT = 64 << 10
"""The most bytes of one frame's head (the headers); more closes the connection."""

REQUEST_LIMIT = 1 << 20
"""The most bytes of one request's body (more closes the connection): as an
HTTP request body's limit."""

ANSWER_LIMIT = 1 << 20
"""The most bytes of one answer's body (a larger answer is a 500 instead;
a prefill answer is a few hundred bytes)."""

MAX_IN_FLIGHT = 1024
"""Requests one engine runs at once from its channel (more: a 503 answer)."""

SEND_TIMEOUT = 10.0
"""How long one frame's write may wait for a peer that does not read (then
its connection is closed)."""

DEAD_PEER_TIMEOUT = 5.0
"""How soon a decode-first engine finds a channel whose prefill engine's host
died or is cut off (keepalive, ``TCP_USER_TIMEOUT``): then its requests go
over HTTP, which tries the next engine."""

_LENGTHS = struct.Struct("!II")


class Request(msgspec.Struct, tag="request", frozen=True):
    """A request: ``id`` (the sender's, echoed in its answer), the path and
    the headers (lower-case names)."""

    id: int
    path: str
    headers: list[tuple[str, str]]


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """The sender no longer waits for request ``id``: cancel it."""

    id: int


class Answer(msgspec.Struct, tag="answer", frozen=True):
    """Request ``id``'s answer: status and headers (its body is the frame's)."""

    id: int
    status: int
    headers: list[tuple[str, str]]


class Closing(msgspec.Struct, tag="closing", frozen=True):
    """The engine closes this connection (its drain is over): every request
    it read was answered before this frame, so one not answered by now was
    never read, and did not run."""


_decode_head = msgspec.msgpack.Decoder(Request | Cancel)
_decode_answer = msgspec.msgpack.Decoder(Answer | Closing)
_encode = msgspec.msgpack.Encoder()


def frame(head: Request | Cancel | Answer | Closing, body: bytes = b"") -> bytes:
    """One frame: the lengths, the head, the body."""
    encoded = _encode.encode(head)
    return b"".join((_LENGTHS.pack(len(encoded), len(body)), encoded, body))


class FrameTooLarge(Exception):
    """A frame's lengths are over the limits: the connection is closed."""


class _Frames:
    """The frames arriving on one stream (a buffer and its reader; no parsing of heads)."""

    def __init__(self, stream: trio.abc.ReceiveStream, body_limit: int) -> None:
        self._stream = stream
        self._body_limit = body_limit
        self._buffer = bytearray()

    async def _fill(self, size: int) -> bool:
        while len(self._buffer) < size:
            data = await self._stream.receive_some(max(65536, size - len(self._buffer)))
            if not data:
                return False
            self._buffer += data
        return True

    async def next(self) -> tuple[bytes, bytes] | None:
        """The next frame's head and body; ``None`` at the end of the stream.

        Raises:
            FrameTooLarge: its lengths are over the limits.
            trio.BrokenResourceError: the connection broke.
        """
        if not await self._fill(_LENGTHS.size):
            return None
        head_length, body_length = _LENGTHS.unpack_from(self._buffer)
        if head_length > HEAD_LIMIT or body_length > self._body_limit:
            raise FrameTooLarge(f"a frame of {head_length} + {body_length} bytes")
        end = _LENGTHS.size + head_length + body_length
        if not await self._fill(end):
            return None
        head = bytes(self._buffer[_LENGTHS.size : _LENGTHS.size + head_length])
        body = bytes(self._buffer[_LENGTHS.size + head_length : end])
        del self._buffer[:end]
        return head, body


class _Connection:
    """One connection's stream and its writers' turn."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._writing = trio.Lock()

    async def send(self, data: bytes) -> bool:
        """Write one whole frame; ``False`` if it could not be written (the
        connection is closed then).

        When no other frame is being written, it goes to the socket at once,
        without a schedule point (a frame is small: the kernel's buffer takes
        it whole; on a machine whose loop is busy, every schedule point
        before the write was a wait on the request's path). Whatever the
        kernel did not take, or a frame that waits for another's turn, is
        written by ``send_all``, shielded (a frame cut in half would break
        the connection for every request on it) and bounded by
        :data:`SEND_TIMEOUT`."""
        try:
            self._writing.acquire_nowait()
        except trio.WouldBlock:
            await self._writing.acquire()
            fast = False
        else:
            fast = True
        try:
            failed = False
            if fast:
                try:
                    data = data[os.write(self.stream.socket.fileno(), data) :]
                except BlockingIOError:
                    pass
                except OSError:  # (the connection broke, or was closed)
                    failed = True
            if data and not failed:
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + SEND_TIMEOUT
                    try:
                        await self.stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        failed = True
                failed = failed or scope.cancelled_caught
        finally:
            self._writing.release()
        if failed:
            await trio.aclose_forcefully(self.stream)
            return False
        return True


class ChannelLost(httpx2.ReadError):
    """The connection to a prefill engine's channel broke while a request waited
    for its answer (the request may have run): answered as a broken HTTP
    connection is (:data:`~.errors.ERROR_STATUSES`' ``httpx2.HTTPError`` row)."""


# The prefill engine's side.


class _CancelScopes(set[trio.CancelScope]):
    """A request's ``asgi.CANCEL_SCOPES``: the application's scopes to cancel
    when its sender cancels it -- and one added after that is cancelled at once."""

    cancelled = False

    def add(self, scope: trio.CancelScope) -> None:
        super().add(scope)
        if self.cancelled:
            scope.cancel()


@attrs.define(eq=False)
class _Call:
    """A request running now: whether its sender cancelled it, and the
    application's cancel scopes to cancel then."""

    disconnected: trio.Event = attrs.field(factory=trio.Event)
    cancel_scopes: _CancelScopes = attrs.field(factory=_CancelScopes)

    def cancel(self) -> None:
        self.disconnected.set()
        self.cancel_scopes.cancelled = True
        for scope in self.cancel_scopes:
            scope.cancel()


class PrefillChannelServer:
    """A prefill engine's channel: its listener, its connections and the
    requests they run (see the module docstring).

    Args:
        app: the engine's ASGI application, which answers every request.
        max_in_flight: requests run at once, every connection's (more: 503s).
        in_flight: counts the requests running, until their answers are
            written (an engine's drain waits for them to reach 0).
    """

    def __init__(
        self,
        app: App,
        *,
        max_in_flight: int = MAX_IN_FLIGHT,
        in_flight: AsyncValue[int] | None = None,
    ) -> None:
        self.app = app
        self.limit = max_in_flight
        self.in_flight = in_flight or AsyncValue(0)
        self._connections: set[_Reading] = set()
        self._open = AsyncValue(0)  # (connections)
        self._accepting = trio.CancelScope()
        self._closing = False

    async def serve(
        self,
        host: str,
        *,
        send_timeout: float = SEND_TIMEOUT,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host`` (a port of its own: bound as the engine's HTTP
        socket is, :func:`~.binding.bind_listener`, its connections reset
        by the kernel after ``send_timeout`` of unacknowledged data), report
        the port, then serve each connection in a task of its own until
        cancelled (every connection closed, every request running cancelled)
        -- or, after :meth:`close`, until the last connection closed.

        Raises:
            BindError: ``host`` cannot be bound (before ``started``).
        """
        sock = bind_listener(host, 0, send_timeout=send_timeout)
        try:
            sock.listen()
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        except BaseException:
            sock.close()
            raise
        async with listener, trio.open_nursery() as connections:
            task_status.started(sock.getsockname()[1])
            with self._accepting:
                await trio.serve_listeners(
                    self._serve_connection, [listener], handler_nursery=connections
                )

    async def close(self) -> None:
        """Stop taking connections and requests; let every connection's
        requests write their answers, send it :class:`Closing` and close it
        (bound it with a deadline: a peer that does not read holds its own
        connection up to the send timeout)."""
        self._closing = True
        self._accepting.cancel()
        for reading in list(self._connections):
            reading.stop()
        await self._open.wait_value(0)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        reading = _Reading(_Connection(stream), _Frames(stream, REQUEST_LIMIT), self)
        if self._closing:
            reading.stop()
        self._connections.add(reading)
        self._open.value += 1
        try:
            async with stream, trio.open_nursery() as nursery:
                await _read(reading, nursery)
        finally:
            self._connections.discard(reading)
            self._open.value -= 1


@attrs.define(eq=False)
class _Reading:
    """One connection: its frames, its requests, and whether it is closing."""

    connection: _Connection
    frames: _Frames
    server: PrefillChannelServer
    calls: dict[int, _Call] = attrs.field(factory=dict)
    idle: AsyncValue[bool] = attrs.field(factory=lambda: AsyncValue(True))
    stopped: bool = False
    scope: trio.CancelScope | None = None  # (the current reader's wait for a frame)

    def stop(self) -> None:
        """Read no more frames (the server closes)."""
        self.stopped = True
        if self.scope is not None:
            self.scope.cancel()


async def _read(reading: _Reading, nursery: trio.Nursery) -> None:
    """Read the connection's frames until one is a request to run; then hand
    the reading on to a fresh task and run that request here, at once (it
    waits for no other task to be scheduled: a request's first step is on
    its time to first token). An error answer is written before the next
    frame is read: a peer that does not read its answers stops only its own
    connection.

    At the connection's end, its requests are cancelled; when the server
    closes, they finish and write their answers, then :class:`Closing` is
    sent (every frame read was answered: the peer knows the others did not
    run)."""
    try:
        while not reading.stopped:
            with trio.CancelScope() as reading.scope:
                got = await reading.frames.next()
            reading.scope = None
            if reading.stopped or got is None:
                break
            request = await _take(*got, reading)
            if request is not None:
                nursery.start_soon(_read, reading, nursery)
                await _run(reading, *request)
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError, FrameTooLarge) as exc:
        logger.debug("prefill channel: a connection closed: %s", exc)
    else:
        if reading.stopped:
            await reading.idle.wait_value(True)
            await reading.connection.send(frame(Closing()))
            return
    for call in reading.calls.values():
        call.cancel()


async def _take(head: bytes, body: bytes, reading: _Reading) -> tuple[Request, bytes, _Call] | None:
    """What one frame asks: a request to run (counted, its call registered),
    or ``None`` (a cancel done, an error answer written, a frame dropped)."""
    try:
        message = _decode_head.decode(head)
    except (msgspec.DecodeError, RecursionError) as exc:
        logger.debug("prefill channel: dropped a frame that does not parse: %s", exc)
        await trio.lowlevel.checkpoint()
        return None
    calls, server = reading.calls, reading.server
    if isinstance(message, Cancel):
        cancelled = calls.get(message.id)
        if cancelled is not None:
            cancelled.cancel()
        await trio.lowlevel.checkpoint()
        return None
    if message.id in calls:
        logger.debug("prefill channel: dropped request %d (its id is in use)", message.id)
        await trio.lowlevel.checkpoint()
        return None
    if message.path not in ROUTES:
        path = message.path[:200]
        await reading.connection.send(_error(message.id, 404, f"Invalid URL (POST {path})"))
        return None
    if server.in_flight.value >= server.limit:
        await reading.connection.send(_error(message.id, 503, "too many requests in flight"))
        return None
    calls[message.id] = call = _Call()
    reading.idle.value = False
    server.in_flight.value += 1
    return message, body, call


async def _run(reading: _Reading, request: Request, body: bytes, call: _Call) -> None:
    """One request through the application; its answer written (none if it
    was cancelled); counted in the server's ``in_flight`` until then.

    The answer is written as soon as the application sends its last body
    message, from within that ``send``: what the application still does
    after it (its metrics, its log line, leaving its scopes) is not on the
    requester's path."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers],
        "client": None,
        "server": None,
        "extensions": {CANCEL_SCOPES: call.cancel_scopes},
    }
    delivered = answered = False
    status, headers, content, too_long = 500, list[tuple[str, str]](), bytearray(), False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await call.disconnected.wait()
        return {"type": "http.disconnect"}

    async def answer() -> None:
        """Write the answer (once), unless its sender stopped waiting."""
        nonlocal answered
        if answered or call.disconnected.is_set():
            return
        answered = True
        if too_long:
            written = _error(request.id, 500, f"an answer over {ANSWER_LIMIT} bytes")
        else:
            written = frame(Answer(request.id, status, headers), bytes(content))
        await reading.connection.send(written)

    async def send(message: Message) -> None:
        nonlocal status, headers, too_long
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
        elif message["type"] == "http.response.body":
            if not too_long:
                content.extend(message.get("body", b""))
                too_long = len(content) > ANSWER_LIMIT
            if not message.get("more_body", False):
                await answer()

    try:
        try:
            await reading.server.app(scope, receive, send)
        except Exception:  # (the engine's application answers every error itself)
            logger.exception("prefill channel: request %d failed unexpectedly", request.id)
            if answered:
                return
            status, headers, content, too_long = 500, [], bytearray(), False
            content += msgspec.json.encode(
                {"error": {"message": "internal error (logged)", "type": "server_error"}}
            )
        await answer()  # (an application that returned without ending its answer)
    finally:
        del reading.calls[request.id]
        reading.server.in_flight.value -= 1
        if not reading.calls:
            reading.idle.value = True


def _error(request_id: int, status: int, text: str) -> bytes:
    """The frame of an error answer that the channel gives itself."""
    error = {"error": {"message": text, "type": "invalid_request_error", "param": None}}
    head = Answer(request_id, status, [("content-type", "application/json")])
    return frame(head, msgspec.json.encode(error))


# The decode-first engine's side.


@attrs.frozen
class ChannelAnswer:
    """A prefill engine's answer that came over its channel."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


@attrs.define(eq=False)
class _Waiter:
    done: trio.Event = attrs.field(factory=trio.Event)
    answer: ChannelAnswer | None = None
    not_run: bool = False  # (the engine closed the channel before reading it)


@attrs.define(eq=False)
class _Channel:
    """One prefill engine's channel: its connection (once open) and what waits on it."""

    engine: str
    port: int
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    connection: _Connection | None = None
    waiting: dict[int, _Waiter] = attrs.field(factory=dict)
    given_up: dict[int, None] = attrs.field(factory=dict)
    """Requests whose callers stopped waiting once they were sent, oldest
    first (at most :data:`MAX_IN_FLIGHT`): an answer to one is orphaned."""

    def lose(self) -> None:
        """Every request waiting on this channel gets no answer."""
        waiting, self.waiting = self.waiting, {}
        for waiter in waiting.values():
            waiter.done.set()


class PrefillChannels:
    """A decode-first engine's (or the proxy's) channels to its prefill
    engines (see the module docstring); made by :func:`open_prefill_channels`.

    ``orphaned`` is called (on the trio thread; it must not raise) with each
    answer that came for a request whose caller had stopped waiting (it was
    cancelled after its request was sent, and the engine answered before
    its cancel arrived, or the answer came just as the caller left): a 200
    prefill answer then names an exposure that nobody will read, which the
    caller can give back rather than leave to its lease.

    Attributes:
        answered: requests answered over a channel so far (to their callers).
        orphans: answers that came after their caller had stopped waiting.
        orphaned: the callback above.
    """

    def __init__(
        self, nursery: trio.Nursery, orphaned: Callable[[ChannelAnswer], None] | None = None
    ) -> None:
        self._nursery = nursery
        self.orphaned = orphaned
        self._channels: dict[str, _Channel] = {}
        self._ids = itertools.count(1)
        self.answered = 0
        self.orphans = 0

    def connected(self, engine: str) -> bool:
        """Whether ``engine``'s channel is connected now."""
        channel = self._channels.get(engine)
        return channel is not None and channel.connection is not None

    def learn(self, engine: str, headers: Mapping[str, str]) -> None:
        """``engine``'s HTTP answer came with ``headers``: connect to the port
        they name (instead of another port), if any, in the background."""
        text = headers.get(PORT_HEADER, "")
        if not (len(text) <= 5 and text.isascii() and text.isdigit() and 0 < int(text) < 65536):
            return
        port, host = int(text), urlsplit(engine).hostname
        channel = self._channels.get(engine)
        if host is None or (channel is not None and channel.port == port):
            return
        if channel is not None:
            channel.scope.cancel()
        self._channels[engine] = channel = _Channel(engine, port)
        self._nursery.start_soon(self._serve, channel, host)

    async def post(
        self,
        engine: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        written: Callable[[], Awaitable[None]] | None = None,
    ) -> ChannelAnswer | None:
        """Send a request to ``engine`` over its channel and wait for its answer;
        ``None`` if it has no connected channel, or the request could not be
        written whole, or the engine closed the channel before reading it
        (it did not run: send it over HTTP). ``written`` is awaited once the
        request is written whole. A caller that stops waiting (cancelled)
        sends a cancel; an answer that comes anyway, or that had come as it
        stopped, goes to ``orphaned``.

        Raises:
            ChannelLost: the connection broke before the answer came.
        """
        channel = self._channels.get(engine)
        if channel is None or channel.connection is None:
            return None
        request_id = next(self._ids)
        request = frame(Request(request_id, path, list(headers.items())), body)
        channel.waiting[request_id] = waiter = _Waiter()
        sent = False
        try:
            if not await channel.connection.send(request):
                return None
            sent = True
            if written is not None:
                await written()
            await waiter.done.wait()
        except BaseException:
            if waiter.answer is not None:  # (it came, and its caller leaves without it)
                self._orphan(waiter.answer)
            raise
        finally:
            unanswered = channel.waiting.pop(request_id, None) is not None
            connection = channel.connection
            if sent and unanswered and not waiter.done.is_set() and connection is not None:
                # (cancelled while the engine runs it: tell the engine, and
                # take an answer that still comes as an orphan)
                channel.given_up[request_id] = None
                if len(channel.given_up) > MAX_IN_FLIGHT:  # (cancels the engine obeyed)
                    del channel.given_up[next(iter(channel.given_up))]
                self._nursery.start_soon(connection.send, frame(Cancel(request_id)))
        if waiter.not_run:
            return None
        if waiter.answer is None:
            raise ChannelLost(f"the prefill channel to {engine} (port {channel.port}) broke")
        return waiter.answer

    async def _serve(self, channel: _Channel, host: str) -> None:
        """Connect ``channel``, then hand its answers to their requests until
        it closes (or is replaced); owns the connection."""
        try:
            with channel.scope:
                with trio.fail_after(CONNECT_TIMEOUT):
                    stream = await trio.open_tcp_stream(host, channel.port)
                async with stream:
                    _detect_dead_peers(stream)
                    channel.connection = _Connection(stream)
                    frames = _Frames(stream, ANSWER_LIMIT)
                    while (got := await frames.next()) is not None:
                        if not self._dispatch(channel, *got):
                            break  # (Closing)
        except (
            OSError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            trio.TooSlowError,
            FrameTooLarge,
        ) as exc:
            logger.debug("prefill channel to %s closed: %s", channel.engine, exc)
        finally:
            channel.connection = None
            channel.lose()
            if self._channels.get(channel.engine) is channel:
                del self._channels[channel.engine]

    def _dispatch(self, channel: _Channel, head: bytes, body: bytes) -> bool:
        """Hand one answer to its request; ``False`` at :class:`Closing`
        (every request still waiting then was never read: sent elsewhere)."""
        try:
            answer = _decode_answer.decode(head)
        except (msgspec.DecodeError, RecursionError) as exc:
            logger.debug("prefill channel %s: dropped an answer: %s", channel.engine, exc)
            return True
        if isinstance(answer, Closing):
            channel.connection = None  # (no request more)
            for unread in channel.waiting.values():
                unread.not_run = True
            channel.lose()
            return False
        waiter = channel.waiting.pop(answer.id, None)
        if waiter is None and answer.id not in channel.given_up:
            return True  # (the engine made it up)
        headers = {name.lower(): value for name, value in answer.headers}
        answered = ChannelAnswer(answer.status, headers, body)
        if waiter is None:  # (its caller stopped waiting: the cancel came too late)
            del channel.given_up[answer.id]
            self._orphan(answered)
            return True
        waiter.answer = answered
        waiter.done.set()
        self.answered += 1
        return True

    def _orphan(self, answer: ChannelAnswer) -> None:
        self.orphans += 1
        if self.orphaned is not None:
            self.orphaned(answer)


def _detect_dead_peers(stream: trio.SocketStream) -> None:
    """A prefill engine whose host died (no reset ever comes) is found within
    :data:`DEAD_PEER_TIMEOUT`: TCP keepalive probes an idle connection, and
    the kernel resets one whose data waited that long unacknowledged."""
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    milliseconds = int(DEAD_PEER_TIMEOUT * 1000)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)


@asynccontextmanager
async def open_prefill_channels(
    orphaned: Callable[[ChannelAnswer], None] | None = None,
) -> AsyncIterator[PrefillChannels]:
    """A :class:`PrefillChannels` (``orphaned``: see there) whose tasks run in
    a nursery of its own, cancelled on exit (closing every connection)."""
    async with trio.open_nursery() as nursery:
        yield PrefillChannels(nursery, orphaned)
        nursery.cancel_scope.cancel()
