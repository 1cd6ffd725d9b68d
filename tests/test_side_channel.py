"""The side channel under attack and against broken peers (real ZeroMQ sockets)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager

import msgspec
import pytest
import trio
import trio.testing
import zmq

import trio_pd
import trio_pd.testing
from trio_pd._core import _protocol as protocol
from trio_pd._side_channel._confirm import ConfirmChannels
from trio_pd._side_channel._zmq import SocketSetups, TrioZmqSocket
from trio_pd.testing import free_port_range

from .conftest import FAST, kv_cache, wait_until


async def _request(
    context: zmq.Context[zmq.Socket[bytes]], port: int, frames: list[bytes], wait: float = 2.0
) -> list[bytes] | None:
    """Send raw ``frames`` from a fresh DEALER; the reply, or None if none came."""
    socket = TrioZmqSocket(context.socket(zmq.DEALER))
    async with socket:
        socket.zmq_socket.setsockopt(zmq.LINGER, 0)
        socket.zmq_socket.connect(f"tcp://127.0.0.1:{port}")
        await socket.send_multipart(frames)
        with trio.move_on_after(wait):
            return await socket.receive_multipart()
    return None


def _error_code(reply: list[bytes] | None) -> str:
    assert reply is not None
    assert reply[0] == b""
    decoded = msgspec.msgpack.decode(reply[1])
    assert decoded["type"] == "error"
    return str(decoded["code"])


async def test_listener_survives_hostile_input_and_keeps_serving() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with trio.fail_after(60):
            async with (
                trio_pd.open_connector("p", kv_cache(blocks=8), config=FAST) as producer,
                trio_pd.open_connector("d", kv_cache(blocks=8), config=FAST) as consumer,
            ):
                port = producer.address[1]
                garbage = _error_code(await _request(context, port, [b"", os.urandom(64)]))
                assert garbage == "bad_request"
                unknown = msgspec.msgpack.encode(
                    {"type": "nope", "protocol_version": protocol.PROTOCOL_VERSION}
                )
                assert _error_code(await _request(context, port, [b"", unknown])) == "bad_request"
                future = msgspec.msgpack.encode({"type": "metadata_request", "protocol_version": 9})
                code = _error_code(await _request(context, port, [b"", future]))
                assert code == "unsupported_version"
                wrong = protocol.encode_request("not-p", "d")
                assert _error_code(await _request(context, port, [b"", wrong])) == "wrong_engine"
                # Wrong frame counts get no reply (there is no envelope to answer).
                assert await _request(context, port, [b"lonely"], wait=0.3) is None
                assert await _request(context, port, [b"", b"a", b"b"], wait=0.3) is None
                # Oversized: ZeroMQ drops the connection before we see the message.
                big = b"x" * (FAST.max_message_bytes + 1)
                assert await _request(context, port, [b"", big], wait=0.3) is None
                assert producer.statistics().listener_rejects == 6
                # Not ZeroMQ at all (libzmq may parse it as legacy ZMTP 1.0
                # framing and hand us junk messages: rejected too).
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(os.urandom(4096))
                await stream.aclose()

                # A burst: 2000 valid requests from 8 peers, all answered.
                request = protocol.encode_request("p", "burst")
                answered = 0

                async def burst() -> None:
                    nonlocal answered
                    socket = TrioZmqSocket(context.socket(zmq.DEALER))
                    async with socket:
                        socket.zmq_socket.setsockopt(zmq.LINGER, 0)
                        socket.zmq_socket.connect(f"tcp://127.0.0.1:{port}")
                        for _ in range(250):
                            await socket.send_multipart([b"", request])
                        for _ in range(250):
                            reply = await socket.receive_multipart()
                            assert msgspec.msgpack.decode(reply[1])["type"] == "metadata_reply"
                            answered += 1

                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(burst)
                assert answered == 2000

                # Still serving real consumers.
                await consumer.pull("after", [0], producer.expose("r", [1]))
                stats = producer.statistics()
                assert stats.listener_rejects >= 6
                assert stats.listener_requests == 2001
    finally:
        context.destroy(linger=0)


async def _serve_replies(
    context: zmq.Context[zmq.Socket[bytes]],
    reply: bytes | None,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer every request with ``reply`` (``None``: never answer), until cancelled."""
    socket = TrioZmqSocket(context.socket(zmq.ROUTER))
    async with socket:
        socket.zmq_socket.setsockopt(zmq.LINGER, 0)
        port = socket.zmq_socket.bind_to_random_port("tcp://127.0.0.1")
        task_status.started(port)
        while True:
            frames = await socket.receive_multipart()
            if reply is not None:
                await socket.send_multipart([frames[0], b"", reply])


def _metadata_reply(engine_id: str = "fake", version: int = protocol.PROTOCOL_VERSION) -> bytes:
    metadata = protocol.EngineMetadata(
        engine_id=engine_id,
        incarnation="0",
        agent_name=f"{engine_id}#0",
        agent_metadata=b"not really",
        num_blocks=8,
        base_addrs=[4096] * 4,
        block_lens=[4096] * 4,
        device_id=0,
        mem_type="DRAM",
        dtype="torch.float16",
        kv_heads=0,
        tp_rank=0,
        tp_size=1,
    )
    reply = protocol.metadata_reply(metadata, protocol.compatibility_hash(""))
    if version != protocol.PROTOCOL_VERSION:
        reply = protocol.MetadataReply(version, reply.compatibility_hash, reply.engine_metadata)
    return protocol.encode_message(reply)


@pytest.mark.parametrize(
    ("reply", "error", "match", "cause"),
    [
        (None, trio_pd.HandshakeError, "connected, but the peer never replied", "timeout"),
        (b"\xc1garbage", trio_pd.HandshakeError, "undecodable reply", "protocol"),
        (
            b"x" * (2 << 20),
            trio_pd.HandshakeError,
            r"closed the connection \d+ time\(s\) before replying .*1048576-byte limit",
            "timeout",
        ),
        (_metadata_reply(version=7), trio_pd.IncompatibleEngineError, "version 7", "incompatible"),
        (
            _metadata_reply("impostor"),
            trio_pd.IncompatibleEngineError,
            "reply is from engine 'impostor'",
            "incompatible",
        ),
    ],
    ids=["silent", "garbage", "oversized", "other-version", "wrong-engine"],
)
async def test_broken_peers_fail_the_handshake_clearly_within_the_deadline(
    reply: bytes | None, error: type[Exception], match: str, cause: str
) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    config = trio_pd.ConnectorConfig(handshake_timeout=1.0)
    try:
        with trio.fail_after(30):
            async with (
                trio.open_nursery() as nursery,
                trio_pd.open_connector("p", kv_cache(blocks=8), config=FAST) as producer,
                trio_pd.open_connector("d", kv_cache(blocks=8), config=config) as consumer,
            ):
                port = await nursery.start(_serve_replies, context, reply)
                remote = trio_pd.RemoteBlocks("fake", "127.0.0.1", port, [0], "r")
                started = trio.current_time()

                good_done = trio.Event()

                async def pull_from_a_good_engine_meanwhile() -> None:
                    await consumer.pull("good", [1], producer.expose("g", [2]))
                    good_done.set()

                nursery.start_soon(pull_from_a_good_engine_meanwhile)
                with pytest.raises(error, match=match) as info:
                    await consumer.pull("bad", [0], remote)
                assert trio.current_time() - started < 1.0 + 0.5
                assert info.value.engine_id == "fake"  # type: ignore[attr-defined]
                stats = consumer.statistics()
                assert stats.handshake_failures_by_cause == {cause: 1}
                await good_done.wait()
                nursery.cancel_scope.cancel()
            assert consumer.statistics().pulls_succeeded == 1
    finally:
        context.destroy(linger=0)


async def test_a_closed_port_is_named_as_refused() -> None:
    # (below the ephemeral range: no listener on port 0, of the other test
    # worker say, is given it meanwhile)
    port = free_port_range(1)
    config = trio_pd.ConnectorConfig(handshake_timeout=0.5)
    with trio.fail_after(10):
        async with trio_pd.open_connector("d", kv_cache(blocks=4), config=config) as consumer:
            remote = trio_pd.RemoteBlocks("gone", "127.0.0.1", port, [0], "r")
            with pytest.raises(trio_pd.HandshakeError, match=r"connection refused \(\d+ attempts"):
                await consumer.pull("r", [0], remote)


async def test_a_zmq_receive_is_a_checkpoint_whether_it_waited_or_not() -> None:
    """A receive that waited for the descriptor passes no second schedule
    point (a server answers sooner); one that found its message at once
    passes one after it; a cancelled one receives nothing."""
    with zmq.Context() as context:
        pull = TrioZmqSocket(context.socket(zmq.PAIR))
        push = TrioZmqSocket(context.socket(zmq.PAIR))
        async with pull, push:
            pull.zmq_socket.bind("inproc://checkpoints")
            push.zmq_socket.connect("inproc://checkpoints")
            async with trio.open_nursery() as nursery:

                async def send_later() -> None:
                    await trio.sleep(0.05)
                    await push.send_multipart([b"waited"])

                nursery.start_soon(send_later)
                with trio.testing.assert_checkpoints():
                    assert await pull.receive_multipart() == [b"waited"]
            await push.send_multipart([b"at once"])
            with trio.fail_after(5):
                await wait_until(lambda: pull.zmq_socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            with trio.CancelScope() as scope:
                scope.cancel()
                await pull.receive_multipart()
            assert scope.cancelled_caught
            with trio.testing.assert_checkpoints():
                assert await pull.receive_multipart() == [b"at once"]


class _Passes(trio.abc.Instrument):
    """Counts the passes of trio's scheduler (each ends polling for I/O)."""

    def __init__(self) -> None:
        self.count = 0

    def before_io_wait(self, timeout: float) -> None:
        self.count += 1


async def test_socket_setups_take_turns_one_per_scheduler_pass() -> None:
    """Tasks that want a turn at once get it in passes of their own; a task
    cancelled while it waits leaves the others their turns; a turn is a
    checkpoint even when nobody else waits."""
    setups = SocketSetups()
    passes = _Passes()
    seen: list[tuple[int, int]] = []
    waiting = trio.CancelScope()

    async def setup(n: int) -> None:
        async with setups.turn():
            seen.append((n, passes.count))

    async def cancelled_while_waiting() -> None:
        with waiting:
            async with setups.turn():
                raise AssertionError("a cancelled wait got a turn")

    trio.lowlevel.add_instrument(passes)
    try:
        with trio.fail_after(5):
            # (the test holds a turn: every task below waits for it)
            async with trio.open_nursery() as nursery, setups.turn():
                for n in range(3):
                    nursery.start_soon(setup, n)
                nursery.start_soon(cancelled_while_waiting)
                for n in range(3, 6):
                    nursery.start_soon(setup, n)
                await trio.testing.wait_all_tasks_blocked()
                waiting.cancel()
                await trio.testing.wait_all_tasks_blocked()
    finally:
        trio.lowlevel.remove_instrument(passes)
    assert waiting.cancelled_caught
    assert sorted(n for n, _ in seen) == [0, 1, 2, 3, 4, 5]
    in_passes = [count for _, count in seen]
    assert len(set(in_passes)) == len(in_passes), seen  # (never two in one pass)
    with trio.testing.assert_checkpoints():
        async with setups.turn():
            pass


async def test_what_a_task_does_after_its_turn_is_never_in_another_turns_pass() -> None:
    """After a turn's body, its task passes a schedule point before the next
    task's turn begins: what it does next (a send, decoding a reply) runs in a
    pass of the scheduler that holds no turn's body."""
    setups = SocketSetups()
    passes = _Passes()
    bodies: list[int] = []
    afters: list[int] = []

    async def setup() -> None:
        async with setups.turn():
            bodies.append(passes.count)
        afters.append(passes.count)

    trio.lowlevel.add_instrument(passes)
    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(setup)
    finally:
        trio.lowlevel.remove_instrument(passes)
    assert len(set(bodies)) == len(bodies) == 5, bodies
    assert not set(bodies) & set(afters), (bodies, afters)


async def test_first_pulls_to_one_rank_wait_for_one_channel_not_for_a_turn_each() -> None:
    """Twenty first confirmations to one producer rank at once: one socket,
    made in one turn; the others wait for it (a turn each would take twenty
    passes of the scheduler)."""
    passes = _Passes()
    setups = SocketSetups()
    with zmq.Context() as context:
        channels = ConfirmChannels("d", "d#1", context, FAST, setups=setups)
        rank = ("p", "127.0.0.1", free_port_range(1))  # (nothing listens: connect is lazy)
        trio.lowlevel.add_instrument(passes)
        try:
            with trio.fail_after(5):
                first = passes.count
                async with trio.open_nursery() as nursery:
                    for _ in range(20):
                        nursery.start_soon(channels.open, rank)
                took = passes.count - first
        finally:
            trio.lowlevel.remove_instrument(passes)
            channels.close()
    assert channels.is_open(rank) is False  # (closed)
    assert took <= 5, took  # (one turn: its own pass, and the pass after its body)


async def _first_pulls(
    monkeypatch: pytest.MonkeyPatch,
    engines: int,
    made: Callable[[], None],
    *,
    at_once: bool,
    during: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> None:
    """First pulls to ``engines`` engines of a prefill worker (all at once, or
    one after another), calling ``made()`` for every DEALER socket the trio
    thread makes meanwhile, with ``during()`` entered around them."""
    socket = zmq.Context.socket

    def counted(self: zmq.Context[zmq.Socket[bytes]], kind: int, **kwargs: object) -> object:
        if kind == zmq.DEALER and trio.lowlevel.in_trio_run():
            made()
        return socket(self, kind, **kwargs)

    spec = trio_pd.testing.WorkerSpec(
        "first", regions=2, blocks=16, block_shape=(8, 64), engines=engines
    )
    with trio.fail_after(60):
        async with trio_pd.testing.open_prefill_worker(spec) as worker:
            remotes = [
                (await worker.expose_many([("r", [e], e)], engine=e))[0] for e in range(engines)
            ]
            local = kv_cache(regions=2, blocks=16, block_shape=(8, 64))
            async with trio_pd.open_connector("d", local, config=FAST) as consumer:
                with monkeypatch.context() as patched, during():
                    patched.setattr(zmq.Context, "socket", counted)
                    async with trio.open_nursery() as nursery:
                        for e, remote in enumerate(remotes):
                            if at_once:
                                nursery.start_soon(consumer.pull, f"p{e}", [e], remote)
                            else:
                                await consumer.pull(f"p{e}", [e], remote)
                assert consumer.statistics().pulls_failed == 0


async def test_a_storm_of_first_pulls_makes_one_socket_per_scheduler_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four engines, first pulls to each all at once: their metadata fetches
    and their confirmation channels open DEALER sockets, and trio would run
    the four tasks' setups in one pass (a loop stall, benchmark 3); the
    connector makes them in passes of their own."""
    passes = _Passes()
    made: list[int] = []

    @contextlib.contextmanager
    def counting_passes() -> Iterator[None]:
        trio.lowlevel.add_instrument(passes)
        try:
            yield
        finally:
            trio.lowlevel.remove_instrument(passes)

    await _first_pulls(
        monkeypatch, 4, lambda: made.append(passes.count), at_once=True, during=counting_passes
    )
    assert len(made) >= 8, made  # (a fetch and a confirmation channel per engine)
    assert len(set(made)) == len(made), made


async def test_every_dealer_of_a_first_pull_is_made_in_a_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fetch's and the confirmation channel's DEALERs are made inside a
    turn, not by the confirmation's send on the pull's path (found by review:
    the storm test above passes without the pull's ``open``, its channels
    happening to be made in different passes)."""
    inside = 0
    made: list[bool] = []
    turn = SocketSetups.turn

    @contextlib.asynccontextmanager
    async def flagged(self: SocketSetups) -> AsyncIterator[None]:
        nonlocal inside
        async with turn(self):
            inside += 1
            try:
                yield
            finally:
                inside -= 1

    monkeypatch.setattr(SocketSetups, "turn", flagged)
    await _first_pulls(monkeypatch, 2, lambda: made.append(inside > 0), at_once=False)
    assert len(made) >= 4, made  # (a fetch and a channel per engine)
    assert all(made), made
