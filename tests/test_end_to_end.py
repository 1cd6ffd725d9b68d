"""A decoder in this process pulls from prefill engines in child processes."""

from __future__ import annotations

import json
import random

import trio

import trio_pd
from trio_pd.testing import WorkerSpec, mismatched_blocks, open_prefill_worker

from .conftest import kv_cache

SPEC = {"regions": 4, "blocks": 64, "block_shape": (16, 128), "dtype": "float16"}


async def test_pulled_blocks_match_the_producer_byte_for_byte() -> None:
    rng = random.Random(1234)
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-0", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=48)
            async with trio_pd.open_connector("decode-0", local) as decoder:
                for n in range(3):
                    count = rng.randint(1, 24)
                    remote_ids = rng.sample(range(64), count)
                    local_ids = rng.sample(range(48), count)
                    seed = rng.getrandbits(32)
                    remote = await worker.expose(f"req-{n}", remote_ids, seed)
                    result = await decoder.pull(f"dec-{n}", local_ids, remote)
                    assert result.bytes == count * 4 * 16 * 128 * 2
                    assert mismatched_blocks(local, local_ids, seed) == []
                    assert await worker.wait_released(f"req-{n}") is trio_pd.Released.READ
                stats = decoder.statistics()
                assert stats.handshakes_started == 1
                assert stats.pulls_succeeded == 3
                assert stats.engines_ready == 1
            producer = await worker.statistics()
            assert producer["exposures_released"] == 3
            assert producer["listener_requests"] == 1


async def test_kv_transfer_params_pass_through_a_proxy_unchanged() -> None:
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-proxy", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=8)
            async with trio_pd.open_connector("decode-proxy", local) as decoder:
                remote = await worker.expose("req-p", [60, 2], seed=7)
                # what a P/D proxy does: JSON through HTTP, untouched
                params = json.loads(json.dumps(remote.to_kv_transfer_params()))
                assert set(params) == {
                    "remote_engine_id",
                    "remote_host",
                    "remote_port",
                    "remote_block_ids",
                    "remote_request_id",
                    "remote_incarnation",  # trio_pd's addition: restart detection
                    "tp_size",  # vLLM's key for the producer's TP size
                    "remote_token",  # trio_pd's addition: proof of the exposure
                    "remote_exposure",  # trio_pd's addition: which exposure of the request
                }
                again = trio_pd.RemoteBlocks.from_kv_transfer_params(dict(params, extra=1))
                assert again == remote
                await decoder.pull("dec-p", [5, 3], again)
                assert mismatched_blocks(local, [5, 3], 7) == []


async def test_empty_pull_only_notifies_the_producer() -> None:
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-hit", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=8)
            async with trio_pd.open_connector("decode-hit", local) as decoder:
                remote = await worker.expose("req-hit", [1, 2, 3], seed=3)
                result = await decoder.pull("dec-hit", [], remote)
                assert result.bytes == 0
                assert all(not t.any() for t in local)
                assert await worker.wait_released("req-hit") is trio_pd.Released.READ


async def test_a_pull_in_many_chunks_through_nixls_thread_pool_reads_every_byte() -> None:
    # nixl_num_threads: UCX's thread pool copies the driver's chunks (trio_pd
    # sets split_batch_size=1 so that even a chunk merged into one descriptor
    # goes to the pool). At most 1 KiB per transfer: each 4 KiB descriptor is
    # a chunk of its own, 48 chunks, 4 of them in flight at once.
    config = trio_pd.ConnectorConfig(nixl_num_threads=2, max_bytes_per_transfer=1024)
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-mt", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=48)
            async with trio_pd.open_connector("decode-mt", local, config=config) as decoder:
                remote_ids = list(range(63, 63 - 12, -1))
                local_ids = list(range(12))
                remote = await worker.expose("req-mt", remote_ids, seed=11)
                result = await decoder.pull("dec-mt", local_ids, remote)
                assert result.bytes == 12 * 4 * 16 * 128 * 2
                assert mismatched_blocks(local, local_ids, 11) == []
                assert not any(t[12:].any() for t in local)
                assert await worker.wait_released("req-mt") is trio_pd.Released.READ
                assert decoder.statistics().transfers_posted >= 48
