"""Common mistake: a shielded scope without a deadline (docs/common-mistakes.md).

At shutdown (a 1 s deadline), a connector tells its peer it is leaving,
shielded so that the shutdown's cancel does not stop it. The peer no longer
answers. Without a deadline of its own, the shield waits for it -- here an
hour; with one, the cleanup gives up in time.

Run it with ``python docs/mistakes/bare_shield.py`` (mock clock: at once).
"""

from __future__ import annotations

import trio
import trio.testing


async def say_goodbye() -> None:
    await trio.sleep(3600)  # a peer that no longer answers (a partition)


async def wrong() -> None:
    try:
        await trio.sleep_forever()  # serving, until the shutdown cancels it
    finally:
        with trio.CancelScope(shield=True):  # nothing can end this but the peer
            await say_goodbye()


async def right() -> None:
    try:
        await trio.sleep_forever()  # serving, until the shutdown cancels it
    finally:
        with trio.move_on_after(0.5, shield=True):  # shielded, and bounded
            await say_goodbye()


async def main() -> None:
    for name, connector in (("wrong: CancelScope(shield=True)", wrong), ("right", right)):
        start = trio.current_time()
        with trio.move_on_after(1):  # the shutdown's deadline
            await connector()
        print(f"-- {name}")
        print(f"   the shutdown, due at 1 s, ended at {trio.current_time() - start:.1f} s")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
