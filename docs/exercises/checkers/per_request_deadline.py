"""The checker of docs/exercises/write_deadline.py (docs/exercises.md).

It runs the learner's ``handle`` for four requests, one of them from a
prefill engine whose READs take 5 s, and says what is still wrong.
In-memory data plane (``trio_pd.testing.MemoryFabric``).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric

DEADLINE = 0.4  # seconds, for one request
ARRIVALS = {"req-0": ("fast", 0.0), "req-1": ("slow", 0.25), "req-2": ("fast", 0.5)}
ARRIVALS["req-3"] = ("fast", 0.75)
PATIENCE = 3.0  # seconds for all four: far more than a request with its deadline needs


class Cluster:
    """Two prefill connectors and a decode connector; ``request`` runs one request."""

    def __init__(self, prefill: dict[str, trio_pd.Connector], decode: trio_pd.Connector) -> None:
        self.prefill, self.decode = prefill, decode

    async def request(self, request_id: str) -> str:
        engine, _ = ARRIVALS[request_id]
        remote = self.prefill[engine].expose(request_id, [1])
        async with self.decode.hold(remote):
            await self.decode.pull(request_id, [int(request_id[-1])], remote)
        return "ok"


Handle = Callable[[Cluster, str], Awaitable[str]]


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


async def _results(handle: Handle, problems: list[str]) -> dict[str, str]:
    fabric = MemoryFabric()
    results = dict.fromkeys(ARRIVALS, "no result")
    async with (
        trio_pd.open_connector("fast", kv_cache(), backend=fabric.backend) as fast,
        trio_pd.open_connector("slow", kv_cache(), backend=fabric.backend) as slow,
        trio_pd.open_connector("decode", kv_cache(), backend=fabric.backend) as decode,
    ):
        cluster = Cluster({"fast": fast, "slow": slow}, decode)
        for engine in (fast, slow):  # the handshakes, done: only the READs take time
            await decode.pull("warm-up", [0], engine.expose("warm-up", [0]))
        fabric.faults("slow").read_delay = 5.0

        async def run(request_id: str) -> None:
            await trio.sleep(ARRIVALS[request_id][1])
            results[request_id] = await handle(cluster, request_id)

        with trio.move_on_after(PATIENCE) as patience:
            try:
                async with trio.open_nursery() as nursery:
                    for request_id in ARRIVALS:
                        nursery.start_soon(run, request_id)
            except* Exception as group:
                names = sorted({type(e).__name__ for e in group.exceptions})
                problems.append(
                    f"{', '.join(names)} escaped a request's task and cancelled the requests "
                    "beside it: turn it into that request's answer"
                )
        if patience.cancelled_caught:
            problems.append(
                f"the four requests were not done within {PATIENCE} s: "
                f"does each have its own deadline of {DEADLINE} s?"
            )
    return results


def check(handle: Handle) -> None:
    """Run the requests through ``handle``, print what each answered and what
    is wrong, and exit 0 if nothing is (1 otherwise)."""
    problems: list[str] = []
    results = trio.run(_results, handle, problems)
    for request_id, result in results.items():
        print(f"{request_id}: {result}")
    expected = {
        request_id: f"failed: not done within {DEADLINE} s" if engine == "slow" else "ok"
        for request_id, (engine, _) in ARRIVALS.items()
    }
    if not problems:
        problems = [
            f"{request_id} answered {results[request_id]!r}, expected {want!r}"
            for request_id, want in expected.items()
            if results[request_id] != want
        ]
    for problem in problems:
        print(f"not yet: {problem}")
    if problems:
        sys.exit(1)
    print("solved: each request had its own deadline, and only the slow one failed")
