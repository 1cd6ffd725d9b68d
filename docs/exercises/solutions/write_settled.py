"""A solution of docs/exercises/write_settled.py (docs/exercises.md).

Run it with ``python docs/exercises/solutions/write_settled.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio_pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the checker)
from checkers.free_when_settled import Pool, check


async def give_back(conn: trio_pd.Connector, pool: Pool, block_ids: list[int]) -> None:
    await conn.wait_settled(block_ids)  # returns at once when nothing may write them
    pool.free(block_ids)


if __name__ == "__main__":
    check(give_back)
