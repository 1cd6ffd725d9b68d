"""Bad input and failed handshakes: clear errors that name their subject."""

from __future__ import annotations

import pytest
import trio

import trio_pd

from .conftest import FAST, kv_cache


async def _silent_port() -> tuple[list[trio.SocketListener], int]:
    """A TCP port that accepts connections and never answers."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    return listeners, listeners[0].socket.getsockname()[1]


async def test_invalid_block_ids_are_rejected_before_anything_is_sent() -> None:
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", kv_cache(blocks=8), config=FAST) as producer,
            trio_pd.open_connector("d", kv_cache(blocks=4), config=FAST) as consumer,
        ):
            remote = producer.expose("r", [6, 7])
            with pytest.raises(ValueError, match=r"'d-1'.*2 remote"):
                await consumer.pull("d-1", [0], remote)
            with pytest.raises(ValueError, match=r"block id 4 is outside \[0, 4\)"):
                await consumer.pull("d-2", [0, 4], remote)
            with pytest.raises(ValueError, match="repeat"):
                await consumer.pull("d-3", [1, 1], remote)
            with pytest.raises(ValueError, match="expected ints"):
                await consumer.pull("d-4", [0.0, 1.0], remote)  # type: ignore[list-item]
            assert consumer.statistics().handshakes_started == 0
            # Remote ids are checked against the producer's size after the
            # handshake, still before any transfer.
            beyond = trio_pd.RemoteBlocks("p", *producer.address, [7, 8], "r")
            with pytest.raises(ValueError, match=r"remote block ids.*block id 8"):
                await consumer.pull("d-5", [0, 1], beyond)
            stats = consumer.statistics()
            assert stats.engines_ready == 1
            assert stats.pulls_succeeded == stats.pulls_failed == 0
            assert producer.statistics().exposures_pending == 1
            with pytest.raises(ValueError, match="already exposed"):
                producer.expose("r", [1])
            with pytest.raises(ValueError, match=r"block id 9 is outside"):
                producer.expose("r2", [9])


async def test_unreachable_engine_fails_every_waiter_within_the_deadline() -> None:
    listeners, port = await _silent_port()
    config = trio_pd.ConnectorConfig(handshake_timeout=0.5)
    remote = trio_pd.RemoteBlocks("mute-engine", "127.0.0.1", port, [0], "r")
    with trio.fail_after(10):
        async with trio_pd.open_connector("d", kv_cache(blocks=4), config=config) as consumer:
            errors: list[trio_pd.HandshakeError] = []

            async def pull(n: int) -> None:
                with pytest.raises(trio_pd.HandshakeError) as info:
                    await consumer.pull(f"req-{n}", [n], remote)
                errors.append(info.value)

            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for n in range(4):
                    nursery.start_soon(pull, n)
            assert trio.current_time() - started < 5  # the 0.5 s deadline, not a hang
            assert len(errors) == 4
            for error in errors:
                assert error.engine_id == "mute-engine"
                assert "within 0.5 s" in error.reason
                assert "mute-engine" in str(error)
            stats = consumer.statistics()
            assert stats.handshakes_started == stats.handshakes_failed == 1
            assert consumer.engine_state("mute-engine") is trio_pd.EngineState.BACKOFF
    for listener in listeners:
        await listener.aclose()


async def test_a_failed_engine_is_in_backoff_then_retried() -> None:
    listeners, port = await _silent_port()
    config = trio_pd.ConnectorConfig(
        handshake_timeout=0.3, backoff_initial=0.5, backoff_max=1.0, backoff_jitter=0.0
    )
    remote = trio_pd.RemoteBlocks("mute-engine", "127.0.0.1", port, [0], "r")
    with trio.fail_after(10):
        async with trio_pd.open_connector("d", kv_cache(blocks=4), config=config) as consumer:
            with pytest.raises(trio_pd.HandshakeError) as first:
                await consumer.pull("one", [0], remote)
            failed_at = trio.current_time()
            # During the backoff: the same error at once, no new handshake.
            with pytest.raises(trio_pd.HandshakeError) as fast:
                await consumer.pull("two", [0], remote)
            assert trio.current_time() - failed_at < 0.5
            assert fast.value.reason == first.value.reason
            stats = consumer.statistics()
            assert stats.handshakes_started == 1
            assert stats.pulls_rejected_in_backoff == 1
            assert stats.handshake_failures_by_cause == {"timeout": 1}
            # After it: the next pull retries (and fails again, backing off longer).
            await trio.sleep_until(failed_at + 0.5)
            with pytest.raises(trio_pd.HandshakeError):
                await consumer.pull("three", [0], remote)
            failed_again_at = trio.current_time()
            assert consumer.statistics().handshakes_started == 2
            # The second backoff is twice as long: past the first delay, still failing fast.
            await trio.sleep_until(failed_again_at + 0.6)
            with pytest.raises(trio_pd.HandshakeError):
                await consumer.pull("four", [0], remote)
            stats = consumer.statistics()
            assert (stats.handshakes_started, stats.pulls_rejected_in_backoff) == (2, 2)
    for listener in listeners:
        await listener.aclose()


async def test_a_cancelled_waiter_does_not_cancel_the_handshake_for_others() -> None:
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", kv_cache(blocks=8), config=FAST) as producer,
            trio_pd.open_connector("d", kv_cache(blocks=8), config=FAST) as consumer,
        ):
            first = producer.expose("a", [1])
            second = producer.expose("b", [2])
            with trio.move_on_after(0):  # cancelled at its first checkpoint
                await consumer.pull("cancelled", [1], first)
            assert consumer.engine_state("p") is trio_pd.EngineState.FETCHING
            await consumer.pull("survivor", [2], second)
            assert consumer.statistics().handshakes_started == 1


@pytest.mark.parametrize(
    ("consumer_kv", "consumer_config", "engine_id", "match"),
    [
        (kv_cache(blocks=4, block_shape=(8, 128)), FAST, "p", "blocks are 2048 bytes"),
        (kv_cache(regions=3, blocks=4), FAST, "p", "remote has 4 KV regions, local has 3"),
        (
            kv_cache(blocks=4),
            trio_pd.ConnectorConfig(compatibility_key="other-model"),
            "p",
            "compatibility hash mismatch",
        ),
        (kv_cache(blocks=4), FAST, "someone-else", "this is engine 'p', not 'someone-else'"),
    ],
    ids=["block-bytes", "regions", "compatibility-key", "engine-id"],
)
async def test_incompatible_engines_fail_with_the_mismatch_named(
    consumer_kv: list[object],
    consumer_config: trio_pd.ConnectorConfig,
    engine_id: str,
    match: str,
) -> None:
    with trio.fail_after(30):
        async with (
            trio_pd.open_connector("p", kv_cache(blocks=8), config=FAST) as producer,
            trio_pd.open_connector("d", consumer_kv, config=consumer_config) as consumer,  # type: ignore[arg-type]
        ):
            producer.expose("r", [1])
            remote = trio_pd.RemoteBlocks(engine_id, *producer.address, [1], "r")
            with pytest.raises(trio_pd.IncompatibleEngineError, match=match) as info:
                await consumer.pull("d-1", [0], remote)
            assert info.value.engine_id == engine_id
            # Nothing was read: the producer still holds the exposure.
            assert producer.statistics().exposures_pending == 1
            assert consumer.statistics().handshakes_failed == 1
