"""The exceptions trio_pd raises.

Every error names what it is about (the engine or the request) and why, so a
log line or a failed request can be traced without a debugger.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio


class TrioPdError(Exception):
    """Base class of every error trio_pd raises on purpose."""


class HandshakeError(TrioPdError):
    """The handshake with a remote prefill engine failed.

    Raised by :meth:`~trio_pd.Connector.pull` in every request that waited on
    that engine. The handshake's own failure is chained as ``__cause__`` when
    there is one.

    Attributes:
        engine_id: the remote engine the handshake was for.
        reason: a one-line description of what went wrong.
    """

    def __init__(self, engine_id: str, reason: str) -> None:
        super().__init__(f"handshake with engine {engine_id!r} failed: {reason}")
        self.engine_id = engine_id
        self.reason = reason

    def __reduce__(self) -> tuple[type[HandshakeError], tuple[str, str]]:
        return (type(self), (self.engine_id, self.reason))


class IncompatibleEngineError(HandshakeError):
    """The remote engine answered, but cannot be paired with this one.

    The reply came from the wrong engine, speaks another protocol version, has
    another compatibility hash, or lays its KV cache out differently (number of
    regions, bytes per block, dtype). ``reason`` names the mismatch.
    """


class TransferError(TrioPdError):
    """A pull's NIXL transfer failed, timed out or could not be posted.

    The local blocks named in ``failed_block_ids`` hold undefined data: the
    caller should recompute or fail the request.

    When the transfer backend reported the failure, its
    :class:`~trio_pd.BackendError` is chained as ``__cause__`` (with
    ``peer_lost`` and, for NIXL, ``nixl_error``: NIXL's own exception as
    text -- NIXL's exception object is never chained, see ``BackendError``).
    A failure trio_pd decided itself (a timeout, a producer that no longer
    holds the blocks, an exposure that ended) has no ``__cause__``.

    Attributes:
        request_id: the pulling request's id.
        failed_block_ids: the local block ids that did not receive their data.
        reason: a one-line description of what went wrong.
        settled: ``None`` almost always: nothing writes into those blocks any
            more. A :class:`trio.Event` when a transfer could not be stopped
            (its peer became unreachable mid-transfer; NIXL cannot cancel it,
            and its bytes land if the link comes back): the blocks may still
            be written until it is set, which happens once NIXL reports the
            transfer ended, or the connector closed. Keep the blocks out of
            reuse until then (``await error.settled.wait()``). Not pickled.
    """

    def __init__(
        self,
        request_id: str,
        failed_block_ids: Sequence[int],
        reason: str,
        *,
        settled: trio.Event | None = None,
    ) -> None:
        ids = tuple(int(b) for b in failed_block_ids)
        super().__init__(
            f"transfer for request {request_id!r} failed ({len(ids)} local blocks): {reason}"
        )
        self.request_id = request_id
        self.failed_block_ids = ids
        self.reason = reason
        self.settled = settled

    def __reduce__(
        self,
    ) -> tuple[type[TransferError], tuple[str, tuple[int, ...], str]]:
        return (type(self), (self.request_id, self.failed_block_ids, self.reason))


class ExposureEndedError(TransferError):
    """The producer no longer held the pulled blocks for this request.

    The exposure ended -- its lease expired, it was abandoned, every
    consumer already read it, or the producer restarted -- before or while
    the READ ran, so the bytes that arrived may be another request's KV
    (the producer is free to reuse blocks once an exposure ends). The pull
    fails instead of returning them; the local blocks hold undefined data.
    A server answers it with an error that says so (``exposure_ended``);
    the request can be prefilled again.

    Attributes:
        outcome: how the producer says the exposure ended (``"expired"``,
            ``"abandoned"``, ``"read"``, ``"unknown"``: never exposed or
            forgotten, ``"restarted"``, ``"refused"``: the token does not
            verify), or ``"unconfirmed"`` when the producer's confirmation
            did not arrive in time.
    """

    def __init__(
        self,
        request_id: str,
        failed_block_ids: Sequence[int],
        reason: str,
        *,
        outcome: str = "unknown",
        settled: trio.Event | None = None,
    ) -> None:
        super().__init__(request_id, failed_block_ids, reason, settled=settled)
        self.outcome = outcome

    def __reduce__(  # type: ignore[override]
        self,
    ) -> tuple[object, ...]:
        return (
            _exposure_ended,
            (self.request_id, self.failed_block_ids, self.reason, self.outcome),
        )


def _exposure_ended(
    request_id: str, failed_block_ids: tuple[int, ...], reason: str, outcome: str
) -> ExposureEndedError:
    return ExposureEndedError(request_id, failed_block_ids, reason, outcome=outcome)


class ParamsRejectedError(TrioPdError, ValueError):
    """A request's ``kv_transfer_params`` claim something this connector refuses.

    Raised by :meth:`~trio_pd.Connector.pull` before anything is read (and,
    for claims checked against the producer's own answer, before anything
    of this request is read): a ``remote_token`` that the producer did not
    issue for exactly these parameters, remote block ids out of the
    producer's range or repeated, an address or TP size that is not the
    engine's. Only the request that made the claim fails; the engine's
    state (its loaded agent, its handshakes) is untouched. A
    :class:`ValueError`, so code that treats bad input as such keeps
    working; a server answers it with a 4xx naming ``field``.

    Attributes:
        request_id: the pulling request's id.
        field: the ``kv_transfer_params`` key at fault (``"remote_token"``,
            ``"remote_block_ids"``, ``"remote_host"``, ...).
        reason: a one-line description.
    """

    def __init__(self, request_id: str, field: str, reason: str) -> None:
        super().__init__(f"request {request_id!r}: kv_transfer_params[{field!r}]: {reason}")
        self.request_id = request_id
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[type[ParamsRejectedError], tuple[str, str, str]]:
        return (type(self), (self.request_id, self.field, self.reason))


class ProtocolError(TrioPdError):
    """A side-channel message could not be decoded or broke the protocol.

    Internal to the wire layer: the connector turns it into a
    :class:`HandshakeError` (consumer side) or a counted reject (listener side).
    """
