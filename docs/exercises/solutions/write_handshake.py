"""A solution of docs/exercises/write_handshake.py (docs/exercises.md).

Run it with ``python docs/exercises/solutions/write_handshake.py``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the checker)
from checkers.one_handshake import HandshakeError, Loads, check


class Handshakes:
    """The decode side's handshakes: one load per engine, shared by its pulls."""

    def __init__(self, loads: Loads) -> None:
        self._loads = loads
        self._queue_send, self._queue = trio.open_memory_channel[str](math.inf)
        self.done: dict[str, trio.Event] = {}  # engine -> set when its load ended
        self.failure: dict[str, str] = {}  # engine -> why its load failed

    async def run(self) -> None:
        """The handshake task: load each engine put on the queue, one at a time."""
        async for engine in self._queue:
            try:
                await self._loads.load(engine)
            except HandshakeError as exc:
                self.failure[engine] = exc.reason
            finally:
                self.done[engine].set()  # whichever way it ended: wake its pulls

    async def ensure(self, engine: str) -> None:
        """Return once ``engine``'s agent is loaded; raise ``HandshakeError`` if
        its load failed."""
        if engine not in self.done:  # the first pull for this engine
            self.done[engine] = trio.Event()
            self._queue_send.send_nowait(engine)  # the handshake task loads it, in turn
        await self.done[engine].wait()  # every pull for it waits on the same Event
        if engine in self.failure:
            raise HandshakeError(engine, self.failure[engine])  # each pull its own exception


if __name__ == "__main__":
    check(Handshakes)
