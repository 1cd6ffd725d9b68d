"""The checker of docs/exercises/write_start.py (docs/exercises.md).

It gives the learner's ``open_side_channel`` a nursery and a fake network,
asks the port it returns at once, as a decoder would, and says what is
wrong. Pure trio on the mock clock: the times it prints are exact.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

import trio
import trio.testing

BIND_TIME = 0.1  # seconds: binding a socket takes a moment
PORT = 5557  # the port the network gives the listener


class Listener:
    """A bound port: ``serve`` answers every question asked on it, until cancelled."""

    def __init__(self, network: Network, port: int) -> None:
        self.network, self.port = network, port
        self._questions, self.questions = trio.open_memory_channel[
            tuple[str, list[str], trio.Event]
        ](0)
        self.serving = False
        self.ended = False

    async def serve(self, answer: Callable[[str], str]) -> None:
        self.serving = True
        try:
            async for question, reply, answered in self.questions:
                reply.append(answer(question))
                answered.set()
        finally:
            self.ended = True  # (cancelled with its nursery)
            del self.network.listeners[self.port]


class Network:
    """A fake network, with one engine on it."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.listeners: dict[int, Listener] = {}
        self.bound: Listener | None = None  # (the one bound, even after it ended)
        self.bound_at = 0.0

    async def bind(self) -> Listener:
        await trio.sleep(BIND_TIME)
        listener = self.listeners[PORT] = self.bound = Listener(self, PORT)
        self.bound_at = trio.current_time()
        return listener

    async def ask(self, port: object, question: str) -> str:
        """What a peer sees when it asks ``question`` on ``port``."""
        listener = self.listeners.get(port) if isinstance(port, int) else None
        if listener is None or not listener.serving:
            raise ConnectionRefusedError(f"nothing listens on port {port}")
        reply: list[str] = []
        answered = trio.Event()
        await listener._questions.send((question, reply, answered))
        await answered.wait()
        return reply[0]


OpenSideChannel = Callable[[trio.Nursery, Network], Awaitable[object]]
PATIENCE = 5.0  # (mock) seconds for open_side_channel to return


async def _run(open_side_channel: OpenSideChannel, problems: list[str]) -> None:
    network = Network("prefill-0")
    async with trio.open_nursery() as nursery:
        port: object = None
        with trio.move_on_after(PATIENCE) as patience:
            port = await open_side_channel(nursery, network)
        if patience.cancelled_caught:
            print(f"open_side_channel: did not return within {PATIENCE} s")
            problems.append(
                "open_side_channel never returned: does serve_metadata call "
                "task_status.started(...) once the listener is bound?"
            )
        else:
            print(f"open_side_channel returned {port!r}, at {trio.current_time():.1f} s")
            try:
                said = repr(await network.ask(port, "metadata?"))
            except ConnectionRefusedError as exc:
                said = f"ConnectionRefusedError: {exc}"
                if network.bound is None:
                    problems.append(
                        "open_side_channel returned before the listener was bound: start it "
                        "with `await nursery.start(...)`, which waits until it is ready"
                    )
                elif port != PORT:
                    problems.append(
                        f"open_side_channel returned {port!r}, not the listener's port: "
                        "pass the port to task_status.started(...)"
                    )
            print(f"a peer asked port {port!r} at once: {said}")
        await trio.sleep(1.0)  # (time for a listener started late to bind)
        bound = network.bound
        if bound is not None:
            print(f"the listener: bound to port {PORT} at {network.bound_at:.1f} s")
        nursery.cancel_scope.cancel()
    print(f"the listener ended with the nursery: {bound is not None and bound.ended}")
    if bound is None:
        problems.append("no listener was bound: serve_metadata must run, in the nursery given")


def check(open_side_channel: OpenSideChannel) -> None:
    """Run it, print what a peer saw, and exit 0 only if nothing is wrong."""
    problems: list[str] = []
    trio.run(_run, open_side_channel, problems, clock=trio.testing.MockClock(autojump_threshold=0))
    for problem in problems:
        print(f"not yet: {problem}")
    if problems:
        sys.exit(1)
    print("solved: the port was returned once a peer could ask it, and the nursery owns the task")
