"""The side-channel listener's decisions (no I/O).

What the producer's ROUTER socket does with one request payload, in two
steps: :func:`parse_request` says what it asks (or rejects it with the error
reply to send: size, version, type, engine id); for a lease request,
:func:`serve_lease_request` decides which entries to apply and which are
unknown or refused, given lookups into the producer's exposures; for a
confirmation, :func:`serve_confirm_request` decides the answer. The
producer (``_producer``) is the shell that receives, applies and sends.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from trio_pd._core import _protocol as protocol
from trio_pd._core._errors import ProtocolError
from trio_pd._core._exposures import Confirmation


@attrs.frozen
class Rejected:
    """A request the listener does not serve: the error reply to send, and why."""

    reply: bytes
    reason: str


def parse_request(
    data: bytes, *, engine_id: str, max_bytes: int
) -> protocol.MetadataRequest | protocol.LeaseRequest | protocol.ConfirmRequest | Rejected:
    """The listener's first step for one request payload: what it asks, or why not.

    Never raises: oversized, undecodable or mistyped requests, requests of
    another protocol version and requests for another engine are
    :class:`Rejected` with the error reply (``bad_request``,
    ``unsupported_version``, ``wrong_engine``).
    """
    try:
        request = protocol.decode_request(data, max_bytes)
    except ProtocolError as exc:
        reason = str(exc)
        return Rejected(
            protocol.encode_message(protocol.error_reply("bad_request", reason)), reason
        )
    if isinstance(request, protocol.ErrorReply):
        return Rejected(protocol.encode_message(request), request.reason)
    if request.engine_id != engine_id:
        reason = f"this is engine {engine_id!r}, not {request.engine_id!r}"
        return Rejected(
            protocol.encode_message(protocol.error_reply("wrong_engine", reason)), reason
        )
    return request


def serve_lease_request(
    request: protocol.LeaseRequest,
    *,
    pending: Callable[[str], bool],
    verify: Callable[[protocol.LeaseEntry], bool] | None,
    ours: Callable[[protocol.LeaseEntry], bool] = lambda entry: True,
) -> tuple[bytes, list[protocol.LeaseEntry], list[str]]:
    """The listener's decision for a lease request: which entries to apply.

    An entry whose request is not ``pending``, or that is not ``ours``
    (it names another incarnation: meant for the engine that ran on this
    port before a restart), is *unknown*; else, with
    ``verify`` (the producer has an exposure secret), one whose token does
    not verify is *refused*; every other entry is to be applied (renewed,
    or abandoned for ``request.consumer_agent``, ending the pins of that
    agent's READs it names: ``ExposureTable.abandon``). A request id named twice
    is decided (and applied) twice: renewing or abandoning is idempotent.

    Returns:
        ``(reply, apply, refused)``: the encoded :class:`LeaseReply` (which
        names unknown and refused entries by their position), the entries to
        apply in order, and the refused request ids.
    """
    unknown: list[int] = []
    refused: list[int] = []
    apply: list[protocol.LeaseEntry] = []
    for position, entry in enumerate(request.entries):
        if not pending(entry.request_id) or not ours(entry):
            unknown.append(position)
        elif verify is not None and not verify(entry):
            refused.append(position)
        else:
            apply.append(entry)
    reply = protocol.LeaseReply(
        protocol_version=protocol.PROTOCOL_VERSION, unknown=unknown, refused=refused
    )
    refused_ids = [request.entries[position].request_id for position in refused]
    return protocol.encode_message(reply), apply, refused_ids


def serve_confirm_request(
    request: protocol.ConfirmRequest,
    *,
    ours: Callable[[str], bool],
    token_verifies: Callable[[protocol.ConfirmEntry], bool | None],
    confirm: Callable[[protocol.ConfirmEntry], Confirmation],
) -> tuple[bytes, list[protocol.ConfirmAnswer]]:
    """The listener's answers to a confirmation request, entry by entry.

    ``ours(incarnation)``: the entry names this incarnation (else
    ``restarted``: the blocks it read belonged to the engine that ran here
    before). ``token_verifies``: ``None`` without an exposure secret, or
    when the exposure is not pending (nothing to compare with); ``False``
    answers ``refused``. Otherwise ``confirm`` decides (and pins, see
    ``ExposureTable.confirm``).

    Returns:
        the encoded :class:`~trio_pd._core._protocol.ConfirmReply` and its answers.
    """
    answers = []
    for entry in request.entries:
        if not ours(entry.incarnation):
            answer = protocol.ConfirmAnswer(entry.seq, "restarted")
        elif token_verifies(entry) is False:
            answer = protocol.ConfirmAnswer(entry.seq, "refused")
        else:
            decided = confirm(entry)
            answer = protocol.ConfirmAnswer(entry.seq, decided.state.value, decided.held_for)
        answers.append(answer)
    return protocol.confirm_reply(answers), answers
