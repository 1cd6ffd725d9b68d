"""Exercise: write a request's deadline yourself (docs/exercises.md).

``handle`` runs one request; four arrive, 0.25 s apart, and one of them
(req-1) reads from a prefill engine whose READs take 5 s. Fill in the TODO
so that every request gets its own deadline of ``DEADLINE`` seconds and a
request that misses it answers ``f"failed: not done within {DEADLINE} s"``
-- without cancelling any other request. Then run this file: the checker
prints what each request answered and what is still wrong, and exits 0
only when nothing is. (One solution: docs/exercises/solutions/write_deadline.py.)

Run it with ``python docs/exercises/write_deadline.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio  # noqa: F401  (you will need it)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the checker beside this file)
from checkers.per_request_deadline import DEADLINE, Cluster, check

assert DEADLINE == 0.4  # (seconds; the checker's)


async def handle(cluster: Cluster, request_id: str) -> str:
    # TODO: give this request its own deadline of DEADLINE seconds, and turn
    # the error that a missed deadline raises into this request's answer.
    return await cluster.request(request_id)


if __name__ == "__main__":
    check(handle)
