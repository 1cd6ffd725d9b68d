"""Exercise: start a listener and return its port once it is ready (docs/exercises.md).

``open_side_channel`` starts the side channel's listener, ``serve_metadata``,
in a nursery it is given, and returns its port: a decoder may ask that port
as soon as it returns. Binding takes a moment. Fill in the two TODOs, then
run this file, or ``python -m trio_pd.exercises check start``: the checker
says what a peer saw and what is still wrong, and exits 0 only when nothing
is. (One solution: docs/exercises/solutions/write_start.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the checker beside this file)
from checkers.started_listener import Network, check


async def serve_metadata(
    network: Network, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Bind a port, then answer every question on it with the engine's metadata."""
    listener = await network.bind()  # takes a moment, as binding a socket does
    # TODO 1: tell the task that started this one that it is ready, and its port
    await listener.serve(lambda question: f"metadata of {network.engine}")


async def open_side_channel(nursery: trio.Nursery, network: Network) -> int:
    """Start ``serve_metadata`` in ``nursery``; return its port, once it can be asked."""
    # TODO 2: start it so that this returns only once the listener is bound,
    # with the port it reported
    nursery.start_soon(serve_metadata, network)
    return 0


if __name__ == "__main__":
    check(open_side_channel)
