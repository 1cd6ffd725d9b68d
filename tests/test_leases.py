"""Leases: exposures held by consumers' heartbeats, abandoned, expired, capped.

Both planes are in memory (``trio_pd.testing.MemoryFabric``: its backend,
and its side channel, where heartbeats and abandons travel) and the clock is
trio's mock clock (``autojump_clock``): a lease of 1.2 s renewed by 1 s every
0.2 s takes no time, and a bound cannot be missed because the machine is
busy. "At once" means well under one lease.

Three stay on the real ZeroMQ side channel, because the shell is what they
test: CURVE on heartbeats and abandons, hostile frames on the listener's
socket, and the close that waits for abandons to dead producers before the
context goes (``_real`` below; no mock clock there).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import msgspec
import pytest
import torch
import trio
import trio.testing
import zmq

import trio_pd
from trio_pd import RemoteBlocks
from trio_pd._consumer._settlement import SettledReads
from trio_pd._core import _protocol as protocol
from trio_pd._core._exposures import MAX_PINS
from trio_pd._side_channel._fetch import ConnectionLog
from trio_pd._side_channel._zmq import TrioZmqSocket
from trio_pd.testing import MemoryFabric, fill_blocks, free_port_range, mismatched_blocks

from .conftest import kv_cache, wait_until

pytest_plugins = ["trio_pd.testing.fixtures"]

LEASES = trio_pd.ConnectorConfig(
    handshake_timeout=1.0,
    transfer_timeout=2.0,
    close_timeout=1.0,
    abort_timeout=10.0,
    lease_initial=1.2,
    lease_renewal=1.0,
    heartbeat_interval=0.2,
)
PINNED = attrs.evolve(LEASES, lease_renewal=30.0, abort_timeout=120.0, transfer_timeout=10.0)
"""Each confirmed READ pins its exposure for 30 s: a pin left behind holds
the blocks far longer than "at once"."""
SECRET = b"leases-test-secret-0123456789"
AT_ONCE = 0.6
"""How soon "at once" must happen: half of ``lease_initial``."""


@asynccontextmanager
async def engine(
    fabric: MemoryFabric,
    engine_id: str,
    config: trio_pd.ConnectorConfig = LEASES,
    *,
    real: bool = False,
    **kwargs: object,
) -> AsyncIterator[tuple[trio_pd.Connector, list[torch.Tensor]]]:
    """A connector on the fabric; ``real``: on the ZeroMQ side channel."""
    kv = kv_cache(blocks=64)
    side_channel = None if real else fabric.side_channel
    async with trio_pd.open_connector(
        engine_id, kv, config=config, backend=fabric.backend, side_channel=side_channel, **kwargs
    ) as conn:
        yield conn, kv


async def wait_timed(conn: trio_pd.Connector, request_id: str) -> tuple[trio_pd.Released, float]:
    started = trio.current_time()
    outcome = await conn.wait_released(request_id)
    return outcome, trio.current_time() - started


def pins(conn: trio_pd.Connector, request_id: str) -> set[tuple[str, int]]:
    """The READs (agent, nonce) that pin ``request_id``'s exposure at ``conn`` now."""
    exposure = conn._producer._exposures.pending_exposure(request_id)
    return set() if exposure is None else set(exposure.pins)


def forged_abandon(
    conn: trio_pd.Connector, request_id: str, agent: str, named: list[int]
) -> protocol.LeaseReply:
    """An abandon of ``request_id`` claiming to come from ``agent`` and naming
    ``named`` as its READs that ended, handed to ``conn``'s listener."""
    entry = protocol.LeaseEntry(request_id, "", 1, True, pins=named)
    request = protocol.encode_lease_request(conn.engine_id, "mallory", agent, [entry])
    return protocol.decode_lease_reply(conn._producer.answer(request), 1 << 20)


def free_port() -> int:
    """A loopback port nobody listens on: below the ephemeral range, so that no
    listener on port 0 (the other test worker has many) is given it."""
    return free_port_range(1)


GONE_PORT = 4000
"""On the fabric, a port nobody listens on (its own start at 61000)."""


async def test_an_exposure_nobody_holds_expires_after_the_initial_lease(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(5):
        async with engine(memory_fabric, "p") as (p, _):
            p.expose("r", [1, 2])
            outcome, waited = await wait_timed(p, "r")
            assert outcome is trio_pd.Released.EXPIRED
            assert LEASES.lease_initial <= waited < LEASES.lease_initial + AT_ONCE
            stats = p.statistics()
            assert (stats.exposures_expired, stats.leases_renewed) == (1, 0)


async def test_a_held_exposure_outlives_the_initial_lease_and_is_read_inside_the_hold(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with engine(memory_fabric, "p") as (p, kv), engine(memory_fabric, "d") as (d, local):
            fill_blocks(kv, [3, 9, 4], seed=11)
            remote = p.expose("r", [3, 9, 4])
            async with d.hold(remote):
                assert d.statistics().holds_active == 1
                await trio.sleep(3 * LEASES.lease_initial)
                assert p.statistics().exposures_pending == 1
                await d.pull("r", [0, 1, 2], remote)
            assert mismatched_blocks(local, [0, 1, 2], seed=11) == []
            assert await p.wait_released("r") is trio_pd.Released.READ
            stats = d.statistics()
            assert stats.holds_active == 0
            assert stats.heartbeats_sent >= 10
            assert (stats.abandons_sent, stats.abandons_failed) == (0, 0)
            assert p.statistics().leases_renewed >= 10


async def test_a_hold_left_without_a_pull_abandons_its_exposure_at_once(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with engine(memory_fabric, "p") as (p, _), engine(memory_fabric, "d") as (d, _):
            # The body ends without a pull ...
            async with d.hold(p.expose("quiet", [1])):
                await trio.sleep(2 * LEASES.heartbeat_interval)
            outcome, waited = await wait_timed(p, "quiet")
            assert (outcome, waited < AT_ONCE) == (trio_pd.Released.ABANDONED, True)
            # ... raises (the exception comes out unchanged) ...
            with pytest.raises(KeyError, match="body"):
                async with d.hold(p.expose("raised", [2])):
                    raise KeyError("body")
            assert await p.wait_released("raised") is trio_pd.Released.ABANDONED
            # ... or is cancelled.
            with trio.move_on_after(0.2):
                async with d.hold(p.expose("cancelled", [3])):
                    await trio.sleep_forever()
            outcome, waited = await wait_timed(p, "cancelled")
            assert (outcome, waited < AT_ONCE) == (trio_pd.Released.ABANDONED, True)
            # A pull that failed does not complete the hold either.
            remote = p.expose("failed", [4])
            memory_fabric.faults("p").read_error = "boom"
            async with d.hold(remote):
                with pytest.raises(trio_pd.TransferError):
                    await d.pull("failed", [0], remote)
            assert await p.wait_released("failed") is trio_pd.Released.ABANDONED
            assert d.statistics().abandons_sent == 4
            assert p.statistics().exposures_abandoned == 4


async def test_abandon_resolves_the_exposure_abandoned_at_once(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with engine(memory_fabric, "p") as (p, _), engine(memory_fabric, "d") as (d, _):
            remote = p.expose("r", [1])
            await d.abandon(remote)
            outcome, waited = await wait_timed(p, "r")
            assert (outcome, waited < 0.05) == (trio_pd.Released.ABANDONED, True)
            # Inside a hold: renewals stop, and leaving it sends nothing more.
            held = p.expose("held", [2])
            async with d.hold(held):
                await d.abandon(held)
                assert await p.wait_released("held") is trio_pd.Released.ABANDONED
            stats = d.statistics()
            assert (stats.abandons_sent, stats.abandons_failed) == (2, 0)
            # Two consumers: one abandon is not enough; the other's read ends it.
            two = p.expose("two", [3], consumers=2)
            await d.abandon(two)
            assert p.statistics().exposures_pending == 1
            await d.abandon(two)  # the same agent again counts once
            assert p.statistics().exposures_pending == 1
            async with engine(memory_fabric, "d2") as (d2, _):
                await d2.pull("two", [0], two)
            assert await p.wait_released("two") is trio_pd.Released.ABANDONED


def test_the_settled_reads_an_abandon_names_are_bounded_and_taken_once() -> None:
    # (the consumer's record of its READs that stopped, per exposure and rank)
    reads = SettledReads(exposures=2)
    one, two, three = (RemoteBlocks("p", "h", 1, [i], f"r{i}", "inc") for i in (1, 2, 3))
    rank, other = ("p", "h", 1), ("p", "h", 2)
    for nonce in range(1, MAX_PINS + 11):  # (more than a producer pins on one exposure)
        reads.add(one, rank, nonce)
    reads.add(one, other, 7)
    reads.add(two, rank, 8)
    assert reads.take(one) == {rank: list(range(11, MAX_PINS + 11)), other: [7]}  # the latest
    assert reads.take(one) == {}
    reads.add(one, rank, 9)
    reads.add(three, rank, 10)  # (a third exposure: the least recently added is forgotten)
    assert (len(reads), reads.take(two), reads.take(three)) == (2, {}, {rank: [10]})


@pytest.mark.parametrize("leaving", ["hold", "abandon"])
async def test_a_cancelled_pull_whose_read_stopped_frees_the_blocks_at_once(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    leaving: str,
) -> None:
    # The pull confirmed its READ (the producer pinned the exposure for it for
    # lease_renewal, 30 s here), then was cancelled, and its READ stopped: the
    # abandon (leaving the hold, or Connector.abandon) names that READ, and
    # the producer frees the blocks at once instead of when the pin runs out.
    with trio.fail_after(60):
        async with (
            engine(memory_fabric, "p", PINNED) as (p, _),
            engine(memory_fabric, "d", PINNED) as (d, _),
        ):
            memory_fabric.faults("p").read_delay = 5.0
            remote = p.expose("r", [1, 2])

            async def pull() -> None:
                if leaving == "hold":
                    async with d.hold(remote):
                        await d.pull("r", [0, 1], remote)
                else:
                    await d.pull("r", [0, 1], remote)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull)
                await wait_until(lambda: pins(p, "r"))  # (its READ runs, confirmed)
                nursery.cancel_scope.cancel()
            assert d.unsettled_blocks() == frozenset()
            if leaving == "abandon":
                assert len(pins(p, "r")) == 1
                await d.abandon(remote)
            outcome, waited = await wait_timed(p, "r")
            assert (outcome, waited < AT_ONCE) == (trio_pd.Released.ABANDONED, True)
            stats = d.statistics()
            assert (stats.abandons_sent, stats.abandons_failed) == (1, 0)
            assert (stats.pulls_succeeded, stats.pulls_failed) == (0, 0)


async def test_over_zeromq_a_cancelled_pull_frees_the_blocks_long_before_its_pin_ends(
    memory_fabric: MemoryFabric,
) -> None:
    # The same on the real side channel (confirmations batched on a
    # long-lived socket, abandons on fresh ones), on the real clock: bounded
    # by fail_after, far below the 30 s pin that would hold the blocks before.
    with trio.fail_after(30):
        async with (
            engine(memory_fabric, "p", PINNED, real=True) as (p, _),
            engine(memory_fabric, "d", PINNED, real=True) as (d, _),
        ):
            await d.pull("warm", [], p.expose("warm", []))  # (the handshake)
            memory_fabric.faults("p").read_delay = 60.0
            remote = p.expose("r", [1, 2])

            async def pull() -> None:
                async with d.hold(remote):
                    await d.pull("r", [0, 1], remote)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull)
                await wait_until(lambda: pins(p, "r"))
                nursery.cancel_scope.cancel()
            with trio.fail_after(5):
                assert await p.wait_released("r") is trio_pd.Released.ABANDONED


async def test_an_abandon_never_ends_another_consumers_pins(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two decode engines read one exposure (consumers=2). The victim's READ
    # runs (5 s); the attacker's pull is cancelled. The attacker's abandon
    # ends its own READ's pin; naming the victim's READ -- under its own
    # agent, or claiming the victim's agent with guessed nonces -- ends
    # nothing: the blocks stay the victim's past the lease, until its READ
    # ended and notified.
    with trio.fail_after(60):
        async with (
            engine(memory_fabric, "p", PINNED) as (p, kv),
            engine(memory_fabric, "victim", PINNED) as (victim, local),
            engine(memory_fabric, "attacker", PINNED) as (attacker, _),
        ):
            fill_blocks(kv, [1, 2], seed=3)
            memory_fabric.faults("p").read_delay = 5.0
            remote = p.expose("r", [1, 2], consumers=2)
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim.pull, "r", [0, 1], remote)
                await wait_until(lambda: pins(p, "r"))
                (victims,) = pins(p, "r")
                with trio.move_on_after(1.0):
                    await attacker.pull("r", [0, 1], remote)
                (attackers,) = pins(p, "r") - {victims}
                await attacker.abandon(remote)  # (names its own READ, which stopped)
                assert pins(p, "r") == {victims}
                for agent, named in [
                    (attackers[0], [victims[1]]),  # the victim's nonce, as its own
                    (victims[0], list(range(1, 65))),  # the victim's agent, guessed nonces
                ]:
                    assert forged_abandon(p, "r", agent, named) == protocol.LeaseReply(
                        protocol.PROTOCOL_VERSION, [], []
                    )
                    assert pins(p, "r") == {victims}
                await trio.sleep(2 * PINNED.lease_initial)  # (the lease is over: the pin holds it)
                assert p.statistics().exposures_pending == 1
            assert mismatched_blocks(local, [0, 1], seed=3) == []
            assert await p.wait_released("r") is trio_pd.Released.ABANDONED
            assert trio.current_time() - started < 5.0 + AT_ONCE  # (its READ's end, not 30 s)


async def test_an_abandon_keeps_the_pin_of_a_read_that_could_not_be_stopped(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two READs of one exposure, both cancelled: one stopped, one could not
    # be (a partitioned peer: NIXL cannot stop it). The abandon names the
    # first alone; the second still pins the blocks, until it ends (its
    # notification) -- or, if it never does, until its pin runs out.
    with trio.fail_after(120):
        async with (
            engine(memory_fabric, "p", PINNED) as (p, _),
            engine(memory_fabric, "d", PINNED) as (d, _),
        ):
            faults = memory_fabric.faults("p")
            for request_id, ends in [("ends", True), ("never", False)]:
                remote = p.expose(request_id, [1])
                faults.read_delay, faults.unstoppable_reads = 5.0, False
                with trio.move_on_after(1.0):
                    await d.pull(request_id, [0], remote)
                faults.read_delay, faults.unstoppable_reads = 0.0, True
                with trio.move_on_after(1.0):
                    await d.pull(request_id, [1], remote)
                assert d.unsettled_blocks() == {1}
                assert len(pins(p, request_id)) == 2
                await d.abandon(remote)
                assert len(pins(p, request_id)) == 1  # (the READ that stopped: its pin ended)
                if ends:
                    await trio.sleep(5.0)
                    assert p.statistics().exposures_pending == 1
                    memory_fabric.finish_unstoppable_reads("p")
                    outcome, waited = await wait_timed(p, request_id)
                    assert (outcome, waited < AT_ONCE) == (trio_pd.Released.ABANDONED, True)
                else:
                    outcome, waited = await wait_timed(p, request_id)
                    assert outcome is trio_pd.Released.ABANDONED
                    assert waited > PINNED.lease_renewal - 5.0  # (its pin ran out)
                    memory_fabric.finish_unstoppable_reads("p")
                await d.wait_settled([1])


async def test_a_hold_never_outlives_abort_timeout(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    capped = attrs.evolve(LEASES, abort_timeout=2.0)
    with trio.fail_after(10):
        async with (
            engine(memory_fabric, "p", capped) as (p, _),
            engine(memory_fabric, "d", capped) as (d, _),
        ):
            remote = p.expose("r", [1])
            with caplog.at_level(logging.WARNING, logger="trio_pd"):
                async with d.hold(remote):
                    outcome, waited = await wait_timed(p, "r")
                    assert outcome is trio_pd.Released.EXPIRED
                    assert capped.abort_timeout <= waited < capped.abort_timeout + AT_ONCE
                    # The next heartbeat learns it is gone; the hold stops renewing.
                    await trio.sleep(3 * capped.heartbeat_interval)
            assert "the hold on request 'r' is lost" in caplog.text
            assert d.statistics().abandons_sent == 0  # nothing left to abandon


async def test_heartbeats_are_batched_one_message_per_producer_per_interval(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(15):
        async with engine(memory_fabric, "p") as (p, _), engine(memory_fabric, "d") as (d, _):
            remotes = [p.expose(f"r{i}", [i]) for i in range(50)]
            async with AsyncExitStack() as stack:
                for remote in remotes:
                    await stack.enter_async_context(d.hold(remote))
                before, renewed = d.statistics().heartbeats_sent, p.statistics().leases_renewed
                started = trio.current_time()
                await trio.sleep(2 * LEASES.lease_initial)
                rounds = (trio.current_time() - started) / LEASES.heartbeat_interval
                sent = d.statistics().heartbeats_sent - before
                assert 0.5 * rounds <= sent <= rounds + 2
                assert p.statistics().leases_renewed - renewed >= 50 * (sent - 1)
                assert p.statistics().exposures_pending == 50
                assert d.statistics().holds_active == 50
                with pytest.raises(ValueError, match="'r0' of 'p' is held"):
                    async with d.hold(remotes[0]):
                        pass  # pragma: no cover
            # (leaving the holds abandons them, sent in the background)
            await wait_until(lambda: p.statistics().exposures_abandoned == 50)


async def test_a_batch_over_the_message_size_limit_is_split(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    small = attrs.evolve(LEASES, max_message_bytes=2048)
    with trio.fail_after(15):
        async with (
            engine(memory_fabric, "p", small) as (p, _),
            engine(memory_fabric, "d", small) as (d, _),
        ):
            remotes = [p.expose(f"request-{i:04}", [i]) for i in range(60)]
            async with AsyncExitStack() as stack:
                for remote in remotes:
                    await stack.enter_async_context(d.hold(remote))
                started = trio.current_time()
                sent, renewed = d.statistics().heartbeats_sent, p.statistics().leases_renewed
                await trio.sleep(2 * LEASES.lease_initial)
                rounds = (trio.current_time() - started) / LEASES.heartbeat_interval
                sent = d.statistics().heartbeats_sent - sent
                renewed = p.statistics().leases_renewed - renewed
                # About 80 bytes an entry: 60 need several messages, each one accepted.
                assert 2 * 0.5 * rounds <= sent <= 8 * (rounds + 2)
                assert renewed >= 60 * 0.5 * rounds
                assert p.statistics().exposures_pending == 60
                assert p.statistics().listener_rejects == 0


async def test_a_dead_producer_does_not_delay_renewals_of_another(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Two dead producers: a port nobody listens on, and a side channel that
    # accepts and never answers (each of its heartbeats waits the whole interval).
    with trio.fail_after(15), caplog.at_level(logging.WARNING, logger="trio_pd"):
        async with (
            engine(memory_fabric, "p") as (p, kv),
            engine(memory_fabric, "hung") as (silent, _),
            engine(memory_fabric, "d") as (d, local),
        ):
            memory_fabric.faults("hung").mute = True
            fill_blocks(kv, [5], seed=3)
            alive = p.expose("r", [5])
            refused = trio_pd.RemoteBlocks("gone", "127.0.0.1", GONE_PORT, [1], "x")
            hung = trio_pd.RemoteBlocks("hung", "127.0.0.1", silent.address[1], [1], "y")
            async with d.hold(refused), d.hold(hung), d.hold(alive):
                started, renewed = trio.current_time(), p.statistics().leases_renewed
                await trio.sleep(3 * LEASES.lease_initial)
                rounds = (trio.current_time() - started) / LEASES.heartbeat_interval
                # (every round renewed it: none waited for the dead ones)
                assert p.statistics().leases_renewed - renewed >= rounds - 1
                assert p.statistics().exposures_pending == 1
                await d.pull("r", [0], alive)
                leaving = trio.current_time()
            # Leaving the holds of dead producers does not wait for them.
            assert trio.current_time() == leaving
            assert mismatched_blocks(local, [0], seed=3) == []
            assert await p.wait_released("r") is trio_pd.Released.READ
            # The dead ones' abandons failed within their deadline, logged,
            # counted -- in the background.
            await wait_until(lambda: d.statistics().abandons_failed == 2)
            assert trio.current_time() - leaving == pytest.approx(LEASES.handshake_timeout)
            assert d.statistics().abandons_sent == 2
    assert "engine gone: lease heartbeat to 127.0.0.1:4000 failed: no reply within 0.2 s: " in (
        caplog.text
    )
    assert "engine hung: could not abandon request 'y'" in caplog.text
    assert "connected, but the peer never replied" in caplog.text


async def test_a_forged_abandon_is_refused_and_the_victim_still_reads(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    signed = attrs.evolve(LEASES, exposure_secret=SECRET)
    with trio.fail_after(10):
        async with (
            engine(memory_fabric, "p", signed) as (p, kv),
            engine(memory_fabric, "victim", signed) as (victim, local),
            # (an attacker without the secret: a consumer with it refuses to
            # send a forged abandon at all, see test_partial_failure)
            engine(memory_fabric, "attacker", LEASES) as (attacker, _),
        ):
            fill_blocks(kv, [7, 8], seed=5)
            remote = p.expose("r", [7, 8])
            assert len(remote.token) == 32
            await attacker.abandon(attrs.evolve(remote, token="0" * 32))
            await attacker.abandon(attrs.evolve(remote, token=""))
            stats = p.statistics()
            assert (stats.leases_refused, stats.exposures_pending) == (2, 1)
            async with victim.hold(remote):
                await trio.sleep(2 * LEASES.lease_initial)  # renewals verify
                await victim.pull("r", [0, 1], remote)
            assert mismatched_blocks(local, [0, 1], seed=5) == []
            assert await p.wait_released("r") is trio_pd.Released.READ
            assert p.statistics().leases_refused == 2


async def test_tensor_parallel_holds_renew_every_rank_read_with_rank_zeros_token(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Prefill TP 2, decode TP 1: the decode rank reads (and holds) both prefill
    # ranks, with the parameters (and the token) of rank 0 alone.
    signed = attrs.evolve(LEASES, exposure_secret=SECRET)
    base = free_port_range(2)
    with trio.fail_after(15):
        async with AsyncExitStack() as stack:
            ranks = []
            for rank in range(2):
                kv = [torch.zeros((16, 2, 8), dtype=torch.float16) for _ in range(2)]
                conn = await stack.enter_async_context(
                    trio_pd.open_connector(
                        "p",
                        kv,
                        port=base,
                        config=signed,
                        tp_rank=rank,
                        tp_size=2,
                        backend=memory_fabric.backend,
                        side_channel=memory_fabric.side_channel,
                    )
                )
                ranks.append((conn, kv))
            exposed = [conn.expose("r", [3]) for conn, _ in ranks]
            assert exposed[0].token != exposed[1].token  # each rank signs its incarnation
            local = [torch.zeros((16, 4, 8), dtype=torch.float16) for _ in range(2)]
            d = await stack.enter_async_context(
                trio_pd.open_connector(
                    "d",
                    local,
                    config=signed,
                    backend=memory_fabric.backend,
                    side_channel=memory_fabric.side_channel,
                )
            )
            async with d.hold(exposed[0]):
                await trio.sleep(2 * LEASES.lease_initial)
                assert [c.statistics().exposures_pending for c, _ in ranks] == [1, 1]
                await d.pull("r", [5], exposed[0])
            for conn, _ in ranks:
                assert await conn.wait_released("r") is trio_pd.Released.READ
                assert conn.statistics().leases_refused == 0
            # Abandons reach every rank read, each with rank 0's token.
            second = [conn.expose("s", [4]) for conn, _ in ranks]
            await d.abandon(second[0])
            assert await ranks[0][0].wait_released("s") is trio_pd.Released.ABANDONED
            assert await ranks[1][0].wait_released("s") is trio_pd.Released.ABANDONED


async def test_a_malformed_lease_frame_gets_an_error_reply_and_the_listener_keeps_serving(
    memory_fabric: MemoryFabric,
) -> None:
    encode = msgspec.msgpack.encode
    good_entry = {"request_id": "r", "token": "", "readers": 1, "abandon": False}
    head = {"type": "lease", "protocol_version": protocol.PROTOCOL_VERSION}
    lease = {**head, "engine_id": "p", "consumer_engine_id": "x", "consumer_agent": "x#1"}
    hostile = [
        encode(head),  # fields missing
        encode({**lease, "entries": "not a list"}),
        encode({**lease, "entries": [{**good_entry, "readers": 0}]}),  # would divide by zero
        encode({**lease, "entries": [{**good_entry, "abandon": "yes"}]}),
        # an abandon naming far more READs than any exposure pins (it would end
        # the pins of "r" that it names, were it applied)
        encode({**lease, "entries": [{**good_entry, "abandon": True, "pins": [*range(1, 5000)]}]}),
        encode({**lease, "engine_id": "other", "entries": [good_entry]}),
        encode({**lease, "protocol_version": 3, "entries": [good_entry]}),
        b"\xc1 not msgpack",
    ]
    with trio.fail_after(10):
        async with (
            engine(memory_fabric, "p", real=True) as (p, kv),
            engine(memory_fabric, "d", real=True) as (d, local),
        ):
            fill_blocks(kv, [6], seed=8)
            remote = p.expose("r", [6])
            host, port = p.address
            with zmq.Context() as context:
                dealer = TrioZmqSocket(context.socket(zmq.DEALER))
                async with dealer:
                    dealer.zmq_socket.setsockopt(zmq.LINGER, 0)
                    dealer.zmq_socket.connect(f"tcp://{host}:{port}")
                    codes = []
                    for frame in hostile:
                        await dealer.send_multipart([b"", frame])
                        empty, reply = await dealer.receive_multipart()
                        assert empty == b""
                        codes.append(msgspec.msgpack.decode(reply, type=protocol.ErrorReply).code)
                    # A valid one from the same socket is served.
                    await dealer.send_multipart([b"", encode({**lease, "entries": [good_entry]})])
                    _, reply = await dealer.receive_multipart()
            assert codes == ["bad_request"] * 5 + ["wrong_engine", "unsupported_version"] + [
                "bad_request"
            ]
            assert protocol.decode_lease_reply(reply, 1 << 20).unknown == []
            stats = p.statistics()
            assert (stats.listener_rejects, stats.leases_renewed) == (len(hostile), 1)
            assert stats.exposures_pending == 1
            await d.pull("r", [0], remote)
            assert mismatched_blocks(local, [0], seed=8) == []


async def test_hold_and_abandon_after_close_raise_closed_resource_error(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with engine(memory_fabric, "p") as (p, _):
            remote = p.expose("r", [1])
            async with engine(memory_fabric, "d") as (d, _):
                pass
            with pytest.raises(trio.ClosedResourceError):
                async with d.hold(remote):
                    pass  # pragma: no cover
            with pytest.raises(trio.ClosedResourceError):
                await d.abandon(remote)
            assert d.statistics().holds_active == 0


async def test_heartbeats_and_abandons_travel_over_curve_and_strangers_get_nowhere(
    memory_fabric: MemoryFabric,
) -> None:
    producer_keys, friend, stranger = (trio_pd.generate_keypair() for _ in range(3))

    def consumer_config(keys: tuple[str, str]) -> trio_pd.ConnectorConfig:
        auth = trio_pd.CurveAuth(
            public_key=keys[0], secret_key=keys[1], producer_keys={"*": producer_keys[0]}
        )
        return attrs.evolve(LEASES, auth=auth)

    producer_auth = trio_pd.CurveAuth(
        public_key=producer_keys[0], secret_key=producer_keys[1], allowed_consumers={friend[0]}
    )
    with trio.fail_after(15):
        async with (
            engine(memory_fabric, "p", attrs.evolve(LEASES, auth=producer_auth), real=True) as (
                p,
                _,
            ),
            engine(memory_fabric, "d", consumer_config(friend), real=True) as (d, _),
            engine(memory_fabric, "x", consumer_config(stranger), real=True) as (x, _),
        ):
            remote = p.expose("r", [1])
            await x.abandon(remote)  # refused by CURVE: logged, counted, not raised
            assert x.statistics().abandons_failed == 1
            async with d.hold(remote):
                await trio.sleep(2 * LEASES.lease_initial)
                assert p.statistics().exposures_pending == 1
            assert await p.wait_released("r") is trio_pd.Released.ABANDONED
            assert p.statistics().listener_auth_failures >= 1


async def test_a_consumer_that_stops_heartbeating_frees_the_blocks_within_lease_renewal(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # (issue 28, 6: a consumer held with a long first lease and died after a few
    # heartbeats; the producer kept the blocks until that first lease ran out.)
    # The consumer here is a bare side channel that sends two heartbeats,
    # then goes silent as a SIGKILLed process does.
    long_first = attrs.evolve(LEASES, lease_initial=30.0, lease_renewal=0.5, abort_timeout=60.0)
    with trio.fail_after(10):
        async with engine(memory_fabric, "p", long_first) as (p, _):
            remote = p.expose("r", [3])
            entry = protocol.LeaseEntry(
                request_id="r", token=remote.token, readers=1, abandon=False
            )
            dead = memory_fabric.side_channel("d#dead", long_first)
            for beat in range(2):
                await trio.sleep(0.1 * beat)
                request = protocol.encode_lease_request("p", "d", "d#dead", [entry])
                await dead.request(("p", *p.address), request, ConnectionLog(1 << 20))
            last_heartbeat = trio.current_time()
            assert await p.wait_released("r") is trio_pd.Released.EXPIRED
            # within lease_renewal (0.5 s, + a notification poll), not when
            # the 30 s first lease runs out
            waited = trio.current_time() - last_heartbeat
            poll = long_first.idle_notification_poll_interval
            assert long_first.lease_renewal - 1e-9 <= waited <= long_first.lease_renewal + poll
            assert p.statistics().leases_renewed == 2


async def test_closing_right_after_leaving_holds_sends_their_abandons_first(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Issue 28: the abandons that leaving the holds queued were dropped by the
    # close, so the producer kept the blocks until their leases expired.
    with trio.fail_after(10):
        async with engine(memory_fabric, "p") as (p, _):
            remote = p.expose("one", [0])
            async with engine(memory_fabric, "d") as (d, _), d.hold(remote):
                pass
            outcome, waited = await wait_timed(p, "one")
            assert (outcome, waited < AT_ONCE) == (trio_pd.Released.ABANDONED, True)
            # Many holds left together, no checkpoint between them and the close.
            remotes = [p.expose(f"r{n}", [n]) for n in range(1, 41)]
            async with engine(memory_fabric, "d") as (d, _), AsyncExitStack() as holds:
                for remote in remotes:
                    await holds.enter_async_context(d.hold(remote))
            stats = d.statistics()
            assert (stats.abandons_sent, stats.abandons_failed) == (40, 0)
            assert p.statistics().exposures_abandoned == 41
            for n in range(1, 41):
                outcome, waited = await wait_timed(p, f"r{n}")
                assert (outcome, waited < AT_ONCE) == (trio_pd.Released.ABANDONED, True)


async def test_close_waits_for_abandons_to_dead_producers_at_most_close_timeout(
    memory_fabric: MemoryFabric, caplog: pytest.LogCaptureFixture
) -> None:
    # Queued and in-flight abandons go concurrently under one close_timeout: a
    # dead producer (refused, or accepting and never answering) delays close by
    # at most that, and the live producer's abandon is not queued behind them.
    context = zmq.Context()
    silent = TrioZmqSocket(context.socket(zmq.ROUTER))
    try:
        silent.zmq_socket.setsockopt(zmq.LINGER, 0)
        silent.zmq_socket.bind("tcp://127.0.0.1:*")
        silent_port = int(silent.zmq_socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":")[-1])
        slow = attrs.evolve(LEASES, handshake_timeout=30.0)  # (close_timeout: 1 s)
        with trio.fail_after(15), caplog.at_level(logging.INFO, logger="trio_pd"):
            async with engine(memory_fabric, "p", real=True) as (p, _):
                alive = [p.expose(f"r{n}", [n]) for n in range(3)]
                dead = [
                    trio_pd.RemoteBlocks(f"gone{n}", "127.0.0.1", free_port(), [1], "x")
                    for n in range(3)
                ] + [trio_pd.RemoteBlocks("hung", "127.0.0.1", silent_port, [1], "y")]
                async with engine(memory_fabric, "d", slow, real=True) as (d, _):
                    for remote in [*dead, *alive]:
                        async with d.hold(remote):
                            pass
                    closing = trio.current_time()
                closed_after = trio.current_time() - closing
                assert closed_after < LEASES.close_timeout + AT_ONCE
                for n in range(3):
                    assert await p.wait_released(f"r{n}") is trio_pd.Released.ABANDONED
                stats = d.statistics()
                assert (stats.abandons_sent, stats.abandons_failed) == (7, 4)
        assert "engine hung: abandon of request 'y' at 127.0.0.1" in caplog.text
        assert "not answered within close_timeout (1 s)" in caplog.text
    finally:
        silent.close()
        context.destroy(linger=0)


async def test_cancelling_a_close_that_waits_for_abandons_still_bounds_and_ends_it(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with engine(memory_fabric, "p") as (p, _):
            remote = p.expose("r", [1])
            gone = trio_pd.RemoteBlocks("gone", "127.0.0.1", GONE_PORT, [1], "x")
            with trio.CancelScope() as outside:
                async with engine(
                    memory_fabric, "d", attrs.evolve(LEASES, handshake_timeout=30.0)
                ) as (
                    d,
                    _,
                ):
                    async with d.hold(gone), d.hold(remote):
                        pass
                    outside.cancel()
                    cancelled_at = trio.current_time()
            # The close was cancelled too: shielded, it still sent the live abandon.
            assert trio.current_time() - cancelled_at < LEASES.close_timeout + AT_ONCE
            outcome, waited = await wait_timed(p, "r")
            assert (outcome, waited < AT_ONCE) == (trio_pd.Released.ABANDONED, True)


async def test_more_abandons_to_a_dead_producer_than_run_at_once_still_end_by_close_timeout(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Past MAX_BACKGROUND_ABANDONS the queue waits for a slot: those that get
    # one only after the close's deadline fail at once, and close is not held up.
    from trio_pd._consumer._leases import MAX_BACKGROUND_ABANDONS

    many = MAX_BACKGROUND_ABANDONS + 6
    port = GONE_PORT
    slow = attrs.evolve(LEASES, handshake_timeout=30.0)
    with trio.fail_after(15):
        async with engine(memory_fabric, "d", slow) as (d, _), AsyncExitStack() as holds:
            for n in range(many):
                gone = trio_pd.RemoteBlocks("gone", "127.0.0.1", port, [1], f"x{n}")
                await holds.enter_async_context(d.hold(gone))
            closing = trio.current_time()
        assert trio.current_time() - closing < LEASES.close_timeout + AT_ONCE
        stats = d.statistics()
        assert (stats.abandons_sent, stats.abandons_failed) == (many, many)
