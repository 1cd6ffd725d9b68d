"""The side-channel wire protocol: encoding, decoding, checks and rejects (no I/O)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pd._core._errors import HandshakeError, IncompatibleEngineError, ProtocolError
from trio_pd._core._layout import KVLayout
from trio_pd._core._listener_rules import Rejected, parse_request, serve_lease_request
from trio_pd._core._protocol import (
    NOTIFICATION_PREFIX,
    PROTOCOL_VERSION,
    EngineMetadata,
    ErrorReply,
    LeaseEntry,
    LeaseReply,
    LeaseRequest,
    MetadataRequest,
    compatibility_hash,
    decode_lease_reply,
    decode_notification,
    decode_reply,
    decode_request,
    encode_lease_request,
    encode_message,
    encode_notification,
    encode_request,
    error_reply,
    join_notifications,
    metadata_reply,
)

ENGINE = "prefill-0"
HASH = compatibility_hash("model-a")
LIMIT = 1 << 20

encode = msgspec.msgpack.encode


def engine_metadata(engine_id: str = ENGINE, **overrides: Any) -> EngineMetadata:
    fields: dict[str, Any] = {
        "engine_id": engine_id,
        "incarnation": "3f2a",
        "agent_name": "agent-prefill-0",
        "agent_metadata": b"\x00nixl\xff",
        "num_blocks": 16,
        "base_addrs": [4096, 1 << 33],
        "block_lens": [256, 256],
        "device_id": 0,
        "mem_type": "DRAM",
        "dtype": "torch.float16",
        "kv_heads": 2,
        "tp_rank": 0,
        "tp_size": 1,
    }
    fields.update(overrides)
    return EngineMetadata(**fields)


def reply_bytes(metadata: EngineMetadata | None = None, compat_hash: str = HASH) -> bytes:
    return encode_message(metadata_reply(metadata or engine_metadata(), compat_hash))


def decode(data: bytes, *, engine_id: str = ENGINE, max_bytes: int = LIMIT) -> EngineMetadata:
    return decode_reply(data, expected_engine_id=engine_id, local_hash=HASH, max_bytes=max_bytes)


def serve(data: bytes, *, max_bytes: int = LIMIT) -> tuple[bytes, str | None]:
    """The listener's decision with ``b"REPLY"`` as the metadata and nothing pending."""
    request = parse_request(data, engine_id=ENGINE, max_bytes=max_bytes)
    if isinstance(request, Rejected):
        return request.reply, request.reason
    if isinstance(request, LeaseRequest):
        reply, apply, _ = serve_lease_request(request, pending=lambda _: False, verify=None)
        assert apply == []
        return reply, None
    return b"REPLY", None


def as_error_reply(data: bytes) -> ErrorReply:
    return msgspec.msgpack.decode(data, type=ErrorReply)


def nested_unknown_field(type_: str, depth: int) -> bytes:
    """A valid envelope plus an extra field nested ``depth`` arrays deep (~depth bytes)."""
    head = encode({"type": type_, "protocol_version": PROTOCOL_VERSION})
    assert head[0] == 0x82  # fixmap of 2: bump it to 3 and append the extra field
    return b"\x83" + head[1:] + encode("x") + b"\x91" * depth + b"\xc0"


# --- requests ------------------------------------------------------------------


def test_request_round_trips() -> None:
    data = encode_request(ENGINE, "decode-7")
    assert decode_request(data, LIMIT) == MetadataRequest(
        protocol_version=PROTOCOL_VERSION, engine_id=ENGINE, consumer_engine_id="decode-7"
    )


def test_request_is_tagged_msgpack() -> None:
    assert msgspec.msgpack.decode(encode_request(ENGINE, "decode-7")) == {
        "type": "metadata_request",
        "protocol_version": PROTOCOL_VERSION,
        "engine_id": ENGINE,
        "consumer_engine_id": "decode-7",
    }


def test_request_of_another_version_becomes_an_unsupported_version_reply() -> None:
    data = encode({"type": "metadata_request", "protocol_version": PROTOCOL_VERSION + 1})
    reply = decode_request(data, LIMIT)
    assert isinstance(reply, ErrorReply)
    assert reply.code == "unsupported_version"
    assert reply.protocol_version == PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xc1garbage", "undecodable request"),
        (encode({"type": "metadata_request", "protocol_version": PROTOCOL_VERSION}), "invalid"),
        (encode(["metadata_request", PROTOCOL_VERSION]), "undecodable request"),
    ],
)
def test_undecodable_request_is_a_protocol_error(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_request(data, LIMIT)


def test_oversized_request_is_a_protocol_error() -> None:
    data = encode_request(ENGINE, "decode-7")
    assert isinstance(decode_request(data, len(data)), MetadataRequest)
    with pytest.raises(ProtocolError, match=f"over the {len(data) - 1}-byte limit"):
        decode_request(data, len(data) - 1)


# --- replies -------------------------------------------------------------------


def test_metadata_reply_round_trips() -> None:
    metadata = engine_metadata()
    assert decode(reply_bytes(metadata)) == metadata


def test_metadata_layout_describes_the_producer_cache() -> None:
    assert engine_metadata().layout() == KVLayout(
        base_addrs=(4096, 1 << 33),
        block_lens=(256, 256),
        num_blocks=16,
        dtype="torch.float16",
        kv_heads=2,
    )


def test_metadata_with_an_invalid_layout_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="invalid KV layout in metadata: num_blocks"):
        engine_metadata(num_blocks=0).layout()


def test_reply_of_another_protocol_version_is_incompatible() -> None:
    data = encode({"type": "metadata_reply", "protocol_version": PROTOCOL_VERSION + 1})
    with pytest.raises(
        IncompatibleEngineError, match=f"remote speaks protocol version {PROTOCOL_VERSION + 1}"
    ) as info:
        decode(data)
    assert info.value.engine_id == ENGINE


def test_reply_with_another_compatibility_hash_is_incompatible() -> None:
    other = compatibility_hash("model-b")
    with pytest.raises(IncompatibleEngineError, match="compatibility hash mismatch") as info:
        decode(reply_bytes(compat_hash=other))
    assert other[:12] in info.value.reason
    assert HASH[:12] in info.value.reason


def test_reply_from_another_engine_is_incompatible() -> None:
    data = reply_bytes(engine_metadata("prefill-1"))
    with pytest.raises(IncompatibleEngineError, match="'prefill-1', not 'prefill-0'"):
        decode(data)


@pytest.mark.parametrize("code", ["wrong_engine", "unsupported_version"])
def test_error_reply_about_compatibility_is_incompatible(code: Any) -> None:
    data = encode_message(error_reply(code, "no such luck"))
    with pytest.raises(IncompatibleEngineError, match=rf"remote refused \({code}\): no such luck"):
        decode(data)


def test_bad_request_error_reply_is_a_plain_handshake_error() -> None:
    data = encode_message(error_reply("bad_request", "what?"))
    with pytest.raises(HandshakeError, match=r"remote refused \(bad_request\): what\?") as info:
        decode(data)
    assert not isinstance(info.value, IncompatibleEngineError)


def test_error_reply_with_an_unknown_code_is_a_plain_handshake_error() -> None:
    data = encode(
        {"type": "error", "protocol_version": PROTOCOL_VERSION, "code": "teapot", "reason": "x"}
    )
    with pytest.raises(HandshakeError, match="invalid reply") as info:
        decode(data)
    assert not isinstance(info.value, IncompatibleEngineError)


def _inner(metadata: dict[str, Any]) -> bytes:
    return encode(
        {
            "type": "metadata_reply",
            "protocol_version": PROTOCOL_VERSION,
            "compatibility_hash": HASH,
            "engine_metadata": encode(metadata),
        }
    )


_GOOD_INNER: dict[str, Any] = msgspec.msgpack.decode(encode(engine_metadata()))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "undecodable reply"),
        (b"\xc1\xc1\xc1", "undecodable reply"),
        (b"\x92\x01\x02", "undecodable reply"),
        (
            encode({"type": "metadata_request", "protocol_version": PROTOCOL_VERSION}),
            "invalid reply",
        ),
        (
            encode(
                {
                    "type": "metadata_reply",
                    "protocol_version": PROTOCOL_VERSION,
                    "compatibility_hash": HASH,
                }
            ),
            "invalid reply",
        ),
        (_inner({**_GOOD_INNER, "num_blocks": "many"}), "invalid engine metadata"),
        (_inner({**_GOOD_INNER, "surprise": 1}), "invalid engine metadata"),
        (_inner({k: v for k, v in _GOOD_INNER.items() if k != "dtype"}), "invalid engine metadata"),
        (
            encode(
                {
                    "type": "metadata_reply",
                    "protocol_version": PROTOCOL_VERSION,
                    "compatibility_hash": HASH,
                    "engine_metadata": b"\xc1",
                }
            ),
            "invalid engine metadata",
        ),
    ],
)
def test_undecodable_reply_is_a_plain_handshake_error_naming_the_engine(
    data: bytes, match: str
) -> None:
    with pytest.raises(HandshakeError, match=match) as info:
        decode(data)
    assert not isinstance(info.value, IncompatibleEngineError)
    assert info.value.engine_id == ENGINE
    assert str(info.value).startswith(f"handshake with engine {ENGINE!r} failed: ")


def test_oversized_reply_is_a_plain_handshake_error() -> None:
    data = reply_bytes()
    assert decode(data, max_bytes=len(data)) == engine_metadata()
    with pytest.raises(HandshakeError, match="over the") as info:
        decode(data, max_bytes=len(data) - 1)
    assert not isinstance(info.value, IncompatibleEngineError)


@pytest.mark.parametrize(
    "data",
    [
        encode({"type": "metadata_reply", "protocol_version": 99}),
        reply_bytes(compat_hash="0" * 64),
        reply_bytes(engine_metadata("someone-else")),
        encode_message(error_reply("wrong_engine", "x")),
        b"\xc1",
    ],
)
def test_every_reply_error_names_the_expected_engine(data: bytes) -> None:
    with pytest.raises(HandshakeError) as info:
        decode(data, engine_id="decode-target-42")
    assert info.value.engine_id == "decode-target-42"
    assert "'decode-target-42'" in str(info.value)


# --- the listener's decision ----------------------------------------------------


def test_serve_valid_request_returns_the_encoded_reply() -> None:
    assert serve(encode_request(ENGINE, "decode-1")) == (b"REPLY", None)


@pytest.mark.parametrize(
    "data",
    [
        b"not msgpack at all \xc1",
        b"",
        encode({"type": "metadata_request", "protocol_version": PROTOCOL_VERSION}),
        encode({"type": "metadata_reply", "protocol_version": PROTOCOL_VERSION}),
        encode_message(error_reply("bad_request", "echo")),
    ],
)
def test_serve_garbage_answers_bad_request(data: bytes) -> None:
    reply, reason = serve(data)
    assert reason is not None
    error = as_error_reply(reply)
    assert error.code == "bad_request"
    assert error.reason == reason
    assert error.protocol_version == PROTOCOL_VERSION


def test_serve_request_for_another_engine_answers_wrong_engine() -> None:
    reply, reason = serve(encode_request("prefill-9", "decode-1"))
    assert reason == "this is engine 'prefill-0', not 'prefill-9'"
    assert as_error_reply(reply) == error_reply("wrong_engine", reason)


def test_serve_request_of_another_version_answers_unsupported_version() -> None:
    data = encode(
        {
            "type": "metadata_request",
            "protocol_version": PROTOCOL_VERSION + 1,
            "engine_id": ENGINE,
            "consumer_engine_id": "decode-1",
        }
    )
    reply, reason = serve(data)
    error = as_error_reply(reply)
    assert error.code == "unsupported_version"
    assert reason == error.reason
    assert reason is not None
    assert f"protocol version {PROTOCOL_VERSION + 1} requested" in reason


def test_serve_oversized_request_rejects_it() -> None:
    data = encode_request(ENGINE, "decode-1")
    assert serve(data, max_bytes=len(data)) == (b"REPLY", None)
    reply, reason = serve(data, max_bytes=len(data) - 1)
    assert reason is not None
    assert "over the" in reason
    assert as_error_reply(reply).code == "bad_request"


def test_wrong_engine_reply_decodes_as_incompatible_on_the_consumer() -> None:
    reply, _ = serve(encode_request("prefill-9", "decode-1"))
    with pytest.raises(IncompatibleEngineError, match="wrong_engine"):
        decode(reply, engine_id="prefill-9")


def test_serve_deeply_nested_request_answers_bad_request() -> None:
    data = nested_unknown_field("metadata_request", 100_000)
    assert len(data) < LIMIT
    reply, reason = serve(data)
    assert reason is not None
    assert as_error_reply(reply).code == "bad_request"


def test_deeply_nested_reply_is_a_handshake_error() -> None:
    data = nested_unknown_field("metadata_reply", 100_000)
    assert len(data) < LIMIT
    with pytest.raises(HandshakeError):
        decode(data)


# --- leases --------------------------------------------------------------------

ENTRIES = [
    LeaseEntry(request_id="r1", token="t" * 32, readers=1, abandon=False, incarnation="inc0"),
    LeaseEntry(request_id="日本", token="", readers=2, abandon=True),
    LeaseEntry(request_id="r2", token="", readers=1, abandon=True, pins=[1, 2**63 - 1]),
]


def lease_request(entries: list[LeaseEntry] = ENTRIES, engine_id: str = ENGINE) -> bytes:
    return encode_lease_request(engine_id, "decode-7", "decode-7#abc", entries)


GARBLED_PINS: list[object] = ["7", [1.5], [[1]], {"a": 1}, [True], [2**64 - 1], None]


def _lease_with_pins(pins: object) -> bytes:
    """An abandon whose ``pins`` are ``pins``, whatever they are."""
    entry = {"request_id": "r", "token": "", "readers": 1, "abandon": True, "pins": pins}
    return encode({**msgspec.msgpack.decode(lease_request()), "entries": [entry]})


def test_lease_request_round_trips() -> None:
    assert decode_request(lease_request(), LIMIT) == LeaseRequest(
        protocol_version=PROTOCOL_VERSION,
        engine_id=ENGINE,
        consumer_engine_id="decode-7",
        consumer_agent="decode-7#abc",
        entries=ENTRIES,
    )


def test_lease_request_is_tagged_msgpack() -> None:
    entry = {"request_id": "r1", "token": "t" * 32, "readers": 1, "abandon": False}
    assert msgspec.msgpack.decode(lease_request(ENTRIES[:1])) == {
        "type": "lease",
        "protocol_version": PROTOCOL_VERSION,
        "engine_id": ENGINE,
        "consumer_engine_id": "decode-7",
        "consumer_agent": "decode-7#abc",
        "entries": [{**entry, "incarnation": "inc0"}],
    }
    # An entry without an incarnation (a consumer that knows none) decodes too.
    data = encode({**msgspec.msgpack.decode(lease_request(ENTRIES[:1])), "entries": [entry]})
    request = decode_request(data, LIMIT)
    assert isinstance(request, LeaseRequest)
    assert request.entries[0].incarnation == ""
    assert request.entries[0].pins == []


def test_an_abandon_names_its_settled_reads_and_a_heartbeat_carries_no_pins_key() -> None:
    # (heartbeats are as they were: the key is only there when it names something)
    abandon = {"request_id": "r2", "token": "", "readers": 1, "abandon": True}
    entries = msgspec.msgpack.decode(lease_request(ENTRIES))["entries"]
    assert "pins" not in entries[0]
    assert entries[2] == {**abandon, "pins": [1, 2**63 - 1]}


def test_lease_reply_round_trips_and_is_tagged_msgpack() -> None:
    reply = LeaseReply(protocol_version=PROTOCOL_VERSION, unknown=[0], refused=[1, 2])
    data = encode_message(reply)
    assert decode_lease_reply(data, LIMIT) == reply
    assert msgspec.msgpack.decode(data) == {
        "type": "lease_reply",
        "protocol_version": PROTOCOL_VERSION,
        "unknown": [0],
        "refused": [1, 2],
    }


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xc1", "undecodable lease reply"),
        (encode({"type": "lease_reply", "protocol_version": 3}), "protocol version 3, local"),
        (encode({"type": "lease_reply", "protocol_version": PROTOCOL_VERSION}), "invalid"),
        (encode_message(error_reply("wrong_engine", "not me")), r"\(wrong_engine\): not me"),
        (reply_bytes(), "invalid lease reply"),
    ],
)
def test_a_bad_lease_reply_is_a_protocol_error(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_lease_reply(data, LIMIT)


def test_an_oversized_lease_reply_is_a_protocol_error() -> None:
    data = encode_message(LeaseReply(protocol_version=PROTOCOL_VERSION, unknown=[], refused=[]))
    with pytest.raises(ProtocolError, match="over the"):
        decode_lease_reply(data, len(data) - 1)


def test_serve_lease_request_applies_pending_entries_and_names_the_rest() -> None:
    entries = [
        LeaseEntry(request_id=rid, token=token, readers=1, abandon=rid == "gone")
        for rid, token in [("ok", "good"), ("gone", "good"), ("forged", "bad"), ("ok", "good")]
    ]
    request = parse_request(lease_request(entries), engine_id=ENGINE, max_bytes=LIMIT)
    assert isinstance(request, LeaseRequest)
    reply, apply, refused = serve_lease_request(
        request,
        pending=lambda rid: rid != "gone",
        verify=lambda entry: entry.token == "good",
    )
    assert decode_lease_reply(reply, LIMIT) == LeaseReply(
        protocol_version=PROTOCOL_VERSION, unknown=[1], refused=[2]
    )
    assert [e.request_id for e in apply] == ["ok", "ok"]
    assert refused == ["forged"]
    # Without a secret nothing is verified: every pending entry is applied.
    reply, apply, refused = serve_lease_request(request, pending=lambda _: True, verify=None)
    assert [e.request_id for e in apply] == ["ok", "gone", "forged", "ok"]
    assert (decode_lease_reply(reply, LIMIT).unknown, refused) == ([], [])


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (lease_request(engine_id="prefill-9"), "wrong_engine"),
        (lease_request([LeaseEntry("r", "", readers=0, abandon=True)]), "bad_request"),
        (lease_request([LeaseEntry("r", "", readers=-1, abandon=False)]), "bad_request"),
        # an abandon's list of settled READs: garbled, forged or too long
        (lease_request([LeaseEntry("r", "", 1, True, pins=[0])]), "bad_request"),
        (lease_request([LeaseEntry("r", "", 1, True, pins=[-5])]), "bad_request"),
        (lease_request([LeaseEntry("r", "", 1, True, pins=list(range(1, 66)))]), "bad_request"),
        *[(_lease_with_pins(pins), "bad_request") for pins in GARBLED_PINS],
        (encode({"type": "lease", "protocol_version": PROTOCOL_VERSION}), "bad_request"),
        (
            encode({"type": "lease", "protocol_version": 3, "engine_id": ENGINE, "entries": []}),
            "unsupported_version",
        ),
    ],
)
def test_a_lease_request_that_cannot_be_served_is_rejected(data: bytes, code: str) -> None:
    rejected = parse_request(data, engine_id=ENGINE, max_bytes=LIMIT)
    assert isinstance(rejected, Rejected)
    assert as_error_reply(rejected.reply).code == code
    assert as_error_reply(rejected.reply).reason == rejected.reason


# --- notifications -------------------------------------------------------------


@pytest.mark.parametrize("request_id", ["r1", "", "cmpl-é-日本", "a:b:c", "trio_pd:5:1:1:x"])
@pytest.mark.parametrize("readers", [1, 2, 16])
@pytest.mark.parametrize("nonce", [0, 1, 2**63 - 1])
def test_notification_round_trips(request_id: str, readers: int, nonce: int) -> None:
    message = encode_notification(request_id, readers, nonce)
    assert message.startswith(NOTIFICATION_PREFIX)
    assert decode_notification(message) == [(request_id, readers, nonce)]


def test_joined_notifications_carry_every_pull_in_order() -> None:
    pulls = [("r1", 1, 0), ("", 2, 5), ("a:7:b", 4, 0), ("日本", 1, 99)]
    message = join_notifications([encode_notification(r, n, x) for r, n, x in pulls])
    assert message.count(NOTIFICATION_PREFIX) == 1
    assert decode_notification(message) == pulls
    assert join_notifications([encode_notification("only")]) == encode_notification("only")


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"r1",
        b"trio_pd:5:",  # no entry
        b"trio_pd:2:1:r1",  # protocol version 2
        b"trio_pd:4:1:2:r1",  # protocol version 4 (no confirmations)
        b"trio_pd:5:r1",  # no readers count
        b"trio_pd:5:1:r1",  # no length
        b"trio_pd:5:0:2:r1",  # zero readers
        b"trio_pd:5:-1:2:r1",
        b"trio_pd:5:1:3:r1",  # shorter than its length
        b"trio_pd:5:1:2:r1x",  # trailing bytes that are not an entry
        b"trio_pd:5:1:2:r11:",  # a second entry cut short
        b"trio_pd:5:1/:2:r1",  # an empty nonce
        b"trio_pd:5:1/0:2:r1",  # a zero nonce (none is written without the slash)
        b"trio_pd:5:1/x:2:r1",
        b"trio_pd:5:/3:2:r1",  # no readers count
        b"xtrio_pd:5:1:2:r1",
        b"TRIO_PD:4:1:2:r1",
    ],
)
def test_foreign_notification_is_not_ours(message: bytes) -> None:
    assert decode_notification(message) is None


def test_notification_with_invalid_utf8_is_not_ours() -> None:
    assert decode_notification(NOTIFICATION_PREFIX + b"1:2:\xff\xfe") is None


def test_notification_ids_are_exact_not_prefixes_or_substrings() -> None:
    assert decode_notification(encode_notification("req-1")) == [("req-1", 1, 0)]
    assert decode_notification(encode_notification("req-10")) == [("req-10", 1, 0)]
    assert decode_notification(encode_notification("xreq-1x")) == [("xreq-1x", 1, 0)]
    assert decode_notification(encode_notification("req-1")) != [("req-10", 1, 0)]


# --- compatibility hash --------------------------------------------------------


def test_compatibility_hash_is_stable() -> None:
    # Pinned: peers of the same protocol version must agree on it across
    # releases (the version is part of the recipe: this is version 5's).
    assert compatibility_hash("model-a") == (
        "86397dfa82d333a3ecd03b66958fd63e9a088c3fdaa57f773ed6ce165bae1c1b"
    )
    assert compatibility_hash("model-a") == HASH


@pytest.mark.parametrize(("a", "b"), [("model-a", "model-b"), ("", " "), ("a\0b", "a"), ("", "x")])
def test_compatibility_hash_differs_for_different_keys(a: str, b: str) -> None:
    assert compatibility_hash(a) != compatibility_hash(b)


# --- properties ----------------------------------------------------------------

_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
    st.lists(st.integers(-5, 2**40), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=3),
)
# Each field is usually its valid value, else well-typed, anything, or absent.
_GOOD_FIELDS: dict[str, Any] = {
    "protocol_version": PROTOCOL_VERSION,
    "engine_id": ENGINE,
    "consumer_engine_id": "decode-0",
    "compatibility_hash": HASH,
    "engine_metadata": encode(_GOOD_INNER),
    "code": "wrong_engine",
    "reason": "r",
    "consumer_agent": "decode-0#a",
    "entries": [{"request_id": "r", "token": "", "readers": 1, "abandon": True}],
    "unknown": ["r"],
    "refused": [],
}
_TYPED_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "protocol_version": st.integers(-1, PROTOCOL_VERSION + 1),
    "engine_id": st.sampled_from([ENGINE, "prefill-1", ""]),
    "consumer_engine_id": st.text(max_size=10),
    "compatibility_hash": st.sampled_from([HASH, compatibility_hash("other")]),
    "engine_metadata": st.binary(max_size=20),
    "code": st.sampled_from(["bad_request", "unsupported_version", "wrong_engine", "x"]),
    "reason": st.text(max_size=10),
    "consumer_agent": st.text(max_size=10),
    "entries": st.lists(
        st.fixed_dictionaries(
            {
                "request_id": st.text(max_size=5),
                "token": st.text(max_size=5),
                "readers": st.integers(-1, 3),
                "abandon": st.booleans(),
            },
            optional={"incarnation": _values},
        ),
        max_size=3,
    ),
    "unknown": st.lists(st.text(max_size=5), max_size=2),
    "refused": st.lists(_values, max_size=2),
}
_modes = st.sampled_from(["good", "good", "good", "typed", "any", "absent"])


@st.composite
def _messages(draw: st.DrawFn) -> bytes:
    """An encoded dict with a message ``type`` and random, partly valid fields."""
    message: dict[str, Any] = {
        "type": draw(
            st.sampled_from(["metadata_reply", "metadata_request", "error", "lease", "lease_reply"])
        )
    }
    for name, good in _GOOD_FIELDS.items():
        mode = draw(_modes)
        if mode == "good":
            message[name] = good
        elif mode == "typed":
            message[name] = draw(_TYPED_FIELDS[name])
        elif mode == "any":
            message[name] = draw(_values)
    if message["type"] == "metadata_reply" and draw(st.booleans()):
        inner = dict(_GOOD_INNER)
        for name in draw(st.lists(st.sampled_from(sorted(inner)), unique=True, max_size=2)):
            inner[name] = draw(_values)
        message["engine_metadata"] = encode(inner)
    if draw(st.integers(0, 4)) == 0:
        message[draw(st.text(max_size=5))] = draw(_values)
    return encode(message)


_payloads = st.one_of(st.binary(max_size=200), _messages())
_limits = st.sampled_from([LIMIT, LIMIT, LIMIT, LIMIT, 48])


@settings(max_examples=200, deadline=None)
@given(data=_payloads, max_bytes=_limits)
def test_decode_reply_raises_only_handshake_errors(data: bytes, max_bytes: int) -> None:
    try:
        engine_id = decode(data, max_bytes=max_bytes).engine_id
    except HandshakeError as exc:
        engine_id = exc.engine_id
    assert engine_id == ENGINE


@settings(max_examples=200, deadline=None)
@given(data=_payloads, max_bytes=_limits)
def test_the_listener_decision_never_raises(data: bytes, max_bytes: int) -> None:
    reply, reason = serve(data, max_bytes=max_bytes)
    if reason is None:
        assert reply == b"REPLY" or decode_lease_reply(reply, LIMIT).unknown is not None
    else:
        error = as_error_reply(reply)
        assert error.reason == reason
        assert error.protocol_version == PROTOCOL_VERSION


@settings(max_examples=200, deadline=None)
@given(data=_payloads, max_bytes=_limits)
def test_decode_lease_reply_raises_only_protocol_errors(data: bytes, max_bytes: int) -> None:
    try:
        reply = decode_lease_reply(data, max_bytes)
    except ProtocolError:
        return
    assert all(isinstance(position, int) for position in [*reply.unknown, *reply.refused])
