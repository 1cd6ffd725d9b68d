"""The loop-stall floor: what a bare trio loop suffers on this machine, measured beside a storm.

Benchmark 3 reports the longest time trio_pd's loop went without polling for
I/O during a handshake storm. On a small shared machine part of that is not
trio_pd's: the OS (or the host, in a virtual machine) takes the core from a
thread in the middle of what it runs. So, in another process and at the same
moments, a trio loop that does nothing but wake every :data:`INTERVAL` s is
watched the same way:

* ``longest_batch``: the longest batch of its loop (the same
  :class:`~trio_pd.testing.LoopStallMonitor`), the CPU its thread used in it
  and how long in it the thread waited for a core (``longest_batch_waiting``:
  the kernel's run queue);
* ``longest_late``: the longest time its sleeping task woke after its deadline
  (less the usual lateness of a wake-up, the median): the longest the machine
  kept that runnable loop off a core.

The *floor* is the larger of the two: a loop doing nothing could not have
answered I/O sooner than that at that moment.

    async with open_stall_floor() as floor:
        await floor.start()
        ... the storm ...
        measured = await floor.stop()   # {"longest_batch": s, "longest_late": s, ...}

Run as a script, it is the bare loop itself: it reads ``start``/``stop``
lines on stdin and answers each on stdout (``stop`` with one JSON line).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

SCRIPT = __file__

INTERVAL = 0.0001
"""How often the bare loop's one task wakes (seconds)."""


class StallFloor:
    """The bare loop's process, as the benchmark talks to it."""

    def __init__(self, process: trio.Process) -> None:
        self._process = process
        assert process.stdout is not None
        assert process.stdin is not None
        self._stdin = process.stdin
        self._lines = _lines(process.stdout)

    async def _ask(self, command: str) -> str:
        await self._stdin.send_all(command.encode() + b"\n")
        return await anext(self._lines)

    async def start(self) -> None:
        """Start a measurement (returns once the bare loop has reset it)."""
        answer = await self._ask("start")
        assert answer == "started", answer

    async def stop(self) -> dict[str, float]:
        """End the measurement and return it (seconds; see the module docstring)."""
        measured: dict[str, float] = json.loads(await self._ask("stop"))
        return measured


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    buffer = b""
    while True:
        while b"\n" not in buffer:
            data = await stream.receive_some()
            if not data:
                raise EOFError("the bare loop's process ended")
            buffer += data
        line, buffer = buffer.split(b"\n", 1)
        yield line.decode()


@asynccontextmanager
async def open_stall_floor() -> AsyncIterator[StallFloor]:
    """Start the bare loop in a process of its own; stop it on exit."""
    process = await trio.lowlevel.open_process(
        [sys.executable, SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        floor = StallFloor(process)
        assert await anext(floor._lines) == "ready"
        yield floor
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


# ---- the bare loop (this file run as a script) ----------------------------------


async def _bare_loop() -> None:
    from trio_pd.testing import LoopStallMonitor

    monitor = LoopStallMonitor(run_queue=True)
    trio.lowlevel.add_instrument(monitor)
    late: list[float] = []
    measuring = False

    async def wake_up() -> None:
        while True:
            deadline = trio.current_time() + INTERVAL
            await trio.sleep_until(deadline)
            if measuring:
                late.append(trio.current_time() - deadline)

    stdin = trio.lowlevel.FdStream(0)
    stdout = trio.lowlevel.FdStream(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wake_up)
        await stdout.send_all(b"ready\n")
        async for line in _lines(stdin):
            if line == "start":
                monitor.reset()
                late.clear()
                measuring = True
                await stdout.send_all(b"started\n")
            elif line == "stop":
                measuring = False
                usual = statistics.median(late) if late else 0.0
                result: dict[str, Any] = {
                    "longest_batch": monitor.longest,
                    "longest_batch_cpu": monitor.longest_cpu,
                    "longest_batch_waiting": monitor.longest_waiting,
                    "longest_late": max(late, default=0.0) - usual,
                    "usual_late": usual,
                    "wake_ups": len(late),
                }
                result["floor"] = max(result["longest_batch"], result["longest_late"])
                await stdout.send_all(json.dumps(result).encode() + b"\n")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(_bare_loop)
