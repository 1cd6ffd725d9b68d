"""The connector's logic on the in-memory backend: handshakes, backoff, restarts,
cancellation and close, with faults injected at the backend seam.

Both planes are the in-memory ones from ``trio_pd.testing`` (the fabric's
backend and side channel), and the clock is trio's mock clock
(``autojump_clock``): no UCX, no sockets, and every deadline is met or
missed exactly. The real-NIXL and real-ZeroMQ tests of the same behaviour
stay in the other modules.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import pytest
import torch
import trio
import trio.testing

import trio_pd
from trio_pd._consumer._handshakes import LOAD_BYTES_AHEAD
from trio_pd._transfer._backend import Loaded, LoadRequest
from trio_pd.testing import MemoryFabric, fill_blocks, mismatched_blocks

from .conftest import kv_cache, wait_until

pytest_plugins = ["trio_pd.testing.fixtures"]

QUICK = trio_pd.ConnectorConfig(
    handshake_timeout=0.5,
    transfer_timeout=0.5,
    close_timeout=1.0,
    backoff_initial=0.2,
    backoff_max=0.4,
    backoff_jitter=0.0,
    abort_timeout=5.0,
)


@asynccontextmanager
async def producer(
    fabric: MemoryFabric, engine_id: str = "p", port: int = 0
) -> AsyncIterator[tuple[trio_pd.Connector, list[torch.Tensor]]]:
    """A producer engine on the fabric, and its KV cache."""
    kv = kv_cache(blocks=16)
    async with trio_pd.open_connector(
        engine_id,
        kv,
        port=port,
        config=QUICK,
        backend=fabric.backend,
        side_channel=fabric.side_channel,
    ) as conn:
        yield conn, kv


@asynccontextmanager
async def consumer(
    fabric: MemoryFabric, config: trio_pd.ConnectorConfig = QUICK
) -> AsyncIterator[tuple[trio_pd.Connector, list[torch.Tensor]]]:
    local = kv_cache(blocks=16)
    async with trio_pd.open_connector(
        "d", local, config=config, backend=fabric.backend, side_channel=fabric.side_channel
    ) as conn:
        yield conn, local


def seeded(
    conn: trio_pd.Connector, kv: list[torch.Tensor], request_id: str, ids: list[int], seed: int
) -> trio_pd.RemoteBlocks:
    """Fill ``ids`` of the producer's ``kv`` from ``seed`` and expose them."""
    fill_blocks(kv, ids, seed)
    return conn.expose(request_id, ids)


async def test_pulls_move_the_right_bytes_and_release_the_exposure(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with (
            producer(memory_fabric) as (p, prefill_kv),
            consumer(memory_fabric) as (d, local),
        ):
            remote = seeded(p, prefill_kv, "r", [3, 9, 4], seed=7)
            result = await d.pull("r", [0, 1, 2], remote)
            assert mismatched_blocks(local, [0, 1, 2], 7) == []
            assert result.bytes == 3 * d.layout.bytes_per_block_id
            assert await p.wait_released("r") is trio_pd.Released.READ
            assert memory_fabric.reads == 1


async def test_concurrent_pulls_to_a_new_engine_share_one_handshake(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with producer(memory_fabric) as (p, _), consumer(memory_fabric) as (d, _):
            memory_fabric.faults("p").load_delay = 0.1  # all of them arrive while it loads
            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(d.pull, f"r{i}", [i], p.expose(f"r{i}", [i]))
            stats = d.statistics()
            assert (stats.handshakes_started, stats.handshakes_succeeded) == (1, 1)
            assert stats.pulls_succeeded == 16
            assert stats.remote_agents_loaded == 1


async def test_a_failed_load_fails_every_waiter_backs_off_then_recovers(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with producer(memory_fabric) as (p, _), consumer(memory_fabric) as (d, _):
            memory_fabric.faults("p").load_error = "bad metadata"
            errors: list[trio_pd.HandshakeError] = []

            async def pull(i: int) -> None:
                with pytest.raises(trio_pd.HandshakeError) as info:
                    await d.pull(f"r{i}", [i], p.expose(f"r{i}", [i]))
                errors.append(info.value)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(pull, i)
            assert [e.reason for e in errors] == [errors[0].reason] * 3
            assert "loading the remote agent: add_remote_agent: bad metadata" in errors[0].reason
            assert len({id(e) for e in errors}) == 3  # one exception object per raise
            assert d.engine_state("p") is trio_pd.EngineState.BACKOFF
            # During the backoff: fail fast, no new attempt.
            with pytest.raises(trio_pd.HandshakeError, match="bad metadata"):
                await d.pull("fast", [5], p.expose("fast", [5]))
            memory_fabric.faults("p").load_error = None
            await trio.sleep(QUICK.backoff_initial)
            await d.pull("later", [6], p.expose("later", [6]))
            stats = d.statistics()
            assert stats.handshake_failures_by_cause == {trio_pd.FailureCause.NIXL: 1}
            assert stats.handshake_failures_by_cause == {"nixl": 1}
            assert (stats.handshakes_started, stats.pulls_rejected_in_backoff) == (2, 1)


async def test_a_load_over_the_deadline_fails_its_waiters_and_its_late_agent_is_unloaded(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with producer(memory_fabric) as (p, _), consumer(memory_fabric) as (d, _):
            memory_fabric.faults("p").load_delay = 2 * QUICK.handshake_timeout
            started = trio.current_time()
            with pytest.raises(trio_pd.HandshakeError, match=r"not loaded within 0\.5 s"):
                await d.pull("r", [1], p.expose("r", [1]))
            assert trio.current_time() - started < 2 * QUICK.handshake_timeout
            # The load finishes later; its agent is not used but unloaded.
            await trio.sleep(QUICK.handshake_timeout + 0.1)
            assert d.statistics().remote_agents_loaded == 0
            memory_fabric.faults("p").load_delay = 0.0
            await d.pull("again", [2], p.expose("again", [2]))
            assert d.statistics().remote_agents_loaded == 1


async def test_a_read_error_names_the_blocks_and_keeps_the_engine_ready(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with producer(memory_fabric) as (p, _), consumer(memory_fabric) as (d, _local):
            await d.pull("warm", [0], p.expose("warm", [0]))
            memory_fabric.faults("p").read_error = "NIXL_ERR_BACKEND"
            with pytest.raises(trio_pd.TransferError) as info:
                await d.pull("r", [4, 5], p.expose("r", [7, 8]))
            assert info.value.request_id == "r"
            assert info.value.failed_block_ids == (4, 5)
            assert "NIXL_ERR_BACKEND" in info.value.reason
            # The public error chains the backend's, which chains nothing.
            cause = info.value.__cause__
            assert isinstance(cause, trio_pd.BackendError)
            assert str(cause) in info.value.reason
            assert (cause.__cause__, cause.__context__) == (None, None)
            assert d.engine_state("p") is trio_pd.EngineState.READY
            assert d.statistics().pulls_failed == 1


async def test_a_read_that_never_ends_times_out_and_writes_nothing(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with (
            producer(memory_fabric) as (p, prefill_kv),
            consumer(memory_fabric) as (d, local),
        ):
            await d.pull("warm", [0], p.expose("warm", [0]))
            memory_fabric.faults("p").hang_reads = True
            remote = seeded(p, prefill_kv, "r", [3], seed=1)
            with pytest.raises(trio_pd.TransferError, match=r"not complete within 0\.5 s") as info:
                await d.pull("r", [3], remote)
            # trio_pd's own decision: no cause, the internal TransferTimeout not shown.
            assert info.value.__cause__ is None
            assert info.value.__suppress_context__
            assert not local[0][3].any()
            assert d.statistics().pulls_in_flight == 0


async def test_a_cancelled_pull_copies_nothing_and_counts_neither_way(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with producer(memory_fabric) as (p, _), consumer(memory_fabric) as (d, _local):
            await d.pull("warm", [0], p.expose("warm", [0]))
            memory_fabric.faults("p").read_delay = 0.2
            with trio.move_on_after(0.05) as scope:
                await d.pull("r", [2], p.expose("r", [2]))
            assert scope.cancelled_caught
            stats = d.statistics()
            assert (stats.pulls_succeeded, stats.pulls_failed, stats.pulls_in_flight) == (1, 0, 0)
            assert memory_fabric.reads == 1  # only the warm-up


async def test_a_restart_seen_in_a_request_retires_the_old_agent(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with consumer(memory_fabric) as (d, _local):
            async with producer(memory_fabric) as (first, _):
                port = first.address[1]
                old = first.expose("old", [1])
                await d.pull("warm", [0], first.expose("warm", [0]))
            async with producer(memory_fabric, port=port) as (second, _):
                fresh = second.expose("new", [2])
                assert fresh.incarnation != old.incarnation
                await d.pull("new", [2], fresh)
                stats = d.statistics()
                assert (stats.restarts_detected, stats.handshakes_started) == (1, 2)
                assert stats.remote_agents_loaded == 1  # the old one was unloaded
                with pytest.raises(trio_pd.TransferError) as info:
                    await d.pull("old", [1], old)
                reason = info.value.reason
                assert f"runs incarnation {fresh.incarnation}, not {old.incarnation}" in reason


async def test_two_incarnations_at_two_addresses_are_two_engines(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # What a request claims about where an engine is (address, TP size)
    # picks the record it uses: both engines serve, neither retires the other.
    with trio.fail_after(10):
        old_kv, new_kv = kv_cache(blocks=16), kv_cache(blocks=16)
        async with (
            trio_pd.open_connector(
                "p", old_kv, backend=memory_fabric.backend, side_channel=memory_fabric.side_channel
            ) as old_p,
            trio_pd.open_connector(
                "p", new_kv, backend=memory_fabric.backend, side_channel=memory_fabric.side_channel
            ) as new_p,
            consumer(memory_fabric) as (d, local),
        ):
            await d.pull("a", [1], seeded(old_p, old_kv, "a", [1], seed=1))
            await d.pull("b", [2], seeded(new_p, new_kv, "b", [2], seed=2))
            await d.pull("c", [3], seeded(old_p, old_kv, "c", [3], seed=3))
            for block in (1, 2, 3):
                assert mismatched_blocks(local, [block], seed=block) == []
            stats = d.statistics()
            assert (stats.handshakes_started, stats.restarts_detected) == (2, 0)
            assert stats.remote_agents_loaded == 2


async def test_after_a_lost_peer_the_next_pull_handshakes_and_reads_if_it_is_back(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A lost connection is not a restart: the incarnation is suspect, not gone.
    with trio.fail_after(10):
        async with (
            producer(memory_fabric) as (p, prefill_kv),
            consumer(memory_fabric) as (d, local),
        ):
            await d.pull("warm", [0], p.expose("warm", [0]))
            during = p.expose("during", [1])
            after = seeded(p, prefill_kv, "after", [2], seed=3)
            memory_fabric.cut("p")
            with pytest.raises(trio_pd.TransferError, match="disconnected"):
                await d.pull("during", [1], during)
            assert d.engine_state("p") is trio_pd.EngineState.STALE
            stats = d.statistics()
            assert (stats.peers_disconnected, stats.remote_agents_loaded) == (1, 0)
            memory_fabric.restore("p")
            await d.pull("after", [2], after)  # same incarnation: handshake, then read
            assert mismatched_blocks(local, [2], 3) == []
            assert d.statistics().handshakes_started == 2


async def test_after_a_producer_died_its_requests_fail_naming_the_cause_not_a_restart(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        async with consumer(memory_fabric) as (d, _):
            async with producer(memory_fabric) as (p, _):
                await d.pull("warm", [0], p.expose("warm", [0]))
                first, second = p.expose("a", [1]), p.expose("b", [2])
            with pytest.raises(trio_pd.TransferError, match="disconnected"):
                await d.pull("a", [1], first)
            with pytest.raises(trio_pd.HandshakeError) as info:
                await d.pull("b", [2], second)
            assert "connection refused" in info.value.reason
            assert "restarted" not in info.value.reason


async def test_closing_wakes_waiters_stops_reads_and_keeps_statistics(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(10):
        outcomes: list[BaseException] = []

        async def pull_outside(d: trio_pd.Connector, remote: trio_pd.RemoteBlocks) -> None:
            try:
                await d.pull(remote.request_id, [remote.block_ids[0]], remote)
            except trio.ClosedResourceError as exc:
                outcomes.append(exc)

        async with producer(memory_fabric) as (p, _), trio.open_nursery() as nursery:
            async with consumer(memory_fabric) as (d, _):
                await d.pull("warm", [0], p.expose("warm", [0]))
                memory_fabric.faults("p").hang_reads = True
                nursery.start_soon(pull_outside, d, p.expose("stuck", [1]))
                await trio.testing.wait_all_tasks_blocked()
                assert d.statistics().pulls_in_flight == 1
            closed_at = trio.current_time()
        assert trio.current_time() - closed_at < QUICK.close_timeout
        assert len(outcomes) == 1
        # statistics() and engine_state() keep answering after close.
        assert d.statistics().pulls_succeeded == 1
        assert d.engine_state("p") is trio_pd.EngineState.CLOSED
        with pytest.raises(trio.ClosedResourceError):
            await d.pull("late", [2], trio_pd.RemoteBlocks("p", "127.0.0.1", 1, [1], "late"))


async def test_a_failing_backend_factory_raises_a_public_error_and_leaks_nothing() -> None:
    async def broken(*_: object) -> trio_pd.TransferBackend:
        await trio.lowlevel.checkpoint()
        raise trio_pd.BackendError("creating agent: no such backend")

    with pytest.raises(trio_pd.BackendError, match="no such backend"):
        async with trio_pd.open_connector("p", kv_cache(blocks=4), backend=broken):
            pass  # pragma: no cover


async def test_the_prefill_engine_fixture_serves_real_pulls(
    prefill_engine: trio_pd.testing.PrefillWorker, caplog: pytest.LogCaptureFixture
) -> None:
    # The fixtures a frontend's suite can use (pytest_plugins above).
    with trio.fail_after(60), caplog.at_level(logging.ERROR):
        local = kv_cache(regions=4, blocks=64)
        async with trio_pd.open_connector("d", local) as d:
            await d.pull("r", [5], await prefill_engine.expose("r", [9], seed=11))
            assert mismatched_blocks(local, [5], 11) == []
        assert caplog.records == []


async def test_an_agent_the_backend_gave_up_is_handshaken_again_by_the_next_pull(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # What a NIXL transfer that cannot be stopped leads to: the backend
    # retires the agent on its own; the engine must not stay "ready" on it.
    with trio.fail_after(10):
        async with producer(memory_fabric) as (p, _), consumer(memory_fabric) as (d, _):
            await d.pull("warm", [0], p.expose("warm", [0]))
            [backend] = [b for b in memory_fabric.backends if b.engine_id == "d"]
            [agent] = backend.remote_agents()
            await backend.retire(agent)
            await d.pull("next", [1], p.expose("next", [1]))
            stats = d.statistics()
            assert (stats.handshakes_started, stats.pulls_failed) == (2, 0)
            assert stats.remote_agents_loaded == 1


async def test_loads_queued_together_go_to_the_backend_in_one_call(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = attrs.evolve(QUICK, handshake_timeout=30.0)
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            producers = [
                (await stack.enter_async_context(producer(memory_fabric, name)))[0]
                for name in "abcde"
            ]
            d, _ = await stack.enter_async_context(consumer(memory_fabric, config))
            backend = memory_fabric.backends[-1]
            batches: list[list[str]] = []
            gate = trio.Event()
            load_remotes = backend.load_remotes

            async def recorded(requests: Sequence[LoadRequest], loaded: Loaded) -> None:
                batches.append([r.engine_id for r in requests])
                await gate.wait()  # (the first load takes until every other one queued)
                await load_remotes(requests, loaded)

            backend.load_remotes = recorded  # type: ignore[method-assign]
            async with trio.open_nursery() as nursery:
                for i, p in enumerate(producers):
                    nursery.start_soon(d.pull, f"r{i}", [i], p.expose(f"r{i}", [i]))
                    if i == 0:
                        await wait_until(lambda: batches)
                loading = trio_pd.EngineState.LOADING
                await wait_until(lambda: all(d.engine_state(n) is loading for n in "bcde"))
                gate.set()
            assert [sorted(batch) for batch in batches] == [["a"], ["b", "c", "d", "e"]]
            assert d.statistics().handshakes_succeeded == 5


async def test_an_attempt_that_never_got_a_fetch_slot_fails_at_its_own_deadline(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    # One fetch slot, held by a mute engine's fetch; another attempt started
    # at the same instant waits for the slot, and at their deadline the
    # watchdog fails it, saying that nothing was sent.
    config = attrs.evolve(QUICK, max_concurrent_fetches=1)
    errors: dict[str, str] = {}
    mute_engine = producer(memory_fabric, "mute")
    async with mute_engine as (mute, _), consumer(memory_fabric, config) as (d, _):
        memory_fabric.faults("mute").mute = True  # (takes requests, never answers)
        port = mute.address[1]
        started = trio.current_time()

        async def pull(engine_id: str) -> None:
            remote = trio_pd.RemoteBlocks(engine_id, "127.0.0.1", port, [0], "r")
            with pytest.raises(trio_pd.HandshakeError) as info:
                await d.pull(engine_id, [0], remote)
            errors[engine_id] = info.value.reason

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull, "mute-first")
                await trio.testing.wait_all_tasks_blocked()  # (its fetch holds the slot)
                nursery.start_soon(pull, "mute-queued")
        assert trio.current_time() - started == pytest.approx(QUICK.handshake_timeout)
        assert "connected, but the peer never replied" in errors["mute-first"]
        assert errors["mute-queued"] == (
            f"no reply from 127.0.0.1:{port} within 0.5 s: nothing was sent: every fetch "
            "slot (max_concurrent_fetches) stayed busy with other handshakes"
        )
        assert d.statistics().handshake_failures_by_cause == {"timeout": 2}


async def test_a_finished_handshake_leaves_no_task_waiting_for_its_deadline(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = attrs.evolve(QUICK, handshake_timeout=60.0)
    with trio.fail_after(20):
        async with producer(memory_fabric) as (p, _), consumer(memory_fabric, config) as (d, _):
            await d.pull("r", [1], p.expose("r", [1]))
            # (no fetch worker, and no watchdog sleeping until the 60 s deadline)
            await wait_until(lambda: not _tasks_named("_fetch_worker"))
            await wait_until(lambda: not _tasks_named("_watch_deadlines"))


def _tasks_named(fragment: str) -> list[trio.lowlevel.Task]:
    found, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        if task is None:
            continue
        found += [task] if fragment in task.name else []
        todo += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
    return found


async def test_a_storm_of_forged_replies_with_huge_metadata_queues_a_bounded_number_of_bytes(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A hostile side channel answers for any engine id a request names, each
    # reply carrying 512 KiB of agent metadata (NIXL's own is ~3 KiB for 64
    # regions). While the one load thread is busy, what the fetch workers
    # fetch waits in the load queue; without a bound on its bytes, 79 of the
    # 80 replies (39.5 MiB) waited there. The workers hold back once the
    # queued and running loads hold LOAD_BYTES_AHEAD (16 MiB) of metadata.
    from trio_pd._core import _protocol as protocol

    blob = b"\0" * (512 << 10)
    config = attrs.evolve(QUICK, handshake_timeout=5.0)

    class Hostile:
        """A listener on the fabric that answers as whatever engine is asked for."""

        def __init__(self, layout: trio_pd.KVLayout) -> None:
            self.layout = layout

        def bound(self, address: tuple[str, int]) -> None:
            pass

        def dropped(self, why: str) -> None:
            raise AssertionError(why)  # pragma: no cover

        def auth_refused(self, reason: str) -> None:
            raise AssertionError(reason)  # pragma: no cover

        def answer(self, payload: bytes) -> bytes:
            layout = self.layout
            request = protocol.decode_request(payload, 1 << 20)
            assert isinstance(request, protocol.MetadataRequest)
            metadata = protocol.EngineMetadata(
                engine_id=request.engine_id,
                incarnation="0",
                agent_name=request.engine_id,
                agent_metadata=blob,
                num_blocks=layout.num_blocks,
                base_addrs=list(layout.base_addrs),
                block_lens=list(layout.block_lens),
                device_id=0,
                mem_type="DRAM",
                dtype=layout.dtype,
                kv_heads=layout.kv_heads,
                tp_rank=0,
                tp_size=1,
            )
            reply = protocol.metadata_reply(metadata, protocol.compatibility_hash(""))
            return protocol.encode_message(reply)

    with trio.fail_after(20):
        async with consumer(memory_fabric, config) as (d, _), trio.open_nursery() as nursery:
            hostile = memory_fabric.side_channel("hostile#0", config)
            _, port = await nursery.start(hostile.serve, "127.0.0.1", 0, Hostile(d.layout))
            backend = memory_fabric.backends[-1]
            gate = trio.Event()

            async def gated(requests: Sequence[LoadRequest], loaded: Loaded) -> None:
                await gate.wait()  # (the load thread is behind)
                await load_remotes(requests, loaded)

            load_remotes = backend.load_remotes
            backend.load_remotes = gated  # type: ignore[method-assign]
            handshakes = d._consumer._handshakes  # (white box: the load queue)

            async def pull(i: int) -> None:
                remote = trio_pd.RemoteBlocks(f"forged-{i}", "127.0.0.1", port, [0], "r")
                with pytest.raises(trio_pd.HandshakeError):
                    await d.pull(f"r{i}", [0], remote)

            async with trio.open_nursery() as pulls:
                for i in range(80):
                    pulls.start_soon(pull, i)
                attempts = handshakes._attempts
                # (until every fetch worker waits for room: none fetches more)
                await wait_until(
                    lambda: attempts.workers_held_back == config.max_concurrent_fetches
                )
                loading = [
                    i
                    for i in range(80)
                    if d.engine_state(f"forged-{i}") is trio_pd.EngineState.LOADING
                ]
                queued_bytes = handshakes._load_bytes
                gate.set()
            nursery.cancel_scope.cancel()
        # At most LOAD_BYTES_AHEAD, plus what the workers had in flight when
        # it was reached (one reply each); the rest never left the producer.
        most = LOAD_BYTES_AHEAD + config.max_concurrent_fetches * len(blob)
        assert queued_bytes == len(loading) * len(blob) <= most
        assert len(loading) < 80
