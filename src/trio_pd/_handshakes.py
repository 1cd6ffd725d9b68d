"""The consumer's handshakes: one record per remote engine and rank, carried out.

What a pull must do about its remote engine -- handshake, wait, fail fast,
retire a restarted engine's agent, refuse blocks of a gone incarnation -- is
decided by ``_engines.EngineRecord.on_pull``; :class:`Handshakes` carries the
actions out with trio, ZeroMQ and the transfer backend. Its tasks run in the
connector's nursery:

* the *handshake task* (:meth:`Handshakes.run`): loads every remote agent
  whose metadata arrived, one at a time, in order, each under a watchdog
  deadline;
* *fetch tasks*, one per handshake attempt, started by the pull that starts
  the attempt: each fetches and checks one engine rank's metadata within
  ``handshake_timeout``, at most ``max_concurrent_fetches`` at once.

Each handshake attempt has a :class:`trio.Event`; its outcome is in the
engine's record (state, error), so every waiter reads the same answer.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter

import attrs
import trio
import zmq

from . import _protocol as protocol
from ._backend import BackendError, RemoteAgent, TransferBackend
from ._config import ConnectorConfig
from ._engines import EngineEvent, EngineRecord, EngineState, FailureCause, PullAction
from ._errors import HandshakeError, TransferError
from ._fetch import FetchFailure, fetch_engine_metadata
from ._layout import BlockIds, KVLayout
from ._records import RemoteBlocks
from ._tp import PullPart, part_layouts

logger = logging.getLogger("trio_pd")

HANDSHAKES_PER_PULL = 3
"""A pull gives up (``HandshakeError``) if its engine changed under this many handshakes."""


@attrs.define(eq=False)
class RemoteEngine:
    """One remote engine: its sans-IO record and the trio side of its handshakes.

    Attributes:
        record: the state machine (the outcome of every attempt lives there).
        attempt_done: set when the current attempt ends, either way; a new
            attempt gets a new event, so a waiter keeps the one it waited on.
        part: what this rank reads of that remote rank, and where it lands
            (from the latest request's TP sizes).
        remote_tp: the remote engine's TP size, as the latest request says.
        agent: the loaded remote agent while the record is ``READY``.
    """

    record: EngineRecord
    part: PullPart
    remote_tp: int = 1
    attempt_done: trio.Event = attrs.field(factory=trio.Event)
    agent: RemoteAgent | None = None

    @property
    def rank_label(self) -> str:
        """``"remote rank r: "`` for a rank of a tensor-parallel engine, else ``""``."""
        return f"remote rank {self.part.remote_rank}: " if self.remote_tp > 1 else ""


@attrs.define
class ConsumerCounters:
    """The consumer's counters (the handshakes and the pulls count into one)."""

    handshakes_started: int = 0
    handshakes_succeeded: int = 0
    handshake_failures: Counter[FailureCause] = attrs.field(factory=Counter)
    pulls_succeeded: int = 0
    pulls_failed: int = 0
    pulls_rejected_in_backoff: int = 0
    restarts_detected: int = 0
    peers_disconnected: int = 0
    bytes_pulled: int = 0


class Handshakes:
    """The remote engines a consumer reads from, and their handshakes.

    Owns one :class:`RemoteEngine` per (engine id, rank), the fetch limiter
    and the handshake queue; the backend owns the loaded remote agents.
    Fetch tasks are started in ``nursery`` (the connector's); :meth:`run`
    must run there too.

    Args:
        engine_id: this engine's id (named in metadata requests).
        tp_size: this (decode) engine's tensor-parallel size.
        layout: the local KV layout (remote layouts must pair with it).
        backend: the transfer backend (loads and retires remote agents).
        zmq_context: for the fetches' sockets.
        config: deadlines and limits.
        nursery: where fetch tasks run.
        counters: the consumer's counters, which this counts into.
    """

    def __init__(
        self,
        engine_id: str,
        tp_size: int,
        layout: KVLayout,
        backend: TransferBackend,
        zmq_context: zmq.Context[zmq.Socket[bytes]],
        config: ConnectorConfig,
        nursery: trio.Nursery,
        counters: ConsumerCounters,
    ) -> None:
        self._engine_id = engine_id
        self._tp_size = tp_size
        self._layout = layout
        self._backend = backend
        self._zmq = zmq_context
        self._config = config
        self._nursery = nursery
        self._counters = counters
        self._compat_hash = protocol.compatibility_hash(config.compatibility_key)
        self._engines: dict[tuple[str, int], RemoteEngine] = {}
        """Keyed by (engine id, rank): each remote rank is its own agent and record."""
        self._fetch_limiter = trio.CapacityLimiter(config.max_concurrent_fetches)
        self._loads_send, self._loads_receive = trio.open_memory_channel[tuple[RemoteEngine, int]](
            math.inf
        )
        self._rng = random.Random()
        self._closed = False

    def engine(self, remote: RemoteBlocks, part: PullPart) -> RemoteEngine:
        """The record of the remote rank ``part`` reads (created on first use)."""
        key = (remote.engine_id, part.remote_rank)
        engine = self._engines.get(key)
        if engine is None:
            record = EngineRecord(remote.engine_id, remote.host, remote.port + part.remote_rank)
            engine = self._engines[key] = RemoteEngine(record, part)
        engine.part, engine.remote_tp = part, remote.tp_size
        return engine

    def engine_state(self, engine_id: str, tp_rank: int | None = None) -> EngineState:
        ranks = sorted(rank for eid, rank in self._engines if eid == engine_id)
        if tp_rank is None and ranks:
            tp_rank = ranks[0]
        engine = self._engines.get((engine_id, tp_rank or 0))
        return EngineState.UNKNOWN if engine is None else engine.record.state

    def ready_count(self) -> int:
        """Remote engine ranks ready for pulls now."""
        return sum(1 for e in self._engines.values() if e.record.state is EngineState.READY)

    async def ready_agent(
        self, engine: RemoteEngine, request_id: str, local_ids: BlockIds, remote: RemoteBlocks
    ) -> RemoteAgent:
        """The agent that serves ``remote``, handshaking as the record says.

        Raises:
            HandshakeError: the attempt this pull waited on failed; the engine
                is in backoff; or it changed under ``HANDSHAKES_PER_PULL``
                handshakes.
            TransferError: the blocks belong to an incarnation that is gone.
        """
        record = engine.record
        port = remote.port + engine.part.remote_rank
        waits = 0
        while True:
            now = trio.current_time()
            action = record.on_pull(remote.incarnation, remote.host, port, now)
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
                assert record.error is not None
                raise _copy(record.error)
            if action is PullAction.GONE:
                reason = engine.rank_label + record.why_gone(remote.incarnation)
                raise TransferError(request_id, local_ids.tolist(), reason)
            if action is PullAction.RETIRE_THEN_START:
                self._counters.restarts_detected += 1
                logger.warning(
                    "engine %s restarted (incarnation %s, seen in request %r): "
                    "retiring its old agent and handshaking again",
                    record.engine_id,
                    remote.incarnation,
                    remote.request_id,
                )
                retired, engine.agent = engine.agent, None
                self._start_attempt(engine)
                if retired is not None:
                    with trio.CancelScope(shield=True):
                        await self._backend.retire(retired)
            elif action is PullAction.START:
                self._start_attempt(engine)
            elif (record.host, record.port) != (remote.host, port):
                logger.warning(
                    "engine %s is being reached at %s:%d; ignoring the address %s:%d of %r",
                    record.engine_id,
                    record.host,
                    record.port,
                    remote.host,
                    port,
                    remote.request_id,
                )
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
        record = engine.record
        engine.attempt_done = trio.Event()
        self._counters.handshakes_started += 1
        logger.info(
            "engine %s: handshake %d started (%s:%d)",
            record.engine_id,
            record.attempts,
            record.host,
            record.port,
        )
        self._nursery.start_soon(self._fetch_metadata, engine, record.attempts)

    async def _fetch_metadata(self, engine: RemoteEngine, attempt: int) -> None:
        """Fetch and check ``engine``'s metadata, then queue it for the handshake task."""
        record = engine.record
        try:
            metadata, layout = await fetch_engine_metadata(
                self._zmq,
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
                limiter=self._fetch_limiter,
            )
        except FetchFailure as failure:
            if not self._closed:
                self._handshake_failed(engine, failure.cause, failure.error)
            return
        if self._closed:
            # The reply was taken from the socket just before the connector
            # closed (a successful receive is not undone by cancellation).
            return
        record.metadata_received(metadata, layout)
        self._loads_send.send_nowait((engine, attempt))

    async def _load(self, engine: RemoteEngine, attempt: int) -> None:
        """Load one engine's agent; its waiters fail if that takes over ``handshake_timeout``.

        The backend's call cannot be abandoned (NIXL calls are not
        interruptible), so the deadline is kept by a watchdog that fails the
        attempt; an agent that loads after it is retired at once.
        """
        record = engine.record
        metadata, layout = record.metadata, record.layout
        assert metadata is not None
        assert layout is not None
        started = time.perf_counter()
        local_view, remote_view = part_layouts(self._layout, layout, engine.part)
        remote: RemoteAgent | None = None
        error: HandshakeError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._load_deadline, engine, attempt)
            try:
                remote = await self._backend.load_remote(
                    record.engine_id,
                    metadata.incarnation,
                    metadata.agent_name,
                    metadata.agent_metadata,
                    remote_view,
                    local_view,
                )
            except BackendError as exc:
                reason = f"{engine.rank_label}loading the remote agent: {exc}"
                error = HandshakeError(record.engine_id, reason)
                error.__cause__ = exc
            nursery.cancel_scope.cancel()
        if record.state is not EngineState.LOADING or record.attempts != attempt:
            if remote is not None:  # too late: its waiters already failed
                await self._backend.retire(remote)
            return
        if error is not None:
            self._handshake_failed(engine, FailureCause.NIXL, error)
            return
        assert remote is not None
        record.loaded()
        engine.agent = remote
        engine.attempt_done.set()
        self._counters.handshakes_succeeded += 1
        logger.info(
            "engine %s: ready (agent %s, %d regions x %d blocks, loaded in %.1f ms)",
            record.engine_id,
            remote.agent_name,
            remote.layout.num_regions,
            remote.layout.num_blocks,
            (time.perf_counter() - started) * 1e3,
        )

    async def _load_deadline(self, engine: RemoteEngine, attempt: int) -> None:
        timeout = self._config.handshake_timeout
        await trio.sleep(timeout)
        if engine.record.state is EngineState.LOADING and engine.record.attempts == attempt:
            reason = f"{engine.rank_label}loading the remote agent took longer than {timeout:g} s"
            error = HandshakeError(engine.record.engine_id, reason)
            self._handshake_failed(engine, FailureCause.NIXL, error)

    def _handshake_failed(
        self, engine: RemoteEngine, cause: FailureCause, error: HandshakeError
    ) -> None:
        delay = engine.record.failed(error, trio.current_time(), self._config.backoff, self._rng)
        engine.attempt_done.set()
        self._counters.handshake_failures[cause] += 1
        logger.warning("%s (next attempt allowed in %.2f s)", error, delay)

    async def run(self) -> None:
        """The handshake task: loads remote agents whose metadata arrived, in order."""
        async for engine, attempt in self._loads_receive:
            await self._load(engine, attempt)

    def peer_lost(self, engine: RemoteEngine, agent: RemoteAgent, request_id: str) -> bool:
        """``agent`` is gone (NIXL said so, or the backend gave it up).

        Returns whether this is news, i.e. ``agent`` was the engine's loaded
        one: then the engine goes stale (the next pull handshakes again), and
        the caller retires the agent.
        """
        if engine.agent is not agent or not engine.record.on_peer_lost(agent.incarnation):
            return False
        engine.agent = None
        self._counters.peers_disconnected += 1
        logger.warning(
            "engine %s: peer lost during request %r; its agent will be removed and the "
            "next pull handshakes again",
            agent.engine_id,
            request_id,
        )
        return True

    def begin_close(self) -> None:
        """Wake every waiter (they raise ClosedResourceError); stop the handshake task."""
        if self._closed:
            return
        self._closed = True
        for engine in self._engines.values():
            engine.record.apply(EngineEvent.CONNECTOR_CLOSED)
            engine.attempt_done.set()
        self._loads_send.close()

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"connector {self._engine_id!r} is closed")


def _copy(error: HandshakeError) -> HandshakeError:
    """A fresh exception equal to ``error`` (one object per raise keeps tracebacks apart)."""
    fresh = type(error)(error.engine_id, error.reason)
    fresh.__cause__ = error.__cause__
    return fresh
