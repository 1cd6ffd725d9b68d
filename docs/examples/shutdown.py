"""What the end of ``async with open_connector(...)`` does to everyone else.

* A task outside the block that still waits on the connector is woken with
  ``trio.ClosedResourceError``: nobody waits forever on a closed connector.
* An exception raised in the block comes out as itself, not wrapped in an
  ``ExceptionGroup``, although the connector runs a nursery inside.
* Calls after the close raise ``trio.ClosedResourceError`` too.

Run it with ``python docs/examples/shutdown.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch
import trio

import trio_pd


class ModelCrashed(Exception):
    pass


async def main() -> None:
    kv = [torch.zeros((8, 1024), dtype=torch.uint8)]

    async def wait_for_reader(conn: trio_pd.Connector) -> None:
        try:
            await conn.wait_released("req-1")  # nobody will ever read req-1
        except trio.ClosedResourceError as exc:
            print("waiter outside the block:", type(exc).__name__, "-", exc)

    async with trio.open_nursery() as outside:
        try:
            async with trio_pd.open_connector("prefill-0", kv) as conn:
                conn.expose("req-1", [0, 1])
                # flake8-async's ASYNC111 warns about this pattern; here it is the point.
                outside.start_soon(wait_for_reader, conn)  # noqa: ASYNC111
                await trio.sleep(0.05)
                raise ModelCrashed("the forward pass failed")
        except ModelCrashed as exc:  # not an ExceptionGroup: no except* needed
            print("the block's exception:", type(exc).__name__, "-", exc)

    try:
        conn.expose("req-2", [2])
    except trio.ClosedResourceError as exc:
        print("after close:", type(exc).__name__, "-", exc)


if __name__ == "__main__":
    trio.run(main)
