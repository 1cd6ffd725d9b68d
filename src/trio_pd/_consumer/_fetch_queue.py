"""Handshake attempts in flight: a few fetch workers and one watchdog, not a task each.

A storm of handshakes -- a decoder's first pull to a thousand engines at
once -- starts an attempt per engine, but only ``max_concurrent_fetches``
of them can fetch at a time, and the rest wait. A trio task per attempt
would hold its frames, cancel scopes and a place in a limiter's queue for
the whole wait (kilobytes per engine, the decoder's memory high-water mark);
here a waiting attempt is one entry in a queue and one in a heap of deadlines.

:class:`AttemptQueue` is the bookkeeping (no I/O): attempts waiting for a
fetch worker, in the order they started, and every live attempt's
deadline. :class:`AttemptRunner` is the trio shell: it starts fetch workers
(at most ``max_concurrent_fetches``) and one watchdog task in the
connector's nursery when there is work, and each ends when there is none
left, so an idle connector runs none of them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import trio

E = TypeVar("E", bound=Hashable)
"""A remote engine (``RemoteEngine`` in the connector); an attempt is
``(engine, attempt number)``."""


class AttemptQueue(Generic[E]):
    """The live handshake attempts, at most one per engine (no I/O).

    An attempt is *live* from :meth:`add` until :meth:`ended` (or a later
    attempt of the same engine is added). While live it is *queued* until
    :meth:`take` hands it to a fetch worker (in the order they started),
    and *taken* after. :meth:`expired` hands out each live attempt once its
    deadline has passed, saying whether it was still queued.
    """

    def __init__(self) -> None:
        # One (deadline, order, engine, attempt) tuple per attempt, in both.
        self._queued: deque[tuple[float, int, E, int]] = deque()
        self._taken: dict[E, int] = {}
        self._live: dict[E, int] = {}
        self._deadlines: list[tuple[float, int, E, int]] = []  # a heap
        self._order = itertools.count()  # (ties: no engine comparisons)

    def __len__(self) -> int:
        """Live attempts."""
        return len(self._live)

    @property
    def waiting(self) -> bool:
        """Whether attempts are queued (some may have ended since)."""
        return bool(self._queued)

    def add(self, engine: E, attempt: int, deadline: float) -> None:
        """``engine``'s attempt ``attempt`` started: queue it for a fetch worker,
        and watch ``deadline``."""
        self._live[engine] = attempt
        entry = (deadline, next(self._order), engine, attempt)
        self._queued.append(entry)
        heapq.heappush(self._deadlines, entry)

    def is_live(self, engine: E, attempt: int) -> bool:
        return self._live.get(engine) == attempt

    def take(self, now: float) -> tuple[E, int] | None:
        """The first queued attempt still live and before its deadline (now
        *taken*), or ``None``. One whose deadline is ``now`` or earlier stays
        queued, for :meth:`expired`."""
        while self._queued:
            deadline, _, engine, attempt = self._queued.popleft()
            if self.is_live(engine, attempt) and deadline > now:
                self._taken[engine] = attempt
                return engine, attempt
        return None

    def ended(self, engine: E) -> None:
        """``engine``'s live attempt ended (or there was none). With no attempt
        left live, the queue and the deadlines are dropped."""
        self._live.pop(engine, None)
        self._taken.pop(engine, None)
        if not self._live:
            self._queued.clear()
            self._deadlines.clear()

    def next_deadline(self) -> float:
        """The earliest deadline still watched (``inf`` when none)."""
        return self._deadlines[0][0] if self._deadlines else math.inf

    def expired(self, now: float) -> list[tuple[E, int, bool]]:
        """``(engine, attempt, queued)`` of each live attempt whose deadline is
        ``now`` or earlier, in deadline order; ``queued``: no fetch worker
        took it. Each is handed out once (the caller ends it, or leaves it to
        its fetch)."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, engine, attempt = heapq.heappop(self._deadlines)
            if self.is_live(engine, attempt):
                due.append((engine, attempt, self._taken.get(engine) != attempt))
        return due

    def clear(self) -> None:
        """Forget every attempt (the connector closed)."""
        self._live.clear()
        self._taken.clear()
        self._queued.clear()
        self._deadlines.clear()


class AttemptRunner(Generic[E]):
    """Fetches the live attempts on a few worker tasks; fails each at its deadline.

    Owns an :class:`AttemptQueue`, the fetch workers (at most ``workers`` at
    once) and the watchdog task, all started in ``nursery`` when needed;
    a worker ends when the queue is empty, the watchdog when no attempt is
    live (or at the connector's close: its nursery cancels them).

    Args:
        nursery: where the workers and the watchdog run (the connector's).
        workers: the most fetches at once (``max_concurrent_fetches``).
        fetch: fetches one attempt and acts on the reply (it must not wait
            for the attempt's end: the worker moves on when it returns).
        expired: called by the watchdog for a live attempt at its deadline,
            with whether it was still queued for a worker; it must end the
            attempt, or leave it to the fetch under way (which keeps the
            same deadline itself and says why it failed).
        room: whether a worker may start a fetch now; while it says no, the
            workers wait (queued attempts stay queued, their deadlines run
            on) until :meth:`room_made`.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        workers: int,
        fetch: Callable[[E, int], Awaitable[None]],
        expired: Callable[[E, int, bool], None],
        *,
        room: Callable[[], bool] = lambda: True,
    ) -> None:
        self._nursery = nursery
        self._max_workers = workers
        self._fetch = fetch
        self._expired = expired
        self._room = room
        self._held_back = trio.lowlevel.ParkingLot()
        self.queue: AttemptQueue[E] = AttemptQueue()
        self._workers = 0
        self._watching = False
        self._watch: trio.CancelScope | None = None

    def start(self, engine: E, attempt: int, deadline: float) -> None:
        """Queue ``engine``'s new attempt for a fetch worker, watching ``deadline``."""
        self.queue.add(engine, attempt, deadline)
        if not self._watching:
            self._watching = True
            self._nursery.start_soon(self._watch_deadlines)
        elif self._watch is not None and deadline < self._watch.deadline:
            self._watch.deadline = deadline
        if self._workers < self._max_workers:
            self._workers += 1
            self._nursery.start_soon(self._fetch_worker)

    def ended(self, engine: E) -> None:
        """``engine``'s live attempt ended (no-op if none)."""
        self.queue.ended(engine)
        if not self.queue and self._watch is not None:
            self._watch.cancel()  # (nothing left to watch: the watchdog ends)

    def room_made(self) -> None:
        """``room`` may say yes again: the workers held back look."""
        self._held_back.unpark_all()

    @property
    def workers_held_back(self) -> int:
        """Fetch workers waiting for ``room``."""
        return self._held_back.statistics().tasks_waiting

    def close(self) -> None:
        """Forget every attempt; the workers and the watchdog end at their next turn."""
        self.queue.clear()
        self._held_back.unpark_all()
        if self._watch is not None:
            self._watch.cancel()

    async def _fetch_worker(self) -> None:
        """A fetch worker: fetches queued attempts one after the other, in
        order, until none is queued (waiting while ``room`` says no)."""
        try:
            while self.queue.waiting:
                if not self._room():
                    await self._held_back.park()
                    continue
                item = self.queue.take(trio.current_time())
                if item is None:
                    return
                await self._fetch(*item)
        finally:
            self._workers -= 1

    async def _watch_deadlines(self) -> None:
        """The watchdog: at each live attempt's deadline, hands it to ``expired``;
        ends once no attempt is live."""
        try:
            while (deadline := self.queue.next_deadline()) < math.inf:
                with trio.CancelScope(deadline=deadline) as self._watch:
                    await trio.sleep_forever()
                self._watch = None
                for engine, attempt, queued in self.queue.expired(trio.current_time()):
                    self._expired(engine, attempt, queued)
        finally:
            self._watch = None
            self._watching = False
