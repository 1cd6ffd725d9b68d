"""The producer's notification polls: collect consumers' notifications, drive the agent.

One worker thread at a time (behind its own limiter) checks the NIXL agent
for new notifications. Each check also advances the agent's UCX worker,
which consumers' READs of our memory wait for, so the pace of the checks is
a latency knob; :class:`NotificationPoller` sets it (see
:meth:`NotificationPoller.notifications`).

Trio thread only, except the worker thread, which touches NIXL, its
arguments, two :class:`threading.Event` s and the lock it holds around each
NIXL call (:attr:`NotificationPoller.calls`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from trio_pd._config import ConnectorConfig
from trio_pd._transfer._nixl._errors import nixl_call
from trio_pd._transfer._nixl._remotes import RunBlocking
from trio_pd._transfer._nixl._timer_slack import fine_timer_slack

READS_EXPECTED_FOR = 0.5
"""How long after blocks are exposed, or a notification arrives, the producer
drives its agent at full rate (``poll_interval``) before it backs off."""


class NotificationPoller:
    """Checks one NIXL agent for notifications at a pace that follows the reads.

    Args:
        agent: returns the live ``nixl_agent`` (raises ``BackendClosing`` once closed).
        config: ``poll_interval`` and ``notification_poll_interval``.
        closing: set when the backend begins closing (a poll then returns).
        run_blocking: how the backend runs a NIXL call in a thread.
    """

    def __init__(
        self,
        agent: Callable[[], Any],
        config: ConnectorConfig,
        closing: threading.Event,
        run_blocking: RunBlocking,
    ) -> None:
        self._agent = agent
        self._config = config
        self._closing = closing
        self._run_blocking = run_blocking
        self._limiter = trio.CapacityLimiter(1)
        self.calls = threading.Lock()
        """Held by the notification thread around each NIXL call: ``get_new_notifs``
        takes NIXL's writer lock, so an inline read (``_inline``), which the trio
        thread must never make wait, runs only if it can take this at once."""
        self._trio_thread = threading.current_thread()
        self._pause = config._tuning.poll_interval
        self._expecting_until = 0.0
        self._reads_expected = threading.Event()

    def expect_reads(self) -> None:
        """Poll at full rate for the next :data:`READS_EXPECTED_FOR` s (see
        :meth:`notifications`); the notification thread notices within a check."""
        self._reads_expected.set()

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        """Collect new notifications (by sending agent name), waiting up to ``wait`` s.

        The notification thread checks until some arrive or ``wait`` has
        passed. Each check also advances this agent's UCX worker: trio_pd
        runs NIXL without its progress thread (which spins a whole core per
        agent), and consumers' READs wait for our worker's progress
        (measured: a READ whose previous notification the producer has not
        processed yet waits for it, so the producer's pause between checks
        adds to a consumer's pull latency). So while exposures are pending,
        the producer keeps this going:

        * every ``poll_interval`` while reads are expected: within
          :data:`READS_EXPECTED_FOR` s of blocks being exposed
          (:meth:`expect_reads`) or of a notification arriving;
        * otherwise -- exposures nobody reads -- at pauses that double up to
          ``notification_poll_interval``, so stale exposures cost about one
          check per that interval, not one per ``poll_interval``. The first
          READ of such an exposure may wait up to that long, once.

        Raises:
            BackendError: NIXL raised.
        """
        notifs, self._pause, self._expecting_until = await self._run_blocking(
            self._limiter, self._poll_blocking, wait, self._pause, self._expecting_until
        )
        return notifs  # type: ignore[no-any-return]

    def _poll_blocking(
        self, wait: float, pause: float, expecting_until: float
    ) -> tuple[dict[str, list[bytes]], float, float]:
        """Check until notifications arrive or ``wait`` passed (a worker thread).

        Returns them, the next pause and until when reads are expected.
        """
        agent = self._agent()
        config = self._config
        fine_timer_slack()  # (a worker thread of trio's: it only makes its sleeps precise)
        now = time.monotonic()
        give_up = now + wait
        while True:
            if self._reads_expected.is_set():
                self._reads_expected.clear()
                expecting_until = now + READS_EXPECTED_FOR
            with self.calls:
                notifs: dict[str, list[bytes]] = nixl_call("get_new_notifs", agent.get_new_notifs)
            now = time.monotonic()
            if notifs:
                return notifs, config._tuning.poll_interval, now + READS_EXPECTED_FOR
            if self._closing.is_set() or now >= give_up:
                return notifs, pause, expecting_until
            if threading.current_thread() is not self._trio_thread:
                trio.from_thread.check_cancelled()
            if now < expecting_until:
                pause = config._tuning.poll_interval
            else:
                pause = min(2 * pause, config.notification_poll_interval)
            time.sleep(min(pause, give_up - now))
            now = time.monotonic()
