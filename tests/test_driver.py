"""The transfer driver: batching, chunking, fairness, stopping, settling.

Most tests drive :class:`TransferDriver` with a scripted agent: the driver's
one seam is the agent object it is given (the five NIXL calls it makes), so a
script can make transfers end, fail, or run forever on cue, which a real
NIXL agent on one host cannot be made to do. The last test runs the real
path: many small pulls through NIXL, batched, every byte and notification
checked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import pytest
import trio

import trio_pd
from trio_pd._core._protocol import decode_notification, encode_notification
from trio_pd._transfer._backend import BackendClosing, BackendError, TransferTimeout
from trio_pd._transfer._nixl._driver import TransferDriver
from trio_pd._transfer._nixl._jobs import Job, JobCancelled
from trio_pd.testing import WorkerSpec, mismatched_blocks, open_prefill_worker

from .conftest import kv_cache

CONFIG = trio_pd.ConnectorConfig(close_timeout=0.5, transfer_timeout=5.0)


@attrs.define(eq=False)
class Handle:
    """A scripted transfer: ``polls`` checks of PROC, then ``state``."""

    local: list[int]
    notification: bytes
    polls: int = 0
    state: str = "DONE"
    forever: threading.Event | None = None  # PROC until set
    released: bool = False

    def release(self) -> None:
        self.released = True


class ScriptedAgent:
    """The calls the driver makes, with transfers shaped by ``script(handle)``."""

    def __init__(self) -> None:
        self.posted: list[Handle] = []
        self.notifications: list[tuple[str, bytes]] = []
        self.script = lambda handle: None
        self.transfer_seconds = 0.0
        self.crash: BaseException | None = None
        self.first_post = threading.Event()
        # When set to an Event: every transfer after the first waits for it
        # (the test decides what was submitted meanwhile; no race with the clock).
        self.resume: threading.Event | None = None

    def make_prepped_xfer(
        self, op: str, local_dlist: Any, local: Any, remote_dlist: Any, remote: Any, note: bytes
    ) -> Handle:
        assert op == "READ"
        handle = Handle(np.asarray(local).tolist(), note)
        self.script(handle)
        return handle

    def transfer(self, handle: Handle) -> str:
        if self.resume is not None and self.posted:
            assert self.resume.wait(10), "the test never resumed the transfers"
        time.sleep(self.transfer_seconds)  # (on one host, posting is the copy)
        self.posted.append(handle)
        self.first_post.set()
        return "PROC"

    def check_xfer_state(self, handle: Handle) -> str:
        if self.crash is not None:
            raise self.crash
        if handle.forever is not None and not handle.forever.is_set():
            return "PROC"
        if handle.polls > 0:
            handle.polls -= 1
            return "PROC"
        return handle.state

    def send_notif(self, agent_name: str, message: bytes) -> None:
        self.notifications.append((agent_name, message))


class DriverCrash(BaseException):
    """Not an Exception: what a bug in the driver itself looks like to its thread."""


@asynccontextmanager
async def driver(
    agent: ScriptedAgent, config: trio_pd.ConnectorConfig = CONFIG, *, start: bool = True
) -> AsyncIterator[TransferDriver]:
    transfers = TransferDriver(agent, "scripted", config)
    if start:
        transfers.start()  # (else the test starts it)
    try:
        yield transfers
    finally:
        with trio.fail_after(5, shield=True):
            await transfers.stop()


async def run_to_the_end(agent: ScriptedAgent, one: Job) -> None:
    """Submit ``one`` to a fresh driver and wait until it finished."""
    with trio.fail_after(5):
        async with driver(agent) as transfers:
            transfers.submit(one)
            await one.finished.wait()


def job(
    local: list[int],
    request_id: str = "r",
    *,
    remote_dlist: object = "remote",
    chunk: int = 64,
    descriptor_bytes: int = 4096,
    timeout: float = 5.0,
) -> Job:
    indices = np.asarray(local, dtype=np.int32)
    return Job(
        "local",
        remote_dlist,
        indices,
        indices,
        "producer",
        encode_notification(request_id),
        time.monotonic() + timeout,
        chunk,
        descriptor_bytes,
    )


def timer_slack_ns(thread: threading.Thread) -> int:
    with open(f"/proc/{thread.native_id}/timerslack_ns") as f:
        return int(f.read())


async def test_the_driver_thread_sleeps_with_a_fine_timer_slack() -> None:
    """Its ``poll_interval`` sleeps end on time (Linux's default slack, 50 us,
    made a 100 us sleep 170 us); other threads keep the default."""
    agent = ScriptedAgent()
    with trio.fail_after(5):
        async with driver(agent) as transfers:
            one = job([1])
            transfers.submit(one)
            await one.finished.wait()
            [thread] = [
                t for t in threading.enumerate() if t.name == "trio_pd transfers of scripted"
            ]
            assert timer_slack_ns(thread) == 1
            assert timer_slack_ns(threading.current_thread()) > 1


async def test_small_jobs_waiting_together_go_out_as_one_read_with_one_notification() -> None:
    agent = ScriptedAgent()
    jobs = [job([2 * i, 2 * i + 1], f"req-{i}") for i in range(50)]
    other = job([200], "other", remote_dlist="another engine")
    with trio.fail_after(5):
        async with driver(agent, start=False) as transfers:
            for j in [*jobs, other]:
                transfers.submit(j)  # all waiting when the thread starts
            transfers.start()
            for j in [*jobs, other]:
                await j.finished.wait()
    assert [(j.ended, j.error) for j in jobs] == [(True, None)] * 50
    # One READ per remote agent, each of at most one chunk (64 descriptors).
    by_engine = [h for h in agent.posted if h.local != [200]]
    assert [len(h.local) for h in by_engine] == [64, 36]
    assert [i for h in by_engine for i in h.local] == list(range(100))
    names = [decode_notification(h.notification) for h in by_engine]
    assert names == [
        [(f"req-{i}", 1, 0) for i in range(32)],
        [(f"req-{i}", 1, 0) for i in range(32, 50)],
    ]
    assert len(agent.posted) == 3
    assert all(h.released for h in agent.posted)
    assert agent.notifications == []  # carried by the reads
    assert transfers.transfers_posted == 3


async def test_a_large_job_goes_in_chunks_and_notifies_after_the_last_one() -> None:
    agent = ScriptedAgent()
    agent.script = lambda handle: setattr(handle, "polls", 3)
    large = job(list(range(10)), "large", chunk=3)
    await run_to_the_end(agent, large)
    assert (large.ended, large.error) == (True, None)
    assert [h.local for h in agent.posted] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert all(h.notification == b"" for h in agent.posted)
    assert agent.notifications == [("producer", encode_notification("large"))]


async def test_a_small_job_does_not_wait_behind_a_large_one() -> None:
    # The driver posts the large job's first chunk, then waits in its second
    # (agent.resume) until the small job was submitted: so the small job
    # arrives while a chunk is in flight, whatever the machine's speed (it
    # used to race a 5 ms "copy" per chunk against the trio thread's wake-up:
    # under load the small job came 5 chunks later, measured).
    agent = ScriptedAgent()
    agent.resume = threading.Event()
    large = job(list(range(40)), "large", chunk=1, descriptor_bytes=CONFIG.max_bytes_per_transfer)
    small = job([100], "small")
    with trio.fail_after(10):
        async with driver(agent) as transfers:
            transfers.submit(large)
            await trio.to_thread.run_sync(agent.first_post.wait)
            transfers.submit(small)
            agent.resume.set()
            await small.finished.wait()
            await large.finished.wait()
    # The small job went out in the driver's next turn (one chunk of each job
    # in its queue) after the chunk that was in flight when it came: not after
    # the other 38.
    order = [h.local for h in agent.posted]
    assert order[:2] == [[0], [1]]
    assert order.index([100]) <= 3, order[:6]


async def test_a_transfer_that_cannot_be_stopped_is_kept_until_it_really_ends() -> None:
    agent = ScriptedAgent()
    stuck = threading.Event()
    agent.script = lambda handle: setattr(handle, "forever", stuck)
    cut_off = job([1, 2], "cut-off")
    with trio.fail_after(10):
        async with driver(agent) as transfers:
            transfers.submit(cut_off)
            await trio.to_thread.run_sync(agent.first_post.wait)
            started = trio.current_time()
            cut_off.cancel_requested = True
            await cut_off.finished.wait()
            # It gave up waiting after close_timeout, but did not release it.
            assert trio.current_time() - started >= CONFIG.close_timeout - 0.05
            # The error says so (the task, cancelled, re-raises trio.Cancelled instead).
            assert isinstance(cut_off.error, BackendError)
            assert "did not stop within 0.5 s of being told to (cancelled;" in str(cut_off.error)
            assert cut_off.error.peer_lost
            assert cut_off.error.settled is cut_off.settled
            assert cut_off.still_running
            [handle] = agent.posted
            assert not handle.released
            assert not cut_off.settled.is_set()
            stuck.set()  # the link is back: the transfer ends
            await cut_off.settled.wait()
            assert handle.released


async def test_an_error_stops_the_job_once_its_running_chunks_have_ended() -> None:
    agent = ScriptedAgent()

    def script(handle: Handle) -> None:
        handle.polls = 5
        if handle.local == [2, 3]:
            handle.state = "ERR"

    agent.script = script
    failing = job(list(range(20)), "failing", chunk=2)
    await run_to_the_end(agent, failing)
    assert isinstance(failing.error, BackendError)
    assert str(failing.error) == "transfer state ERR"
    assert not failing.error.peer_lost
    # At most 4 chunks run at once, so posting stopped long before the end,
    # and every posted transfer had ended (and was released) before it finished.
    assert len(agent.posted) <= 5
    assert all(h.released for h in agent.posted)
    assert agent.notifications == []


async def test_a_job_past_its_deadline_times_out() -> None:
    agent = ScriptedAgent()
    agent.script = lambda handle: setattr(handle, "polls", 10**9)  # (until released)
    late = job([1], "late", timeout=0.05)
    await run_to_the_end(agent, late)
    # A transfer that never ends is kept until stop; the job's error says so.
    assert late.still_running
    assert isinstance(late.error, BackendError)
    assert "(timed out;" in str(late.error)


async def test_a_job_stopped_at_its_deadline_ends_with_transfer_timeout() -> None:
    agent = ScriptedAgent()
    agent.transfer_seconds = 0.1  # (past the deadline while it is posted)
    agent.script = lambda handle: setattr(handle, "polls", 2)
    late = job([1], "late", timeout=0.05)
    await run_to_the_end(agent, late)
    assert isinstance(late.error, TransferTimeout)  # (the task raises this very one)
    assert not late.still_running
    assert agent.posted[0].released


async def test_a_job_its_task_cancelled_ends_with_job_cancelled_which_nobody_raises() -> None:
    agent = ScriptedAgent()
    cancelled = job([1], "cancelled")
    cancelled.cancel_requested = True
    await run_to_the_end(agent, cancelled)
    assert isinstance(cancelled.error, JobCancelled)
    assert agent.posted == []


class nixlRemoteDisconnectError(Exception):
    """A stand-in for NIXL's class (the driver knows it by its name)."""


async def test_a_nixl_error_fails_each_job_of_a_batch_with_an_error_of_its_own() -> None:
    agent = ScriptedAgent()
    agent.crash = nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")  # (in check_xfer_state)
    jobs = [job([i], f"req-{i}") for i in range(3)]
    with trio.fail_after(5):
        async with driver(agent, start=False) as transfers:
            for j in jobs:
                transfers.submit(j)  # (waiting together: one READ)
            transfers.start()
            for j in jobs:
                await j.finished.wait()
    assert len(agent.posted) == 1
    errors = [j.error for j in jobs]
    assert len({id(e) for e in errors}) == 3  # (each task raises its own)
    for error in errors:
        assert isinstance(error, BackendError)
        assert (
            str(error) == "check_xfer_state: nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT"
        )
        assert error.peer_lost
        assert (error.__cause__, error.__context__) == (None, None)


async def test_a_bug_in_the_driver_fails_every_job_instead_of_hanging_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = ScriptedAgent()
    agent.script = lambda handle: setattr(handle, "polls", 1)
    jobs = [job([i], f"req-{i}") for i in range(3)]
    with trio.fail_after(5):
        async with driver(agent) as transfers:
            agent.crash = DriverCrash("boom")
            for j in jobs:
                transfers.submit(j)
            for j in jobs:
                await j.finished.wait()
            late = job([9], "late")  # submitted after the crash: fails at once
            transfers.submit(late)
            await late.finished.wait()
    errors = [j.error for j in [*jobs, late]]
    assert all(isinstance(e, BackendError) for e in errors)
    assert {str(e) for e in errors} == {"the transfer driver crashed: DriverCrash: boom"}
    assert len({id(e) for e in errors}) == 4  # (each task raises its own)
    assert "transfer driver crashed" in caplog.text


async def test_stopping_keeps_what_still_runs_unreleased_and_unsettled() -> None:
    # Releasing a handle does not stop a transfer NIXL cannot stop: its bytes
    # would land in memory the caller believes free. So the driver keeps it.
    agent = ScriptedAgent()
    agent.script = lambda handle: setattr(handle, "forever", threading.Event())
    running = job([1], "running")
    with trio.fail_after(5):
        async with driver(agent) as transfers:
            transfers.submit(running)
            await trio.to_thread.run_sync(agent.first_post.wait)
        # (the driver stopped: closing, then close_timeout, then kept)
        await running.finished.wait()
    assert "(closing;" in str(running.error)
    assert running.still_running
    assert not running.settled.is_set()
    assert not agent.posted[0].released
    assert transfers.transfers_kept == 1


async def test_a_job_submitted_after_the_driver_stopped_ends_at_once() -> None:
    with trio.fail_after(5):
        async with driver(ScriptedAgent()) as transfers:
            pass
        late = job([1], "late")
        transfers.submit(late)
        await late.finished.wait()
        await late.settled.wait()
    assert isinstance(late.error, BackendClosing)


# ---- the real path --------------------------------------------------------------

SPEC = {"regions": 4, "blocks": 512, "block_shape": (1024,), "dtype": "float16"}


async def test_many_small_pulls_at_once_are_batched_and_each_is_correct() -> None:
    pulls = 200
    with trio.fail_after(60):
        async with open_prefill_worker(WorkerSpec("prefill-many", **SPEC)) as worker:
            local = kv_cache(regions=4, blocks=2 * pulls, block_shape=(1024,))
            async with trio_pd.open_connector("decode-many", local) as decoder:
                await decoder.pull("warm", [0], await worker.expose("warm", [0], seed=0))
                requests = [(f"req-{i}", [2 * i, 2 * i + 1], i) for i in range(pulls)]
                remotes = await worker.expose_many(requests)
                async with trio.open_nursery() as nursery:
                    for (request_id, ids, _), remote in zip(requests, remotes, strict=True):
                        nursery.start_soon(decoder.pull, request_id, ids, remote)
                stats = decoder.statistics()
                assert stats.pulls_succeeded == pulls + 1
                # Pulls that waited together shared READs (and notifications).
                assert stats.transfers_posted < pulls
                for request_id, ids, seed in requests:
                    assert mismatched_blocks(local, ids, seed) == []
                    assert await worker.wait_released(request_id) is trio_pd.Released.READ
