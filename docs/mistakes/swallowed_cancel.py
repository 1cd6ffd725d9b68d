"""Common mistake: catching ``trio.Cancelled`` and carrying on (docs/common-mistakes.md).

A fetch under a 1 s deadline gets no reply. Catching the cancellation and
returning a value hides it: the caller goes on as if nothing happened.
Clean up and let it go on instead (re-raise, or use ``finally``).

Run it with ``python docs/mistakes/swallowed_cancel.py`` (mock clock: at once).
"""

from __future__ import annotations

import trio
import trio.testing


def log(message: str) -> None:
    print(f"   [{trio.current_time() % 10:.1f} s] {message}")  # (each run starts at a 10 s mark)


async def wrong() -> str:
    try:
        await trio.sleep(10)  # waits for a reply that does not come
        return "metadata"
    except trio.Cancelled:
        log("fetch: cancelled; carries on")
        return "stale metadata"  # the cancellation ends here


async def right() -> str:
    try:
        await trio.sleep(10)  # waits for a reply that does not come
        return "metadata"
    except trio.Cancelled:
        log("fetch: cancelled; cleans up")
        raise  # (or a finally: block, which cannot forget to)


async def main() -> None:
    for name, fetch in (("wrong: except trio.Cancelled, no raise", wrong), ("right", right)):
        print(f"-- {name}")
        with trio.move_on_after(1) as deadline:
            got = await fetch()
            log(f"the caller got {got!r} and goes on")
        log(f"the deadline's scope caught its cancel: {deadline.cancelled_caught}")
        await trio.sleep(9)


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
