"""The remote-engine state machine: its table and the record that follows it (no I/O)."""

from __future__ import annotations

import itertools

import pytest

from trio_pd._engines import (
    HANDSHAKE_STARTING,
    TRANSITIONS,
    EngineEvent,
    EngineRecord,
    EngineState,
    InvalidTransition,
)
from trio_pd._errors import HandshakeError
from trio_pd._protocol import EngineMetadata

S, E = EngineState, EngineEvent

METADATA = EngineMetadata(
    engine_id="prefill-0",
    incarnation="1",
    agent_name="agent",
    agent_metadata=b"md",
    num_blocks=4,
    base_addrs=[0],
    block_lens=[16],
    device_id=0,
    mem_type="DRAM",
    dtype="torch.uint8",
)
LAYOUT = METADATA.layout()

NOT_IN_TABLE = [
    pair for pair in itertools.product(EngineState, EngineEvent) if pair not in TRANSITIONS
]


def record(state: EngineState = S.UNKNOWN) -> EngineRecord:
    return EngineRecord(engine_id="prefill-0", host="127.0.0.1", port=5555, state=state)


def test_new_record_is_unknown_with_nothing_known() -> None:
    rec = EngineRecord(engine_id="e", host="h", port=1)
    assert (rec.state, rec.error, rec.metadata, rec.layout, rec.attempts) == (
        S.UNKNOWN,
        None,
        None,
        None,
        0,
    )


@pytest.mark.parametrize(("pair", "target"), sorted(TRANSITIONS.items(), key=str))
def test_every_transition_in_the_table_applies(
    pair: tuple[EngineState, EngineEvent], target: EngineState
) -> None:
    state, event = pair
    rec = record(state)
    assert rec.apply(event) is target
    assert rec.state is target


def test_the_table_leaves_some_pairs_out() -> None:
    # Guards the next test against an empty parametrization.
    assert (S.READY, E.PULL_REQUESTED) in NOT_IN_TABLE
    assert (S.CLOSED, E.CONNECTOR_CLOSED) in NOT_IN_TABLE


@pytest.mark.parametrize(("state", "event"), NOT_IN_TABLE, ids=str)
def test_every_pair_not_in_the_table_is_an_invalid_transition(
    state: EngineState, event: EngineEvent
) -> None:
    rec = record(state)
    rec.attempts = 3
    with pytest.raises(InvalidTransition) as info:
        rec.apply(event)
    message = str(info.value)
    assert "'prefill-0'" in message
    assert repr(event.value) in message
    assert repr(state.value) in message
    assert (rec.state, rec.attempts) == (state, 3)


def test_handshake_starts_from_unknown_or_failed_only() -> None:
    assert frozenset({S.UNKNOWN, S.FAILED}) == HANDSHAKE_STARTING


@pytest.mark.parametrize("state", [s for s in EngineState if s is not S.CLOSED])
def test_connector_closed_is_reachable_from_every_open_state(state: EngineState) -> None:
    assert TRANSITIONS[state, E.CONNECTOR_CLOSED] is S.CLOSED


def test_closed_is_terminal() -> None:
    assert not any(state is S.CLOSED for state, _event in TRANSITIONS)


def test_attempts_count_pull_requested_transitions() -> None:
    rec = record()
    rec.apply(E.PULL_REQUESTED)
    assert rec.attempts == 1
    rec.apply(E.FAILED)
    assert rec.attempts == 1
    rec.apply(E.PULL_REQUESTED)
    rec.apply(E.METADATA_RECEIVED)
    rec.apply(E.LOADED)
    rec.apply(E.CONNECTOR_CLOSED)
    assert rec.attempts == 2


def test_a_new_attempt_clears_the_last_error() -> None:
    rec = record(S.FETCHING)
    rec.failed(HandshakeError("prefill-0", "boom"))
    assert rec.error is not None
    rec.apply(E.PULL_REQUESTED)
    assert rec.error is None


def test_metadata_received_stores_metadata_and_layout() -> None:
    rec = record(S.FETCHING)
    rec.metadata_received(METADATA, LAYOUT)
    assert (rec.state, rec.metadata, rec.layout) == (S.LOADING, METADATA, LAYOUT)


def test_metadata_received_in_the_wrong_state_stores_nothing() -> None:
    rec = record(S.UNKNOWN)
    with pytest.raises(InvalidTransition):
        rec.metadata_received(METADATA, LAYOUT)
    assert (rec.metadata, rec.layout) == (None, None)


def test_failed_stores_the_error_and_clears_metadata() -> None:
    rec = record(S.FETCHING)
    rec.metadata_received(METADATA, LAYOUT)
    error = HandshakeError("prefill-0", "NIXL said no")
    rec.failed(error)
    assert rec.state is S.FAILED
    assert rec.error is error
    assert (rec.metadata, rec.layout) == (None, None)


def test_failed_in_the_wrong_state_keeps_the_record() -> None:
    rec = record(S.READY)
    rec.metadata, rec.layout = METADATA, LAYOUT
    with pytest.raises(InvalidTransition):
        rec.failed(HandshakeError("prefill-0", "late"))
    assert (rec.state, rec.error, rec.metadata) == (S.READY, None, METADATA)
