"""LoopStallMonitor: the longest batch of task steps, and the trio thread's CPU in it."""

from __future__ import annotations

import time

import trio

from trio_pd.testing import LoopStallMonitor


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
