"""Exercise: break the nesting order of the tutorial's ``async with`` (docs/exercises.md).

The same little program twice: once with the tutorial's order (prefill
connector, then the nursery of its "free when released" tasks), once with the
two swapped; each with and without an *orphan*, an exposure that nobody reads.
In-memory data plane (``trio_pd.testing.MemoryFabric``): runs in about a second.

Run it with ``python docs/exercises/nesting.py``.
"""

from __future__ import annotations

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric

LEASE = 0.5  # an exposure nobody reads or holds expires after this (default: 30 s)
CONFIG = trio_pd.ConnectorConfig(lease_initial=LEASE)
released: dict[str, str] = {}  # request id -> how its exposure ended
body_ended = 0.0  # when the body of the async with ended (trio's clock)


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((8, 256), dtype=torch.uint8) for _ in range(2)]


async def free_when_released(prefill: trio_pd.Connector, request_id: str) -> None:
    released[request_id] = (await prefill.wait_released(request_id)).name


async def serve(
    prefill: trio_pd.Connector, tasks: trio.Nursery, decode: trio_pd.Connector, orphan: bool
) -> None:
    remote = prefill.expose("read", [0, 1])
    tasks.start_soon(free_when_released, prefill, "read")
    await decode.pull("read", [2, 3], remote)
    if orphan:  # exposed, but its decode request never comes
        prefill.expose("orphan", [4])
        tasks.start_soon(free_when_released, prefill, "orphan")
    await trio.sleep(0.1)  # the rest of the work (decoding, say)
    global body_ended
    body_ended = trio.current_time()


async def tutorial_order(fabric: MemoryFabric, orphan: bool) -> None:
    async with (
        trio_pd.open_connector(
            "prefill-0", kv_cache(), config=CONFIG, backend=fabric.backend
        ) as prefill,
        trio.open_nursery() as tasks,
        trio_pd.open_connector(
            "decode-0", kv_cache(), config=CONFIG, backend=fabric.backend
        ) as decode,
    ):
        await serve(prefill, tasks, decode, orphan)


async def swapped_order(fabric: MemoryFabric, orphan: bool) -> None:
    async with (
        trio.open_nursery() as tasks,
        trio_pd.open_connector(
            "prefill-0", kv_cache(), config=CONFIG, backend=fabric.backend
        ) as prefill,
        trio_pd.open_connector(
            "decode-0", kv_cache(), config=CONFIG, backend=fabric.backend
        ) as decode,
    ):
        await serve(prefill, tasks, decode, orphan)


async def main() -> None:
    for program in (tutorial_order, swapped_order):
        for orphan in (False, True):
            released.clear()
            try:
                await program(MemoryFabric(), orphan)
                ending = "ends cleanly"
            except* trio.ClosedResourceError as group:
                ending = f"raises ExceptionGroup[ClosedResourceError: {group.exceptions[0]}]"
            waited = trio.current_time() - body_ended
            when = "at once" if waited < 0.2 else "only when the orphan's lease ran out"
            name = f"{program.__name__}, {'an orphan' if orphan else 'no orphan'}"
            print(f"{name}: {ending} {when}; released {dict(sorted(released.items()))}")


if __name__ == "__main__":
    trio.run(main)
