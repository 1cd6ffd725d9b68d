"""The consumer role (decode side): remote engines, their handshakes, and pulls.

The policy -- when to handshake, wait, fail fast, retire a restarted engine's
agent or refuse blocks of a gone incarnation -- is in ``_engines``
(:meth:`EngineRecord.on_pull` returns an action); this module carries the
actions out with trio, ZeroMQ and the transfer backend. Its tasks run in the
connector's nursery:

* the *handshake task* (:meth:`Consumer.run_handshakes`): loads every remote
  agent whose metadata arrived, one at a time, in order;
* *fetch tasks*, one per handshake attempt, started by the pull that starts
  the attempt: each fetches and checks one engine's metadata within
  ``handshake_timeout``, at most ``max_concurrent_fetches`` at once.

Pulls run in the caller's task. Each handshake attempt has a
:class:`trio.Event`; its outcome is in the engine's record (state, error), so
every waiter reads the same answer.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from types import MappingProxyType
from typing import NoReturn, TypeVar

import attrs
import numpy as np
import trio
import zmq
from trio_util import AsyncValue

from . import _protocol as protocol
from ._backend import (
    BackendClosing,
    BackendError,
    RemoteAgent,
    RemoteRetired,
    TransferBackend,
    TransferTimeout,
)
from ._config import ConnectorConfig
from ._engines import EngineEvent, EngineRecord, EngineState, FailureCause, PullAction
from ._errors import HandshakeError, IncompatibleEngineError, TransferError
from ._fetch import FetchFailure, fetch_engine_metadata
from ._layout import BlockIds, KVLayout, as_block_ids
from ._records import ConsumerStatistics, PullResult, RemoteBlocks
from ._tp import PullPart, part_layouts, plan_pull, readers_per_remote_rank, sizes_mismatch

logger = logging.getLogger("trio_pd")

HANDSHAKES_PER_PULL = 3
"""A pull gives up (``HandshakeError``) if its engine changed under this many handshakes."""


@attrs.define(eq=False)
class _Engine:
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
class _Counters:
    handshakes_started: int = 0
    handshakes_succeeded: int = 0
    handshake_failures: Counter[FailureCause] = attrs.field(factory=Counter)
    pulls_succeeded: int = 0
    pulls_failed: int = 0
    pulls_rejected_in_backoff: int = 0
    restarts_detected: int = 0
    peers_disconnected: int = 0
    bytes_pulled: int = 0


class Consumer:
    """The decode side of a connector: pulls remote engines' blocks.

    Owns the remote engines' records, the fetch limiter and the handshake
    queue; the backend owns the loaded remote agents. Fetch tasks are started
    in ``nursery`` (the connector's); :meth:`run_handshakes` must run there too.

    Args:
        engine_id: this engine's id (named in metadata requests).
        tp_rank, tp_size: this rank of the (decode) engine, and how many it has.
        layout: the local KV layout (remote layouts must match it).
        backend: the transfer backend.
        zmq_context: for the fetches' sockets.
        config: deadlines and limits.
        nursery: where fetch tasks run.
    """

    def __init__(
        self,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        layout: KVLayout,
        backend: TransferBackend,
        zmq_context: zmq.Context[zmq.Socket[bytes]],
        config: ConnectorConfig,
        nursery: trio.Nursery,
    ) -> None:
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._layout = layout
        self._backend = backend
        self._zmq = zmq_context
        self._config = config
        self._nursery = nursery
        self._compat_hash = protocol.compatibility_hash(config.compatibility_key)
        self._engines: dict[tuple[str, int], _Engine] = {}
        """Keyed by (engine id, rank): each remote rank is its own agent and record."""
        self._fetch_limiter = trio.CapacityLimiter(config.max_concurrent_fetches)
        self._loads_send, self._loads_receive = trio.open_memory_channel[tuple[_Engine, int]](
            math.inf
        )
        self._rng = random.Random()
        self._pulls_in_flight: AsyncValue = AsyncValue(0)
        self._counters = _Counters()
        self._closed = False

    # ---- public (through the Connector facade) ---------------------------

    async def pull(
        self, request_id: str, local_block_ids: Sequence[int], remote: RemoteBlocks
    ) -> PullResult:
        """See :meth:`trio_pd.Connector.pull`.

        Three phases, so that nothing is transferred unless every part can
        be: the remote ranks this rank reads (see ``_tp.plan_pull``) are made
        ready concurrently; every part's block ids are checked; then the
        parts transfer concurrently.
        """
        self._check_open()
        started = trio.current_time()
        what = f"request {request_id!r}"
        local_ids = as_block_ids(
            local_block_ids, self._layout.num_blocks, f"local block ids of {what}"
        )
        if local_ids.size and local_ids.size != len(remote.block_ids):
            raise ValueError(
                f"{what}: {local_ids.size} local block ids for "
                f"{len(remote.block_ids)} remote block ids"
            )
        mismatch = sizes_mismatch(self._tp_size, remote.tp_size)
        if mismatch is not None:
            raise IncompatibleEngineError(remote.engine_id, mismatch)
        parts = plan_pull(self._tp_rank, self._tp_size, remote.tp_size)
        engines = [self._engine(remote, part) for part in parts]
        try:
            agents = await _each(
                [
                    functools.partial(self._ready_agent, e, request_id, local_ids, remote)
                    for e in engines
                ]
            )
            handshake_wait = trio.current_time() - started
            transfers = [
                self._transfer_for(engine, agent, request_id, local_ids, remote)
                for engine, agent in zip(engines, agents, strict=True)
            ]
            await _each(transfers)
        except TransferError:
            self._counters.pulls_failed += 1
            raise
        nbytes = int(local_ids.size) * self._layout.bytes_per_block_id
        self._counters.pulls_succeeded += 1
        self._counters.bytes_pulled += nbytes
        return PullResult(
            request_id, remote.engine_id, nbytes, trio.current_time() - started, handshake_wait
        )

    def _engine(self, remote: RemoteBlocks, part: PullPart) -> _Engine:
        """The record of the remote rank ``part`` reads (created on first use)."""
        key = (remote.engine_id, part.remote_rank)
        engine = self._engines.get(key)
        if engine is None:
            record = EngineRecord(remote.engine_id, remote.host, remote.port + part.remote_rank)
            engine = self._engines[key] = _Engine(record, part)
        engine.part, engine.remote_tp = part, remote.tp_size
        return engine

    def _transfer_for(
        self,
        engine: _Engine,
        agent: RemoteAgent,
        request_id: str,
        local_ids: BlockIds,
        remote: RemoteBlocks,
    ) -> Callable[[], Awaitable[None]]:
        """One part's transfer, its block ids checked now (before any part runs)."""
        readers = readers_per_remote_rank(self._tp_size, remote.tp_size)
        notification = protocol.encode_notification(remote.request_id, readers)
        indices = None
        if local_ids.size:
            remote_ids = as_block_ids(
                remote.block_ids,
                agent.layout.num_blocks,
                f"remote block ids of request {request_id!r} (engine {remote.engine_id!r})",
            )
            indices = (
                agent.local_layout.descriptor_indices(local_ids),
                agent.layout.descriptor_indices(remote_ids),
            )
        return functools.partial(
            self._transfer, engine, request_id, local_ids, agent, indices, notification
        )

    def engine_state(self, engine_id: str, tp_rank: int | None = None) -> EngineState:
        ranks = sorted(rank for eid, rank in self._engines if eid == engine_id)
        if tp_rank is None and ranks:
            tp_rank = ranks[0]
        engine = self._engines.get((engine_id, tp_rank or 0))
        return EngineState.UNKNOWN if engine is None else engine.record.state

    def statistics(self) -> ConsumerStatistics:
        c = self._counters
        ready = sum(1 for e in self._engines.values() if e.record.state is EngineState.READY)
        return ConsumerStatistics(
            handshakes_started=c.handshakes_started,
            handshakes_succeeded=c.handshakes_succeeded,
            handshakes_failed=c.handshake_failures.total(),
            handshake_failures_by_cause=MappingProxyType(
                {str(cause): n for cause, n in c.handshake_failures.items()}
            ),
            engines_ready=ready,
            pulls_succeeded=c.pulls_succeeded,
            pulls_failed=c.pulls_failed,
            pulls_in_flight=self._pulls_in_flight.value,
            pulls_rejected_in_backoff=c.pulls_rejected_in_backoff,
            restarts_detected=c.restarts_detected,
            peers_disconnected=c.peers_disconnected,
            bytes_pulled=c.bytes_pulled,
            remote_agents_loaded=self._backend.remote_agents_loaded,
        )

    # ---- handshakes: carry out the record's actions ----------------------

    async def _ready_agent(
        self, engine: _Engine, request_id: str, local_ids: BlockIds, remote: RemoteBlocks
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
                record.on_peer_lost(engine.agent.incarnation)
                engine.agent = None
                continue
            if action is PullAction.FAIL_FAST:
                self._counters.pulls_rejected_in_backoff += 1
                assert record.error is not None
                raise _copy(record.error)
            if action is PullAction.GONE:
                reason = engine.rank_label + record.why_gone(remote.incarnation)
                self._fail(request_id, local_ids, reason)
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

    def _start_attempt(self, engine: _Engine) -> None:
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

    async def _fetch_metadata(self, engine: _Engine, attempt: int) -> None:
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

    async def run_handshakes(self) -> None:
        """The handshake task: loads remote agents whose metadata arrived, in order."""
        async for engine, attempt in self._loads_receive:
            await self._load(engine, attempt)

    async def _load(self, engine: _Engine, attempt: int) -> None:
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

    async def _load_deadline(self, engine: _Engine, attempt: int) -> None:
        timeout = self._config.handshake_timeout
        await trio.sleep(timeout)
        if engine.record.state is EngineState.LOADING and engine.record.attempts == attempt:
            reason = f"{engine.rank_label}loading the remote agent took longer than {timeout:g} s"
            error = HandshakeError(engine.record.engine_id, reason)
            self._handshake_failed(engine, FailureCause.NIXL, error)

    def _handshake_failed(
        self, engine: _Engine, cause: FailureCause, error: HandshakeError
    ) -> None:
        delay = engine.record.failed(error, trio.current_time(), self._config.backoff, self._rng)
        engine.attempt_done.set()
        self._counters.handshake_failures[cause] += 1
        logger.warning("%s (next attempt allowed in %.2f s)", error, delay)

    # ---- transfers -------------------------------------------------------

    async def _transfer(
        self,
        engine: _Engine,
        request_id: str,
        local_ids: BlockIds,
        agent: RemoteAgent,
        indices: tuple[np.ndarray, np.ndarray] | None,
        notification: bytes,
    ) -> None:
        """READ ``indices`` (local, remote) with ``notification``; only notify if ``None``.

        The agent is leased for the transfer: it cannot be unloaded under it.
        (A pull with several parts checkpoints between making its ranks ready
        and leasing them; an agent retired in that gap fails the pull before
        anything is read.)
        """
        self._pulls_in_flight.value += 1
        try:
            async with AsyncExitStack() as lease:
                try:
                    await lease.enter_async_context(self._backend.lease(agent))
                except RemoteRetired:
                    reason = "its agent was retired (restart or lost peer) before the transfer"
                    self._fail(request_id, local_ids, engine.rank_label + reason)
                try:
                    if indices is None:
                        await self._backend.notify(agent, notification)
                    else:
                        await self._backend.read(agent, *indices, notification)
                except BackendError as exc:
                    if exc.peer_lost and engine.record.on_peer_lost(agent.incarnation):
                        self._peer_lost(engine, agent, request_id)
                        with trio.CancelScope(shield=True):
                            await self._backend.retire(agent)  # unloaded when the lease ends
                    self._fail(request_id, local_ids, engine.rank_label + str(exc), cause=exc)
                except TransferTimeout:
                    timeout = self._config.transfer_timeout
                    reason = f"{engine.rank_label}not complete within {timeout:g} s"
                    self._fail(request_id, local_ids, reason)
                except BackendClosing:
                    raise trio.ClosedResourceError(
                        f"connector closed while request {request_id!r} was in flight"
                    ) from None
        finally:
            self._pulls_in_flight.value -= 1

    def _peer_lost(self, engine: _Engine, agent: RemoteAgent, request_id: str) -> None:
        engine.agent = None
        self._counters.peers_disconnected += 1
        logger.warning(
            "engine %s: peer lost during request %r; its agent will be removed and the "
            "next pull handshakes again",
            agent.engine_id,
            request_id,
        )

    def _fail(
        self, request_id: str, local_ids: BlockIds, reason: str, cause: BaseException | None = None
    ) -> NoReturn:
        """Raise the pull's TransferError (``pull`` counts it)."""
        raise TransferError(request_id, local_ids.tolist(), reason) from cause

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
        for engine in self._engines.values():
            engine.record.apply(EngineEvent.CONNECTOR_CLOSED)
            engine.attempt_done.set()
        self._loads_send.close()

    async def wait_pulls_done(self) -> None:
        """Until no pull is in flight (bound it with a cancel scope)."""
        await self._pulls_in_flight.wait_value(lambda n: n == 0)

    @property
    def pulls_in_flight(self) -> int:
        count: int = self._pulls_in_flight.value
        return count


def _copy(error: HandshakeError) -> HandshakeError:
    """A fresh exception equal to ``error`` (one object per raise keeps tracebacks apart)."""
    fresh = type(error)(error.engine_id, error.reason)
    fresh.__cause__ = error.__cause__
    return fresh


_T = TypeVar("_T")


async def _each(calls: Sequence[Callable[[], Awaitable[_T]]]) -> list[_T]:
    """Await every call concurrently and return their results in order.

    The first call to fail cancels the others (a cancelled transfer still
    ends before its task does), and its error propagates alone. One call
    runs in the caller's task, with no nursery.
    """
    if len(calls) == 1:
        return [await calls[0]()]
    results: dict[int, _T] = {}
    failures: list[Exception] = []

    async def run(index: int, call: Callable[[], Awaitable[_T]]) -> None:
        try:
            results[index] = await call()
        except Exception as exc:
            failures.append(exc)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for index, call in enumerate(calls):
            nursery.start_soon(run, index, call)
    if failures:
        raise failures[0]
    return [results[index] for index in range(len(calls))]
