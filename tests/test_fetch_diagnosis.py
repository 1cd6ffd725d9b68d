"""ConnectionLog: naming why a fetch got no reply, from socket monitor events (no I/O)."""

from __future__ import annotations

import pytest
import zmq

from trio_pd._side_channel._fetch import ConnectionLog

LIMIT = 65536

AUTH = zmq.EVENT_HANDSHAKE_FAILED_AUTH
PROTOCOL = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
NO_DETAIL = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
# Monitor messages carry plain ints, as parse_monitor_message returns them.
MISMATCH = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
OTHER_PROTOCOL_ERROR = int(zmq.PROTOCOL_ERROR_ZMTP_UNEXPECTED_COMMAND)

REFUSED = zmq.EVENT_CONNECT_RETRIED
HANDSHAKE = zmq.EVENT_HANDSHAKE_SUCCEEDED
DISCONNECTED = zmq.EVENT_DISCONNECTED

NON_FATAL_EVENTS = [
    zmq.EVENT_CONNECTED,
    zmq.EVENT_CONNECT_RETRIED,
    zmq.EVENT_HANDSHAKE_SUCCEEDED,
    zmq.EVENT_DISCONNECTED,
]


def log_of(*events: int | tuple[int, int]) -> ConnectionLog:
    """A log that recorded ``events`` (an event alone has value 0)."""
    log = ConnectionLog(max_reply_bytes=LIMIT)
    for item in events:
        event, value = item if isinstance(item, tuple) else (item, 0)
        log.record(event, value)
    return log


def test_an_empty_log_could_not_connect() -> None:
    log = log_of()
    assert (log.refused, log.tcp_connected, log.connected, log.dropped) == (0, 0, 0, 0)
    assert log.fatal is None
    assert log.diagnosis() == "could not connect"


TCP_ONLY = "the TCP connection was accepted, but the ZeroMQ handshake never completed"


def test_a_tcp_connect_without_a_handshake_is_not_counted_as_connected() -> None:
    # CONNECTED is the TCP connection; only a finished ZMTP handshake counts as connected.
    log = log_of(zmq.EVENT_CONNECTED, zmq.EVENT_CONNECTED)
    assert (log.tcp_connected, log.connected) == (2, 0)
    diagnosis = log.diagnosis()
    assert diagnosis.startswith(TCP_ONLY)
    assert "trio_pd side channel" in diagnosis


def test_a_drop_before_any_handshake_does_not_blame_the_reply_size_limit() -> None:
    # A peer that accepts TCP and closes on our greeting (not a ZeroMQ socket) never
    # sent a reply, so the size limit cannot be the cause.
    log = log_of(zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED)
    assert "byte limit" not in log.diagnosis()


def test_refused_connections_are_counted() -> None:
    log = log_of(*[zmq.EVENT_CONNECT_RETRIED] * 3)
    assert log.refused == 3
    assert log.diagnosis() == "connection refused (3 attempts)"


def test_connected_but_no_reply() -> None:
    log = log_of(zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert log.connected == 1
    assert log.diagnosis() == "connected, but the peer never replied"


def test_dropped_after_connect_names_the_reply_size_limit() -> None:
    log = log_of(zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED)
    assert log.dropped == 1
    diagnosis = log.diagnosis()
    assert "closed the connection 1 time(s)" in diagnosis
    assert f"{LIMIT}-byte limit" in diagnosis


def test_drops_accumulate_across_rounds() -> None:
    round_ = (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED)
    log = log_of(*round_, *round_, *round_)
    assert (log.connected, log.dropped) == (3, 3)
    assert "closed the connection 3 time(s)" in log.diagnosis()


def test_auth_failure_is_fatal_and_names_the_zap_status() -> None:
    log = log_of(zmq.EVENT_CONNECTED, (AUTH, 400))
    assert log.fatal is not None
    assert "ZAP status 400" in log.diagnosis()
    assert "allowlist" in log.diagnosis()
    assert log.ends_round(AUTH)


def test_mechanism_mismatch_is_named_as_such() -> None:
    log = log_of((PROTOCOL, MISMATCH))
    assert log.fatal is not None
    assert "security mechanism mismatch" in log.diagnosis()
    assert "CURVE" in log.diagnosis()
    assert log.ends_round(PROTOCOL)


def test_other_protocol_errors_are_fatal_and_give_the_code_in_hex() -> None:
    log = log_of((PROTOCOL, OTHER_PROTOCOL_ERROR))
    assert log.fatal is not None
    diagnosis = log.diagnosis()
    assert "mechanism mismatch" not in diagnosis
    assert f"protocol error {OTHER_PROTOCOL_ERROR:#x}" in diagnosis
    assert log.ends_round(PROTOCOL)


def test_handshake_failure_without_detail_suggests_a_wrong_server_key() -> None:
    log = ConnectionLog(max_reply_bytes=LIMIT, curve=True)
    log.record(NO_DETAIL, 0)
    assert log.fatal is not None
    assert "wrong producer key" in log.diagnosis()
    assert log.ends_round(NO_DETAIL)


def test_without_curve_a_handshake_failure_without_detail_is_a_closed_connection() -> None:
    # (no keys to mismatch: the peer closed the connection under the handshake,
    # e.g. it was exiting; found in the demo, where it was called a CURVE refusal)
    log = log_of(zmq.EVENT_CONNECTED, NO_DETAIL, zmq.EVENT_CONNECTED, NO_DETAIL)
    assert log.fatal is None
    assert not log.ends_round(NO_DETAIL)
    assert log.handshakes_lost == 2
    assert "closed during ZeroMQ's handshake 2 time(s)" in log.diagnosis()
    assert "CURVE" not in log.diagnosis()


@pytest.mark.parametrize("event", NON_FATAL_EVENTS)
def test_no_event_ends_a_fresh_round_except_a_fatal_one(event: int) -> None:
    log = ConnectionLog(max_reply_bytes=LIMIT)
    log.record(event, 0)
    assert not log.ends_round(event)


def test_a_disconnect_before_any_handshake_does_not_end_the_round() -> None:
    log = log_of(zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED)
    assert log.fatal is None
    assert not log.ends_round(zmq.EVENT_DISCONNECTED)


def test_a_disconnect_after_a_successful_handshake_ends_the_round() -> None:
    log = log_of(zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED)
    assert log.ends_round(zmq.EVENT_DISCONNECTED)


@pytest.mark.parametrize(
    "event", [zmq.EVENT_CONNECTED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_HANDSHAKE_SUCCEEDED]
)
def test_after_a_handshake_only_a_disconnect_ends_the_round(event: int) -> None:
    log = log_of(zmq.EVENT_HANDSHAKE_SUCCEEDED, event)
    assert not log.ends_round(event)


@pytest.mark.parametrize("event", NON_FATAL_EVENTS)
def test_once_fatal_every_event_ends_the_round(event: int) -> None:
    log = log_of((AUTH, 400), event)
    assert log.ends_round(event)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param(
            [REFUSED, HANDSHAKE, DISCONNECTED, (AUTH, 400)],
            "ZAP status 400",
            id="fatal beats dropped",
        ),
        pytest.param(
            [(AUTH, 400), zmq.EVENT_CONNECT_RETRIED],
            "ZAP status 400",
            id="fatal beats later refusals",
        ),
        pytest.param(
            [REFUSED, HANDSHAKE, DISCONNECTED, HANDSHAKE],
            f"{LIMIT}-byte limit",
            id="dropped beats connected",
        ),
        pytest.param(
            [zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_HANDSHAKE_SUCCEEDED],
            "connected, but the peer never replied",
            id="connected beats refused",
        ),
        pytest.param(
            [zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED],
            "connected, but the peer never replied",
            id="connected beats tcp-only",
        ),
        pytest.param(
            [zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECTED],
            TCP_ONLY,
            id="tcp-only beats refused",
        ),
        pytest.param(
            [zmq.EVENT_CONNECT_RETRIED],
            "connection refused (1 attempts)",
            id="refused beats could not connect",
        ),
    ],
)
def test_diagnosis_priority(events: list[int | tuple[int, int]], expected: str) -> None:
    assert expected in log_of(*events).diagnosis()


def test_the_latest_fatal_cause_wins() -> None:
    log = log_of((PROTOCOL, MISMATCH), (AUTH, 400))
    assert "ZAP status 400" in log.diagnosis()
    assert "mismatch" not in log.diagnosis()


def test_a_fetch_that_never_got_a_slot_says_so() -> None:
    log = ConnectionLog(max_reply_bytes=1024, waiting_for_slot=True)
    assert "max_concurrent_fetches" in log.diagnosis()
    assert "held back" not in log.diagnosis()
    held = ConnectionLog(max_reply_bytes=1024, waiting_for_slot=True, load_bytes_queued=17 << 20)
    assert "held back while 17.0 MiB of agent metadata waited for the load thread" in (
        held.diagnosis()
    )
