"""Bind and advertised addresses, IPv6 (multi-host basics on one machine)."""

from __future__ import annotations

import pytest
import trio

import trio_pd
from trio_pd.testing import fill_blocks, mismatched_blocks

from .conftest import FAST, kv_cache


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "", "*", "[::]"])
async def test_a_wildcard_bind_without_an_advertised_host_is_refused(wildcard: str) -> None:
    with pytest.raises(ValueError, match="pass advertise_host="):
        async with trio_pd.open_connector("p", kv_cache(blocks=4), host=wildcard):
            pass  # pragma: no cover


async def test_exposures_name_the_advertised_host_and_consumers_reach_it() -> None:
    with trio.fail_after(30):
        prefill_kv, local = kv_cache(blocks=8), kv_cache(blocks=8)
        async with (
            trio_pd.open_connector(
                "p", prefill_kv, host="0.0.0.0", advertise_host="127.0.0.1", config=FAST
            ) as producer,
            trio_pd.open_connector("d", local, config=FAST) as consumer,
        ):
            assert producer.address[0] == "0.0.0.0"
            fill_blocks(prefill_kv, [3], seed=4)
            remote = producer.expose("r", [3])
            assert remote.host == "127.0.0.1"
            assert remote.to_kv_transfer_params()["remote_host"] == "127.0.0.1"
            await consumer.pull("r", [3], remote)
            assert mismatched_blocks(local, [3], 4) == []


@pytest.mark.parametrize("host", ["::1", "[::1]"])
async def test_ipv6_binds_advertises_and_round_trips_through_kv_transfer_params(
    host: str,
) -> None:
    with trio.fail_after(30):
        prefill_kv, local = kv_cache(blocks=8), kv_cache(blocks=8)
        async with (
            trio_pd.open_connector("p", prefill_kv, host=host, config=FAST) as producer,
            trio_pd.open_connector("d", local, config=FAST) as consumer,
        ):
            fill_blocks(prefill_kv, [1, 2], seed=6)
            params = producer.expose("r", [1, 2]).to_kv_transfer_params()
            assert params["remote_host"] == "::1"
            remote = trio_pd.RemoteBlocks.from_kv_transfer_params(params)
            await consumer.pull("r", [5, 6], remote)
            assert mismatched_blocks(local, [5, 6], 6) == []


def test_remote_blocks_keep_ipv6_hosts_without_brackets() -> None:
    blocks = trio_pd.RemoteBlocks("p", "[fd00::7]", 5600, [1], "r")
    assert blocks.host == "fd00::7"
    params = {**blocks.to_kv_transfer_params(), "remote_host": "[fd00::7]"}
    assert trio_pd.RemoteBlocks.from_kv_transfer_params(params) == blocks
