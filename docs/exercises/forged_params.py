"""Exercise: a forged ``kv_transfer_params`` (docs/exercises.md).

A prefill engine exposes "alice"'s blocks 1-2 and "mallory"'s blocks 5-6.
Mallory's proxy changes ``remote_block_ids`` in mallory's parameters to
alice's blocks. Twice: without an ``exposure_secret``, then with one shared by
the engines of the deployment. In-memory data plane
(``trio_pd.testing.MemoryFabric``).

Run it with ``python docs/exercises/forged_params.py``.
"""

from __future__ import annotations

import json

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric, fill_blocks, mismatched_blocks

ALICE = 1  # the seed of alice's KV-cache contents


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


async def attempt(config: trio_pd.ConnectorConfig) -> None:
    fabric = MemoryFabric()
    prefill_kv, local = kv_cache(), kv_cache()
    async with (
        trio_pd.open_connector("prefill-0", prefill_kv, config=config, backend=fabric.backend) as p,
        trio_pd.open_connector("decode", local, config=config, backend=fabric.backend) as d,
    ):
        fill_blocks(prefill_kv, [1, 2], seed=ALICE)
        fill_blocks(prefill_kv, [5, 6], seed=2)
        p.expose("alice", [1, 2])
        params = p.expose("mallory", [5, 6]).to_kv_transfer_params()
        forged = json.loads(json.dumps(params))  # as it crosses the proxy
        forged["remote_block_ids"] = [1, 2]
        try:
            remote = trio_pd.RemoteBlocks.from_kv_transfer_params(forged)
            await d.pull("mallory", [3, 4], remote)
        except trio_pd.ParamsRejectedError as exc:
            print(f"ParamsRejectedError, field {exc.field!r}: {exc.reason}")
        except trio_pd.ExposureEndedError as exc:
            print(f"ExposureEndedError ({exc.outcome}): {exc.reason}")
        else:
            stolen = mismatched_blocks(local, [3, 4], seed=ALICE) == []
            print(f"the pull succeeded; mallory now holds alice's KV cache: {stolen}")
        stats = d.statistics()
        print(f"handshakes {stats.handshakes_started}, READs {fabric.reads}, ", end="")
        print(f"pulls rejected {stats.pulls_rejected}")


async def main() -> None:
    print("-- without exposure_secret")
    await attempt(trio_pd.ConnectorConfig())
    print("-- with exposure_secret")
    await attempt(trio_pd.ConnectorConfig(exposure_secret=b"one secret per deployment!"))


if __name__ == "__main__":
    trio.run(main)
