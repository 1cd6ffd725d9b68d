"""The producer role (prefill side): exposures, leases, the side-channel listener, notifications.

The bookkeeping of exposures and their leases is in ``_exposures`` and the
listener's decision for one request in ``_listener_rules`` (both free of I/O); this
module is the trio shell around them. Its tasks run in the connector's nursery:

* the *listener* (:meth:`Producer.serve_listener`): the side channel's
  ``serve`` (``_side_channel._seam``; ZeroMQ: a ROUTER socket), which hands
  every request to :meth:`Producer.answer`: the metadata, and lease
  requests (consumers' heartbeats and abandons) that renew or abandon
  exposures, and confirmations that pin them;
* the *notification task* (:meth:`Producer.collect_notifications`): counts
  consumers' notifications, resolves exposures, expires overdue ones;
* with CURVE auth, the side channel's ``serve_auth`` (ZeroMQ: the ZAP
  handler), started by :func:`~trio_pd.open_connector` before the listener
  binds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._core import _listener_rules as listener
from trio_pd._core import _protocol as protocol
from trio_pd._core._exposures import Confirmation, ExposureTable, Notice, Released, lease_window
from trio_pd._core._layout import KVLayout, as_block_ids
from trio_pd._core._public_values import ProducerStatistics, RemoteBlocks
from trio_pd._core._tokens import exposure_token, token_matches
from trio_pd._side_channel._seam import SideChannel
from trio_pd._transfer._backend import BackendError, TransferBackend

logger = logging.getLogger("trio_pd")


@attrs.define
class _Counters:
    notifications_ignored: int = 0
    listener_requests: int = 0
    listener_rejects: int = 0
    listener_auth_failures: int = 0
    leases_refused: int = 0
    confirmations: int = 0
    confirmations_denied: int = 0


class Producer:
    """The prefill side of a connector: holds exposed blocks until they are read.

    Owns the exposure table, the release events of pending exposures, and
    (while :meth:`serve_listener` runs) the side channel's listener. The metadata reply
    is encoded once, here, before the listener can receive a request.

    Args:
        engine_id: this engine's id.
        tp_rank, tp_size: this rank of the engine, and how many it has.
        incarnation: this connector's incarnation (random per start).
        advertise_host: the host exposures name (consumers connect to it).
        layout: the local KV layout (described in the reply).
        backend: the transfer backend (its agent's metadata, notifications).
        side_channel: where the listener serves.
        config: deadlines and limits.
    """

    def __init__(
        self,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        incarnation: str,
        advertise_host: str,
        layout: KVLayout,
        backend: TransferBackend,
        side_channel: SideChannel,
        config: ConnectorConfig,
    ) -> None:
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._incarnation = incarnation
        self._advertise_host = advertise_host
        self._layout = layout
        self._backend = backend
        self._side_channel = side_channel
        self._config = config
        self._address: tuple[str, int] | None = None
        self._closed = False
        self._exposures = ExposureTable(history=config._tuning.resolved_history)
        self._release_events: dict[str, trio.Event] = {}
        self._exposure_added = trio.Event()
        self._counters = _Counters()
        metadata = protocol.EngineMetadata(
            engine_id=engine_id,
            incarnation=incarnation,
            agent_name=backend.agent_name,
            agent_metadata=backend.agent_metadata(),
            num_blocks=layout.num_blocks,
            base_addrs=list(layout.base_addrs),
            block_lens=list(layout.block_lens),
            device_id=layout.device_id,
            mem_type=layout.mem_type,
            dtype=layout.dtype,
            kv_heads=layout.kv_heads,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        compat_hash = protocol.compatibility_hash(config.compatibility_key)
        self._encoded_reply = protocol.encode_message(
            protocol.metadata_reply(metadata, compat_hash)
        )

    @property
    def address(self) -> tuple[str, int]:
        assert self._address is not None, "listener not started"
        return self._address

    # ---- public (through the Connector facade) ---------------------------

    def expose(self, request_id: str, block_ids: Sequence[int], consumers: int = 1) -> RemoteBlocks:
        """See :meth:`trio_pd.Connector.expose`."""
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        ids = as_block_ids(
            block_ids, self._layout.num_blocks, f"block ids of request {request_id!r}"
        )
        config = self._config
        block_list = ids.tolist()
        generation = self._exposures.generation(request_id)
        token = self._token(request_id, block_list, self._incarnation, generation)
        deadline, limit = lease_window(
            trio.current_time(), config.lease_initial, config.abort_timeout
        )
        self._exposures.expose(
            request_id, ids, consumers, deadline, limit=limit, token=token, generation=generation
        )
        self._release_events[request_id] = trio.Event()
        self._exposure_added.set()
        self._backend.expect_reads()
        return RemoteBlocks(
            self._engine_id,
            self._advertise_host,
            self._base_port,
            block_list,
            request_id,
            self._incarnation,
            self._tp_size,
            token,
            generation,
        )

    @property
    def _base_port(self) -> int:
        """The engine's base port, whichever rank this is."""
        return self.address[1] - self._tp_rank

    def _token(
        self, request_id: str, block_ids: list[int], incarnation: str, generation: int
    ) -> str:
        """The exposure token of these blocks (empty without a secret)."""
        secret = self._config.exposure_secret
        if secret is None:
            return ""
        return exposure_token(
            secret,
            engine_id=self._engine_id,
            host=self._advertise_host,
            port=self._base_port,
            incarnation=incarnation,
            tp_size=self._tp_size,
            request_id=request_id,
            block_ids=block_ids,
            exposure=generation,
        )

    async def wait_released(self, request_id: str) -> Released:
        """See :meth:`trio_pd.Connector.wait_released`."""
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

    def statistics(self) -> ProducerStatistics:
        c = self._counters
        return ProducerStatistics(
            exposures_pending=self._exposures.pending,
            exposures_released=self._exposures.released,
            exposures_expired=self._exposures.expired,
            exposures_abandoned=self._exposures.abandoned,
            leases_renewed=self._exposures.renewed,
            leases_refused=c.leases_refused,
            notifications_ignored=c.notifications_ignored,
            listener_requests=c.listener_requests,
            listener_rejects=c.listener_rejects,
            listener_auth_failures=c.listener_auth_failures,
            confirmations=c.confirmations,
            confirmations_denied=c.confirmations_denied,
        )

    # ---- the listener ----------------------------------------------------

    async def serve_listener(  # noqa: ASYNC128 -- task_status is handed on
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind the side channel's listener, report the address, answer requests
        until cancelled (the transport's ``serve``, with this producer as its
        :class:`~trio_pd._side_channel._seam.Listener`).

        Every request gets a reply (see :meth:`answer`); messages without a
        request envelope are dropped and counted (:meth:`dropped`).

        Raises:
            OSError: ``host:port`` cannot be bound (before ``started``).
        """
        await self._side_channel.serve(host, port, self, task_status=task_status)

    def bound(self, address: tuple[str, int]) -> None:
        """The listener is bound (``Listener.bound``): expose() can name it."""
        self._address = address

    def answer(self, payload: bytes) -> bytes:
        """The reply to one request (``Listener.answer``): the metadata; for a
        lease request, the lease reply, once its entries are applied (see
        :meth:`_serve_leases`); for a confirmation, its answers; or an
        error reply saying why not (counted in ``listener_rejects``)."""
        request = listener.parse_request(
            payload, engine_id=self._engine_id, max_bytes=self._config.max_message_bytes
        )
        if isinstance(request, listener.Rejected):
            self._counters.listener_rejects += 1
            logger.debug("listener: rejected a request: %s", request.reason)
            return request.reply
        if isinstance(request, protocol.LeaseRequest):
            return self._serve_leases(request)
        if isinstance(request, protocol.ConfirmRequest):
            return self._serve_confirm(request)
        self._counters.listener_requests += 1
        return self._encoded_reply

    def dropped(self, why: str) -> None:
        """A message without a request envelope (``Listener.dropped``): counted."""
        self._counters.listener_rejects += 1
        logger.debug("listener: dropped %s", why)

    def _entry_is_ours(self, entry: protocol.LeaseEntry) -> bool:
        """Whether a lease entry is for this incarnation's exposure.

        Entries carry rank 0's incarnation (what consumers hold), so only
        rank 0 can tell; an entry without one is taken as ours. Without
        this, an abandon meant for the incarnation that ran on this port
        before a restart abandoned the new one's exposure of the same
        request id (found by the chaos suite).
        """
        return self._incarnation_is_ours(entry.incarnation)

    def _incarnation_is_ours(self, incarnation: str) -> bool:
        """See :meth:`_entry_is_ours` (an empty incarnation is taken as ours)."""
        return self._tp_rank != 0 or not incarnation or incarnation == self._incarnation

    def _serve_leases(self, request: protocol.LeaseRequest) -> bytes:
        """Renew or abandon what a lease request names; the reply to send.

        Without an exposure secret every pending entry is applied; with one,
        only those whose token verifies (the others are refused: counted in
        ``leases_refused``, logged at debug). An abandon also ends the pins
        of the READs it names as ended, the requesting agent's only
        (``ExposureTable.abandon``); names that end no pin are logged at info.
        """
        verify = None if self._config.exposure_secret is None else self._token_verifies
        reply, apply, refused = listener.serve_lease_request(
            request,
            pending=lambda request_id: self._exposures.pending_exposure(request_id) is not None,
            verify=verify,
            ours=self._entry_is_ours,
        )
        if refused:
            self._counters.leases_refused += len(refused)
            logger.debug(
                "engine %s: refused lease entries of %s (agent %s) whose token does not verify: %s",
                self._engine_id,
                request.consumer_engine_id,
                request.consumer_agent,
                refused,
            )
        now = trio.current_time()
        extension = self._config.lease_renewal
        for entry in apply:
            if not entry.abandon:
                self._exposures.renew(entry.request_id, now, extension)
                continue
            ended = self._exposures.pins_ended
            notice = self._exposures.abandon(
                entry.request_id, request.consumer_agent, entry.readers, entry.pins
            )
            ended = self._exposures.pins_ended - ended
            logger.debug(
                "engine %s: %s abandoned request %r (%s; %d of its READs ended)",
                self._engine_id,
                request.consumer_agent,
                entry.request_id,
                notice.value,
                ended,
            )
            if ended < len(entry.pins):
                logger.info(
                    "engine %s: %s (agent %s) abandoned request %r naming %d READs that hold "
                    "no pin of that agent (ended already, or not its own): ignored",
                    self._engine_id,
                    request.consumer_engine_id,
                    request.consumer_agent,
                    entry.request_id,
                    len(entry.pins) - ended,
                )
            if notice is Notice.RELEASED:
                self._release_events.pop(entry.request_id).set()
        return reply

    def _serve_confirm(self, request: protocol.ConfirmRequest) -> bytes:
        """Answer a consumer's confirmations (and pin the exposures for them).

        Each pin lasts ``lease_renewal`` (never past ``abort_timeout``): a
        READ that takes longer is confirmed again once it ended.
        """
        now = trio.current_time()
        hold_for = self._config.lease_renewal
        agent = request.consumer_agent
        secret = self._config.exposure_secret is not None

        def token_verifies(entry: protocol.ConfirmEntry) -> bool | None:
            if not secret or self._exposures.pending_exposure(entry.request_id) is None:
                return None
            lease = protocol.LeaseEntry(entry.request_id, entry.token, 1, False, entry.incarnation)
            return self._token_verifies(lease)

        def confirm(entry: protocol.ConfirmEntry) -> Confirmation:
            return self._exposures.confirm(
                entry.request_id,
                agent,
                entry.blocks_digest,
                now,
                hold_for,
                entry.nonce,
                entry.exposure,
            )

        reply, answers = listener.serve_confirm_request(
            request, ours=self._incarnation_is_ours, token_verifies=token_verifies, confirm=confirm
        )
        self._counters.confirmations += len(answers)
        for entry, answer in zip(request.entries, answers, strict=True):
            if answer.state not in ("held", "read"):
                self._counters.confirmations_denied += 1
                logger.info(
                    "engine %s: %s (agent %s) read request %r after its exposure ended: %s",
                    self._engine_id,
                    request.consumer_engine_id,
                    agent,
                    entry.request_id,
                    answer.state,
                )
        return reply

    def _token_verifies(self, entry: protocol.LeaseEntry) -> bool:
        """Whether ``entry`` carries the token issued for its (pending) exposure.

        Rank 0 (and an engine of one rank) compares with the token it issued.
        Another rank of a tensor-parallel engine never issued the token that
        consumers hold (rank 0's, signed with rank 0's incarnation): it checks
        the signature over its own exposure's fields with the incarnation
        the entry names.
        """
        exposure = self._exposures.pending_exposure(entry.request_id)
        assert exposure is not None
        if self._tp_rank == 0 or entry.incarnation == self._incarnation:
            return token_matches(exposure.token, entry.token)
        block_ids = exposure.block_ids.tolist()
        expected = self._token(entry.request_id, block_ids, entry.incarnation, exposure.generation)
        return token_matches(expected, entry.token)

    def auth_refused(self, reason: str) -> None:
        """The side channel's authentication refused a consumer (``Listener.auth_refused``)."""
        self._counters.listener_auth_failures += 1
        logger.warning("engine %s: side channel refused a consumer: %s", self._engine_id, reason)

    # ---- notifications and expiry ----------------------------------------

    async def collect_notifications(self) -> None:
        """Count consumer notifications and expire overdue exposures, until cancelled."""
        config = self._config
        while True:
            if self._exposures.pending:
                # The backend checks (adaptively, see NixlBackend.notifications;
                # with NIXL this also drives our UCX worker, which consumers'
                # READs need) and returns as soon as notifications arrive.
                wait = config.idle_notification_poll_interval
            else:
                self._exposure_added = trio.Event()
                with trio.move_on_after(config.idle_notification_poll_interval):
                    await self._exposure_added.wait()
                wait = 0.0
            try:
                batches = await self._backend.notifications(wait)
            except BackendError as exc:
                logger.error("engine %s: %s", self._engine_id, exc)
                batches = {}
                await trio.sleep(config.idle_notification_poll_interval)  # (no busy loop)
            for consumer, messages in batches.items():
                for message in messages:
                    self._count_notification(consumer, message)
            for exposure in self._exposures.expire(trio.current_time()):
                self._release_events.pop(exposure.request_id).set()
                if exposure.outcome is not Released.EXPIRED:
                    continue  # (resolved READ or ABANDONED once its last pin ended)
                capped = exposure.deadline >= exposure.limit
                logger.warning(
                    "engine %s: request %r expired after %g s (%s) with %.3g of %d consumers read",
                    self._engine_id,
                    exposure.request_id,
                    exposure.deadline - exposure.limit + config.abort_timeout,  # since exposed
                    "abort_timeout" if capped else "lease not renewed",
                    float(exposure.engines_read),
                    exposure.consumers,
                )

    def _count_notification(self, consumer: str, message: bytes) -> None:
        decoded = protocol.decode_notification(message)
        if decoded is None:
            self._counters.notifications_ignored += 1
            logger.warning(
                "engine %s: ignored a foreign notification from %s: %r",
                self._engine_id,
                consumer,
                message[:64],
            )
            return
        for request_id, readers, nonce in decoded:
            notice = self._exposures.notify(request_id, consumer, readers, nonce)
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

    # ---- life cycle ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"connector {self._engine_id!r} is closed")

    def begin_close(self) -> None:
        """Refuse new calls and wake every ``wait_released`` (ClosedResourceError)."""
        if self._closed:
            return
        self._closed = True
        for event in self._release_events.values():
            event.set()
