"""Opening and closing: every exit path releases sockets, agents, threads."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

import trio_pd

from .conftest import FAST, kv_cache, live_threads, open_fds


async def _pull_once(producer_kv: list[torch.Tensor], consumer_kv: list[torch.Tensor]) -> None:
    async with (
        trio_pd.open_connector("p", producer_kv, config=FAST) as producer,
        trio_pd.open_connector("d", consumer_kv, config=FAST) as consumer,
    ):
        remote = producer.expose("r", [1, 2])
        await consumer.pull("r", [3, 0], remote)
        assert await producer.wait_released("r") is trio_pd.Released.READ


async def test_twenty_connectors_in_a_row_return_fds_and_threads_to_baseline() -> None:
    producer_kv, consumer_kv = kv_cache(blocks=8), kv_cache(blocks=8)
    with trio.fail_after(120):
        # Warm-up: UCX starts one process-wide thread on first use; it
        # persists by design (trio's idle worker threads are not counted).
        await _pull_once(producer_kv, consumer_kv)
        fds, threads = open_fds(), live_threads()
        for _ in range(10):  # 10 pairs = 20 connectors
            await _pull_once(producer_kv, consumer_kv)
            assert open_fds() == fds
            assert live_threads() == threads


async def test_an_error_in_the_block_propagates_as_itself_and_releases_everything() -> None:
    with trio.fail_after(30):
        await _pull_once(kv_cache(blocks=4), kv_cache(blocks=4))
        fds = open_fds()
        with pytest.raises(KeyError, match="boom"):
            async with trio_pd.open_connector("e", kv_cache(blocks=4), config=FAST):
                raise KeyError("boom")
        assert open_fds() == fds


async def test_outside_cancellation_during_a_handshake_releases_everything() -> None:
    with trio.fail_after(30):
        await _pull_once(kv_cache(blocks=4), kv_cache(blocks=4))
        fds, threads = open_fds(), live_threads()
        # A listener that accepts but never answers keeps the handshake pending.
        silent = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = silent[0].socket.getsockname()[1]
        remote = trio_pd.RemoteBlocks("mute", "127.0.0.1", port, [0], "r")
        config = trio_pd.ConnectorConfig(handshake_timeout=60.0)
        with trio.move_on_after(0.5) as scope:
            async with trio_pd.open_connector("c", kv_cache(blocks=4), config=config) as conn:
                await conn.pull("r", [0], remote)
        assert scope.cancelled_caught
        for listener in silent:
            await listener.aclose()
        assert open_fds() == fds
        assert live_threads() == threads


async def test_calls_after_close_raise_closed_resource_error() -> None:
    with trio.fail_after(30):
        async with trio_pd.open_connector("x", kv_cache(blocks=4), config=FAST) as conn:
            remote = conn.expose("r", [0])
        with pytest.raises(trio.ClosedResourceError):
            conn.expose("r2", [1])
        with pytest.raises(trio.ClosedResourceError):
            await conn.pull("q", [0], remote)
        with pytest.raises(trio.ClosedResourceError):
            await conn.wait_released("r")


async def test_waiters_are_woken_with_closed_resource_error_when_the_connector_closes() -> None:
    with trio.fail_after(30):
        silent = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = silent[0].socket.getsockname()[1]
        remote = trio_pd.RemoteBlocks("mute", "127.0.0.1", port, [0], "r")
        config = trio_pd.ConnectorConfig(handshake_timeout=60.0)
        errors: list[BaseException] = []

        async def wait_and_record(fn: object, *args: object) -> None:
            try:
                await fn(*args)  # type: ignore[operator]
            except trio.ClosedResourceError as exc:
                errors.append(exc)

        # The waiters run outside the connector's block, so the block can end
        # (closing the connector) while they wait.
        async with (
            trio.open_nursery() as nursery,
            trio_pd.open_connector("c", kv_cache(blocks=4), config=config) as conn,
        ):
            conn.expose("held", [1])
            nursery.start_soon(wait_and_record, conn.pull, "r", [0], remote)  # noqa: ASYNC111
            nursery.start_soon(wait_and_record, conn.wait_released, "held")  # noqa: ASYNC111
            await trio.testing.wait_all_tasks_blocked()
            assert conn.engine_state("mute") is trio_pd.EngineState.FETCHING
        assert len(errors) == 2
        for listener in silent:
            await listener.aclose()


async def test_an_unknown_nixl_backend_is_a_public_error() -> None:
    config = trio_pd.ConnectorConfig(nixl_backends=("NO_SUCH_BACKEND",))
    with trio.fail_after(30), pytest.raises(trio_pd.BackendError) as info:
        async with trio_pd.open_connector("x", kv_cache(blocks=4), config=config):
            pass  # pragma: no cover
    assert isinstance(info.value, trio_pd.TrioPdError)
    assert "creating NIXL backend 'NO_SUCH_BACKEND'" in str(info.value)


async def test_a_tensor_shared_by_two_regions_is_registered_once() -> None:
    # vLLM's shared-layer case: the same tensor for two layers. NIXL crashed
    # on close when it was registered twice; now it is registered once.
    with trio.fail_after(60):
        shared, own = kv_cache(regions=2, blocks=8)
        shared[3].fill_(7)
        own[3].fill_(5)
        local = kv_cache(regions=3, blocks=8)
        async with (
            trio_pd.open_connector("p", [shared, own, shared], config=FAST) as producer,
            trio_pd.open_connector("d", local, config=FAST) as consumer,
        ):
            await consumer.pull("r", [1], producer.expose("r", [3]))
        # Both connectors closed without a crash, and each region got its block.
        assert [float(t[1].unique()) for t in local] == [7.0, 5.0, 7.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_rank": 2, "tp_size": 2, "port": 6000}, r"tp_rank 2 is outside range\(2\)"),
        ({"tp_rank": 0, "tp_size": 0, "port": 6000}, "tp_size must be >= 1"),
        ({"tp_rank": 1, "tp_size": 2}, "needs an explicit base port"),
    ],
)
async def test_bad_tensor_parallel_arguments_are_value_errors(
    kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        async with trio_pd.open_connector("x", kv_cache(blocks=4), **kwargs):  # type: ignore[arg-type]
            pass  # pragma: no cover
