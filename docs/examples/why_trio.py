"""Why structured concurrency, 2: the same program in trio (docs/why-structured-concurrency.md).

The handler can only start tasks in a nursery it opens, so they cannot
outlive it, and the handshake's error comes out of the handler's call.

Run it with ``python docs/examples/why_trio.py``. It runs on trio's mock
clock: the times it prints are exact and it ends at once.
"""

import trio
import trio.testing


def log(message: str) -> None:
    print(f"[{trio.current_time():.2f} s] {message}")


async def handshake(engine: str) -> None:
    await trio.sleep(0.1)
    raise ConnectionError(f"{engine}: no reply")


async def heartbeat() -> None:
    beats = 0
    try:
        while True:
            await trio.sleep(0.05)
            beats += 1
    finally:
        log("heartbeat: cancelled, because a sibling failed")


async def handle_request() -> str:
    async with trio.open_nursery() as nursery:  # the tasks' owner: the handler
        nursery.start_soon(handshake, "prefill-0")
        nursery.start_soon(heartbeat)
        await trio.sleep(0.2)  # cancelled at 0.1 s, when the handshake fails
        nursery.cancel_scope.cancel()  # (never reached here)
    return "the request answered: ok"  # (never reached here)


async def main() -> None:
    try:
        log(await handle_request())
    except* ConnectionError as group:
        log(f"the request failed: {group.exceptions[0]!r}")
    log("handle_request has returned: no task of its can still run")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
