"""Handshake attempts in flight: the queue and deadlines (no I/O), the fetch
workers and the watchdog, and the attempt's event -- on trio's mock clock."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from trio_pd._consumer._fetch_queue import AttemptQueue, AttemptRunner
from trio_pd._consumer._remote_table import _FIRST_COMPACTION, NO_ATTEMPT, AttemptDone

# --- AttemptQueue (no I/O) ---------------------------------------------------------------


def test_attempts_are_taken_in_the_order_they_started() -> None:
    queue: AttemptQueue[str] = AttemptQueue()
    for n, engine in enumerate("abc"):
        queue.add(engine, 1, deadline=10.0 + n)
    assert [queue.take(0.0), queue.take(0.0), queue.take(0.0)] == [("a", 1), ("b", 1), ("c", 1)]
    assert queue.take(0.0) is None
    assert len(queue) == 3  # (taken is still live: its fetch, then its load)


def test_ended_and_superseded_attempts_are_skipped() -> None:
    queue: AttemptQueue[str] = AttemptQueue()
    queue.add("a", 1, 10.0)
    queue.add("b", 1, 10.0)
    queue.add("c", 1, 10.0)
    queue.ended("a")
    queue.ended("b")
    queue.add("b", 2, 11.0)  # (b's next attempt)
    assert [queue.take(0.0), queue.take(0.0), queue.take(0.0)] == [("c", 1), ("b", 2), None]


def test_an_attempt_past_its_deadline_is_left_queued_for_the_watchdog() -> None:
    queue: AttemptQueue[str] = AttemptQueue()
    queue.add("a", 1, 5.0)
    queue.add("b", 1, 6.0)
    assert queue.take(5.0) == ("b", 1)  # (a's deadline is now: no fetch for it)
    assert queue.expired(5.0) == [("a", 1, True)]
    assert queue.expired(6.0) == [("b", 1, False)]  # taken: its fetch keeps the deadline


def test_each_live_attempt_expires_once_and_ended_ones_never() -> None:
    queue: AttemptQueue[str] = AttemptQueue()
    queue.add("a", 1, 1.0)
    queue.add("b", 1, 2.0)
    queue.add("c", 1, 3.0)
    queue.ended("b")
    assert queue.next_deadline() == 1.0
    assert queue.expired(0.5) == []
    assert queue.expired(10.0) == [("a", 1, True), ("c", 1, True)]
    assert queue.expired(10.0) == []


def test_with_no_attempt_left_live_nothing_is_kept() -> None:
    queue: AttemptQueue[str] = AttemptQueue()
    queue.add("a", 1, 1.0)
    queue.add("b", 1, 2.0)
    queue.ended("a")
    assert queue.next_deadline() == 1.0  # (a's entry stays while b is live)
    queue.ended("b")
    assert (len(queue), queue.waiting, queue.next_deadline()) == (0, False, math.inf)
    queue.ended("b")  # (no attempt: nothing happens)
    assert queue.take(0.0) is None


# --- AttemptRunner: workers and the watchdog --------------------------------------------


async def test_at_most_n_fetches_run_and_the_rest_fail_queued_at_their_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    started: list[str] = []
    running: list[str] = []
    most = 0
    expired: list[tuple[str, int, bool]] = []

    async def fetch(engine: str, attempt: int) -> None:
        nonlocal most
        started.append(engine)
        running.append(engine)
        most = max(most, len(running))
        await trio.sleep(1.0)
        running.remove(engine)
        runner.ended(engine)

    def on_expired(engine: str, attempt: int, queued: bool) -> None:
        expired.append((engine, attempt, queued))
        runner.ended(engine)

    async with trio.open_nursery() as nursery:
        runner = AttemptRunner[str](nursery, 2, fetch, on_expired)
        now = trio.current_time()
        for engine in "abcdefg":
            runner.start(engine, 1, now + 2.5)
    # Two at a time, one second each, in order: a, b; c, d; e and f start at
    # 2 s and are still fetching at their deadline (2.5 s): handed to
    # ``expired`` as taken; g never got a worker: handed over as queued.
    assert most == 2
    assert started == ["a", "b", "c", "d", "e", "f"]
    assert sorted(expired) == [("e", 1, False), ("f", 1, False), ("g", 1, True)]
    # (and the nursery exited: the workers and the watchdog ended on their own)


async def test_the_watchdog_ends_as_soon_as_no_attempt_is_live(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def fetch(engine: str, attempt: int) -> None:
        runner.ended(engine)  # (done at once: its deadline is an hour away)
        await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        runner = AttemptRunner[str](nursery, 8, fetch, lambda *_: None)
        started = trio.current_time()
        runner.start("a", 1, started + 3600)
    assert trio.current_time() == started  # (the nursery did not wait for the deadline's hour)


async def test_an_earlier_deadline_wakes_the_watchdog_earlier(
    autojump_clock: trio.testing.MockClock,
) -> None:
    expired: list[tuple[str, float]] = []

    async def fetch(engine: str, attempt: int) -> None:
        await trio.sleep_forever()  # (a fetch that keeps the deadline itself: never ends here)

    def on_expired(engine: str, attempt: int, queued: bool) -> None:
        expired.append((engine, trio.current_time() - start))
        runner.ended(engine)

    async with trio.open_nursery() as nursery:
        runner = AttemptRunner[str](nursery, 1, fetch, on_expired)
        start = trio.current_time()
        runner.start("late", 1, start + 10)
        await trio.sleep(1)
        runner.start("early", 1, start + 5)  # (queued behind "late": no worker for it)
        await trio.sleep(20)
        nursery.cancel_scope.cancel()
    assert expired == [("early", 5.0), ("late", 10.0)]


async def test_workers_hold_back_while_there_is_no_room_and_close_lets_them_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fetched: list[str] = []
    room = False

    async def fetch(engine: str, attempt: int) -> None:
        fetched.append(engine)
        runner.ended(engine)
        await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        runner = AttemptRunner[str](nursery, 4, fetch, lambda *_: None, room=lambda: room)
        for engine in "abc":
            runner.start(engine, 1, trio.current_time() + 60)
        await trio.sleep(1)
        assert (fetched, runner.workers_held_back) == ([], 3)
        room = True
        runner.room_made()
        await trio.sleep(1)
        assert (fetched, runner.workers_held_back) == (["a", "b", "c"], 0)
        room = False
        runner.start("d", 1, trio.current_time() + 60)
        await trio.sleep(1)
        assert runner.workers_held_back == 1
        runner.close()  # (the connector closes: the held-back worker ends)
    assert fetched == ["a", "b", "c"]


# --- AttemptDone: the attempt's event ----------------------------------------------------


async def wait_then_note(done: AttemptDone, woken: list[int], n: int) -> None:
    """A pull's wait on its attempt: ``n`` goes to ``woken`` once woken."""
    await done.wait()
    woken.append(n)


async def test_set_wakes_every_waiter_but_not_one_cancelled_meanwhile() -> None:
    done = AttemptDone()
    woken: list[int] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(wait_then_note, done, woken, n)
            async with trio.open_nursery() as doomed:
                doomed.start_soon(wait_then_note, done, woken, 99)
                await trio.testing.wait_all_tasks_blocked()
                doomed.cancel_scope.cancel()
            assert not done.is_set()
            done.set()
            done.set()  # (once only)
    assert sorted(woken) == [0, 1, 2]
    assert done.is_set()


async def test_waiters_cancelled_while_the_attempt_runs_on_are_not_kept() -> None:
    # (a client that cancels its pulls at a high rate, say: each cancelled
    # wait left its task in the list until the attempt ended)
    done = AttemptDone()
    woken: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_then_note, done, woken, -1)  # (one stays)
            for round_ in range(10):
                async with trio.open_nursery() as doomed:
                    for n in range(100):
                        doomed.start_soon(wait_then_note, done, woken, round_ * 100 + n)
                    await trio.testing.wait_all_tasks_blocked()
                    doomed.cancel_scope.cancel()
            # (white box: at most twice the first compaction's size plus a round, not 1001)
            assert len(done._waiters or []) <= 2 * _FIRST_COMPACTION + 100
            done.set()
    assert woken == [-1]


async def test_a_waiter_cancelled_then_waiting_again_is_woken_once() -> None:
    done = AttemptDone()
    woken = 0

    async def waiter() -> None:
        nonlocal woken
        with trio.move_on_after(0.01):
            await done.wait()
        await done.wait()
        woken += 1

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.05)
            await trio.testing.wait_all_tasks_blocked()
            done.set()
    assert woken == 1


async def test_waiting_on_a_set_event_is_a_checkpoint() -> None:
    assert NO_ATTEMPT.is_set()
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await NO_ATTEMPT.wait()
