"""The round-trip floor: a trio process that answers ZeroMQ requests at once, doing nothing else.

Benchmark 13 times a side-channel round trip (a lease request naming
nothing, answered by a prefill engine's listener) and asks how much of a
confirmed pull's time it is. Part of that round trip is not trio_pd's: two
processes, each a trio loop waking on a ZeroMQ descriptor, and ZeroMQ's I/O
thread on each side, take turns on this machine's cores. So, in the same
rounds, the same DEALER request goes to this process too: a ROUTER socket
on :class:`~trio_pd._side_channel._zmq.TrioZmqSocket`, as a producer's
listener is, that sends every message straight back. Its round trip is the
least any answer over the side channel can take here (the *floor*).

    async with open_zmq_echo() as endpoint:
        ...  # a DEALER connected to ``endpoint``: send [b"", payload], receive it back

Run as a script, it is the echo itself: it binds a loopback port, prints its
endpoint on stdout, and echoes until it is killed.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import zmq

SCRIPT = __file__


@asynccontextmanager
async def open_zmq_echo() -> AsyncIterator[str]:
    """Start the echo in a process of its own; yield its endpoint; kill it on exit."""
    process = await trio.lowlevel.open_process([sys.executable, SCRIPT], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            data = await process.stdout.receive_some()
            if not data:
                raise EOFError("the echo's process ended before it was bound")
            line += data
        yield line.decode().strip()
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


# ---- the echo (this file run as a script) ---------------------------------------


async def _echo() -> None:
    from trio_pd._side_channel._zmq import TrioZmqSocket

    with zmq.Context() as context:
        router = TrioZmqSocket(context.socket(zmq.ROUTER))
        async with router:
            router.zmq_socket.setsockopt(zmq.LINGER, 0)
            router.zmq_socket.bind("tcp://127.0.0.1:0")
            endpoint = router.zmq_socket.getsockopt_string(zmq.LAST_ENDPOINT)
            await trio.lowlevel.FdStream(1).send_all(endpoint.encode() + b"\n")
            while True:
                await router.send_multipart(await router.receive_multipart())


if __name__ == "__main__":
    trio.run(_echo)
