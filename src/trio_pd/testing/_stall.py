"""Measure how long the trio loop goes without checking for I/O (a *stall*).

Between two waits for I/O, trio runs a batch of task steps. If one of them
blocks (a long C call on the trio thread, say), every other task -- timers,
sockets, other requests -- waits for the whole batch. :class:`LoopStallMonitor`
is a :class:`trio.abc.Instrument` that records the longest batch, so "the
loop stayed responsive" becomes a number.

    monitor = LoopStallMonitor()
    trio.lowlevel.add_instrument(monitor)
    ...
    print(monitor.longest)          # seconds
    trio.lowlevel.remove_instrument(monitor)
"""

from __future__ import annotations

import time

import trio


class LoopStallMonitor(trio.abc.Instrument):
    """Records the longest time the loop ran tasks without polling for I/O.

    Attributes:
        longest: the longest batch so far, in seconds.
        batches: how many batches were measured.
    """

    def __init__(self) -> None:
        self.longest = 0.0
        self.batches = 0
        self._batch_started: float | None = None

    def after_io_wait(self, timeout: float) -> None:
        self._batch_started = time.perf_counter()

    def before_io_wait(self, timeout: float) -> None:
        started = self._batch_started
        if started is not None:
            self.longest = max(self.longest, time.perf_counter() - started)
            self.batches += 1
        self._batch_started = None

    def reset(self) -> None:
        self.longest = 0.0
        self.batches = 0
        self._batch_started = None
