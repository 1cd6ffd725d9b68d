"""Exposure tokens: a consumer reads only blocks a producer issued for exactly
these parameters (memory backend; the side channel is real)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_pd
from trio_pd._core._tokens import exposure_token, token_matches
from trio_pd.testing import MemoryFabric, fill_blocks, mismatched_blocks

from .conftest import kv_cache

pytest_plugins = ["trio_pd.testing.fixtures"]

SECRET = b"deployment secret, 32 bytes long"
SIGNED = trio_pd.ConnectorConfig(
    handshake_timeout=0.5, transfer_timeout=0.5, close_timeout=1.0, exposure_secret=SECRET
)


BASE: dict[str, Any] = {
    "engine_id": "p",
    "host": "10.0.0.1",
    "port": 5600,
    "incarnation": "abc",
    "tp_size": 1,
    "request_id": "r",
    "block_ids": [1, 2],
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("engine_id", "q"),
        ("host", "10.0.0.2"),
        ("port", 5601),
        ("incarnation", "abd"),
        ("tp_size", 2),
        ("request_id", "s"),
        ("block_ids", [1, 3]),
        ("block_ids", [2, 1]),
    ],
)
def test_the_token_covers_every_field(field: str, value: object) -> None:
    token = exposure_token(SECRET, **BASE)
    assert len(token) == 32
    assert token_matches(token, exposure_token(SECRET, **BASE))
    assert not token_matches(token, exposure_token(SECRET, **{**BASE, field: value}))


def test_another_secret_makes_another_token() -> None:
    other = b"another secret of 32 bytes......"
    assert not token_matches(exposure_token(SECRET, **BASE), exposure_token(other, **BASE))


def test_a_short_secret_is_refused_and_a_secret_never_shows() -> None:
    with pytest.raises(ValueError, match="exposure_secret"):
        trio_pd.ConnectorConfig(exposure_secret=b"short")
    assert SECRET.decode() not in repr(trio_pd.ConnectorConfig(exposure_secret=SECRET))


async def test_forged_parameters_fail_before_any_read(
    memory_fabric: MemoryFabric, autojump_clock: trio.testing.MockClock
) -> None:
    on_fabric = {"backend": memory_fabric.backend, "side_channel": memory_fabric.side_channel}
    with trio.fail_after(10):
        prefill_kv, local = kv_cache(blocks=16), kv_cache(blocks=16)
        async with (
            trio_pd.open_connector("p", prefill_kv, config=SIGNED, **on_fabric) as p,
            trio_pd.open_connector("d", local, config=SIGNED, **on_fabric) as d,
        ):
            fill_blocks(prefill_kv, [3, 4], seed=1)
            remote = p.expose("r", [3, 4])
            assert remote.token
            assert remote.to_kv_transfer_params()["remote_token"] == remote.token
            forgeries = {
                "other blocks (another user's KV)": attrs.evolve(remote, block_ids=(5, 6)),
                "another request id": attrs.evolve(remote, request_id="victim"),
                "another incarnation": attrs.evolve(remote, incarnation="0" * 16),
                "no token": attrs.evolve(remote, token=""),
                "another port": attrs.evolve(remote, port=remote.port + 1),
            }
            for what, forged in forgeries.items():
                with pytest.raises(trio_pd.ParamsRejectedError) as caught:
                    await d.pull("forged", [0, 1], forged)
                assert caught.value.field == "remote_token", what
                assert "'forged'" in str(caught.value), what
                assert isinstance(caught.value, ValueError)
            stats = d.statistics()
            assert (stats.handshakes_started, memory_fabric.reads) == (0, 0)
            assert memory_fabric.side_channel_requests == 0  # (not a message sent)
            await d.pull("r", [0, 1], remote)  # the real one still reads
            assert mismatched_blocks(local, [0, 1], 1) == []
            assert await p.wait_released("r") is trio_pd.Released.READ
