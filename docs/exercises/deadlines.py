"""Exercise: one deadline for all requests, or one per request (docs/exercises.md).

Four requests arrive 0.25 s apart. req-1 reads from a slow prefill engine
(its READs take 5 s: ``MemoryFaults.read_delay``); the others from a healthy
one. The same requests run three times, with their deadlines set three ways.
In-memory data plane (``trio_pd.testing.MemoryFabric``).

Run it with ``python docs/exercises/deadlines.py``.
"""

from __future__ import annotations

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric

DEADLINE = 0.4  # seconds
ARRIVALS = {"req-0": ("fast", 0.0), "req-1": ("slow", 0.25), "req-2": ("fast", 0.5)}
ARRIVALS["req-3"] = ("fast", 0.75)


async def arrival(request_id: str) -> None:
    await trio.sleep(ARRIVALS[request_id][1])


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


class Cluster:
    def __init__(self, prefill: dict[str, trio_pd.Connector], decode: trio_pd.Connector) -> None:
        self.prefill, self.decode = prefill, decode
        self.round = 0

    async def request(self, request_id: str) -> str:
        engine, _ = ARRIVALS[request_id]
        unique = f"{request_id}/{self.round}"  # the same request ids run in each round
        remote = self.prefill[engine].expose(unique, [1])
        async with self.decode.hold(remote):  # leaving without a pull abandons the exposure
            await self.decode.pull(unique, [int(request_id[-1])], remote)
        return "ok"


async def one_deadline_for_all(cluster: Cluster) -> dict[str, str]:
    results = dict.fromkeys(ARRIVALS, "no result")

    async def run(request_id: str) -> None:
        await arrival(request_id)
        results[request_id] = await cluster.request(request_id)

    with trio.move_on_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            for request_id in ARRIVALS:
                nursery.start_soon(run, request_id)
    return results


async def a_deadline_per_request_not_caught(cluster: Cluster) -> dict[str, str]:
    results = dict.fromkeys(ARRIVALS, "no result")

    async def run(request_id: str) -> None:
        await arrival(request_id)
        with trio.fail_after(DEADLINE):
            results[request_id] = await cluster.request(request_id)

    try:
        async with trio.open_nursery() as nursery:
            for request_id in ARRIVALS:
                nursery.start_soon(run, request_id)
    except* trio.TooSlowError as group:
        results["the nursery"] = f"raised {len(group.exceptions)} TooSlowError"
    return results


async def a_deadline_per_request_caught(cluster: Cluster) -> dict[str, str]:
    results = dict.fromkeys(ARRIVALS, "no result")

    async def run(request_id: str) -> None:
        await arrival(request_id)
        try:
            with trio.fail_after(DEADLINE):
                results[request_id] = await cluster.request(request_id)
        except trio.TooSlowError:
            results[request_id] = f"failed: not done within {DEADLINE} s"

    async with trio.open_nursery() as nursery:
        for request_id in ARRIVALS:
            nursery.start_soon(run, request_id)
    return results


async def main() -> None:
    fabric = MemoryFabric()
    async with (
        trio_pd.open_connector("fast", kv_cache(), backend=fabric.backend) as fast,
        trio_pd.open_connector("slow", kv_cache(), backend=fabric.backend) as slow,
        trio_pd.open_connector("decode", kv_cache(), backend=fabric.backend) as decode,
    ):
        cluster = Cluster({"fast": fast, "slow": slow}, decode)
        for engine in (fast, slow):  # handshake both first, so that only the READs take time
            await decode.pull("warm-up", [0], engine.expose("warm-up", [0]))
        fabric.faults("slow").read_delay = 5.0
        for way in (
            one_deadline_for_all,
            a_deadline_per_request_not_caught,
            a_deadline_per_request_caught,
        ):
            cluster.round += 1
            print(f"{way.__name__}:")
            for request_id, result in (await way(cluster)).items():
                print(f"  {request_id}: {result}")


if __name__ == "__main__":
    trio.run(main)
