"""Prefill requests over a kept TCP connection (``trio_pd._serve.prefill_channel``).

A decode-first engine (and the proxy) sends its prefill requests over a
prefill engine's channel once an HTTP answer named its port, and over HTTP
while it has no connected channel. Real engines and real connections; the
hostile peer is a plain TCP connection writing what it likes.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import trio

from trio_pd._serve import prefill_channel
from trio_pd._serve.app import build_app
from trio_pd._serve.keys import BearerKeys
from trio_pd._serve.prefill_channel import (
    HEAD_LIMIT,
    MAX_IN_FLIGHT,
    PORT_HEADER,
    REQUEST_LIMIT,
    Answer,
    Cancel,
    ChannelAnswer,
    ChannelLost,
    Closing,
    PrefillChannelServer,
    Request,
    _CancelScopes,
    _Connection,
    _Frames,
    frame,
    open_prefill_channels,
)

from .http_clients import http_client
from .test_decode_first import INTERNAL, PROMPTS, deployment, engine, serving, stream
from .test_proxy import closed_port_url, proxy_for, until

PREFILL = {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}


def prefiller_channels(decode: Any) -> Any:
    return decode.prefiller.channels


async def test_after_the_first_answer_prefills_go_over_the_channel() -> None:
    """The first request's prefill goes over HTTP (its answer names the port),
    every later one over the channel; the tokens are one engine's."""
    async with (
        deployment() as (prefill, decode, prefill_url, decode_url),
        http_client(30) as client,
    ):
        with trio.fail_after(60):
            channels = prefiller_channels(decode)
            for i, prompt in enumerate(PROMPTS):
                body = {"prompt": prompt, "max_tokens": 3}
                expected = (await client.post(f"{prefill_url}/v1/completions", json=body)).json()
                ids, _, timing = await stream(client, decode_url, "/v1/completions", body)
                assert ids == expected["choices"][0]["token_ids"]
                assert {"prefill", "prefill.forward", "prefill.expose"} <= set(timing)
                assert channels.answered == i
                if i == 0:  # (the answer named the port: connecting now)
                    assert channels.answered == 0
                    await until(lambda: channels.connected(prefill_url))
            assert channels.answered == len(PROMPTS) - 1
            await until(lambda: prefill.pool.free == prefill.pool.num_blocks)
            assert prefill.channel_requests.value == 0


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
async def test_the_proxy_sends_its_prefills_over_the_channel_too(dispatch: str) -> None:
    """A proxy in front of real engines: the first prefill over HTTP, the
    others over the prefill engine's channel (with concurrent dispatch, the
    decode request goes once the prefill's frame is written); the tokens
    are one engine's."""
    prefill, decode = engine("p0"), engine("d0")
    async with (
        serving(build_app(prefill), build_app(decode)) as [prefill_url, decode_url],
        proxy_for([prefill_url], [decode_url], dispatch=dispatch) as (proxy, proxy_url),
        http_client(30) as client,
    ):
        with trio.fail_after(60):
            channels = proxy._prefiller.channels
            assert channels is not None
            for i, prompt in enumerate(PROMPTS):
                body = {"prompt": prompt, "max_tokens": 3}
                expected = (await client.post(f"{prefill_url}/v1/completions", json=body)).json()
                answer = await client.post(f"{proxy_url}/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                assert (
                    answer.json()["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
                )
                assert channels.answered == i
                if i == 0:
                    await until(lambda: channels.connected(prefill_url))
            await until(lambda: prefill.pool.free == prefill.pool.num_blocks)
            await until(lambda: decode.pool.free == decode.pool.num_blocks)


async def test_an_engine_without_the_channel_is_asked_over_http() -> None:
    prefill = engine("p0", prefill_channel=False)
    async with (
        deployment(prefill) as (_, decode, prefill_url, decode_url),
        http_client(30) as client,
    ):
        with trio.fail_after(60):
            for prompt in PROMPTS[:3]:
                body = {"prompt": prompt, "max_tokens": 2}
                answer = await client.post(f"{decode_url}/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
            assert prefill.prefill_channel_port is None
            assert not prefiller_channels(decode).connected(prefill_url)
            assert prefiller_channels(decode).answered == 0


@asynccontextmanager
async def prefill_engine(**settings: Any) -> AsyncIterator[tuple[Any, str, Peer]]:
    """A prefill engine (internal key :data:`INTERNAL`) over HTTP, and a plain
    TCP connection to its channel."""
    internal = BearerKeys([INTERNAL], audience="internal")
    prefill = engine("p0", keys={"internal_keys": internal}, **settings)
    async with (
        serving(build_app(prefill)) as [url],
        await Peer.connect(prefill.prefill_channel_port) as peer,
    ):
        yield prefill, url, peer


class Peer:
    """A hostile (or not) client of a channel: it writes what it likes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.frames = _Frames(stream, 1 << 30)

    @classmethod
    async def connect(cls, port: int | None) -> Peer:
        assert port is not None
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def answer(self) -> tuple[Answer, Any]:
        got = await self.frames.next()
        assert got is not None, "the channel closed the connection"
        head = msgspec.msgpack.decode(got[0], type=Answer)
        return head, json.loads(got[1])

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stream.aclose()


def request(
    request_id: int, body: Any, key: str = INTERNAL, path: str = "/v1/completions"
) -> bytes:
    head = Request(request_id, path, [("authorization", f"Bearer {key}")])
    return frame(head, json.dumps(body).encode())


def raw_frame(head: bytes, body: bytes = b"") -> bytes:
    return struct.pack("!II", len(head), len(body)) + head + body


async def test_its_http_prefill_answers_name_the_channel() -> None:
    async with (
        prefill_engine() as (prefill, url, _),
        http_client(30) as client,
    ):
        with trio.fail_after(30):
            headers = {"authorization": f"Bearer {INTERNAL}"}
            body = {"prompt": "where is the channel", **PREFILL}
            answer = await client.post(f"{url}/v1/completions", json=body, headers=headers)
            assert answer.headers[PORT_HEADER] == str(prefill.prefill_channel_port)
            # (a whole request's answer does not: only prefill answers say it)
            whole = {"prompt": "x", "max_tokens": 1}
            answer = await client.post(f"{url}/v1/completions", json=whole, headers=headers)
            assert PORT_HEADER not in answer.headers


async def test_hostile_frames_fail_only_themselves() -> None:
    """Heads that do not parse, an answer posing as a request, a request id
    already running are dropped; an unknown path is a 404, a missing key a
    401, a malformed body a 400 -- each answered (or not) alone, and a good
    request after them is answered as over HTTP."""
    async with prefill_engine() as (prefill, _, peer):
        with trio.fail_after(30):
            await peer.send(raw_frame(b"\xc1not msgpack", b"{}"))
            await peer.send(raw_frame(msgspec.msgpack.encode(Answer(1, 200, [])), b"{}"))
            await peer.send(raw_frame(msgspec.msgpack.encode({"type": "request"})))
            await peer.send(request(3, {"prompt": "x"}, path="/metrics"))
            head, error = await peer.answer()
            assert (head.id, head.status) == (3, 404), error
            await peer.send(request(4, {"prompt": "x", **PREFILL}, key="wrong"))
            head, error = await peer.answer()
            assert (head.id, head.status) == (4, 401), error
            await peer.send(
                raw_frame(
                    msgspec.msgpack.encode(
                        Request(5, "/v1/completions", [("authorization", f"Bearer {INTERNAL}")])
                    ),
                    b"{not json",
                )
            )
            head, error = await peer.answer()
            assert (head.id, head.status) == (5, 400), error
            await peer.send(request(6, {"prompt": "a good one", **PREFILL}))
            head, good = await peer.answer()
            assert (head.id, head.status) == (6, 200), good
            assert good["kv_transfer_params"]["do_remote_prefill"] is True
            assert "forward;dur=" in dict(head.headers)["server-timing"]
            assert prefill.channel_requests.value == 0


@pytest.mark.parametrize("lengths", [(HEAD_LIMIT + 1, 0), (10, REQUEST_LIMIT + 1)])
async def test_a_frame_over_the_limits_closes_only_its_connection(lengths: tuple[int, int]) -> None:
    """The channel reads no more of it (nothing of its size is buffered) and
    closes it; another connection is served meanwhile, and after."""
    async with prefill_engine() as (prefill, _, peer):
        with trio.fail_after(30):
            await peer.send(struct.pack("!II", *lengths) + b"x" * 1000)
            assert await peer.frames.next() is None  # (closed by the channel)
            async with await Peer.connect(prefill.prefill_channel_port) as other:
                await other.send(request(2, {"prompt": "still here", **PREFILL}))
                head, _body = await other.answer()
                assert (head.id, head.status) == (2, 200)


async def full_pool(prefill: Any) -> list[int]:
    """Every KV block of ``prefill``'s pool, taken (requests wait for blocks)."""
    deadline = trio.current_time() + 5
    blocks: list[int] = await prefill.pool.allocate(prefill.pool.num_blocks, deadline=deadline)
    return blocks


async def test_a_cancel_stops_the_request_and_gives_its_blocks_back() -> None:
    """A cancel while the request waits for KV blocks: no answer comes, the
    request ends, nothing stays allocated or exposed."""
    async with prefill_engine(admission_timeout=30.0) as (prefill, _, peer):
        with trio.fail_after(30):
            held = await full_pool(prefill)
            await peer.send(request(1, {"prompt": "waits for blocks", **PREFILL}))
            await until(lambda: prefill.channel_requests.value == 1)
            await peer.send(frame(Cancel(1)))
            await until(lambda: prefill.channel_requests.value == 0)
            prefill.pool.release(held)
            assert prefill.pool.free == prefill.pool.num_blocks
            [producer] = prefill.connectors
            assert producer.statistics().exposures_pending == 0
            # (the next request is answered; the cancelled one never is)
            await peer.send(request(2, {"prompt": "after", **PREFILL}))
            head, _body = await peer.answer()
            assert (head.id, head.status) == (2, 200)
            with trio.move_on_after(0.2):
                await peer.answer()
                pytest.fail("the cancelled request was answered")


async def test_a_connection_that_closes_cancels_its_requests() -> None:
    async with prefill_engine(admission_timeout=30.0) as (prefill, _, peer):
        with trio.fail_after(30):
            held = await full_pool(prefill)
            async with await Peer.connect(prefill.prefill_channel_port) as other:
                for i in range(3):
                    await other.send(request(i, {"prompt": "waits", **PREFILL}))
                await peer.send(request(9, {"prompt": "the other peer's", **PREFILL}))
                await until(lambda: prefill.channel_requests.value == 4)
            await until(lambda: prefill.channel_requests.value == 1)  # (only its own)
            prefill.pool.release(held)
            head, _body = await peer.answer()
            assert (head.id, head.status) == (9, 200)


async def test_a_caller_that_stops_waiting_cancels_its_request() -> None:
    """The decode-first side: a post cancelled while the prefill engine runs
    it sends a cancel, and the engine's request ends."""
    async with (
        prefill_engine(admission_timeout=30.0) as (prefill, url, _),
        open_prefill_channels() as channels,
    ):
        with trio.fail_after(30):
            channels.learn(url, {PORT_HEADER: str(prefill.prefill_channel_port)})
            await until(lambda: channels.connected(url))
            held = await full_pool(prefill)
            body = json.dumps({"prompt": "waits", **PREFILL}).encode()
            headers = {"authorization": f"Bearer {INTERNAL}"}
            with trio.move_on_after(0.5):
                await channels.post(url, "/v1/completions", body, headers)
            await until(lambda: prefill.channel_requests.value == 0)
            prefill.pool.release(held)
            answer = await channels.post(url, "/v1/completions", body, headers)
            assert answer is not None
            assert answer.status_code == 200, answer.content
            assert channels.answered == 1


async def test_too_many_requests_in_flight_are_503s() -> None:
    async with prefill_engine(admission_timeout=30.0) as (prefill, _, peer):
        with trio.fail_after(30):
            held = await full_pool(prefill)
            for i in range(MAX_IN_FLIGHT):
                await peer.send(request(i, {"prompt": "waits", **PREFILL}))
            await until(lambda: prefill.channel_requests.value == MAX_IN_FLIGHT)
            await peer.send(request(-1, {"prompt": "one too many", **PREFILL}))
            head, error = await peer.answer()
            assert (head.id, head.status) == (-1, 503), error
            for i in range(MAX_IN_FLIGHT):
                await peer.send(frame(Cancel(i)))
            await until(lambda: prefill.channel_requests.value == 0)
            prefill.pool.release(held)


async def test_a_channel_that_breaks_while_a_request_waits_is_channel_lost() -> None:
    """The prefill engine's side goes away with a request unanswered: the
    request fails with ChannelLost (a broken connection's 502) at once, not
    at its deadline; then there is no connected channel (HTTP); a port that
    refuses never connects; a header that names no port is ignored."""
    url = "http://127.0.0.1:1"
    received = trio.Event()

    async def never_answers(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        received.set()
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, never_answers, 0, host="127.0.0.1")
        [listener] = await nursery.start(serve)
        port = listener.socket.getsockname()[1]
        async with open_prefill_channels() as channels:
            with trio.fail_after(30):
                channels.learn(url, {PORT_HEADER: str(port)})
                await until(lambda: channels.connected(url))
                with pytest.raises(ChannelLost, match="broke"):
                    await channels.post(url, "/v1/completions", b"{}", {})
                assert received.is_set()
                await until(lambda: not channels.connected(url))
                assert await channels.post(url, "/v1/completions", b"{}", {}) is None
                refusing = "http://127.0.0.1:2"
                channels.learn(refusing, {PORT_HEADER: closed_port_url().rsplit(":", 1)[1]})
                await trio.sleep(0.1)
                assert await channels.post(refusing, "/v1/completions", b"{}", {}) is None
                for bad in ("0", "65536", "x", "-1", "", "\u0663", "1" * 5000, "08000"):
                    channels.learn("http://127.0.0.1:3", {PORT_HEADER: bad})
                assert not channels.connected("http://127.0.0.1:3")
        nursery.cancel_scope.cancel()


async def echo(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI application that answers each request with its own body."""
    body = (await receive())["body"]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def test_frames_written_at_once_never_interleave() -> None:
    """Twenty requests of 300 KB each at once, both ways over one connection
    (more than the kernel's buffers take at once: writes are cut and wait
    their turns): every answer is its own request's body."""
    async with trio.open_nursery() as nursery, open_prefill_channels() as channels:
        port = await nursery.start(PrefillChannelServer(echo).serve, "127.0.0.1")
        url = "http://127.0.0.1:4"
        with trio.fail_after(30):
            channels.learn(url, {PORT_HEADER: str(port)})
            await until(lambda: channels.connected(url))
            answers: dict[int, bytes] = {}

            async def one(i: int) -> None:
                body = bytes([i]) * 300_000
                answer = await channels.post(url, "/v1/completions", body, {})
                assert answer is not None
                answers[i] = answer.content

            async with trio.open_nursery() as requests:
                for i in range(20):
                    requests.start_soon(one, i)
            assert answers == {i: bytes([i]) * 300_000 for i in range(20)}
        nursery.cancel_scope.cancel()


async def test_a_peer_that_does_not_read_is_dropped_after_the_send_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request the prefill engine's side never reads: its write gives up
    after SEND_TIMEOUT and closes the connection; the request did not run
    (post returns None: it goes over HTTP)."""
    monkeypatch.setattr(prefill_channel, "SEND_TIMEOUT", 0.2)
    accepted = trio.Event()

    async def never_reads(stream: trio.SocketStream) -> None:
        accepted.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery, open_prefill_channels() as channels:
        serve = functools.partial(trio.serve_tcp, never_reads, 0, host="127.0.0.1")
        [listener] = await nursery.start(serve)
        url = "http://127.0.0.1:5"
        with trio.fail_after(30):
            channels.learn(url, {PORT_HEADER: str(listener.socket.getsockname()[1])})
            await until(lambda: channels.connected(url))
            body = b"x" * (REQUEST_LIMIT - 100)
            assert await channels.post(url, "/v1/completions", body, {}) is None
            await until(lambda: not channels.connected(url))
        nursery.cancel_scope.cancel()


async def test_a_peer_that_floods_without_reading_holds_only_its_own_connection() -> None:
    """Twenty thousand frames that each get an error answer (an unknown path),
    from a peer that reads none: the channel stops reading that connection
    once its answers no longer fit (no task or answer piles up per frame),
    and serves another connection meanwhile."""
    async with prefill_engine() as (prefill, _, peer):
        with trio.fail_after(30):
            tasks = trio.lowlevel.current_statistics().tasks_living
            flood = request(1, {}, path="/x")
            with trio.move_on_after(2):  # (until the kernel's buffers are full)
                for _ in range(20_000):
                    await peer.send(flood)
            await trio.sleep(0.2)
            assert trio.lowlevel.current_statistics().tasks_living < tasks + 20
            async with await Peer.connect(prefill.prefill_channel_port) as other:
                await other.send(request(2, {"prompt": "served meanwhile", **PREFILL}))
                head, _body = await other.answer()
                assert (head.id, head.status) == (2, 200)


async def test_a_frame_that_cannot_be_written_whole_is_not_sent() -> None:
    """A frame bigger than the kernel's buffers, to a peer that closes the
    connection while it is written: ``send`` says so (False) and closes
    the stream -- the request did not reach the engine whole, so it goes
    over HTTP, not to a 502."""
    got_some = trio.Event()

    async def reads_a_little_then_closes(stream: trio.SocketStream) -> None:
        await stream.receive_some(1024)
        got_some.set()
        await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, reads_a_little_then_closes, 0, host="127.0.0.1")
        [listener] = await nursery.start(serve)
        with trio.fail_after(30):
            stream = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
            connection = _Connection(stream)
            assert await connection.send(b"x" * (64 << 20)) is False
            assert got_some.is_set()
            assert await connection.send(b"more") is False  # (closed: at once)
        nursery.cancel_scope.cancel()


async def test_the_channel_binds_as_the_http_socket_does() -> None:
    """``host=""`` is every IPv4 interface (as for the engine's HTTP socket):
    the engine starts and its channel answers on 127.0.0.1."""
    async with prefill_engine(host="", advertise_host="127.0.0.1") as (_, _, peer):
        with trio.fail_after(30):
            await peer.send(request(1, {"prompt": "every interface", **PREFILL}))
            head, _body = await peer.answer()
            assert (head.id, head.status) == (1, 200)


async def test_closing_answers_what_was_read_and_says_so() -> None:
    """The drain's close: a request already running is answered, then the
    peer gets Closing and the end of the connection; a new connection is
    not taken."""
    async with prefill_engine(admission_timeout=30.0) as (prefill, _, peer):
        with trio.fail_after(30):
            held = await full_pool(prefill)
            await peer.send(request(1, {"prompt": "running at the close", **PREFILL}))
            await until(lambda: prefill.channel_requests.value == 1)
            channel = prefill.prefill_channel
            assert channel is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel.close)
                await trio.sleep(0.1)
                prefill.pool.release(held)
            head, _body = await peer.answer()
            assert (head.id, head.status) == (1, 200)
            got = await peer.frames.next()
            assert got is not None
            assert isinstance(msgspec.msgpack.decode(got[0], type=Answer | Closing), Closing)
            assert await peer.frames.next() is None
            with pytest.raises(OSError, match="onnect"):
                await Peer.connect(prefill.prefill_channel_port)


async def test_a_request_the_engine_closed_before_reading_goes_over_http() -> None:
    """A prefill engine that answers Closing before a request's answer: that
    request was never read (post returns None: HTTP), and the channel is
    no longer used."""
    url = "http://127.0.0.1:6"

    async def closes_without_answering(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.send_all(frame(Closing()))
        await stream.aclose()

    async with trio.open_nursery() as nursery, open_prefill_channels() as channels:
        serve = functools.partial(trio.serve_tcp, closes_without_answering, 0, host="127.0.0.1")
        [listener] = await nursery.start(serve)
        with trio.fail_after(30):
            channels.learn(url, {PORT_HEADER: str(listener.socket.getsockname()[1])})
            await until(lambda: channels.connected(url))
            assert await channels.post(url, "/v1/completions", b"{}", {}) is None
            assert not channels.connected(url)
            assert channels.answered == 0
        nursery.cancel_scope.cancel()


async def test_an_application_that_raises_is_a_500_for_its_request_only() -> None:
    async def raises(scope: Any, receive: Any, send: Any) -> None:
        if json.loads((await receive())["body"])["fail"]:
            raise RuntimeError("a bug")
        await echo_body(send, b"fine")

    async with trio.open_nursery() as nursery:
        port = await nursery.start(PrefillChannelServer(raises).serve, "127.0.0.1")
        async with await Peer.connect(port) as peer:
            with trio.fail_after(30):
                await peer.send(request(1, {"fail": True}))
                head, error = await peer.answer()
                assert (head.id, head.status) == (1, 500), error
                await peer.send(request(2, {"fail": False}))
                got = await peer.frames.next()
                assert got is not None
                assert msgspec.msgpack.decode(got[0], type=Answer).status == 200
        nursery.cancel_scope.cancel()


async def test_an_answer_leaves_once_sent_whole_not_when_the_application_returns() -> None:
    """The answer's frame is written from the application's last ``send``:
    what the application still does after it (an engine's metrics, its
    log line) is not on the requester's path. An application that raises
    after its answer left sends nothing more for that request."""
    go_on = [trio.Event() for _ in range(3)]  # (each request's application waits on its own)
    returned = [False] * 3

    async def slow_tail(scope: Any, receive: Any, send: Any) -> None:
        asked = json.loads((await receive())["body"])
        await echo_body(send, b"early")
        await go_on[asked["i"]].wait()
        returned[asked["i"]] = True
        if asked["fail"]:
            raise RuntimeError("a bug after the answer")

    async with trio.open_nursery() as nursery:
        port = await nursery.start(PrefillChannelServer(slow_tail).serve, "127.0.0.1")
        async with await Peer.connect(port) as peer:
            with trio.fail_after(30):
                for i, fail in enumerate((False, True, False)):
                    await peer.send(request(i, {"i": i, "fail": fail}))
                    got = await peer.frames.next()  # (request 2's: no 500 came for 1)
                    assert got is not None
                    assert got[1] == b"early"
                    assert msgspec.msgpack.decode(got[0], type=Answer).id == i
                    assert not returned[i]  # (its application had not returned)
                    go_on[i].set()
                    await until(functools.partial(returned.__getitem__, i))
        nursery.cancel_scope.cancel()


async def echo_body(send: Any, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def test_a_scope_added_after_the_cancel_is_cancelled_at_once() -> None:
    scopes = _CancelScopes()
    scopes.cancelled = True
    scope = trio.CancelScope()
    scopes.add(scope)
    assert scope.cancel_called


# ---- answers that come after their caller stopped waiting ----------------------


@asynccontextmanager
async def late_answerer(
    script: Any,
) -> AsyncIterator[tuple[Any, str, list[ChannelAnswer]]]:
    """Channels to a fake prefill engine whose connection ``script(stream,
    frames)`` drives, and the answers they call orphaned."""
    orphans: list[ChannelAnswer] = []
    async with trio.open_nursery() as nursery:
        [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listener.socket.getsockname()[1]

        async def serve_one() -> None:
            async with listener, await listener.accept() as stream:
                await script(stream, _Frames(stream, 1 << 20))

        nursery.start_soon(serve_one)
        async with open_prefill_channels(orphans.append) as channels:
            url = f"http://127.0.0.1:{port}"
            channels.learn(url, {PORT_HEADER: str(port)})
            await until(lambda: channels.connected(url))
            yield channels, url, orphans
        nursery.cancel_scope.cancel()


def answer_frame(request_id: int, body: Any, status: int = 200) -> bytes:
    return frame(Answer(request_id, status, []), json.dumps(body).encode())


async def test_an_answer_that_crosses_its_cancel_is_orphaned() -> None:
    """The engine answered before the cancel reached it: nobody waits for the
    answer any more, so it goes to ``orphaned`` (a decode-first engine gives
    its exposure back) -- and an answer to a request never sent does not."""
    params = {"kv_transfer_params": {"remote_engine_id": "p0"}}

    async def script(stream: trio.SocketStream, frames: _Frames) -> None:
        got = await frames.next()
        assert got is not None
        sent = msgspec.msgpack.decode(got[0], type=Request)
        got = await frames.next()  # (the caller stopped waiting)
        assert got is not None
        assert msgspec.msgpack.decode(got[0], type=Cancel).id == sent.id
        await stream.send_all(answer_frame(sent.id, params) + answer_frame(sent.id + 7, {}))
        await trio.sleep_forever()

    async with late_answerer(script) as (channels, url, orphans):
        with trio.fail_after(30):
            with trio.move_on_after(0.2) as scope:
                await channels.post(url, "/v1/completions", b"{}", {})
            assert scope.cancelled_caught
            await until(lambda: orphans)
            [orphan] = orphans
            assert (orphan.status_code, json.loads(orphan.content)) == (200, params)
            assert (channels.orphans, channels.answered) == (1, 0)
            await trio.sleep(0.05)  # (the made-up answer: dropped, not orphaned)
            assert channels.orphans == 1


async def test_an_answer_that_came_as_its_caller_was_cancelled_is_orphaned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer reached its waiter, but the caller's cancellation won: it
    leaves without the answer (no cancel sent: the engine is done), which
    goes to ``orphaned``."""
    caller = trio.CancelScope()

    def arrives_as_the_caller_is_cancelled(*args: Any) -> ChannelAnswer:
        caller.cancel()  # (in the same step that hands the answer over)
        return ChannelAnswer(*args)

    async def script(stream: trio.SocketStream, frames: _Frames) -> None:
        got = await frames.next()
        assert got is not None
        sent = msgspec.msgpack.decode(got[0], type=Request)
        await stream.send_all(answer_frame(sent.id, {"ok": 1}))
        assert await frames.next() is None  # (no cancel comes: the channel closes)

    async with late_answerer(script) as (channels, url, orphans):
        monkeypatch.setattr(prefill_channel, "ChannelAnswer", arrives_as_the_caller_is_cancelled)
        with trio.fail_after(30):
            with caller:
                await channels.post(url, "/v1/completions", b"{}", {})
            assert caller.cancelled_caught
            [orphan] = orphans
            assert json.loads(orphan.content) == {"ok": 1}
            assert (channels.orphans, channels.answered) == (1, 1)  # (handed over, not taken)


async def test_a_decode_first_engine_gives_back_what_an_orphaned_answer_exposed() -> None:
    """Its channels hand orphans to ``give_back_answer``, which abandons the
    exposure a 200 names at once (instead of when its lease runs out), and
    ignores an error answer or a body that is not JSON."""
    async with (
        deployment() as (prefill, decode, prefill_url, _),
        http_client(30) as client,
    ):
        assert decode.prefiller is not None
        assert prefiller_channels(decode).orphaned == decode.give_back_answer
        [producer] = prefill.connectors
        with trio.fail_after(60):
            body = {"prompt": "its client left", "kv_transfer_params": {"do_remote_decode": True}}
            exposed = await client.post(f"{prefill_url}/v1/completions", json=body)
            assert exposed.status_code == 200, exposed.text
            for ignored in (ChannelAnswer(500, {}, exposed.content), ChannelAnswer(200, {}, b"{")):
                decode.give_back_answer(ignored)
            await trio.sleep(0.1)
            assert producer.statistics().exposures_pending == 1
            decode.give_back_answer(ChannelAnswer(200, {}, exposed.content))
            await until(lambda: producer.statistics().exposures_abandoned == 1)
            assert producer.statistics().exposures_pending == 0
