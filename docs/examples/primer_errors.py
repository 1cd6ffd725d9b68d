"""trio in ten minutes, 6: a failing task cancels its siblings; errors come as an ExceptionGroup.

Run it with ``python docs/examples/primer_errors.py`` (mock clock: exact times, no waiting).
"""

import trio
import trio.testing


def log(message: str) -> None:
    print(f"[{trio.current_time():.1f} s] {message}")


async def fails(name: str, seconds: float) -> None:
    await trio.sleep(seconds)
    raise ValueError(f"{name} failed")


async def fails_at_once(name: str) -> None:
    raise ValueError(f"{name} failed")  # before its first checkpoint: nothing can cancel it


async def slow() -> None:
    try:
        await trio.sleep(10)
    except trio.Cancelled:
        log("slow: cancelled, because a sibling failed")
        raise


async def main() -> None:
    try:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fails, "a", 1)
                nursery.start_soon(slow)
        except ValueError:
            log("never printed: the ValueError does not come out bare")
    except ExceptionGroup as group:
        log(f"a plain 'except ValueError' missed it: it came as {group!r}")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails_at_once, "b")
            nursery.start_soon(fails_at_once, "c")
    except* ValueError as group:
        messages = sorted(str(exc) for exc in group.exceptions)
        log(f"except* ValueError caught both: {messages}")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
