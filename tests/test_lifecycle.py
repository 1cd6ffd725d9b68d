"""Opening and closing: every exit path releases sockets, agents, threads."""

from __future__ import annotations

import logging
import threading
from typing import Any

import attrs
import pytest
import torch
import trio
import trio.testing

import trio_pd
import trio_pd._transfer._nixl._backend

from .conftest import FAST, assert_back_to, kv_cache, live_threads, open_fds, wait_until


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
            await assert_back_to(fds, threads)


async def test_an_error_in_the_block_propagates_as_itself_and_releases_everything() -> None:
    with trio.fail_after(30):
        await _pull_once(kv_cache(blocks=4), kv_cache(blocks=4))
        fds = open_fds()
        with pytest.raises(KeyError, match="boom"):
            async with trio_pd.open_connector("e", kv_cache(blocks=4), config=FAST):
                raise KeyError("boom")
        await assert_back_to(fds)


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
        await assert_back_to(fds, threads)


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
    # NIXL's own exception is named, not chained (see _transfer/_nixl/_errors.py).
    assert info.value.nixl_error
    assert info.value.nixl_error in str(info.value)
    assert (info.value.__cause__, info.value.__context__) == (None, None)


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


class GatedLoads:
    """A real NIXL agent whose ``add_remote_agent`` waits on a gate (a peer slow
    to answer): ``entered`` is set when a load is in the call. Open the gate to
    let the call (and every later one) through."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.removed: list[str] = []

    def add_remote_agent(self, metadata: bytes) -> Any:
        self.entered.set()
        self.gate.wait()
        return self._agent.add_remote_agent(metadata)

    def remove_remote_agent(self, name: str | bytes) -> Any:
        self.removed.append(name if isinstance(name, str) else repr(name))
        return self._agent.remove_remote_agent(name)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._agent, attribute)


@attrs.define
class Made:
    """The backends a factory made (the connector's, to look at after close)."""

    backends: list[trio_pd.NixlBackend] = attrs.field(factory=list)
    gates: list[GatedLoads] = attrs.field(factory=list)

    async def nixl(self, *args: Any) -> trio_pd.NixlBackend:
        backend = await trio_pd.NixlBackend.create(*args)
        self.backends.append(backend)
        return backend

    async def gated(self, *args: Any) -> trio_pd.NixlBackend:
        backend = await self.nixl(*args)
        gated = GatedLoads(backend.agent)
        backend._remotes._agent = lambda: gated  # the fault seam (as in test_nixl_loads)
        self.gates.append(gated)
        return backend


def assert_released(backend: trio_pd.NixlBackend, caplog: pytest.LogCaptureFixture) -> None:
    """The backend let go of its agent, remote agents and registrations; nothing was kept."""
    assert backend.agent is None
    assert backend.remote_agents_loaded == 0
    assert backend not in trio_pd._transfer._nixl._backend._KEPT_FOR_LIFE
    assert "stay registered" not in caplog.text
    assert "abandoned at its handshake's deadline" not in caplog.text


@pytest.mark.parametrize("gate_opens", ["before close", "while close waits"])
async def test_cancelling_while_a_remote_agent_loads_waits_for_the_load_and_releases_it(
    gate_opens: str, caplog: pytest.LogCaptureFixture
) -> None:
    made = Made()
    with trio.fail_after(30), caplog.at_level(logging.INFO, logger="trio_pd"):
        await _pull_once(kv_cache(blocks=4), kv_cache(blocks=4))
        fds, threads = open_fds(), live_threads()
        async with (
            trio_pd.open_connector("p", kv_cache(blocks=4), config=FAST) as p,
            trio.open_nursery() as helpers,
        ):
            remote = p.expose("r", [1])
            with trio.CancelScope() as outside:
                async with (
                    trio_pd.open_connector(
                        "d", kv_cache(blocks=4), config=FAST, backend=made.gated
                    ) as d,
                    trio.open_nursery() as nursery,
                ):
                    nursery.start_soon(d.pull, "r", [0], remote)
                    gated = made.gates[0]
                    assert await trio.to_thread.run_sync(gated.entered.wait, 20)
                    assert d.engine_state("p") is trio_pd.EngineState.LOADING
                    outside.cancel()  # the load is in NIXL, in its worker thread
                    if gate_opens == "before close":
                        gated.gate.set()
                    else:  # once the close began: d's handshake task was cancelled
                        helpers.start_soon(trio.to_thread.run_sync, _open_when, made, gated)
            assert outside.cancelled_caught
            assert_released(made.backends[0], caplog)
            # The thread unloaded what it loaded (nobody took it).
            assert gated.removed == ["p#" + remote.incarnation]
            assert (
                "abandoned when its caller was cancelled, still in add_remote_agent" in caplog.text
            )
        gated._agent = None  # (the gate, still reachable from d, holds the agent)
        await assert_back_to(fds, threads)


def _open_when(made: Made, gated: GatedLoads) -> None:
    """(A thread) open the gate once the connector's backend began closing."""
    made.backends[0]._closing.wait(20)
    gated.gate.set()


@pytest.mark.parametrize("delay_ms", [0, 1, 2, 3, 5])
async def test_cancelling_at_any_moment_of_an_ordinary_load_releases_everything(
    delay_ms: int, caplog: pytest.LogCaptureFixture
) -> None:
    # No fault: a load of a real agent, cancelled from outside 0-5 ms after the
    # handshake entered LOADING (issue 28: it was kept for the life of the process).
    made = Made()
    with trio.fail_after(30), caplog.at_level(logging.INFO, logger="trio_pd"):
        async with trio_pd.open_connector("p", kv_cache(blocks=4), config=FAST) as p:
            remote = p.expose("r", [1])
            with trio.CancelScope() as outside:
                async with (
                    trio_pd.open_connector(
                        "d", kv_cache(blocks=4), config=FAST, backend=made.nixl
                    ) as d,
                    trio.open_nursery() as nursery,
                ):
                    nursery.start_soon(d.pull, "r", [0], remote)
                    await wait_until(lambda: d.engine_state("p") is trio_pd.EngineState.LOADING, 0)
                    await trio.sleep(delay_ms / 1000)
                    outside.cancel()
            assert outside.cancelled_caught
            assert_released(made.backends[0], caplog)


async def test_a_load_still_in_nixl_after_close_timeout_is_kept_and_logged_as_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    short = attrs.evolve(FAST, close_timeout=0.5)
    made = Made()
    try:
        with trio.fail_after(30), caplog.at_level(logging.INFO, logger="trio_pd"):
            async with trio_pd.open_connector("p", kv_cache(blocks=4), config=FAST) as p:
                remote = p.expose("r", [1])
                with trio.CancelScope() as outside:
                    async with (
                        trio_pd.open_connector(
                            "d", kv_cache(blocks=4), config=short, backend=made.gated
                        ) as d,
                        trio.open_nursery() as nursery,
                    ):
                        nursery.start_soon(d.pull, "r", [0], remote)
                        assert await trio.to_thread.run_sync(made.gates[0].entered.wait, 20)
                        outside.cancel()
                        cancelled_at = trio.current_time()
                closed_after = trio.current_time() - cancelled_at
            # close waited close_timeout for the load, not longer, then kept the agent
            assert short.close_timeout <= closed_after < short.close_timeout + 1.0
            assert made.backends[0] in trio_pd._transfer._nixl._backend._KEPT_FOR_LIFE
            kept = [r.getMessage() for r in caplog.records if "stay registered" in r.getMessage()]
            assert len(kept) == 1
            assert "still in add_remote_agent for agent 'p#" in kept[0]
            assert "abandoned when its caller was cancelled), 0.5 s (close_timeout)" in kept[0]
            assert "deadline" not in kept[0]
    finally:
        for gated in made.gates:
            gated.gate.set()  # (the thread then releases what it loaded itself)


async def test_cancelling_the_close_itself_still_waits_for_the_load_and_releases_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    made = Made()
    with trio.fail_after(30), caplog.at_level(logging.INFO, logger="trio_pd"):
        async with (
            trio_pd.open_connector("p", kv_cache(blocks=4), config=FAST) as p,
            trio.open_nursery() as helpers,
        ):
            remote = p.expose("r", [1])
            with trio.CancelScope() as again, trio.CancelScope() as outside:
                async with (
                    trio_pd.open_connector(
                        "d", kv_cache(blocks=4), config=FAST, backend=made.gated
                    ) as d,
                    trio.open_nursery() as nursery,
                ):
                    nursery.start_soon(d.pull, "r", [0], remote)
                    gated = made.gates[0]
                    assert await trio.to_thread.run_sync(gated.entered.wait, 20)
                    outside.cancel()
                    again.cancel()  # (a second, outer cancellation during the close)
                    helpers.start_soon(trio.to_thread.run_sync, _open_when, made, gated)
            assert_released(made.backends[0], caplog)
