"""The side-channel wire protocol (no I/O).

Request/reply exchanges, msgpack-encoded with msgspec, over a ZeroMQ ROUTER
socket on the producer (REQ-style envelope: an empty delimiter frame, then one
payload frame): one per handshake, and the lease exchanges. Nothing is ever
unpickled.

Consumer -> producer, one of::

    MetadataRequest {type: "metadata_request", protocol_version, engine_id,
                     consumer_engine_id}
    LeaseRequest    {type: "lease", protocol_version, engine_id,
                     consumer_engine_id, consumer_agent,
                     entries: [LeaseEntry {request_id, token, readers,
                                           abandon, incarnation, pins}]}
    ConfirmRequest  {type: "confirm", protocol_version, engine_id,
                     consumer_engine_id, consumer_agent,
                     entries: [ConfirmEntry {seq, request_id, token,
                                             incarnation, blocks_digest, nonce,
                                             exposure}]}

Producer -> consumer, one of::

    MetadataReply {type: "metadata_reply", protocol_version, compatibility_hash,
                   engine_metadata: bytes}      # msgpack EngineMetadata
    LeaseReply    {type: "lease_reply", protocol_version, unknown, refused}
    ConfirmReply  {type: "confirm_reply", protocol_version,
                   answers: [ConfirmAnswer {seq, state, held_for}]}
    ErrorReply    {type: "error", protocol_version, code, reason}

A reply is decoded in three steps, each a clear error if it fails: the
envelope's ``type`` and ``protocol_version`` (tolerant, so another version is
reported as such); the full envelope with the compatibility hash compared; only
then the inner :class:`EngineMetadata`, whose engine id must be the one asked for.

Transfer notifications (consumer -> producer, through NIXL) are
``b"trio_pd:5:"`` followed by one entry per pull, each
``b"<readers>[/<nonce>]:<length>:" + request_id`` (UTF-8; ``length`` its
byte length; ``nonce`` the READ's, as its confirmation names it).
``readers`` is how many ranks of the consumer's engine read this producer
rank (vLLM's ``"{request_id}:{count}"``). A consumer's transfer driver posts
small pulls that arrive together as one transfer, and their notifications as
one message of several entries. They are parsed exactly, never by substring.

What the producer's listener does with a request is decided (without I/O)
in ``_listener_rules``.

Version 2 added the tensor-parallel fields of :class:`EngineMetadata`
(``tp_rank``, ``tp_size``, ``kv_heads``) and the readers count; version 3
made a notification a list of entries; version 4 added the lease exchange;
version 5 the confirmation of a pull's exposure (``ConfirmRequest``, sent on a
long-lived DEALER per producer rank, so its answers name the ``seq`` they
answer; the READs that queue while one request waits travel together).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Final, Literal

import msgspec

from trio_pd._core._errors import HandshakeError, IncompatibleEngineError, ProtocolError
from trio_pd._core._exposures import MAX_PINS
from trio_pd._core._layout import KVLayout

PROTOCOL_VERSION: Final = 5
"""Bumped on any incompatible change to the messages below."""

NOTIFICATION_PREFIX: Final = b"trio_pd:5:"

ErrorCode = Literal["bad_request", "unsupported_version", "wrong_engine"]


class MetadataRequest(msgspec.Struct, tag="metadata_request", tag_field="type", frozen=True):
    """Ask a producer for its handshake metadata."""

    protocol_version: int
    engine_id: str
    """The producer engine the consumer expects to reach."""
    consumer_engine_id: str
    """The consumer's own engine id (informational)."""


MAX_NONCE: Final = 2**63 - 1
"""The largest nonce a READ may have (consumers draw theirs at random in
``[1, MAX_NONCE]``, and an abandon names them in ``LeaseEntry.pins``)."""


class LeaseEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One held request in a :class:`LeaseRequest`."""

    request_id: str
    """The producer's request id (``remote_request_id``)."""
    token: str
    """``remote_token`` as the consumer received it (empty when the producer signs nothing)."""
    readers: Annotated[int, msgspec.Meta(ge=1)]
    """Ranks of the consumer's engine that read this producer rank (as in a notification)."""
    abandon: bool
    """``false``: renew the lease; ``true``: this consumer will not read."""
    incarnation: str = ""
    """The incarnation the consumer's parameters name (``remote_incarnation``:
    rank 0's), so that another rank of a tensor-parallel engine can check a
    token that rank 0 issued."""
    pins: Annotated[
        list[Annotated[int, msgspec.Meta(ge=1, le=MAX_NONCE)]], msgspec.Meta(max_length=MAX_PINS)
    ] = []
    """With ``abandon``: the nonces of this agent's confirmed READs of the
    request that have ended without their notification (none of them reads
    any more): the producer ends those READs' pins -- only this agent's --
    and frees the blocks at once if nothing else holds them. A READ that
    may still run is not named: its pin lasts until its notification or its
    end. Ignored in a renewal; absent in most entries. At most 64 nonces
    (``MAX_PINS``: as many READs as one exposure pins), each from 1 to
    2^63 - 1 (``MAX_NONCE``): another list fails the whole request
    (``bad_request``)."""


class LeaseRequest(msgspec.Struct, tag="lease", tag_field="type", frozen=True):
    """Renew or abandon a consumer's leases on a producer rank's exposures."""

    protocol_version: int
    engine_id: str
    """The producer engine the consumer expects to reach."""
    consumer_engine_id: str
    """The consumer's own engine id (logged)."""
    consumer_agent: str
    """The consumer's NIXL agent name: an abandon counts for this agent as its
    notification would, and ends only this agent's pins."""
    entries: list[LeaseEntry]
    """The held requests, one ``LeaseEntry`` map each."""


class LeaseReply(msgspec.Struct, tag="lease_reply", tag_field="type", frozen=True):
    """The producer applied every entry of a lease request except these."""

    protocol_version: int
    unknown: list[int]
    """Entries (their positions in the request's ``entries``) whose request is
    not pending here: expired, already resolved, or never exposed."""
    refused: list[int]
    """Entries (positions) whose token did not verify; positions, not request
    ids, because one consumer may hold the same request id under a real and a
    forged token, and only the forged entry's hold is lost."""


class ConfirmEntry(msgspec.Struct, frozen=True):
    """One READ to confirm, in a :class:`ConfirmRequest`."""

    seq: Annotated[int, msgspec.Meta(ge=0)]
    """Echoed in its answer: the consumer matches answers by it."""
    request_id: str
    """``remote_request_id``."""
    token: str
    """``remote_token`` (empty when the producer signs nothing)."""
    incarnation: str
    """``remote_incarnation`` (rank 0's)."""
    blocks_digest: Annotated[bytes, msgspec.Meta(max_length=32)]
    """``_exposures.blocks_digest`` of ``remote_block_ids``."""
    nonce: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The nonce of the READ's notification: ``read`` is answered only if
    that notification (not an earlier READ's of the same agent) was counted."""
    exposure: Annotated[int, msgspec.Meta(ge=0)] = 0
    """``remote_exposure``: which exposure of the request the READ's
    parameters came from (0: unknown, any)."""


class ConfirmRequest(msgspec.Struct, tag="confirm", tag_field="type", frozen=True):
    """READs a consumer is about to post (or has posted): does the producer still
    hold their exposures for them? (see ``_exposures.ExposureTable.confirm``)"""

    protocol_version: int
    engine_id: str
    """The producer engine the consumer expects to reach."""
    consumer_engine_id: str
    """The consumer's own engine id (logged)."""
    consumer_agent: str
    """The consumer's NIXL agent name: each pin is this agent's, and its
    READ's notification ends it (or this agent's abandon that names the
    READ: a lease entry's ``pins``)."""
    entries: list[ConfirmEntry]
    """One per READ: the pulls that reach the consumer's socket while an
    earlier request waits for its answer travel together."""


ConfirmState = Literal[
    "held",
    "read",
    "expired",
    "abandoned",
    "read_by_others",
    "unknown",
    "too_many_pins",
    "refused",
    "restarted",
]
"""``_exposures.Confirmed``'s values, and two the listener decides: ``refused``
(the token does not verify) and ``restarted`` (another incarnation)."""


class ConfirmAnswer(msgspec.Struct, frozen=True):
    """The producer's answer for one :class:`ConfirmEntry`."""

    seq: int
    """The entry's ``seq``."""
    state: ConfirmState
    """``held`` (pinned for ``held_for`` seconds from when it was answered)
    or ``read`` (this READ's notification was counted while it was
    pending) let the consumer keep what it read; every other state says why
    not."""
    held_for: float = 0.0
    """With ``held``: how long the pin lasts, in seconds from when the producer
    answered (0 otherwise)."""


class ConfirmReply(msgspec.Struct, tag="confirm_reply", tag_field="type", frozen=True):
    """The producer's answers to a :class:`ConfirmRequest`, one per entry, in order."""

    protocol_version: int
    answers: list[ConfirmAnswer]
    """One per entry of the request, in its order."""


class MetadataReply(msgspec.Struct, tag="metadata_reply", tag_field="type", frozen=True):
    """The producer's answer: an envelope checked before the payload is decoded."""

    protocol_version: int
    compatibility_hash: str
    """Hex SHA-256 of the protocol version and the producer's ``compatibility_key``
    (``compatibility_hash()``); the consumer compares it with its own."""
    engine_metadata: bytes
    """A MessagePack map, the ``EngineMetadata``, encoded separately: the
    consumer compares the version and the hash before it decodes it."""


class ErrorReply(msgspec.Struct, tag="error", tag_field="type", frozen=True):
    """The producer could not serve a request; ``code`` says why."""

    protocol_version: int
    """the *producer's* version"""
    code: ErrorCode
    """Why the request was refused."""
    reason: str
    """One line, for humans and logs."""


class EngineMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a consumer needs to read a producer's KV blocks."""

    engine_id: str
    """The producer's engine id; must be the one asked for."""
    incarnation: str
    """Random per connector start: a restarted producer has a new one."""
    agent_name: str
    """The producer's NIXL agent name."""
    agent_metadata: bytes
    """NIXL's serialized agent metadata (``get_agent_metadata()``), for
    ``add_remote_agent``."""
    num_blocks: int
    """Blocks per region."""
    base_addrs: list[int]
    """The start address of each region, in region order."""
    block_lens: list[int]
    """Bytes per block of each region."""
    device_id: int
    """NIXL device id (0 for host memory)."""
    mem_type: str
    """NIXL memory type: ``"DRAM"`` or ``"VRAM"``."""
    dtype: str
    """Element type of the regions, as torch prints it, e.g. ``"torch.float16"``."""
    kv_heads: int
    """KV heads per block (dimension 1 of the region tensors); 0 if the tensors
    have no such dimension."""
    tp_rank: int
    """Which rank of its engine answers (its side channel is the engine's base
    port + ``tp_rank``)."""
    tp_size: int
    """The engine's tensor-parallel size."""

    def layout(self) -> KVLayout:
        """The producer's KV layout.

        Raises:
            ProtocolError: the fields describe no valid layout.
        """
        try:
            return KVLayout(
                base_addrs=self.base_addrs,
                block_lens=self.block_lens,
                num_blocks=self.num_blocks,
                device_id=self.device_id,
                mem_type=self.mem_type,
                dtype=self.dtype,
                kv_heads=self.kv_heads,
            )
        except ValueError as exc:
            raise ProtocolError(f"invalid KV layout in metadata: {exc}") from None


class _Envelope(msgspec.Struct):
    """The two fields every version of every message keeps."""

    type: str
    """Which message it is."""
    protocol_version: int
    """The sender's protocol version: a receiver that speaks another names both."""


_UNDECODABLE = (msgspec.DecodeError, RecursionError)
"""What decoding hostile bytes can raise: a deeply nested message recurses."""

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_request_decoder = msgspec.msgpack.Decoder(MetadataRequest | LeaseRequest | ConfirmRequest)
_confirm_reply_decoder = msgspec.msgpack.Decoder(ConfirmReply | ErrorReply)
_reply_decoder = msgspec.msgpack.Decoder(MetadataReply | ErrorReply)
_lease_reply_decoder = msgspec.msgpack.Decoder(LeaseReply | ErrorReply)
_metadata_decoder = msgspec.msgpack.Decoder(EngineMetadata)


def compatibility_hash(compatibility_key: str) -> str:
    """SHA-256 over the protocol version and the user's compatibility key.

    Layout facts (regions, block sizes, dtype) are not hashed: they are checked
    one by one after decoding, so a mismatch can be named.
    """
    text = f"trio_pd\0{PROTOCOL_VERSION}\0{compatibility_key}"
    return hashlib.sha256(text.encode()).hexdigest()


def _check_size(data: bytes, max_bytes: int, what: str) -> None:
    if len(data) > max_bytes:
        raise ProtocolError(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit")


def _envelope(data: bytes, what: str) -> _Envelope:
    try:
        return _envelope_decoder.decode(data)
    except _UNDECODABLE as exc:
        raise ProtocolError(f"undecodable {what}: {exc}") from None


def encode_request(engine_id: str, consumer_engine_id: str) -> bytes:
    return _encoder.encode(
        MetadataRequest(
            protocol_version=PROTOCOL_VERSION,
            engine_id=engine_id,
            consumer_engine_id=consumer_engine_id,
        )
    )


def decode_request(
    data: bytes, max_bytes: int
) -> MetadataRequest | LeaseRequest | ConfirmRequest | ErrorReply:
    """Decode a request; a request this engine cannot serve becomes the reply to send.

    Returns:
        the request (metadata, lease or confirm), or the :class:`ErrorReply` for a
        request of another protocol version.

    Raises:
        ProtocolError: oversized or undecodable input (no reply is owed).
    """
    _check_size(data, max_bytes, "request")
    envelope = _envelope(data, "request")
    if envelope.protocol_version != PROTOCOL_VERSION:
        return error_reply(
            "unsupported_version",
            f"protocol version {envelope.protocol_version} requested, "
            f"this engine speaks {PROTOCOL_VERSION}",
        )
    try:
        request: MetadataRequest | LeaseRequest | ConfirmRequest = _request_decoder.decode(data)
    except _UNDECODABLE as exc:
        raise ProtocolError(f"invalid request: {exc}") from None
    return request


def error_reply(code: ErrorCode, reason: str) -> ErrorReply:
    return ErrorReply(protocol_version=PROTOCOL_VERSION, code=code, reason=reason)


def encode_message(message: MetadataReply | LeaseReply | ConfirmReply | ErrorReply) -> bytes:
    return _encoder.encode(message)


def metadata_reply(metadata: EngineMetadata, compat_hash: str) -> MetadataReply:
    return MetadataReply(
        protocol_version=PROTOCOL_VERSION,
        compatibility_hash=compat_hash,
        engine_metadata=_encoder.encode(metadata),
    )


def decode_reply(
    data: bytes, *, expected_engine_id: str, local_hash: str, max_bytes: int
) -> EngineMetadata:
    """Decode and check a producer's reply.

    Raises:
        IncompatibleEngineError: another protocol version, another
            compatibility hash, or metadata of another engine.
        HandshakeError: the producer answered with an error, or the reply is
            oversized or undecodable.
    """
    eid = expected_engine_id
    try:
        _check_size(data, max_bytes, "reply")
        envelope = _envelope(data, "reply")
    except ProtocolError as exc:
        raise HandshakeError(eid, str(exc)) from None
    if envelope.protocol_version != PROTOCOL_VERSION:
        raise IncompatibleEngineError(
            eid,
            f"remote speaks protocol version {envelope.protocol_version}, "
            f"local speaks {PROTOCOL_VERSION}",
        )
    try:
        reply = _reply_decoder.decode(data)
    except _UNDECODABLE as exc:
        raise HandshakeError(eid, f"invalid reply: {exc}") from None
    if isinstance(reply, ErrorReply):
        cls = HandshakeError if reply.code == "bad_request" else IncompatibleEngineError
        raise cls(eid, f"remote refused ({reply.code}): {reply.reason}")
    if reply.compatibility_hash != local_hash:
        raise IncompatibleEngineError(
            eid,
            f"compatibility hash mismatch (remote {reply.compatibility_hash[:12]}, "
            f"local {local_hash[:12]}): different compatibility_key or trio_pd protocol",
        )
    try:
        metadata = _metadata_decoder.decode(reply.engine_metadata)
    except _UNDECODABLE as exc:
        raise HandshakeError(eid, f"invalid engine metadata: {exc}") from None
    if metadata.engine_id != eid:
        raise IncompatibleEngineError(
            eid, f"reply is from engine {metadata.engine_id!r}, not {eid!r}"
        )
    return metadata


def encode_notification(request_id: str, readers: int = 1, nonce: int = 0) -> bytes:
    """The notification a consumer rank posts once it has read ``request_id``'s blocks.

    ``readers``: how many ranks of its engine read the same producer rank
    (the producer counts each as ``1 / readers`` of a consumer engine).
    ``nonce``: names this READ among the agent's (its confirmation names the
    same one, so a ``read`` answer is about this READ, not an earlier one);
    0 for none.
    """
    encoded = request_id.encode()
    if nonce:
        return b"%s%d/%d:%d:%s" % (NOTIFICATION_PREFIX, readers, nonce, len(encoded), encoded)
    return b"%s%d:%d:%s" % (NOTIFICATION_PREFIX, readers, len(encoded), encoded)


def join_notifications(messages: Sequence[bytes]) -> bytes:
    """One notification for several pulls, from their :func:`encode_notification` s."""
    if len(messages) == 1:
        return messages[0]
    skip = len(NOTIFICATION_PREFIX)
    return NOTIFICATION_PREFIX + b"".join(message[skip:] for message in messages)


def decode_notification(message: bytes) -> list[tuple[str, int, int]] | None:
    """``[(request_id, readers, nonce), ...]`` of a notification, or ``None`` if it is not ours.

    A message that starts like ours but does not parse to the end is not ours.
    """
    if not message.startswith(NOTIFICATION_PREFIX):
        return None
    entries: list[tuple[str, int, int]] = []
    position, end = len(NOTIFICATION_PREFIX), len(message)
    while position < end:
        colon = message.find(b":", position)
        second = message.find(b":", colon + 1) if colon >= 0 else -1
        if second < 0:
            return None
        head, length = message[position:colon], message[colon + 1 : second]
        readers, slash, nonce = head.partition(b"/")
        if not (readers.isdigit() and length.isdigit()) or int(readers) < 1:
            return None
        if slash and not (nonce.isdigit() and int(nonce) > 0):
            return None
        start, position = second + 1, second + 1 + int(length)
        if position > end:
            return None
        try:
            request_id = message[start:position].decode()
        except UnicodeDecodeError:
            return None
        entries.append((request_id, int(readers), int(nonce) if slash else 0))
    return entries or None


def encode_lease_request(
    engine_id: str, consumer_engine_id: str, consumer_agent: str, entries: Sequence[LeaseEntry]
) -> bytes:
    return _encoder.encode(
        LeaseRequest(
            protocol_version=PROTOCOL_VERSION,
            engine_id=engine_id,
            consumer_engine_id=consumer_engine_id,
            consumer_agent=consumer_agent,
            entries=list(entries),
        )
    )


def decode_lease_reply(data: bytes, max_bytes: int) -> LeaseReply:
    """Decode a producer's answer to a lease request.

    Raises:
        ProtocolError: oversized, undecodable, another protocol version, or
            an error reply (its code and reason named).
    """
    _check_version(data, max_bytes, "lease reply")
    try:
        reply = _lease_reply_decoder.decode(data)
    except _UNDECODABLE as exc:
        raise ProtocolError(f"invalid lease reply: {exc}") from None
    if isinstance(reply, ErrorReply):
        raise ProtocolError(f"remote refused ({reply.code}): {reply.reason}")
    return reply


def encode_confirm_request(
    engine_id: str,
    consumer_engine_id: str,
    consumer_agent: str,
    entries: Sequence[ConfirmEntry],
) -> bytes:
    return _encoder.encode(
        ConfirmRequest(
            protocol_version=PROTOCOL_VERSION,
            engine_id=engine_id,
            consumer_engine_id=consumer_engine_id,
            consumer_agent=consumer_agent,
            entries=list(entries),
        )
    )


def confirm_reply(answers: Sequence[ConfirmAnswer]) -> bytes:
    """The encoded :class:`ConfirmReply`."""
    return _encoder.encode(ConfirmReply(protocol_version=PROTOCOL_VERSION, answers=list(answers)))


def decode_confirm_reply(data: bytes, max_bytes: int) -> ConfirmReply | ErrorReply:
    """Decode a producer's answer on a confirmation channel.

    An :class:`ErrorReply` (another version, a request it could not parse)
    names no ``seq``: the channel fails every confirmation it waits for.

    Raises:
        ProtocolError: oversized, undecodable, or another protocol version.
    """
    _check_version(data, max_bytes, "confirm reply")
    try:
        reply: ConfirmReply | ErrorReply = _confirm_reply_decoder.decode(data)
    except _UNDECODABLE as exc:
        raise ProtocolError(f"invalid confirm reply: {exc}") from None
    return reply


def _check_version(data: bytes, max_bytes: int, what: str) -> None:
    """A reply's size and envelope, and that it speaks our version.

    Raises:
        ProtocolError: oversized, no envelope, or another protocol version.
    """
    _check_size(data, max_bytes, what)
    envelope = _envelope(data, what)
    if envelope.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"remote speaks protocol version {envelope.protocol_version}, "
            f"local speaks {PROTOCOL_VERSION}"
        )


def endpoint(host: str, port: int | str) -> str:
    """The ZeroMQ TCP endpoint of ``host:port`` (IPv6 addresses in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
