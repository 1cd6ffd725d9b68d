"""The consumer's handshakes: one record per remote engine and rank, carried out.

What a pull must do about its remote engine -- handshake, wait, fail fast,
retire a restarted engine's agent, refuse blocks of a gone incarnation -- is
decided by ``_remote_engine.EngineRecord.on_pull``; :class:`Handshakes` carries the
actions out with trio, ZeroMQ and the transfer backend. Its tasks run in the
connector's nursery:

* the *handshake task* (:meth:`Handshakes.run`): loads every remote agent
  whose metadata arrived, one at a time, in order, each under its
  attempt's deadline (the loads queued together go to the backend in one call);
* *fetch workers*, at most ``max_concurrent_fetches``, and one *watchdog*
  (``_fetch_queue.AttemptRunner``), there while attempts are: the workers
  fetch and check the queued attempts' metadata, in order, each within its
  attempt's deadline, and queue the load (what it needs, not the whole
  reply), holding back while the loads queued or running hold
  :data:`LOAD_BYTES_AHEAD` bytes of agent metadata; the watchdog fails an
  attempt still queued for a fetch or for its load at its deadline,
  ``handshake_timeout`` after it started.

Each attempt has an event (``_remote_table.AttemptDone``); its outcome is
in the engine's record (state, error), so every waiter reads the same
answer. The records, their keys and their bound are ``_remote_table``'s.
"""

from __future__ import annotations

import logging
import math
import random

import trio

from trio_pd._config import ConnectorConfig
from trio_pd._consumer._counters import ConsumerCounters
from trio_pd._consumer._fetch_queue import AttemptRunner
from trio_pd._consumer._remote_table import (
    NO_ATTEMPT,
    AttemptDone,
    RemoteEngine,
    RemoteEngines,
)
from trio_pd._core import _protocol as protocol
from trio_pd._core._errors import HandshakeError, TransferError
from trio_pd._core._layout import BlockIds, KVLayout
from trio_pd._core._public_values import RemoteBlocks
from trio_pd._core._remote_engine import (
    EngineEvent,
    EngineState,
    FailureCause,
    MetadataOutcome,
    PullAction,
)
from trio_pd._core._tensor_parallel import PullPart, part_layouts
from trio_pd._side_channel._fetch import FetchFailure, fetch_engine_metadata, unsent_failure
from trio_pd._side_channel._seam import SideChannel
from trio_pd._transfer._backend import (
    BackendClosing,
    BackendError,
    LoadRequest,
    RemoteAgent,
    TransferBackend,
)

logger = logging.getLogger("trio_pd")

HANDSHAKES_PER_PULL = 3
"""A pull gives up (``HandshakeError``) if its engine changed under this many handshakes."""

_PENDING = (EngineState.FETCHING, EngineState.VERIFYING)  # (no metadata yet)

_QueuedLoad = tuple[RemoteEngine, int, str, str, bytes, KVLayout]
"""A load in the queue: engine, attempt, and of the reply what the load needs (the
incarnation, the agent's name and metadata blob, the layout); a storm queues a thousand."""

LOADS_PER_BATCH = 32
"""The most queued loads the handshake task hands the backend in one call (NIXL:
one worker thread runs them back to back; an unload waits for the batch)."""

LOAD_BYTES_AHEAD = 16 << 20
"""While the loads queued or running hold this many bytes of agent metadata, no
fetch starts (deadlines run on).

Why a byte bound, and why this one. Fetches run in parallel (a few fetch
workers) while loads run one at a time in the handshake task, so replies can
arrive faster than they are loaded; each queued reply holds its agent
metadata until its load. NIXL's own metadata is about 3.2 KiB for 64
regions, so a legitimate storm of 1024 new engines queues about 3 MiB and
never reaches the bound: the first storm is not slowed (an earlier bound on
the *number* of queued loads did slow it, by holding fetches back that
would have been ready in time). Only oversized replies pile up to it -- a
hostile or broken side channel answering up to ``max_message_bytes`` each:
80 forged replies of 512 KiB queued 39.5 MiB before this bound existed.
16 MiB keeps that to a few times the largest legitimate storm's need while
leaving every honest fetch unhindered; an attempt that expires while held
back says how many MiB it waited behind."""


class Handshakes:
    """The remote engines a consumer reads from, and their handshakes.

    Owns the remote engines' records (a ``RemoteEngines`` table: one
    :class:`RemoteEngine` per engine id, address, TP size and rank), the
    attempts in flight (an ``AttemptRunner``: the fetch queue, the fetch
    workers and the watchdog) and the load queue; the backend owns the
    loaded remote agents.
    The fetch workers and the watchdog run in ``nursery`` (the
    connector's); :meth:`run` must run there too.

    Args:
        engine_id: this engine's id (named in metadata requests).
        tp_size: this (decode) engine's tensor-parallel size.
        layout: the local KV layout (remote layouts must pair with it).
        backend: the transfer backend (loads and retires remote agents).
        side_channel: where the metadata fetches go.
        config: deadlines and limits.
        nursery: where the fetch workers and the watchdog run.
        counters: the consumer's counters, which this counts into.
    """

    def __init__(
        self,
        engine_id: str,
        tp_size: int,
        layout: KVLayout,
        backend: TransferBackend,
        side_channel: SideChannel,
        config: ConnectorConfig,
        nursery: trio.Nursery,
        counters: ConsumerCounters,
    ) -> None:
        self._engine_id = engine_id
        self._tp_size = tp_size
        self._layout = layout
        self._backend = backend
        self._side_channel = side_channel
        self._config = config
        self._counters = counters
        self._compat_hash = protocol.compatibility_hash(config.compatibility_key)
        self._engines = RemoteEngines()
        self._loads_send, self._loads_receive = trio.open_memory_channel[_QueuedLoad](math.inf)
        self._loads_queued = 0
        self._load_bytes = 0  # (agent metadata queued or being loaded)
        self._attempts = AttemptRunner[RemoteEngine](
            nursery,
            config.max_concurrent_fetches,
            self._fetch_metadata,
            self._deadline_passed,
            room=lambda: self._load_bytes < LOAD_BYTES_AHEAD,
        )
        self._rng = random.Random()
        self._closed = False

    def engine(self, remote: RemoteBlocks, part: PullPart) -> RemoteEngine:
        """The record of the remote rank ``part`` reads, at the address and TP
        size ``remote`` names (created on first use; see
        ``RemoteEngines.get_or_create``)."""
        return self._engines.get_or_create(
            remote, part, verify_interval=self._config.backoff_initial
        )

    def engine_state(self, engine_id: str, tp_rank: int | None = None) -> EngineState:
        """The state of ``engine_id`` (rank ``tp_rank``, default the lowest read;
        see ``RemoteEngines.engine_state``)."""
        return self._engines.engine_state(engine_id, tp_rank)

    def ready_count(self) -> int:
        """Remote engine ranks ready for pulls now."""
        return self._engines.ready_count()

    async def ready_agent(
        self, engine: RemoteEngine, request_id: str, local_ids: BlockIds, remote: RemoteBlocks
    ) -> RemoteAgent:
        """The agent that serves ``remote``, handshaking as the record says.

        Every wait here ends within ``handshake_timeout`` of its start: each
        attempt (or verification) is failed by its watchdog at its deadline,
        however long it queued.

        Raises:
            HandshakeError: the attempt this pull waited on failed; the engine
                is in backoff; a verification it needed got no answer; or it
                changed under ``HANDSHAKES_PER_PULL`` handshakes.
            TransferError: the blocks belong to an incarnation that is not
                running (gone, or refuted by the engine itself).
            trio.ClosedResourceError: the connector closed (before or meanwhile).
        """
        self._check_open()  # (a pull's second round of parts may start after close)
        record = engine.record
        waits = 0
        while True:
            now = trio.current_time()
            action = record.on_pull(remote.incarnation, now)
            if action is PullAction.READY:
                assert engine.agent is not None
                if not engine.agent.retired:
                    return engine.agent
                # The backend gave up on the agent (a transfer it could not
                # stop): as a lost peer, handshake again.
                self.peer_lost(engine, engine.agent, request_id)
                continue
            if action is PullAction.FAIL_FAST:
                self._counters.pulls_rejected_in_backoff += 1
                raise _copy(record.fail_fast_error())
            if action is PullAction.GONE:
                reason = engine.rank_label + record.why_gone(remote.incarnation)
                raise TransferError(request_id, local_ids.tolist(), reason)
            if action is PullAction.DEFER:  # (at most verify_interval, then ask again)
                if waits == HANDSHAKES_PER_PULL:
                    reason = f"the engine changed during {HANDSHAKES_PER_PULL} handshakes"
                    raise HandshakeError(remote.engine_id, reason)
                await trio.sleep_until(record.verify_again_at)
                waits += 1
                self._check_open()
                continue
            if action is PullAction.VERIFY:
                logger.info(
                    "engine %s: request %r names incarnation %s, %s is loaded: asking the engine",
                    record.engine_id,
                    remote.request_id,
                    remote.incarnation,
                    record.epoch,
                )
                self._start_attempt(engine)
            elif action is PullAction.START:
                self._start_attempt(engine)
            if waits == HANDSHAKES_PER_PULL:
                reason = f"the engine changed during {HANDSHAKES_PER_PULL} handshakes"
                raise HandshakeError(remote.engine_id, reason)
            attempt, done = record.attempts, engine.attempt_done
            await done.wait()
            waits += 1
            self._check_open()
            error = record.attempt_error(attempt)
            if error is not None:
                raise _copy(error)

    def _start_attempt(self, engine: RemoteEngine) -> None:
        """Start the record's new attempt: queue it for a fetch worker, under the watchdog."""
        record = engine.record
        engine.attempt_done = AttemptDone()
        engine.deadline = trio.current_time() + self._config.handshake_timeout
        self._counters.handshakes_started += 1
        verifying = record.state is EngineState.VERIFYING
        logger.info(
            "engine %s: %s %d started (%s:%d)",
            record.engine_id,
            "verification" if verifying else "handshake",
            record.attempts,
            record.host,
            record.port,
        )
        self._attempts.start(engine, record.attempts, engine.deadline)

    def _current(self, engine: RemoteEngine, attempt: int, *states: EngineState) -> bool:
        """Whether ``attempt`` is still the engine's current one, in one of ``states``."""
        record = engine.record
        return not self._closed and record.attempts == attempt and record.state in states

    async def _fetch_metadata(self, engine: RemoteEngine, attempt: int) -> None:
        """(A fetch worker) fetch and check ``engine``'s metadata, then act on
        it: queue the load (its request: a storm queues a thousand, so not
        the whole reply), or end a verification."""
        record = engine.record
        try:
            metadata, layout = await fetch_engine_metadata(
                self._side_channel,
                record.engine_id,
                record.host,
                record.port,
                tp_rank=engine.part.remote_rank,
                tp_size=engine.remote_tp,
                consumer_engine_id=self._engine_id,
                local_layout=self._layout,
                local_tp=self._tp_size,
                compat_hash=self._compat_hash,
                config=self._config,
                deadline=engine.deadline,
            )
        except FetchFailure as failure:
            if self._current(engine, attempt, *_PENDING):
                self._handshake_failed(engine, failure.cause, failure.error)
            return
        # (A reply taken from the socket just before the connector closed, or
        # after the watchdog or a lost peer ended the attempt, is dropped.)
        if not self._current(engine, attempt, *_PENDING):
            return
        epoch = record.epoch
        outcome = record.metadata_received(metadata)
        restarted = bool(epoch and record.epoch and record.epoch != epoch)
        if outcome is MetadataOutcome.SAME:
            logger.info(
                "engine %s: still runs incarnation %s; request incarnation %s refuted",
                record.engine_id,
                metadata.incarnation,
                record.sought_incarnation,
            )
            self._end_attempt(engine)
            return
        if outcome is MetadataOutcome.RESTARTED:
            self._counters.restarts_detected += 1
            logger.warning(
                "engine %s restarted (now incarnation %s): retiring its old agent",
                record.engine_id,
                metadata.incarnation,
            )
            retired, engine.agent = engine.agent, None
            if retired is not None:
                with trio.CancelScope(shield=True):
                    await self._backend.retire(retired)
            if not self._current(engine, attempt, EngineState.LOADING):
                return  # (the connector closed meanwhile)
        if restarted:  # (rank 0 found a new incarnation, by a verification or a handshake)
            await self._retire_other_ranks(engine)
            if not self._current(engine, attempt, EngineState.LOADING):
                return
        self._loads_queued += 1
        blob = metadata.agent_metadata
        self._load_bytes += len(blob)
        queued = (engine, attempt, metadata.incarnation, metadata.agent_name, blob, layout)
        self._loads_send.send_nowait(queued)

    async def _retire_other_ranks(self, engine: RemoteEngine) -> None:
        """Rank 0 of ``engine`` answered with a new incarnation: the engine restarted,
        and its other ranks with it (an engine's ranks restart together).

        Their records judge no incarnation (see ``EngineRecord.rank``), so
        they would read through their old agents, which are gone. Each
        loaded one is retired now (unloaded once no pull uses it) and its
        record goes stale: its next pull handshakes again (see
        ``Consumer.pull``: a pull whose part got its agent just before makes
        it ready again). Other addresses or TP sizes are other engines.
        """
        record = engine.record
        retired = []
        ranks = self._engines.ranks_of(record.engine_id, record.host, engine.remote_tp, record.port)
        for rank, other in ranks:
            agent = other.agent
            if rank == 0 or agent is None or not other.record.on_peer_lost(agent.incarnation):
                continue
            other.agent = None
            self._end_attempt(other)
            retired.append(agent)
            logger.warning(
                "engine %s restarted: retiring the old agent of its rank %d too",
                record.engine_id,
                rank,
            )
        with trio.CancelScope(shield=True):
            for agent in retired:
                await self._backend.retire(agent)

    async def _load(self, batch: list[_QueuedLoad]) -> None:
        """Load the agents of a batch of queued engines, each giving up at its
        attempt's deadline.

        The backend loads them one at a time, in order, and reports each as
        it ends, so an engine is ready as soon as its own load is done. A
        load is given up at its deadline, so one that never returns does not
        hold up the loads queued behind it (a backend whose call cannot be
        interrupted abandons it, and fails later loads fast while it is
        stuck: see ``TransferBackend.load_remotes``). An agent that loads
        after its attempt ended is retired at once.
        """
        live = []
        requests = []
        for engine, attempt, incarnation, agent_name, agent_metadata, layout in batch:
            if not self._current(engine, attempt, EngineState.LOADING):
                continue
            local_view, remote_view = part_layouts(self._layout, layout, engine.part)
            live.append((engine, attempt))
            requests.append(
                LoadRequest(
                    engine.record.engine_id,
                    incarnation,
                    agent_name,
                    agent_metadata,
                    remote_view,
                    local_view,
                    engine.deadline,
                )
            )
        late: list[RemoteAgent] = []  # loaded after their attempt ended (the watchdog)

        def loaded(index: int, outcome: RemoteAgent | BackendError | None) -> None:
            engine, attempt = live[index]
            if not self._current(engine, attempt, EngineState.LOADING):
                if outcome is not None and not isinstance(outcome, BackendError):
                    late.append(outcome)  # too late: its waiters already failed
                return
            self._loaded(engine, outcome)

        try:
            await self._backend.load_remotes(requests, loaded)
        except BackendClosing:
            return  # the connector is closing: its waiters are woken by begin_close
        for remote in late:
            await self._backend.retire(remote)

    def _loaded(self, engine: RemoteEngine, outcome: RemoteAgent | BackendError | None) -> None:
        """A load of ``engine``'s current attempt ended (``None``: at its deadline)."""
        record = engine.record
        if outcome is None:  # the deadline, at the same moment as the watchdog
            self._handshake_failed(engine, FailureCause.NIXL, self._deadline_error(engine))
            return
        if isinstance(outcome, BackendError):
            reason = f"{engine.rank_label}loading the remote agent: {outcome}"
            error = HandshakeError(record.engine_id, reason)
            error.__cause__ = outcome
            self._handshake_failed(engine, FailureCause.NIXL, error)
            return
        record.loaded()
        engine.agent = outcome
        self._end_attempt(engine)
        self._counters.handshakes_succeeded += 1
        began = engine.deadline - self._config.handshake_timeout
        logger.info(
            "engine %s: ready (agent %s, %d regions x %d blocks) %.1f ms after its handshake began",
            record.engine_id,
            outcome.agent_name,
            outcome.layout.num_regions,
            outcome.layout.num_blocks,
            (trio.current_time() - began) * 1e3,
        )

    def _deadline_error(self, engine: RemoteEngine) -> HandshakeError:
        timeout = self._config.handshake_timeout
        phase = {
            EngineState.FETCHING: "no metadata",
            EngineState.VERIFYING: "no answer to the verification",
            EngineState.LOADING: "the remote agent was not loaded",
        }.get(engine.record.state, "not done")
        queued = self._loads_queued
        behind = f" ({queued} loads queued)" if queued else ""
        stuck = self._backend.stuck_call
        if stuck:
            behind += f"; the transfer backend is stuck: {stuck}"
        reason = f"{engine.rank_label}{phase} within {timeout:g} s of the handshake's start{behind}"
        return HandshakeError(engine.record.engine_id, reason)

    def _deadline_passed(self, engine: RemoteEngine, attempt: int, queued: bool) -> None:
        """(The watchdog) ``attempt``'s deadline passed: fail it if it is still
        ``queued`` for a fetch worker, or queued for (or in) its load. A fetch
        under way keeps the same deadline itself, and says why it failed; a
        load under way is given up at it by the backend too (see :meth:`_load`).
        """
        record = engine.record
        if queued and self._current(engine, attempt, *_PENDING):
            rank, size = engine.part.remote_rank, engine.remote_tp
            held = self._load_bytes if self._load_bytes >= LOAD_BYTES_AHEAD else 0
            failure = unsent_failure(record, rank, size, self._config.handshake_timeout, held)
            self._handshake_failed(engine, failure.cause, failure.error)
        elif self._current(engine, attempt, EngineState.LOADING):
            self._handshake_failed(engine, FailureCause.NIXL, self._deadline_error(engine))

    def _end_attempt(self, engine: RemoteEngine) -> None:
        """``engine``'s current attempt ended, either way: wake its waiters."""
        engine.attempt_done.set()
        engine.attempt_done = NO_ATTEMPT  # (its waiters hold the attempt's own)
        self._attempts.ended(engine)

    def _handshake_failed(
        self, engine: RemoteEngine, cause: FailureCause, error: HandshakeError
    ) -> None:
        record = engine.record
        self._counters.handshake_failures[cause] += 1
        if record.state is EngineState.VERIFYING:
            record.verification_failed(error)
            self._end_attempt(engine)
            logger.warning("%s (verification; the loaded agent stays in service)", error)
            return
        delay = record.failed(error, trio.current_time(), self._config.backoff, self._rng)
        self._end_attempt(engine)
        logger.warning("%s (next attempt allowed in %.2f s)", error, delay)

    async def run(self) -> None:
        """The handshake task: loads remote agents whose metadata arrived, in
        order; the loads queued together (up to :data:`LOADS_PER_BATCH`) go
        to the backend at once."""
        async for queued in self._loads_receive:
            batch = [queued]
            while len(batch) < LOADS_PER_BATCH:
                try:
                    batch.append(self._loads_receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            try:
                await self._load(batch)
            finally:
                self._loads_queued -= len(batch)
                self._load_bytes -= sum(len(item[4]) for item in batch)
                self._attempts.room_made()

    def peer_lost(self, engine: RemoteEngine, agent: RemoteAgent, request_id: str) -> bool:
        """``agent`` is gone (NIXL said so, or the backend gave it up).

        Returns whether this is news, i.e. ``agent`` was the engine's loaded
        one: then the engine goes stale (the next pull handshakes again), and
        the caller retires the agent.
        """
        if engine.agent is not agent or not engine.record.on_peer_lost(agent.incarnation):
            return False
        engine.agent = None
        self._end_attempt(engine)  # (a verification's waiters ask again: a handshake is due)
        self._counters.peers_disconnected += 1
        logger.warning(
            "engine %s: peer lost during request %r; its agent will be removed and the "
            "next pull handshakes again",
            agent.engine_id,
            request_id,
        )
        return True

    def begin_close(self) -> None:
        """Wake every waiter (they raise ClosedResourceError); stop the handshake
        task, the fetch workers and the watchdog."""
        if self._closed:
            return
        self._closed = True
        for engine in self._engines.values():
            engine.record.apply(EngineEvent.CONNECTOR_CLOSED)
            engine.attempt_done.set()
        self._attempts.close()
        self._loads_send.close()

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"connector {self._engine_id!r} is closed")


def _copy(error: HandshakeError) -> HandshakeError:
    """A fresh exception equal to ``error`` (one object per raise keeps tracebacks apart)."""
    fresh = type(error)(error.engine_id, error.reason)
    fresh.__cause__ = error.__cause__
    return fresh
