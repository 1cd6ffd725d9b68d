"""A pull returns only bytes that were its request's for the whole READ (issue 28).

A READ is one-sided: once an exposure ended (expired, abandoned, read by its
consumers, the producer restarted) its blocks may hold another request's
KV, and the producer cannot refuse the READ. So a pull confirms with the
producer (``_confirm``, ``_exposures.ExposureTable.confirm``) and raises
:class:`trio_pd.ExposureEndedError` instead of returning such bytes: a late
decode, a replay to the same or another engine, an exposure that ended during
a long READ, a tensor-parallel producer whose ranks ended it. Real NIXL and
ZeroMQ on loopback, except where the in-memory backend injects a slow READ.
"""

from __future__ import annotations

import pytest
import torch
import trio

import trio_pd
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


async def test_an_exposure_that_expires_during_a_read_longer_than_its_pin_fails_the_pull() -> None:
    # The pin is 0.2 s (the producer's lease_renewal); the READ takes 0.6 s:
    # the exposure expires under it, and the confirmation sent once the READ
    # ended says so.
    fabric = MemoryFabric()
    short = _config(None, lease_initial=0.2, lease_renewal=0.2, heartbeat_interval=0.1)
    prefill_kv = kv_cache(blocks=8)
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", prefill_kv, config=short, backend=fabric.backend) as p,
            trio_pd.open_connector(
                "d", kv_cache(blocks=8), config=FAST, backend=fabric.backend
            ) as d,
        ):
            await d.pull("warm", [], p.expose("warm", []))  # (the handshake)
            fabric.faults("p").read_delay = 0.6
            remote = p.expose("slow", [1])
            with pytest.raises(trio_pd.ExposureEndedError, match="expired"):
                await d.pull("slow", [1], remote)
            assert p.statistics().exposures_expired == 1


async def test_a_read_longer_than_its_pin_is_kept_when_the_exposure_is_still_pending() -> None:
    fabric = MemoryFabric()
    prefill_kv = kv_cache(blocks=8)
    pinned_briefly = _config(None, lease_renewal=0.2, heartbeat_interval=0.1)
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector(
                "p", prefill_kv, config=pinned_briefly, backend=fabric.backend
            ) as p,
            trio_pd.open_connector(
                "d", local := kv_cache(blocks=8), config=FAST, backend=fabric.backend
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
