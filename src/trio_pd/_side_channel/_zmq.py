"""A trio adapter for ZeroMQ sockets (thin I/O shell).

libzmq exposes one file descriptor per socket that is *edge-triggered*: it
becomes readable when the socket's ``EVENTS`` may have changed, and any zmq call
on the socket may consume that edge. So every operation is tried with
``NOBLOCK`` first; on ``zmq.Again`` the socket's ``EVENTS`` is checked, and only
if the wanted event is still absent do we wait for the descriptor, then check
again. Waiting only after ``EVENTS`` said "not ready" is what makes the edge
impossible to miss.

A :class:`TrioZmqSocket` belongs to one task at a time (zmq sockets are not
thread-safe, and one fd cannot be awaited twice): concurrent use raises
:class:`trio.BusyResourceError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import cast

import trio
import zmq


class SocketSetups:
    """Where one connector makes its new ZeroMQ sockets: one at a time, each
    in a pass of trio's scheduler of its own.

    Making a socket is the most the trio thread does for a handshake in one
    step: ``zmq_socket``, its options, a monitor's inproc pair and
    ``connect`` are each a command to ZeroMQ's I/O thread, 0.1-0.6 ms of the
    trio thread's CPU together on this project's 2-core machine
    (docs/performance.md, benchmark 3). A storm of first pulls to new
    engines makes them all at once -- a metadata fetch's socket and monitor
    per engine, then a confirmation channel per producer rank -- and trio
    runs every task that is ready in one batch before it polls for I/O
    again: eight at once kept the loop from polling for 2-5 ms. Inside
    :meth:`turn`, one task makes its sockets; the others wait for theirs,
    each in a later batch, and the loop polls between them. The task then
    passes one more schedule point before the next task's turn: what it
    does right after (start a send, decode a reply, post a READ) runs in a
    pass of its own too, not in the next turn's (0.77 -> 0.63 ms of CPU in
    a storm's longest batch, docs/performance.md).

    What a turn holds: nothing but its lock. The body must not wait for
    anything (a turn is for synchronous setup; a send or a receive comes
    after it), or every other setup would wait with it.
    """

    def __init__(self) -> None:
        self._lock = trio.Lock()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """This task's turn to make sockets: a checkpoint (a cancel point while
        it waits; a schedule point even when no other task waits, so that
        the setup runs in a batch of its own), and a schedule point after
        the body (not a cancel point; none when the body raised), still in
        the turn, so that what the task does next is not in the next
        turn's batch."""
        async with self._lock:
            yield
            await trio.lowlevel.cancel_shielded_checkpoint()


class TrioZmqSocket:
    """Owns one :class:`zmq.Socket`; :meth:`aclose` (or :meth:`close`) releases it.

    Operations after close raise :class:`trio.ClosedResourceError`. Closing
    while another task waits on the socket wakes that task with
    :class:`trio.ClosedResourceError`.
    """

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self._socket = socket
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._closed = False
        self._busy = False

    @property
    def zmq_socket(self) -> zmq.Socket[bytes]:
        """The wrapped socket, for options and binding; do not send or receive on it."""
        return self._socket

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if self._busy:
            raise trio.BusyResourceError(f"another task is using this zmq socket ({what})")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("zmq socket is closed")

    async def _wait_for(self, event: int) -> bool:
        """Until ``event`` is set; returns whether it waited (a schedule point)."""
        waited = False
        while True:
            self._check_open()
            if cast(int, self._socket.getsockopt(zmq.EVENTS)) & event:
                return waited
            await trio.lowlevel.wait_readable(self._fd)
            waited = True

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Send one multipart message, waiting while the socket cannot take it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        with self._exclusive("send"):
            while True:
                self._check_open()
                try:
                    self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    await self._wait_for(zmq.POLLOUT)  # (then a schedule point anyway)
                else:
                    break
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_multipart(self) -> list[bytes]:
        """Receive one multipart message, waiting until one arrives.

        A checkpoint: a cancel point before anything is received, and a
        schedule point -- the wait for the descriptor, or, when the message
        was there at once, one after it (not both: an answering server
        would otherwise let every other task run once more between a
        request's arrival and its answer).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        with self._exclusive("receive"):
            while True:
                self._check_open()
                try:
                    frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    waited = await self._wait_for(zmq.POLLIN) or waited
                else:
                    break
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return frames

    def close(self) -> None:
        """Close now, discarding unsent messages (linger 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._socket.close(linger=0)

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> TrioZmqSocket:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
