"""Partial failure by construction (issue 16's repros, each a test).

* No block is let go while a transfer may still write it, however the pull
  ended (cancelled, a sibling part's failure, an error, close).
* A request's claims hurt only that request (a forged incarnation never
  retires a live agent; a forged address or TP size gets its own record).
* Every wait has its bound, queued time included (a load that never returns
  holds up no other engine's handshake; nothing escapes at close).

Both planes are the in-memory ones (``MemoryFaults.unstoppable_reads``
plays a NIXL transfer to a partitioned peer; the fabric's side channel
carries handshakes, heartbeats and confirmations) and the clock is trio's
mock clock (``autojump_clock``): nothing here waits on the real clock.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import attrs
import pytest
import torch
import trio
import trio.testing

import trio_pd
from trio_pd.testing import (
    MemoryFabric,
    fill_blocks,
    fill_heads,
    free_port_range,
    mismatched_blocks,
    mismatched_heads,
)

from .conftest import kv_cache, wait_until

pytest_plugins = ["trio_pd.testing.fixtures"]

QUICK = trio_pd.ConnectorConfig(
    handshake_timeout=0.5,
    transfer_timeout=5.0,
    close_timeout=0.2,
    backoff_initial=0.3,
    backoff_max=0.6,
    backoff_jitter=0.0,
)


def connector(
    fabric: MemoryFabric,
    engine_id: str,
    *,
    kv: list[torch.Tensor] | None = None,
    config: trio_pd.ConnectorConfig = QUICK,
    **options: Any,
) -> contextlib.AbstractAsyncContextManager[trio_pd.Connector]:
    """``open_connector`` on the fabric (16 blocks of the default shape unless ``kv``)."""
    kv = kv_cache(blocks=16) if kv is None else kv
    return trio_pd.open_connector(
        engine_id,
        kv,
        config=config,
        backend=fabric.backend,
        side_channel=fabric.side_channel,
        **options,
    )


# ---- no block let go while a READ may still write it ------------------------------


async def test_a_cancelled_pull_keeps_its_blocks_unsettled_until_the_transfer_ends(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The repro: a READ that stays in progress, its pull cancelled after 0.2 s
    # (the client hung up). The caller sees Cancelled; the blocks must not be
    # reported free while the transfer can still write them.
    with trio.fail_after(10):
        prefill_kv, local = kv_cache(blocks=16), kv_cache(blocks=16)
        async with (
            connector(memory_fabric, "p", kv=prefill_kv) as p,
            connector(memory_fabric, "d", kv=local) as d,
        ):
            await d.pull("warm", [0], p.expose("warm", [0]))
            fill_blocks(prefill_kv, [5, 6], seed=3)
            remote = p.expose("r", [5, 6])
            memory_fabric.faults("p").unstoppable_reads = True
            with trio.move_on_after(0.2) as scope:
                await d.pull("r", [2, 3], remote)
            assert scope.cancelled_caught
            assert d.unsettled_blocks() == {2, 3}
            stats = d.statistics()
            assert (stats.transfers_unsettled, stats.blocks_unsettled) == (1, 2)
            assert stats.pulls_in_flight == 0
            # The caller reuses block 2 only after it settles: wait_settled
            # waits for the transfer, which writes (late) and then settles.
            waited = trio.Event()

            async def reuse_when_settled() -> None:
                await d.wait_settled([2])
                waited.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reuse_when_settled)
                await trio.sleep(0.1)
                assert not waited.is_set()
                assert memory_fabric.finish_unstoppable_reads("p") == 1
            assert waited.is_set()
            assert mismatched_blocks(local, [2, 3], seed=3) == []  # the late write landed
            assert d.unsettled_blocks() == frozenset()
            assert d.statistics().transfers_unsettled == 0
            await d.wait_settled([2, 3])  # at once now


async def test_a_failed_pull_reports_the_same_blocks_unsettled(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = attrs.evolve(QUICK, transfer_timeout=0.3)
    with trio.fail_after(10):
        async with (
            connector(memory_fabric, "p", config=config) as p,
            connector(memory_fabric, "d", config=config) as d,
        ):
            await d.pull("warm", [0], p.expose("warm", [0]))
            memory_fabric.faults("p").unstoppable_reads = True
            with pytest.raises(trio_pd.TransferError) as info:
                await d.pull("r", [7], p.expose("r", [7]))
            assert info.value.settled is not None
            assert d.unsettled_blocks() == {7}
            memory_fabric.finish_unstoppable_reads("p")
            await info.value.settled.wait()
            assert d.unsettled_blocks() == frozenset()


async def test_a_sibling_part_cancelled_by_another_parts_failure_keeps_its_blocks_unsettled(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A TP-1 decoder reads both ranks of a TP-2 engine: rank 1's read fails
    # at once, which cancels rank 0's part -- whose transfer cannot stop.
    # The pull raises rank 1's error; the blocks stay unsettled for rank 0.
    with trio.fail_after(10):
        base = free_port_range(2)
        heads = [kv_cache(blocks=16, block_shape=(8, 64)) for _ in range(2)]
        async with (
            trio_pd.open_connector(
                "p",
                heads[0],
                port=base,
                tp_rank=0,
                tp_size=2,
                config=QUICK,
                backend=memory_fabric.backend,
                side_channel=memory_fabric.side_channel,
            ) as rank0,
            trio_pd.open_connector(
                "p",
                heads[1],
                port=base,
                tp_rank=1,
                tp_size=2,
                config=QUICK,
                backend=memory_fabric.backend,
                side_channel=memory_fabric.side_channel,
            ) as rank1,
            trio_pd.open_connector(
                "d",
                kv_cache(blocks=16, block_shape=(16, 64)),
                config=QUICK,
                backend=memory_fabric.backend,
                side_channel=memory_fabric.side_channel,
            ) as d,
        ):
            warm = [rank.expose("warm", [0]) for rank in (rank0, rank1)]
            await d.pull("warm", [0], warm[0])
            exposed = [rank.expose("r", [4, 5]) for rank in (rank0, rank1)]
            memory_fabric.faults(f"p#{exposed[0].incarnation}").unstoppable_reads = True
            memory_fabric.faults(f"p#{exposed[1].incarnation}").read_error = "NIXL_ERR_REMOTE"
            with pytest.raises(trio_pd.TransferError, match=r"remote rank 1.*NIXL_ERR_REMOTE"):
                await d.pull("r", [8, 9], exposed[0])
            assert d.unsettled_blocks() == {8, 9}
            memory_fabric.finish_unstoppable_reads("p")
            await d.wait_settled([8, 9])
            assert d.unsettled_blocks() == frozenset()


async def test_closing_with_an_unsettled_transfer_keeps_its_blocks_unsettled(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with connector(memory_fabric, "p") as p:
            async with connector(memory_fabric, "d") as d:
                await d.pull("warm", [0], p.expose("warm", [0]))
                memory_fabric.faults("p").unstoppable_reads = True
                remote = p.expose("r", [3])
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(d.pull, "r", [3], remote)
                    await trio.sleep(0.05)
                    nursery.cancel_scope.cancel()
            # closed: the transfer still runs; the answer stays true after close
            assert d.unsettled_blocks() == {3}
            memory_fabric.finish_unstoppable_reads("p")
            await d.wait_settled([3])


# ---- a request's claims hurt only that request -------------------------------------


async def test_forged_incarnations_never_fail_valid_requests_or_retire_the_agent(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The repro: valid requests from many clients while forged requests name
    # fake incarnations of the same live engine. Before: the live agent was
    # retired at each new fake value and valid requests failed with "it
    # restarted and the blocks are gone".
    with trio.fail_after(20):
        prefill_kv, local = kv_cache(blocks=64), kv_cache(blocks=64)
        async with (
            connector(memory_fabric, "p", kv=prefill_kv) as p,
            connector(memory_fabric, "d", kv=local) as d,
        ):
            await d.pull("warm", [0], p.expose("warm", [0]))
            valid_failures: list[BaseException] = []
            forged_errors: list[BaseException] = []

            async def valid(n: int) -> None:
                for round_ in range(8):
                    block = 1 + (n * 8 + round_) % 31
                    fill_blocks(prefill_kv, [block], seed=n)
                    remote = p.expose(f"v{n}-{round_}", [block])
                    try:
                        await d.pull(f"v{n}-{round_}", [32 + n], remote)
                    except trio_pd.TrioPdError as exc:
                        valid_failures.append(exc)
                    await trio.sleep(0.01)

            async def forged(n: int) -> None:
                for round_ in range(5):
                    real = p.expose(f"f{n}-{round_}", [40 + n])
                    fake = attrs.evolve(real, incarnation=f"{n:04d}{round_:012d}")
                    try:
                        await d.pull(f"f{n}-{round_}", [50 + n], fake)
                    except (trio_pd.TransferError, trio_pd.HandshakeError) as exc:
                        forged_errors.append(exc)
                    await trio.sleep(0.02)

            async with trio.open_nursery() as nursery:
                for n in range(8):
                    nursery.start_soon(valid, n)
                for n in range(7):
                    nursery.start_soon(forged, n)
            assert valid_failures == []
            assert len(forged_errors) == 35
            # each names its own request (or the engine whose answers it waited on)
            assert all("request 'f" in str(e) or "engine 'p'" in str(e) for e in forged_errors), [
                str(e) for e in forged_errors
            ]
            stats = d.statistics()
            assert stats.restarts_detected == 0
            assert stats.remote_agents_loaded == 1
            assert d.engine_state("p") is trio_pd.EngineState.READY
            # at most one verification per backoff_initial (0.3 s) over the run
            assert stats.handshakes_started <= 2 + 20


async def test_a_real_restart_at_the_same_address_is_still_detected(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with connector(memory_fabric, "d") as d:
            async with connector(memory_fabric, "p") as first:
                port = first.address[1]
                await d.pull("a", [0], first.expose("a", [0]))
                stale = first.expose("stale", [1])
            new_kv = kv_cache(blocks=16)
            async with trio_pd.open_connector(
                "p",
                new_kv,
                port=port,
                config=QUICK,
                backend=memory_fabric.backend,
                side_channel=memory_fabric.side_channel,
            ) as second:
                fill_blocks(new_kv, [2], seed=4)
                await d.pull("b", [2], second.expose("b", [2]))
                stats = d.statistics()
                assert (stats.restarts_detected, stats.remote_agents_loaded) == (1, 1)
                with pytest.raises(trio_pd.TransferError, match="not"):
                    await d.pull("stale", [1], stale)


async def test_a_forged_address_or_tp_size_fails_only_its_request(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        prefill_kv, local = kv_cache(blocks=16), kv_cache(blocks=16)
        async with (
            connector(memory_fabric, "p", kv=prefill_kv) as p,
            connector(memory_fabric, "d", kv=local) as d,
        ):
            await d.pull("warm", [0], p.expose("warm", [0]))
            real = p.expose("x", [1])
            async with trio.open_nursery() as nursery:
                for n, fake in enumerate(
                    [
                        attrs.evolve(real, port=real.port + 7),
                        attrs.evolve(real, host="127.0.0.2"),
                        attrs.evolve(real, tp_size=2),
                    ]
                ):

                    async def forged(fake: trio_pd.RemoteBlocks = fake, n: int = n) -> None:
                        with pytest.raises(trio_pd.HandshakeError):
                            await d.pull(f"forged-{n}", [8 + n], fake)

                    nursery.start_soon(forged)
                for n in range(5):  # valid requests meanwhile: unaffected
                    fill_blocks(prefill_kv, [2 + n], seed=n)
                    await d.pull(f"ok-{n}", [2 + n], p.expose(f"ok-{n}", [2 + n]))
                    assert mismatched_blocks(local, [2 + n], seed=n) == []
            assert d.engine_state("p") is trio_pd.EngineState.READY
            assert d.statistics().remote_agents_loaded == 1


async def test_remote_block_ids_out_of_range_are_rejected_naming_the_field(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with (
            connector(memory_fabric, "p") as p,
            connector(memory_fabric, "d") as d,
        ):
            real = p.expose("x", [1, 2])
            for ids in ([1, 99], [-1, 2], [3, 3]):
                with pytest.raises(trio_pd.ParamsRejectedError) as info:
                    await d.pull("bad", [0, 1], attrs.evolve(real, block_ids=ids))
                assert info.value.field == "remote_block_ids"
            assert memory_fabric.reads == 0
            assert d.statistics().pulls_rejected == 3
            await d.pull("x", [0, 1], real)


# ---- every wait has its bound -------------------------------------------------------


async def test_a_load_that_never_returns_holds_up_no_other_engines_handshake(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The repro: engine A's remote-agent load never returns. Before: a pull
    # from healthy engine B queued behind it with no deadline (B stayed
    # LOADING), and BackendClosing escaped open_connector at close.
    caplog.set_level(logging.WARNING)
    with trio.fail_after(10):
        async with (
            connector(memory_fabric, "a") as a,
            connector(memory_fabric, "b") as b,
            connector(memory_fabric, "d") as d,
        ):
            memory_fabric.faults("a").hang_loads = True
            outcomes: dict[str, float] = {}

            async def timed(name: str, conn: trio_pd.Connector, block: int) -> None:
                started = trio.current_time()
                try:
                    await d.pull(name, [block], conn.expose(name, [block]))
                except trio_pd.HandshakeError:
                    outcomes[name + " failed"] = trio.current_time() - started
                else:
                    outcomes[name] = trio.current_time() - started

            async with trio.open_nursery() as nursery:
                nursery.start_soon(timed, "from-a", a, 1)
                await trio.sleep(0.05)  # b's load queues behind a's
                nursery.start_soon(timed, "from-b", b, 2)
            assert set(outcomes) == {"from-a failed", "from-b"}
            bound = QUICK.handshake_timeout + 0.15
            assert outcomes["from-a failed"] < bound
            assert outcomes["from-b"] < bound
            assert d.engine_state("b") is trio_pd.EngineState.READY
            assert d.engine_state("a") is trio_pd.EngineState.BACKOFF
            # A second hang, this time in flight when the connector closes.
            await trio.sleep(QUICK.backoff_max)
            async with trio.open_nursery() as nursery:

                async def doomed() -> None:
                    with pytest.raises((trio_pd.HandshakeError, trio.ClosedResourceError)):
                        await d.pull("again", [3], a.expose("again", [3]))

                nursery.start_soon(doomed)
                await trio.sleep(0.1)
                assert d.engine_state("a") is trio_pd.EngineState.LOADING
                nursery.cancel_scope.cancel()
    assert "BackendClosing" not in caplog.text


async def test_a_pull_waiting_on_a_queued_load_gets_its_error_within_the_timeout(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Many engines whose loads are slow (0.3 s each) queue behind each other:
    # each pull gets an answer within handshake_timeout of starting, success
    # or a clear error, never later.
    with trio.fail_after(20):
        engines = [f"slow-{n}" for n in range(4)]
        for engine in engines:
            memory_fabric.faults(engine).load_delay = 0.3
        async with connector(memory_fabric, "d") as d:
            producers: list[trio_pd.Connector] = []
            async with trio.open_nursery() as opener:
                for engine in engines:

                    async def open_one(
                        engine: str = engine,
                        *,
                        task_status: trio.TaskStatus[trio_pd.Connector] = trio.TASK_STATUS_IGNORED,
                    ) -> None:
                        async with trio_pd.open_connector(
                            engine,
                            kv_cache(blocks=16),
                            config=QUICK,
                            backend=memory_fabric.backend,
                            side_channel=memory_fabric.side_channel,
                        ) as conn:
                            task_status.started(conn)
                            await trio.sleep_forever()

                    producers.append(await opener.start(open_one))
                took: list[float] = []
                errors: list[str] = []

                async def one(conn: trio_pd.Connector, block: int) -> None:
                    started = trio.current_time()
                    try:
                        await d.pull(f"r{block}", [block], conn.expose(f"r{block}", [block]))
                    except trio_pd.HandshakeError as exc:
                        errors.append(str(exc))
                    took.append(trio.current_time() - started)

                async with trio.open_nursery() as nursery:
                    for block, conn in enumerate(producers):
                        nursery.start_soon(one, conn, block)
                opener.cancel_scope.cancel()
            assert len(took) == 4
            assert max(took) < QUICK.handshake_timeout + 0.15
            assert errors, "four 0.3 s loads cannot all fit in 0.5 s"
            assert all("queued" in e or "not loaded within" in e for e in errors)


async def test_a_failing_notification_poll_is_retried_at_a_pace_not_in_a_busy_loop(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = attrs.evolve(QUICK, idle_notification_poll_interval=0.05)
    with trio.fail_after(10):
        async with connector(memory_fabric, "p", config=config) as p:
            p.expose("pending", [1])
            backend = memory_fabric.backends[-1]
            memory_fabric.faults("p").notification_error = "NIXL_ERR_BACKEND"
            before = backend.notification_polls
            await trio.sleep(0.5)
            polls = backend.notification_polls - before
            assert 3 <= polls <= 0.5 / 0.05 + 3, polls  # (about one per interval)
            assert "NIXL_ERR_BACKEND" in caplog.text
            memory_fabric.faults("p").notification_error = None
            assert p.statistics().exposures_pending == 1  # (nothing lost meanwhile)


# ---- found by review: each a repro first ---------------------------------------------

SIGNED = attrs.evolve(QUICK, exposure_secret=b"deployment secret, 32 bytes long")


async def open_tp2_producer(
    fabric: MemoryFabric, base: int, stack: contextlib.AsyncExitStack
) -> list[trio_pd.Connector]:
    """Both ranks of a TP-2 prefill engine "p" on ``base`` (and ``base + 1``)."""
    return [
        await stack.enter_async_context(
            trio_pd.open_connector(
                "p",
                kv_cache(blocks=16, block_shape=(8, 64)),
                port=base,
                tp_rank=rank,
                tp_size=2,
                config=QUICK,
                backend=fabric.backend,
                side_channel=fabric.side_channel,
            )
        )
        for rank in range(2)
    ]


def expose_all(
    ranks: list[trio_pd.Connector], request_id: str, ids: list[int]
) -> trio_pd.RemoteBlocks:
    """Every rank exposes; rank 0's parameters go to the decoder (as a proxy forwards them)."""
    exposed = [rank.expose(request_id, ids) for rank in ranks]
    return exposed[0]


async def test_a_stale_first_request_does_not_poison_another_ranks_record(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Requests prefilled before a TP-2 engine restarted reach the decoder
    # after it: they fail, and they must not make later valid requests fail
    # (a rank-1 record once took its epoch from the first request). The
    # handshakes with the live ranks are not the point: a long deadline for
    # them (a busy machine missed 0.5 s).
    with trio.fail_after(30):
        base = free_port_range(2)
        async with trio_pd.open_connector(
            "d",
            kv_cache(blocks=16, block_shape=(16, 64)),
            config=attrs.evolve(QUICK, handshake_timeout=5.0),
            backend=memory_fabric.backend,
            side_channel=memory_fabric.side_channel,
        ) as d:
            async with contextlib.AsyncExitStack() as stack:
                ranks = await open_tp2_producer(memory_fabric, base, stack)
                await d.pull("w", [0], expose_all(ranks, "w", [0]))
                stale = [expose_all(ranks, f"s{i}", [1 + i]) for i in range(2)]
            async with contextlib.AsyncExitStack() as stack:
                ranks = await open_tp2_producer(memory_fabric, base, stack)
                for i in range(2):
                    with pytest.raises(trio_pd.TrioPdError):
                        await d.pull(f"s{i}", [1 + i], stale[i])
                forged = attrs.evolve(ranks[0].expose("f", [4]), incarnation="0" * 16)
                ranks[1].expose("f", [4])
                with pytest.raises(trio_pd.TransferError):
                    await d.pull("f", [4], forged)
                for n in range(3):
                    await trio.sleep(QUICK.backoff_initial)
                    valid = expose_all(ranks, f"ok{n}", [5 + n])
                    await d.pull(f"ok{n}", [5 + n], valid)


# Found by tests/test_chaos.py: the rank-1 part of the first pull after a TP-2 engine restarted
# read through rank 1's old agent (TransferError "... disconnected"), although the rank-0 part of
# the same pull had just found the new incarnation
async def test_the_first_pull_after_a_tp_engine_restarted_reads_every_rank(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        base = free_port_range(2)
        local = kv_cache(blocks=16, block_shape=(16, 64))
        async with trio_pd.open_connector(
            "d",
            local,
            config=QUICK,
            backend=memory_fabric.backend,
            side_channel=memory_fabric.side_channel,
        ) as d:
            async with contextlib.AsyncExitStack() as stack:
                ranks = await open_tp2_producer(memory_fabric, base, stack)
                await d.pull("before", [0], expose_all(ranks, "before", [0]))
            kvs = [kv_cache(blocks=16, block_shape=(8, 64)) for _ in range(2)]
            async with contextlib.AsyncExitStack() as stack:  # both ranks restart, same ports
                ranks = [
                    await stack.enter_async_context(
                        trio_pd.open_connector(
                            "p",
                            kv,
                            port=base,
                            tp_rank=rank,
                            tp_size=2,
                            config=QUICK,
                            backend=memory_fabric.backend,
                            side_channel=memory_fabric.side_channel,
                        )
                    )
                    for rank, kv in enumerate(kvs)
                ]
                for rank, kv in enumerate(kvs):
                    fill_heads(kv, rank, [3], seed=5)
                await d.pull("after", [1], expose_all(ranks, "after", [3]))
                assert mismatched_heads(local, 0, [1], [3], seed=5) == []
            stats = d.statistics()
            assert (stats.pulls_succeeded, stats.pulls_failed, stats.restarts_detected) == (2, 0, 1)


async def test_a_replay_of_parameters_whose_exposure_is_over_reads_nothing(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = attrs.evolve(SIGNED, heartbeat_interval=0.05)
    with trio.fail_after(10):
        prefill_kv, local = kv_cache(blocks=16), kv_cache(blocks=16)
        async with (
            connector(memory_fabric, "p", kv=prefill_kv, config=config) as p,
            connector(memory_fabric, "d", kv=local, config=config) as d,
        ):
            mine = p.expose("attacker", [3])
            await d.pull("attacker", [1], mine)
            assert await p.wait_released("attacker") is trio_pd.Released.READ
            fill_blocks(prefill_kv, [3], seed=7)  # block 3 holds a victim's KV now
            p.expose("victim", [3])
            async with d.hold(mine):
                await trio.sleep(0.2)  # the heartbeat hears: not pending there
                with pytest.raises(trio_pd.TransferError, match="no longer holds"):
                    await d.pull("replay", [2], mine)
            assert not local[0][2].any()


# Found by tests/test_chaos.py: the pull above, refused for a lost hold, was refused before the
# consumer's pull began, and pulls_failed did not count it
async def test_a_pull_refused_for_a_lost_hold_counts_as_failed(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = attrs.evolve(QUICK, heartbeat_interval=0.1)
    with trio.fail_after(10), caplog.at_level(logging.WARNING, logger="trio_pd"):
        async with (
            connector(memory_fabric, "p", config=config) as p,
            connector(memory_fabric, "d", config=config) as d,
        ):
            remote = p.expose("r", [1])
            await d.pull("r", [1], remote)
            async with d.hold(p.expose("other", [3])), d.hold(remote):
                # A heartbeat's reply says "r" is not pending there (read already):
                # the hold is lost (a reply can miss its round's deadline on a
                # loaded machine: wait for the verdict, not for a number of rounds).
                await wait_until(lambda: "the hold on request 'r' is lost" in caplog.text)
                with pytest.raises(trio_pd.TransferError, match="no longer holds"):
                    await d.pull("again", [2], remote)
            stats = d.statistics()
            assert (stats.pulls_succeeded, stats.pulls_failed, stats.pulls_rejected) == (1, 1, 0)


async def test_a_forged_hold_is_refused_before_any_message(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with (
            connector(memory_fabric, "p", config=SIGNED) as p,
            connector(memory_fabric, "d", config=SIGNED) as d,
        ):
            forged = attrs.evolve(p.expose("x", [1]), request_id="victim", token="0" * 32)
            with pytest.raises(trio_pd.ParamsRejectedError):
                async with d.hold(forged):
                    await trio.sleep(0.3)
            with pytest.raises(trio_pd.ParamsRejectedError):
                await d.abandon(forged)
            stats = d.statistics()
            assert (stats.heartbeats_sent, stats.abandons_sent) == (0, 0)


async def test_several_ranks_failing_at_once_is_one_error(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Every decode rank refuses a forged token before its first checkpoint:
    # serve got an ExceptionGroup (a 500); it is one ParamsRejectedError.
    from trio_pd._serve.engine import _pull_every_rank

    with trio.fail_after(10):
        async with trio_pd.open_connector(
            "p", kv_cache(blocks=16, block_shape=(16, 64)), config=SIGNED,
            backend=memory_fabric.backend, side_channel=memory_fabric.side_channel,
        ) as p:  # fmt: skip
            base = free_port_range(2)
            forged = attrs.evolve(p.expose("x", [1]), token="0" * 32)
            options = {"port": base, "tp_size": 2, "config": SIGNED}
            async with (
                trio_pd.open_connector(
                    "d", kv_cache(blocks=16, block_shape=(8, 64)), tp_rank=0,
                    backend=memory_fabric.backend,
                    side_channel=memory_fabric.side_channel,
                    **options,  # type: ignore[arg-type]
                ) as d0,
                trio_pd.open_connector(
                    "d", kv_cache(blocks=16, block_shape=(8, 64)), tp_rank=1,
                    backend=memory_fabric.backend,
                    side_channel=memory_fabric.side_channel,
                    **options,  # type: ignore[arg-type]
                ) as d1,
            ):  # fmt: skip
                with pytest.raises(trio_pd.ParamsRejectedError):
                    await _pull_every_rank([d0, d1], "r", [1], forged)


async def test_closing_while_a_restart_retires_the_old_agent_raises_nothing(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A verification finds a restart and retires the old agent (NIXL: a
    # thread call); the connector closes meanwhile. Before: the handshake
    # task's queue was closed under it and ClosedResourceError escaped.
    memory_fabric.faults("p").unload_delay = 0.2
    with trio.fail_after(10):
        async with connector(memory_fabric, "p") as first:
            port = first.address[1]
        async with (
            trio.open_nursery() as outer,
            connector(memory_fabric, "d") as d,
        ):
            async with trio_pd.open_connector(
                "p", kv_cache(blocks=16), port=port, config=QUICK,
                backend=memory_fabric.backend, side_channel=memory_fabric.side_channel,
            ) as old:  # fmt: skip
                await d.pull("a", [0], old.expose("a", [0]))
            async with trio_pd.open_connector(
                "p", kv_cache(blocks=16), port=port, config=QUICK,
                backend=memory_fabric.backend, side_channel=memory_fabric.side_channel,
            ) as new:  # fmt: skip

                async def pull(remote: trio_pd.RemoteBlocks) -> None:
                    with pytest.raises(trio.ClosedResourceError):
                        await d.pull("b", [1], remote)

                # (on purpose: the pull outlives `new`, and `d` closes under it)
                outer.start_soon(pull, new.expose("b", [1]))  # noqa: ASYNC111
                await trio.sleep(0.1)  # the verification found it; the retire runs
