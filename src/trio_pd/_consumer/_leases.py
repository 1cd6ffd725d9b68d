"""The consumer's holds on remote exposures: heartbeats and abandons (trio shell).

A *hold* (:meth:`trio_pd.Connector.hold`) says "this consumer means to read
these blocks": while it lasts, the *heartbeat task* (:meth:`Leases.run`)
renews the exposure's lease on every producer rank the pull would read (see
``_tensor_parallel.plan_pull``), so that the producer keeps the blocks however long the
request waits in the decode engine's queue, up to the producer's
``abort_timeout``. Each round sends ONE lease request per producer rank,
naming every request held there, to all ranks concurrently, each under its
own deadline (``heartbeat_interval``), so an unreachable producer never
delays the others.

A hold ends *completed* when a pull of its blocks succeeds inside it (the
pull's notification releases the exposure), else *abandoned*: the producer
ranks are told, best effort, that this consumer will not read, so they free
the blocks at once instead of when the lease runs out. The abandon names
this agent's confirmed READs of the request that stopped without reading
(``_settlement.SettledReads``: a pull cancelled or failed inside the hold),
so that their pins end too; a READ that could not be stopped keeps its pin. That message is sent
by the *abandon task* (also in :meth:`Leases.run`), not in the exit: a
request that failed because its producer is gone fails at once, instead of
waiting up to ``handshake_timeout`` for a courtesy to a dead peer.
:meth:`Leases.abandon` sends one on demand, and waits for it. Closing the
connector does not drop them: the abandons queued and in flight go on,
concurrently, until ``close_timeout`` after :meth:`Leases.begin_close`.

Every exchange is one request/reply over the side channel
(``_side_channel._seam.SideChannel.request``; ZeroMQ: ``_fetch``'s rounds on
fresh DEALER sockets, CURVE included, closed on every exit path). What the producer
decides is in ``_listener_rules`` and ``_exposures``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager

import attrs
import msgspec
import trio
from trio_util import AsyncValue

from trio_pd._config import ConnectorConfig
from trio_pd._consumer._settlement import SettledReads
from trio_pd._core import _protocol as protocol
from trio_pd._core._errors import IncompatibleEngineError, ProtocolError
from trio_pd._core._public_values import RemoteBlocks
from trio_pd._core._tensor_parallel import plan_pull, readers_per_remote_rank, sizes_mismatch
from trio_pd._side_channel._fetch import ConnectionLog, FetchRefused
from trio_pd._side_channel._seam import SideChannel

logger = logging.getLogger("trio_pd")

MAX_BACKGROUND_ABANDONS = 64
"""Abandons the lease task sends at once (each a socket for up to ``handshake_timeout``)."""

Rank = tuple[str, str, int]
"""One producer rank: ``(engine_id, host, port)``."""


@attrs.define(eq=False)
class _Hold:
    """One held request: its lease entry per producer rank it reads."""

    remote: RemoteBlocks
    entries: dict[Rank, protocol.LeaseEntry]
    lost: set[Rank] = attrs.field(factory=set)
    """Ranks that answered that the request is unknown there, or refused it."""
    done: bool = False
    """Pulled, or abandoned already: nothing more to send."""
    lost_reason: str = ""
    """Why the first rank that said so no longer holds the request for us."""


@attrs.define
class LeaseCounters:
    heartbeats_sent: int = 0
    abandons_sent: int = 0
    abandons_failed: int = 0


class Leases:
    """The consumer's holds, and the heartbeat task that renews their leases.

    Owns the holds and (while a round or an abandon runs) its side-channel
    exchanges; :meth:`run` must run in the connector's nursery.

    Args:
        engine_id: this (consumer) engine's id, named in lease requests.
        agent_name: this connector's transfer agent: the producer counts an
            abandon for it as it counts its notifications.
        tp_rank, tp_size: this rank of the consumer engine, and how many it has.
        side_channel: where heartbeats and abandons go.
        config: ``heartbeat_interval``, ``handshake_timeout`` (abandons),
            ``max_message_bytes``, ``auth``.
        settled_reads: this connector's confirmed READs that ended without
            reading (the pulls' record): an abandon names those of its
            request, so that the producer ends their pins.
    """

    def __init__(
        self,
        engine_id: str,
        agent_name: str,
        tp_rank: int,
        tp_size: int,
        side_channel: SideChannel,
        config: ConnectorConfig,
        settled_reads: SettledReads | None = None,
    ) -> None:
        self._engine_id = engine_id
        self._agent_name = agent_name
        self._settled_reads = SettledReads() if settled_reads is None else settled_reads
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._side_channel = side_channel
        self._config = config
        self._holds: dict[RemoteBlocks, _Hold] = {}
        self._by_rank: dict[Rank, dict[RemoteBlocks, _Hold]] = {}
        self._hold_added = trio.Event()
        self._failing: set[Rank] = set()
        self._closed = False
        self._close_deadline = math.inf  # (close_timeout after begin_close)
        self._abandoning: set[trio.CancelScope] = set()  # (one per rank of an abandon)
        # The abandon task's scope: shielded, so that the connector's close does
        # not cancel the abandons it sends (each ends by _close_deadline).
        self._sender_scope = trio.CancelScope(shield=True)
        self._abandons_in_flight: AsyncValue = AsyncValue(0)
        # Holds that ended without a pull: (remote, ranks) for the abandon task.
        self._to_abandon, self._abandons = trio.open_memory_channel[
            tuple[RemoteBlocks, list[Rank]]
        ](math.inf)
        self.counters = LeaseCounters()

    @property
    def holds_active(self) -> int:
        return len(self._holds)

    # ---- public (through the Connector facade) ---------------------------

    @asynccontextmanager
    async def hold(self, remote: RemoteBlocks) -> AsyncIterator[None]:
        """See :meth:`trio_pd.Connector.hold`."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        if remote in self._holds:
            raise ValueError(f"request {remote.request_id!r} of {remote.engine_id!r} is held")
        hold = _Hold(remote, self._entries(remote, abandon=False))
        self._holds[remote] = hold
        for rank in hold.entries:
            self._by_rank.setdefault(rank, {})[remote] = hold
        self._hold_added.set()
        try:
            yield
        finally:
            del self._holds[remote]
            self._unindex(hold, hold.entries)
            if not (hold.done or self._closed):
                hold.done = True
                ranks = [rank for rank in hold.entries if rank not in hold.lost]
                # (the abandon task sends it: the exit returns at once)
                self._to_abandon.send_nowait((remote, ranks))

    def lost(self, remote: RemoteBlocks) -> str | None:
        """Why the producer no longer holds ``remote`` for us, if a hold on it
        heard so (``None``: not held, or not known to be lost)."""
        if not self._holds:  # (most pulls: no hash of ``remote`` to compute)
            return None
        hold = self._holds.get(remote)
        if hold is None or not hold.lost:
            return None
        return hold.lost_reason or "its lease was answered as not pending"

    def pulled(self, remote: RemoteBlocks) -> None:
        """A pull of ``remote`` succeeded: its hold (if any) is complete."""
        if not self._holds:
            return
        hold = self._holds.get(remote)
        if hold is not None and not hold.done:
            hold.done = True
            self._unindex(hold, hold.entries)

    async def abandon(self, remote: RemoteBlocks) -> None:
        """See :meth:`trio_pd.Connector.abandon`."""
        self._check_open()
        ranks = list(self._entries(remote, abandon=False))
        hold = self._holds.get(remote)
        if hold is not None:
            hold.done = True
            self._unindex(hold, hold.entries)
        await self._abandon(remote, ranks)

    def begin_close(self) -> None:
        """Refuse new holds and abandons; holds that end from now on send nothing.

        The abandons already queued (holds left without a pull) and those in
        flight, in the abandon task or in callers' tasks, go on -- the abandon
        task is shielded from the connector's cancellation -- and end by
        ``close_timeout`` from now: one not answered by then is logged and
        counted in ``abandons_failed`` (its lease expires on its own). The
        abandon task ends once it sent the queue; :meth:`wait_idle` waits for
        the abandons in callers' tasks. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._close_deadline = trio.current_time() + self._config.close_timeout
        for scope in self._abandoning:
            scope.deadline = min(scope.deadline, self._close_deadline)
        self._to_abandon.close()  # (the abandon task sends what is queued, then ends)

    async def wait_idle(self) -> None:
        """Until no abandon runs in a caller's task (their sockets are closed).

        The connector waits for this before it closes the side channel
        (ZeroMQ: destroys the context): destroying the context under a
        socket in use closes that socket's fd behind trio's back, and the fd
        number, reused by the next socket, then confuses trio's I/O in
        another task (found by the chaos suite).
        """
        await self._abandons_in_flight.wait_value(lambda n: n == 0)

    # ---- the heartbeat task ----------------------------------------------

    async def run(self) -> None:
        """Renew the leases of every held request until cancelled (the
        connector's close), and send the abandons of holds that ended
        without a pull, until close has sent them too (see :meth:`begin_close`:
        they end by ``close_timeout`` after it).

        While anything is held: a round at once, then one every
        ``heartbeat_interval``; a round never takes longer than that, so a
        dead producer does not shift the schedule. Each abandon runs in a
        task of its own (bounded by ``handshake_timeout``), as soon as its
        hold ends.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_abandons)
            try:
                await self._renew_rounds()
            finally:  # (cancelled: the connector closes; begin_close came first, normally)
                self.begin_close()

    async def _send_abandons(self) -> None:
        # At most MAX_BACKGROUND_ABANDONS at once (each holds a socket for up
        # to handshake_timeout when its producer is gone); the rest wait here.
        # Shielded: after begin_close it sends the queue, each abandon ending
        # by the close's deadline, and ends when the queue is empty.
        slots = trio.Semaphore(MAX_BACKGROUND_ABANDONS)

        async def send(remote: RemoteBlocks, ranks: list[Rank]) -> None:
            try:
                await self._abandon(remote, ranks)
            finally:
                slots.release()

        with self._sender_scope:
            async with trio.open_nursery() as nursery:
                async for remote, ranks in self._abandons:
                    await slots.acquire()
                    nursery.start_soon(send, remote, ranks)

    async def _renew_rounds(self) -> None:
        interval = self._config.heartbeat_interval
        while True:
            if not self._by_rank:
                self._hold_added = trio.Event()
                await self._hold_added.wait()
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for rank, holds in self._by_rank.items():
                    nursery.start_soon(self._renew, rank, list(holds.values()))
            await trio.sleep_until(started + interval)

    async def _renew(self, rank: Rank, holds: list[_Hold]) -> None:
        """One round's heartbeat to one producer rank, within ``heartbeat_interval``."""
        interval = self._config.heartbeat_interval
        log = ConnectionLog(self._config.max_message_bytes)
        failure: str | None = None
        with trio.move_on_after(interval) as scope:
            for request, batch in self._requests(rank, holds):
                self.counters.heartbeats_sent += 1
                log = ConnectionLog(self._config.max_message_bytes)
                reply = await self._exchange(rank, request, log)
                if isinstance(reply, str):
                    failure = reply
                    break
                self._mark_lost(rank, batch, reply)
        if scope.cancelled_caught:
            failure = f"no reply within {interval:g} s: {log.diagnosis()}"
        if failure is None:
            if rank in self._failing:
                self._failing.discard(rank)
                logger.info("engine %s: lease heartbeats reach %s again", rank[0], _where(rank))
        elif rank not in self._failing:
            self._failing.add(rank)
            logger.warning(
                "engine %s: lease heartbeat to %s failed: %s (retrying every %g s)",
                rank[0],
                _where(rank),
                failure,
                interval,
            )

    def _mark_lost(self, rank: Rank, holds: list[_Hold], reply: protocol.LeaseReply) -> None:
        """Stop renewing what the producer rank does not hold (any more) for us.

        ``holds`` are the request's entries, in order: the reply names
        entries by position (a request id may be held twice, under a real
        and a forged token: only the refused one is lost).
        """
        why = dict.fromkeys(reply.unknown, "not pending there (expired, read or never exposed)")
        why.update(dict.fromkeys(reply.refused, "its token was refused"))
        for position, reason in why.items():
            if not 0 <= position < len(holds):
                continue  # (a confused producer: ignore what names no entry of ours)
            hold = holds[position]
            if hold.done or rank in hold.lost:
                continue
            hold.lost.add(rank)
            hold.lost_reason = hold.lost_reason or f"{_where(rank)}: {reason}"
            self._unindex(hold, [rank])
            logger.warning(
                "engine %s: the hold on request %r is lost at %s: %s",
                rank[0],
                hold.remote.request_id,
                _where(rank),
                reason,
            )

    # ---- abandons ---------------------------------------------------------

    async def _abandon(self, remote: RemoteBlocks, ranks: Sequence[Rank]) -> None:
        """Tell ``ranks`` that we will not read ``remote``, concurrently; never raises.

        Each rank's abandon names this agent's confirmed READs of ``remote``
        there that ended without reading (the pulls' ``settled_reads``),
        so that the producer ends their pins and frees the blocks at once; a
        READ that may still run is not named. Each message is bounded by
        ``handshake_timeout``, and by the close's deadline once the connector
        closes; a failure is logged and counted (``abandons_failed``).
        """
        entries = self._entries(remote, abandon=True)
        for rank, nonces in self._settled_reads.take(remote).items():
            if rank in entries:
                entries[rank] = msgspec.structs.replace(entries[rank], pins=nonces)
        self._abandons_in_flight.value += 1
        try:
            async with trio.open_nursery() as nursery:
                for rank in ranks:
                    nursery.start_soon(self._abandon_one, rank, entries[rank])
        finally:
            self._abandons_in_flight.value -= 1

    async def _abandon_one(self, rank: Rank, entry: protocol.LeaseEntry) -> None:
        self.counters.abandons_sent += 1
        request = protocol.encode_lease_request(rank[0], self._engine_id, self._agent_name, [entry])
        limit = self._config.handshake_timeout
        log = ConnectionLog(self._config.max_message_bytes)
        reply: protocol.LeaseReply | str = f"no reply within {limit:g} s"
        deadline = min(trio.current_time() + limit, self._close_deadline)
        with trio.move_on_at(deadline) as scope:  # (begin_close may move it earlier)
            self._abandoning.add(scope)
            try:
                reply = await self._exchange(rank, request, log)
            except Exception as exc:  # best effort, never raised: the connector may be closing
                reply = f"{type(exc).__name__}: {exc}"
            finally:
                self._abandoning.discard(scope)
        if scope.cancelled_caught and scope.deadline >= self._close_deadline:
            timeout = self._config.close_timeout
            reply = f"not answered within close_timeout ({timeout:g} s): {log.diagnosis()}"
        elif scope.cancelled_caught:
            reply = f"no reply within {limit:g} s: {log.diagnosis()}"
        if isinstance(reply, str) and self._closed:
            self.counters.abandons_failed += 1
            logger.warning(
                "engine %s: abandon of request %r at %s, sent as the connector closed: %s "
                "(its lease expires on its own)",
                rank[0],
                entry.request_id,
                _where(rank),
                reply,
            )
        elif isinstance(reply, str):
            self.counters.abandons_failed += 1
            logger.warning(
                "engine %s: could not abandon request %r at %s: %s (its lease expires on its own)",
                rank[0],
                entry.request_id,
                _where(rank),
                reply,
            )
        elif reply.unknown or reply.refused:
            logger.debug(
                "engine %s: abandon of request %r at %s: %s",
                rank[0],
                entry.request_id,
                _where(rank),
                "refused" if reply.refused else "not pending there",
            )

    # ---- one exchange -----------------------------------------------------

    async def _exchange(
        self, rank: Rank, request: bytes, log: ConnectionLog
    ) -> protocol.LeaseReply | str:
        """Send ``request`` to ``rank`` and decode the reply (the caller bounds it).

        Retries until a reply arrives (see ``SideChannel.request``; ZeroMQ:
        fresh sockets each round); ``log`` records what the connection did, for
        the caller's diagnosis on timeout.

        Returns:
            the reply, or why there is none (refused by CURVE, an error
            reply, a reply that does not decode).
        """
        try:
            data = await self._side_channel.request(rank, request, log)
            return protocol.decode_lease_reply(data, self._config.max_message_bytes)
        except (FetchRefused, ProtocolError, ValueError) as exc:
            return str(exc)

    def _requests(self, rank: Rank, holds: list[_Hold]) -> list[tuple[bytes, list[_Hold]]]:
        """Lease requests renewing ``holds`` at ``rank``, each with the holds it
        names (in order): one, unless that is over ``max_message_bytes``."""
        entries = [hold.entries[rank] for hold in holds]
        request = protocol.encode_lease_request(rank[0], self._engine_id, self._agent_name, entries)
        if len(request) <= self._config.max_message_bytes or len(holds) == 1:
            return [(request, holds)]
        half = len(holds) // 2
        return self._requests(rank, holds[:half]) + self._requests(rank, holds[half:])

    # ---- bookkeeping ------------------------------------------------------

    def _entries(self, remote: RemoteBlocks, *, abandon: bool) -> dict[Rank, protocol.LeaseEntry]:
        """The lease entry of ``remote`` for each producer rank this rank reads.

        Raises:
            IncompatibleEngineError: the TP sizes do not divide.
        """
        mismatch = sizes_mismatch(self._tp_size, remote.tp_size)
        if mismatch is not None:
            raise IncompatibleEngineError(remote.engine_id, mismatch)
        entry = protocol.LeaseEntry(
            request_id=remote.request_id,
            token=remote.token,
            readers=readers_per_remote_rank(self._tp_size, remote.tp_size),
            abandon=abandon,
            incarnation=remote.incarnation,
        )
        parts = plan_pull(self._tp_rank, self._tp_size, remote.tp_size)
        return {
            (remote.engine_id, remote.host, remote.port + part.remote_rank): entry for part in parts
        }

    def _unindex(self, hold: _Hold, ranks: Iterable[Rank]) -> None:
        for rank in ranks:
            held = self._by_rank.get(rank)
            if held is not None and held.get(hold.remote) is hold:
                del held[hold.remote]
                if not held:
                    del self._by_rank[rank]
                    self._failing.discard(rank)

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"connector {self._engine_id!r} is closed")


def _where(rank: Rank) -> str:
    _, host, port = rank
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
