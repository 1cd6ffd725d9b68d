"""CURVE authentication: key validation, producer key lookup and ZAP verdicts (no I/O)."""

from __future__ import annotations

import pytest
import zmq
import zmq.utils.z85

from trio_pd._curve_keys import ANY_ENGINE, CurveAuth, generate_keypair
from trio_pd._side_channel._auth import zap_verdict

Z85_ALPHABET = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)

PUBLIC, SECRET = generate_keypair()
CONSUMER, _CONSUMER_SECRET = generate_keypair()
STRANGER, _STRANGER_SECRET = generate_keypair()
PRODUCER_A, _ = generate_keypair()
PRODUCER_ANY, _ = generate_keypair()

# 40 characters, but "~" is not in the Z85 alphabet.
NOT_Z85 = "~" * 40
# 40 Z85 characters whose 5-character groups exceed 2**32 - 1.
Z85_OVERFLOW = "#" * 40


def zap_request(public_key: str, mechanism: bytes = b"CURVE") -> list[bytes]:
    raw = zmq.utils.z85.decode(public_key.encode())
    return [b"1.0", b"7", b"trio_pd", b"127.0.0.1", b"", mechanism, raw]


# --- keys ------------------------------------------------------------------------------


def test_generated_keys_are_40_character_z85_and_differ() -> None:
    public, secret = generate_keypair()
    assert len(public) == len(secret) == 40
    assert set(public) <= Z85_ALPHABET
    assert set(secret) <= Z85_ALPHABET
    assert len(zmq.utils.z85.decode(public.encode())) == 32
    assert public != secret
    assert generate_keypair() != (public, secret)


def test_generated_keypair_is_accepted() -> None:
    auth = CurveAuth(public_key=PUBLIC, secret_key=SECRET)
    assert (auth.public_key, auth.secret_key) == (PUBLIC, SECRET)
    assert auth.allowed_consumers == frozenset()
    assert dict(auth.producer_keys) == {}


def test_a_public_key_that_does_not_match_the_secret_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="public_key does not belong to secret_key"):
        CurveAuth(public_key=CONSUMER, secret_key=SECRET)


@pytest.mark.parametrize(
    "bad", [PUBLIC[:-1], PUBLIC + "0", "", PUBLIC.encode()], ids=["short", "long", "empty", "bytes"]
)
def test_a_public_key_of_the_wrong_length_or_type_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="public_key must be a 40-character Z85 CURVE key"):
        CurveAuth(public_key=bad, secret_key=SECRET)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [SECRET[:-5], SECRET * 2], ids=["short", "long"])
def test_a_secret_key_of_the_wrong_length_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="secret_key must be a 40-character Z85 CURVE key"):
        CurveAuth(public_key=PUBLIC, secret_key=bad)


@pytest.mark.parametrize(
    "bad", [NOT_Z85, " " * 40, PUBLIC[:-1] + '"', "é" * 40], ids=["tilde", "space", "quote", "e"]
)
def test_a_public_key_with_non_z85_characters_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="public_key is not valid Z85"):
        CurveAuth(public_key=bad, secret_key=SECRET)


def test_a_secret_key_with_non_z85_characters_is_rejected() -> None:
    with pytest.raises(ValueError, match="secret_key is not valid Z85"):
        CurveAuth(public_key=PUBLIC, secret_key=NOT_Z85)


def test_a_z85_key_whose_groups_overflow_32_bits_is_rejected_as_invalid() -> None:
    with pytest.raises(ValueError, match="an allowed consumer key is not valid Z85"):
        CurveAuth(public_key=PUBLIC, secret_key=SECRET, allowed_consumers=[Z85_OVERFLOW])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (CONSUMER[:-1], "an allowed consumer key must be a 40-character Z85 CURVE key"),
        (NOT_Z85, "an allowed consumer key is not valid Z85"),
    ],
    ids=["length", "alphabet"],
)
def test_a_malformed_allowed_consumer_key_is_rejected(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CurveAuth(public_key=PUBLIC, secret_key=SECRET, allowed_consumers=[CONSUMER, bad])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (PRODUCER_A + "x", "the producer key of 'prefill-7' must be a 40-character Z85"),
        (NOT_Z85, "the producer key of 'prefill-7' is not valid Z85"),
    ],
    ids=["length", "alphabet"],
)
def test_a_malformed_producer_key_is_rejected_naming_the_engine(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CurveAuth(
            public_key=PUBLIC,
            secret_key=SECRET,
            producer_keys={"prefill-0": PRODUCER_A, "prefill-7": bad},
        )


def test_allowed_consumers_are_frozen() -> None:
    auth = CurveAuth(public_key=PUBLIC, secret_key=SECRET, allowed_consumers=[CONSUMER, CONSUMER])
    assert auth.allowed_consumers == frozenset({CONSUMER})


def test_producer_keys_are_copied_and_read_only() -> None:
    keys = {"prefill-0": PRODUCER_A}
    auth = CurveAuth(public_key=PUBLIC, secret_key=SECRET, producer_keys=keys)
    keys["prefill-0"] = PRODUCER_ANY
    assert auth.producer_key("prefill-0") == PRODUCER_A
    with pytest.raises(TypeError):
        auth.producer_keys["prefill-1"] = PRODUCER_ANY  # type: ignore[index]


def test_producer_key_is_looked_up_by_engine_id_then_falls_back_to_any() -> None:
    auth = CurveAuth(
        public_key=PUBLIC,
        secret_key=SECRET,
        producer_keys={"prefill-0": PRODUCER_A, ANY_ENGINE: PRODUCER_ANY},
    )
    assert ANY_ENGINE == "*"
    assert auth.producer_key("prefill-0") == PRODUCER_A
    assert auth.producer_key("prefill-9") == PRODUCER_ANY


def test_producer_key_of_an_unknown_engine_without_a_wildcard_is_none() -> None:
    auth = CurveAuth(public_key=PUBLIC, secret_key=SECRET, producer_keys={"prefill-0": PRODUCER_A})
    assert auth.producer_key("prefill-0") == PRODUCER_A
    assert auth.producer_key("prefill-9") is None


def test_the_secret_key_is_not_in_the_repr() -> None:
    auth = CurveAuth(public_key=PUBLIC, secret_key=SECRET, allowed_consumers=[CONSUMER])
    text = repr(auth)
    assert PUBLIC in text
    assert SECRET not in text


# --- ZAP -------------------------------------------------------------------------------


def test_an_allowed_curve_key_is_admitted_as_that_user() -> None:
    reply, refusal = zap_verdict(zap_request(CONSUMER), frozenset({CONSUMER}))
    assert refusal is None
    assert reply == [b"1.0", b"7", b"200", b"OK", CONSUMER.encode(), b""]


def test_an_unknown_curve_key_is_refused_naming_the_key_and_address() -> None:
    reply, refusal = zap_verdict(zap_request(STRANGER), frozenset({CONSUMER}))
    assert len(reply) == 6
    assert reply[:3] == [b"1.0", b"7", b"400"]
    assert reply[4] == b""
    assert refusal is not None
    assert STRANGER in refusal
    assert "127.0.0.1" in refusal


def test_with_no_allowed_consumers_nobody_is_admitted() -> None:
    reply, refusal = zap_verdict(zap_request(CONSUMER), frozenset())
    assert reply[2] == b"400"
    assert refusal is not None


def test_a_null_mechanism_is_refused() -> None:
    frames = [b"1.0", b"7", b"trio_pd", b"127.0.0.1", b"", b"NULL"]
    reply, refusal = zap_verdict(frames, frozenset({CONSUMER}))
    assert reply[:3] == [b"1.0", b"7", b"400"]
    assert len(reply) == 6
    assert refusal is not None
    assert "NULL" in refusal


def test_a_plain_mechanism_with_an_allowed_key_as_password_is_refused() -> None:
    raw = zmq.utils.z85.decode(CONSUMER.encode())
    frames = [b"1.0", b"7", b"trio_pd", b"127.0.0.1", b"", b"PLAIN", raw]
    reply, refusal = zap_verdict(frames, frozenset({CONSUMER}))
    assert reply[2] == b"400"
    assert reply[4] == b""
    assert refusal is not None


@pytest.mark.parametrize(
    "credentials",
    [[], [b"\x00" * 31], [b"\x00" * 33], [b"\x00" * 32, b"extra"]],
    ids=["none", "short", "long", "two"],
)
def test_curve_with_malformed_credentials_is_refused(credentials: list[bytes]) -> None:
    frames = [b"1.0", b"7", b"trio_pd", b"127.0.0.1", b"", b"CURVE", *credentials]
    reply, refusal = zap_verdict(frames, frozenset({CONSUMER}))
    assert reply[2] == b"400"
    assert refusal is not None


@pytest.mark.parametrize("count", range(6))
def test_a_malformed_request_still_gets_a_six_frame_500_reply(count: int) -> None:
    frames = zap_request(CONSUMER)[:count]
    reply, refusal = zap_verdict(frames, frozenset({CONSUMER}))
    assert len(reply) == 6
    assert reply[2] == b"500"
    assert refusal is not None
    assert "malformed" in refusal


def test_the_reply_echoes_the_version_and_request_id() -> None:
    frames = zap_request(CONSUMER)
    frames[1] = b"request-42"
    reply, _ = zap_verdict(frames, frozenset({CONSUMER}))
    assert reply[:2] == [b"1.0", b"request-42"]
