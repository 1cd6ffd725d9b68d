"""The connector: one engine's end of P/D KV transfer, and how it runs.

:func:`open_connector` creates the side channel's transport (ZeroMQ, unless
a test passes another: ``_side_channel._seam``) and the transfer backend,
then opens one nursery
for everything the connector runs, and runs the caller's ``async with`` body
inside it as well::

    open_connector nursery
    |-- ZAP handler          with CURVE auth only: admits allowed consumers
    |-- listener             producer: ROUTER socket, answers metadata requests
    |-- notification task    producer: counts notifications, expires exposures
    |-- handshake task       consumer: loads remote agents, one at a time
    |-- fetch workers        consumer: at most max_concurrent_fetches, while attempts wait
    |-- watchdog             consumer: fails handshake attempts at their deadlines
    |-- heartbeat task       consumer: renews the leases of held requests
    `-- the async with body  your code: pull / hold / expose / wait_released

It builds the two roles (``_producer.Producer``, ``_consumer.Consumer``
whose remote engines are ``_handshakes.Handshakes``, and the consumer's
holds, ``_leases.Leases``) with everything passed to constructors, and
yields :class:`Connector`, the facade over them. The facade owns no task and
no resource itself; its docstrings are the public contract of each call
(what it waits for, what it raises, what cancelling it does). On exit,
``_release`` frees the backend and the side channel once no pull uses them. This
module also owns the checks of the addresses it binds and advertises
(:data:`WILDCARD_HOSTS`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._consumer._leases import Leases
from trio_pd._consumer._pulls import Consumer
from trio_pd._core._exposures import Released
from trio_pd._core._layout import KVLayout, layout_of_tensors
from trio_pd._core._public_values import ConnectorStatistics, PullResult, RemoteBlocks, unbracket
from trio_pd._core._remote_engine import EngineState
from trio_pd._core._tensor_parallel import check_tp
from trio_pd._exception_groups import unwrapped_errors
from trio_pd._producer._producer import Producer
from trio_pd._side_channel._seam import SideChannel, SideChannelFactory
from trio_pd._side_channel._zmq_channel import ZmqSideChannel
from trio_pd._transfer._backend import BackendFactory, TransferBackend
from trio_pd._transfer._nixl._backend import NixlBackend
from trio_pd._transfer._nixl._interfaces import wait_for_interface

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "*"})
"""Bind addresses that mean "every interface": never an address to connect to."""

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("trio_pd")


def bind_and_advertised_hosts(host: str, advertise_host: str | None) -> tuple[str, str]:
    """The host to bind and the host to advertise, brackets of IPv6 addresses removed.

    Raises:
        ValueError: ``host`` is a wildcard and ``advertise_host`` is not given
            (or is a wildcard itself).
    """
    bind = unbracket(host)
    advertised = bind if advertise_host is None else unbracket(advertise_host)
    if advertised in WILDCARD_HOSTS:
        raise ValueError(
            f"the side channel binds {host!r}, which consumers cannot connect to: pass "
            "advertise_host=<this engine's address on the consumers' network>"
        )
    return ("0.0.0.0" if bind in ("", "*") else bind), advertised


@asynccontextmanager
async def open_connector(
    engine_id: str,
    kv_caches: Sequence[torch.Tensor],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    config: ConnectorConfig | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    advertise_host: str | None = None,
    backend: BackendFactory | None = None,
    side_channel: SideChannelFactory | None = None,
) -> AsyncIterator[Connector]:
    """Open a connector for one engine and run its tasks for the block's duration.

    Registers ``kv_caches`` with a new transfer backend (a NIXL agent), binds
    the side channel on ``host:port`` (``port=0`` picks a free port; see
    :attr:`Connector.address`) and starts the listener, the handshake task,
    the heartbeat task and the notification task in an internal nursery. Returns once the
    listener is bound, so :meth:`Connector.expose` hands out a working
    address at once.

    The ``async with`` body runs inside that nursery: if a task of the
    connector fails (a bug), the body is cancelled and the error propagates.

    Args:
        engine_id: this engine's id, unique among the engines that talk to each other.
        kv_caches: one tensor per region (e.g. per layer, K and V separately);
            dimension 0 indexes blocks; all the same number of blocks, dtype and
            device; contiguous; no two may overlap, but the same tensor may
            appear more than once (shared layers). They stay registered until
            the block exits.
        host, port: the side channel's bind address. ``port`` is the engine's
            *base* port: rank ``tp_rank`` binds ``port + tp_rank`` (vLLM's
            convention). IPv6 addresses work (``"::1"``; brackets optional).
        advertise_host: the host that :class:`RemoteBlocks` tell consumers
            to connect to (default: ``host``). Needed when ``host`` is a
            wildcard (``"0.0.0.0"``, ``"::"``, ``""``, ``"*"``), which no
            consumer can connect to; give this engine's address on the
            network its consumers share.
        config: deadlines, limits and NIXL options.
        tp_rank, tp_size: this connector is rank ``tp_rank`` of an engine with
            tensor-parallel size ``tp_size``; all ranks share ``engine_id``,
            each holds ``1/tp_size`` of the KV heads (``kv_caches`` tensors are
            ``(num_blocks, num_kv_heads_on_this_rank, ...)``). A decode rank
            pulls from the prefill ranks that hold its heads, whatever their
            TP size (see :meth:`Connector.pull`).
        backend: creates the transfer backend. Default
            :meth:`NixlBackend.create` (NIXL with UCX); tests pass
            :meth:`trio_pd.testing.MemoryFabric.backend` to run the same
            connector logic on an in-memory data plane with injected faults.
        side_channel: a testing seam: creates the side channel's transport.
            Default ZeroMQ (with CURVE when ``config.auth`` is set); tests
            pass :meth:`trio_pd.testing.MemoryFabric.side_channel` to run
            the same connector logic with an in-memory control plane too,
            on trio's clock alone (``autojump_clock``).

    Resource handling:
        On every exit -- normal, an exception in the block, or cancellation from
        outside -- the block's end stops the tasks, wakes every waiter with
        :class:`trio.ClosedResourceError`, stops in-flight pulls after their
        current transfer (waiting at most ``config.close_timeout`` for pulls
        in other tasks to let go), waits for what is in flight -- a
        remote-agent load in NIXL, the abandons of holds left without a
        pull, queued or sent -- at most ``config.close_timeout`` after the
        close began, then releases transfer handles, remote agents,
        descriptor lists, the memory registration, the agent and the ZeroMQ
        sockets and context. Two exceptions: if a pull's transfer is still
        running after ``close_timeout``, or a remote-agent load is still in
        NIXL then, the backend is *not* released (freeing memory under a
        running transfer would let it write into freed memory; a release
        would queue behind the stuck load); that is logged as an error,
        with the reason. An abandon not answered by then is given up
        (logged; its lease expires on its own).

    Error handling:
        An exception in the block propagates as itself. A failure of the
        connector's own tasks (a bug, or the bind failing) propagates as
        itself, not wrapped in an :class:`ExceptionGroup`; only when several
        unrelated exceptions happen at once is the group raised.

    Raises:
        ValueError: invalid ``engine_id`` or ``kv_caches``; ``tp_rank`` not in
            ``range(tp_size)``; ``port=0`` with ``tp_size > 1`` (the ranks'
            ports must follow from one base port); a wildcard ``host`` without
            ``advertise_host``.
        BackendError: the backend could not be created (e.g. an unknown name
            in ``config.nixl_backends``) or could not register ``kv_caches``.
        OSError: the side channel cannot bind ``host:port``; or the network
            interface that holds ``advertise_host`` stayed down for
            ``config.interface_timeout`` (NIXL advertises only the interfaces
            up when the agent is created, so the connector waits for it).
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")
    check_tp(tp_rank, tp_size)
    host, advertised = bind_and_advertised_hosts(host, advertise_host)
    if tp_size > 1 and port == 0:
        raise ValueError(
            f"tp_size {tp_size} needs an explicit base port: rank r listens on port + r"
        )
    config = ConnectorConfig() if config is None else config
    layout = layout_of_tensors(kv_caches)
    incarnation = secrets.token_hex(8)
    agent_name = f"{engine_id}#{incarnation}"
    create = NixlBackend.create if backend is None else backend
    await wait_for_interface(engine_id, advertised, config)
    channel = (ZmqSideChannel.create if side_channel is None else side_channel)(agent_name, config)
    try:
        transfers: TransferBackend = await create(agent_name, kv_caches, layout, config)
    except BaseException:
        channel.close()
        raise
    consumer: Consumer | None = None
    leases: Leases | None = None
    try:
        async with unwrapped_errors(), trio.open_nursery() as nursery:
            producer = Producer(
                engine_id,
                tp_rank,
                tp_size,
                incarnation,
                advertised,
                layout,
                transfers,
                channel,
                config,
            )
            consumer = Consumer(
                engine_id, tp_rank, tp_size, layout, transfers, channel, config, nursery
            )
            leases = Leases(
                engine_id,
                transfers.agent_name,
                tp_rank,
                tp_size,
                channel,
                config,
                consumer.settled_reads,
            )
            connector = Connector(engine_id, layout, producer, consumer, leases)
            try:
                if config.auth is not None:
                    await nursery.start(channel.serve_auth, producer)
                rank_port = port + tp_rank if port else 0
                address = await nursery.start(producer.serve_listener, host, rank_port)
                nursery.start_soon(consumer.run_handshakes)
                nursery.start_soon(leases.run)
                nursery.start_soon(producer.collect_notifications)
                logger.info(
                    "engine %s rank %d/%d: connector open on %s:%d (%d regions x %d blocks)",
                    engine_id,
                    tp_rank,
                    tp_size,
                    *address,
                    layout.num_regions,
                    layout.num_blocks,
                )
                yield connector
            finally:
                connector._begin_close()
                nursery.cancel_scope.cancel()
    finally:
        transfers.begin_close()  # (again: the nursery may have failed to start)
        # close_timeout bounds the wait for pulls; the backend's releases take ms.
        with trio.move_on_after(2 * config.close_timeout, shield=True):
            await _release(engine_id, transfers, consumer, leases, channel, config)


async def _release(
    engine_id: str,
    transfers: TransferBackend,
    consumer: Consumer | None,
    leases: Leases | None,
    channel: SideChannel,
    config: ConnectorConfig,
) -> None:
    """Wait (bounded) for pulls in other tasks, then release the backend and the side channel.

    Called once, shielded, when the nursery has exited: no task of ours
    uses the backend or the side channel any more (the abandon task sent what was
    queued before it ended), only pulls and abandons in callers' tasks may
    (abandons end by ``close_timeout`` after ``begin_close``), and a
    remote-agent load abandoned in NIXL (``transfers.aclose`` waits for it).
    """
    try:
        if consumer is not None:
            with trio.move_on_after(config.close_timeout) as scope:
                await consumer.wait_pulls_done()
            if scope.cancelled_caught:
                logger.error(
                    "connector %s: %d pulls still in flight after %g s; "
                    "transfer backend resources leaked",
                    engine_id,
                    consumer.pulls_in_flight,
                    config.close_timeout,
                )
                return
        await transfers.aclose()
    finally:
        if leases is not None:
            with trio.move_on_after(config.close_timeout, shield=True):
                await leases.wait_idle()
        channel.close()


class Connector:
    """One engine's end of P/D KV transfer: producer, consumer, or both.

    Create it with :func:`open_connector`, which owns its tasks and resources.
    A prefill engine calls :meth:`expose` and :meth:`wait_released`; a decode
    engine calls :meth:`pull`, inside :meth:`hold` while the request may
    wait before it pulls. All methods are safe to call from many tasks.

    After the connector closes, :meth:`expose`, :meth:`wait_released`,
    :meth:`pull`, :meth:`hold` and :meth:`abandon` raise
    :class:`trio.ClosedResourceError`; :meth:`statistics`,
    :meth:`engine_state` and the properties keep answering (the final
    counters; every engine reads ``CLOSED``), as trio's own objects do.
    """

    def __init__(
        self,
        engine_id: str,
        layout: KVLayout,
        producer: Producer,
        consumer: Consumer,
        leases: Leases,
    ) -> None:
        self._engine_id = engine_id
        self._layout = layout
        self._producer = producer
        self._consumer = consumer
        self._leases = leases

    @property
    def engine_id(self) -> str:
        """This engine's id."""
        return self._engine_id

    @property
    def address(self) -> tuple[str, int]:
        """The side channel's ``(host, port)`` as bound (the real port if 0 was asked).

        :meth:`expose` advertises ``advertise_host`` (default: this host) and
        the engine's base port instead.
        """
        return self._producer.address

    @property
    def layout(self) -> KVLayout:
        """The local KV cache's layout."""
        return self._layout

    def expose(self, request_id: str, block_ids: Sequence[int], consumers: int = 1) -> RemoteBlocks:
        """Hold ``block_ids`` for ``consumers`` decode engines to read (producer side).

        The blocks must already hold the request's KV data and must not be
        reused until :meth:`wait_released` says so. The returned record goes to
        the decoder (via :meth:`RemoteBlocks.to_kv_transfer_params` through a
        P/D proxy).

        The exposure is held under a *lease* of ``config.lease_initial``
        seconds; each heartbeat of a consumer that holds it (:meth:`hold`)
        extends it to ``config.lease_renewal`` seconds from the heartbeat's
        arrival, never beyond ``config.abort_timeout`` after this call. It
        resolves :attr:`Released.READ` when ``consumers`` distinct decode
        engines have read and notified; :attr:`Released.ABANDONED` once
        every consumer engine has read or abandoned it (:meth:`abandon`, or
        a hold left without a pull) and at least one abandoned; or
        :attr:`Released.EXPIRED` when its lease runs out first.

        Raises:
            ValueError: ``request_id`` is already pending; block ids out of
                range, repeated or not ints; ``consumers < 1``.
            trio.ClosedResourceError: the connector is closed.
        """
        return self._producer.expose(request_id, block_ids, consumers)

    async def wait_released(self, request_id: str) -> Released:
        """Wait until the exposure of ``request_id`` resolves; return how.

        :attr:`Released.READ`, :attr:`Released.ABANDONED` (a consumer said
        it will not read: the blocks are free at once) or
        :attr:`Released.EXPIRED` (the lease ran out); see :meth:`expose`.
        Returns at once if it already resolved (outcomes are remembered for
        the last 4096 exposures resolved).

        Raises:
            KeyError: ``request_id`` was never exposed (or long forgotten).
            trio.ClosedResourceError: the connector closed first.
        """
        return await self._producer.wait_released(request_id)

    async def pull(
        self, request_id: str, local_block_ids: Sequence[int], remote: RemoteBlocks
    ) -> PullResult:
        """Copy ``remote``'s blocks into ``local_block_ids`` (consumer side).

        The k-th remote block lands in the k-th local block, in every region.
        The first pull for an engine starts its handshake; concurrent pulls for
        that engine share it; pulls for ready engines never wait for another
        engine's handshake. When this returns, the data is in place and the
        notification to the producer has been posted.

        Tensor parallelism: this connector is decode rank ``d`` of ``Td``; the
        remote engine has ``remote.tp_size`` ranks (``Tp``). With ``Td == Tp``
        it reads remote rank ``d``; with ``Td > Tp`` its head slice of remote
        rank ``d // (Td // Tp)``; with ``Tp > Td`` remote ranks ``d*k`` to
        ``d*k + k - 1`` (``k = Tp // Td``), each into its head slice of the
        local blocks. Every rank read is handshaked (concurrently), every
        part's block ids are checked, then the parts transfer concurrently;
        this returns when all have landed.

        An empty ``local_block_ids`` only posts the notification (a full
        prefix-cache hit). That is fire and forget: NIXL reports no delivery,
        so if the producer died just before, the notification is lost and
        the producer's exposure (if it still exists) expires.

        ``remote`` comes from the network and is checked before it is
        trusted; a wrong claim fails this pull only:

        * with ``config.exposure_secret``, its ``token`` must be the one the
          producer issued for exactly these parameters
          (:class:`ParamsRejectedError` before anything is sent);
        * an address or TP size that is not the engine's gets a handshake of
          its own, which fails for this request alone;
        * an incarnation other than the loaded one makes the connector ask
          the engine which one it runs (at most one such verification per
          engine per ``backoff_initial``; pulls of the loaded incarnation go
          on meanwhile). Only if the engine answers with a new incarnation
          is the old agent retired and the new one loaded; otherwise the
          request fails (:class:`TransferError`: those blocks are not
          readable). Blocks exposed by an incarnation that is no longer
          running are never read. After a lost connection, the next pull
          handshakes again and reads only if the same incarnation answers.

        Transfers: the read goes to the connector's transfer driver, which
        may post it together with other small pulls to the same engine (one
        READ, one notification naming each) and posts a large one in chunks.

        Cancellation: if the calling task is cancelled, no further chunk of
        this pull is posted and the running ones are waited for until they
        end (at most ``config.close_timeout``) before :class:`trio.Cancelled`
        propagates, so nothing writes into the local blocks afterwards. The
        handshake itself goes on for other waiters. The exception: a
        transfer that does not stop within ``close_timeout`` (its peer
        unreachable: NIXL cannot cancel it). Its local blocks are then in
        :meth:`unsettled_blocks` until that transfer really ended, whichever
        way the pull ends (an error, cancellation, a sibling part's failure,
        close); a :class:`TransferError` also carries a ``settled`` event.
        Before reusing the blocks of a pull that did not return, ``await
        connector.wait_settled(local_block_ids)`` (at once in the normal
        case).

        Raises:
            ValueError: before anything is sent: local and remote lengths
                differ; a local block id is out of range, repeated or not an int.
            ParamsRejectedError: (a ``ValueError``) before anything of this
                request is read: ``remote.token`` does not verify, or a
                remote block id is out of the producer's range or repeated
                (checked once the handshake is done).
            HandshakeError: the handshake failed (the same error for every
                pull that waited on it; a handshake, queued time and load
                included, fails within ``config.handshake_timeout`` of its
                start), or the engine is in backoff after a failed handshake
                (the same error again, at once);
                :class:`IncompatibleEngineError` if the engines cannot be
                paired (for TP sizes that do not divide, before any traffic).
            TransferError: the backend reported an error, the transfer did
                not finish within ``config.transfer_timeout`` of being handed
                to the transfer driver,
                or the blocks belong to an incarnation of the engine that is
                gone; it names the local block ids that hold undefined data
                (all of the pull's), and the remote rank when the remote
                engine has several.
            trio.ClosedResourceError: the connector is (or got) closed.
        """
        # (a replay of parameters whose exposure is over, say: failed and counted there)
        lost = self._leases.lost(remote)
        result = await self._consumer.pull(request_id, local_block_ids, remote, lost=lost)
        self._leases.pulled(remote)
        return result

    @asynccontextmanager
    async def hold(self, remote: RemoteBlocks) -> AsyncIterator[None]:
        """Keep ``remote``'s exposure alive while the body runs (consumer side).

        Use it around everything from receiving ``remote`` to the
        :meth:`pull` of it -- a decode request waiting in a queue, say::

            async with connector.hold(remote):
                await wait_for_my_turn()
                await connector.pull(request_id, local_block_ids, remote)

        While the body runs, the connector's heartbeat task renews the
        exposure's lease every ``config.heartbeat_interval`` on each
        producer rank this rank reads, up to the producer's
        ``abort_timeout``. Heartbeats are batched: one message per producer
        rank per interval names every request held there. A producer that
        does not answer delays no other (each message has its own deadline
        of one interval); one that answers that it does not hold the request
        (it expired, or its token was refused) ends the renewals of that
        hold, with a warning: a pull may still try, and fail if the blocks
        are gone.

        How it ends: a successful pull of ``remote`` inside the body
        completes the hold (the pull's notification releases the exposure).
        Leaving the body without one -- it raised, was cancelled, or never
        pulled -- *abandons* it: the producer ranks are told, best effort,
        so they free the blocks at once (:attr:`Released.ABANDONED`) rather
        than when the lease runs out. That includes a pull inside the body
        that was cancelled or failed after its READ began: the abandon names
        that READ (it stopped), so its pin on the producer's blocks ends
        too -- except a READ that could not be stopped (its peer
        unreachable), whose pin lasts until it ends or for
        ``lease_renewal``: the producer must not reuse blocks a READ may
        still read. The exit does not wait for that: the
        connector's lease task sends it (each message bounded by
        ``config.handshake_timeout``), so a request whose producer is gone
        fails at once. The exit raises nothing but the body's own
        exception; a failed abandon is logged and counted
        (``abandons_failed``). Closing the connector sends those still
        queued or in flight, concurrently, for at most
        ``config.close_timeout`` (see :func:`open_connector`).

        A pull inside a hold that the producer has answered it does not
        hold (expired, read, abandoned: the parameters are stale or
        replayed) fails with :class:`TransferError` without reading.

        Raises:
            ParamsRejectedError: with ``config.exposure_secret``, ``remote``
                is not what the producer signed (nothing is sent to it).
            ValueError: ``remote`` is already held by this connector.
            IncompatibleEngineError: the TP sizes do not divide.
            trio.ClosedResourceError: the connector is closed (on entry;
                holds that end after close send nothing).
        """
        self._consumer.check_token(remote.request_id, remote)
        async with self._leases.hold(remote):
            yield

    async def abandon(self, remote: RemoteBlocks) -> None:
        """Tell the producer that this consumer will not read ``remote`` (consumer side).

        Sends one abandon per producer rank this rank reads, concurrently,
        each bounded by ``config.handshake_timeout``; the producer counts it
        as this engine's read would count (so with ``consumers=1`` the
        exposure resolves :attr:`Released.ABANDONED` at once). It names this
        connector's READs of ``remote`` that stopped without reading (pulls
        cancelled or failed), so that their pins end; a READ still running,
        or one that could not be stopped, keeps the exposure pending until
        it ends or its pin runs out (``lease_renewal``). If ``remote``
        is held, its renewals stop and leaving the hold sends nothing more.
        A producer that cannot be reached is logged (naming engine and
        request) and counted in ``abandons_failed``, not raised: the lease
        then expires on its own. With ``exposure_secret`` the producer
        applies it only if ``remote.token`` is the one it issued.

        Raises:
            ParamsRejectedError: with ``config.exposure_secret``, ``remote``
                is not what the producer signed (nothing is sent to it).
            IncompatibleEngineError: the TP sizes do not divide.
            trio.ClosedResourceError: the connector is closed.
        """
        self._consumer.check_token(remote.request_id, remote)
        await self._leases.abandon(remote)

    def unsettled_blocks(self) -> frozenset[int]:
        """Local block ids that a transfer whose pull already ended may still write.

        Empty almost always. A block is here while a transfer NIXL could not
        stop (its peer became unreachable mid-transfer) still runs, however
        its pull ended: it returned an error, was cancelled (the client hung
        up), failed because a sibling part (tensor parallelism) failed, or
        the connector closed. Keep these blocks out of reuse; see
        :meth:`wait_settled`. Keeps answering after close (the last state).
        """
        return self._consumer.unsettled_blocks()

    async def wait_settled(self, block_ids: Sequence[int]) -> None:
        """Return once none of ``block_ids`` can be written by a transfer any more.

        Returns at once (after a checkpoint) when none is in
        :meth:`unsettled_blocks` -- the normal case after any pull, however
        it ended. Call it before giving a failed or cancelled pull's blocks
        back to a pool. It may wait as long as a partition lasts: bound it
        with a cancel scope if you must, and then keep the blocks out of
        reuse. Works after close too (a transfer still running then keeps
        its memory registered for the life of the process and never settles).
        """
        await self._consumer.wait_settled(block_ids)

    def statistics(self) -> ConnectorStatistics:
        """A snapshot of this connector's counters (both roles; see its ``consumer``
        and ``producer`` properties for one role alone)."""
        leases = self._leases
        consumer = attrs.evolve(
            self._consumer.statistics(),
            holds_active=leases.holds_active,
            **attrs.asdict(leases.counters),
        )
        return ConnectorStatistics.of_roles(consumer, self._producer.statistics())

    def engine_state(self, engine_id: str, tp_rank: int | None = None) -> EngineState:
        """Where the handshake with ``engine_id`` stands (``UNKNOWN`` if never seen).

        For a tensor-parallel engine each rank has its own handshake: pass
        ``tp_rank``; by default, the lowest rank this connector reads from.
        """
        return self._consumer.engine_state(engine_id, tp_rank)

    def _begin_close(self) -> None:
        """Refuse new calls and wake every waiter; in-flight transfers stop."""
        self._producer.begin_close()
        self._consumer.begin_close()
        self._leases.begin_close()
