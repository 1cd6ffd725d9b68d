"""Consumer side of the side channel: fetch one engine's metadata reply.

A fetch is one request/reply over a fresh DEALER socket, watched by a ZeroMQ
socket monitor so that a failure can be *named*: connection refused, a peer
that accepts and never answers, a peer that drops the connection before
replying (for instance because its reply exceeds our size limit), a CURVE
authentication failure. :class:`ConnectionLog` (no I/O) turns the monitor's
events into that diagnosis; :func:`fetch_reply` is the trio shell.

:func:`fetch_engine_metadata` is the whole metadata step of a handshake: the
fetch under ``handshake_timeout``, then the reply's checks, with every failure
mapped (in one place, :func:`_failures`) to a :class:`FetchFailure` that
carries its :class:`FailureCause` and the :class:`HandshakeError` for the
waiting pulls. :func:`fetch_reply` alone leaves the deadline to the caller,
who asks the log what happened on timeout. Rounds end early only for causes that waiting cannot fix
(authentication or security-mechanism failures); a dropped connection starts
a new round with a fresh socket, so a producer that restarts within the
deadline is still reached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from trio_pd._core import _protocol as protocol
from trio_pd._core._errors import HandshakeError, IncompatibleEngineError, ProtocolError
from trio_pd._core._remote_engine import EngineRecord, FailureCause
from trio_pd._core._tensor_parallel import tp_mismatch
from trio_pd._exception_groups import unwrapped_errors
from trio_pd._side_channel._zmq import SocketSetups, TrioZmqSocket

if TYPE_CHECKING:
    from trio_pd._config import ConnectorConfig
    from trio_pd._core._layout import KVLayout
    from trio_pd._side_channel._seam import SideChannel

RETRY_DELAY = 0.1
"""Pause between rounds after the peer dropped the connection."""

_MONITORED = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class FetchRefused(Exception):
    """The peer refused us in a way that retrying cannot fix; ``str`` says why."""


class FetchFailure(Exception):
    """The metadata step of a handshake failed.

    Attributes:
        cause: why, for the statistics.
        error: what every pull waiting on the attempt raises.
    """

    def __init__(self, cause: FailureCause, error: HandshakeError) -> None:
        super().__init__(str(error))
        self.cause = cause
        self.error = error


@attrs.define
class ConnectionLog:
    """What the monitor saw during one fetch, across its rounds (no I/O).

    Attributes:
        max_reply_bytes: our reply size limit, named in the diagnosis of drops.
        curve: the fetch uses CURVE (set by :func:`fetch_reply`): only then can a
            security handshake that fails without detail be a key mismatch.
    """

    max_reply_bytes: int
    waiting_for_slot: bool = False
    """The attempt never got a fetch slot (one of the ``max_concurrent_fetches``
    fetch workers, shared by every engine's handshakes): nothing was sent."""
    load_bytes_queued: int = 0
    """With ``waiting_for_slot``: the agent metadata waiting for the load thread
    then, if the fetch workers were holding back for it (else 0)."""
    curve: bool = False
    handshakes_lost: int = 0
    """ZeroMQ handshakes that ended without detail on a plain-text socket: the
    connection closed under them (the peer exiting, say); ZeroMQ retries."""
    refused: int = 0
    tcp_connected: int = 0
    connected: int = 0
    dropped: int = 0
    fatal: str | None = None
    in_session: bool = False

    def record(self, event: int, value: int) -> None:
        """Account for one monitor event."""
        if event == zmq.EVENT_CONNECT_RETRIED:
            self.refused += 1
        elif event == zmq.EVENT_CONNECTED:
            self.tcp_connected += 1
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected += 1
            self.in_session = True
        elif event == zmq.EVENT_DISCONNECTED and self.in_session:
            self.dropped += 1
            self.in_session = False
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.fatal = (
                f"the producer rejected our CURVE key (ZAP status {value}): "
                "this consumer is not in its allowlist"
            )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self.fatal = (
                    "security mechanism mismatch: one side uses CURVE authentication, "
                    "the other does not"
                )
            else:
                self.fatal = f"ZeroMQ handshake failed (protocol error {value:#x})"
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not self.curve:
            self.handshakes_lost += 1  # (no keys to mismatch: the connection closed)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.fatal = (
                "the ZeroMQ security handshake failed: the CURVE keys or mechanisms do "
                "not match (wrong producer key, or only one side uses CURVE)"
            )

    def ends_round(self, event: int) -> bool:
        """Whether the current round is over (the reply will not come on this socket)."""
        return self.fatal is not None or (event == zmq.EVENT_DISCONNECTED and self.connected > 0)

    def diagnosis(self) -> str:
        """The likeliest cause of a missing reply, in words."""
        if self.waiting_for_slot:
            held = (
                f", or held back while {self.load_bytes_queued / (1 << 20):.1f} MiB of agent "
                "metadata waited for the load thread"
            )
            return (
                "nothing was sent: every fetch slot (max_concurrent_fetches) stayed busy "
                "with other handshakes" + (held if self.load_bytes_queued else "")
            )
        if self.fatal is not None:
            return self.fatal
        if self.dropped:
            return (
                f"the peer closed the connection {self.dropped} time(s) before replying "
                f"(is its reply over our {self.max_reply_bytes}-byte limit?)"
            )
        if self.connected:
            return "connected, but the peer never replied"
        if self.handshakes_lost:
            return (
                f"the connection closed during ZeroMQ's handshake {self.handshakes_lost} "
                "time(s) (the peer exited or restarted?)"
            )
        if self.tcp_connected:
            return (
                "the TCP connection was accepted, but the ZeroMQ handshake never "
                "completed (is that port a trio_pd side channel?)"
            )
        if self.refused:
            return f"connection refused ({self.refused} attempts)"
        return "could not connect"


@attrs.frozen
class CurveClient:
    """CURVE keys for one fetch: ours, and the producer's public key (z85)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes


async def fetch_reply(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    request: bytes,
    log: ConnectionLog,
    *,
    ipv6: bool = False,
    curve: CurveClient | None = None,
    setups: SocketSetups | None = None,
) -> bytes:
    """Send ``request`` to ``endpoint`` and return the reply payload.

    Runs rounds (fresh socket each) until a reply arrives; the caller bounds
    it with a deadline. Every socket is closed on every exit. Each round's
    sockets are made in a turn of ``setups`` (the connector's: one setup per
    scheduler pass; none given, a turn of their own).

    Raises:
        FetchRefused: authentication or mechanism failure (``log.fatal``).
        ValueError: a malformed reply envelope (not ``[b"", payload]``).
        zmq.ZMQError: the endpoint is invalid.
    """
    log.curve = curve is not None
    setups = setups or SocketSetups()
    while True:
        reply = await _one_round(context, endpoint, request, log, ipv6, curve, setups)
        if reply is not None:
            return reply
        if log.fatal is not None:
            raise FetchRefused(log.fatal)
        await trio.sleep(RETRY_DELAY)


async def _one_round(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    request: bytes,
    log: ConnectionLog,
    ipv6: bool,
    curve: CurveClient | None,
    setups: SocketSetups,
) -> bytes | None:
    with contextlib.ExitStack() as sockets:  # (closed on every exit, the monitor first)
        async with setups.turn():  # (made in a scheduler pass of their own)
            raw = context.socket(zmq.DEALER)
            dealer = TrioZmqSocket(raw)
            sockets.callback(dealer.close)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.MAXMSGSIZE, log.max_reply_bytes)
            if ipv6:
                raw.setsockopt(zmq.IPV6, 1)
            if curve is not None:
                raw.curve_publickey = curve.public_key
                raw.curve_secretkey = curve.secret_key
                raw.curve_serverkey = curve.server_key
            monitor = TrioZmqSocket(raw.get_monitor_socket(_MONITORED))
            sockets.callback(monitor.close)
            sockets.callback(raw.disable_monitor)
            raw.connect(endpoint)
        result: list[bytes] = []
        async with unwrapped_errors(), trio.open_nursery() as nursery:

            async def watch() -> None:
                while True:
                    event = parse_monitor_message(await monitor.receive_multipart())
                    log.record(event["event"], event["value"])
                    if log.ends_round(event["event"]):
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)
            await dealer.send_multipart([b"", request])
            frames = await dealer.receive_multipart()
            if len(frames) != 2 or frames[0] != b"":
                raise ValueError(f"malformed reply: {len(frames)} frames, expected 2")
            result.append(frames[1])
            nursery.cancel_scope.cancel()
        # (closed in a turn too when the round ended -- a reply, or the monitor
        # ended it --: a storm's replies come together; on an error or a
        # cancellation, at once, as the stack unwinds)
        async with setups.turn():
            sockets.close()
        return result[0] if result else None


@contextmanager
def _failures(engine_id: str, where: str, log: ConnectionLog, timeout: float) -> Iterator[None]:
    """The one table from what the metadata step can raise to a cause and an error."""
    try:
        yield
    except trio.TooSlowError:
        raise _timed_out(engine_id, where, log, timeout) from None
    except FetchRefused as exc:
        error = HandshakeError(engine_id, f"{where}: {exc}")
        raise FetchFailure(FailureCause.REFUSED, error) from None
    except IncompatibleEngineError as exc:
        raise FetchFailure(FailureCause.INCOMPATIBLE, exc) from None
    except HandshakeError as exc:
        raise FetchFailure(FailureCause.PROTOCOL, exc) from None
    except ValueError as exc:
        error = HandshakeError(engine_id, f"{where}: {exc}")
        raise FetchFailure(FailureCause.PROTOCOL, error) from None


async def fetch_engine_metadata(
    side_channel: SideChannel,
    engine_id: str,
    host: str,
    port: int,
    *,
    tp_rank: int,
    tp_size: int,
    consumer_engine_id: str,
    local_layout: KVLayout,
    local_tp: int,
    compat_hash: str,
    config: ConnectorConfig,
    deadline: float,
) -> tuple[protocol.EngineMetadata, KVLayout]:
    """Fetch rank ``tp_rank`` of ``engine_id``'s metadata from ``host:port`` and check it.

    The request goes over ``side_channel`` and must be answered by
    ``deadline`` (trio's clock: the handshake's start plus
    ``config.handshake_timeout``); then the reply is decoded and
    checked (version, compatibility hash, engine id, rank and TP size, then
    the layout against ours, ``local_tp`` being our TP size).

    Raises:
        FetchFailure: with the cause and the HandshakeError (or
            IncompatibleEngineError) that names what went wrong.
    """
    log = ConnectionLog(config.max_message_bytes)
    where = _where(host, port, tp_rank, tp_size)
    with _failures(engine_id, where, log, config.handshake_timeout):
        with trio.fail_at(deadline):
            data = await side_channel.request(
                (engine_id, host, port), protocol.encode_request(engine_id, consumer_engine_id), log
            )
        metadata = protocol.decode_reply(
            data,
            expected_engine_id=engine_id,
            local_hash=compat_hash,
            max_bytes=config.max_message_bytes,
        )
        try:
            layout = metadata.layout()
        except ProtocolError as exc:
            raise HandshakeError(engine_id, str(exc)) from None
        if (metadata.tp_rank, metadata.tp_size) != (tp_rank, tp_size):
            raise IncompatibleEngineError(
                engine_id,
                f"{where} answers as rank {metadata.tp_rank} of {metadata.tp_size}, "
                f"the request expects rank {tp_rank} of {tp_size}",
            )
        mismatch = tp_mismatch(local_layout, local_tp, layout, tp_size)
        if mismatch is not None:
            raise IncompatibleEngineError(engine_id, mismatch)
    return metadata, layout


def unsent_failure(
    record: EngineRecord, tp_rank: int, tp_size: int, timeout: float, held_back_for: int = 0
) -> FetchFailure:
    """The failure of ``record``'s attempt that got no fetch slot before its
    deadline: the cause and words of a fetch that timed out, nothing sent.
    ``held_back_for``: the bytes of agent metadata the fetch workers were
    holding back for (0: they were not)."""
    log = ConnectionLog(0, waiting_for_slot=True, load_bytes_queued=held_back_for)
    where = _where(record.host, record.port, tp_rank, tp_size)
    return _timed_out(record.engine_id, where, log, timeout)


def _timed_out(engine_id: str, where: str, log: ConnectionLog, timeout: float) -> FetchFailure:
    reason = f"no reply from {where} within {timeout:g} s: {log.diagnosis()}"
    return FetchFailure(FailureCause.TIMEOUT, HandshakeError(engine_id, reason))


def _where(host: str, port: int, tp_rank: int, tp_size: int) -> str:
    return f"{host}:{port}" + (f" (rank {tp_rank} of {tp_size})" if tp_size > 1 else "")


def curve_client(config: ConnectorConfig, engine_id: str) -> CurveClient | None:
    """Our CURVE keys for reaching ``engine_id``'s side channel (``None`` without auth).

    Raises:
        FetchRefused: no public key is configured for that producer.
    """
    auth = config.auth
    if auth is None:
        return None
    server_key = auth.producer_key(engine_id)
    if server_key is None:
        raise FetchRefused("no CURVE public key configured for this producer")
    return CurveClient(auth.public_key.encode(), auth.secret_key.encode(), server_key.encode())
