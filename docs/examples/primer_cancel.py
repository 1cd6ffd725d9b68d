"""trio in ten minutes, 3: cancel scopes, ``move_on_after`` and ``fail_after``.

Run it with ``python docs/examples/primer_cancel.py`` (mock clock: exact times, no waiting).
"""

import trio
import trio.testing


def log(message: str) -> None:
    print(f"[{trio.current_time():.1f} s] {message}")


async def main() -> None:
    with trio.move_on_after(1) as scope:
        await trio.sleep(5)
        log("never printed")
    log(f"move_on_after(1) moved on; cancelled_caught={scope.cancelled_caught}")

    try:
        with trio.fail_after(1):
            await trio.sleep(5)
    except trio.TooSlowError:
        log("fail_after(1) raised TooSlowError")

    with trio.move_on_after(2) as outer:
        with trio.move_on_after(10) as inner:  # an inner deadline cannot extend the outer one
            await trio.sleep(5)
    caught = f"outer {outer.cancelled_caught}, inner {inner.cancelled_caught}"
    log(f"nested: the outer 2 s deadline fired ({caught})")

    with trio.move_on_after(1):
        try:
            await trio.sleep(5)
        finally:
            log("cancelled; the cleanup awaits something...")
            try:
                await trio.sleep(1)
            except trio.Cancelled:
                log("...and is cancelled at once too: cancellation is level-triggered")
                raise
    log("done")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
