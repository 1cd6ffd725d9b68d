"""trio in ten minutes, 2: ``start`` waits until the task is ready, ``start_soon`` does not.

Run it with ``python docs/examples/primer_start.py`` (mock clock: exact times, no waiting).
"""

import trio
import trio.testing


def log(message: str) -> None:
    print(f"[{trio.current_time():.1f} s] {message}")


async def server(
    name: str, bind_seconds: float, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    await trio.sleep(bind_seconds)  # stands in for binding a socket
    log(f"{name} is listening")
    task_status.started(f"{name}'s address")  # start() returns this
    await trio.sleep_forever()  # serve until cancelled


async def main() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server, "server-1", 2)
        log("start_soon returned at once: server-1 is not listening yet")
        address = await nursery.start(server, "server-2", 1)
        log(f"start returned {address!r}: server-2 is listening now")
        await trio.sleep(1.5)
        nursery.cancel_scope.cancel()  # stop every task of the nursery
        log("cancelled the nursery's scope")
    log("the nursery is closed: both servers were cancelled")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
