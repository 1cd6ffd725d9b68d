"""Inline reads: a small READ the trio thread posts itself while everything else is idle.

Most tests drive :class:`InlineReads` with the scripted agent of
``test_driver`` (the driver's seam: the NIXL calls it makes) next to a real
:class:`TransferDriver`, so that a transfer can end, fail or run on at will.
The last tests run the real path: sequential pulls through NIXL go inline,
pulls that wait together still go to the driver and are batched, and every
byte and notification arrives.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

import trio_pd
from trio_pd._backend import BackendError
from trio_pd._driver import TransferDriver
from trio_pd._inline import InlineReads
from trio_pd._jobs import Outcome
from trio_pd._nixl_notifications import NotificationPoller
from trio_pd.testing import CapturedBackends, WorkerSpec, mismatched_blocks, open_prefill_worker

from .conftest import kv_cache
from .test_driver import CONFIG, Handle, ScriptedAgent, driver, job


@asynccontextmanager
async def inline(
    agent: ScriptedAgent,
    config: trio_pd.ConnectorConfig = CONFIG,
    idle_loads: Callable[[], bool] = lambda: True,
    other_calls: threading.Lock | None = None,
) -> AsyncIterator[tuple[InlineReads, TransferDriver]]:
    other_calls = threading.Lock() if other_calls is None else other_calls
    async with driver(agent, config) as transfers:
        yield InlineReads(lambda: agent, transfers, config, idle_loads, other_calls), transfers


class Refuses(Exception):
    pass


async def test_a_small_read_while_everything_is_idle_ends_on_the_trio_thread() -> None:
    agent = ScriptedAgent()
    threads: list[threading.Thread] = []
    agent.script = lambda handle: threads.append(threading.current_thread())
    with trio.fail_after(5):
        async with inline(agent) as (reads, transfers):
            one = job([1, 2], "r1")
            assert reads.read(one)
            assert one.outcome is Outcome.DONE
            assert one.finished.is_set()
            assert one.settled.is_set()
            [handle] = agent.posted
            assert handle.released
            assert handle.notification == one.notification
            assert threads == [threading.current_thread()]
            assert (reads.posted, reads.adopted, transfers.transfers_posted) == (1, 0, 0)
            assert one.local_dlist is None  # (nothing keeps the agent alive)


async def test_a_read_still_running_after_the_spin_is_adopted_by_the_driver() -> None:
    agent = ScriptedAgent()
    running = threading.Event()

    def script(handle: Handle) -> None:
        handle.forever = running

    agent.script = script
    config = attrs.evolve(CONFIG, inline_read_spin=0.001)
    with trio.fail_after(5):
        async with inline(agent, config) as (reads, transfers):
            one = job([1], "r1")
            assert reads.read(one)
            assert not one.finished.is_set()
            assert reads.adopted == 1
            assert not transfers.idle  # (a second read now goes to the driver)
            assert not reads.read(job([2], "r2"))
            running.set()
            await one.finished.wait()
            await one.settled.wait()
            assert one.outcome is Outcome.DONE
            [handle] = agent.posted
            assert handle.released
            assert transfers.transfers_posted == 0  # (adopted, not posted again)
            await trio.testing.wait_all_tasks_blocked()
            assert transfers.idle


async def test_an_adopted_read_that_is_cancelled_ends_once_its_transfer_has_ended() -> None:
    agent = ScriptedAgent()
    running = threading.Event()
    agent.script = lambda handle: setattr(handle, "forever", running)
    config = attrs.evolve(CONFIG, inline_read_spin=0.0)
    with trio.fail_after(5):
        async with inline(agent, config) as (reads, _):
            one = job([1], "r1")
            assert reads.read(one)
            one.cancel_requested = True
            await trio.sleep(0.05)
            assert not one.finished.is_set()  # (its transfer still runs)
            running.set()
            await one.finished.wait()
            assert one.outcome is Outcome.CANCELLED
            assert agent.posted[0].released


@pytest.mark.parametrize(
    "why", ["too large", "several transfers", "driver busy", "load running", "task runnable"]
)
async def test_a_read_goes_to_the_driver_unless_everything_is_idle(why: str) -> None:
    agent = ScriptedAgent()
    busy = threading.Event()
    config = attrs.evolve(CONFIG, inline_read_bytes=8 * 4096)
    loads_idle = why != "load running"
    with trio.fail_after(5):
        async with inline(agent, config, lambda: loads_idle) as (reads, transfers):
            one = job([1, 2])
            if why == "too large":
                one = job(list(range(9)))
            elif why == "several transfers":
                one = job([1, 2], chunk=1)
            elif why == "driver busy":
                agent.script = lambda handle: setattr(handle, "forever", busy)
                transfers.submit(job([7], "other"))
                agent.script = lambda handle: None
            async with trio.open_nursery() as nursery:
                if why == "task runnable":
                    nursery.start_soon(trio.lowlevel.checkpoint)
                assert not reads.read(one)
            assert reads.posted == 0
            assert one.outcome is None
            assert one.posted == 0
            busy.set()


async def test_inline_reads_can_be_turned_off() -> None:
    agent = ScriptedAgent()
    config = attrs.evolve(CONFIG, inline_read_bytes=0)
    with trio.fail_after(5):
        async with inline(agent, config) as (reads, _):
            assert not reads.read(job([1]))


@pytest.mark.parametrize("where", ["make_prepped_xfer", "transfer", "check_xfer_state", "ERR"])
async def test_an_inline_read_that_fails_names_the_call_and_releases_its_handle(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = ScriptedAgent()
    if where == "ERR":
        agent.script = lambda handle: setattr(handle, "state", "ERR")
    else:

        def refuse(*args: object) -> None:
            raise Refuses("no route to the peer")

        monkeypatch.setattr(agent, where, refuse)
    with trio.fail_after(5):
        async with inline(agent) as (reads, transfers):
            one = job([1])
            assert reads.read(one)
            assert one.outcome is Outcome.FAILED
            assert one.settled.is_set()
            assert isinstance(one.error, BackendError)
            expected = "transfer state ERR" if where == "ERR" else where
            assert expected in str(one.error)
            assert all(handle.released for handle in agent.posted)
            assert transfers.idle


async def test_a_handle_that_cannot_be_released_is_kept_until_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent = ScriptedAgent()
    refused: list[Handle] = []

    def release(handle: Handle) -> None:
        refused.append(handle)
        raise Refuses("busy")

    monkeypatch.setattr(Handle, "release", release)
    with trio.fail_after(5):
        async with inline(agent) as (reads, _):
            one = job([1])
            assert reads.read(one)
            assert one.outcome is Outcome.DONE
            assert refused == agent.posted
            assert reads.take_stuck() == refused
            assert reads.take_stuck() == []


class NotifyingAgent(ScriptedAgent):
    """A scripted agent whose ``get_new_notifs`` stays in NIXL until ``leave`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.in_call = threading.Event()
        self.leave = threading.Event()

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.in_call.set()
        self.leave.wait()
        return {}


async def in_a_thread(
    limiter: trio.CapacityLimiter, fn: Callable[..., object], *args: object
) -> object:
    """The backend's ``run_blocking`` (without its error handling)."""
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)


async def test_no_inline_read_while_the_notification_thread_is_in_nixl() -> None:
    """``get_new_notifs`` takes NIXL's *writer* lock (the same agent: every
    connector is a producer too): the trio thread must not queue behind it."""
    agent = NotifyingAgent()
    poller = NotificationPoller(lambda: agent, CONFIG, threading.Event(), in_a_thread)
    with trio.fail_after(5):
        async with inline(agent, other_calls=poller.calls) as (reads, transfers):
            one = job([1], "r1")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(poller.notifications, 0.0)
                try:
                    assert await trio.to_thread.run_sync(agent.in_call.wait, 5)
                    taken = reads.read(one)
                finally:
                    agent.leave.set()  # (the thread cannot be cancelled)
            assert not taken  # it goes to the driver instead
            transfers.submit(one)
            await one.settled.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert reads.read(job([2], "r2"))  # (the thread has left NIXL)
            assert reads.posted == 1


async def test_the_notification_thread_waits_for_an_inline_read() -> None:
    agent = NotifyingAgent()
    agent.leave.set()
    poller = NotificationPoller(lambda: agent, CONFIG, threading.Event(), in_a_thread)
    held: list[bool] = []
    agent.script = lambda handle: held.append(poller.calls.locked())
    with trio.fail_after(5):
        async with inline(agent, other_calls=poller.calls) as (reads, _):
            assert reads.read(job([1]))
            assert held == [True]
            assert not poller.calls.locked()
            assert await poller.notifications(0.0) == {}


# ---- the real path --------------------------------------------------------------

SPEC = {"regions": 4, "blocks": 256, "block_shape": (1024,), "dtype": "float16"}


async def test_sequential_small_pulls_go_inline_and_each_is_correct() -> None:
    pulls = 40
    captured = CapturedBackends()
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-inline", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=2 * pulls, block_shape=(1024,))
            async with trio_pd.open_connector("decode-inline", local, backend=captured) as d:
                [backend] = captured.backends
                await d.pull("warm", [0], await worker.expose("warm", [0], seed=0))
                requests = [(f"req-{i}", [2 * i, 2 * i + 1], i) for i in range(pulls)]
                remotes = await worker.expose_many(requests)
                before = backend.reads_inline
                for (request_id, ids, _), remote in zip(requests, remotes, strict=True):
                    await d.pull(request_id, ids, remote)
                # Each went inline (a few may have been handed on to the driver
                # on a loaded machine: adopted, still correct).
                assert backend.reads_inline - before == pulls
                assert d.statistics().transfers_posted == backend.transfers_posted
                for request_id, ids, seed in requests:
                    assert mismatched_blocks(local, ids, seed) == []
                    assert await worker.wait_released(request_id) is trio_pd.Released.READ


async def test_with_inline_reads_off_every_pull_goes_to_the_driver() -> None:
    captured = CapturedBackends()
    config = trio_pd.ConnectorConfig(inline_read_bytes=0)
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-driver", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=16, block_shape=(1024,))
            async with trio_pd.open_connector(
                "decode-driver", local, config=config, backend=captured
            ) as d:
                for i in range(5):
                    remote = await worker.expose(f"req-{i}", [i], seed=i)
                    await d.pull(f"req-{i}", [i], remote)
                    assert mismatched_blocks(local, [i], i) == []
                assert captured.backends[0].reads_inline == 0
                assert d.statistics().transfers_posted == 5
