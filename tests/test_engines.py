"""The remote-engine state machine: its table, the record that follows it, and backoff (no I/O)."""

from __future__ import annotations

import itertools
import random

import attrs
import msgspec
import pytest

from trio_pd._core._errors import HandshakeError
from trio_pd._core._protocol import EngineMetadata
from trio_pd._core._remote_engine import (
    RETIRED_INCARNATIONS_KEPT,
    TRANSITIONS,
    Backoff,
    EngineEvent,
    EngineRecord,
    EngineState,
    InvalidTransition,
    MetadataOutcome,
    PullAction,
)

S, E = EngineState, EngineEvent

METADATA = EngineMetadata(
    engine_id="prefill-0",
    incarnation="incarnation-1",
    agent_name="agent",
    agent_metadata=b"md",
    num_blocks=4,
    base_addrs=[0],
    block_lens=[16],
    device_id=0,
    mem_type="DRAM",
    dtype="torch.uint8",
    kv_heads=0,
    tp_rank=0,
    tp_size=1,
)

NOT_IN_TABLE = [
    pair for pair in itertools.product(EngineState, EngineEvent) if pair not in TRANSITIONS
]

# Backoff with no jitter: delays are exactly min(maximum, initial * 2**(n-1)).
EXACT = Backoff(initial=1.0, maximum=30.0, jitter=0.0)


def record(state: EngineState = S.UNKNOWN, **fields: object) -> EngineRecord:
    return EngineRecord(
        engine_id="prefill-0",
        host="127.0.0.1",
        port=5555,
        state=state,
        **fields,  # type: ignore[arg-type]
    )


def pull(rec: EngineRecord, now: float, incarnation: str = "") -> PullAction:
    """A pull for blocks of ``incarnation`` at the record's own address."""
    return rec.on_pull(incarnation, now)


def error(reason: str = "boom") -> HandshakeError:
    return HandshakeError("prefill-0", reason)


def snapshot(rec: EngineRecord) -> dict[str, object]:
    return attrs.asdict(rec, recurse=False)


# --- the table -------------------------------------------------------------------------


def test_new_record_is_unknown_with_nothing_known() -> None:
    rec = EngineRecord(engine_id="e", host="h", port=1)
    assert (rec.state, rec.error, rec.incarnation) == (S.UNKNOWN, None, None)
    assert (rec.attempts, rec.failures, rec.retry_at) == (0, 0, 0.0)


@pytest.mark.parametrize(("pair", "target"), sorted(TRANSITIONS.items(), key=str), ids=str)
def test_every_transition_in_the_table_applies(
    pair: tuple[EngineState, EngineEvent], target: EngineState
) -> None:
    state, event = pair
    rec = record(state)
    assert rec.apply(event) is target
    assert rec.state is target


def test_the_table_leaves_some_pairs_out() -> None:
    # Guards the next test against an empty parametrization.
    assert (S.READY, E.PULL) in NOT_IN_TABLE
    assert (S.CLOSED, E.CONNECTOR_CLOSED) in NOT_IN_TABLE
    assert (S.BACKOFF, E.PULL) in NOT_IN_TABLE


@pytest.mark.parametrize(("state", "event"), NOT_IN_TABLE, ids=str)
def test_every_pair_not_in_the_table_is_an_invalid_transition(
    state: EngineState, event: EngineEvent
) -> None:
    rec = record(state, attempts=3, failures=2, retry_at=7.5, error=error())
    before = snapshot(rec)
    with pytest.raises(InvalidTransition) as info:
        rec.apply(event)
    message = str(info.value)
    assert "'prefill-0'" in message
    assert repr(event.value) in message
    assert repr(state.value) in message
    assert snapshot(rec) == before


@pytest.mark.parametrize("state", [s for s in EngineState if s is not S.CLOSED], ids=str)
def test_connector_closed_is_reachable_from_every_open_state(state: EngineState) -> None:
    rec = record(state)
    assert rec.apply(E.CONNECTOR_CLOSED) is S.CLOSED


def test_closed_is_terminal() -> None:
    assert not any(state is S.CLOSED for state, _event in TRANSITIONS)


def test_failed_state_no_longer_exists() -> None:
    assert "FAILED" not in EngineState.__members__
    assert {"BACKOFF", "STALE"} <= set(EngineState.__members__)


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.UNKNOWN, E.PULL),
        (S.STALE, E.PULL),
        (S.BACKOFF, E.PULL_AFTER_BACKOFF),
        (S.READY, E.INCARNATION_MISMATCH),
    ],
    ids=str,
)
def test_entering_fetching_or_verifying_counts_an_attempt(
    state: EngineState, event: EngineEvent
) -> None:
    rec = record(state, attempts=4)
    rec.apply(event)
    assert rec.attempts == 5


@pytest.mark.parametrize(
    ("pair", "target"),
    [
        (pair, target)
        for pair, target in TRANSITIONS.items()
        if target not in (S.FETCHING, S.VERIFYING)
    ],
    ids=str,
)
def test_other_transitions_do_not_count_an_attempt(
    pair: tuple[EngineState, EngineEvent], target: EngineState
) -> None:
    state, event = pair
    rec = record(state, attempts=4)
    rec.apply(event)
    assert rec.attempts == 4


# --- on_pull ---------------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.UNKNOWN, S.STALE], ids=str)
def test_pull_from_unknown_or_stale_starts_a_handshake(state: EngineState) -> None:
    rec = record(state, attempts=1)
    assert pull(rec, 10.0) is PullAction.START
    assert rec.state is S.FETCHING
    assert rec.attempts == 2


@pytest.mark.parametrize("state", [S.FETCHING, S.LOADING], ids=str)
def test_pull_while_an_attempt_is_in_progress_waits(state: EngineState) -> None:
    rec = record(state, attempts=1)
    before = snapshot(rec)
    assert pull(rec, 10.0) is PullAction.WAIT
    assert snapshot(rec) == before


@pytest.mark.parametrize("incarnation", ["", "incarnation-1"])
def test_pull_to_a_ready_engine_of_its_incarnation_goes_ahead(incarnation: str) -> None:
    rec = record(S.READY, attempts=1, incarnation="incarnation-1", epoch="incarnation-1")
    before = snapshot(rec)
    assert pull(rec, 10.0, incarnation) is PullAction.READY
    assert snapshot(rec) == before


def test_pull_before_retry_at_fails_fast_and_stays_in_backoff() -> None:
    rec = record(S.BACKOFF, attempts=1, failures=1, retry_at=10.0, error=error())
    assert pull(rec, 9.999) is PullAction.FAIL_FAST
    assert rec.state is S.BACKOFF
    assert (rec.attempts, rec.failures, rec.retry_at) == (1, 1, 10.0)
    assert rec.error is not None


@pytest.mark.parametrize("now", [10.0, 10.001, 100.0])
def test_pull_at_or_after_retry_at_starts_a_new_attempt(now: float) -> None:
    rec = record(S.BACKOFF, attempts=1, failures=1, retry_at=10.0, error=error())
    assert pull(rec, now) is PullAction.START
    assert rec.state is S.FETCHING
    assert rec.attempts == 2


def test_repeated_pulls_during_backoff_keep_failing_fast_until_retry_at() -> None:
    rec = record(S.FETCHING, attempts=1)
    delay = rec.failed(error(), now=0.0, backoff=EXACT, rng=random.Random(0))
    assert delay == 1.0
    actions = [pull(rec, t) for t in (0.0, 0.5, 0.99)]
    assert actions == [PullAction.FAIL_FAST] * 3
    assert pull(rec, 1.0) is PullAction.START
    assert pull(rec, 1.0) is PullAction.WAIT
    assert rec.attempts == 2


# --- metadata_received, loaded, failed -------------------------------------------------


def test_incarnation_is_none_before_metadata() -> None:
    rec = record(S.FETCHING)
    assert rec.incarnation is None


def test_metadata_received_keeps_the_incarnation() -> None:
    rec = record(S.FETCHING)
    rec.metadata_received(METADATA)
    assert (rec.state, rec.incarnation) == (S.LOADING, "incarnation-1")


def test_metadata_received_in_the_wrong_state_stores_nothing() -> None:
    rec = record(S.UNKNOWN)
    with pytest.raises(InvalidTransition):
        rec.metadata_received(METADATA)
    assert (rec.state, rec.incarnation) == (S.UNKNOWN, None)


@pytest.mark.parametrize("state", [S.FETCHING, S.LOADING], ids=str)
def test_failed_stores_the_error_clears_metadata_and_schedules_a_retry(
    state: EngineState,
) -> None:
    rec = record(state, incarnation="incarnation-1", failures=2)
    err = error("NIXL said no")
    delay = rec.failed(err, now=100.0, backoff=Backoff(), rng=random.Random(1))
    assert rec.state is S.BACKOFF
    assert rec.error is err
    assert rec.incarnation is None
    assert rec.failures == 3
    assert rec.retry_at == 100.0 + delay
    # The third consecutive failure waits about 4 s (initial 1 s, doubled twice).
    assert 4.0 * (1 - 0.2) <= delay <= 4.0


def test_failed_returns_the_backoff_delay_for_the_failure_count() -> None:
    rng_a, rng_b = random.Random(5), random.Random(5)
    backoff = Backoff(initial=0.5, maximum=10.0, jitter=0.3)
    rec = record(S.FETCHING, failures=3)
    delay = rec.failed(error(), now=0.0, backoff=backoff, rng=rng_a)
    assert delay == backoff.delay(4, rng_b)


def test_failed_in_the_wrong_state_keeps_the_record() -> None:
    rec = record(S.READY, incarnation="incarnation-1")
    before = snapshot(rec)
    with pytest.raises(InvalidTransition):
        rec.failed(error("late"), now=1.0, backoff=EXACT, rng=random.Random(0))
    assert snapshot(rec) == before


def test_consecutive_failures_double_the_delay() -> None:
    rec = record()
    delays = []
    now = 0.0
    for _ in range(4):
        assert pull(rec, now) is PullAction.START
        delays.append(rec.failed(error(), now=now, backoff=EXACT, rng=random.Random(0)))
        now = rec.retry_at
    assert delays == [1.0, 2.0, 4.0, 8.0]
    assert (rec.failures, rec.attempts) == (4, 4)


def test_loaded_makes_the_engine_ready_and_resets_failures_and_error() -> None:
    rec = record(S.FETCHING, failures=3, error=error())
    rec.metadata_received(METADATA)
    rec.loaded()
    assert rec.state is S.READY
    assert (rec.failures, rec.error) == (0, None)
    assert rec.incarnation == "incarnation-1"


def test_after_success_the_next_failure_starts_backoff_afresh() -> None:
    rec = record()
    pull(rec, 0.0)
    rec.failed(error(), now=0.0, backoff=EXACT, rng=random.Random(0))
    pull(rec, rec.retry_at)
    rec.failed(error(), now=1.0, backoff=EXACT, rng=random.Random(0))
    assert rec.failures == 2
    pull(rec, rec.retry_at)
    rec.metadata_received(METADATA)
    rec.loaded()
    rec.apply(E.PEER_DISCONNECTED)
    assert pull(rec, 10.0) is PullAction.START
    assert rec.failed(error(), now=10.0, backoff=EXACT, rng=random.Random(0)) == 1.0
    assert rec.failures == 1


def test_loaded_in_the_wrong_state_keeps_failures_and_error() -> None:
    err = error()
    rec = record(S.BACKOFF, failures=2, error=err, retry_at=5.0)
    with pytest.raises(InvalidTransition):
        rec.loaded()
    assert (rec.state, rec.failures, rec.error) == (S.BACKOFF, 2, err)


@pytest.mark.parametrize("event", [E.PEER_DISCONNECTED], ids=str)
def test_a_ready_engine_whose_peer_goes_away_becomes_stale_then_restarts(
    event: EngineEvent,
) -> None:
    rec = record(S.READY, attempts=1, incarnation="incarnation-1")
    rec.apply(event)
    assert rec.state is S.STALE
    assert pull(rec, 0.0) is PullAction.START
    assert (rec.state, rec.attempts) == (S.FETCHING, 2)


# --- the whole policy: a pull's incarnation and address, races -------------------------

OLD, NEW = "incarnation-1", "incarnation-2"


def metadata(incarnation: str) -> EngineMetadata:
    return msgspec.structs.replace(
        METADATA, incarnation=incarnation, agent_name=f"agent#{incarnation}"
    )


def ready(incarnation: str = OLD) -> EngineRecord:
    """A record that handshook once and loaded ``incarnation``."""
    rec = record()
    assert pull(rec, 0.0, incarnation) is PullAction.START
    rec.metadata_received(metadata(incarnation))
    rec.loaded()
    return rec


def test_another_incarnation_in_a_request_verifies_without_retiring_the_loaded_one() -> None:
    rec = ready(OLD)
    assert pull(rec, 1.0, NEW) is PullAction.VERIFY
    assert (rec.state, rec.attempts) == (S.VERIFYING, 2)
    assert rec.retired_incarnations == {}
    # Meanwhile: requests of the loaded incarnation go on, others wait.
    assert pull(rec, 1.0, OLD) is PullAction.READY
    assert pull(rec, 1.0) is PullAction.READY
    assert pull(rec, 1.0, NEW) is PullAction.WAIT
    assert pull(rec, 1.0, "third") is PullAction.WAIT


def test_the_engine_answering_with_a_new_incarnation_retires_the_loaded_one() -> None:
    rec = ready(OLD)
    pull(rec, 1.0, NEW)
    assert rec.metadata_received(metadata(NEW)) is MetadataOutcome.RESTARTED
    assert rec.state is S.LOADING
    assert list(rec.retired_incarnations) == [OLD]
    assert pull(rec, 1.0, OLD) is PullAction.GONE
    assert pull(rec, 1.0, NEW) is PullAction.WAIT
    rec.loaded()
    assert pull(rec, 2.0, NEW) is PullAction.READY
    reason = rec.why_gone(OLD)
    assert "runs incarnation incarnation-2, not incarnation-1" in reason


def test_the_engine_answering_with_the_loaded_incarnation_refutes_the_request() -> None:
    # A forged (or garbled) incarnation: the engine still runs OLD. The
    # loaded agent was never out of service; the claim fails its request.
    rec = ready(OLD)
    assert pull(rec, 1.0, "forged") is PullAction.VERIFY
    assert rec.metadata_received(metadata(OLD)) is MetadataOutcome.SAME
    assert rec.state is S.READY
    assert pull(rec, 1.0, "forged") is PullAction.GONE
    assert pull(rec, 1.0, OLD) is PullAction.READY
    assert "runs incarnation incarnation-1, not forged" in rec.why_gone("forged")


def test_at_most_one_verification_per_interval_however_many_claims() -> None:
    rec = ready(OLD)
    rec.verify_interval = 1.0
    assert pull(rec, 1.0, "forged-1") is PullAction.VERIFY
    rec.metadata_received(metadata(OLD))
    # New values within the interval: no handshake; they wait for the next
    # interval (the engine may restart meanwhile). The refuted one is gone.
    for n in range(2, 50):
        assert pull(rec, 1.5, f"forged-{n}") is PullAction.DEFER
    assert pull(rec, 1.5, "forged-1") is PullAction.GONE
    assert rec.attempts == 2
    assert pull(rec, 2.0, "forged-99") is PullAction.VERIFY  # the next interval


def test_a_verification_without_an_answer_keeps_the_agent_and_fails_the_claims_fast() -> None:
    rec = ready(OLD)
    pull(rec, 1.0, NEW)
    err = error("no reply")
    rec.verification_failed(err)
    assert rec.state is S.READY
    assert rec.attempt_error(2) is None  # (waiters ask on_pull again)
    assert pull(rec, 1.2, NEW) is PullAction.FAIL_FAST
    assert rec.fail_fast_error() is err
    assert pull(rec, 1.2, OLD) is PullAction.READY
    assert pull(rec, 2.5, NEW) is PullAction.VERIFY  # asked again after the interval


def test_a_peer_lost_during_a_verification_makes_the_engine_stale() -> None:
    rec = ready(OLD)
    pull(rec, 1.0, NEW)
    assert rec.on_peer_lost(OLD) is True
    assert rec.state is S.STALE
    assert pull(rec, 1.0, NEW) is PullAction.START


def test_retired_incarnations_are_bounded() -> None:
    rec = ready(OLD)
    rec.verify_interval = 0.0
    for n in range(RETIRED_INCARNATIONS_KEPT + 10):
        assert pull(rec, float(n), f"forged-{n}") is PullAction.VERIFY
        rec.metadata_received(metadata(OLD))
    assert len(rec.retired_incarnations) == RETIRED_INCARNATIONS_KEPT


def test_restart_during_a_handshake_loads_the_old_one_then_the_request_verifies() -> None:
    # A handshake started for a request without an incarnation loads OLD; a
    # request of NEW arrived while it ran and waited on it. When it wakes,
    # the table says: verify; the engine answers NEW: load it.
    rec = record()
    assert pull(rec, 0.0) is PullAction.START
    assert pull(rec, 0.0, NEW) is PullAction.WAIT
    rec.metadata_received(metadata(OLD))
    rec.loaded()
    assert rec.attempt_error(1) is None  # the waiter's attempt succeeded: ask again
    assert pull(rec, 0.1, NEW) is PullAction.VERIFY
    assert rec.metadata_received(metadata(NEW)) is MetadataOutcome.RESTARTED
    rec.loaded()
    assert pull(rec, 0.2, NEW) is PullAction.READY
    assert list(rec.retired_incarnations) == [OLD]


def test_a_request_of_an_incarnation_that_no_handshake_finds_is_gone_not_retried() -> None:
    # The engine restarted before we ever saw it: the request names OLD, the
    # handshake it started finds NEW. OLD is retired, not handshaken again.
    rec = record()
    assert pull(rec, 0.0, OLD) is PullAction.START
    rec.metadata_received(metadata(NEW))
    rec.loaded()
    assert pull(rec, 0.1, OLD) is PullAction.GONE
    assert rec.attempts == 1


def test_a_verification_between_handshake_and_wake_up_lets_the_waiter_go_on() -> None:
    # Attempt 1 succeeds; before its waiter runs, another pull names NEW and
    # starts a verification. The waiter (no incarnation) reads at once.
    rec = record()
    pull(rec, 0.0)
    rec.metadata_received(metadata(OLD))
    rec.loaded()
    assert pull(rec, 0.0, NEW) is PullAction.VERIFY
    assert rec.attempt_error(1) is None
    assert pull(rec, 0.0) is PullAction.READY
    assert rec.attempts == 2


def test_a_waiter_of_a_failed_attempt_gets_its_error_a_later_attempt_does_not() -> None:
    rec = record()
    pull(rec, 0.0)
    err = error("no reply")
    rec.failed(err, now=1.0, backoff=EXACT, rng=random.Random(0))
    assert rec.attempt_error(1) is err
    assert pull(rec, 2.0) is PullAction.START  # backoff over: attempt 2
    assert rec.attempt_error(1) is None


def test_a_lost_peer_retires_the_agent_but_not_its_incarnation() -> None:
    rec = ready(OLD)
    assert rec.on_peer_lost(OLD) is True
    assert rec.state is S.STALE
    assert rec.on_peer_lost(OLD) is False  # the second pull to notice does nothing
    # The next request of OLD handshakes again; if OLD answers, it reads.
    assert pull(rec, 1.0, OLD) is PullAction.START
    rec.metadata_received(metadata(OLD))
    rec.loaded()
    assert pull(rec, 1.0, OLD) is PullAction.READY
    assert rec.retired_incarnations == {}


def test_a_lost_peer_that_comes_back_restarted_makes_old_requests_gone() -> None:
    rec = ready(OLD)
    rec.on_peer_lost(OLD)
    assert pull(rec, 1.0, OLD) is PullAction.START
    rec.metadata_received(metadata(NEW))
    rec.loaded()
    assert pull(rec, 1.0, OLD) is PullAction.GONE
    assert pull(rec, 1.0, NEW) is PullAction.READY


def test_a_peer_lost_report_for_another_incarnation_is_ignored() -> None:
    rec = ready(NEW)
    assert rec.on_peer_lost(OLD) is False
    assert rec.state is S.READY


def _gone() -> EngineRecord:
    rec = ready(OLD)
    pull(rec, 0.0, NEW)
    rec.metadata_received(metadata(NEW))
    return rec


def _verified_moments_ago() -> EngineRecord:
    rec = ready(OLD)
    pull(rec, 0.5, NEW)
    rec.metadata_received(metadata(OLD))  # NEW refuted, until 1.5 no new question
    return rec


ACTION_EXAMPLES = {
    PullAction.START: (record, ""),
    PullAction.VERIFY: (lambda: ready(OLD), NEW),
    PullAction.DEFER: (_verified_moments_ago, "another"),
    PullAction.WAIT: (lambda: record(S.FETCHING), ""),
    PullAction.READY: (lambda: ready(OLD), OLD),
    PullAction.FAIL_FAST: (lambda: record(S.BACKOFF, retry_at=5.0, error=error()), ""),
    PullAction.GONE: (_gone, OLD),
}


@pytest.mark.parametrize("action", list(PullAction), ids=str)
def test_every_action_has_an_example(action: PullAction) -> None:
    make, incarnation = ACTION_EXAMPLES[action]
    assert pull(make(), 1.0, incarnation) is action


def test_a_record_of_another_rank_judges_no_request_incarnation() -> None:
    # Requests carry rank 0's incarnation: a stale or forged one must not
    # poison a rank-1 record (it once became the record's epoch, and every
    # valid request after it failed as "gone").
    rec = EngineRecord(engine_id="prefill-0", host="127.0.0.1", port=5556, rank=1)
    assert rec.on_pull("stale-or-forged", 0.0) is PullAction.START
    rec.metadata_received(msgspec.structs.replace(metadata(OLD), tp_rank=1))
    rec.loaded()
    for incarnation in ("", OLD, NEW, "stale-or-forged"):
        assert rec.on_pull(incarnation, 1.0) is PullAction.READY
    assert rec.retired_incarnations == {}
    assert rec.state is S.READY
