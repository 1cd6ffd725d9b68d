"""The checker of docs/exercises/write_cleanup.py (docs/exercises.md).

It runs the learner's ``pull`` three times under a request deadline of
``DEADLINE``: a READ that finishes, a READ the deadline cancels, and a
READ the deadline cancels on a peer that no longer answers. Pure trio on
the mock clock: the times it prints are exact and it ends at once.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

import trio
import trio.testing

DEADLINE = 0.5  # seconds: the request's own
RELEASE_TIMEOUT = 1.0  # seconds: the most a release may wait for its peer


class Peer:
    """A prefill engine: a READ takes ``read_time``; a release, 0.1 s to be
    answered (or an hour: a peer that no longer answers)."""

    def __init__(self, read_time: float, answers: bool) -> None:
        self.read_time, self.answers = read_time, answers
        self.released: list[str] = []

    async def read(self, request_id: str) -> None:
        await trio.sleep(self.read_time)

    async def release(self, request_id: str) -> None:
        await trio.sleep(0.1 if self.answers else 3600.0)
        self.released.append(request_id)


Pull = Callable[[Peer, str], Awaitable[None]]
CASES = {  # name: (read_time, answers)
    "a READ that finishes": (0.2, True),
    "a READ its deadline cancels": (10.0, True),
    "the same, on a peer that no longer answers": (10.0, False),
}


async def _case(pull: Pull, peer: Peer) -> tuple[float, bool]:
    with trio.move_on_after(DEADLINE) as deadline:
        await pull(peer, "req-1")
    return trio.current_time(), deadline.cancelled_caught


def check(pull: Pull) -> None:
    """Run the three cases, print how each ended, and exit 0 only if right."""
    problems = []
    for name, (read_time, answers) in CASES.items():
        peer = Peer(read_time, answers)
        clock = trio.testing.MockClock(autojump_threshold=0)
        ended, cancelled = trio.run(_case, pull, peer, clock=clock)
        released = peer.released == ["req-1"]
        print(f"{name}: released {released}, ended at {ended:.1f} s, cancelled: {cancelled}")
        if peer.read_time < DEADLINE:
            continue
        if not cancelled:
            problems.append(
                "the deadline's cancellation did not reach it: never swallow trio.Cancelled"
            )
        elif peer.answers and not released:
            problems.append(
                "a cancelled pull did not send its release: in a cancelled scope the await "
                "in the finally is cancelled too; shield it"
            )
        if ended > DEADLINE + RELEASE_TIMEOUT:
            problems.append(
                f"with a peer that does not answer, the pull ended at {ended:.1f} s, not "
                f"within {RELEASE_TIMEOUT} s of its deadline: give the shielded scope a deadline"
            )
    for problem in problems:
        print(f"not yet: {problem}")
    if problems:
        sys.exit(1)
    print("solved: the release is sent even when cancelled, and never waits more than its deadline")
