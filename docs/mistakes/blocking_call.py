"""Common mistake: a blocking call on the event loop (docs/common-mistakes.md).

A handshake waits, blocking, for a reply that another task of the same
program delivers. Called on the trio thread, it stops every task -- the
one that would reply included -- until its timeout; in a worker thread
(``trio.to_thread.run_sync``) the loop runs on and the reply arrives.

Run it with ``python docs/mistakes/blocking_call.py`` (about half a second).
"""

from __future__ import annotations

import threading

import trio

TIMEOUT = 0.5  # seconds the blocking call waits for its reply


def blocking_handshake(reply: threading.Event) -> str:
    """A blocking call (a socket's recv, a C library): waits for the reply."""
    return "answered" if reply.wait(TIMEOUT) else f"no reply within {TIMEOUT} s"


async def deliver_reply(reply: threading.Event) -> None:
    """Another task of the program: the reply arrives as soon as it runs."""
    reply.set()


async def wrong(nursery: trio.Nursery, reply: threading.Event) -> str:
    nursery.start_soon(deliver_reply, reply)
    return blocking_handshake(reply)  # no await: the loop stops here


async def right(nursery: trio.Nursery, reply: threading.Event) -> str:
    nursery.start_soon(deliver_reply, reply)
    return await trio.to_thread.run_sync(blocking_handshake, reply)  # the loop runs on


async def main() -> None:
    for name, way in (
        ("wrong: called on the trio thread", wrong),
        ("right: in a worker thread", right),
    ):
        async with trio.open_nursery() as nursery:
            said = await way(nursery, threading.Event())
        print(f"-- {name}")
        print(f"   the handshake: {said}")


if __name__ == "__main__":
    trio.run(main)
