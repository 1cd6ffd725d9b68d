"""trio in ten minutes, 7: checkpoints, and a call that has none (docs/trio-primer.md).

The bug trio_pd was written against: a handshake that blocks the event loop.
A decode loop steps every 10 ms while a 0.5 s handshake runs three ways --
called on the trio thread, sliced by checkpoints, and in a worker thread --
and ``trio_pd.testing.LoopStallMonitor`` (a ``trio.abc.Instrument``) measures
the longest time the loop went without looking at I/O.

Run it with ``python docs/examples/primer_blocking.py`` (about 2 s, real time:
the mock clock cannot see a blocked thread).
"""

import time
from collections.abc import Awaitable, Callable

import trio

from trio_pd.testing import LoopStallMonitor

HANDSHAKE = 0.5  # seconds of blocking work (the seed's took about 2 s)
SLICES = 10


def blocking_handshake(seconds: float = HANDSHAKE) -> None:
    time.sleep(seconds)  # stands in for a blocking socket call or a C library


async def on_the_trio_thread() -> None:
    blocking_handshake()  # no await: no checkpoint for 0.5 s


async def sliced_by_checkpoints() -> None:
    for _ in range(SLICES):
        blocking_handshake(HANDSHAKE / SLICES)
        await trio.lowlevel.checkpoint()  # here trio may run other tasks


async def in_a_worker_thread(limiter: trio.CapacityLimiter) -> None:
    await trio.to_thread.run_sync(blocking_handshake, limiter=limiter)


async def measure(name: str, handshake: Callable[[], Awaitable[None]]) -> None:
    monitor = LoopStallMonitor()
    steps = 0

    async def decode_loop() -> None:
        nonlocal steps
        while True:
            await trio.sleep(0.01)  # one decode step
            steps += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(decode_loop)
        await trio.sleep(0.05)  # the decode loop is under way
        trio.lowlevel.add_instrument(monitor)
        await trio.lowlevel.checkpoint()  # (the monitor's first batch starts)
        steps = 0
        await handshake()
        during = steps
        await trio.lowlevel.checkpoint()  # (the monitor's last batch ends)
        trio.lowlevel.remove_instrument(monitor)
        nursery.cancel_scope.cancel()
    # What is printed does not depend on the machine's speed: a blocking call
    # stalls the loop for at least its length; sliced, the decode loop can step
    # at most once per checkpoint (each slice outlasts a step); in a thread it
    # steps every 10 ms (about 45 times), far more than that bound.
    print(f"-- {name}")
    print(f"   the loop stood still for the whole handshake: {monitor.longest >= HANDSHAKE}")
    if during == 0:
        words = "0"
    elif during <= SLICES + 1:
        words = "at most one per checkpoint"
    else:
        words = f"more than {SLICES + 1}"
    print(f"   decode steps while it ran: {words}")


async def main() -> None:
    limiter = trio.CapacityLimiter(1)  # one blocking handshake at a time
    await measure("called on the trio thread", on_the_trio_thread)
    await measure("sliced by ten checkpoints", sliced_by_checkpoints)
    await measure("in a worker thread", lambda: in_a_worker_thread(limiter))


if __name__ == "__main__":
    trio.run(main)
