"""trio in ten minutes, 4: shielding the cleanup that must finish.

Run it with ``python docs/examples/primer_shield.py`` (mock clock: exact times, no waiting).
"""

import trio
import trio.testing


def log(message: str) -> None:
    print(f"[{trio.current_time():.1f} s] {message}")


async def release(what: str) -> None:
    await trio.sleep(0.5)  # stands in for telling the peer
    log(f"released {what}")


async def main() -> None:
    with trio.move_on_after(1):
        try:
            await trio.sleep(5)
        finally:
            try:
                await release("the first blocks")
            except trio.Cancelled:
                log("unshielded: the release was cancelled with the rest")
                raise

    with trio.move_on_after(1):
        try:
            await trio.sleep(5)
        finally:
            # A shielded scope ignores the cancellation outside it; give it a
            # deadline of its own, or a stuck release would hang the caller.
            with trio.move_on_after(2, shield=True):
                await release("the second blocks")
    log("shielded: the release ran to its end, then the cancellation went on")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
