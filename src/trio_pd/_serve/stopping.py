"""Stopping a server: the first SIGTERM or SIGINT (or its parent's exit)
abandons start-up or starts the drain; later ones are reported and ignored."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

PARENT_POLL_INTERVAL = 0.5


class StopRequest:
    """The first SIGTERM or SIGINT (or the parent's exit): it abandons start-up,
    or starts the drain; later ones are reported and ignored."""

    def __init__(self, name: str, report: Callable[[str], None]) -> None:
        self.name = name
        self.report = report
        self.requested = trio.Event()
        self.starting = trio.CancelScope()  # (cancelled by a request during start-up)
        self.ready = False
        self._also: trio.CancelScope | None = None

    def __call__(self, reason: str) -> None:
        if self.requested.is_set():
            self.report(f"{self.name}: {reason}: already draining (within --grace)")
        elif self.ready:
            self.report(f"{self.name}: {reason}: draining")
        else:
            self.report(f"{self.name}: {reason}: start-up abandoned")
            self.starting.cancel()
            if self._also is not None:
                self._also.cancel()
        self.requested.set()

    def also_cancel(self, scope: trio.CancelScope | None) -> None:
        """A request during start-up cancels ``scope`` too (``None``: no more)."""
        self._also = scope


@asynccontextmanager
async def stop_requests(stop: StopRequest, parent_pid: int | None) -> AsyncIterator[None]:
    """Deliver SIGTERM, SIGINT and the parent's exit to ``stop`` while the body runs."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as watchers:
            watchers.start_soon(_on_signals, signals, stop)
            if parent_pid is not None:
                watchers.start_soon(_on_orphaned, parent_pid, stop)
            try:
                yield
            finally:
                watchers.cancel_scope.cancel()


async def _on_signals(signals: Any, stop: Callable[[str], None]) -> None:
    # Every signal is consumed here (none is left to re-raise at exit).
    async for signum in signals:
        stop(signal.Signals(signum).name)


async def _on_orphaned(parent_pid: int, stop: Callable[[str], None]) -> None:
    # (Nothing wakes a process when its parent exits: poll. Its orphans are
    # adopted by init or a subreaper, so the parent's pid changes.)
    while os.getppid() == parent_pid:  # noqa: ASYNC110
        await trio.sleep(PARENT_POLL_INTERVAL)
    stop(f"its parent (pid {parent_pid}) exited")
    await trio.sleep_forever()
