"""The checker of docs/exercises/write_settled.py (docs/exercises.md).

A pull is cancelled while its READ cannot be stopped (as a NIXL transfer to
a partitioned peer cannot: ``MemoryFaults.unstoppable_reads``); the
learner's ``give_back`` returns the pull's blocks to the pool. The READ ends
0.5 s later. In-memory data plane (``trio_pd.testing.MemoryFabric``).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric

CONFIG = trio_pd.ConnectorConfig(close_timeout=0.2)  # default 5 s


class Pool:
    """The decode engine's free blocks; it notes a block freed too early."""

    def __init__(self, conn: trio_pd.Connector) -> None:
        self._conn = conn
        self.free_blocks: list[int] = []
        self.too_early: list[int] = []

    def free(self, block_ids: list[int]) -> None:
        self.too_early += sorted(set(block_ids) & self._conn.unsettled_blocks())
        self.free_blocks += block_ids


GiveBack = Callable[[trio_pd.Connector, Pool, list[int]], Awaitable[None]]


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


async def _run(give_back: GiveBack) -> Pool:
    fabric = MemoryFabric()
    async with (
        trio_pd.open_connector("prefill-0", kv_cache(), backend=fabric.backend) as p,
        trio_pd.open_connector("decode", kv_cache(), config=CONFIG, backend=fabric.backend) as d,
    ):
        await d.pull("warm-up", [0], p.expose("warm-up", [0]))  # the handshake, done
        fabric.faults("prefill-0").unstoppable_reads = True
        pool = Pool(d)
        async with trio.open_nursery() as nursery:
            blocks = [7, 8]
            try:
                with trio.move_on_after(0.1):  # the request gives up
                    await d.pull("req", blocks, p.expose("req", [5, 6]))
            finally:
                nursery.start_soon(give_back, d, pool, blocks)
            await trio.sleep(0.5)
            fabric.finish_unstoppable_reads("prefill-0")  # the link is back: the READ ends
            with trio.move_on_after(1.0):
                await d.wait_settled(blocks)
                await trio.sleep(0.1)  # (time for give_back to finish)
            nursery.cancel_scope.cancel()
        return pool


def check(give_back: GiveBack) -> None:
    """Run it, print what went back to the pool and when, and exit 0 only if right."""
    pool = trio.run(_run, give_back)
    print(f"back in the pool: {sorted(pool.free_blocks)}")
    print(f"freed while a transfer could still write them: {pool.too_early}")
    problems = []
    if pool.too_early:
        problems.append("a block went back while NIXL could still write it: wait until it settled")
    if sorted(pool.free_blocks) != [7, 8]:
        problems.append("blocks 7 and 8 should go back to the pool, once each")
    for problem in problems:
        print(f"not yet: {problem}")
    if problems:
        sys.exit(1)
    print("solved: the blocks went back to the pool once nothing could write them")
