"""An in-memory side channel with injectable faults (no sockets, no threads).

Connectors opened with ``side_channel=fabric.side_channel`` on one
:class:`~trio_pd.testing.MemoryFabric` reach each other's listeners through
the fabric: a request is handed to the listener bound at its address (the
producer's real ``answer``, so the encoding, the checks and every decision
are the library's own), and its reply comes back. Only the transport is
replaced; nothing waits but on trio's clock, so tests of timeouts, backoff,
leases, partitions and restarts run under ``autojump_clock`` in
milliseconds.

What a consumer sees mirrors the ZeroMQ side channel, down to the
diagnosis of a request that got no reply (the same ``ConnectionLog``,
fed the events ZeroMQ's monitor would report):

* nobody listens at the address (never did, closed, or between a restart's
  two incarnations): the connection is refused, and retried every
  :data:`RECONNECT_INTERVAL` (ZeroMQ's reconnect interval) until the
  deadline, so a producer that restarts within it is reached;
* ``MemoryFaults.refuse``: refused the same way while a listener runs;
* ``MemoryFaults.unreachable`` (a partition): nothing connects, and nothing
  is refused; requests wait until their deadline, or until it is cleared;
* ``MemoryFaults.mute``: the listener takes requests and never answers;
* ``MemoryFaults.reply_delay``: each request is answered that long after it
  was sent, by the listener bound at its address then (a slow link, a busy
  producer);
* a request over the listener's ``max_message_bytes``, or a reply over the
  consumer's: the connection is dropped, and the request sent again after
  ``_fetch.RETRY_DELAY``, as ZeroMQ's ``MAXMSGSIZE`` does.

Confirmations are answered one by one, at once when nothing stands in the
way (the ZeroMQ channels' batching is theirs alone), else by the time the
pull waits for the answer.

CURVE is ZeroMQ's: a configuration with ``auth`` is refused here; the
real side channel's tests cover it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
from typing import TYPE_CHECKING

import attrs
import trio
import zmq

from trio_pd._config import ConnectorConfig
from trio_pd._core import _protocol as protocol
from trio_pd._core._errors import ProtocolError
from trio_pd._side_channel._confirm import Confirmations, Pending, refusal
from trio_pd._side_channel._fetch import RETRY_DELAY, ConnectionLog
from trio_pd._side_channel._seam import Listener, Peer, SideChannel

if TYPE_CHECKING:
    from trio_pd.testing._memory import MemoryFabric

logger = logging.getLogger("trio_pd")

RECONNECT_INTERVAL = 0.1
"""How often a refused connection is tried again (ZeroMQ's ``RECONNECT_IVL``)."""

FIRST_PORT = 61000
"""The first port a listener bound with ``port=0`` gets (each fabric counts its own).

Above Linux's default ephemeral range (32768-60999), and so above every base
:func:`~trio_pd.testing.free_port_range` draws (from 20000 up to that range):
a test may bind ranks at such a base on a fabric where other listeners took
ports of their own, and the two never meet. (From 30000 they could: a
decode engine drew the base 30000, a port the prefill engine bound before
it already held.)"""

_WILDCARDS = ("0.0.0.0", "::")


@attrs.define(eq=False)
class BoundListener:
    """A listener bound at an address of the fabric."""

    host: str
    port: int
    listener: Listener
    agent_name: str
    """Its connector's transfer agent (``{engine_id}#{incarnation}``): faults
    set for the agent name apply to it before the engine's."""
    max_message_bytes: int

    @property
    def engine_id(self) -> str:
        return self.agent_name.rsplit("#", 1)[0]


class Addresses:
    """Who listens where on one fabric (ports are the fabric's own)."""

    def __init__(self) -> None:
        self._bound: dict[tuple[str, int], BoundListener] = {}
        self._ports = itertools.count(FIRST_PORT)

    def bind(
        self, host: str, port: int, listener: Listener, agent_name: str, max_bytes: int
    ) -> BoundListener:
        """Bind ``host:port`` (``port=0``: the next free port of the fabric).

        Raises:
            OSError: the address is in use (a wildcard host conflicts with any).
        """
        if port == 0:
            port = next(port for port in self._ports if not self._taken(host, port))
        elif self._taken(host, port):
            raise OSError(
                errno.EADDRINUSE,
                f"cannot bind the side channel to {host}:{port}: Address already in use",
            )
        bound = BoundListener(host, port, listener, agent_name, max_bytes)
        self._bound[(host, port)] = bound
        return bound

    def unbind(self, bound: BoundListener) -> None:
        if self._bound.get((bound.host, bound.port)) is bound:
            del self._bound[(bound.host, bound.port)]

    def at(self, host: str, port: int) -> BoundListener | None:
        """The listener a connection to ``host:port`` reaches, if any."""
        for key in [(host, port), *((wildcard, port) for wildcard in _WILDCARDS)]:
            if key in self._bound:
                return self._bound[key]
        return None

    def _taken(self, host: str, port: int) -> bool:
        return any(
            p == port and (h == host or h in _WILDCARDS or host in _WILDCARDS)
            for h, p in self._bound
        )


@attrs.define(eq=False)
class _Exchange:
    """One request on its way: tried until it is answered (no I/O; see :meth:`attempt`)."""

    peer: Peer
    payload: bytes
    log: ConnectionLog
    sent_at: float
    """When the current round was sent (a drop starts a new round)."""

    def attempt(self, fabric: MemoryFabric) -> bytes | float:
        """Try now: the reply, or the time to try again (``math.inf``: never)."""
        now = trio.current_time()
        engine_id, host, port = self.peer
        bound = fabric._addresses.at(host, port)
        faults = fabric._side_channel_faults(bound, engine_id)
        if faults.unreachable:
            return now + RECONNECT_INTERVAL  # (a partition: nothing to see)
        if bound is None or faults.refuse:
            self.log.record(zmq.EVENT_CONNECT_RETRIED, 0)
            return now + RECONNECT_INTERVAL
        self.log.record(zmq.EVENT_CONNECTED, 0)
        self.log.record(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
        if faults.mute:
            return math.inf
        if len(self.payload) > bound.max_message_bytes:
            return self._dropped(now)  # (the listener's MAXMSGSIZE)
        if now < self.sent_at + faults.reply_delay:
            return self.sent_at + faults.reply_delay
        reply = bound.listener.answer(self.payload)
        if len(reply) > self.log.max_reply_bytes:
            return self._dropped(now)  # (ours)
        return reply

    def _dropped(self, now: float) -> float:
        self.log.record(zmq.EVENT_DISCONNECTED, 0)
        self.sent_at = now + RETRY_DELAY  # (a new round, sent then)
        return self.sent_at


class MemorySideChannel:
    """One connector's side channel on a :class:`~trio_pd.testing.MemoryFabric`
    (see the module docstring); made by :meth:`MemoryFabric.side_channel`."""

    def __init__(self, fabric: MemoryFabric, agent_name: str, config: ConnectorConfig) -> None:
        if config.auth is not None:
            raise ValueError(
                "the in-memory side channel has no CURVE: test ConnectorConfig.auth on "
                "the ZeroMQ side channel (leave side_channel out)"
            )
        self._fabric = fabric
        self._agent_name = agent_name
        self._config = config
        self._closed = False

    async def serve(
        self,
        host: str,
        port: int,
        listener: Listener,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind ``host:port`` on the fabric until cancelled (requests are answered
        in the requesters' tasks, by ``listener.answer``)."""
        bound = self._fabric._addresses.bind(
            host, port, listener, self._agent_name, self._config.max_message_bytes
        )
        try:
            listener.bound((bound.host, bound.port))
            task_status.started((bound.host, bound.port))
            await trio.sleep_forever()
        finally:
            self._fabric._addresses.unbind(bound)

    async def serve_auth(
        self, listener: Listener, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        raise AssertionError("unreachable: a configuration with auth is refused")

    async def request(self, peer: Peer, payload: bytes, log: ConnectionLog) -> bytes:
        """Send ``payload`` to the listener at ``peer``'s address, until answered."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise ValueError("the side channel is closed")
        self._fabric.side_channel_requests += 1
        return await self._run(_Exchange(peer, payload, log, trio.current_time()))

    async def _run(self, exchange: _Exchange, retry_at: float | None = None) -> bytes:
        """Attempt ``exchange`` until it is answered (from ``retry_at``, if one
        attempt was made already); always a checkpoint."""
        if retry_at is None:
            await trio.lowlevel.checkpoint()
            result = exchange.attempt(self._fabric)
        else:
            result = retry_at
        while not isinstance(result, bytes):
            await trio.sleep_until(result)
            result = exchange.attempt(self._fabric)
        return result

    def confirmations(self, engine_id: str, agent_name: str) -> MemoryConfirmations:
        return MemoryConfirmations(self, engine_id, agent_name, self._config)

    def close(self) -> None:
        self._closed = True


@attrs.define(eq=False)
class _InFlight:
    exchange: _Exchange
    retry_at: float


class MemoryConfirmations(Confirmations):
    """Confirmations over the fabric: each its own request, answered at once
    when the producer can be reached with no delay, else when its pull waits."""

    def __init__(
        self, channel: MemorySideChannel, engine_id: str, agent_name: str, config: ConnectorConfig
    ) -> None:
        super().__init__(engine_id, agent_name, config)
        self._channel = channel
        self._in_flight: dict[int, _InFlight] = {}
        self._waits: set[trio.CancelScope] = set()

    @property
    def open_channels(self) -> int:
        return 0  # (nothing to keep open)

    def discard(self, pending: Pending) -> None:
        self._in_flight.pop(pending.seq, None)

    def close(self) -> None:
        self._closed = True
        for scope in self._waits:
            scope.cancel()

    def _post(self, pending: Pending) -> None:
        self._next_seq(pending)
        if self._closed:
            pending.finish(failure="the connector closed")
            return
        payload = protocol.encode_confirm_request(
            pending.rank[0], self._engine_id, self._agent_name, [self._entry(pending)]
        )
        if len(payload) > self._config.max_message_bytes:
            size = len(payload)
            pending.finish(failure=f"its confirmation ({size} bytes) is over max_message_bytes")
            return
        pending.sent = True
        self._channel._fabric.side_channel_requests += 1
        log = ConnectionLog(self._config.max_message_bytes)
        exchange = _Exchange(pending.rank, payload, log, pending.sent_at)
        result = exchange.attempt(self._channel._fabric)
        if isinstance(result, bytes):
            self._answered(pending, result)
        else:
            self._in_flight[pending.seq] = _InFlight(exchange, result)

    async def _wait(self, pending: Pending, deadline: float) -> None:
        in_flight = self._in_flight.get(pending.seq)
        if pending.done or in_flight is None:
            await trio.lowlevel.checkpoint()
        else:
            with trio.CancelScope(deadline=deadline) as scope:
                self._waits.add(scope)
                try:
                    data = await self._channel._run(in_flight.exchange, in_flight.retry_at)
                    self._answered(pending, data)
                    if not pending.done:  # (nothing in the reply for it)
                        await trio.sleep_forever()
                finally:
                    self._waits.discard(scope)
                    self._in_flight.pop(pending.seq, None)
        if self._closed and pending.reply is None:
            raise trio.ClosedResourceError(
                f"connector {self._engine_id!r} closed while request "
                f"{pending.request_id!r} waited for its confirmation"
            )

    def _answered(self, pending: Pending, data: bytes) -> None:
        """Finish ``pending`` with what ``data`` says of it (as ``ConfirmChannels`` does)."""
        try:
            reply = protocol.decode_confirm_reply(data, self._config.max_message_bytes)
        except ProtocolError as exc:
            logger.warning("engine %s: confirmation reply dropped: %s", pending.rank[0], exc)
            return
        if isinstance(reply, protocol.ErrorReply):
            pending.finish(failure=refusal(reply))
            return
        for answer in reply.answers:
            if answer.seq == pending.seq:
                pending.finish(answer)


if TYPE_CHECKING:

    def _conforms(channel: MemorySideChannel) -> SideChannel:  # (mypy checks the seam)
        return channel
