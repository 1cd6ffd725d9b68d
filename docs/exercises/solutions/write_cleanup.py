"""A solution of docs/exercises/write_cleanup.py (docs/exercises.md).

Run it with ``python docs/exercises/solutions/write_cleanup.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the checker)
from checkers.bounded_release import RELEASE_TIMEOUT, Peer, check


async def pull(peer: Peer, request_id: str) -> None:
    try:
        await peer.read(request_id)  # the request's deadline may cancel this
    finally:
        # shielded: the cancellation outside does not reach in; bounded: a
        # peer that never answers costs RELEASE_TIMEOUT, not forever
        with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
            await peer.release(request_id)


if __name__ == "__main__":
    check(pull)
