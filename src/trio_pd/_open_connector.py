"""The connector: how ``open_connector`` sets an engine's connector up, runs it, tears it down.

:func:`open_connector` creates the transfer backend, then opens one nursery
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

It builds the two roles (``_producer.Producer``, ``_consumer.Consumer`` and
its holds, ``_leases.Leases``) with everything passed to constructors, and
yields the facade over them, ``_connector.Connector``. On exit, ``_release``
frees the backend and ZeroMQ once no pull uses them. This module also owns
the checks of the addresses it binds and advertises (:data:`WILDCARD_HOSTS`).
"""

from __future__ import annotations

import logging
import resource
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio
import zmq

from trio_pd._config import ConnectorConfig
from trio_pd._connector import Connector
from trio_pd._consumer._consumer import Consumer
from trio_pd._consumer._leases import Leases
from trio_pd._core._layout import layout_of_tensors
from trio_pd._core._records import unbracket
from trio_pd._core._tp import check_tp
from trio_pd._groups import unwrapped_errors
from trio_pd._producer._producer import Producer
from trio_pd._side_channel._auth import serve_zap
from trio_pd._transfer._backend import BackendFactory, TransferBackend
from trio_pd._transfer._interfaces import wait_for_interface
from trio_pd._transfer._nixl import NixlBackend

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "*"})
"""Bind addresses that mean "every interface": never an address to connect to."""

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("trio_pd")


def max_sockets() -> int:
    """ZeroMQ sockets a connector's context may hold: the soft limit on open
    files (every socket needs one), between 1024 and 65536."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return min(max(soft, 1024), 65536)


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
    create = NixlBackend.create if backend is None else backend
    await wait_for_interface(engine_id, advertised, config)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    # ZeroMQ's own cap (1023 sockets) is below what a decoder of many engines
    # uses (a confirmation socket per producer rank pulled from at once): the
    # process's file limit, which bounds them anyway, is the cap instead.
    context.set(zmq.MAX_SOCKETS, max_sockets())
    try:
        transfers: TransferBackend = await create(
            f"{engine_id}#{incarnation}", kv_caches, layout, config
        )
    except BaseException:
        context.destroy(linger=0)
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
                context,
                config,
            )
            consumer = Consumer(
                engine_id, tp_rank, tp_size, layout, transfers, context, config, nursery
            )
            leases = Leases(engine_id, transfers.agent_name, tp_rank, tp_size, context, config)
            connector = Connector(engine_id, layout, producer, consumer, leases)
            try:
                if config.auth is not None:
                    allowed = config.auth.allowed_consumers
                    await nursery.start(serve_zap, context, allowed, producer.auth_refused)
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
            await _release(engine_id, transfers, consumer, leases, context, config)


async def _release(
    engine_id: str,
    transfers: TransferBackend,
    consumer: Consumer | None,
    leases: Leases | None,
    context: zmq.Context[zmq.Socket[bytes]],
    config: ConnectorConfig,
) -> None:
    """Wait (bounded) for pulls in other tasks, then release the backend and ZeroMQ.

    Called once, shielded, when the nursery has exited: no task of ours
    uses the backend or ZeroMQ any more (the abandon task sent what was
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
        context.destroy(linger=0)
