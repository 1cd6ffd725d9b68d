"""Exercise: a cleanup that survives a cancel, within a deadline (docs/exercises.md).

``pull`` reads a request's blocks from a prefill engine, then tells the
engine it may free them (``peer.release``), whichever way the read ended.
The request has a deadline that may cancel the read. Fill in the TODO, then
run this file, or ``python -m trio_pd.exercises check cleanup``: the checker
runs three cases, says how each ended and what is still wrong, and exits 0
only when nothing is. (One solution: docs/exercises/solutions/write_cleanup.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio  # noqa: F401  (you will need it)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the checker beside this file)
from checkers.bounded_release import RELEASE_TIMEOUT, Peer, check

assert RELEASE_TIMEOUT == 1.0  # (seconds; the checker's)


async def pull(peer: Peer, request_id: str) -> None:
    try:
        await peer.read(request_id)  # the request's deadline may cancel this
    finally:
        # TODO: this runs after a cancelled read too. Make sure the release is
        # sent then, but never wait more than RELEASE_TIMEOUT seconds for it.
        await peer.release(request_id)


if __name__ == "__main__":
    check(pull)
