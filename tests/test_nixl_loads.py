"""Remote-agent loads on real NIXL agents: batches, deadlines, stuck calls, release.

The NIXL backend loads the agents queued together in one worker thread, one
after the other (``TransferBackend.load_remotes``). These tests drive that
seam directly, with real agents of other engines in this process. The one
injected fault: the consumer's ``add_remote_agent`` for a chosen agent waits
on a gate (as it does towards a peer whose packets vanish, see the design
page), set through the accessor ``NixlRemotes`` reaches the agent by (one
test gates ``remove_remote_agent`` the same way).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trio_pd
from trio_pd import BackendError, LoadRequest, RemoteAgent
from trio_pd._core._layout import layout_of_tensors

from .conftest import FAST, kv_cache, wait_until

Outcome = RemoteAgent | BackendError | None


class GatedAgent:
    """A real NIXL agent whose ``add_remote_agent`` waits on a gate for chosen
    agents; records the calls made on it, and the threads they came from."""

    def __init__(self, agent: Any, names: dict[bytes, str]) -> None:
        self._agent = agent
        self._names = names  # agent metadata -> agent name
        self.gates: dict[str, threading.Event] = {}
        self.failing: set[str] = set()  # gated agents whose call then fails (TCP gave up)
        self.entered: dict[str, threading.Event] = {}
        self.added: list[str] = []
        self.removed: list[str] = []
        self.threads: set[int] = set()
        self.removing: threading.Event | None = None  # a gate for remove_remote_agent
        self.in_remove = threading.Event()
        self.refusing: dict[str, Exception] = {}  # make_connection raises these (by agent)

    def gate(self, name: str) -> None:
        self.gates[name], self.entered[name] = threading.Event(), threading.Event()

    def add_remote_agent(self, metadata: bytes) -> Any:
        name = self._names.get(metadata, "(forged)")
        self.added.append(name)
        self.threads.add(threading.get_ident())
        if name in self.gates:
            self.entered[name].set()
            self.gates[name].wait()
            if name in self.failing:
                raise RuntimeError("NIXL_ERR_BACKEND: the peer never answered")
        return self._agent.add_remote_agent(metadata)

    def make_connection(self, name: str) -> Any:
        if name in self.refusing:
            raise self.refusing[name]
        return self._agent.make_connection(name)

    def remove_remote_agent(self, name: str | bytes) -> Any:
        self.removed.append(name if isinstance(name, str) else repr(name))
        if self.removing is not None:
            self.in_remove.set()
            self.removing.wait()
        return self._agent.remove_remote_agent(name)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._agent, attribute)


@contextmanager
def opened_gates(agent: GatedAgent) -> Iterator[None]:
    """Open every gate on the way out, so no worker thread outlives the test."""
    try:
        yield
    finally:
        for gate in agent.gates.values():
            gate.set()
        if agent.removing is not None:
            agent.removing.set()


@asynccontextmanager
async def backends(
    producers: int, config: trio_pd.ConnectorConfig = FAST
) -> AsyncIterator[tuple[trio_pd.NixlBackend, GatedAgent, list[trio_pd.NixlBackend]]]:
    """A consumer backend (its agent gated) and ``producers`` producer backends."""
    made: list[trio_pd.NixlBackend] = []
    try:
        for n in range(producers + 1):
            caches = kv_cache(regions=2, blocks=8, block_shape=(64,))
            made.append(
                await trio_pd.NixlBackend.create(f"a{n}", caches, layout_of_tensors(caches), config)
            )
        consumer, others = made[0], made[1:]
        gated = GatedAgent(consumer.agent, {p.agent_metadata(): p.agent_name for p in others})
        consumer._remotes._agent = lambda: gated  # the fault seam: how it reaches its agent
        with opened_gates(gated):
            yield consumer, gated, others
    finally:
        for backend in made:
            backend.begin_close()
            await backend.aclose()


def request(
    producer: trio_pd.NixlBackend, consumer: trio_pd.NixlBackend, timeout: float
) -> LoadRequest:
    return LoadRequest(
        producer.agent_name,
        "i1",
        producer.agent_name,
        producer.agent_metadata(),
        producer.layout,
        consumer.layout,
        trio.current_time() + timeout,
    )


async def test_a_batch_loads_in_order_in_one_thread_and_reports_each_as_it_ends() -> None:
    with trio.fail_after(60):
        async with backends(3) as (consumer, agent, producers):
            a, b, c = producers
            agent.gate(b.agent_name)
            outcomes: dict[int, Outcome] = {}
            requests = [request(p, consumer, 30) for p in producers]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer.load_remotes, requests, outcomes.__setitem__)
                await trio.to_thread.run_sync(agent.entered[b.agent_name].wait)
                # A is reported while the thread is still in B's call.
                await wait_until(lambda: 0 in outcomes)
                assert list(outcomes) == [0]
                agent.gates[b.agent_name].set()
            assert list(outcomes) == [0, 1, 2]
            assert all(isinstance(o, RemoteAgent) for o in outcomes.values())
            assert agent.added == [a.agent_name, b.agent_name, c.agent_name]
            assert len(agent.threads) == 1  # one worker thread for the batch
            assert consumer.remote_agents_loaded == 3
            assert consumer.stuck_call == ""


async def test_a_load_past_its_deadline_before_its_turn_is_skipped_and_the_rest_go_on() -> None:
    with trio.fail_after(60):
        async with backends(3) as (consumer, agent, producers):
            a, b, c = producers
            agent.gate(a.agent_name)
            outcomes: dict[int, Outcome] = {}
            requests = [
                request(a, consumer, 30),
                request(b, consumer, 0.2),
                request(c, consumer, 30),
            ]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer.load_remotes, requests, outcomes.__setitem__)
                await trio.to_thread.run_sync(agent.entered[a.agent_name].wait)
                await trio.sleep_until(requests[1].deadline + 0.1)
                agent.gates[a.agent_name].set()
            assert isinstance(outcomes[0], RemoteAgent)
            assert outcomes[1] is None  # its deadline passed while A loaded: never begun
            assert isinstance(outcomes[2], RemoteAgent)
            assert agent.added == [a.agent_name, c.agent_name]
            assert consumer.remote_agents_loaded == 2


async def test_a_load_stuck_at_its_deadline_is_abandoned_and_released_when_it_returns() -> None:
    with trio.fail_after(60):
        async with backends(3) as (consumer, agent, producers):
            a, b, c = producers
            agent.gate(a.agent_name)
            outcomes: dict[int, Outcome] = {}
            requests = [
                request(a, consumer, 0.5),
                request(b, consumer, 30),
                request(c, consumer, 30),
            ]
            await consumer.load_remotes(requests, outcomes.__setitem__)  # returns at A's deadline
            assert outcomes[0] is None
            for index in (1, 2):
                error = outcomes[index]
                assert isinstance(error, BackendError)
                assert "an earlier load is stuck in add_remote_agent" in str(error)
            assert consumer.stuck_call.startswith(f"add_remote_agent for agent {a.agent_name!r}")
            # While it is stuck, a new batch fails fast too.
            more: dict[int, Outcome] = {}
            await consumer.load_remotes([request(b, consumer, 30)], more.__setitem__)
            assert isinstance(more[0], BackendError)
            agent.gates[a.agent_name].set()  # the call returns: the thread releases what it loaded
            await wait_until(lambda: consumer.stuck_call == "" and agent.removed)
            assert agent.removed == [a.agent_name]
            assert agent.added == [a.agent_name]  # B and C were never begun
            assert consumer.remote_agents_loaded == 0
            await consumer.load_remotes([request(b, consumer, 30)], more.__setitem__)
            assert isinstance(more[0], RemoteAgent)


async def test_an_abandoned_load_keeps_inline_reads_off_until_its_thread_returned() -> None:
    """Its thread holds NIXL's writer lock after its stuck call returned too
    (it releases what it loaded): trio keeps the limiter of an abandoned
    thread borrowed until the thread returns, and inline reads check that."""
    with trio.fail_after(60):
        async with backends(1) as (consumer, agent, (a,)):
            agent.gate(a.agent_name)
            agent.removing = threading.Event()
            assert consumer._remotes.idle
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes([request(a, consumer, 0.5)], outcomes.__setitem__)
            assert consumer.stuck_call
            assert not consumer._remotes.idle
            agent.gates[a.agent_name].set()  # it loads, then removes what nobody took
            assert await trio.to_thread.run_sync(agent.in_remove.wait, 10)
            await wait_until(lambda: consumer.stuck_call == "")  # (its stuck call returned)
            assert not consumer._remotes.idle  # (still in remove_remote_agent)
            agent.removing.set()
            await wait_until(lambda: consumer._remotes.idle)
            assert agent.removed == [a.agent_name]


async def test_a_cancelled_batch_abandons_its_loads_and_what_loads_late_is_released() -> None:
    with trio.fail_after(60):
        async with backends(2) as (consumer, agent, producers):
            a, b = producers
            agent.gate(a.agent_name)
            outcomes: dict[int, Outcome] = {}
            requests = [request(a, consumer, 30), request(b, consumer, 30)]
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consumer.load_remotes, requests, outcomes.__setitem__)
                    await trio.to_thread.run_sync(agent.entered[a.agent_name].wait)
                    scope.cancel()
            assert outcomes == {}  # (cancelled: nothing reported)
            assert consumer.stuck_call.startswith("add_remote_agent")
            agent.gates[a.agent_name].set()
            await wait_until(lambda: consumer.stuck_call == "" and agent.removed)
            assert agent.removed == [a.agent_name]
            assert agent.added == [a.agent_name]
            assert consumer.remote_agents_loaded == 0


async def test_the_same_agent_twice_in_a_batch_is_loaded_once_and_used_again() -> None:
    with trio.fail_after(60):
        async with backends(1) as (consumer, agent, [a]):
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes(
                [request(a, consumer, 30), request(a, consumer, 30)], outcomes.__setitem__
            )
            assert isinstance(outcomes[0], RemoteAgent)
            assert outcomes[1] is outcomes[0]
            assert agent.added == [a.agent_name]


async def read_one_block(
    consumer: trio_pd.NixlBackend, producer: trio_pd.NixlBackend, remote: RemoteAgent
) -> None:
    """READ block 0 of ``remote`` (the producer polls, so the READ completes)."""

    async def poll() -> None:
        while not await producer.notifications(0.01):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        async with consumer.lease(remote):
            one = np.array([0], np.int32)
            await consumer.read(remote, one, one, b"read")


async def test_a_stuck_load_whose_call_then_fails_is_stuck_no_longer() -> None:
    # A peer whose packets vanish: add_remote_agent blocks until TCP gives up,
    # then fails. Once it returned, loads must not fail fast any more.
    with trio.fail_after(60):
        async with backends(2) as (consumer, agent, (a, b)):
            agent.gate(a.agent_name)
            agent.failing.add(a.agent_name)
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes([request(a, consumer, 0.5)], outcomes.__setitem__)
            assert outcomes[0] is None
            assert consumer.stuck_call.startswith("add_remote_agent")
            agent.gates[a.agent_name].set()  # the call returns, with an error
            with trio.fail_after(10):
                await wait_until(lambda: consumer.stuck_call == "")
            await consumer.load_remotes([request(b, consumer, 30)], outcomes.__setitem__)
            assert isinstance(outcomes[0], RemoteAgent)


SHORT_CLOSE = attrs.evolve(FAST, close_timeout=0.5)


async def test_closing_while_a_load_is_stuck_keeps_the_agent_after_close_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every release would wait behind the stuck call (NIXL's writer lock: up
    # to 135 s towards a vanished peer): close waits close_timeout for it,
    # then keeps the agent for the life of the process and releases nothing.
    with trio.fail_after(60), caplog.at_level(logging.ERROR, logger="trio_pd"):
        async with backends(1, SHORT_CLOSE) as (consumer, agent, (a,)):
            agent.gate(a.agent_name)
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes([request(a, consumer, 0.5)], outcomes.__setitem__)
            assert consumer.stuck_call.startswith("add_remote_agent")
            consumer.begin_close()
            began = trio.current_time()
            with trio.fail_after(SHORT_CLOSE.close_timeout + 1):
                await consumer.aclose()
                await consumer.aclose()  # (idempotent)
            assert trio.current_time() - began >= SHORT_CLOSE.close_timeout
            assert consumer in trio_pd._transfer._nixl._backend._KEPT_FOR_LIFE
            assert agent.removed == []
        kept = [r.getMessage() for r in caplog.records if "stay registered" in r.getMessage()]
        assert len(kept) == 1
        assert "abandoned at its handshake's deadline), 0.5 s (close_timeout)" in kept[0]


async def test_a_stuck_load_that_returns_while_close_waits_is_released_with_the_agent() -> None:
    with trio.fail_after(60):
        async with backends(1) as (consumer, agent, (a,)):
            agent.gate(a.agent_name)
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes([request(a, consumer, 0.5)], outcomes.__setitem__)
            assert consumer.stuck_call.startswith("add_remote_agent")
            consumer.begin_close()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer.aclose)
                await trio.testing.wait_all_tasks_blocked()  # (close waits for the load)
                assert consumer.agent is not None
                agent.gates[a.agent_name].set()
            assert consumer.agent is None  # released
            assert consumer not in trio_pd._transfer._nixl._backend._KEPT_FOR_LIFE
            assert agent.removed == [a.agent_name]  # (by the load's thread, which loaded it)


class nixlRemoteDisconnectError(Exception):
    """Named as NIXL's (the backend knows NIXL's exceptions by class name)."""


async def test_a_nixl_error_fails_its_load_with_the_mapped_error_and_leaves_nothing() -> None:
    with trio.fail_after(60):
        async with backends(2) as (consumer, agent, (a, b)):
            agent.refusing[a.agent_name] = nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes(
                [request(a, consumer, 30), request(b, consumer, 30)], outcomes.__setitem__
            )
            error = outcomes[0]
            assert isinstance(error, BackendError)
            assert (
                str(error)
                == "make_connection: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"
            )
            assert error.peer_lost
            assert (error.__cause__, error.__context__) == (None, None)  # (see _nixl._errors)
            assert agent.removed == [a.agent_name]  # the half-loaded agent is removed
            assert isinstance(outcomes[1], RemoteAgent)
            assert consumer.stuck_call == ""


async def test_metadata_of_a_loaded_agent_under_another_name_unloads_nothing() -> None:
    # A hostile peer (or a forged address) replies with a loaded engine's
    # agent metadata under a name of its own: that load fails, and only it.
    with trio.fail_after(60):
        async with backends(2) as (consumer, agent, (a, b)):
            outcomes: dict[int, Outcome] = {}
            forged_a = attrs.evolve(request(a, consumer, 30), engine_id="evil", agent_name="x")
            await consumer.load_remotes(
                [request(a, consumer, 30), forged_a, request(b, consumer, 30)],
                outcomes.__setitem__,
            )
            remote_a, error, remote_b = outcomes[0], outcomes[1], outcomes[2]
            assert isinstance(error, BackendError)
            assert "metadata names agent 'a1', reply said 'x'" in str(error)
            forged_b = attrs.evolve(request(b, consumer, 30), engine_id="evil", agent_name="y")
            await consumer.load_remotes([forged_b], outcomes.__setitem__)  # (a later batch)
            assert isinstance(outcomes[0], BackendError)
            assert agent.removed == []
            assert isinstance(remote_a, RemoteAgent)
            assert isinstance(remote_b, RemoteAgent)
            await read_one_block(consumer, a, remote_a)
            await read_one_block(consumer, b, remote_b)


async def test_an_agent_name_that_is_not_utf8_fails_only_its_load_and_leaves_nothing() -> None:
    with trio.fail_after(60):
        async with backends(2) as (consumer, agent, (a, b)):
            metadata = a.agent_metadata()
            assert metadata.count(b"a1") == 1
            forged = attrs.evolve(
                request(a, consumer, 30), agent_metadata=metadata.replace(b"a1", b"\xff\xfe")
            )
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes([forged, request(b, consumer, 30)], outcomes.__setitem__)
            assert isinstance(outcomes[0], BackendError)
            assert isinstance(outcomes[1], RemoteAgent)
            assert agent.removed == [repr(b"\xff\xfe")]  # the agent it loaded is removed
            assert consumer.stuck_call == ""


async def test_an_agent_retired_while_a_load_is_stuck_is_unloaded_once_it_returns() -> None:
    # The unload would queue behind the stuck call (one limiter): it waits for
    # the next chance instead, and is not forgotten.
    with trio.fail_after(60):
        async with backends(3) as (consumer, agent, (a, b, c)):
            outcomes: dict[int, Outcome] = {}
            await consumer.load_remotes([request(a, consumer, 30)], outcomes.__setitem__)
            remote_a = outcomes[0]
            assert isinstance(remote_a, RemoteAgent)
            agent.gate(b.agent_name)
            await consumer.load_remotes([request(b, consumer, 0.5)], outcomes.__setitem__)
            assert consumer.stuck_call.startswith("add_remote_agent")
            await consumer.retire(remote_a)  # (its engine restarted, say)
            agent.gates[b.agent_name].set()
            await wait_until(lambda: consumer.stuck_call == "")
            await consumer.load_remotes([request(c, consumer, 30)], outcomes.__setitem__)
            assert isinstance(outcomes[0], RemoteAgent)
            assert sorted(agent.removed) == [a.agent_name, b.agent_name]
            assert [r.agent_name for r in consumer.remote_agents()] == [c.agent_name]


async def test_a_load_not_taken_when_cancelled_is_unloaded_once_the_stuck_one_returns() -> None:
    with trio.fail_after(60):
        async with backends(2) as (consumer, agent, (a, b)):
            agent.gate(a.agent_name)
            agent.gate(b.agent_name)
            outcomes: dict[int, Outcome] = {}
            requests = [request(a, consumer, 30), request(b, consumer, 30)]
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(consumer.load_remotes, requests, outcomes.__setitem__)
                    await trio.to_thread.run_sync(agent.entered[a.agent_name].wait)
                    agent.gates[a.agent_name].set()
                    # Block the trio thread until A ended and the thread is in B's
                    # call, so A is not taken before the cancellation.
                    assert agent.entered[b.agent_name].wait(30)
                    scope.cancel()
            assert outcomes == {}
            assert consumer.stuck_call.startswith(f"add_remote_agent for agent {b.agent_name!r}")
            agent.gates[b.agent_name].set()
            await wait_until(lambda: consumer.stuck_call == "")
            await consumer.load_remotes([], outcomes.__setitem__)  # (the next chance)
            assert sorted(agent.removed) == [a.agent_name, b.agent_name]
            assert consumer.remote_agents_loaded == 0
