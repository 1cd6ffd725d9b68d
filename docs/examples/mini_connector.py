"""A connector in about a hundred lines (docs/build-a-connector.md).

The decode side of trio_pd's design, without NIXL or ZeroMQ: engines are
entries in a fake network with a handshake delay (``None``: never answers).
It shows the patterns one by one: a nursery the connector owns, one
handshake attempt per engine shared by every pull (an Event and the outcome
beside it), a deadline per attempt, and a shielded, bounded cleanup.

Run it with ``python docs/examples/mini_connector.py``. It runs on trio's
mock clock: the times it prints are exact and it ends at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

HANDSHAKE_TIMEOUT = 1.0
CLOSE_TIMEOUT = 0.5
NETWORK = {"prefill-a": 0.3, "prefill-b": None, "prefill-c": 0.2}  # handshake delays


def log(message: str) -> None:
    print(f"[{trio.current_time():.1f} s] {message}")


class HandshakeError(Exception):
    def __init__(self, engine: str, reason: str) -> None:
        super().__init__(f"{engine}: {reason}")
        self.engine, self.reason = engine, reason


class Attempt:
    """One handshake with one engine: an Event, and the outcome beside it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.failure: str | None = None  # (None: it succeeded)


class MiniConnector:
    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery  # the connector's own: its tasks end with its block
        self._attempts: dict[str, Attempt] = {}
        self.handshakes = 0

    async def pull(self, engine: str, request: str) -> str:
        attempt = self._attempts.get(engine)
        if attempt is None:  # the first pull for this engine starts the attempt
            attempt = self._attempts[engine] = Attempt()
            self._nursery.start_soon(self._handshake, engine, attempt)
        await attempt.done.wait()  # every pull for this engine waits on the same one
        if attempt.failure is not None:
            raise HandshakeError(engine, attempt.failure)  # each waiter its own exception
        await trio.sleep(0.1)  # the READ
        return f"pulled from {engine}"

    async def _handshake(self, engine: str, attempt: Attempt) -> None:
        self.handshakes += 1
        try:
            with trio.move_on_after(HANDSHAKE_TIMEOUT) as scope:  # the attempt's deadline
                delay = NETWORK[engine]
                await trio.sleep(delay if delay is not None else float("inf"))
            if scope.cancelled_caught:
                attempt.failure = f"no reply within {HANDSHAKE_TIMEOUT} s"
                del self._attempts[engine]  # the next pull tries again
        except trio.Cancelled:
            attempt.failure = "the connector closed"
            raise
        finally:
            attempt.done.set()  # whichever way it ended: nobody waits forever

    async def _release(self) -> None:
        await trio.sleep(0.1)  # stands in for freeing NIXL's memory
        log("connector: released")


@asynccontextmanager
async def open_mini_connector() -> AsyncIterator[MiniConnector]:
    async with trio.open_nursery() as nursery:
        connector = MiniConnector(nursery)
        try:
            yield connector
        finally:
            nursery.cancel_scope.cancel()  # the connector's tasks end with the block
            with trio.move_on_after(CLOSE_TIMEOUT, shield=True):  # cleanup, bounded
                await connector._release()


async def main() -> None:
    results: dict[str, str] = {}

    async def request(connector: MiniConnector, engine: str, name: str) -> None:
        try:
            outcome = await connector.pull(engine, name)
        except HandshakeError as exc:
            outcome = f"failed: {exc}"
        results[name] = f"[{trio.current_time():.1f} s] {outcome}"

    async with trio.open_nursery() as outliving:  # (outlives the connector: see the page)
        async with open_mini_connector() as connector:
            async with trio.open_nursery() as requests:
                for n, engine in enumerate(["prefill-a", "prefill-b", "prefill-a", "prefill-c"]):
                    requests.start_soon(request, connector, engine, f"req-{n}")
            for name in sorted(results):  # (tasks woken together run in any order)
                print(f"{name}: {results[name]}")
            log(f"handshakes started: {connector.handshakes}")
            outliving.start_soon(request, connector, "prefill-b", "req-4")
            await trio.sleep(0.5)
            log("closing the connector while req-4's handshake runs")
        log("the connector is closed")
    print(f"req-4: {results['req-4']}")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
