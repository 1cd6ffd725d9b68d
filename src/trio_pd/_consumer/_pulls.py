"""The consumer role (decode side): pulls.

A pull finds the remote ranks it reads (``_tensor_parallel.plan_pull``), has them made
ready by the handshakes (``_handshakes.Handshakes``, which own the remote
engines' records and the handshake tasks), checks every part's block ids,
then runs the parts' transfers concurrently, each holding a lease on its
remote agent. Pulls run in the caller's task.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from types import MappingProxyType
from typing import NoReturn

import attrs
import numpy as np
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._consumer._counters import ConsumerCounters
from trio_pd._consumer._handshakes import Handshakes
from trio_pd._consumer._remote_table import RemoteEngine
from trio_pd._consumer._settlement import SettledReads, UnsettledBlocks
from trio_pd._core import _protocol as protocol
from trio_pd._core._errors import (
    ExposureEndedError,
    HandshakeError,
    IncompatibleEngineError,
    ParamsRejectedError,
    TransferError,
)
from trio_pd._core._exposures import blocks_digest
from trio_pd._core._layout import BlockIds, KVLayout, as_block_ids, few_block_ids
from trio_pd._core._public_values import ConsumerStatistics, PullResult, RemoteBlocks
from trio_pd._core._remote_engine import EngineState
from trio_pd._core._tensor_parallel import (
    PullPart,
    plan_pull,
    readers_per_remote_rank,
    sizes_mismatch,
)
from trio_pd._core._tokens import exposure_token, token_matches
from trio_pd._exception_groups import first_failure_wins
from trio_pd._side_channel._confirm import Pending
from trio_pd._side_channel._seam import SideChannel
from trio_pd._transfer._backend import (
    BackendClosing,
    BackendError,
    RemoteAgent,
    RemoteRetired,
    TransferBackend,
    TransferTimeout,
)


class Consumer:
    """The decode side of a connector: pulls remote engines' blocks.

    Owns the pulls' bookkeeping (in flight, counters) and the
    :class:`~trio_pd._consumer._handshakes.Handshakes`, whose fetch workers run in
    ``nursery`` (the connector's); :meth:`run_handshakes` must run there too.

    Args:
        engine_id: this engine's id (named in metadata requests).
        tp_rank, tp_size: this rank of the (decode) engine, and how many it has.
        layout: the local KV layout (remote layouts must pair with it).
        backend: the transfer backend.
        side_channel: where the metadata fetches and the confirmations go.
        config: deadlines and limits.
        nursery: where the fetch workers and the watchdog run.
    """

    def __init__(
        self,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        layout: KVLayout,
        backend: TransferBackend,
        side_channel: SideChannel,
        config: ConnectorConfig,
        nursery: trio.Nursery,
    ) -> None:
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._layout = layout
        self._bytes_per_block_id = layout.bytes_per_block_id
        self._backend = backend
        self._config = config
        self._counters = ConsumerCounters()
        self._handshakes = Handshakes(
            engine_id, tp_size, layout, backend, side_channel, config, nursery, self._counters
        )
        self._confirms = side_channel.confirmations(engine_id, backend.agent_name)
        self.settled_reads = SettledReads()
        """Confirmed READs that ended without reading (see ``_settlement``):
        the abandons (``_leases``) name them, so that their pins end."""
        self.confirm_reads = True
        """Whether READs are confirmed (``_confirm``). Only the benchmarks turn
        it off, to measure what the confirmation costs side by side: without
        it a pull may return another request's bytes."""
        self._pulls_in_flight = 0
        self._no_pull_in_flight: trio.Event | None = None  # (set when that count gets to 0)
        self._unsettled = UnsettledBlocks()
        self._closed = False

    async def run_handshakes(self) -> None:
        """The handshake task (see :meth:`Handshakes.run`)."""
        await self._handshakes.run()

    # ---- public (through the Connector facade) ---------------------------

    async def pull(
        self,
        request_id: str,
        local_block_ids: Sequence[int],
        remote: RemoteBlocks,
        *,
        lost: str | None = None,
    ) -> PullResult:
        """See :meth:`trio_pd.Connector.pull`.

        Three phases, so that nothing is transferred unless every part can
        be: the remote ranks this rank reads (see ``_tensor_parallel.plan_pull``) are made
        ready concurrently; every part's block ids are checked; then the
        parts transfer concurrently.

        ``lost``: why the producer no longer holds ``remote`` for us (a hold
        heard so): the pull fails with :class:`TransferError` without
        reading, counted in ``pulls_failed`` as every failed pull is.
        """
        self._check_open()
        started = trio.current_time()
        local_ids = as_block_ids(
            local_block_ids, self._layout.num_blocks, "local block ids of request", request_id
        )
        if local_ids.size and local_ids.size != len(remote.block_ids):
            raise ValueError(
                f"request {request_id!r}: {local_ids.size} local block ids for "
                f"{len(remote.block_ids)} remote block ids"
            )
        try:
            if lost is not None:
                await trio.lowlevel.checkpoint()
                raise TransferError(
                    request_id,
                    local_ids.tolist(),
                    f"engine {remote.engine_id!r} no longer holds these blocks for us "
                    f"({lost}): not read",
                )
            if self._config.exposure_secret is not None:
                self.check_token(request_id, remote)
            if remote.tp_size != self._tp_size:
                mismatch = sizes_mismatch(self._tp_size, remote.tp_size)
                if mismatch is not None:
                    raise IncompatibleEngineError(remote.engine_id, mismatch)
            parts = plan_pull(self._tp_rank, self._tp_size, remote.tp_size)
            # (No comprehension or closure in this coroutine: every variable one
            # captured would cost each pull in flight a cell, for its whole life.)
            if len(parts) == 1:
                # One remote rank, the usual case: its transfer runs right here,
                # with no list, group or wrapper (each is a few microseconds of a
                # tiny pull, on a core that has just run NIXL's calls).
                engine = self._handshakes.engine(remote, parts[0])
                agent = await self._handshakes.ready_agent(engine, request_id, local_ids, remote)
                handshake_wait = trio.current_time() - started
                await self._transfer_for(engine, agent, request_id, local_ids, remote)()
            else:
                engines = self._engines_read(remote, parts)
                agents = await self._ready_parts(engines, request_id, local_ids, remote)
                handshake_wait = trio.current_time() - started
                transfers = self._transfers_for(engines, agents, request_id, local_ids, remote)
                await first_failure_wins(transfers)
        except ParamsRejectedError:
            self._counters.pulls_rejected += 1
            raise
        except ExposureEndedError:
            self._counters.pulls_failed += 1
            self._counters.pulls_exposure_ended += 1
            raise
        except (HandshakeError, TransferError):
            self._counters.pulls_failed += 1
            raise
        nbytes = int(local_ids.size) * self._bytes_per_block_id
        self._counters.pulls_succeeded += 1
        self._counters.bytes_pulled += nbytes
        return PullResult(
            request_id, remote.engine_id, nbytes, trio.current_time() - started, handshake_wait
        )

    def check_token(self, request_id: str, remote: RemoteBlocks) -> None:
        """With ``exposure_secret``: refuse parameters the producer did not sign.

        Raises:
            ParamsRejectedError: ``remote.token`` is missing or does not verify.
        """
        secret = self._config.exposure_secret
        if secret is None:
            return
        if not remote.token:
            raise ParamsRejectedError(
                request_id, "remote_token", "missing (this deployment signs its exposures)"
            )
        expected = exposure_token(
            secret,
            engine_id=remote.engine_id,
            host=remote.host,
            port=remote.port,
            incarnation=remote.incarnation,
            tp_size=remote.tp_size,
            request_id=remote.request_id,
            block_ids=remote.block_ids,
            exposure=remote.exposure,
        )
        if not token_matches(expected, remote.token):
            raise ParamsRejectedError(
                request_id,
                "remote_token",
                f"does not match the other parameters: engine {remote.engine_id!r} did not "
                "expose these blocks for this request (or another secret signed them)",
            )

    def _engines_read(self, remote: RemoteBlocks, parts: Sequence[PullPart]) -> list[RemoteEngine]:
        """The records of the remote ranks ``parts`` read (see ``Handshakes.engine``)."""
        return [self._handshakes.engine(remote, part) for part in parts]

    async def _ready_parts(
        self,
        engines: list[RemoteEngine],
        request_id: str,
        local_ids: BlockIds,
        remote: RemoteBlocks,
    ) -> list[RemoteAgent]:
        """The agents of several remote ranks, made ready concurrently (the first
        failure cancels the others and propagates)."""
        ready = [
            functools.partial(self._handshakes.ready_agent, e, request_id, local_ids, remote)
            for e in engines
        ]
        agents = await first_failure_wins(ready)
        # A part made ready while another part's handshake found the engine
        # restarted has an agent that was retired since (an engine's ranks
        # restart together): once more, for those parts.
        again = [i for i, e in enumerate(engines) if e.agent is not agents[i]]
        if again:
            renewed = await first_failure_wins([ready[i] for i in again])
            for i, agent in zip(again, renewed, strict=True):
                agents[i] = agent
        return agents

    def _transfers_for(
        self,
        engines: list[RemoteEngine],
        agents: list[RemoteAgent],
        request_id: str,
        local_ids: BlockIds,
        remote: RemoteBlocks,
    ) -> list[Callable[[], Awaitable[None]]]:
        """Every part's transfer, all block ids checked now (before any part runs)."""
        return [
            self._transfer_for(engine, agent, request_id, local_ids, remote)
            for engine, agent in zip(engines, agents, strict=True)
        ]

    def _transfer_for(
        self,
        engine: RemoteEngine,
        agent: RemoteAgent,
        request_id: str,
        local_ids: BlockIds,
        remote: RemoteBlocks,
    ) -> Callable[[], Awaitable[None]]:
        """One part's transfer, its block ids checked now (before any part runs)."""
        readers = readers_per_remote_rank(self._tp_size, remote.tp_size)
        nonce = _nonce()
        notification = protocol.encode_notification(remote.request_id, readers, nonce)
        indices = None
        if local_ids.size:
            try:
                remote_ids = few_block_ids(
                    remote.block_ids,
                    agent.layout.num_blocks,
                    "remote block ids of engine",
                    remote.engine_id,
                )
            except ValueError as exc:
                raise ParamsRejectedError(request_id, "remote_block_ids", str(exc)) from None
            indices = (
                agent.local_layout.descriptor_indices(local_ids),
                agent.layout.descriptor_indices(remote_ids),
            )
        return functools.partial(
            self._transfer,
            engine,
            request_id,
            local_ids,
            agent,
            indices,
            notification,
            remote,
            nonce,
        )

    def engine_state(self, engine_id: str, tp_rank: int | None = None) -> EngineState:
        return self._handshakes.engine_state(engine_id, tp_rank)

    def unsettled_blocks(self) -> frozenset[int]:
        """See :meth:`trio_pd.Connector.unsettled_blocks`."""
        return self._unsettled.snapshot()

    async def wait_settled(self, block_ids: Sequence[int]) -> None:
        """See :meth:`trio_pd.Connector.wait_settled`."""
        await self._unsettled.wait_settled(block_ids)

    def statistics(self) -> ConsumerStatistics:
        c = self._counters
        return ConsumerStatistics(
            handshakes_started=c.handshakes_started,
            handshakes_succeeded=c.handshakes_succeeded,
            handshakes_failed=c.handshake_failures.total(),
            handshake_failures_by_cause=MappingProxyType(
                {str(cause): n for cause, n in c.handshake_failures.items()}
            ),
            engines_ready=self._handshakes.ready_count(),
            pulls_succeeded=c.pulls_succeeded,
            pulls_failed=c.pulls_failed,
            pulls_in_flight=self._pulls_in_flight,
            pulls_rejected_in_backoff=c.pulls_rejected_in_backoff,
            restarts_detected=c.restarts_detected,
            peers_disconnected=c.peers_disconnected,
            bytes_pulled=c.bytes_pulled,
            remote_agents_loaded=self._backend.remote_agents_loaded,
            transfers_posted=self._backend.transfers_posted,
            transfers_unsettled=self._backend.transfers_unsettled,
            pulls_rejected=c.pulls_rejected,
            pulls_exposure_ended=c.pulls_exposure_ended,
            blocks_unsettled=len(self._unsettled),
            backend_stuck_call=self._backend.stuck_call,
        )

    # ---- transfers -------------------------------------------------------

    async def _transfer(
        self,
        engine: RemoteEngine,
        request_id: str,
        local_ids: BlockIds,
        agent: RemoteAgent,
        indices: tuple[np.ndarray, np.ndarray] | None,
        notification: bytes,
        remote: RemoteBlocks,
        nonce: int,
    ) -> None:
        """READ ``indices`` (local, remote) with ``notification``; only notify if ``None``.

        A READ is confirmed (``_confirm``): the confirmation is sent just
        before the READ is posted, its answer checked once the READ ended,
        and the pull raises :class:`ExposureEndedError` unless the producer
        held the blocks for this request for the whole READ. A confirmed
        READ that ended without its notification and reads nothing any more
        (cancelled or failed, and stopped) is recorded in ``settled_reads``:
        the exposure's abandon names it, so that its pin ends.

        The agent is leased for the transfer: it cannot be unloaded under it.
        (A pull with several parts checkpoints between making its ranks ready
        and leasing them; an agent retired in that gap fails the pull before
        anything is read.)
        """
        self._pulls_in_flight += 1
        pending = None
        read = None
        try:
            try:
                async with self._backend.lease(agent):
                    try:
                        if indices is None:
                            await self._backend.notify(agent, notification)
                        else:
                            if self.confirm_reads:
                                rank = (
                                    remote.engine_id,
                                    remote.host,
                                    remote.port + engine.part.remote_rank,
                                )
                                if not self._confirms.is_open(rank):
                                    # (its first confirmation: a socket to make,
                                    # in a turn of its own -- SocketSetups)
                                    await self._confirms.open(rank)
                                pending = self._confirms.send(
                                    rank,
                                    remote.request_id,
                                    remote.token,
                                    remote.incarnation,
                                    blocks_digest(remote.block_ids),
                                    nonce,
                                    remote.exposure,
                                )
                            read = _Read(self._unsettled, local_ids, pending)
                            # (a confirmed READ's schedule point is its answer's wait)
                            await self._backend.read(
                                agent, *indices, notification, read.hold, schedule=pending is None
                            )
                            read.done = True
                    except BackendError as exc:
                        if exc.peer_lost and self._handshakes.peer_lost(engine, agent, request_id):
                            with trio.CancelScope(shield=True):
                                await self._backend.retire(agent)  # unloaded when the lease ends
                        self._fail(
                            request_id,
                            local_ids,
                            engine.rank_label + str(exc),
                            cause=exc,
                            settled=exc.settled,
                        )
                    except TransferTimeout:
                        timeout = self._config.transfer_timeout
                        reason = f"{engine.rank_label}not complete within {timeout:g} s"
                        self._fail(request_id, local_ids, reason)
                    except BackendClosing:
                        raise trio.ClosedResourceError(
                            f"connector closed while request {request_id!r} was in flight"
                        ) from None
            except RemoteRetired:  # (entering the lease: the body raises no such thing)
                reason = "its agent was retired (restart or lost peer) before the transfer"
                self._fail(request_id, local_ids, engine.rank_label + reason)
            if pending is not None:  # (the READ ended, its lease too: is it ours?)
                try:
                    await self._confirms.check(
                        pending, trio.current_time(), request_id, local_ids.tolist()
                    )
                finally:
                    pending = None
        finally:
            if pending is not None:
                self._confirms.discard(pending)  # (the READ failed: no answer is awaited)
            confirmation = None if read is None else read.pinned()
            if confirmation is not None:
                # (it ended without its notification: the abandon names it)
                self.settled_reads.add(remote, confirmation.rank, nonce)
            self._pulls_in_flight -= 1
            if not self._pulls_in_flight and self._no_pull_in_flight is not None:
                self._no_pull_in_flight.set()
                self._no_pull_in_flight = None

    def _fail(
        self,
        request_id: str,
        local_ids: BlockIds,
        reason: str,
        cause: BackendError | None = None,
        settled: trio.Event | None = None,
    ) -> NoReturn:
        """Raise the pull's TransferError (``pull`` counts it).

        Chaining (see :class:`~trio_pd.TransferError`): ``cause``, the
        backend's error, is its ``__cause__``; without one (a timeout, a
        retired agent: trio_pd's own internal exceptions) it chains nothing
        (``from None``: the internal exception being handled is not shown).
        """
        raise TransferError(request_id, local_ids.tolist(), reason, settled=settled) from cause

    # ---- life cycle ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"connector {self._engine_id!r} is closed")

    def begin_close(self) -> None:
        """Refuse new pulls, wake every waiter (they raise ClosedResourceError),
        and tell the backend to stop in-flight transfers."""
        if self._closed:
            return
        self._closed = True
        self._backend.begin_close()
        self._handshakes.begin_close()
        self._confirms.close()

    async def wait_pulls_done(self) -> None:
        """Until no pull is in flight (bound it with a cancel scope). A checkpoint."""
        if not self._pulls_in_flight:
            await trio.lowlevel.checkpoint()
            return
        if self._no_pull_in_flight is None:
            self._no_pull_in_flight = trio.Event()
        await self._no_pull_in_flight.wait()

    @property
    def pulls_in_flight(self) -> int:
        return self._pulls_in_flight


_NONCES_PER_DRAW = 64
_nonces: list[int] = []


def _nonce() -> int:
    """A READ's nonce: random, so that nobody but this agent (and the
    producer it reads) can name its READs -- an abandon that names them
    ends their pins (see ``protocol.LeaseEntry.pins``).

    Drawn from the operating system's CSPRNG 64 at a time (one system call
    per 64 pulls, not one each), in ``[1, MAX_NONCE]``; a forked child
    draws its own.
    """
    while True:
        try:
            return _nonces.pop()  # (atomic: connectors in several threads' trio loops share it)
        except IndexError:
            drawn = struct.unpack(f"<{_NONCES_PER_DRAW}Q", os.urandom(8 * _NONCES_PER_DRAW))
            _nonces.extend((n >> 1) or 1 for n in drawn)  # (63 bits: MAX_NONCE is 2**63 - 1)


os.register_at_fork(after_in_child=_nonces.clear)


@attrs.define(eq=False)
class _Read:
    """How one READ ended, for its pull's cleanup."""

    unsettled_blocks: UnsettledBlocks
    block_ids: BlockIds
    confirmation: Pending | None
    done: bool = False
    """The READ completed (its notification went with it)."""
    stuck: bool = False
    """The READ could not be stopped (its blocks are unsettled)."""

    def hold(self) -> Callable[[], None]:
        """The backend's unsettled hook (``TransferBackend.read``)."""
        self.stuck = True
        return self.unsettled_blocks.hold(self.block_ids.tolist())

    def pinned(self) -> Pending | None:
        """The READ's confirmation if the READ ended without its notification
        and reads nothing any more, while that confirmation may have pinned
        the exposure (sent, and not answered otherwise than ``held``)."""
        confirmation = self.confirmation
        if confirmation is None or self.done or self.stuck or not confirmation.sent:
            return None
        reply = confirmation.reply
        return confirmation if reply is None or reply.state == "held" else None
