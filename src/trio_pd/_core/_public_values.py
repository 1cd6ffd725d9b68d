"""The small immutable records the public API hands out."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import attrs


def _block_tuple(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def unbracket(host: str) -> str:
    """``"[::1]"`` -> ``"::1"``: IPv6 addresses are kept without brackets."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@attrs.frozen
class RemoteBlocks:
    """Where a consumer finds a request's blocks: the producer's answer to
    :meth:`~trio_pd.Connector.expose`, passed by the P/D proxy to the decoder.

    Attributes:
        engine_id: the producer engine.
        host: the producer's side-channel host as consumers reach it (its
            ``advertise_host``); IPv6 addresses without brackets.
        port: the producer's side-channel port, 1 to 65535: the engine's
            *base* port (rank ``r`` of a tensor-parallel engine listens on
            ``port + r``, which must be a port too).
        block_ids: the producer's block ids, in the order they are read.
        request_id: the producer's request id (named in the notification).
        incarnation: the producer connector's incarnation (random per start).
            A consumer that finds the engine running another incarnation knows
            it restarted: it re-handshakes, and refuses to read blocks that
            belonged to the old one. Empty when unknown (e.g. parameters from a
            producer that is not trio_pd); then no such check is possible.
            For a tensor-parallel engine, rank 0's incarnation.
        tp_size: the producer engine's tensor-parallel size (its ranks; vLLM's
            key).
        token: the producer's signature over all of the above (see
            ``ConnectorConfig.exposure_secret``); empty when the producer
            has no secret. A consumer with a secret reads only blocks whose
            token matches.
        exposure: which exposure of ``request_id`` on the producer this is:
            1 for its first, 2 if it was exposed again after the first
            ended, and so on (each rank of an engine counts the same). A
            pull's confirmation names it, so that a READ that outlasted one
            exposure is never taken for a later one of the same request on
            the same blocks. 0 when unknown (then only the request id and
            the blocks name it).
    """

    engine_id: str
    host: str = attrs.field(converter=unbracket)
    port: int
    block_ids: tuple[int, ...] = attrs.field(converter=_block_tuple)
    request_id: str
    incarnation: str = ""
    tp_size: int = 1
    token: str = attrs.field(default="", repr=False)
    exposure: int = 0

    def to_kv_transfer_params(self) -> dict[str, Any]:
        """vLLM's ``kv_transfer_params`` keys, so a P/D proxy can pass them through.

        trio_pd adds ``remote_incarnation``, ``remote_token`` and
        ``remote_exposure``; proxies
        pass unknown keys along. ``tp_size`` is vLLM's key for the
        producer's tensor-parallel size.
        """
        params = {key: getattr(self, name) for key, name in KV_TRANSFER_PARAMS.items()}
        params["remote_block_ids"] = list(self.block_ids)  # (JSON has no tuples)
        return params

    @classmethod
    def from_kv_transfer_params(cls, params: Mapping[str, Any]) -> RemoteBlocks:
        """Inverse of :meth:`to_kv_transfer_params`; extra keys are ignored,
        ``remote_incarnation``, ``remote_token`` and ``remote_exposure`` are optional (``None``
        counts as absent, as vLLM's proxy sends them), an absent ``tp_size``
        means 1.

        Raises:
            ValueError: a key is missing or has the wrong type.
        """
        missing = [key for key in REQUIRED_PARAMS if key not in params]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {missing[0]!r}")
        engine_id = params["remote_engine_id"]
        host = params["remote_host"]
        port = params["remote_port"]
        block_ids = params["remote_block_ids"]
        request_id = params["remote_request_id"]
        if not isinstance(engine_id, str) or not isinstance(host, str):
            raise ValueError("remote_engine_id and remote_host must be strings")
        if not isinstance(request_id, str):
            raise ValueError("remote_request_id must be a string")
        incarnation = params.get("remote_incarnation") or ""
        if not isinstance(incarnation, str):
            raise ValueError("remote_incarnation must be a string")
        token = params.get("remote_token") or ""
        if not isinstance(token, str):
            raise ValueError("remote_token must be a string")
        exposure = params.get("remote_exposure") or 0
        if not isinstance(exposure, int) or isinstance(exposure, bool) or not 0 <= exposure < 2**63:
            raise ValueError(f"remote_exposure must be an int >= 0, got {exposure!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"remote_port must be a TCP port, got {port!r}")
        tp_size = params.get("tp_size")
        tp_size = 1 if tp_size is None else tp_size
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        if port + tp_size - 1 >= 65536:
            raise ValueError(f"remote_port {port} + tp_size {tp_size} leaves the TCP port range")
        if not isinstance(block_ids, list | tuple) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in block_ids
        ):
            raise ValueError("remote_block_ids must be a list of ints")
        return cls(
            engine_id, host, port, block_ids, request_id, incarnation, tp_size, token, exposure
        )


KV_TRANSFER_PARAMS: Final = {
    "remote_engine_id": "engine_id",
    "remote_host": "host",
    "remote_port": "port",
    "remote_block_ids": "block_ids",
    "remote_request_id": "request_id",
    "remote_incarnation": "incarnation",
    "tp_size": "tp_size",
    "remote_token": "token",
    "remote_exposure": "exposure",
}
"""The ``kv_transfer_params`` keys, in order, and the :class:`RemoteBlocks`
attribute each carries: a key is required when its attribute has no default,
else optional (absent or ``null``: the default)."""

REQUIRED_PARAMS: Final = tuple(
    key
    for key, name in KV_TRANSFER_PARAMS.items()
    if attrs.fields_dict(RemoteBlocks)[name].default is attrs.NOTHING
)
"""The keys that :meth:`RemoteBlocks.from_kv_transfer_params` requires."""


@attrs.frozen
class PullResult:
    """What one :meth:`~trio_pd.Connector.pull` did.

    Attributes:
        request_id: the pulling request.
        engine_id: the producer it pulled from.
        bytes: bytes copied into local blocks (0 for a notify-only pull).
        seconds: wall time of the whole pull, handshake wait included.
        handshake_wait: the part of ``seconds`` spent waiting for the handshake.
    """

    request_id: str
    engine_id: str
    bytes: int
    seconds: float
    handshake_wait: float


# A role's counters are keyword-only (ConnectorStatistics combines both roles'
# fields, and no order of required and defaulted fields would hold for both) and
# have no __slots__ (two slotted bases could not be combined).
@attrs.frozen(kw_only=True, slots=False)
class ConsumerStatistics:
    """The consumer (decode) role's counters (:attr:`ConnectorStatistics.consumer`).

    Attributes:
        handshakes_started: handshake attempts started, consumer side.
        handshakes_succeeded: handshake attempts that succeeded.
        handshakes_failed: handshake attempts that failed.
        handshake_failures_by_cause: failed handshakes by cause, keyed by
            :class:`~trio_pd.FailureCause` (a ``str`` enum: ``"timeout"``,
            ``"refused"`` (authentication), ``"protocol"`` (bad reply),
            ``"incompatible"``, ``"nixl"`` (loading the remote agent)).
        engines_ready: remote engines ready for pulls now.
        pulls_succeeded: pulls that finished successfully.
        pulls_failed: pulls that failed (cancelled pulls count as neither).
        pulls_in_flight: pulls posted and not finished.
        pulls_rejected_in_backoff: pulls that failed fast because their
            engine was in backoff after a failed handshake.
        restarts_detected: engines found running a new incarnation.
        peers_disconnected: engines whose transfers reported a lost peer.
        bytes_pulled: bytes copied by successful pulls.
        remote_agents_loaded: remote agents loaded in the transfer backend
            now, retired ones included until they are unloaded.
        transfers_posted: READs the transfer backend posted. Small pulls
            that reach it together share one, so ``pulls_succeeded /
            transfers_posted`` shows how much batching happens; a large pull
            posts several (one per ``max_bytes_per_transfer``).
        transfers_unsettled: pulls that ended (failed, cancelled) with a
            transfer that could not be stopped (its peer unreachable) and
            that has not ended yet: their local blocks may still be written
            (see :meth:`~trio_pd.Connector.unsettled_blocks`). Normally 0.
        pulls_rejected: pulls refused for their parameters
            (:class:`~trio_pd.ParamsRejectedError`: a token that does not
            verify, remote block ids out of range). Not in ``pulls_failed``.
        blocks_unsettled: local blocks that such transfers may still write
            (the size of :meth:`~trio_pd.Connector.unsettled_blocks`).
        backend_stuck_call: the NIXL call a remote-agent load is stuck in,
            with the agent and for how long (``""`` when none); while set,
            handshakes fail fast rather than queue behind it.
        holds_active: requests held now (see :meth:`~trio_pd.Connector.hold`).
        heartbeats_sent: lease renewal messages sent: one per producer rank
            per ``heartbeat_interval``, naming every request held there (so
            this grows with producers and time, not with holds).
        abandons_sent: abandon messages sent (one per producer rank read),
            by :meth:`~trio_pd.Connector.abandon` or by a hold left without
            a successful pull.
        abandons_failed: abandon messages that got no answer in time (or an
            error reply); their exposures expire when their leases run out.
        pulls_exposure_ended: pulls that failed with
            :class:`~trio_pd.ExposureEndedError` (also in ``pulls_failed``):
            their producer no longer held the blocks for them.
    """

    handshakes_started: int
    handshakes_succeeded: int
    handshakes_failed: int
    handshake_failures_by_cause: Mapping[str, int]
    engines_ready: int
    pulls_succeeded: int
    pulls_failed: int
    pulls_in_flight: int
    pulls_rejected_in_backoff: int
    restarts_detected: int
    peers_disconnected: int
    bytes_pulled: int
    remote_agents_loaded: int
    transfers_posted: int
    transfers_unsettled: int
    pulls_rejected: int = 0
    blocks_unsettled: int = 0
    backend_stuck_call: str = ""
    holds_active: int = 0
    heartbeats_sent: int = 0
    abandons_sent: int = 0
    abandons_failed: int = 0
    pulls_exposure_ended: int = 0


@attrs.frozen(kw_only=True, slots=False)
class ProducerStatistics:
    """The producer (prefill) role's counters (:attr:`ConnectorStatistics.producer`).

    Attributes:
        exposures_pending: producer side: exposures not resolved yet.
        exposures_released: exposures resolved ``READ``.
        exposures_expired: exposures resolved ``EXPIRED``.
        exposures_abandoned: exposures resolved ``ABANDONED``.
        leases_renewed: lease renewals applied (one per held request per
            heartbeat that reached it).
        leases_refused: lease entries (renewals or abandons) refused because
            their token did not verify (with ``exposure_secret`` only).
        notifications_ignored: late, duplicate or unknown notifications.
        listener_requests: side-channel requests answered with metadata.
        listener_rejects: side-channel requests rejected (malformed, wrong
            engine, other protocol version).
        listener_auth_failures: consumers refused by CURVE authentication.
        confirmations: producer side: pulls' confirmations answered.
        confirmations_denied: confirmations answered that the exposure had
            ended (the pull fails with :class:`~trio_pd.ExposureEndedError`).
    """

    exposures_pending: int
    exposures_released: int
    exposures_expired: int
    exposures_abandoned: int
    leases_renewed: int
    leases_refused: int
    notifications_ignored: int
    listener_requests: int
    listener_rejects: int
    listener_auth_failures: int
    confirmations: int = 0
    confirmations_denied: int = 0


_T = TypeVar("_T")


def _documenting_the_counters_of(*roles: type) -> Callable[[type[_T]], type[_T]]:
    """Append the ``Attributes:`` entries of ``roles``' docstrings to the
    decorated class's (which ends with an ``Attributes:`` header), so that each
    counter is described once, where its role declares it."""

    def entries(role: type) -> str:
        doc = role.__doc__ or ""
        return textwrap.dedent(doc[doc.index("Attributes:\n") + len("Attributes:\n") :])

    def document(cls: type[_T]) -> type[_T]:
        listed = "".join(entries(role) for role in roles)
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + textwrap.indent(listed, "        ")
        return cls

    return document


# The bases in this order: attrs takes the fields of the last base first, so the
# consumer's counters come first, as in the docstring.
@_documenting_the_counters_of(ConsumerStatistics, ProducerStatistics)
@attrs.frozen(kw_only=True)
class ConnectorStatistics(ProducerStatistics, ConsumerStatistics):
    """A snapshot of a connector's counters (see :meth:`~trio_pd.Connector.statistics`).

    Every counter of both roles, flat: the fields of :class:`ConsumerStatistics`
    and of :class:`ProducerStatistics` (each declared and described there
    once), keyword-only; :attr:`consumer` and :attr:`producer` give one role's
    counters alone, as that role's record.

    Attributes:
    """

    @classmethod
    def of_roles(
        cls, consumer: ConsumerStatistics, producer: ProducerStatistics
    ) -> ConnectorStatistics:
        """Both roles' counters in one record."""
        return cls(**attrs.asdict(consumer, recurse=False), **attrs.asdict(producer, recurse=False))

    @property
    def consumer(self) -> ConsumerStatistics:
        """The consumer role's counters alone."""
        return _role(ConsumerStatistics, self)

    @property
    def producer(self) -> ProducerStatistics:
        """The producer role's counters alone."""
        return _role(ProducerStatistics, self)


_R = TypeVar("_R", ConsumerStatistics, ProducerStatistics)


def _role(role: type[_R], stats: ConnectorStatistics) -> _R:
    return role(**{f.name: getattr(stats, f.name) for f in attrs.fields(role)})
