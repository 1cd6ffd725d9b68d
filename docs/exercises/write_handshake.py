"""Exercise: one handshake per engine, however many pulls wait (docs/exercises.md).

Twelve pulls arrive at once for three prefill engines. Before its first
READ from an engine, a decoder must load that engine's agent into its own
NIXL agent -- once per engine, not once per pull, and one load at a time
(NIXL does not promise that two at once are safe). ``Handshakes.run`` is
the handshake task: it loads the engines put on its queue, one after the
other, and sets each engine's Event when its load ended. Fill in the TODO
in ``ensure``, which every pull calls. Then run this file, or
``python -m trio_pd.exercises check handshake``: the checker says what each
pull saw and what is still wrong, and exits 0 only when nothing is.
(One solution: docs/exercises/solutions/write_handshake.py.)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the checker beside this file)
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
        # TODO: only the first pull for an engine makes its Event and puts the
        # engine on the queue (self._queue_send.send_nowait). Every pull for it
        # waits for that Event; if the load failed, each raises a HandshakeError
        # of its own (HandshakeError(engine, reason)).
        await self._loads.load(engine)


if __name__ == "__main__":
    check(Handshakes)
