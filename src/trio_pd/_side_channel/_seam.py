"""The side channel's seam: what the roles need from its transport, as whole messages.

The roles speak the side-channel protocol (``_core._protocol``): a consumer
sends an encoded request to a producer rank's address and gets the encoded
reply; a producer's listener turns each request into its reply (the
decisions of ``_core._listener_rules``). Everything between -- sockets,
connections, authentication, retries -- is the transport's, behind
:class:`SideChannel`. The encoding, the checks, the deadlines and the words
of a failure stay in the shared code, so a transport replaces only the
transport.

Two implement it: ``_zmq_channel.ZmqSideChannel`` (ZeroMQ with CURVE, the
default and the only one in production) and ``trio_pd.testing``'s in-memory
one, which runs on trio's clock alone (no sockets, no threads), so that the
control plane's timeouts, backoff and leases can be tested under
``autojump_clock``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from trio_pd._config import ConnectorConfig

if TYPE_CHECKING:
    from trio_pd._side_channel._confirm import Confirmations
    from trio_pd._side_channel._fetch import ConnectionLog

Peer = tuple[str, str, int]
"""One producer rank's side channel: ``(engine_id, host, port)`` (the engine id
picks the CURVE key to expect; the host and port are where to connect)."""


class Listener(Protocol):
    """What a listener serves: the producer's side of every exchange (no I/O).

    Called on the trio thread, between checkpoints; never blocks.
    """

    def bound(self, address: tuple[str, int]) -> None:
        """The listener is bound at ``address`` (the real port if 0 was asked);
        called once, before the first request is answered."""

    def answer(self, payload: bytes) -> bytes:
        """The reply to one request (an error reply for one it does not serve)."""

    def dropped(self, why: str) -> None:
        """A message without a request envelope was dropped, unanswered."""

    def auth_refused(self, reason: str) -> None:
        """The transport's authentication refused a consumer."""


class SideChannel(Protocol):
    """One connector's side-channel transport; it owns what it opens.

    :meth:`close` (the connector's release, once no task uses the channel)
    releases the rest.
    """

    async def serve(
        self,
        host: str,
        port: int,
        listener: Listener,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind ``host:port`` (``port=0``: any free one), report the bound
        address to ``listener.bound`` and ``task_status.started``, then answer
        every request with ``listener.answer`` until cancelled.

        Raises:
            OSError: ``host:port`` cannot be bound (before ``started``).
        """

    async def serve_auth(
        self, listener: Listener, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Admit or refuse consumers for the listener (``config.auth``), until
        cancelled; started before :meth:`serve`, so that no consumer finds
        it missing. Refusals go to ``listener.auth_refused``."""

    async def request(self, peer: Peer, payload: bytes, log: ConnectionLog) -> bytes:
        """Send ``payload`` to ``peer`` and return its reply.

        Tries until a reply arrives (a producer that restarts meanwhile is
        still reached): the caller bounds it with a deadline, and on timeout
        asks ``log`` what the connection did (``log.diagnosis()``).

        Raises:
            FetchRefused: the peer refused us in a way that retrying cannot
                fix (authentication), or we have no key for it.
            ValueError: a malformed reply, or an address the transport cannot use.
        """
        ...

    def confirmations(self, engine_id: str, agent_name: str) -> Confirmations:
        """The consumer's confirmations of READs, for this connector
        (``engine_id``, whose transfer agent is ``agent_name``)."""
        ...

    def close(self) -> None:
        """Release what the channel holds; called once, after every task that
        used it ended."""


SideChannelFactory = Callable[[str, ConnectorConfig], SideChannel]
"""Makes a connector's side channel: ``factory(agent_name, config)``
(``open_connector(..., side_channel=...)``; the default is ZeroMQ's)."""
