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

import os
import threading
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
        longest_waiting: with ``run_queue=True`` on Linux, how long in that
            batch the trio thread was ready to run but waited for a core
            (the kernel's run-queue time, ``/proc/<pid>/task/<tid>/schedstat``):
            the part of ``longest`` the OS, not the thread's own work, decided.
            What is left of ``longest`` after ``longest_cpu`` and this the
            thread slept: waiting for the GIL or a lock. 0.0 otherwise.
        batches: how many batches were measured.

    ``run_queue=True`` reads the trio thread's scheduler statistics at both
    ends of every batch (one ``pread`` each, a few microseconds: for
    measurements, not for a monitor left on in serving); the file is opened
    on the first batch, in the thread that runs the loop, and closed by
    ``close()`` (or when the monitor is collected). Where the kernel has
    no such file (not Linux, or schedstats compiled out) it falls back to
    ``time.thread_time`` and ``longest_waiting`` stays 0.0.
    """

    def __init__(self, *, run_queue: bool = False) -> None:
        self.longest = 0.0
        self.longest_cpu = 0.0
        self.longest_waiting = 0.0
        self.batches = 0
        self._batch_started: float | None = None
        self._cpu_started = 0.0
        self._waiting_started = 0.0
        self._run_queue = run_queue
        self._schedstat: int | None = None  # (the trio thread's file, once opened)

    def _times(self) -> tuple[float, float]:
        """(CPU seconds, run-queue seconds) of the calling (trio) thread so far."""
        if self._run_queue:
            if self._schedstat is None:
                path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
                try:
                    self._schedstat = os.open(path, os.O_RDONLY)
                except OSError:
                    self._run_queue = False
                    return time.thread_time(), 0.0
            ran, waited, _ = os.pread(self._schedstat, 128, 0).split()
            return int(ran) / 1e9, int(waited) / 1e9
        return time.thread_time(), 0.0

    def after_io_wait(self, timeout: float) -> None:
        self._batch_started = time.perf_counter()
        self._cpu_started, self._waiting_started = self._times()

    def before_io_wait(self, timeout: float) -> None:
        started = self._batch_started
        if started is not None:
            took = time.perf_counter() - started
            if took > self.longest:
                self.longest = took
                cpu, waiting = self._times()
                self.longest_cpu = cpu - self._cpu_started
                self.longest_waiting = waiting - self._waiting_started
            self.batches += 1
        self._batch_started = None

    def reset(self) -> None:
        self.longest = 0.0
        self.longest_cpu = 0.0
        self.longest_waiting = 0.0
        self.batches = 0
        self._batch_started = None

    def close(self) -> None:
        """Close the scheduler-statistics file, if open (idempotent)."""
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def __del__(self) -> None:
        self.close()
