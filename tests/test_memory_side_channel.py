"""The in-memory side channel (``MemoryFabric.side_channel``): what its faults do.

It stands in for ZeroMQ in the control-plane tests (test_leases,
test_memory_backend, test_partial_failure...), so it must fail as ZeroMQ
fails: each fault here ends as the ZeroMQ side channel's failures end
(test_side_channel, test_confirm), with the same diagnosis, at the deadline
to the instant (trio's mock clock: nothing else is real).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import msgspec
import pytest
import torch
import trio
import trio.lowlevel
import trio.testing

import trio_pd
from trio_pd._core import _protocol as protocol
from trio_pd._side_channel._fetch import ConnectionLog
from trio_pd.testing import MemoryFabric, fill_blocks, mismatched_blocks

from .conftest import kv_cache, live_threads, open_fds

pytest_plugins = ["trio_pd.testing.fixtures"]

QUICK = trio_pd.ConnectorConfig(
    handshake_timeout=0.5,
    transfer_timeout=0.5,
    close_timeout=1.0,
    backoff_initial=0.2,
    backoff_max=0.4,
    backoff_jitter=0.0,
    heartbeat_interval=0.2,
)


@asynccontextmanager
async def engine(
    fabric: MemoryFabric,
    engine_id: str,
    config: trio_pd.ConnectorConfig = QUICK,
    heads: int = 16,
    **options: object,
) -> AsyncIterator[tuple[trio_pd.Connector, list[torch.Tensor]]]:
    kv = kv_cache(blocks=16, block_shape=(heads, 128))
    async with trio_pd.open_connector(
        engine_id,
        kv,
        config=config,
        backend=fabric.backend,
        side_channel=fabric.side_channel,
        **options,  # type: ignore[arg-type]
    ) as conn:
        yield conn, kv


class _Echo:
    """A listener that answers every request with ``reply`` (and counts them)."""

    def __init__(self, reply: bytes = b"pong") -> None:
        self.reply = reply
        self.requests: list[bytes] = []

    def bound(self, address: tuple[str, int]) -> None:
        pass

    def answer(self, payload: bytes) -> bytes:
        self.requests.append(payload)
        return self.reply

    def dropped(self, why: str) -> None:
        raise AssertionError(why)  # pragma: no cover

    def auth_refused(self, reason: str) -> None:
        raise AssertionError(reason)  # pragma: no cover


async def test_connectors_on_the_fabric_alone_open_no_socket_and_no_thread(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    fds, threads = open_fds(), live_threads()
    async with engine(memory_fabric, "p") as (p, prefill_kv), engine(memory_fabric, "d") as (d, kv):
        fill_blocks(prefill_kv, [3, 4], seed=5)
        remote = p.expose("r", [3, 4])
        async with d.hold(remote):
            await trio.sleep(10.1)  # (51 heartbeats: no time passes outside trio's clock)
            await d.pull("r", [0, 1], remote)
        assert mismatched_blocks(kv, [0, 1], seed=5) == []
        assert await p.wait_released("r") is trio_pd.Released.READ
        assert (open_fds(), live_threads()) == (fds, threads)
        assert p.statistics().listener_requests == 1  # (the handshake's metadata)
        assert p.statistics().leases_renewed == 51
        assert p.statistics().confirmations == 1


async def test_nobody_listening_is_refused_until_the_deadline(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    async with engine(memory_fabric, "d") as (d, _):
        started = trio.current_time()
        with pytest.raises(trio_pd.HandshakeError) as info:
            await d.pull("r", [0], trio_pd.RemoteBlocks("gone", "127.0.0.1", 4000, [0], "r"))
        assert trio.current_time() - started == pytest.approx(QUICK.handshake_timeout)
        assert info.value.reason == (
            "no reply from 127.0.0.1:4000 within 0.5 s: connection refused (5 attempts)"
        )
        assert d.statistics().handshake_failures_by_cause == {"timeout": 1}


@pytest.mark.parametrize(
    ("fault", "diagnosis"),
    [
        ("mute", "connected, but the peer never replied"),
        ("unreachable", "could not connect"),
        ("refuse", "connection refused (5 attempts)"),
    ],
)
async def test_a_fault_fails_the_handshake_at_its_deadline_with_zeromqs_words(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock, fault: str, diagnosis: str
) -> None:
    async with engine(memory_fabric, "p") as (p, _), engine(memory_fabric, "d") as (d, _):
        setattr(memory_fabric.faults("p"), fault, True)
        started = trio.current_time()
        with pytest.raises(trio_pd.HandshakeError) as info:
            await d.pull("r", [0], p.expose("r", [1]))
        assert trio.current_time() - started == pytest.approx(QUICK.handshake_timeout)
        assert (
            info.value.reason
            == f"no reply from {p.address[0]}:{p.address[1]} within 0.5 s: " + (diagnosis)
        )
        # Cleared: after the backoff, the next pull gets through.
        setattr(memory_fabric.faults("p"), fault, False)
        await trio.sleep(QUICK.backoff_initial)
        await d.pull("again", [0], p.expose("again", [2]))


async def test_a_fault_set_for_one_agent_leaves_the_other_ranks_alone(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        engine(memory_fabric, "p", heads=8, port=5000, tp_rank=0, tp_size=2) as (p0, _),
        engine(memory_fabric, "p", heads=8, port=5000, tp_rank=1, tp_size=2) as (p1, _),
        engine(memory_fabric, "d") as (d, _),
    ):
        [agent1] = [b.agent_name for b in memory_fabric.backends if b.agent_name.startswith("p#")][
            1:
        ]
        memory_fabric.faults(agent1).mute = True
        remote = p0.expose("r", [1])
        p1.expose("r", [1])
        with pytest.raises(trio_pd.HandshakeError) as info:
            await d.pull("r", [0], remote)
        assert "127.0.0.1:5001 (rank 1 of 2) within 0.5 s: connected, but" in info.value.reason
        assert d.engine_state("p", 0) is trio_pd.EngineState.READY
        assert d.engine_state("p", 1) is trio_pd.EngineState.BACKOFF


async def test_a_slow_reply_is_waited_for_within_the_deadline_and_not_past_it(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    async with engine(memory_fabric, "p") as (p, _), engine(memory_fabric, "d") as (d, _):
        memory_fabric.faults("p").reply_delay = 0.3
        result = await d.pull("r", [0], p.expose("r", [1]))
        # the handshake's fetch (0.3 s), then the READ's confirmation (sent
        # before the READ, whose answer came 0.3 s later)
        assert result.handshake_wait == pytest.approx(0.3)
        assert result.seconds == pytest.approx(0.6)
        memory_fabric.faults("p").reply_delay = 0.6  # (over handshake_timeout)
        with pytest.raises(trio_pd.ExposureEndedError) as info:
            await d.pull("late", [1], p.expose("late", [2]))
        assert info.value.outcome == "unconfirmed"
        assert "no reply within 0.5 s" in info.value.reason


async def test_a_producer_restarted_within_the_deadline_is_reached(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    channel = memory_fabric.side_channel("d#1", QUICK)
    log = ConnectionLog(1 << 20)
    echo = _Echo()
    replies: list[bytes] = []

    async def ask() -> None:
        replies.append(await channel.request(("p", "127.0.0.1", 7000), b"ping", log))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.sleep(0.35)  # (refused at 0, 0.1, 0.2 and 0.3 s)
        listener = memory_fabric.side_channel("p#2", QUICK)
        await nursery.start(listener.serve, "127.0.0.1", 7000, echo)
        await trio.sleep(0.1)
        assert replies == [b"pong"]
        nursery.cancel_scope.cancel()
    assert (log.refused, log.connected, echo.requests) == (4, 1, [b"ping"])


async def test_a_listener_that_goes_away_during_a_slow_reply_is_not_the_one_that_answers(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    first, second = _Echo(b"first"), _Echo(b"second")
    memory_fabric.faults("p").reply_delay = 0.2
    channel = memory_fabric.side_channel("d#1", QUICK)
    async with trio.open_nursery() as nursery:
        serving = trio.CancelScope()

        async def serve_first(*, task_status: trio.TaskStatus[None]) -> None:  # noqa: ASYNC128 -- task_status is handed on
            with serving:
                await memory_fabric.side_channel("p#1", QUICK).serve(
                    "127.0.0.1", 7000, first, task_status=task_status
                )

        await nursery.start(serve_first)
        replies: list[bytes] = []

        async def ask() -> None:
            replies.append(await channel.request(("p", "127.0.0.1", 7000), b"x", ConnectionLog(99)))

        nursery.start_soon(ask)
        await trio.sleep(0.1)
        serving.cancel()  # (the first incarnation exits mid-request ...)
        await trio.lowlevel.checkpoint()
        await nursery.start(
            memory_fabric.side_channel("p#2", QUICK).serve, "127.0.0.1", 7000, second
        )
        await trio.sleep(0.2)  # (... and the second, at the same address, answers it)
        assert replies == [b"second"]
        nursery.cancel_scope.cancel()
    assert (first.requests, second.requests) == ([], [b"x"])


async def test_messages_over_a_limit_drop_the_connection_as_zeromq_does(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    big = _Echo(b"x" * 2000)
    small = attrs.evolve(QUICK, max_message_bytes=1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(memory_fabric.side_channel("p#1", small).serve, "127.0.0.1", 7000, big)
        channel = memory_fabric.side_channel("d#1", QUICK)
        for payload, reply_limit in [(b"y" * 2000, 1 << 20), (b"y", 1000)]:
            log = ConnectionLog(reply_limit)
            with trio.move_on_after(0.45):
                await channel.request(("p", "127.0.0.1", 7000), payload, log)
            assert log.diagnosis() == (
                "the peer closed the connection 5 time(s) before replying "
                "(is its reply over our 1000-byte limit?)".replace("1000", str(reply_limit))
            )
        nursery.cancel_scope.cancel()
    assert len(big.requests) == 5  # (only the small request reached it: once per round)


async def test_binding_an_address_in_use_fails_and_port_zero_picks_a_free_one(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    async with engine(memory_fabric, "a") as (a, _), engine(memory_fabric, "b") as (b, _):
        assert a.address != b.address
        with pytest.raises(OSError, match="Address already in use"):
            async with engine(memory_fabric, "c", port=a.address[1]):
                pass  # pragma: no cover
        with pytest.raises(OSError, match="Address already in use"):
            async with engine(
                memory_fabric, "c", host="0.0.0.0", advertise_host="h", port=b.address[1]
            ):
                pass  # pragma: no cover
    async with (
        engine(memory_fabric, "w", host="0.0.0.0", advertise_host="10.0.0.1") as (w, _),
        engine(memory_fabric, "d") as (d, _),
    ):
        remote = w.expose("r", [1])
        assert (remote.host, remote.port) == ("10.0.0.1", w.address[1])
        await d.pull("r", [0], remote)  # (a wildcard bind is reached on any host)


async def test_the_memory_side_channel_refuses_curve(memory_fabric: MemoryFabric) -> None:
    public, secret = trio_pd.generate_keypair()
    auth = trio_pd.CurveAuth(public_key=public, secret_key=secret, allowed_consumers={public})
    with pytest.raises(ValueError, match="no CURVE"):
        async with engine(memory_fabric, "p", attrs.evolve(QUICK, auth=auth)):
            pass  # pragma: no cover


async def test_what_the_producer_rejects_it_rejects_here_too(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    # The listener is the producer's own: a payload it cannot parse gets its error reply.
    async with engine(memory_fabric, "p") as (p, _):
        channel = memory_fabric.side_channel("x#1", QUICK)
        data = await channel.request(("p", *p.address), b"\xc1 junk", ConnectionLog(1 << 20))
        assert msgspec.msgpack.decode(data, type=protocol.ErrorReply).code == "bad_request"
        assert p.statistics().listener_rejects == 1


def test_every_test_on_the_mock_clock_opens_its_connectors_on_the_fabric() -> None:
    """A test that asks for ``autojump_clock`` and opens a connector on real
    ZeroMQ jumps virtual time while a real socket waits (a heartbeat "times
    out" before its TCP handshake could end): it passes or fails with the
    machine's speed. So each such ``open_connector`` call names its
    ``side_channel`` (or passes its keywords on, as the tests' helpers do)."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.AsyncFunctionDef):
                continue
            if not any(arg.arg == "autojump_clock" for arg in node.args.args):
                continue
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and ast.unparse(call.func).endswith("open_connector")
                    and not any(k.arg in ("side_channel", None) for k in call.keywords)
                ):
                    offenders.append(f"{path.name}:{call.lineno} ({node.name})")
    assert not offenders, offenders


def test_the_fabrics_own_ports_are_clear_of_every_free_port_range() -> None:
    """Tests bind ranks at a base from ``free_port_range`` on a fabric where
    listeners bound with port 0 took the fabric's own ports: the two sets never
    meet. (The fabric's ports once began at 30000, inside the draw: a decode
    engine drew 30000, which its prefill engine held.)"""
    from trio_pd._serve.ports import LOWEST, _ephemeral_low
    from trio_pd.testing._memory_side_channel import FIRST_PORT, Addresses

    highest_drawn = _ephemeral_low() - 1  # (free_port_range's ranges end below it)
    assert LOWEST <= highest_drawn < FIRST_PORT
    addresses = Addresses()
    first = addresses.bind("127.0.0.1", 0, object(), "p#1", 1 << 20)  # type: ignore[arg-type]
    assert first.port == FIRST_PORT
