"""A pull returns only bytes that were its request's for the whole READ (issue 28).

A READ is one-sided: once an exposure ended (expired, abandoned, read by its
consumers, the producer restarted) its blocks may hold another request's
KV, and the producer cannot refuse the READ. So a pull confirms with the
producer (``_confirm``, ``_exposures.ExposureTable.confirm``) and raises
:class:`trio_pd.ExposureEndedError` instead of returning such bytes: a late
decode, a replay to the same or another engine, an exposure that ended during
a long READ, a tensor-parallel producer whose ranks ended it. Real NIXL and
ZeroMQ on loopback, except where a READ must be slow or must not stop:
there the fabric of ``trio_pd.testing`` plays both planes, on trio's mock
clock (``autojump_clock``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import trio
import trio.testing
import zmq

import trio_pd
from trio_pd._core import _protocol as protocol
from trio_pd._core._exposures import blocks_digest
from trio_pd._side_channel._confirm import ConfirmChannels, Pending
from trio_pd.testing import MemoryFabric, fill_blocks, free_port_range, mismatched_blocks

from .conftest import FAST, kv_cache, wait_until

SECRET = b"s" * 32


def _config(secret: bytes | None, **changes: float) -> trio_pd.ConnectorConfig:
    return trio_pd.ConnectorConfig(
        handshake_timeout=2.0,
        transfer_timeout=10.0,
        close_timeout=5.0,
        exposure_secret=secret,
        **changes,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
async def test_a_decode_after_the_exposure_expired_never_gets_the_next_requests_kv(
    secret: bytes | None,
) -> None:
    # (issue 28, 1: v1 expires, v2 takes its block, v1's decode arrives late)
    short = _config(secret, lease_initial=0.2, lease_renewal=0.2, heartbeat_interval=0.1)
    prefill_kv, decode_kv = kv_cache(blocks=8), kv_cache(blocks=8)
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", prefill_kv, config=short) as p,
            trio_pd.open_connector("d", decode_kv, config=_config(secret)) as d,
        ):
            fill_blocks(prefill_kv, [1], seed=1)
            v1 = p.expose("v1", [1])
            assert await p.wait_released("v1") is trio_pd.Released.EXPIRED
            fill_blocks(prefill_kv, [1], seed=2)  # the next request's KV
            v2 = p.expose("v2", [1])
            with pytest.raises(trio_pd.ExposureEndedError, match="expired") as info:
                await d.pull("v1", [3], v1)
            assert isinstance(info.value, trio_pd.TransferError)
            assert (info.value.outcome, info.value.request_id) == ("expired", "v1")
            assert info.value.failed_block_ids == (3,)
            # the request that owns the block now reads it
            await d.pull("v2", [4], v2)
            assert mismatched_blocks(decode_kv, [4], seed=2) == []
            assert await p.wait_released("v2") is trio_pd.Released.READ
            stats = d.statistics()
            assert (stats.pulls_exposure_ended, stats.pulls_failed) == (1, 1)
            assert p.statistics().confirmations_denied == 1


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
async def test_replayed_parameters_fail_at_the_engine_that_read_them_and_at_another(
    secret: bytes | None,
) -> None:
    # (issue 28, 3: the same valid kv_transfer_params sent again after the pull)
    prefill_kv = kv_cache(blocks=8)
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", prefill_kv, config=_config(secret)) as p,
            trio_pd.open_connector("d1", kv_cache(blocks=8), config=_config(secret)) as d1,
            trio_pd.open_connector("d2", kv_cache(blocks=8), config=_config(secret)) as d2,
        ):
            fill_blocks(prefill_kv, [2], seed=1)
            v1 = p.expose("v1", [2])
            await d1.pull("v1", [0], v1)
            assert await p.wait_released("v1") is trio_pd.Released.READ
            fill_blocks(prefill_kv, [2], seed=2)
            p.expose("v2", [2])  # (the pool is LIFO: the next request gets the block)
            for decoder in (d1, d2, d1):
                with pytest.raises(trio_pd.ExposureEndedError) as info:
                    await decoder.pull("v1", [1], v1)
                assert info.value.outcome == "read_by_others"
            assert p.statistics().exposures_pending == 1  # (v2 untouched)


async def test_parameters_replayed_while_the_exposure_is_pending_read_its_own_bytes() -> None:
    # Two consumers of one exposure read it: each READ is confirmed.
    prefill_kv = kv_cache(blocks=8)
    local = [kv_cache(blocks=8), kv_cache(blocks=8)]
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", prefill_kv, config=FAST) as p,
            trio_pd.open_connector("d1", local[0], config=FAST) as d1,
            trio_pd.open_connector("d2", local[1], config=FAST) as d2,
        ):
            fill_blocks(prefill_kv, [5, 6], seed=9)
            remote = p.expose("r", [5, 6], consumers=2)
            await d1.pull("r", [0, 1], remote)
            assert p.statistics().exposures_pending == 1
            await d2.pull("r", [2, 3], remote)
            assert await p.wait_released("r") is trio_pd.Released.READ
            assert mismatched_blocks(local[0], [0, 1], seed=9) == []
            assert mismatched_blocks(local[1], [2, 3], seed=9) == []
            assert p.statistics().confirmations == 2


async def test_an_exposure_that_expires_during_a_read_longer_than_its_pin_fails_the_pull(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The pin is 0.2 s (the producer's lease_renewal); the READ takes 0.6 s:
    # the exposure expires under it, and the confirmation sent once the READ
    # ended says so.
    fabric = MemoryFabric()
    short = _config(None, lease_initial=0.2, lease_renewal=0.2, heartbeat_interval=0.1)
    prefill_kv = kv_cache(blocks=8)
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector(
                "p",
                prefill_kv,
                config=short,
                backend=fabric.backend,
                side_channel=fabric.side_channel,
            ) as p,
            trio_pd.open_connector(
                "d",
                kv_cache(blocks=8),
                config=FAST,
                backend=fabric.backend,
                side_channel=fabric.side_channel,
            ) as d,
        ):
            await d.pull("warm", [], p.expose("warm", []))  # (the handshake)
            fabric.faults("p").read_delay = 0.6
            remote = p.expose("slow", [1])
            with pytest.raises(trio_pd.ExposureEndedError, match="expired"):
                await d.pull("slow", [1], remote)
            assert p.statistics().exposures_expired == 1


async def test_a_read_longer_than_its_pin_is_kept_when_the_exposure_is_still_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fabric = MemoryFabric()
    prefill_kv = kv_cache(blocks=8)
    pinned_briefly = _config(None, lease_renewal=0.2, heartbeat_interval=0.1)
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector(
                "p",
                prefill_kv,
                config=pinned_briefly,
                backend=fabric.backend,
                side_channel=fabric.side_channel,
            ) as p,
            trio_pd.open_connector(
                "d",
                local := kv_cache(blocks=8),
                config=FAST,
                backend=fabric.backend,
                side_channel=fabric.side_channel,
            ) as d,
        ):
            fill_blocks(prefill_kv, [1], seed=4)
            fabric.faults("p").read_delay = 0.6
            await d.pull("slow", [2], p.expose("slow", [1]))
            assert mismatched_blocks(local, [2], seed=4) == []
            assert p.statistics().confirmations == 2  # (before the READ, and after it)


async def test_a_pull_of_a_tensor_parallel_producer_whose_exposure_ended_fails() -> None:
    base = free_port_range(2)
    short = _config(None, lease_initial=0.2, lease_renewal=0.2, heartbeat_interval=0.1)
    shape = (8, 64)  # (8 heads: 4 per prefill rank)
    prefill = [[torch.zeros((8, 4, 64), dtype=torch.float16) for _ in range(2)] for _ in range(2)]
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector(
                "p", prefill[0], port=base, tp_rank=0, tp_size=2, config=short
            ) as p0,
            trio_pd.open_connector(
                "p", prefill[1], port=base, tp_rank=1, tp_size=2, config=short
            ) as p1,
            trio_pd.open_connector("d", kv_cache(regions=2, blocks=8, block_shape=shape)) as d,
        ):
            remote = p0.expose("r", [3])
            p1.expose("r", [3])
            assert await p1.wait_released("r") is trio_pd.Released.EXPIRED
            await p0.wait_released("r")
            with pytest.raises(trio_pd.ExposureEndedError):
                await d.pull("r", [0], remote)
            # a fresh exposure of both ranks is read whole
            remote = p0.expose("r2", [3])
            p1.expose("r2", [3])
            await d.pull("r2", [0], remote)
            await wait_until(lambda: p1.statistics().exposures_released == 1)


# ---- the confirmation channel against a scripted producer (a bare ROUTER) ----


class _ScriptedProducer:
    """A ROUTER that receives confirmations and answers them when told."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.rank = ("p", "127.0.0.1", self.port)
        self.requests: dict[str, tuple[bytes, int]] = {}  # request id -> (peer, seq)

    def receive(self, n: int) -> None:
        """Until ``n`` more confirmations arrived (in one request or several)."""
        wanted = len(self.requests) + n
        while len(self.requests) < wanted:
            assert self.socket.poll(5000), "no confirmation arrived"
            peer, _, payload = self.socket.recv_multipart()
            request = protocol.decode_request(payload, 1 << 20)
            assert isinstance(request, protocol.ConfirmRequest)
            for entry in request.entries:
                self.requests[entry.request_id] = (peer, entry.seq)

    def answer(self, request_id: str, held_for: float = 100.0) -> None:
        peer, seq = self.requests[request_id]
        answer = protocol.ConfirmAnswer(seq, "held", held_for)
        self.socket.send_multipart([peer, b"", protocol.confirm_reply([answer])])


@contextmanager
def scripted_channels(
    config: trio_pd.ConnectorConfig | None = None,
) -> Iterator[tuple[_ScriptedProducer, ConfirmChannels]]:
    """A scripted producer and a consumer's confirmation channels (closed on exit)."""
    config = trio_pd.ConnectorConfig(handshake_timeout=30.0) if config is None else config
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    producer = _ScriptedProducer(context)
    channels = ConfirmChannels("d", "agent-d", context, config)
    try:
        yield producer, channels
    finally:
        channels.close()
        producer.socket.close(linger=0)
        context.term()


async def test_a_leader_whose_answer_another_waiter_received_returns_at_once() -> None:
    # Pull a leads the wait on the fd; its answer arrives and pull b (just
    # starting to wait) drains it. ZeroMQ's fd is edge-triggered and that
    # edge is spent: a must be woken by whoever hands it its answer, not
    # wait for the next reply or its whole handshake_timeout (30 s here).
    digest = blocks_digest([1])
    with scripted_channels() as (producer, channels):
        with trio.fail_after(10):
            a = channels.send(producer.rank, "a", "", "inc", digest, 1)
            b = channels.send(producer.rank, "b", "", "inc", digest, 2)  # (queued behind a)
            producer.receive(1)
            done: list[str] = []

            async def check(pending: Pending, name: str) -> None:
                await channels.check(pending, trio.current_time(), name, [0])
                done.append(name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(check, a, "a")
                await trio.testing.wait_all_tasks_blocked()  # (a leads)
                producer.answer("a")
                # (a's answer is in the DEALER now; the spent edge stands for
                # the send, drain or EVENTS of another pull that got there first)
                assert a.channel is not None
                assert a.channel.socket.poll(5000)
                nursery.start_soon(check, b, "b")  # (b sends itself, drains a's answer)
                await trio.testing.wait_all_tasks_blocked()
                assert done == ["a"]
                producer.receive(1)
                producer.answer("b")
            assert done == ["a", "b"]


async def test_a_pull_cancelled_while_it_waits_for_its_confirmation_leaves_nothing_behind() -> None:
    # A producer that never answers, and a caller that gives up first: the
    # confirmation must not stay in the channel's table for good (which
    # also keeps the channel from ever being closed as least recently used).
    with scripted_channels() as (producer, channels):
        with trio.fail_after(10):
            for i in range(3):
                pending = channels.send(
                    producer.rank, f"r{i}", "", "inc", blocks_digest([1]), i + 1
                )
                with trio.move_on_after(0.05):
                    await channels.check(pending, trio.current_time(), f"r{i}", [0])
                assert pending.channel is not None
                assert pending.channel.waiting == {}
                assert pending.channel.checking == {}


# (found by a hostile review: a confirmation named an exposure by request id
# and blocks digest only; exposures now carry their generation,
# remote_exposure, and the confirmation names it)
async def test_a_read_across_the_end_and_a_re_exposure_of_its_request_on_its_blocks_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # v1 expires while its decode's READ runs; the block serves v2 meanwhile
    # (the READ copies v2's KV); v1 is then prefilled again, on the same
    # block (a LIFO pool), and exposed again before the READ's second
    # confirmation: the old pull must not take v2's bytes for v1's.
    fabric = MemoryFabric()
    short = _config(None, lease_initial=0.2, lease_renewal=0.2, heartbeat_interval=0.1)
    prefill_kv, decode_kv = kv_cache(blocks=8), kv_cache(blocks=8)
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector(
                "p",
                prefill_kv,
                config=short,
                backend=fabric.backend,
                side_channel=fabric.side_channel,
            ) as p,
            trio_pd.open_connector(
                "d",
                decode_kv,
                config=FAST,
                backend=fabric.backend,
                side_channel=fabric.side_channel,
            ) as d,
        ):
            await d.pull("warm", [], p.expose("warm", []))  # (the handshake)
            fill_blocks(prefill_kv, [1], seed=1)
            v1 = p.expose("v1", [1])
            fabric.faults("p").unstoppable_reads = True
            async with trio.open_nursery() as nursery:
                failure: list[BaseException] = []

                async def pull() -> None:
                    try:
                        await d.pull("v1", [2], v1)
                    except trio_pd.ExposureEndedError as exc:
                        failure.append(exc)

                nursery.start_soon(pull)
                assert await p.wait_released("v1") is trio_pd.Released.EXPIRED
                fill_blocks(prefill_kv, [1], seed=2)  # v2's KV
                assert fabric.finish_unstoppable_reads("p") == 1  # (copies it)
                fill_blocks(prefill_kv, [1], seed=1)  # v1 prefilled again
                p.expose("v1", [1])
            assert failure or mismatched_blocks(decode_kv, [2], seed=1) == []


async def test_a_confirmation_too_large_for_the_producer_fails_alone_and_is_never_sent() -> None:
    # Parameters come from the network: a request id (or token) over
    # max_message_bytes would make the producer's ZeroMQ close the shared
    # channel's connection, losing the confirmations of every other pull
    # in flight to that rank (each then waits its handshake_timeout).
    config = trio_pd.ConnectorConfig(handshake_timeout=30.0)
    digest = blocks_digest([1])
    with scripted_channels(config) as (producer, channels):
        producer.socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        with trio.fail_after(10):
            legit = channels.send(producer.rank, "a", "", "inc", digest, 1)
            huge = "x" * config.max_message_bytes
            hostile = channels.send(producer.rank, huge, "", "inc", digest, 2)
            assert hostile.done
            assert "max_message_bytes" in hostile.failure
            producer.receive(1)
            producer.answer("a")
            await channels.check(legit, trio.current_time(), "a", [0])
            with pytest.raises(trio_pd.ExposureEndedError) as info:
                await channels.check(hostile, trio.current_time(), "h", [1])
            assert info.value.outcome == "unconfirmed"


async def test_a_pull_that_must_confirm_again_after_the_connector_closed_opens_nothing() -> None:
    # Its first answer (a pin that ended before its READ did) came before the
    # close; the confirmation it then sends again must not open a socket the
    # close will never close (nor wait for its answer).
    digest = blocks_digest([1])
    with scripted_channels() as (producer, channels):
        with trio.fail_after(10):
            a = channels.send(producer.rank, "a", "", "inc", digest, 1)
            b = channels.send(producer.rank, "b", "", "inc", digest, 2)  # (queued behind a)
            producer.receive(1)
            producer.answer("a", held_for=0.0)
            async with trio.open_nursery() as nursery:
                # (b's wait sends it, and receives a's answer too)
                nursery.start_soon(channels.check, b, trio.current_time(), "b", [0])
                await trio.testing.wait_all_tasks_blocked()
                producer.receive(1)
                producer.answer("b")
            assert a.done
            channels.close()
            with pytest.raises(trio.ClosedResourceError):
                await channels.check(a, trio.current_time() + 1.0, "a", [0])
            assert channels.open_channels == 0
