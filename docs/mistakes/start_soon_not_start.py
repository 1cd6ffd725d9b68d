"""Common mistake: ``start_soon`` for a task that must be ready first (docs/common-mistakes.md).

A listener takes 0.1 s to bind. Started with ``start_soon``, it has not even
begun when the next line asks its port; ``await nursery.start(...)``
returns once the listener said it is ready (``task_status.started``).

Run it with ``python docs/mistakes/start_soon_not_start.py`` (mock clock: at once).
"""

from __future__ import annotations

import trio
import trio.testing

listening: set[int] = set()  # the ports something listens on


async def listener(
    port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    await trio.sleep(0.1)  # binding takes a moment
    listening.add(port)
    task_status.started(port)  # ready: nursery.start returns port
    try:
        await trio.sleep_forever()  # serve
    finally:
        listening.discard(port)


def ask(port: int) -> str:
    return "answered" if port in listening else "refused: nothing listens there yet"


async def wrong(nursery: trio.Nursery) -> str:
    nursery.start_soon(listener, 5557)  # returns at once: the task has not begun
    return ask(5557)


async def right(nursery: trio.Nursery) -> str:
    port = await nursery.start(listener, 5558)  # returns when the listener is ready
    return ask(port)


async def main() -> None:
    for name, way in (("wrong: start_soon", wrong), ("right: await nursery.start", right)):
        async with trio.open_nursery() as nursery:
            said = await way(nursery)
            print(f"-- {name}")
            print(f"   [{trio.current_time():.1f} s] a peer asked the port: {said}")
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
