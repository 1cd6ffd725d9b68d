"""trio in ten minutes, 5: one attempt, many waiters: an Event plus a stored outcome.

Run it with ``python docs/examples/primer_event.py`` (mock clock: exact times, no waiting).
"""

import trio
import trio.testing


def log(message: str) -> None:
    print(f"[{trio.current_time():.1f} s] {message}")


class HandshakeFailed(Exception):
    pass


class Attempt:
    """What trio_pd keeps per handshake attempt: an Event, and the outcome beside it."""

    def __init__(self) -> None:
        self.done = trio.Event()  # can be set once, carries no value
        self.reason: str | None = None  # None: it succeeded


async def handshake(attempt: Attempt) -> None:
    await trio.sleep(1)  # the network round trip, which fails
    attempt.reason = "no reply within 1 s"
    log("the attempt failed; setting its Event")
    attempt.done.set()


async def pull(attempt: Attempt) -> str:
    await attempt.done.wait()
    if attempt.reason is not None:
        raise HandshakeFailed(attempt.reason)  # each waiter raises an exception of its own
    return "pulled"


async def main() -> None:
    attempt = Attempt()
    results: dict[str, str] = {}

    async def request(name: str) -> None:
        try:
            results[name] = await pull(attempt)
        except HandshakeFailed as exc:
            results[name] = f"HandshakeFailed: {exc}"

    async def impatient() -> None:
        with trio.move_on_after(0.5):
            await pull(attempt)
        log("impatient: gave up waiting; the attempt goes on for the others")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(handshake, attempt)
        for n in range(3):
            nursery.start_soon(request, f"waiter-{n}")
        nursery.start_soon(impatient)
    for name, result in sorted(results.items()):
        print(f"{name}: {result}")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
