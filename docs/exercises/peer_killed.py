"""Exercise: a prefill engine dies while a decoder pulls from it (docs/exercises.md).

Two prefill engines; a pull from prefill-0 is under way (its READs take
0.3 s: ``MemoryFaults.read_delay``) when prefill-0 is killed: its connector
is closed by cancelling the task that runs it. A pull from prefill-1 runs at
the same time. In-memory data plane (``trio_pd.testing.MemoryFabric``).

Run it with ``python docs/exercises/peer_killed.py``.
"""

from __future__ import annotations

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric, fill_blocks, mismatched_blocks

CONFIG = trio_pd.ConnectorConfig(handshake_timeout=0.3, backoff_initial=1.0)


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


async def prefill_engine(
    fabric: MemoryFabric,
    engine_id: str,
    kill: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[tuple[trio_pd.Connector, list[torch.Tensor]]],
) -> None:
    """A prefill engine that runs until ``kill`` is cancelled."""
    with kill:
        kv = kv_cache()
        async with trio_pd.open_connector(engine_id, kv, backend=fabric.backend) as conn:
            task_status.started((conn, kv))
            await trio.sleep_forever()


async def main() -> None:
    fabric = MemoryFabric()
    local = kv_cache()
    kill_0, kill_1 = trio.CancelScope(), trio.CancelScope()
    async with (
        trio_pd.open_connector("decode", local, config=CONFIG, backend=fabric.backend) as d,
        trio.open_nursery() as engines,
    ):
        p0, kv0 = await engines.start(prefill_engine, fabric, "prefill-0", kill_0)
        p1, kv1 = await engines.start(prefill_engine, fabric, "prefill-1", kill_1)
        fill_blocks(kv0, [1, 2], seed=10)
        fill_blocks(kv1, [1, 2], seed=11)
        fabric.faults("prefill-0").read_delay = 0.3
        doomed = p0.expose("doomed", [1, 2])
        healthy = p1.expose("healthy", [1, 2])

        async def pull(request_id: str, blocks: list[int], remote: trio_pd.RemoteBlocks) -> None:
            try:
                result = await d.pull(request_id, blocks, remote)
                print(f"{request_id}: pulled {result.bytes} bytes")
            except trio_pd.TransferError as exc:
                print(f"{request_id}: TransferError, blocks {exc.failed_block_ids}: {exc.reason}")

        async with trio.open_nursery() as requests:
            requests.start_soon(pull, "doomed", [4, 5], doomed)
            requests.start_soon(pull, "healthy", [6, 7], healthy)
            await trio.sleep(0.1)
            kill_0.cancel()  # prefill-0 dies mid-transfer
        print(f"doomed: blocks not holding its data: {mismatched_blocks(local, [4, 5], seed=10)}")
        print(f"healthy's blocks verified: {mismatched_blocks(local, [6, 7], seed=11) == []}")
        print(f"prefill-0 is now {d.engine_state('prefill-0').name}")

        try:  # a request that was exposed before the crash, pulled after it
            await d.pull("late", [8, 9], doomed)
        except trio_pd.HandshakeError as exc:
            print(f"late: HandshakeError: {exc.reason}")
        print(f"prefill-0 is now {d.engine_state('prefill-0').name}")
        stats = d.statistics()
        print(
            f"pulls succeeded {stats.pulls_succeeded}, failed {stats.pulls_failed}; "
            f"peers lost {stats.peers_disconnected}; "
            f"handshake failures {dict(stats.handshake_failures_by_cause)}"
        )
        kill_1.cancel()


if __name__ == "__main__":
    trio.run(main)
