"""The consumer's confirmation channels (``_confirm``) against scripted producers.

A real ROUTER socket on loopback plays the producer's side channel and
answers confirmations as the test says: late, never, with another ``seq``,
with garbage, with an error reply. The real producer's answers are tested
end to end in ``tests/test_isolation.py``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import zmq

import trio_pd
from trio_pd._consumer import _pulls
from trio_pd._core import _protocol as protocol
from trio_pd._side_channel._confirm import ConfirmChannels
from trio_pd._side_channel._zmq import TrioZmqSocket

from .conftest import wait_until

CONFIG = trio_pd.ConnectorConfig(handshake_timeout=0.3)

Answer = Callable[[protocol.ConfirmEntry], list[bytes]]
"""What the scripted producer sends back for one confirmation (maybe nothing)."""


def reply(seq: int, state: protocol.ConfirmState, held_for: float = 10.0) -> bytes:
    """A confirmation reply answering ``seq`` alone."""
    return protocol.confirm_reply([protocol.ConfirmAnswer(seq, state, held_for)])


class Producer:
    """The scripted producer's port, what it received, and a way to answer later."""

    def __init__(self, router: TrioZmqSocket, port: int) -> None:
        self.router = router
        self.port = port
        self.seen: list[int] = []
        self.identity = b""
        self.outbox: list[bytes] = []

    def reply(self, seq: int, state: protocol.ConfirmState) -> None:
        """Answer ``seq`` now (the serving task sends it within 10 ms)."""
        self.outbox.append(reply(seq, state))


@asynccontextmanager
async def scripted(answer: Answer) -> AsyncIterator[Producer]:
    """A ROUTER on a free loopback port answering as ``answer`` says."""
    with zmq.Context() as context:
        router = TrioZmqSocket(context.socket(zmq.ROUTER))
        async with router, trio.open_nursery() as nursery:
            router.zmq_socket.setsockopt(zmq.LINGER, 0)
            producer = Producer(router, router.zmq_socket.bind_to_random_port("tcp://127.0.0.1"))

            async def serve() -> None:
                while True:
                    frames: list[bytes] = []
                    while producer.outbox:
                        message = producer.outbox.pop(0)
                        await router.send_multipart([producer.identity, b"", message])
                    with trio.move_on_after(0.01):
                        frames = await router.receive_multipart()
                    if not frames:
                        continue
                    identity, _, payload = frames
                    request = protocol.decode_request(payload, 1 << 20)
                    assert isinstance(request, protocol.ConfirmRequest)
                    producer.identity = identity
                    for entry in request.entries:
                        producer.seen.append(entry.seq)
                        for message in answer(entry):
                            await router.send_multipart([identity, b"", message])

            # (bound already: what arrives before serve runs waits in the socket)
            nursery.start_soon(serve)  # noqa: ASYNC113
            yield producer
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def scripted_producer(answer: Answer) -> AsyncIterator[tuple[int, list[int]]]:
    """:func:`scripted`, as its port and the ``seq`` of every confirmation received."""
    async with scripted(answer) as producer:
        yield producer.port, producer.seen


@asynccontextmanager
async def channels(config: trio_pd.ConnectorConfig = CONFIG) -> AsyncIterator[ConfirmChannels]:
    with zmq.Context() as context:
        confirms = ConfirmChannels("d", "d#1", context, config)
        try:
            yield confirms
        finally:
            confirms.close()


def send(confirms: ConfirmChannels, port: int, nonce: int = 1) -> object:
    return confirms.send(("p", "127.0.0.1", port), "r", "", "", b"12345678", nonce)


async def test_a_producer_that_never_answers_fails_the_pull_as_unconfirmed_in_time() -> None:
    async with scripted_producer(lambda request: []) as (port, seen), channels() as confirms:
        pending = send(confirms, port)
        started = trio.current_time()
        with trio.fail_after(5), pytest.raises(trio_pd.ExposureEndedError) as info:
            await confirms.check(pending, trio.current_time(), "pull-1", [3])  # type: ignore[arg-type]
        assert info.value.outcome == "unconfirmed"
        assert info.value.request_id == "pull-1"
        assert "no reply within 0.3 s" in info.value.reason
        # one confirmation, then one more on a fresh socket, each handshake_timeout
        assert len(seen) == 2
        assert trio.current_time() - started < 2 * CONFIG.handshake_timeout + 1.0
        assert confirms.open_channels == 0


@pytest.mark.parametrize(
    "noise",
    [
        [b"\xc1 not msgpack"],
        [reply(10**9, "held")],  # another seq
        [b"", b"two frames"],
    ],
    ids=["garbage", "another-seq", "extra-frame"],
)
async def test_replies_that_answer_nothing_of_ours_are_dropped(noise: list[bytes]) -> None:
    def answer(entry: protocol.ConfirmEntry) -> list[bytes]:
        return [*noise, reply(entry.seq, "read")]

    async with scripted_producer(answer) as (port, _), channels() as confirms:
        with trio.fail_after(5):
            await confirms.check(send(confirms, port), trio.current_time(), "p", [1])  # type: ignore[arg-type]


async def test_an_error_reply_fails_every_confirmation_waiting_on_that_socket() -> None:
    def answer(entry: protocol.ConfirmEntry) -> list[bytes]:
        return [protocol.encode_message(protocol.error_reply("bad_request", "nope"))]

    async with scripted_producer(answer) as (port, _), channels() as confirms:
        with trio.fail_after(5), pytest.raises(trio_pd.ExposureEndedError) as info:
            await confirms.check(send(confirms, port), trio.current_time(), "p", [1])  # type: ignore[arg-type]
        assert "refused (bad_request): nope" in info.value.reason


async def test_many_pulls_waiting_on_one_channel_each_get_their_own_answer() -> None:
    # Replies come back in reverse order, and only once all were sent: the
    # pulls that do not lead the wait on the socket are handed their answers.
    held: list[protocol.ConfirmEntry] = []

    def answer(entry: protocol.ConfirmEntry) -> list[bytes]:
        held.append(entry)
        if len(held) < 20:
            return []
        return [reply(e.seq, "held" if e.nonce % 2 else "expired") for e in reversed(held)]

    outcomes: dict[int, str] = {}
    async with scripted_producer(answer) as (port, _), channels() as confirms:

        async def pull(nonce: int) -> None:
            pending = send(confirms, port, nonce)
            try:
                await confirms.check(pending, trio.current_time(), f"p{nonce}", [nonce])  # type: ignore[arg-type]
                outcomes[nonce] = "ok"
            except trio_pd.ExposureEndedError as exc:
                outcomes[nonce] = exc.outcome

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for nonce in range(1, 21):
                    nursery.start_soon(pull, nonce)
    assert outcomes == {n: "ok" if n % 2 else "expired" for n in range(1, 21)}


async def test_a_pull_cancelled_while_it_leads_hands_the_wait_on() -> None:
    # The first pull leads the wait on the socket and is cancelled; the second
    # pull's answer comes afterwards and must wake it at once, not at its
    # deadline (the lead was handed on).
    patient = trio_pd.ConnectorConfig(handshake_timeout=10.0)
    async with scripted(lambda request: []) as producer, channels(patient) as confirms:
        with trio.fail_after(8):
            first = send(confirms, producer.port, 1)
            second = send(confirms, producer.port, 2)
            done = trio.Event()
            async with trio.open_nursery() as nursery:
                cancel_first = trio.CancelScope()

                async def lead() -> None:
                    with cancel_first:
                        await confirms.check(first, trio.current_time(), "a", [1])  # type: ignore[arg-type]

                async def follow() -> None:
                    await confirms.check(second, trio.current_time(), "b", [2])  # type: ignore[arg-type]
                    done.set()

                nursery.start_soon(lead)
                await wait_until(lambda: len(producer.seen) == 1)
                nursery.start_soon(follow)  # (the second was queued: its wait sends it)
                await wait_until(lambda: len(producer.seen) == 2)
                await trio.sleep(0.02)
                cancel_first.cancel()
                await trio.sleep(0.02)
                answered_at = trio.current_time()
                producer.reply(producer.seen[1], "read")
                await done.wait()
                # (the second's deadline is 10 s away: it was woken by the reply)
                assert trio.current_time() - answered_at < patient.handshake_timeout / 2


async def test_a_request_whose_pulls_all_gave_up_no_longer_holds_back_the_next() -> None:
    # Confirmations posted while a request waits for its answer are queued for
    # the next one. A request whose answer was lost, and whose pulls all gave
    # up (cancelled) before their deadline, must not keep them queued for good.
    patient = trio_pd.ConnectorConfig(handshake_timeout=10.0)
    async with scripted(lambda entry: []) as producer, channels(patient) as confirms:
        with trio.fail_after(5):
            first = send(confirms, producer.port, 1)
            await wait_until(lambda: len(producer.seen) == 1)
            with trio.move_on_after(0.05):
                await confirms.check(first, trio.current_time(), "a", [1])  # type: ignore[arg-type]
            send(confirms, producer.port, 2)  # (nobody waits for it yet: sent at once)
            await wait_until(lambda: len(producer.seen) == 2)


async def test_a_channel_whose_socket_cannot_be_set_up_is_closed_and_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A socket option ZeroMQ refuses fails that confirmation with the reason
    and closes the socket it made (found by review: only a failed connect
    closed it; the context's ``term`` waits forever for a socket left open)."""
    context = zmq.Context()
    confirms = ConfirmChannels("d", "d#1", context, CONFIG)
    setsockopt = zmq.Socket.setsockopt

    def refusing(self: zmq.Socket[bytes], option: int, value: object) -> None:
        if option == zmq.MAXMSGSIZE:
            raise zmq.ZMQError(zmq.EINVAL, "refused by this test")
        setsockopt(self, option, value)

    monkeypatch.setattr(zmq.Socket, "setsockopt", refusing)
    pending = send(confirms, 9)
    monkeypatch.undo()
    assert pending.done  # type: ignore[attr-defined]
    assert "refused by this test" in pending.failure  # type: ignore[attr-defined]
    assert confirms.open_channels == 0
    confirms.close()
    with trio.fail_after(10):
        await trio.to_thread.run_sync(context.term, abandon_on_cancel=True)


def test_read_nonces_are_distinct_in_range_and_drawn_64_per_system_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    draws: list[int] = []
    urandom = os.urandom

    def counted(n: int) -> bytes:
        draws.append(n)
        return urandom(n)

    monkeypatch.setattr(_pulls.os, "urandom", counted)
    _pulls._nonces.clear()
    nonces = [_pulls._nonce() for _ in range(640)]
    assert all(1 <= n <= protocol.MAX_NONCE for n in nonces)
    assert len(set(nonces)) == len(nonces)
    assert draws == [8 * 64] * 10
