"""Inline reads: a small READ the trio thread posts itself while everything else is idle.

Most tests drive :class:`InlineReads` with the scripted agent of
``test_driver`` (the driver's seam: the NIXL calls it makes) next to a real
:class:`TransferDriver`, so that a transfer can end, fail or run on at will.
The last tests run the real path: sequential pulls through NIXL go inline,
pulls that wait together still go to the driver and are batched, and every
byte and notification arrives.
"""

from __future__ import annotations

import os
import signal
import threading
import types
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import torch
import trio
import trio.testing

import trio_pd
from trio_pd._config import tuned
from trio_pd._transfer._backend import BackendError
from trio_pd._transfer._nixl import _notifications
from trio_pd._transfer._nixl._backend import NixlBackend
from trio_pd._transfer._nixl._driver import TransferDriver
from trio_pd._transfer._nixl._inline import NOT_TAKEN, InlineReads, no_task_runnable
from trio_pd._transfer._nixl._jobs import JobCancelled
from trio_pd._transfer._nixl._notifications import NotificationPoller
from trio_pd.testing import (
    CapturedBackends,
    PrefillWorker,
    WorkerSpec,
    mismatched_blocks,
    open_prefill_worker,
)

from .conftest import kv_cache, wait_until
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
            assert (one.ended, one.error) == (True, None)
            assert not hasattr(one, "finished")  # (never handed to the driver: no events)
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
    config = tuned(CONFIG, inline_read_spin=0.001)
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
            assert (one.ended, one.error) == (True, None)
            [handle] = agent.posted
            assert handle.released
            assert transfers.transfers_posted == 0  # (adopted, not posted again)
            # Its timestamps (job_observer's breakdown) are those of its posting.
            assert one.submitted_at == one.posted_at <= one.finished_at
            await trio.testing.wait_all_tasks_blocked()
            assert transfers.idle


async def test_an_adopted_read_that_is_cancelled_ends_once_its_transfer_has_ended() -> None:
    agent = ScriptedAgent()
    running = threading.Event()
    agent.script = lambda handle: setattr(handle, "forever", running)
    config = tuned(CONFIG, inline_read_spin=0.0)
    with trio.fail_after(5):
        async with inline(agent, config) as (reads, _):
            one = job([1], "r1")
            assert reads.read(one)
            one.cancel_requested = True
            await trio.sleep(0.05)
            assert not one.finished.is_set()  # (its transfer still runs)
            running.set()
            await one.finished.wait()
            assert isinstance(one.error, JobCancelled)  # (its task re-raises trio.Cancelled)
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
            assert not one.ended
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
            assert one.ended
            assert one.local_dlist is None
            assert isinstance(one.error, BackendError)
            if where == "ERR":
                assert str(one.error) == "transfer state ERR"
            else:  # (NIXL's exception, mapped: see test_nixl_errors)
                assert str(one.error) == f"{where}: Refuses: no route to the peer"
                assert one.error.nixl_error == "Refuses: no route to the peer"
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
            assert (one.ended, one.error) == (True, None)
            assert refused == agent.posted
            assert reads.take_stuck() == refused
            assert reads.take_stuck() == []


async def test_control_c_waits_until_an_inline_read_ended_or_was_adopted() -> None:
    """KeyboardInterrupt can strike any line of unprotected code; inside a read
    it would leak the running transfer's handle (neither released nor adopted)
    and leave the job unfinished. Protected, it arrives at the next checkpoint."""
    agent = ScriptedAgent()
    protected: list[bool] = []

    def script(handle: Handle) -> None:
        handle.polls = 2
        protected.append(trio.lowlevel.currently_ki_protected())

    agent.script = script
    with trio.fail_after(5):
        async with inline(agent) as (reads, _):
            assert not trio.lowlevel.currently_ki_protected()
            assert reads.read(job([1]))
            assert protected == [True]


@pytest.mark.parametrize("then", ["idle", "driver given work", "load started", "poll started"])
async def test_a_read_checked_after_a_schedule_point_goes_to_the_driver_if_the_loop_moved_on(
    then: str,
) -> None:
    """``start`` posts, the pull's task lets the others run while the READ
    runs, ``finish`` checks it. If meanwhile a task gave the driver work (its
    thread now calls NIXL too), started a load or a notification poll (NIXL's
    writer lock, which the trio thread must never wait behind), the driver
    takes the READ over."""
    agent = ScriptedAgent()
    agent.script = lambda handle: setattr(handle, "polls", 1)  # (PROC once, then DONE)
    loads_idle = True
    lock = threading.Lock()
    with trio.fail_after(5):
        async with inline(agent, idle_loads=lambda: loads_idle, other_calls=lock) as (
            reads,
            transfers,
        ):
            one = job([1], "r1")
            handle = reads.start(one)
            assert handle is not NOT_TAKEN
            assert handle is not None
            assert (reads.posted, one.ended) == (1, False)
            assert not lock.locked()  # (a poll may run meanwhile, on any thread)
            other = job([2], "r2")
            if then == "driver given work":
                transfers.submit(other)
            elif then == "load started":
                loads_idle = False
            elif then == "poll started":
                lock.acquire()
            ended_here = reads.finish(one, handle)
            assert lock.locked() is (then == "poll started")
            if then == "poll started":
                lock.release()
            if then == "idle":
                assert ended_here
                assert (one.ended, one.error, reads.adopted) == (True, None, 0)
            else:
                assert not ended_here
                assert reads.adopted == 1
                await one.finished.wait()
                assert one.error is None
                await one.settled.wait()
            assert agent.posted[0].released
            if then == "driver given work":
                await other.settled.wait()
            assert transfers.transfers_posted == (1 if then == "driver given work" else 0)


async def test_a_read_adopted_once_the_driver_stopped_is_kept_not_settled() -> None:
    """The driver stopped during the schedule point (a close, or a crash):
    nothing polls the READ any more, and NIXL cannot stop it, so the job
    ends still running, never settled, its handle kept unreleased."""
    agent = ScriptedAgent()
    running = threading.Event()
    agent.script = lambda handle: setattr(handle, "forever", running)
    try:
        with trio.fail_after(5):
            async with inline(agent) as (reads, transfers):
                one = job([1], "r1")
                handle = reads.start(one)
                assert handle is not NOT_TAKEN
                await transfers.stop()
                reads.finish(one, handle)
                await one.finished.wait()
                assert (one.still_running, one.settled.is_set()) == (True, False)
                assert isinstance(one.error, BackendError)
                assert transfers.transfers_kept == 1
                assert not agent.posted[0].released
    finally:
        running.set()


class TimedLock:
    """``other_calls``, but a blocking acquire gives up after 1 s (instead of
    hanging the test) and says so."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited_on_itself = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=1.0):
            self.waited_on_itself = True
            raise AssertionError("the trio thread waited on other_calls, held by its own task")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


async def on_the_trio_thread(limiter: trio.CapacityLimiter, fn: Any, *args: Any) -> Any:
    """A ``run_blocking`` that calls NIXL on the trio thread (benchmark 3's
    ``NixlOnEventLoop``): polls take ``other_calls`` there, blocking."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


async def test_a_poll_on_the_trio_thread_during_a_reads_schedule_point_does_not_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``other_calls`` is not held across the schedule point: a poll that runs
    then on the trio thread itself takes it (and the READ goes to the driver
    if the poll still has it)."""
    # (a poll sets its thread's timer slack: here, the test's own thread)
    monkeypatch.setattr(_notifications, "fine_timer_slack", lambda: None)
    agent = NotifyingAgent()
    agent.leave.set()
    agent.script = lambda handle: setattr(handle, "polls", 1)
    lock = TimedLock()
    poller = NotificationPoller(lambda: agent, CONFIG, threading.Event(), on_the_trio_thread)
    poller.calls = lock  # type: ignore[assignment]
    with trio.fail_after(30):
        async with inline(agent, other_calls=lock) as (reads, transfers):  # type: ignore[arg-type]
            backend = types.SimpleNamespace(
                _inline=reads, _driver=transfers, _observe=lambda job: None, job_observer=None
            )

            async def pull(i: int) -> None:
                await trio.lowlevel.checkpoint()  # (in the same batch as the poll's task)
                await NixlBackend._run_job(backend, job([i], f"r{i}"), True)  # type: ignore[arg-type]

            for i in range(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(poller.notifications, 0.0)
                    nursery.start_soon(pull, i)
                await trio.testing.wait_all_tasks_blocked()
            assert not lock.waited_on_itself
            assert reads.posted == 20


async def test_start_answers_not_taken_or_ended_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = ScriptedAgent()

    def transfer(handle: Handle) -> str:
        agent.posted.append(handle)
        return "DONE"  # (a READ that ended while it was posted)

    monkeypatch.setattr(agent, "transfer", transfer)
    lock = threading.Lock()
    with trio.fail_after(5):
        async with inline(agent, other_calls=lock) as (reads, _):
            one = job([1], "r1")
            assert reads.start(one) is None  # (DONE when posted: ended here)
            assert (one.ended, one.error, one.local_dlist) == (True, None, None)
            assert agent.posted[0].released
            assert not lock.locked()
            with lock:
                assert reads.start(job([2], "r2")) is NOT_TAKEN  # (the poller is in NIXL)
            assert reads.posted == 1


async def test_the_run_queue_check_says_what_current_statistics_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def public() -> bool:
        return trio.lowlevel.current_statistics().tasks_runnable == 0

    with trio.fail_after(5):
        assert no_task_runnable() is public() is True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.lowlevel.checkpoint)
            assert no_task_runnable() is public() is False
            # A trio that moved its run queue: the public call answers.
            with monkeypatch.context() as patched:
                patched.setattr(trio._core._run, "GLOBAL_RUN_CONTEXT", types.SimpleNamespace())
                assert no_task_runnable() is False
        assert no_task_runnable() is True


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
# A decoder's own notification thread polls now and then even with nothing
# exposed; a read made while it is in NIXL goes to the driver. Not here:
QUIET = trio_pd.ConnectorConfig(idle_notification_poll_interval=600.0)


@asynccontextmanager
async def warm_decoder(
    name: str, *, warm: bool = True
) -> AsyncIterator[tuple[PrefillWorker, list[torch.Tensor], trio_pd.Connector, NixlBackend]]:
    """A prefill worker and a decoder of 16 blocks that has pulled from it once
    (handshake done; block 0, seed 0), with the decoder's backend.
    ``warm=False``: nothing pulled yet."""
    captured = CapturedBackends()
    async with open_prefill_worker(WorkerSpec(f"prefill-{name}", **SPEC)) as worker:
        local = kv_cache(regions=4, blocks=16, block_shape=(1024,))
        async with trio_pd.open_connector(
            f"decode-{name}", local, config=QUIET, backend=captured
        ) as d:
            [backend] = captured.backends
            if warm:
                await d.pull("warm", [0], await worker.expose("warm", [0], seed=0))
            yield worker, local, d, backend


async def test_sequential_small_pulls_go_inline_and_each_is_correct() -> None:
    pulls = 40
    captured = CapturedBackends()
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-inline", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=2 * pulls, block_shape=(1024,))
            async with trio_pd.open_connector(
                "decode-inline", local, config=QUIET, backend=captured
            ) as d:
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


async def test_the_first_read_from_a_new_agent_is_the_drivers_the_next_go_inline() -> None:
    """The first READ from a newly loaded agent finishes UCX's connection
    set-up, several times a small READ's CPU: the driver's thread posts it,
    never the trio thread (a storm of first pulls kept the loop from polling
    for that long). The next small READ from it goes inline as before."""
    with trio.fail_after(60):
        async with warm_decoder("first", warm=False) as (worker, local, d, backend):
            await d.pull("first", [0], await worker.expose("first", [0], seed=0))
            assert (backend.reads_inline, backend.transfers_posted) == (0, 1)
            await d.pull("second", [1], await worker.expose("second", [1], seed=1))
            assert (backend.reads_inline, backend.transfers_posted) == (1, 2)
            for ids, seed in (([0], 0), ([1], 1)):
                assert mismatched_blocks(local, ids, seed) == []


async def test_an_inline_pull_is_a_checkpoint_confirmed_or_not() -> None:
    """An inline read that ended at once skips its own schedule point when the
    pull's confirmation waits next (that wait is the pull's): the pull as a
    whole still lets other tasks run, and a cancelled one reads nothing."""
    with trio.fail_after(60):
        async with warm_decoder("checkpoint") as (worker, local, d, backend):
            before = backend.reads_inline
            for i, confirm in enumerate((True, False, True, False), start=1):
                d._consumer.confirm_reads = confirm
                remote = await worker.expose(f"req-{i}", [i], seed=i)
                with trio.testing.assert_checkpoints():
                    await d.pull(f"req-{i}", [i], remote)
                assert mismatched_blocks(local, [i], i) == []
            assert backend.reads_inline - before == 4
            remote = await worker.expose("cancelled", [9], seed=9)
            with trio.CancelScope() as scope:
                scope.cancel()
                await d.pull("cancelled", [9], remote)
            assert scope.cancelled_caught
            assert backend.reads_inline - before == 4  # (nothing posted)


async def test_an_unconfirmed_inline_pull_lets_other_tasks_run_while_its_read_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its schedule point (a pass of trio's scheduler: the other tasks' turn)
    comes between posting the READ and checking it, while the READ runs, not
    after the READ. (A confirmed pull's schedule point is its answer's wait.)"""
    with trio.fail_after(60):
        async with warm_decoder("overlap") as (worker, local, d, backend):
            d._consumer.confirm_reads = False
            agent = backend.agent
            posting = agent.transfer
            posted = trio.Event()

            def transfer(handle: object, *args: object) -> str:
                posting(handle, *args)
                posted.set()
                return "PROC"  # (even if it ended already: checked after the others ran)

            checking = agent.check_xfer_state
            checks: list[object] = []

            def check_xfer_state(handle: object) -> str:
                checks.append(handle)
                state: str = checking(handle)
                return state

            monkeypatch.setattr(agent, "transfer", transfer)
            monkeypatch.setattr(agent, "check_xfer_state", check_xfer_state)
            # Each pass of trio's scheduler (its I/O check, between two
            # batches of tasks): how many READs were posted inline, and
            # how many checks they had had.
            passes: list[tuple[int, int]] = []

            class Passes(trio.abc.Instrument):
                def before_io_wait(self, timeout: float) -> None:
                    passes.append((backend.reads_inline, len(checks)))

            remote = await worker.expose("r1", [3, 4], seed=1)
            before = backend.reads_inline
            instrument = Passes()
            trio.lowlevel.add_instrument(instrument)
            try:
                await d.pull("r1", [3, 4], remote)
            finally:
                trio.lowlevel.remove_instrument(instrument)
            assert posted.is_set()
            # A pass came with the READ posted and not yet checked; then it was.
            assert (before + 1, 0) in passes
            assert checks
            assert mismatched_blocks(local, [3, 4], 1) == []


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


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (a signal is delivered, not obeyed, at once)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


async def test_a_read_from_a_stopped_producer_is_adopted_and_fails_within_its_deadline() -> None:
    """SIGSTOP: the READ waits for the producer's progress past the spin; the
    driver adopts it, and it ends as any read to an unreachable peer does."""
    captured = CapturedBackends()
    config = attrs.evolve(QUIET, transfer_timeout=0.5, close_timeout=0.3)
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-stopped", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=8, block_shape=(1024,))
            async with trio_pd.open_connector(
                "decode-stopped", local, config=config, backend=captured
            ) as d:
                [backend] = captured.backends
                await d.pull("warm", [0], await worker.expose("warm", [0], seed=0))
                remote = await worker.expose("r1", [1, 2], seed=1)
                before = (backend.reads_inline, backend.reads_adopted)
                os.kill(worker.process.pid, signal.SIGSTOP)
                try:
                    await wait_until(lambda: stopped(worker.process.pid))
                    try:
                        await d.pull("r1", [1, 2], remote)
                    except trio_pd.TransferError as exc:
                        error = exc
                    else:
                        pytest.skip("this UCX read a stopped process without its progress")
                    assert (backend.reads_inline, backend.reads_adopted) == (
                        before[0] + 1,
                        before[1] + 1,
                    )
                    assert (error.request_id, error.failed_block_ids) == ("r1", (1, 2))
                    assert "did not stop within 0.3 s of being told to (timed out" in str(error)
                    assert error.settled is not None
                    assert not error.settled.is_set()
                    assert d.unsettled_blocks() == {1, 2}
                    assert d.statistics().pulls_in_flight == 0
                finally:
                    os.kill(worker.process.pid, signal.SIGCONT)
                await d.wait_settled([1, 2])  # the READ ends once the producer runs
                assert d.unsettled_blocks() == frozenset()
                assert mismatched_blocks(local, [1, 2], 1) == []
                # Its agent was given up: the next pull handshakes again.
                await d.pull("r2", [3], await worker.expose("r2", [3], seed=3))
                assert mismatched_blocks(local, [3], 3) == []
                stats = d.statistics()
                assert (stats.handshakes_succeeded, stats.peers_disconnected) == (2, 1)
                assert stats.transfers_posted == backend.transfers_posted


async def test_an_inline_read_from_a_killed_producer_fails_and_the_next_pull_handshakes_again() -> (
    None
):
    captured = CapturedBackends()
    config = attrs.evolve(QUIET, handshake_timeout=2.0, transfer_timeout=5.0)
    with trio.fail_after(90):
        local = kv_cache(regions=4, blocks=8, block_shape=(1024,))
        async with trio_pd.open_connector(
            "decode-killed", local, config=config, backend=captured
        ) as d:
            [backend] = captured.backends
            async with open_prefill_worker(WorkerSpec("prefill-killed", **SPEC)) as first:
                port = first.port
                await d.pull("warm", [0], await first.expose("warm", [0], seed=0))
                remote = await first.expose("r1", [1], seed=1)
                first.kill()
                await first.process.wait()
                posted = backend.reads_inline
                with pytest.raises(trio_pd.TransferError, match="DISCONNECT") as info:
                    await d.pull("r1", [1], remote)
                assert (info.value.request_id, info.value.failed_block_ids) == ("r1", (1,))
                assert backend.reads_inline == posted + 1  # (the failed READ was inline)
                # NIXL's disconnect, mapped once (_nixl._errors): the TransferError
                # chains the BackendError, which names NIXL's error and chains nothing.
                cause = info.value.__cause__
                assert isinstance(cause, trio_pd.BackendError)
                assert cause.peer_lost
                assert cause.nixl_error.startswith("nixlRemoteDisconnectError")
                assert str(cause) in info.value.reason
                assert (cause.__cause__, cause.__context__) == (None, None)
                assert d.engine_state("prefill-killed") is trio_pd.EngineState.STALE
            async with open_prefill_worker(
                WorkerSpec("prefill-killed", port=port, **SPEC)
            ) as second:
                await d.pull("r2", [2], await second.expose("r2", [2], seed=2))
                assert mismatched_blocks(local, [2], 2) == []
            stats = d.statistics()
            assert (stats.peers_disconnected, stats.handshakes_succeeded) == (1, 2)
            assert (stats.pulls_failed, stats.pulls_in_flight) == (1, 0)
