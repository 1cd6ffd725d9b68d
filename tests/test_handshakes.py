"""Handshakes: one per engine, shared by its waiters, never blocking ready engines."""

from __future__ import annotations

import random

import trio
import trio.testing

import trio_pd
from trio_pd.testing import (
    WorkerSpec,
    mismatched_blocks,
    open_prefill_worker,
    open_prefill_workers,
    serve_delay_relay,
)

from .conftest import kv_cache

SPEC = {"regions": 2, "blocks": 512, "block_shape": (8, 64), "dtype": "float16"}


async def test_concurrent_pulls_to_new_engines_share_one_handshake_each() -> None:
    # 3 prefill processes at once; 120 pulls to the first, 10 to each other,
    # all started before any engine is known.
    plan = {"prefill-a": 120, "prefill-b": 10, "prefill-c": 10}
    rng = random.Random(7)
    with trio.fail_after(120):
        specs = [WorkerSpec(engine_id, **SPEC) for engine_id in plan]
        async with open_prefill_workers(specs) as started:
            workers = {w.engine_id: w for w in started}
            local = kv_cache(regions=2, blocks=512, block_shape=(8, 64))
            free_local = iter(rng.sample(range(512), 512))
            jobs = []
            for engine_id, pulls in plan.items():
                # pending exposures of one engine must not share blocks
                free_remote = iter(rng.sample(range(512), 512))
                for n in range(pulls):
                    remote_ids = [next(free_remote) for _ in range(rng.randint(1, 3))]
                    local_ids = [next(free_local) for _ in remote_ids]
                    seed = rng.getrandbits(32)
                    remote = await workers[engine_id].expose(f"r{n}", remote_ids, seed)
                    jobs.append((f"{engine_id}/r{n}", local_ids, remote, seed))

            async with trio_pd.open_connector("decode", local) as decoder:
                assert decoder.statistics().handshakes_started == 0
                async with trio.open_nursery() as nursery:
                    for request_id, local_ids, remote, _ in jobs:
                        nursery.start_soon(decoder.pull, request_id, local_ids, remote)
                stats = decoder.statistics()
            assert stats.handshakes_started == 3
            assert stats.handshakes_succeeded == 3
            assert stats.engines_ready == 3
            assert stats.pulls_succeeded == len(jobs) == 140
            for request_id, local_ids, _, seed in jobs:
                assert mismatched_blocks(local, local_ids, seed) == [], request_id
            for engine_id, pulls in plan.items():
                producer = await workers[engine_id].statistics()
                assert producer["listener_requests"] == 1
                for n in range(pulls):
                    outcome = await workers[engine_id].wait_released(f"r{n}")
                    assert outcome is trio_pd.Released.READ


async def test_ready_engine_is_not_blocked_by_a_slow_handshake() -> None:
    with trio.fail_after(60):
        async with (
            open_prefill_worker(WorkerSpec("fast", **SPEC)) as fast,
            open_prefill_worker(WorkerSpec("slow", **SPEC)) as slow,
            trio.open_nursery() as relays,
        ):
            # Every byte to and from the slow engine's side channel takes 0.3 s.
            slow_port = await relays.start(serve_delay_relay, slow.host, slow.port, 0.3)
            local = kv_cache(regions=2, blocks=16, block_shape=(8, 64))
            config = trio_pd.ConnectorConfig(handshake_timeout=20.0)
            async with trio_pd.open_connector("decode", local, config=config) as decoder:
                await decoder.pull("warm-up", [0], await fast.expose("w", [0], seed=1))
                via_relay = await slow.expose("s", [5, 6], seed=2)
                slow_remote = trio_pd.RemoteBlocks(
                    "slow", "127.0.0.1", slow_port, via_relay.block_ids, "s"
                )
                slow_done = trio.Event()

                async def pull_slow() -> None:
                    await decoder.pull("slow-pull", [1, 2], slow_remote)
                    slow_done.set()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pull_slow)
                    await trio.testing.wait_all_tasks_blocked()
                    assert decoder.engine_state("slow") is trio_pd.EngineState.FETCHING
                    for n in range(5):
                        remote = await fast.expose(f"f{n}", [10 + n], seed=100 + n)
                        await decoder.pull(f"fast-{n}", [3 + n], remote)
                        assert mismatched_blocks(local, [3 + n], 100 + n) == []
                    # all five fast pulls finished while the slow handshake was pending
                    assert not slow_done.is_set()
                    assert decoder.engine_state("slow") is not trio_pd.EngineState.READY
                assert mismatched_blocks(local, [1, 2], 2) == []
                assert decoder.statistics().handshakes_succeeded == 2
            relays.cancel_scope.cancel()
