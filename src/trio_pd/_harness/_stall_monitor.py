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
        longest: the longest batch so far, in seconds (wall clock).
        longest_cpu: the CPU time the trio thread itself used in that batch.
            The rest of ``longest``, the thread was not running: another
            thread held the GIL, or the OS ran something else (on a small
            machine, other processes and threads take turns with it).
        batches: how many batches were measured.
    """

    def __init__(self) -> None:
        self.longest = 0.0
        self.longest_cpu = 0.0
        self.batches = 0
        self._batch_started: float | None = None
        self._cpu_started = 0.0

    def after_io_wait(self, timeout: float) -> None:
        self._batch_started = time.perf_counter()
        self._cpu_started = time.thread_time()

    def before_io_wait(self, timeout: float) -> None:
        started = self._batch_started
        if started is not None:
            took = time.perf_counter() - started
            if took > self.longest:
                self.longest = took
                self.longest_cpu = time.thread_time() - self._cpu_started
            self.batches += 1
        self._batch_started = None

    def reset(self) -> None:
        self.longest = 0.0
        self.longest_cpu = 0.0
        self.batches = 0
        self._batch_started = None
