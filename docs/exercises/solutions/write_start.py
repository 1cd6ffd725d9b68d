"""A solution of docs/exercises/write_start.py (docs/exercises.md).

Run it with ``python docs/exercises/solutions/write_start.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the checker)
from checkers.started_listener import Network, check


async def serve_metadata(
    network: Network, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Bind a port, then answer every question on it with the engine's metadata."""
    listener = await network.bind()  # takes a moment, as binding a socket does
    task_status.started(listener.port)  # ready: nursery.start returns this port
    await listener.serve(lambda question: f"metadata of {network.engine}")


async def open_side_channel(nursery: trio.Nursery, network: Network) -> int:
    """Start ``serve_metadata`` in ``nursery``; return its port, once it can be asked."""
    port: int = await nursery.start(serve_metadata, network)  # waits for started(...)
    return port


if __name__ == "__main__":
    check(open_side_channel)
