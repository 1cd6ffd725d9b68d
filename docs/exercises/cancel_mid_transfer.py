"""Exercise: cancel a pull while its transfer runs (docs/exercises.md).

Twice: first a READ that stops when told to (it takes 0.5 s:
``MemoryFaults.read_delay``), then one that cannot be stopped, as a NIXL
transfer to a partitioned peer cannot (``MemoryFaults.unstoppable_reads``).
Each time the caller gives up after 0.1 s, and the exposure is abandoned. In-memory data plane
(``trio_pd.testing.MemoryFabric``).

Run it with ``python docs/exercises/cancel_mid_transfer.py``.
"""

from __future__ import annotations

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric, fill_blocks, mismatched_blocks

CONFIG = trio_pd.ConnectorConfig(close_timeout=0.2)  # default 5 s


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


async def main() -> None:
    fabric = MemoryFabric()
    prefill_kv, local = kv_cache(), kv_cache()
    async with (
        trio_pd.open_connector("prefill-0", prefill_kv, backend=fabric.backend) as p,
        trio_pd.open_connector("decode", local, config=CONFIG, backend=fabric.backend) as d,
    ):
        await d.pull("warm-up", [0], p.expose("warm-up", [0]))  # the handshake, done
        faults = fabric.faults("prefill-0")

        print("-- a READ that stops when told to")
        faults.read_delay = 0.5
        fill_blocks(prefill_kv, [1, 2], seed=1)
        remote = p.expose("stoppable", [1, 2])
        with trio.move_on_after(0.1) as scope:
            async with d.hold(remote):  # leaving it without a pull abandons the exposure
                await d.pull("stoppable", [3, 4], remote)
        cancelled = trio.current_time()
        print(f"cancelled: {scope.cancelled_caught}")
        print(f"blocks without the data: {mismatched_blocks(local, [3, 4], seed=1)}")
        print(f"blocks a transfer may still write: {sorted(d.unsettled_blocks())}")
        released = await p.wait_released("stoppable")
        at_once = trio.current_time() - cancelled < 1.0  # (its READ's pin: lease_renewal, 10 s)
        print(f"the producer: {released.name}, at once: {at_once}")
        stats = d.statistics()
        print(f"pulls succeeded {stats.pulls_succeeded - 1}, failed {stats.pulls_failed}")

        print("-- a READ that cannot be stopped")
        faults.read_delay, faults.unstoppable_reads = 0.0, True
        fill_blocks(prefill_kv, [5, 6], seed=2)
        remote = p.expose("unstoppable", [5, 6])
        started = trio.current_time()
        with trio.move_on_after(0.1) as scope:
            await d.pull("unstoppable", [7, 8], remote)
        waited = trio.current_time() - started
        print(f"cancelled: {scope.cancelled_caught}, after close_timeout too: {waited >= 0.3}")
        print(f"blocks a transfer may still write: {sorted(d.unsettled_blocks())}")
        print(f"transfers unsettled: {d.statistics().transfers_unsettled}")
        await d.abandon(remote)  # (its READ still runs: the abandon cannot name it)
        print(f"abandoned; the producer keeps the blocks: {p.statistics().exposures_pending == 1}")
        fabric.finish_unstoppable_reads("prefill-0")  # the link is back: the READ ends
        await d.wait_settled([7, 8])
        print(f"after it ended: unsettled {sorted(d.unsettled_blocks())}, ", end="")
        print(f"blocks without the data: {mismatched_blocks(local, [7, 8], seed=2)}")
        print(f"the producer: {(await p.wait_released('unstoppable')).name}")
        stats = d.statistics()
        print(f"pulls succeeded {stats.pulls_succeeded - 1}, failed {stats.pulls_failed}")


if __name__ == "__main__":
    trio.run(main)
