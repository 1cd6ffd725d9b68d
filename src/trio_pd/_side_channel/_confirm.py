"""Pulls' confirmations: what a pull concludes, and long-lived DEALER sockets to producer ranks.

A pull's bytes are kept only if the producer still held them for its
request for the whole READ (see ``_exposures``: the producer pins the
exposure for the confirming READ). The confirmation is sent just before
the READ is posted and its reply awaited only once the READ has ended, so
a READ longer than one side-channel round trip waits for nothing more (the
producer's work to answer still takes CPU: on a small machine it competes
with the copy, see the performance page); a tiny READ waits for at most
the rest of that round trip.

What a pull sends and concludes from the answer is :class:`Confirmations`,
shared by every side channel (``_seam``); how a confirmation travels is its
subclass's. :class:`ConfirmChannels` is ZeroMQ's (the trio shell below);
``trio_pd.testing``'s in-memory side channel answers each confirmation at
once.

A fresh socket per confirmation (as the handshakes and heartbeats use)
would cost a TCP and ZMTP handshake (and a CURVE one) per pull, so each
producer rank gets one DEALER socket, kept while pulls use it (at most
:data:`MAX_CHANNELS`, the least recently used idle one closed past that).
Sends are made by the pulling tasks themselves (``NOBLOCK``; the socket's
queue is unbounded, so a send never fails for lack of room: what waits
there is bounded by the pulls in flight): at once when no request of that
channel waits for its answer, else queued and sent together with the others
when it comes, or when one of their pulls needs its answer (one message,
and one answer, for many pulls at once). There is no reader task:
the pulls waiting for their answers receive them. One of them at a time
(the channel's *leader*) waits on the socket's file descriptor; every
waiter drains what is readable and hands each reply to the pull it answers
(by ``seq``); a leader whose answer came hands the wait on to another
waiter. (A task per channel would be runnable whenever ZeroMQ signals its
descriptor, which would keep small sequential pulls off their inline path:
those run only when no other task is runnable.)

Replies are drained :data:`DRAIN_BATCH` at a time, with a checkpoint between,
and at most :data:`RECEIVE_QUEUE` wait in the socket: a hostile producer
that floods the socket neither holds the loop nor grows memory without bound.

ZeroMQ's file descriptor is edge-triggered, and any call on the socket --
a send too -- may consume the edge the leader waits for. So after every
send the pull checks ``EVENTS``, and if a reply is readable wakes the
leader (it cancels its wait); the leader checks ``EVENTS`` before it waits
again: no reply can be missed.

Owned here: the sockets (closed by :meth:`ConfirmChannels.close`, which the
consumer's close calls, or when dropped) and the waiting pulls' slots; a
pull waiting when its channel closes raises :class:`trio.ClosedResourceError`
(the connector closed) or gets no answer (the channel was dropped after a
timeout) -- :meth:`ConfirmChannels.check` turns that into
:class:`~trio_pd.ExposureEndedError` with outcome ``"unconfirmed"``.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
from collections import OrderedDict
from typing import cast

import attrs
import trio
import zmq

from trio_pd._config import ConnectorConfig
from trio_pd._core import _protocol as protocol
from trio_pd._core._errors import ExposureEndedError, ProtocolError
from trio_pd._core._exposures import pin_covers
from trio_pd._side_channel._fetch import FetchRefused, curve_client
from trio_pd._side_channel._zmq import SocketSetups

logger = logging.getLogger("trio_pd")

EMPTY_REQUEST = len(protocol.encode_confirm_request("", "", "", []))

DRAIN_BATCH = 256
"""Replies handed out per drain before the draining task checkpoints."""

RECEIVE_QUEUE = 65536
"""Replies ZeroMQ keeps for a confirmation socket before it drops more (a
producer answers once per request: only a hostile one gets near it)."""

MAX_CHANNELS = 64
"""Confirmation sockets kept open at once (one per producer rank pulled from
lately); past it, the least recently used idle one is closed."""

Rank = tuple[str, str, int]
"""One producer rank: ``(engine_id, host, port)``."""


@attrs.define(eq=False)
class Pending:
    """One confirmation in flight: what the pull waits on."""

    rank: Rank
    request_id: str
    token: str = attrs.field(repr=False)
    incarnation: str
    digest: bytes
    nonce: int
    exposure: int = 0
    seq: int = -1
    sent_at: float = 0.0
    """When it was posted (it may have been sent later, with a batch)."""
    sent: bool = False
    batch: int = -1
    """The ``seq`` of the first entry of the request it was sent in."""
    size: int = 0
    """The bytes its entry adds to a request (see ``ConfirmChannels._size``)."""
    channel: _Channel | None = attrs.field(default=None, repr=False)
    done: bool = False
    """Answered, or no answer will come (``failure`` says why)."""
    wake: trio.Event | None = attrs.field(default=None, repr=False)
    """Set when it is answered, or when the leader's wait is handed to it."""
    reply: protocol.ConfirmAnswer | None = None
    failure: str = ""
    """Why no reply will come (an error reply, the channel closed)."""

    def finish(self, reply: protocol.ConfirmAnswer | None = None, failure: str = "") -> None:
        self.done = True
        self.reply = reply
        self.failure = self.failure or failure
        if self.wake is not None:
            self.wake.set()


@attrs.define(eq=False)
class _Channel:
    rank: Rank
    socket: zmq.Socket[bytes]
    fd: int
    waiting: dict[int, Pending] = attrs.field(factory=dict)
    """Posted and not answered yet, by ``seq`` (queued ones too)."""
    queued: list[Pending] = attrs.field(factory=list)
    """Posted while a request was in flight: sent together, when its answer
    comes (or when one of their pulls needs its own answer)."""
    unanswered: dict[int, int] = attrs.field(factory=dict)
    """Requests sent whose entries still wait: each by the ``seq`` of its
    first entry, and how many of its entries wait. A request counts as in
    flight while one of its pulls still waits for it, so that a reply the
    network lost does not keep later confirmations queued for good."""
    envelope: int = 0
    """The encoded size of a request of no entries, from us to this rank."""
    checking: dict[int, Pending] = attrs.field(factory=dict)
    """Those of ``waiting`` whose pulls wait for the answer now."""
    leader: Pending | None = None
    """The one waiting on the file descriptor."""
    wait_scope: trio.CancelScope | None = None
    """The leader's wait for the fd: cancelled by a send that left a reply readable."""
    closed: bool = False


_ENDED_REASONS = {
    "expired": "its exposure expired before the READ ended (lease not renewed, or abort_timeout)",
    "abandoned": "its exposure was abandoned",
    "read_by_others": "every consumer it was exposed for had read it",
    "unknown": "the producer does not hold these blocks for this request "
    "(never exposed with them, or ended long ago)",
    "too_many_pins": "too many agents were reading it",
    "refused": "the producer refused its token",
    "restarted": "the producer restarted since it exposed them",
}


class Confirmations(abc.ABC):
    """The consumer's confirmations of READs: what a pull sends and checks.

    The decisions are here, shared by every side channel: what a pull
    sends (:meth:`send`) and what it concludes from the answer
    (:meth:`check`: the pin covered the READ, confirm once more, or
    :class:`~trio_pd.ExposureEndedError`). How a confirmation travels and
    how its answer is awaited is the transport's (:meth:`_post`,
    :meth:`_wait`): :class:`ConfirmChannels` over ZeroMQ, batching; the
    in-memory side channel of ``trio_pd.testing`` answers each at once.

    Args:
        engine_id: this (consumer) engine's id, named in requests.
        agent_name: this connector's transfer agent: the pin is its own.
        config: ``handshake_timeout`` (how long a reply is awaited),
            ``max_message_bytes``, ``auth``.
    """

    def __init__(self, engine_id: str, agent_name: str, config: ConnectorConfig) -> None:
        self._engine_id = engine_id
        self._agent_name = agent_name
        self._config = config
        self._seq = itertools.count()
        self._closed = False

    def send(
        self,
        rank: Rank,
        request_id: str,
        token: str,
        incarnation: str,
        digest: bytes,
        nonce: int,
        exposure: int = 0,
    ) -> Pending:
        """Ask ``rank`` (now, without waiting) to confirm and pin an exposure
        for the READ whose notification carries ``nonce``.

        Raises:
            trio.ClosedResourceError: the connector is closing.
        """
        if self._closed:
            raise trio.ClosedResourceError(f"connector {self._engine_id!r} is closed")
        pending = Pending(rank, request_id, token, incarnation, digest, nonce, exposure)
        self._post(pending)
        return pending

    def is_open(self, rank: Rank) -> bool:
        """Whether a confirmation to ``rank`` goes out without anything to
        make first (:meth:`open`); the base: always."""
        return True

    async def open(self, rank: Rank) -> None:
        """Make what confirmations to ``rank`` travel on, if the transport
        needs anything made (a checkpoint). A pull calls it before
        :meth:`send` when :meth:`is_open` says no, so that a new connection
        is made where it may wait its turn; what cannot be made (no CURVE
        key for that producer, say) is not raised here: :meth:`send` fails
        its confirmation with the reason."""
        await trio.lowlevel.checkpoint()

    async def check(
        self, pending: Pending, read_done_at: float, request_id: str, local_ids: list[int]
    ) -> None:
        """Whether pull ``request_id``'s READ, which ended at ``read_done_at``,
        read its own bytes (``local_ids``: its local blocks, named in the error).

        Waits for ``pending``'s reply (up to ``handshake_timeout`` after it
        was sent); if that pin ended before the READ did, or no reply came,
        confirms once more (up to ``handshake_timeout`` again).

        Raises:
            ExposureEndedError: the producer says the exposure ended before
                the READ did, or did not answer (``outcome="unconfirmed"``).
            trio.ClosedResourceError: the connector closed meanwhile.
        """
        timeout = self._config.handshake_timeout
        await self._wait(pending, pending.sent_at + timeout)
        reply = pending.reply
        if reply is not None and reply.state == "read":
            return
        if reply is not None and reply.state == "held":
            if pin_covers(reply.held_for, pending.sent_at, read_done_at):
                return
        elif reply is not None:
            self._ended(pending, reply.state, request_id, local_ids)
        # The pin ended before the READ did, or no answer: once more, now.
        if not self.is_open(pending.rank):  # (dropped for want of an answer, say)
            await self.open(pending.rank)
        again = attrs.evolve(
            pending, seq=-1, sent=False, done=False, wake=None, reply=None, failure=""
        )
        self._post(again)
        await self._wait(again, again.sent_at + timeout)
        if again.reply is None:
            why = again.failure or pending.failure or f"no reply within {timeout:g} s"
            raise ExposureEndedError(
                request_id,
                local_ids,
                f"engine {pending.rank[0]!r} did not confirm that it still held the blocks of "
                f"request {pending.request_id!r} ({why}): not trusted",
                outcome="unconfirmed",
            )
        if again.reply.state not in ("held", "read"):
            self._ended(again, again.reply.state, request_id, local_ids)

    @property
    @abc.abstractmethod
    def open_channels(self) -> int:
        """Connections kept open for confirmations now."""

    @abc.abstractmethod
    def discard(self, pending: Pending) -> None:
        """Stop waiting for ``pending``'s answer (its READ failed)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Refuse new confirmations, release what the transport holds, and
        wake the pulls that wait for an answer (they raise
        :class:`trio.ClosedResourceError`). Idempotent; called by the
        consumer's close, before the side channel is closed."""

    @abc.abstractmethod
    def _post(self, pending: Pending) -> None:
        """Send ``pending`` (or queue it to be sent): a new ``seq`` and
        ``sent_at`` (from now), or ``finish`` it with the failure that
        keeps it from being sent. Never waits."""

    @abc.abstractmethod
    async def _wait(self, pending: Pending, deadline: float) -> None:
        """Until ``pending`` is answered (or will not be), at most until
        ``deadline``; always a checkpoint.

        Raises:
            trio.ClosedResourceError: closed and ``pending`` got no answer.
        """

    def _entry(self, pending: Pending) -> protocol.ConfirmEntry:
        return protocol.ConfirmEntry(
            pending.seq,
            pending.request_id,
            pending.token,
            pending.incarnation,
            pending.digest,
            pending.nonce,
            pending.exposure,
        )

    def _next_seq(self, pending: Pending) -> None:
        """Number ``pending`` and stamp it sent from now (the pin counts from no earlier)."""
        pending.seq = next(self._seq)
        pending.sent_at = trio.current_time()

    def _ended(self, pending: Pending, state: str, request_id: str, local_ids: list[int]) -> None:
        why = _ENDED_REASONS.get(state, state)
        raise ExposureEndedError(
            request_id,
            local_ids,
            f"engine {pending.rank[0]!r} no longer held the blocks of request "
            f"{pending.request_id!r}: {why}; what was read is not returned",
            outcome=state,
        )


def refusal(reply: protocol.ErrorReply) -> str:
    """Why no confirmation of a request answered by ``reply`` comes (it names
    no ``seq``: every confirmation of the request gets it)."""
    return f"the producer refused ({reply.code}): {reply.reason}"


class ConfirmChannels(Confirmations):
    """The consumer's confirmation sockets, one per producer rank (ZeroMQ).

    Args:
        engine_id: this (consumer) engine's id, named in requests.
        agent_name: this connector's transfer agent: the pin is its own.
        zmq_context: for the sockets.
        config: ``handshake_timeout`` (how long a reply is awaited),
            ``max_message_bytes``, ``auth``.
        setups: whose turns a new channel's socket is made in (:meth:`open`;
            the side channel's, shared with its fetches).
    """

    def __init__(
        self,
        engine_id: str,
        agent_name: str,
        zmq_context: zmq.Context[zmq.Socket[bytes]],
        config: ConnectorConfig,
        *,
        setups: SocketSetups | None = None,
    ) -> None:
        super().__init__(engine_id, agent_name, config)
        self._zmq = zmq_context
        self._setups = setups or SocketSetups()
        self._channels: OrderedDict[Rank, _Channel] = OrderedDict()
        self._opening: dict[Rank, trio.Event] = {}  # (set once that rank's open ends)

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    def is_open(self, rank: Rank) -> bool:
        return rank in self._channels

    async def open(self, rank: Rank) -> None:
        """Open ``rank``'s channel in a turn of ``setups`` (its socket is made
        in a scheduler pass of its own, :class:`~._zmq.SocketSetups`). Pulls
        to the same rank that come meanwhile wait for that one, not for
        turns of their own (a burst of first pulls to a new producer would
        otherwise take a pass each). A failure to make it is left to
        :meth:`send`, which meets it again and fails that confirmation with
        it."""
        opening = self._opening.get(rank)
        if opening is not None:  # (another pull is making it)
            await opening.wait()
            return
        self._opening[rank] = opening = trio.Event()
        try:
            async with self._setups.turn():
                if not self._closed and rank not in self._channels:
                    with contextlib.suppress(FetchRefused, zmq.ZMQError):
                        self._channel(rank)
        finally:
            del self._opening[rank]
            opening.set()

    def discard(self, pending: Pending) -> None:
        """Stop waiting for ``pending``'s answer (its READ failed)."""
        if pending.channel is not None:
            self._unwait(pending.channel, pending.seq)

    def close(self) -> None:
        """Refuse new confirmations, close every socket, and wake the pulls
        that wait for an answer (they raise :class:`trio.ClosedResourceError`).
        Idempotent; called by the consumer's close, before the ZeroMQ
        context is destroyed."""
        self._closed = True
        for channel in list(self._channels.values()):
            self._drop(channel, "the connector closed")

    # ---- internals -------------------------------------------------------

    async def _wait(self, pending: Pending, deadline: float) -> None:
        """Until ``pending`` is answered (or will not be), at most until ``deadline``.

        Drains the channel (every reply readable goes to its pull); leads
        the wait on the socket's descriptor if no one else does, else waits
        to be answered or handed the lead.
        """
        channel = pending.channel
        if channel is None or pending.done:
            await trio.lowlevel.checkpoint()
        else:
            if not pending.sent:  # (queued behind a request in flight: ours is needed now)
                self._flush(channel)
            channel.checking[pending.seq] = pending
            try:
                with trio.move_on_at(deadline) as scope:
                    await self._receive_until_done(channel, pending)
            finally:
                del channel.checking[pending.seq]
                if channel.leader is None:
                    self._hand_on(channel)
                if not pending.done:  # (our deadline, or we were cancelled)
                    self._unwait(channel, pending.seq)
            if scope.cancelled_caught and not pending.done and not channel.closed:
                # (a peer that answers nothing: a fresh socket for the next pull)
                self._drop(channel, f"no reply within {self._config.handshake_timeout:g} s")
        if self._closed and pending.reply is None:
            raise trio.ClosedResourceError(
                f"connector {self._engine_id!r} closed while request "
                f"{pending.request_id!r} waited for its confirmation"
            )

    async def _receive_until_done(self, channel: _Channel, pending: Pending) -> None:
        """Until ``pending`` is done; a checkpoint (once: a pull that waited
        for its answer is not scheduled once more when it comes)."""
        waited = False
        while True:
            self._drain(channel)
            if pending.done:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return
            waited = True
            if channel.leader is None:
                channel.leader = pending
                try:
                    with trio.CancelScope() as channel.wait_scope:
                        if self._readable(channel):
                            # (more than one drain's worth: let the others run)
                            await trio.lowlevel.checkpoint()
                        else:
                            await trio.lowlevel.wait_readable(channel.fd)
                except trio.ClosedResourceError:
                    pass  # (the channel was dropped: its waiters were finished)
                finally:
                    channel.wait_scope = None
                    channel.leader = None
            else:
                pending.wake = trio.Event()
                await pending.wake.wait()
                pending.wake = None

    def _hand_on(self, channel: _Channel) -> None:
        """Wake one pull still waiting here to take the lead."""
        for other in channel.checking.values():
            if other.wake is not None:
                other.wake.set()
                return

    def _post(self, pending: Pending) -> None:
        """Post ``pending`` (a new ``seq``, from now) on its rank's channel: sent
        at once if no request of that channel waits for its answer, else
        queued for the next one (the pulls that arrive while one request is
        in flight travel together: one message, and one answer, for many)."""
        self._next_seq(pending)
        if self._closed:  # (a confirmation sent again: no socket the close will not close)
            pending.finish(failure="the connector closed")
            return
        try:
            channel = self._channel(pending.rank)
        except (FetchRefused, zmq.ZMQError) as exc:
            pending.finish(failure=str(exc))
            return
        pending.size = size = self._size(pending)
        if channel.envelope + size > self._config.max_message_bytes:
            # (the producer's ZeroMQ would close the connection, losing the
            # other pulls' confirmations in flight on it: this one fails alone)
            pending.finish(failure=f"its confirmation ({size} bytes) is over max_message_bytes")
            return
        pending.channel = channel
        channel.waiting[pending.seq] = pending
        channel.queued.append(pending)
        if not channel.unanswered:
            self._flush(channel)

    def _size(self, pending: Pending) -> int:
        """The bytes ``pending``'s entry adds to a request (and room for the
        array's header to grow)."""
        request = protocol.encode_confirm_request("", "", "", [self._entry(pending)])
        return len(request) - EMPTY_REQUEST + 8

    def _flush(self, channel: _Channel) -> None:
        """Send what is queued on ``channel``, in requests under ``max_message_bytes``."""
        batch: list[protocol.ConfirmEntry] = []
        size = channel.envelope
        queued, channel.queued = channel.queued, []
        for pending in queued:
            if pending.done or pending.seq not in channel.waiting:
                continue  # (cancelled or failed meanwhile)
            if batch and size + pending.size > self._config.max_message_bytes:
                self._send(channel, batch)
                batch, size = [], channel.envelope
            pending.sent = True
            batch.append(self._entry(pending))
            size += pending.size
        if batch:
            self._send(channel, batch)

    def _send(self, channel: _Channel, batch: list[protocol.ConfirmEntry]) -> None:
        payload = protocol.encode_confirm_request(
            channel.rank[0], self._engine_id, self._agent_name, batch
        )
        try:
            channel.socket.send_multipart([b"", payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # (unbounded queue: only a closed socket)
            for entry in batch:
                pending = channel.waiting.pop(entry.seq, None)
                if pending is not None:
                    pending.finish(failure=f"could not send: {exc}")
            return
        channel.unanswered[batch[0].seq] = len(batch)
        for entry in batch:
            channel.waiting[entry.seq].batch = batch[0].seq
        # Our calls may have consumed the edge the leader waits for: if
        # anything is readable now, wake it (if not, the next reply makes a
        # new edge).
        if channel.wait_scope is not None and self._readable(channel):
            channel.wait_scope.cancel()

    def _channel(self, rank: Rank) -> _Channel:
        """``rank``'s channel, opened on first use.

        Raises:
            FetchRefused: no CURVE public key is configured for that producer.
            zmq.ZMQError: the address is not a valid endpoint.
        """
        channel = self._channels.get(rank)
        if channel is not None:
            self._channels.move_to_end(rank)
            return channel
        curve = curve_client(self._config, rank[0])
        raw = self._zmq.socket(zmq.DEALER)
        try:  # (a socket that cannot be set up or connected is closed at once)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.SNDHWM, 0)
            raw.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
            raw.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
            if ":" in rank[1]:
                raw.setsockopt(zmq.IPV6, 1)
            if curve is not None:
                raw.curve_publickey = curve.public_key
                raw.curve_secretkey = curve.secret_key
                raw.curve_serverkey = curve.server_key
            raw.connect(protocol.endpoint(rank[1], rank[2]))
        except BaseException:
            raw.close(linger=0)
            raise
        channel = _Channel(rank, raw, cast(int, raw.getsockopt(zmq.FD)))
        empty = protocol.encode_confirm_request(rank[0], self._engine_id, self._agent_name, [])
        channel.envelope = len(empty)
        self._channels[rank] = channel
        if len(self._channels) > MAX_CHANNELS:
            for old in list(self._channels.values()):
                if not old.waiting and old is not channel:
                    self._drop(old, "closed (least recently used)")
                    break
        return channel

    @staticmethod
    def _readable(channel: _Channel) -> bool:
        if channel.closed:
            return True  # (let the leader find out)
        return bool(cast(int, channel.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _drop(self, channel: _Channel, why: str) -> None:
        """Close ``channel``'s socket and finish whatever waits on it."""
        if channel.closed:
            return
        channel.closed = True
        if self._channels.get(channel.rank) is channel:
            del self._channels[channel.rank]
        trio.lowlevel.notify_closing(channel.fd)  # (wakes the leader)
        channel.socket.close(linger=0)
        for pending in channel.waiting.values():
            pending.finish(failure=f"the confirmation channel {why}")
        channel.waiting.clear()

    def _drain(self, channel: _Channel) -> None:
        """Hand every reply readable now to the pull it answers (and wake
        the leader if its own answer was among them: the edge it waits for
        was spent by this drain). At most :data:`DRAIN_BATCH` at a time: a
        producer that floods the socket does not hold the loop."""
        for _ in range(DRAIN_BATCH):
            if channel.closed:
                break
            try:
                frames = channel.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._dispatch(channel, frames)
        leader = channel.leader
        if leader is not None and leader.done and channel.wait_scope is not None:
            channel.wait_scope.cancel()

    def _dispatch(self, channel: _Channel, frames: list[bytes]) -> None:
        if len(frames) != 2 or frames[0] != b"":
            logger.debug("confirmations from %s: a malformed reply dropped", channel.rank[0])
            return
        try:
            reply = protocol.decode_confirm_reply(frames[1], self._config.max_message_bytes)
        except ProtocolError as exc:
            logger.warning("engine %s: confirmation reply dropped: %s", channel.rank[0], exc)
            return
        if isinstance(reply, protocol.ErrorReply):
            # (names no seq: every confirmation waiting here gets it)
            for pending in channel.waiting.values():
                pending.finish(failure=refusal(reply))
            channel.waiting.clear()
            channel.queued.clear()
            channel.unanswered.clear()
            return
        for answer in reply.answers:
            answered = self._unwait(channel, answer.seq)
            if answered is not None:
                answered.finish(answer)
        if channel.queued and not channel.unanswered:
            self._flush(channel)

    def _unwait(self, channel: _Channel, seq: int) -> Pending | None:
        """Take ``seq`` out of what waits on ``channel`` (answered, given up
        or discarded); its request stops counting once none of it waits."""
        pending = channel.waiting.pop(seq, None)
        if pending is not None and pending.batch in channel.unanswered:
            left = channel.unanswered[pending.batch] - 1
            if left:
                channel.unanswered[pending.batch] = left
            else:
                del channel.unanswered[pending.batch]
        return pending
