"""trio in ten minutes, 1: a nursery owns its tasks (docs/trio-primer.md).

Run it with ``python docs/examples/primer_nursery.py``. Like every primer
script it runs on trio's mock clock, which jumps ahead whenever every task
sleeps: the times it prints are exact and it ends at once.
"""

import trio
import trio.testing


def log(message: str) -> None:
    print(f"[{trio.current_time():.1f} s] {message}")


async def worker(name: str, seconds: float) -> None:
    await trio.sleep(seconds)
    log(f"{name} done")


async def main() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker, "a", 1)
        nursery.start_soon(worker, "b", 2)
        log("the body is done; the nursery now waits for its tasks")
    log("the nursery is closed: a and b have finished")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
