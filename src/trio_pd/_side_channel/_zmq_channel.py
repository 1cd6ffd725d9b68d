"""The side channel over ZeroMQ: the default transport behind the seam (trio shell).

:class:`ZmqSideChannel` owns one connector's ZeroMQ context and implements
``_seam.SideChannel`` with it:

* the listener (:meth:`ZmqSideChannel.serve`): a ROUTER socket (many
  consumers, replies routed by the peer's identity; a send to a peer that
  has gone is dropped instead of blocking), a CURVE server with
  ``config.auth``;
* the ZAP handler (:meth:`ZmqSideChannel.serve_auth`, ``_auth.serve_zap``);
* each request (:meth:`ZmqSideChannel.request`): ``_fetch.fetch_reply``'s
  rounds, each on a fresh DEALER socket watched by a monitor, a CURVE
  client with ``config.auth``;
* confirmations: ``_confirm.ConfirmChannels``, one long-lived DEALER per
  producer rank, batching.

The fetches' and the confirmation channels' sockets are made in turns of
one :class:`~._zmq.SocketSetups` (one setup per pass of trio's scheduler:
a storm of first pulls does not stall the loop making them all at once).

Every socket is closed by the task that opened it, on every exit path; the
context is destroyed by :meth:`ZmqSideChannel.close`, after them.
"""

from __future__ import annotations

import logging
import resource

import trio
import zmq
import zmq.utils.monitor

from trio_pd._config import ConnectorConfig
from trio_pd._core import _protocol as protocol
from trio_pd._side_channel._auth import serve_zap
from trio_pd._side_channel._confirm import ConfirmChannels
from trio_pd._side_channel._fetch import ConnectionLog, curve_client, fetch_reply
from trio_pd._side_channel._seam import Listener, Peer
from trio_pd._side_channel._zmq import SocketSetups, TrioZmqSocket

logger = logging.getLogger("trio_pd")


def max_sockets() -> int:
    """ZeroMQ sockets a connector's context may hold: the soft limit on open
    files (every socket needs one), between 1024 and 65536."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return min(max(soft, 1024), 65536)


class ZmqSideChannel:
    """One connector's side channel over ZeroMQ (see the module docstring).

    Args:
        config: ``max_message_bytes`` (every socket's limit), ``auth`` (CURVE).
    """

    def __init__(self, config: ConnectorConfig) -> None:
        self._config = config
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # ZeroMQ's own cap (1023 sockets) is below what a decoder of many engines
        # uses (a confirmation socket per producer rank pulled from at once): the
        # process's file limit, which bounds them anyway, is the cap instead.
        self._context.set(zmq.MAX_SOCKETS, max_sockets())
        self._setups = SocketSetups()  # (the fetches' and the confirmations' sockets)

    @classmethod
    def create(cls, agent_name: str, config: ConnectorConfig) -> ZmqSideChannel:
        """The default ``SideChannelFactory``."""
        return cls(config)

    async def serve(
        self,
        host: str,
        port: int,
        listener: Listener,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind the ROUTER socket, report the address, answer requests until cancelled.

        Messages without a request envelope are dropped (``listener.dropped``).
        Messages over ``max_message_bytes`` never reach the listener: ZeroMQ
        closes that connection. With CURVE auth, consumers the ZAP handler
        refuses never reach it either. Sends never block: ROUTER drops
        replies to peers that are gone.
        """
        socket = TrioZmqSocket(self._context.socket(zmq.ROUTER))
        async with socket:
            raw = socket.zmq_socket
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
            if ":" in host:
                raw.setsockopt(zmq.IPV6, 1)
            if self._config.auth is not None:
                self._config.auth.configure_server(raw)
            try:
                raw.bind(protocol.endpoint(host, port or "*"))
            except zmq.ZMQError as exc:
                raise OSError(
                    exc.errno, f"cannot bind the side channel to {host}:{port}: {exc}"
                ) from exc
            endpoint = raw.getsockopt_string(zmq.LAST_ENDPOINT)
            address = (host, int(endpoint.rsplit(":", 1)[1]))
            listener.bound(address)
            async with trio.open_nursery() as nursery:
                if self._config.auth is not None:
                    monitor = TrioZmqSocket(raw.get_monitor_socket(_FAILED_HANDSHAKES))
                    nursery.start_soon(_count_failed_handshakes, monitor, listener)
                task_status.started(address)
                while True:
                    frames = await socket.receive_multipart()
                    if len(frames) != 3 or frames[1] != b"":
                        listener.dropped(f"a message of {len(frames)} frames")
                        continue
                    await socket.send_multipart([frames[0], b"", listener.answer(frames[2])])

    async def serve_auth(  # noqa: ASYNC128 -- task_status is handed on
        self, listener: Listener, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The ZAP handler (``_auth.serve_zap``) for ``config.auth``'s allowed consumers."""
        assert self._config.auth is not None
        allowed = self._config.auth.allowed()
        await serve_zap(self._context, allowed, listener.auth_refused, task_status=task_status)

    async def request(self, peer: Peer, payload: bytes, log: ConnectionLog) -> bytes:
        """``_fetch.fetch_reply``: rounds on fresh DEALER sockets until a reply;
        an invalid endpoint's :class:`zmq.ZMQError` is raised as a ``ValueError``."""
        engine_id, host, port = peer
        try:
            return await fetch_reply(
                self._context,
                protocol.endpoint(host, port),
                payload,
                log,
                ipv6=":" in host,
                curve=curve_client(self._config, engine_id),
                setups=self._setups,
            )
        except zmq.ZMQError as exc:
            raise ValueError(str(exc)) from exc

    def confirmations(self, engine_id: str, agent_name: str) -> ConfirmChannels:
        return ConfirmChannels(
            engine_id, agent_name, self._context, self._config, setups=self._setups
        )

    def close(self) -> None:
        """Destroy the context (every socket of ours is closed by then)."""
        self._context.destroy(linger=0)


_FAILED_HANDSHAKES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
"""A handshake that failed before ZAP was asked, or without a ZAP verdict (ZAP's
own refusals are ``EVENT_HANDSHAKE_FAILED_AUTH``, counted by the handler)."""


async def _count_failed_handshakes(monitor: TrioZmqSocket, listener: Listener) -> None:
    """Count the peers refused before ZAP is asked (a plain-text peer at a CURVE
    listener, a broken handshake) as the ZAP handler counts its refusals
    (``listener.auth_refused``), until cancelled; owns ``monitor``."""
    async with monitor:
        monitor.zmq_socket.setsockopt(zmq.LINGER, 0)
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await monitor.receive_multipart())
            if event["event"] & _FAILED_HANDSHAKES:
                what = zmq.Event(event["event"]).name
                listener.auth_refused(f"a handshake failed ({what}, {event['value']:#x})")
