"""The checker of docs/exercises/write_handshake.py (docs/exercises.md).

Twelve pulls arrive at once for three prefill engines; the learner's
``Handshakes.ensure`` must give each engine one load, shared by all its
pulls, with the loads one at a time in the handshake task. Pure trio on
the mock clock: the times it prints are exact and it ends at once.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import trio
import trio.testing

LOAD_TIME = 1.0  # seconds: a load of a remote agent (NIXL's add_remote_agent)
FAILING = {"prefill-b": "no reply"}  # the engines whose load fails, and why
PULLS = [
    (f"req-{n}", engine) for n, engine in enumerate(["prefill-a", "prefill-b", "prefill-c"] * 4)
]


class HandshakeError(Exception):
    def __init__(self, engine: str, reason: str) -> None:
        super().__init__(f"{engine}: {reason}")
        self.engine, self.reason = engine, reason


class Loads:
    """Loads remote agents into the local one, like NIXL: it does not promise
    that two loads at once are safe, so it counts how many ran at once."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.running = 0
        self.most_at_once = 0
        self.ended: dict[str, float] = {}  # engine -> when its (last) load ended

    async def load(self, engine: str) -> None:
        """Load ``engine``'s agent (``LOAD_TIME`` s); raise ``HandshakeError`` if it fails."""
        self.count[engine] += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await trio.sleep(LOAD_TIME)
        finally:
            self.running -= 1
            self.ended[engine] = trio.current_time()
        if engine in FAILING:
            raise HandshakeError(engine, FAILING[engine])


class Handshakes(Protocol):
    async def run(self) -> None: ...
    async def ensure(self, engine: str) -> None: ...


MakeHandshakes = Callable[[Loads], Handshakes]


Ended = dict[str, tuple[float, HandshakeError | None]]  # request -> when, and what it raised


async def _pulls(make: MakeHandshakes) -> tuple[Loads, Ended]:
    loads = Loads()
    handshakes = make(loads)
    ended: Ended = {}

    async def pull(request_id: str, engine: str) -> None:
        try:
            await handshakes.ensure(engine)
            ended[request_id] = (trio.current_time(), None)
        except HandshakeError as exc:
            ended[request_id] = (trio.current_time(), exc)

    with trio.fail_after(60):  # (mock seconds: far more than three loads take)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handshakes.run)  # the handshake task
            async with trio.open_nursery() as requests:
                for request_id, engine in PULLS:
                    requests.start_soon(pull, request_id, engine)
            nursery.cancel_scope.cancel()
    return loads, ended


def check(make: MakeHandshakes) -> None:
    """Run the twelve pulls through ``make(loads)``'s handshakes, say what each
    saw and what is wrong, and exit 0 only if nothing is."""
    loads, ended = trio.run(_pulls, make, clock=trio.testing.MockClock(autojump_threshold=0))
    engines = sorted({engine for _, engine in PULLS})
    counts = ", ".join(f"{engine} {loads.count[engine]}" for engine in engines)
    print(f"loads: {counts}; at most {loads.most_at_once} at once")
    problems = []
    for engine in engines:
        mine = [ended[r] for r, e in PULLS if e == engine]
        seen = set()
        for when, exc in mine:
            said = "ok" if exc is None else f"{type(exc).__name__}: {exc.reason}"
            if when == loads.ended.get(engine):
                seen.add(f"{said}, when its load ended")
            else:
                seen.add(f"{said}, at {when:.1f} s: not when its load ended")
        print(f"{engine}'s {len(mine)} pulls: {'; '.join(sorted(seen))}")
        failures = [exc for _, exc in mine if exc is not None]
        if len({id(exc) for exc in failures}) < len(failures):
            problems.append(
                f"the pulls for {engine} raised one exception object between them: "
                "raise a HandshakeError of its own in each"
            )
        want = "HandshakeError" if engine in FAILING else "ok"
        if any(not s.startswith(want) for s in seen):
            problems.append(f"{engine}'s pulls should all end {want}")
        if any(s.endswith("not when its load ended") for s in seen):
            problems.append(f"a pull for {engine} did not end when its engine's load did")
    more = [e for e in engines if loads.count[e] > 1]
    if more:
        problems.append(
            f"{more[0]} was loaded {loads.count[more[0]]} times: "
            "the pulls for one engine must share one load"
        )
    if loads.most_at_once > 1:
        problems.append(
            f"{loads.most_at_once} loads ran at once: put each engine on the queue, "
            "for the handshake task to load one at a time"
        )
    for problem in problems:
        print(f"not yet: {problem}")
    if problems:
        sys.exit(1)
    print("solved: one load per engine, one at a time, and every pull got its engine's outcome")
