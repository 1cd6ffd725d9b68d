"""A solution of docs/exercises/write_deadline.py (docs/exercises.md).

Run it with ``python docs/exercises/solutions/write_deadline.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the checker)
from checkers.per_request_deadline import DEADLINE, Cluster, check


async def handle(cluster: Cluster, request_id: str) -> str:
    try:
        with trio.fail_after(DEADLINE):  # this request's own deadline
            return await cluster.request(request_id)
    except trio.TooSlowError:  # caught in this request's task: its siblings go on
        return f"failed: not done within {DEADLINE} s"


if __name__ == "__main__":
    check(handle)
