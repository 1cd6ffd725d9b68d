"""Exercise: give a cancelled pull's blocks back, safely (docs/exercises.md).

A pull was cancelled while its READ could not be stopped; ``give_back``
runs in a task of its own and must return the pull's local blocks to the
engine's pool with ``pool.free(block_ids)`` -- but not while a transfer may
still write them. Fill in the TODO, then run this file: the checker says
what went back to the pool and when, and exits 0 only when it is right.
(One solution: docs/exercises/solutions/write_settled.py.)

Run it with ``python docs/exercises/write_settled.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio_pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the checker beside this file)
from checkers.free_when_settled import Pool, check


async def give_back(conn: trio_pd.Connector, pool: Pool, block_ids: list[int]) -> None:
    # TODO: a transfer NIXL could not stop may still write these blocks
    # (they are in conn.unsettled_blocks()); free them only once it ended.
    pool.free(block_ids)


if __name__ == "__main__":
    check(give_back)
