"""LoopStallMonitor: the longest batch of task steps, and the trio thread's CPU in it."""

from __future__ import annotations

import os
import sys
import time

import pytest
import trio

from trio_pd.testing import LoopStallMonitor

SCHEDSTAT = os.path.exists("/proc/thread-self/schedstat")  # (Linux with CONFIG_SCHED_INFO)


async def test_a_blocked_loop_is_measured_with_the_cpu_it_used() -> None:
    monitor = LoopStallMonitor()
    trio.lowlevel.add_instrument(monitor)
    try:
        await trio.sleep(0.001)
        time.sleep(0.03)  # blocks the loop without using the CPU  # noqa: ASYNC251
        await trio.sleep(0.001)
    finally:
        trio.lowlevel.remove_instrument(monitor)
    assert monitor.longest >= 0.03
    assert monitor.longest_cpu < monitor.longest / 2
    assert monitor.batches >= 1

    monitor.reset()
    trio.lowlevel.add_instrument(monitor)
    try:
        await trio.sleep(0.001)
        spin_until = time.thread_time() + 0.02
        while time.thread_time() < spin_until:  # busy on the trio thread
            pass
        await trio.sleep(0.001)
    finally:
        trio.lowlevel.remove_instrument(monitor)
    assert monitor.longest_cpu >= 0.02
    assert monitor.longest >= monitor.longest_cpu - 0.001  # (two clocks)


async def test_run_queue_waits_are_told_apart_from_the_threads_own_time() -> None:
    # The trio thread and a busy process share one core: in a batch that
    # spins 40 ms of wall time, the thread runs part of it and waits for the
    # core the rest, which the kernel counts as run-queue time.
    if not SCHEDSTAT:
        pytest.skip("the kernel keeps no scheduler statistics (CONFIG_SCHED_INFO)")
    saved = os.sched_getaffinity(0)
    core = min(saved)
    spin = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    busy = await trio.lowlevel.open_process([sys.executable, "-c", spin])
    monitor = LoopStallMonitor(run_queue=True)
    try:
        os.sched_setaffinity(0, {core})  # (the calling thread: trio's)
        with trio.fail_after(10):
            await trio.sleep(0.2)  # (the busy process starts and pins itself)
            trio.lowlevel.add_instrument(monitor)
            try:
                await trio.sleep(0.001)
                spin_until = time.perf_counter() + 0.04
                while time.perf_counter() < spin_until:  # busy, sharing the core
                    pass
                await trio.sleep(0.001)
            finally:
                trio.lowlevel.remove_instrument(monitor)
    finally:
        os.sched_setaffinity(0, saved)
        busy.kill()
        with trio.CancelScope(shield=True):
            await busy.wait()
        monitor.close()
    assert monitor.longest >= 0.04
    assert monitor.longest_waiting > 0.005, vars(monitor)
    # (the thread's CPU and its waits for a core make up the batch: no GIL here)
    accounted = monitor.longest_cpu + monitor.longest_waiting
    assert abs(accounted - monitor.longest) < monitor.longest / 4, vars(monitor)


async def test_without_run_queue_nothing_is_read_and_waiting_stays_zero() -> None:
    monitor = LoopStallMonitor()
    trio.lowlevel.add_instrument(monitor)
    try:
        await trio.sleep(0.001)
        time.sleep(0.01)  # noqa: ASYNC251
        await trio.sleep(0.001)
    finally:
        trio.lowlevel.remove_instrument(monitor)
    assert monitor.longest >= 0.01
    assert monitor.longest_waiting == 0.0
    assert monitor._schedstat is None
