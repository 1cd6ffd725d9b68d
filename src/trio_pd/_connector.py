"""The connector: one engine's side channel, handshakes, pulls and exposures.

This module is the trio shell that ties the I/O-free pieces (``_protocol``,
``_engines``, ``_exposures``, ``_layout``) to ZeroMQ (``_zmq``) and NIXL
(``_nixl``). The task tree, all owned by the nursery of :func:`open_connector`::

    open_connector nursery
    |-- ZAP handler          with CURVE auth only: admits allowed consumers
    |-- listener             ROUTER socket: answers metadata requests
    |-- handshake task       the only task that changes NIXL's remote agents
    |                        (loads new engines, unloads stale ones)
    |-- notification task    producer: counts notifications, expires exposures
    `-- fetch tasks          one per handshake attempt, at most
                             ``max_concurrent_fetches`` on the network at once

Pulls run in the caller's task; each waits on its engine's handshake attempt
(a :class:`trio.Event` with the outcome stored beside it), then runs its
transfer in a NIXL worker thread.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import TYPE_CHECKING, NoReturn

import attrs
import numpy as np
import trio
import zmq
from trio_util import AsyncValue

from . import _protocol as protocol
from ._auth import serve_zap
from ._config import ConnectorConfig
from ._engines import EngineEvent, EngineRecord, EngineState, PullAction
from ._errors import HandshakeError, IncompatibleEngineError, ProtocolError, TransferError
from ._exposures import ExposureTable, Notice, Released
from ._fetch import ConnectionLog, CurveClient, FetchRefused, fetch_reply
from ._groups import unwrapped_errors
from ._layout import KVLayout, as_block_ids, layout_of_tensors
from ._nixl import EngineClosing, NixlCallError, NixlEngine, RemoteAgent, TransferTimeout
from ._records import ConnectorStatistics, PullResult, RemoteBlocks
from ._zmq import TrioZmqSocket

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("trio_pd")


@attrs.define(eq=False)
class _Attempt:
    """One handshake attempt: waiters wait on ``done``, then read the outcome."""

    done: trio.Event = attrs.field(factory=trio.Event)
    remote: RemoteAgent | None = None
    error: HandshakeError | None = None


@attrs.define(eq=False)
class _Engine:
    record: EngineRecord
    attempt: _Attempt = attrs.field(factory=_Attempt)


@attrs.define
class _Counters:
    handshakes_started: int = 0
    handshakes_succeeded: int = 0
    handshake_failures: Counter[str] = attrs.field(factory=Counter)
    pulls_succeeded: int = 0
    pulls_failed: int = 0
    pulls_rejected_in_backoff: int = 0
    restarts_detected: int = 0
    peers_disconnected: int = 0
    bytes_pulled: int = 0
    notifications_ignored: int = 0
    listener_requests: int = 0
    listener_rejects: int = 0
    listener_auth_failures: int = 0


class Connector:
    """One engine's end of P/D KV transfer: producer, consumer, or both.

    Create it with :func:`open_connector`, which owns its tasks and resources.
    A prefill engine calls :meth:`expose` and :meth:`wait_released`; a decode
    engine calls :meth:`pull`. All methods are safe to call from many tasks.
    After the connector closes, every method raises
    :class:`trio.ClosedResourceError`.
    """

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        nixl: NixlEngine,
        zmq_context: zmq.Context[zmq.Socket[bytes]],
        config: ConnectorConfig,
        incarnation: str,
    ) -> None:
        self._engine_id = engine_id
        self._layout = layout
        self._nixl = nixl
        self._zmq = zmq_context
        self._config = config
        self._incarnation = incarnation
        self._address: tuple[str, int] | None = None
        self._closed = False
        self._nursery: trio.Nursery | None = None
        self._compat_hash = protocol.compatibility_hash(config.compatibility_key)
        self._engines: dict[str, _Engine] = {}
        self._fetch_limiter = trio.CapacityLimiter(config.max_concurrent_fetches)
        self._jobs_send, self._jobs_receive = trio.open_memory_channel[_Engine | RemoteAgent](
            math.inf
        )
        self._rng = random.Random()
        self._inline_lock = trio.Lock()
        self._exposures = ExposureTable(history=config.resolved_history)
        self._release_events: dict[str, trio.Event] = {}
        self._exposure_added = trio.Event()
        self._pulls_in_flight = AsyncValue(0)
        self._counters = _Counters()
        self._encoded_reply = b""

    # ---- public ---------------------------------------------------------

    @property
    def engine_id(self) -> str:
        """This engine's id."""
        return self._engine_id

    @property
    def address(self) -> tuple[str, int]:
        """The side channel's ``(host, port)`` as bound (the real port if 0 was asked)."""
        assert self._address is not None, "connector not started"
        return self._address

    @property
    def layout(self) -> KVLayout:
        """The local KV cache's layout."""
        return self._layout

    def expose(self, request_id: str, block_ids: Sequence[int], consumers: int = 1) -> RemoteBlocks:
        """Hold ``block_ids`` for ``consumers`` decode engines to read (producer side).

        The blocks must already hold the request's KV data and must not be
        reused until :meth:`wait_released` says so. The returned record goes to
        the decoder (via :meth:`RemoteBlocks.to_kv_transfer_params` through a
        P/D proxy). The exposure resolves :attr:`Released.READ` when
        ``consumers`` distinct decode engines have read and notified, or
        :attr:`Released.EXPIRED` after ``config.abort_timeout``.

        Raises:
            ValueError: ``request_id`` is already pending; block ids out of
                range, repeated or not ints; ``consumers < 1``.
            trio.ClosedResourceError: the connector is closed.
        """
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        ids = as_block_ids(
            block_ids, self._layout.num_blocks, f"block ids of request {request_id!r}"
        )
        deadline = trio.current_time() + self._config.abort_timeout
        self._exposures.expose(request_id, ids, consumers, deadline)
        self._release_events[request_id] = trio.Event()
        self._exposure_added.set()
        host, port = self.address
        return RemoteBlocks(
            self._engine_id, host, port, ids.tolist(), request_id, self._incarnation
        )

    async def wait_released(self, request_id: str) -> Released:
        """Wait until the exposure of ``request_id`` resolves; return how.

        Returns at once if it already resolved (outcomes are remembered for
        the last ``config.resolved_history`` exposures).

        Raises:
            KeyError: ``request_id`` was never exposed (or long forgotten).
            trio.ClosedResourceError: the connector closed first.
        """
        self._check_open()
        outcome = self._exposures.outcome(request_id)
        if outcome is not None:
            await trio.lowlevel.checkpoint()
            return outcome
        await self._release_events[request_id].wait()
        self._check_open()
        outcome = self._exposures.outcome(request_id)
        assert outcome is not None
        return outcome

    async def pull(
        self, request_id: str, local_block_ids: Sequence[int], remote: RemoteBlocks
    ) -> PullResult:
        """Copy ``remote``'s blocks into ``local_block_ids`` (consumer side).

        The k-th remote block lands in the k-th local block, in every region.
        The first pull for an engine starts its handshake; concurrent pulls for
        that engine share it; pulls for ready engines never wait for another
        engine's handshake. When this returns, the data is in place and the
        producer has been notified. An empty ``local_block_ids`` only notifies
        the producer (a full prefix-cache hit).

        If ``remote.incarnation`` names another incarnation than the one this
        connector knows, the engine restarted: its old agent is retired and a
        fresh handshake runs first. Blocks exposed by an incarnation that is no
        longer running are never read (:class:`TransferError`).

        Cancellation: if the calling task is cancelled, no further transfer
        of this pull is posted and the running one is waited for until it
        ends (at most ``config.close_timeout``; only then is it released
        while still running) before :class:`trio.Cancelled` propagates, so
        nothing writes into the local blocks afterwards. The handshake itself
        goes on for other waiters.

        Raises:
            ValueError: before anything is sent: local and remote lengths
                differ; a block id is out of range, repeated or not an int.
                Remote ids are checked against the remote's size once the
                handshake is done, still before any transfer.
            HandshakeError: the handshake failed (the same error for every
                pull that waited on it), or the engine is in backoff after a
                failed handshake (the same error again, at once);
                :class:`IncompatibleEngineError` if the engines cannot be paired.
            TransferError: NIXL reported an error, the transfer did not finish
                within ``config.transfer_timeout``, or the blocks belong to an
                incarnation of the engine that is gone; it names the local
                block ids that hold undefined data.
            trio.ClosedResourceError: the connector is (or got) closed.
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
        known = self._engines.get(remote.engine_id)
        if known is not None and remote.incarnation in known.record.retired_incarnations:
            self._gone_incarnation(request_id, local_ids, remote, known.record.incarnation)
        if self._config.inline_handshakes:  # comparison mode: pre-#19836 behaviour
            async with self._inline_lock:
                remote_agent = await self._ready_agent(remote)
        else:
            remote_agent = await self._ready_agent(remote)
        handshake_wait = trio.current_time() - started
        if remote.incarnation and remote.incarnation != remote_agent.incarnation:
            self._gone_incarnation(request_id, local_ids, remote, remote_agent.incarnation)
        notification = protocol.encode_notification(remote.request_id)
        if local_ids.size == 0:
            await self._transfer(request_id, local_ids, remote_agent, None, notification)
            self._counters.pulls_succeeded += 1
            return PullResult(request_id, remote.engine_id, 0, handshake_wait, handshake_wait)
        remote_ids = as_block_ids(
            remote.block_ids,
            remote_agent.layout.num_blocks,
            f"remote block ids of {what} (engine {remote.engine_id!r})",
        )
        indices = (
            self._layout.descriptor_indices(local_ids),
            remote_agent.layout.descriptor_indices(remote_ids),
        )
        await self._transfer(request_id, local_ids, remote_agent, indices, notification)
        nbytes = int(local_ids.size) * self._layout.bytes_per_block_id
        self._counters.pulls_succeeded += 1
        self._counters.bytes_pulled += nbytes
        return PullResult(
            request_id,
            remote.engine_id,
            nbytes,
            trio.current_time() - started,
            handshake_wait,
        )

    def _gone_incarnation(
        self,
        request_id: str,
        local_ids: np.ndarray,
        remote: RemoteBlocks,
        current: str | None,
    ) -> NoReturn:
        self._counters.pulls_failed += 1
        raise TransferError(
            request_id,
            local_ids.tolist(),
            f"the blocks were exposed by incarnation {remote.incarnation} of engine "
            f"{remote.engine_id!r}, which now runs {current}: "
            "it restarted and the blocks are gone",
        )

    def statistics(self) -> ConnectorStatistics:
        """A snapshot of this connector's counters."""
        c = self._counters
        ready = sum(1 for e in self._engines.values() if e.record.state is EngineState.READY)
        return ConnectorStatistics(
            handshakes_started=c.handshakes_started,
            handshakes_succeeded=c.handshakes_succeeded,
            handshakes_failed=c.handshake_failures.total(),
            handshake_failures_by_cause=MappingProxyType(dict(c.handshake_failures)),
            engines_ready=ready,
            pulls_succeeded=c.pulls_succeeded,
            pulls_failed=c.pulls_failed,
            pulls_in_flight=self._pulls_in_flight.value,
            pulls_rejected_in_backoff=c.pulls_rejected_in_backoff,
            restarts_detected=c.restarts_detected,
            peers_disconnected=c.peers_disconnected,
            bytes_pulled=c.bytes_pulled,
            exposures_pending=self._exposures.pending,
            exposures_released=self._exposures.released,
            exposures_expired=self._exposures.expired,
            notifications_ignored=c.notifications_ignored,
            listener_requests=c.listener_requests,
            listener_rejects=c.listener_rejects,
            listener_auth_failures=c.listener_auth_failures,
        )

    def engine_state(self, engine_id: str) -> EngineState:
        """Where the handshake with ``engine_id`` stands (``UNKNOWN`` if never seen)."""
        engine = self._engines.get(engine_id)
        return EngineState.UNKNOWN if engine is None else engine.record.state

    # ---- consumer: handshakes -------------------------------------------

    def _engine_for(self, remote: RemoteBlocks) -> _Engine:
        """The engine ``remote`` names, with a handshake started if it needs one.

        Raises:
            HandshakeError: the engine is in backoff (its last error, again).
        """
        engine = self._engines.get(remote.engine_id)
        if engine is None:
            record = EngineRecord(remote.engine_id, remote.host, remote.port)
            engine = self._engines[remote.engine_id] = _Engine(record)
        record = engine.record
        if (
            record.state is EngineState.READY
            and remote.incarnation
            and remote.incarnation != record.incarnation
        ):
            self._counters.restarts_detected += 1
            logger.warning(
                "engine %s restarted (incarnation %s -> %s, seen in request %r): "
                "removing its old agent and handshaking again",
                record.engine_id,
                record.incarnation,
                remote.incarnation,
                remote.request_id,
            )
            self._retire(engine, EngineEvent.PEER_RESTARTED)
        if record.state in (EngineState.UNKNOWN, EngineState.STALE, EngineState.BACKOFF):
            record.host, record.port = remote.host, remote.port
        elif (record.host, record.port) != (remote.host, remote.port):
            logger.warning(
                "engine %s is known at %s:%d; ignoring the address %s:%d of request %r",
                record.engine_id,
                record.host,
                record.port,
                remote.host,
                remote.port,
                remote.request_id,
            )
        action = record.on_pull(trio.current_time())
        if action is PullAction.FAIL_FAST:
            self._counters.pulls_rejected_in_backoff += 1
            assert record.error is not None
            raise _copy(record.error)
        if action is PullAction.START:
            engine.attempt = _Attempt()
            self._counters.handshakes_started += 1
            logger.info(
                "engine %s: handshake %d started (%s:%d)",
                record.engine_id,
                record.attempts,
                record.host,
                record.port,
            )
            assert self._nursery is not None
            self._nursery.start_soon(self._fetch_metadata, engine)
        return engine

    def _retire(self, engine: _Engine, event: EngineEvent) -> None:
        """Mark ``engine`` stale and retire its agent (unloaded once unused)."""
        engine.record.went_stale(event)
        remote = engine.attempt.remote
        engine.attempt = _Attempt()
        if remote is not None and not remote.retired:
            remote.retired = True
            if remote.users == 0:
                self._jobs_send.send_nowait(remote)

    async def _ready_agent(self, remote: RemoteBlocks) -> RemoteAgent:
        """The loaded agent of ``remote``'s engine, handshaking first if needed.

        Two races get one more handshake each: an agent retired (engine
        restarted or lost) between the handshake and this task waking up, and
        a handshake that was under way when the engine restarted, which loads
        the old incarnation -- the request's newer one then retires it.

        Raises:
            HandshakeError: the engine kept changing under three handshakes.
        """
        for _ in range(3):
            engine = self._engine_for(remote)
            agent = await self._wait_ready(engine)
            if agent.retired:
                continue
            if (
                not remote.incarnation
                or agent.incarnation == remote.incarnation
                or remote.incarnation in engine.record.retired_incarnations
            ):
                return agent
        raise HandshakeError(remote.engine_id, "the engine changed during three handshakes")

    async def _wait_ready(self, engine: _Engine) -> RemoteAgent:
        attempt = engine.attempt
        await attempt.done.wait()
        self._check_open()
        if attempt.remote is not None:
            return attempt.remote
        if attempt.error is not None:
            raise _copy(attempt.error)
        raise trio.ClosedResourceError("connector closed during the handshake")

    async def _fetch_metadata(self, engine: _Engine) -> None:
        """Fetch and check ``engine``'s metadata, then queue it for the handshake task."""
        record = engine.record
        eid, timeout = record.engine_id, self._config.handshake_timeout
        log = ConnectionLog(self._config.max_message_bytes)
        where = f"{record.host}:{record.port}"
        try:
            try:
                with trio.fail_after(timeout):
                    async with self._fetch_limiter:
                        data = await fetch_reply(
                            self._zmq,
                            _endpoint(record.host, record.port),
                            protocol.encode_request(eid, self._engine_id),
                            log,
                            ipv6=":" in record.host,
                            curve=self._curve_client(eid),
                        )
            except trio.TooSlowError:
                raise _Failure(
                    "timeout",
                    HandshakeError(
                        eid, f"no reply from {where} within {timeout:g} s: {log.diagnosis()}"
                    ),
                ) from None
            except FetchRefused as exc:
                raise _Failure("refused", HandshakeError(eid, f"{where}: {exc}")) from None
            except (ValueError, zmq.ZMQError) as exc:
                raise _Failure("protocol", HandshakeError(eid, f"{where}: {exc}")) from None
            try:
                metadata = protocol.decode_reply(
                    data,
                    expected_engine_id=eid,
                    local_hash=self._compat_hash,
                    max_bytes=self._config.max_message_bytes,
                )
                layout = self._remote_layout(eid, metadata)
            except IncompatibleEngineError as exc:
                raise _Failure("incompatible", exc) from None
            except HandshakeError as exc:
                raise _Failure("protocol", exc) from None
        except _Failure as failure:
            self._handshake_failed(engine, failure.cause, failure.error)
            return
        record.metadata_received(metadata, layout)
        self._jobs_send.send_nowait(engine)

    def _curve_client(self, engine_id: str) -> CurveClient | None:
        auth = self._config.auth
        if auth is None:
            return None
        server_key = auth.producer_key(engine_id)
        if server_key is None:
            raise _Failure(
                "refused",
                HandshakeError(engine_id, "no CURVE public key configured for this producer"),
            )
        return CurveClient(auth.public_key.encode(), auth.secret_key.encode(), server_key.encode())

    def _remote_layout(self, engine_id: str, metadata: protocol.EngineMetadata) -> KVLayout:
        try:
            layout = metadata.layout()
        except ProtocolError as exc:
            raise HandshakeError(engine_id, str(exc)) from None
        mismatch = self._layout.mismatch(layout)
        if mismatch is not None:
            raise IncompatibleEngineError(engine_id, mismatch)
        return layout

    async def _run_handshakes(self) -> None:
        """The handshake task: every NIXL remote-agent mutation, one at a time.

        Jobs are engines whose metadata arrived (load them) and retired remote
        agents nobody uses any more (unload them), in the order they came.
        """
        async for job in self._jobs_receive:
            if isinstance(job, RemoteAgent):
                await self._unload(job)
            else:
                await self._load(job)

    async def _load(self, engine: _Engine) -> None:
        record = engine.record
        metadata, layout = record.metadata, record.layout
        assert metadata is not None
        assert layout is not None
        started = time.perf_counter()
        try:
            remote = await self._nixl.load_remote(
                record.engine_id,
                metadata.incarnation,
                metadata.agent_name,
                metadata.agent_metadata,
                layout,
            )
        except NixlCallError as exc:
            error = HandshakeError(record.engine_id, f"loading the remote agent: {exc}")
            error.__cause__ = exc
            self._handshake_failed(engine, "nixl", error)
            return
        record.loaded()
        engine.attempt.remote = remote
        engine.attempt.done.set()
        self._counters.handshakes_succeeded += 1
        logger.info(
            "engine %s: ready (agent %s, %d regions x %d blocks, loaded in %.1f ms)",
            record.engine_id,
            remote.agent_name,
            remote.layout.num_regions,
            remote.layout.num_blocks,
            (time.perf_counter() - started) * 1e3,
        )

    async def _unload(self, remote: RemoteAgent) -> None:
        try:
            await self._nixl.unload_remote(remote)
        except Exception as exc:  # the agent is dead anyway; keep serving others
            logger.warning(
                "engine %s: removing agent %s failed: %s", remote.engine_id, remote.agent_name, exc
            )
        else:
            logger.info("engine %s: removed stale agent %s", remote.engine_id, remote.agent_name)

    def _handshake_failed(self, engine: _Engine, cause: str, error: HandshakeError) -> None:
        delay = engine.record.failed(error, trio.current_time(), self._config.backoff, self._rng)
        engine.attempt.error = error
        engine.attempt.done.set()
        self._counters.handshake_failures[cause] += 1
        logger.warning("%s (next attempt allowed in %.2f s)", error, delay)

    # ---- consumer: transfers --------------------------------------------

    async def _transfer(
        self,
        request_id: str,
        local_ids: np.ndarray,
        remote_agent: RemoteAgent,
        indices: tuple[np.ndarray, np.ndarray] | None,
        notification: bytes,
    ) -> None:
        """READ ``indices`` (local, remote) with ``notification``; only notify if ``None``."""
        timeout = self._config.transfer_timeout
        self._pulls_in_flight.value += 1
        remote_agent.users += 1
        try:
            if indices is None:
                await self._nixl.notify(remote_agent, notification)
            else:
                await self._nixl.read(
                    remote_agent, *indices, notification, time.monotonic() + timeout
                )
        except NixlCallError as exc:
            self._counters.pulls_failed += 1
            if exc.peer_lost:
                self._peer_lost(remote_agent, request_id)
            raise TransferError(request_id, local_ids.tolist(), str(exc)) from exc
        except TransferTimeout:
            self._counters.pulls_failed += 1
            raise TransferError(
                request_id, local_ids.tolist(), f"not complete within {timeout:g} s"
            ) from None
        except EngineClosing:
            raise trio.ClosedResourceError(
                f"connector closed while request {request_id!r} was in flight"
            ) from None
        finally:
            self._pulls_in_flight.value -= 1
            remote_agent.users -= 1
            if remote_agent.retired and remote_agent.users == 0 and not self._closed:
                self._jobs_send.send_nowait(remote_agent)

    def _peer_lost(self, remote_agent: RemoteAgent, request_id: str) -> None:
        engine = self._engines.get(remote_agent.engine_id)
        if engine is None or engine.attempt.remote is not remote_agent:
            return  # already retired
        self._counters.peers_disconnected += 1
        logger.warning(
            "engine %s: peer lost during request %r; its agent will be removed and the "
            "next pull handshakes again",
            remote_agent.engine_id,
            request_id,
        )
        self._retire(engine, EngineEvent.PEER_DISCONNECTED)

    # ---- producer: side channel and notifications -----------------------

    async def _serve_listener(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind the ROUTER socket, report the address, answer requests until cancelled.

        Every request gets a reply: the metadata, or an error reply saying why
        (counted in ``listener_rejects``). Messages without a request envelope
        are dropped and counted. Messages over ``max_message_bytes`` never
        reach us: ZeroMQ closes that connection. With CURVE auth, consumers
        the ZAP handler refuses never reach us either. Sends never block:
        ROUTER drops replies to peers that are gone.
        """
        socket = TrioZmqSocket(self._zmq.socket(zmq.ROUTER))
        async with socket:
            raw = socket.zmq_socket
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
            if ":" in host:
                raw.setsockopt(zmq.IPV6, 1)
            if self._config.auth is not None:
                self._config.auth.configure_server(raw)
            try:
                raw.bind(_endpoint(host, port or "*"))
            except zmq.ZMQError as exc:
                raise OSError(
                    exc.errno, f"cannot bind the side channel to {host}:{port}: {exc}"
                ) from exc
            endpoint = raw.getsockopt_string(zmq.LAST_ENDPOINT)
            bound_port = int(endpoint.rsplit(":", 1)[1])
            task_status.started((host, bound_port))
            while True:
                frames = await socket.receive_multipart()
                if len(frames) != 3 or frames[1] != b"":
                    self._counters.listener_rejects += 1
                    logger.debug("listener: dropped a message of %d frames", len(frames))
                    continue
                reply, reject = protocol.serve_request(
                    frames[2],
                    engine_id=self._engine_id,
                    encoded_reply=self._encoded_reply,
                    max_bytes=self._config.max_message_bytes,
                )
                if reject is None:
                    self._counters.listener_requests += 1
                else:
                    self._counters.listener_rejects += 1
                    logger.debug("listener: rejected a request: %s", reject)
                await socket.send_multipart([frames[0], b"", reply])

    def _auth_refused(self, reason: str) -> None:
        self._counters.listener_auth_failures += 1
        logger.warning("engine %s: side channel refused a consumer: %s", self._engine_id, reason)

    async def _collect_notifications(self) -> None:
        """Count consumer notifications and expire overdue exposures, until cancelled."""
        config = self._config
        while True:
            if self._exposures.pending:
                # checks every poll_interval in the notification thread (this
                # also drives our UCX worker, which consumers' READs need)
                wait = config.notification_poll_interval
            else:
                self._exposure_added = trio.Event()
                with trio.move_on_after(config.idle_notification_poll_interval):
                    await self._exposure_added.wait()
                wait = 0.0
            try:
                batches = await self._nixl.notifications(wait)
            except NixlCallError as exc:
                logger.error("engine %s: %s", self._engine_id, exc)
                batches = {}
            for consumer, messages in batches.items():
                for message in messages:
                    self._count_notification(consumer, message)
            for exposure in self._exposures.expire(trio.current_time()):
                logger.warning(
                    "engine %s: request %r expired after %g s with %d of %d consumers read",
                    self._engine_id,
                    exposure.request_id,
                    config.abort_timeout,
                    len(exposure.readers),
                    exposure.consumers,
                )
                self._release_events.pop(exposure.request_id).set()

    def _count_notification(self, consumer: str, message: bytes) -> None:
        request_id = protocol.decode_notification(message)
        if request_id is None:
            self._counters.notifications_ignored += 1
            logger.warning(
                "engine %s: ignored a foreign notification from %s: %r",
                self._engine_id,
                consumer,
                message[:64],
            )
            return
        notice = self._exposures.notify(request_id, consumer)
        if notice is Notice.RELEASED:
            self._release_events.pop(request_id).set()
        elif notice is not Notice.COUNTED:
            self._counters.notifications_ignored += 1
            logger.warning(
                "engine %s: %s notification for request %r from %s (it may have expired)",
                self._engine_id,
                notice.value,
                request_id,
                consumer,
            )

    # ---- life cycle -----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"connector {self._engine_id!r} is closed")

    def _begin_close(self) -> None:
        """Refuse new calls and wake every waiter; in-flight transfers abort."""
        if self._closed:
            return
        self._closed = True
        self._nixl.begin_close()
        for event in self._release_events.values():
            event.set()
        for engine in self._engines.values():
            engine.record.apply(EngineEvent.CONNECTOR_CLOSED)
            engine.attempt.done.set()
        self._jobs_send.close()

    async def _release(self) -> None:
        """Wait (bounded) for in-flight pulls, then release NIXL and ZeroMQ resources.

        Called once, shielded, when the nursery has exited: no task of ours
        uses NIXL or ZeroMQ any more, only pulls in callers' tasks may.
        """
        try:
            with trio.move_on_after(self._config.close_timeout) as scope:
                await self._pulls_in_flight.wait_value(lambda n: n == 0)
            if scope.cancelled_caught:
                logger.error(
                    "connector %s: %d pulls still in flight after %g s; NIXL resources leaked",
                    self._engine_id,
                    self._pulls_in_flight.value,
                    self._config.close_timeout,
                )
            else:
                await trio.to_thread.run_sync(self._nixl.close)
        finally:
            self._zmq.destroy(linger=0)


class _Failure(Exception):
    """A failed handshake attempt and its cause, for the statistics."""

    def __init__(self, cause: str, error: HandshakeError) -> None:
        self.cause = cause
        self.error = error


def _copy(error: HandshakeError) -> HandshakeError:
    """A fresh exception equal to ``error`` (one object per raise keeps tracebacks apart)."""
    fresh = type(error)(error.engine_id, error.reason)
    fresh.__cause__ = error.__cause__
    return fresh


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@asynccontextmanager
async def open_connector(
    engine_id: str,
    kv_caches: Sequence[torch.Tensor],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    config: ConnectorConfig | None = None,
) -> AsyncIterator[Connector]:
    """Open a connector for one engine and run its tasks for the block's duration.

    Registers ``kv_caches`` with a new NIXL agent, binds the side channel on
    ``host:port`` (``port=0`` picks a free port; see :attr:`Connector.address`)
    and starts the listener, the handshake task and the notification task in an
    internal nursery. Returns once the listener is bound, so
    :meth:`Connector.expose` hands out a working address at once.

    Args:
        engine_id: this engine's id, unique among the engines that talk to each other.
        kv_caches: one tensor per region (e.g. per layer, K and V separately);
            dimension 0 indexes blocks; all the same number of blocks, dtype and
            device; contiguous. They stay registered until the block exits.
        host, port: side-channel bind address, also advertised in
            :class:`RemoteBlocks`.
        config: deadlines, limits and NIXL options.

    Resource handling:
        On every exit -- normal, an exception in the block, or cancellation from
        outside -- the block's end stops the tasks, wakes every waiter with
        :class:`trio.ClosedResourceError`, stops in-flight pulls after their
        current NIXL transfer (waiting at most ``config.close_timeout`` for
        pulls in other tasks to let go),
        then releases transfer handles, remote agents, descriptor lists, the
        memory registration, the NIXL agent and the ZeroMQ sockets and context.

    Error handling:
        An exception in the block propagates as itself. A failure of the
        connector's own tasks (a bug, or the bind failing) propagates as
        itself, not wrapped in an :class:`ExceptionGroup`; only when several
        unrelated exceptions happen at once is the group raised.

    Raises:
        ValueError: invalid ``engine_id`` or ``kv_caches``.
        OSError: the side channel cannot bind ``host:port``.
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")
    config = ConnectorConfig() if config is None else config
    layout = layout_of_tensors(kv_caches)
    incarnation = secrets.token_hex(8)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        nixl = await NixlEngine.create(f"{engine_id}#{incarnation}", kv_caches, layout, config)
    except BaseException:
        context.destroy(linger=0)
        raise
    connector = Connector(engine_id, layout, nixl, context, config, incarnation)
    try:
        # The reply is the same for every consumer: encode it once, before
        # the listener can receive a request.
        connector._encoded_reply = protocol.encode_message(
            protocol.metadata_reply(
                protocol.EngineMetadata(
                    engine_id=engine_id,
                    incarnation=incarnation,
                    agent_name=nixl.agent_name,
                    agent_metadata=nixl.agent_metadata(),
                    num_blocks=layout.num_blocks,
                    base_addrs=list(layout.base_addrs),
                    block_lens=list(layout.block_lens),
                    device_id=layout.device_id,
                    mem_type=layout.mem_type,
                    dtype=layout.dtype,
                ),
                connector._compat_hash,
            )
        )
        async with unwrapped_errors(), trio.open_nursery() as nursery:
            connector._nursery = nursery
            if config.auth is not None:
                await nursery.start(
                    serve_zap, context, config.auth.allowed_consumers, connector._auth_refused
                )
            connector._address = await nursery.start(connector._serve_listener, host, port)
            nursery.start_soon(connector._run_handshakes)
            nursery.start_soon(connector._collect_notifications)
            logger.info(
                "engine %s: connector open on %s:%d (%d regions x %d blocks)",
                engine_id,
                *connector._address,
                layout.num_regions,
                layout.num_blocks,
            )
            try:
                yield connector
            finally:
                connector._begin_close()
                nursery.cancel_scope.cancel()
    finally:
        connector._begin_close()
        # close_timeout bounds the wait for pulls; NIXL's own releases take ms.
        with trio.move_on_after(2 * config.close_timeout, shield=True):
            await connector._release()
