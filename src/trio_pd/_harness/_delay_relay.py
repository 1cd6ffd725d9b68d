"""A TCP relay that adds latency: a slow link for demos, benchmarks and tests.

``serve_delay_relay`` listens on loopback and forwards every connection to a
target address; each chunk of bytes, in either direction, is delivered
``delay`` seconds after it was read (latency, not a bandwidth limit; order
is kept). Put it in front of a producer's side channel to make that engine's
handshake slow without touching the engine. ``trio-pd demo`` runs it for
its slow link; :mod:`trio_pd.testing` re-exports it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager

import trio

from trio_pd._harness._child_process import open_child, read_lines


async def serve_delay_relay(
    target_host: str,
    target_port: int,
    delay: float,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Relay connections on ``127.0.0.1:<port>`` to the target, until cancelled.

    Reports the port it listens on through ``task_status`` (use
    ``await nursery.start(serve_delay_relay, ...)``). Each relayed connection
    is closed when either side closes or fails.
    """
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listeners[0].socket.getsockname()[1]

    async def handle(client: trio.SocketStream) -> None:
        async with client:
            try:
                server = await trio.open_tcp_stream(target_host, target_port)
            except OSError:
                return
            async with server, trio.open_nursery() as nursery:
                nursery.start_soon(_pump, client, server, delay, nursery.cancel_scope)
                nursery.start_soon(_pump, server, client, delay, nursery.cancel_scope)

    async with trio.open_nursery() as nursery:
        task_status.started(port)
        await trio.serve_listeners(handle, listeners, handler_nursery=nursery)


async def _pump(
    source: trio.SocketStream,
    sink: trio.SocketStream,
    delay: float,
    done: trio.CancelScope,
) -> None:
    send, receive = trio.open_memory_channel[tuple[float, bytes]](math.inf)

    async def deliver() -> None:
        async for due, data in receive:
            await trio.sleep_until(due)
            await sink.send_all(data)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliver)
            async with send:
                async for data in source:
                    send.send_nowait((trio.current_time() + delay, bytes(data)))
    except* (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    done.cancel()


# ---- a relay process (keeps relaying off the measured process's trio loop) ----


async def _relay_process_main(targets: list[tuple[str, int]], delay: float) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    stdout = trio.lowlevel.FdStream(os.dup(1))
    async with stdin, stdout, trio.open_nursery() as nursery:
        ports = [await nursery.start(serve_delay_relay, h, p, delay) for h, p in targets]
        await stdout.send_all(json.dumps({"ports": ports}).encode() + b"\n")
        async for _ in stdin:  # until the parent closes our stdin
            pass
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_delay_relays(
    targets: Sequence[tuple[str, int]], delay: float
) -> AsyncIterator[list[int]]:
    """Relay each target through a child process; yield the relay ports (same order).

    The child process ends when the block exits (see
    ``trio_pd._harness._child_process.open_child``).
    """
    argument = json.dumps({"targets": targets, "delay": delay})
    async with open_child("trio_pd._harness._delay_relay", argument) as process:
        assert process.stdout is not None
        with trio.fail_after(30):
            async with aclosing(read_lines(process.stdout)) as lines:
                line = await anext(lines, None)
        if line is None:
            raise RuntimeError("relay process exited before reporting its ports")
        yield [int(p) for p in json.loads(line)["ports"]]


def main() -> None:
    """The relay process (see :func:`open_delay_relays`)."""
    spec = json.loads(sys.argv[1])
    trio.run(_relay_process_main, [tuple(t) for t in spec["targets"]], float(spec["delay"]))
