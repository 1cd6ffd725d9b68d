"""Common mistake: freeing a cancelled transfer's blocks before ``wait_settled``
(docs/common-mistakes.md).

A pull into local blocks 7 and 8 is cancelled by its deadline while its
READ cannot be stopped (a NIXL transfer to a partitioned peer cannot:
``MemoryFaults.unstoppable_reads``). The blocks go back to the pool, the
next request writes its own KV into them, and then the link comes back and
the old READ lands. In-memory data plane and side channel, on the mock clock.

Run it with ``python docs/mistakes/freed_too_early.py`` (at once).
"""

from __future__ import annotations

import torch
import trio
import trio.testing

import trio_pd
from trio_pd.testing import MemoryFabric

CONFIG = trio_pd.ConnectorConfig(close_timeout=0.2)  # default 5 s
BLOCKS = [7, 8]


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


class Pool:
    """The decode engine's free blocks."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.returned = trio.Event()

    def free(self, block_ids: list[int]) -> None:
        self.blocks += block_ids
        self.returned.set()


async def wrong(decode: trio_pd.Connector, pool: Pool) -> None:
    pool.free(BLOCKS)  # "the pull is over": but its READ is not


async def right(decode: trio_pd.Connector, pool: Pool) -> None:
    await decode.wait_settled(BLOCKS)  # returns once no transfer may write them
    pool.free(BLOCKS)


async def run(way: str) -> None:
    fabric = MemoryFabric()
    prefill_kv, local = kv_cache(), kv_cache()
    backend, side_channel = fabric.backend, fabric.side_channel
    async with (
        trio_pd.open_connector(
            "prefill-0", prefill_kv, backend=backend, side_channel=side_channel
        ) as prefill,
        trio_pd.open_connector(
            "decode", local, config=CONFIG, backend=backend, side_channel=side_channel
        ) as decode,
    ):
        await decode.pull("warm-up", [0], prefill.expose("warm-up", [0]))  # the handshake
        start = trio.current_time()

        def log(message: str) -> None:
            print(f"   [{trio.current_time() - start:.1f} s] {message}")

        async def next_request(pool: Pool) -> None:  # req-2: computes its KV in free blocks
            await pool.returned.wait()
            for tensor in local:
                tensor[pool.blocks] = 2
            log(f"req-2 got blocks {pool.blocks} and wrote its KV in them")

        fabric.faults("prefill-0").unstoppable_reads = True
        for tensor in prefill_kv:
            tensor[5:7] = 1  # req-1's KV
        with trio.move_on_after(0.1):  # req-1's deadline
            await decode.pull("req-1", BLOCKS, prefill.expose("req-1", [5, 6]))
        unsettled = sorted(decode.unsettled_blocks())
        log(f"req-1 was cancelled; blocks a transfer may still write: {unsettled}")
        pool = Pool()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wrong if way == "wrong" else right, decode, pool)
            nursery.start_soon(next_request, pool)
            await trio.sleep(0.5)
            fabric.finish_unstoppable_reads("prefill-0")  # the link is back
            log("the link is back: req-1's READ lands")
        intact = all(bool((tensor[BLOCKS] == 2).all()) for tensor in local)
        print(f"   req-2's KV is intact: {intact}")


async def main() -> None:
    for way in ("wrong", "right"):
        print(f"-- {way}" + (": free at once" if way == "wrong" else ": free after wait_settled"))
        await run(way)


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
