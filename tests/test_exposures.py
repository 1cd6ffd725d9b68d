"""Producer-side exposure bookkeeping: consumers, leases, abandons, history (no I/O)."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_pd._core._exposures import (
    MAX_PINS,
    Confirmed,
    ExposureTable,
    Notice,
    Released,
    blocks_digest,
    lease_window,
    pin_covers,
)

BLOCKS = np.array([3, 1, 4], dtype=np.int64)


def table(history: int = 16) -> ExposureTable:
    return ExposureTable(history=history)


def test_expose_records_a_pending_exposure() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=2, deadline=10.0)
    assert (exposure.request_id, exposure.consumers, exposure.deadline) == ("r1", 2, 10.0)
    assert exposure.block_ids is BLOCKS
    assert exposure.outcome is None
    assert t.pending == 1
    assert t.outcome("r1") is None


def test_single_consumer_releases_on_its_notification() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    assert t.notify("r1", "decode-a") is Notice.RELEASED
    assert exposure.outcome is Released.READ
    assert t.outcome("r1") is Released.READ
    assert (t.pending, t.released, t.expired) == (0, 1, 0)


def test_read_only_after_n_distinct_consumers() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=3, deadline=10.0)
    assert t.notify("r1", "a") is Notice.COUNTED
    assert t.notify("r1", "b") is Notice.COUNTED
    assert t.outcome("r1") is None
    assert t.notify("r1", "c") is Notice.RELEASED
    assert t.outcome("r1") is Released.READ


def test_duplicate_consumer_is_not_counted_twice() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=2, deadline=10.0)
    assert t.notify("r1", "a") is Notice.COUNTED
    assert t.notify("r1", "a") is Notice.DUPLICATE
    assert t.outcome("r1") is None
    assert t.pending == 1
    assert t.notify("r1", "b") is Notice.RELEASED


def test_notification_after_release_is_late() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    t.notify("r1", "a")
    assert t.notify("r1", "b") is Notice.LATE
    assert t.released == 1


def test_notification_after_expiry_is_late() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    t.expire(10.0)
    assert t.notify("r1", "a") is Notice.LATE
    assert t.outcome("r1") is Released.EXPIRED
    assert (t.released, t.expired) == (0, 1)


def test_notification_for_an_unknown_request_is_unknown() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    assert t.notify("r2", "a") is Notice.UNKNOWN
    assert t.notify("r", "a") is Notice.UNKNOWN
    assert t.pending == 1


def test_exposing_a_pending_request_again_is_an_error() -> None:
    t = table()
    first = t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    with pytest.raises(ValueError, match="'r1' is already exposed and pending"):
        t.expose("r1", BLOCKS, consumers=1, deadline=20.0)
    assert t.pending == 1
    t.expire(10.0)
    assert first.outcome is Released.EXPIRED


def test_exposing_a_resolved_request_again_starts_afresh() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    t.notify("r1", "a")
    again = t.expose("r1", BLOCKS, consumers=2, deadline=30.0)
    assert t.outcome("r1") is None
    assert again.readers == {}
    assert t.notify("r1", "a") is Notice.COUNTED
    assert t.notify("r1", "b") is Notice.RELEASED
    assert t.released == 2


def test_stale_deadline_of_a_re_exposed_request_does_not_expire_it() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    t.notify("r1", "a")
    t.expose("r1", BLOCKS, consumers=1, deadline=30.0)
    assert t.expire(20.0) == []
    assert t.next_deadline() == 30.0
    assert t.outcome("r1") is None


@pytest.mark.parametrize("consumers", [0, -1])
def test_consumers_below_one_is_an_error(consumers: int) -> None:
    t = table()
    with pytest.raises(ValueError, match=f"consumers must be >= 1, got {consumers}"):
        t.expose("r1", BLOCKS, consumers=consumers, deadline=10.0)
    assert t.pending == 0
    assert t.next_deadline() is None


def test_expire_resolves_only_due_exposures_in_deadline_order() -> None:
    t = table()
    t.expose("late", BLOCKS, consumers=1, deadline=30.0)
    t.expose("b", BLOCKS, consumers=1, deadline=20.0)
    t.expose("a", BLOCKS, consumers=1, deadline=10.0)
    t.expose("never", BLOCKS, consumers=1, deadline=99.0)

    assert t.expire(9.999) == []
    expired = t.expire(30.0)

    assert [e.request_id for e in expired] == ["a", "b", "late"]
    assert all(e.outcome is Released.EXPIRED for e in expired)
    assert t.outcome("never") is None
    assert (t.pending, t.expired) == (1, 3)


def test_expire_skips_exposures_already_read() -> None:
    t = table()
    t.expose("read", BLOCKS, consumers=1, deadline=10.0)
    t.expose("due", BLOCKS, consumers=1, deadline=11.0)
    t.notify("read", "a")
    assert [e.request_id for e in t.expire(100.0)] == ["due"]
    assert t.outcome("read") is Released.READ
    assert (t.released, t.expired) == (1, 1)


def test_next_deadline_is_the_earliest_pending_one() -> None:
    t = table()
    assert t.next_deadline() is None
    t.expose("r1", BLOCKS, consumers=1, deadline=20.0)
    t.expose("r2", BLOCKS, consumers=1, deadline=10.0)
    assert t.next_deadline() == 10.0
    t.notify("r2", "a")
    assert t.next_deadline() == 20.0
    t.expire(20.0)
    assert t.next_deadline() is None


def test_outcome_of_a_never_exposed_request_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="'nope' is not exposed"):
        table().outcome("nope")


def test_history_forgets_the_oldest_outcomes() -> None:
    t = table(history=2)
    for rid in ["r1", "r2", "r3"]:
        t.expose(rid, BLOCKS, consumers=1, deadline=10.0)
        t.notify(rid, "a")
    with pytest.raises(KeyError):
        t.outcome("r1")
    assert t.notify("r1", "b") is Notice.UNKNOWN
    assert t.outcome("r2") is Released.READ
    assert t.outcome("r3") is Released.READ
    assert t.released == 3


def test_history_counts_expired_and_read_outcomes_together() -> None:
    t = table(history=1)
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    t.expose("r2", BLOCKS, consumers=1, deadline=50.0)
    t.expire(10.0)
    t.notify("r2", "a")
    assert t.outcome("r2") is Released.READ
    with pytest.raises(KeyError):
        t.outcome("r1")


def test_counters_count_each_resolution_once() -> None:
    t = table()
    for i in range(3):
        t.expose(f"read{i}", BLOCKS, consumers=1, deadline=100.0)
        t.notify(f"read{i}", "a")
        t.notify(f"read{i}", "a")
    for i in range(2):
        t.expose(f"exp{i}", BLOCKS, consumers=2, deadline=5.0)
        t.notify(f"exp{i}", "a")
    t.expire(5.0)
    t.expire(5.0)
    assert (t.pending, t.released, t.expired) == (0, 3, 2)


def test_ranks_of_one_engine_count_as_fractions_of_it() -> None:
    # Decode TP 4 reading prefill TP 2: two decode ranks read each prefill
    # rank, and each says so (readers=2).
    t = table()
    t.expose("r1", BLOCKS, consumers=2, deadline=10.0)
    assert t.notify("r1", "d0#a", readers=2) is Notice.COUNTED
    assert t.notify("r1", "d0#a", readers=2) is Notice.DUPLICATE
    assert t.notify("r1", "d1#b", readers=2) is Notice.COUNTED  # one engine of two
    assert t.notify("r1", "e0#c", readers=1) is Notice.RELEASED  # a second engine, TP 1
    assert t.outcome("r1") is Released.READ


def test_an_engine_with_three_readers_is_read_only_when_all_three_notified() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0)
    assert [t.notify("r1", f"d{i}", readers=3) for i in range(3)] == [
        Notice.COUNTED,
        Notice.COUNTED,
        Notice.RELEASED,
    ]


# ---- leases -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("initial", "cap", "window"),
    [(30.0, 120.0, (130.0, 220.0)), (30.0, 10.0, (110.0, 110.0)), (5.0, 5.0, (105.0, 105.0))],
)
def test_the_first_deadline_is_the_initial_lease_never_past_the_cap(
    initial: float, cap: float, window: tuple[float, float]
) -> None:
    assert lease_window(100.0, initial, cap) == window


def test_a_renewal_extends_the_deadline_from_its_arrival() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    assert t.renew("r1", now=25.0, extension=10.0)
    assert t.pending_exposure("r1") is not None
    assert t.next_deadline() == 35.0
    assert t.expire(34.9) == []
    assert [e.request_id for e in t.expire(35.0)] == ["r1"]
    assert t.outcome("r1") is Released.EXPIRED
    assert t.renewed == 1


def test_a_heartbeat_shortens_a_long_first_lease_so_a_dead_consumer_frees_the_blocks_soon() -> None:
    # (issue 28, 6: a consumer held with lease_initial=30, lease_renewal=2 and
    # died after a few heartbeats; the blocks stayed until the first lease ran out)
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    t.renew("r1", now=1.0, extension=2.0)
    t.renew("r1", now=1.5, extension=2.0)
    assert exposure.deadline == 3.5
    assert t.next_deadline() == 3.5
    assert t.expire(3.4) == []
    assert t.expire(3.5) == [exposure]
    assert exposure.outcome is Released.EXPIRED


def test_renewals_move_the_deadline_only_forward_once_they_began() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    for now in (1.0, 2.0, 3.0):
        t.renew("r1", now=now, extension=10.0)
        assert exposure.deadline == now + 10.0
    assert t.expire(12.9) == []
    assert t.expire(13.0) == [exposure]


def test_a_pin_keeps_an_exposure_pending_past_its_lease_until_it_ends() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    answer = t.confirm("r1", "decode-a", blocks_digest(BLOCKS), now=9.0, hold_for=5.0)
    assert (answer.state, answer.held_for) == (Confirmed.HELD, 5.0)
    assert t.expire(10.0) == []  # (the lease ran out; the pin has not)
    assert t.next_deadline() == 14.0
    assert t.expire(14.0) == [exposure]
    assert exposure.outcome is Released.EXPIRED


def test_the_pinning_agents_notification_ends_its_pin_and_resolves() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    t.confirm("r1", "decode-a", blocks_digest(BLOCKS), now=1.0, hold_for=5.0)
    assert t.notify("r1", "decode-a") is Notice.RELEASED
    assert t.outcome("r1") is Released.READ


def test_other_readers_cannot_end_an_exposure_while_a_pin_holds_it() -> None:
    # A replay (or a decode engine retried elsewhere) reads and notifies while
    # the request's own decode is still READing under its pin: the exposure must
    # not end (the prefill engine would reuse the blocks under that READ).
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    t.confirm("r1", "decode-a", blocks_digest(BLOCKS), now=1.0, hold_for=5.0)
    assert t.notify("r1", "decode-b") is Notice.COUNTED
    assert t.outcome("r1") is None
    assert t.expire(5.9) == []
    assert t.expire(6.0) == [exposure]  # (the pin ran out: resolved as accounted)
    assert exposure.outcome is Released.READ


def test_a_deferred_exposure_resolves_when_its_pinning_agent_notifies() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    t.confirm("r1", "decode-a", blocks_digest(BLOCKS), now=1.0, hold_for=5.0)
    assert t.notify("r1", "decode-b") is Notice.COUNTED
    assert t.notify("r1", "decode-a") is Notice.RELEASED
    assert t.outcome("r1") is Released.READ


def test_a_pin_never_passes_the_cap() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=12.0)
    answer = t.confirm("r1", "decode-a", blocks_digest(BLOCKS), now=9.0, hold_for=5.0)
    assert (answer.state, answer.held_for) == (Confirmed.HELD, 3.0)
    assert t.expire(12.0) == [exposure]
    at_cap = t.expose("r2", BLOCKS, consumers=1, deadline=5.0, limit=5.0)
    assert t.confirm("r2", "decode-a", blocks_digest(BLOCKS), 5.0, 5.0).state is Confirmed.EXPIRED
    assert t.expire(5.0) == [at_cap]


@pytest.mark.parametrize(
    ("end", "answer"),
    [
        ("expire", Confirmed.EXPIRED),
        ("abandon", Confirmed.ABANDONED),
        ("read-by-b", Confirmed.READ_BY_OTHERS),
    ],
)
def test_a_confirmation_after_the_exposure_ended_says_how(end: str, answer: Confirmed) -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    if end == "expire":
        t.expire(10.0)
    elif end == "abandon":
        t.abandon("r1", "decode-b")
    else:
        t.notify("r1", "decode-b")
    assert t.confirm("r1", "decode-a", blocks_digest(BLOCKS), 11.0, 5.0).state is answer
    assert t.confirm("r1", "decode-a", blocks_digest(BLOCKS), 11.0, 5.0).held_for == 0.0


def test_a_confirmation_after_the_agents_own_read_says_read() -> None:
    # (its notification may reach the producer before its confirmation)
    t = table()
    digest = blocks_digest(BLOCKS)
    t.expose("r1", BLOCKS, consumers=2, deadline=10.0, limit=120.0)
    t.notify("r1", "decode-a", nonce=7)
    assert t.confirm("r1", "decode-a", digest, 1.0, 5.0, nonce=7).state is Confirmed.READ
    t.notify("r1", "decode-b", nonce=3)
    assert t.confirm("r1", "decode-a", digest, 2.0, 5.0, nonce=7).state is Confirmed.READ
    assert t.confirm("r1", "decode-c", digest, 2.0, 5.0, nonce=7).state is (
        Confirmed.READ_BY_OTHERS
    )


def test_a_replay_by_the_agent_that_read_is_not_confirmed() -> None:
    # (issue 28, 3: the same parameters sent again to the same decode engine
    # after its pull: its next READ has another nonce)
    t = table()
    digest = blocks_digest(BLOCKS)
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    t.notify("r1", "decode-a", nonce=7)
    assert t.confirm("r1", "decode-a", digest, 1.0, 5.0, nonce=8).state is (
        Confirmed.READ_BY_OTHERS
    )
    assert t.confirm("r1", "decode-a", digest, 1.0, 5.0).state is Confirmed.READ_BY_OTHERS


def test_a_second_read_of_a_pending_exposure_is_pinned_and_its_notification_ends_the_pin() -> None:
    t = table()
    digest = blocks_digest(BLOCKS)
    t.expose("r1", BLOCKS, consumers=2, deadline=10.0, limit=120.0)
    t.notify("r1", "decode-a", nonce=1)
    assert t.confirm("r1", "decode-a", digest, 1.0, 5.0, nonce=2).state is Confirmed.HELD
    assert t.notify("r1", "decode-b", nonce=1) is Notice.COUNTED  # (held by a's pin)
    assert t.notify("r1", "decode-a", nonce=2) is Notice.RELEASED
    assert t.outcome("r1") is Released.READ


def test_a_request_id_exposed_again_with_other_blocks_is_not_confirmed_for_the_old_ones() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    t.expire(10.0)
    t.expose("r1", np.array([7, 8], dtype=np.int64), consumers=1, deadline=20.0, limit=120.0)
    assert t.confirm("r1", "decode-a", blocks_digest(BLOCKS), 11.0, 5.0).state is (
        Confirmed.UNKNOWN
    )
    assert t.confirm("r1", "decode-a", blocks_digest([7, 8]), 11.0, 5.0).state is Confirmed.HELD
    assert t.confirm("r9", "decode-a", blocks_digest(BLOCKS), 11.0, 5.0).state is (
        Confirmed.UNKNOWN
    )


def test_pins_per_exposure_are_bounded() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    digest = blocks_digest(BLOCKS)
    for i in range(MAX_PINS):
        assert t.confirm("r1", f"agent-{i}", digest, 1.0, 5.0).state is Confirmed.HELD
    assert t.confirm("r1", "one-more", digest, 1.0, 5.0).state is Confirmed.TOO_MANY_PINS
    assert t.confirm("r1", "agent-0", digest, 2.0, 5.0).state is Confirmed.HELD  # (renewed)


def test_the_heap_stays_small_under_a_storm_of_renewals_and_confirmations() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    digest = blocks_digest(BLOCKS)
    for i in range(10_000):
        now = 1.0 + i * 1e-3
        t.renew("r1", now=now, extension=10.0)
        t.confirm("r1", "decode-a", digest, now, 5.0)
    assert len(t._deadlines) <= 3


def test_pin_covers_counts_from_the_send_with_slack() -> None:
    assert pin_covers(10.0, sent_at=100.0, read_done_at=109.0)
    assert not pin_covers(10.0, sent_at=100.0, read_done_at=109.95)
    assert not pin_covers(0.0, sent_at=100.0, read_done_at=100.0001)


def test_renewals_never_pass_the_cap() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    for now in range(0, 200, 3):
        if t.outcome("r1") is not None:
            break
        t.expire(float(now))
        t.renew("r1", now=float(now), extension=10.0)
        assert exposure.deadline <= 120.0
    assert exposure.outcome is Released.EXPIRED
    assert exposure.deadline == 120.0


def test_a_renewal_of_what_is_not_pending_does_nothing() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    t.notify("r1", "a")
    assert not t.renew("r1", now=1.0, extension=10.0)
    assert not t.renew("never", now=1.0, extension=10.0)
    assert t.renewed == 0


def test_without_a_limit_an_exposure_cannot_be_renewed() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=30.0)
    assert exposure.limit == 30.0
    t.renew("r1", now=25.0, extension=10.0)
    assert exposure.deadline == 30.0


def test_a_limit_before_the_deadline_is_an_error() -> None:
    with pytest.raises(ValueError, match="before deadline"):
        table().expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=20.0)


def test_the_issued_token_is_kept_with_the_exposure() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=30.0, token="abc")
    exposure = t.pending_exposure("r1")
    assert exposure is not None
    assert exposure.token == "abc"
    assert "abc" not in repr(exposure)


def test_one_consumers_abandon_resolves_it_abandoned_at_once() -> None:
    t = table()
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=30.0)
    assert t.abandon("r1", "decode#a") is Notice.RELEASED
    assert exposure.outcome is Released.ABANDONED
    assert t.outcome("r1") is Released.ABANDONED
    assert (t.pending, t.released, t.expired, t.abandoned) == (0, 0, 0, 1)
    assert t.next_deadline() is None
    assert t.abandon("r1", "decode#a") is Notice.LATE
    assert t.notify("r1", "decode#a") is Notice.LATE


def test_an_exposure_resolves_when_every_consumer_read_or_abandoned() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=2, deadline=30.0)
    assert t.abandon("r1", "a") is Notice.COUNTED
    assert t.outcome("r1") is None
    assert t.notify("r1", "b") is Notice.RELEASED
    assert t.outcome("r1") is Released.ABANDONED
    t.expose("r2", BLOCKS, consumers=2, deadline=30.0)
    assert t.notify("r2", "a") is Notice.COUNTED
    assert t.abandon("r2", "b") is Notice.RELEASED
    assert t.outcome("r2") is Released.ABANDONED
    assert (t.released, t.abandoned) == (0, 2)


def test_an_agent_that_read_or_abandoned_is_counted_once() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=3, deadline=30.0)
    assert t.notify("r1", "a") is Notice.COUNTED
    assert t.abandon("r1", "a") is Notice.DUPLICATE
    assert t.abandon("r1", "b") is Notice.COUNTED
    assert t.abandon("r1", "b") is Notice.DUPLICATE
    assert t.notify("r1", "b") is Notice.DUPLICATE
    assert t.outcome("r1") is None
    assert t.abandon("r1", "c") is Notice.RELEASED
    assert t.abandon("unknown", "a") is Notice.UNKNOWN


def test_abandoning_ranks_count_as_fractions_of_their_engine() -> None:
    # Decode TP 2 reading prefill TP 1: both decode ranks must abandon.
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=30.0)
    assert t.abandon("r1", "d0", readers=2) is Notice.COUNTED
    assert t.outcome("r1") is None
    assert t.abandon("r1", "d1", readers=2) is Notice.RELEASED
    assert t.outcome("r1") is Released.ABANDONED


def test_an_abandon_ends_the_pins_of_the_agents_reads_it_names_and_resolves_at_once() -> None:
    # A pull confirmed its READ (pinned), then was cancelled and its READ
    # stopped: the consumer's abandon names that READ, and nothing holds the
    # blocks any more.
    t = table()
    digest = blocks_digest(BLOCKS)
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    assert t.confirm("r1", "decode#a", digest, 1.0, 10.0, nonce=7).state is Confirmed.HELD
    assert t.abandon("r1", "decode#a", pins=[7]) is Notice.RELEASED
    assert exposure.outcome is Released.ABANDONED
    assert (exposure.pins, t.pins_ended) == ({}, 1)
    assert t.next_deadline() is None


def test_an_abandon_never_ends_another_agents_pins() -> None:
    t = table()
    digest = blocks_digest(BLOCKS)
    exposure = t.expose("r1", BLOCKS, consumers=2, deadline=3.0, limit=120.0)
    t.confirm("r1", "victim", digest, 1.0, 10.0, nonce=5)
    t.confirm("r1", "attacker", digest, 1.0, 10.0, nonce=6)
    # The attacker names the victim's nonce as well as its own: only its own ends.
    assert t.abandon("r1", "attacker", pins=[5, 6]) is Notice.COUNTED
    assert set(exposure.pins) == {("victim", 5)}
    assert t.pins_ended == 1
    assert t.expire(10.9) == []  # (the lease ran out at 3.0: the victim's READ still holds it)
    assert t.notify("r1", "victim", nonce=5) is Notice.RELEASED
    assert exposure.outcome is Released.ABANDONED


def test_an_abandon_keeps_the_pins_of_the_agents_reads_it_does_not_name() -> None:
    # Two READs of one agent: one stopped (named), one that could not be
    # stopped (not named): the exposure waits for the second one's pin.
    t = table()
    digest = blocks_digest(BLOCKS)
    exposure = t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    t.confirm("r1", "decode#a", digest, 1.0, 10.0, nonce=7)
    t.confirm("r1", "decode#a", digest, 2.0, 10.0, nonce=8)
    assert t.abandon("r1", "decode#a", pins=[7]) is Notice.COUNTED
    assert set(exposure.pins) == {("decode#a", 8)}
    assert t.outcome("r1") is None
    # Its READ ended at last (its notification): the pin ends, it resolves.
    assert t.notify("r1", "decode#a", nonce=8) is Notice.RELEASED
    assert exposure.outcome is Released.ABANDONED
    # ... or, unsettled for good, the pin runs out.
    exposure = t.expose("r2", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    t.confirm("r2", "decode#a", digest, 1.0, 10.0, nonce=9)
    assert t.abandon("r2", "decode#a", pins=[10]) is Notice.COUNTED
    assert t.expire(10.9) == []
    assert t.expire(11.0) == [exposure]
    assert exposure.outcome is Released.ABANDONED


def test_an_agent_already_counted_may_still_end_its_pins_with_an_abandon() -> None:
    # It abandoned (or read) before; a later abandon names READs that
    # stopped since: they end, and the exposure resolves if nothing else holds it.
    t = table()
    digest = blocks_digest(BLOCKS)
    exposure = t.expose("r1", BLOCKS, consumers=2, deadline=30.0, limit=120.0)
    t.notify("r1", "decode#b")
    t.confirm("r1", "decode#a", digest, 1.0, 10.0, nonce=7)
    assert t.abandon("r1", "decode#a") is Notice.COUNTED  # (accounted for, but pinned)
    assert t.abandon("r1", "decode#a", pins=[7]) is Notice.RELEASED
    assert exposure.outcome is Released.ABANDONED
    t.expose("r2", BLOCKS, consumers=2, deadline=30.0, limit=120.0)
    t.confirm("r2", "decode#a", digest, 1.0, 10.0, nonce=7)
    assert t.abandon("r2", "decode#a", pins=[99]) is Notice.COUNTED
    assert t.abandon("r2", "decode#a", pins=[7]) is Notice.DUPLICATE  # (b still to account)
    assert t.pending_exposure("r2") is not None
    assert t.pending_exposure("r2").pins == {}  # type: ignore[union-attr]
    assert t.abandon("r2", "decode#b") is Notice.RELEASED
    assert t.abandon("r2", "decode#a", pins=[7]) is Notice.LATE


def test_an_abandoned_exposure_does_not_expire_later() -> None:
    t = table()
    t.expose("r1", BLOCKS, consumers=1, deadline=30.0, limit=120.0)
    t.renew("r1", now=25.0, extension=10.0)
    t.abandon("r1", "a")
    assert t.expire(1000.0) == []
    assert (t.abandoned, t.expired) == (1, 0)


# A random life of one exposure against a model of the rules: heartbeats,
# reads and abandons of a few agents, and the clock, in any order.
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("renew"), st.floats(0, 5), st.floats(0.1, 20)),
        st.tuples(st.just("notify"), st.sampled_from(["a", "b", "c"]), st.sampled_from([1, 2])),
        st.tuples(st.just("abandon"), st.sampled_from(["a", "b", "c"]), st.sampled_from([1, 2])),
        st.tuples(st.just("tick"), st.floats(0, 10), st.just(0)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    steps=_steps,
    consumers=st.integers(1, 2),
    initial=st.floats(0.1, 30),
    cap=st.floats(0.1, 60),
)
def test_an_exposure_follows_the_lease_rules(
    steps: list[tuple[str, Any, Any]], consumers: int, initial: float, cap: float
) -> None:
    t = table()
    now = 0.0
    deadline, limit = lease_window(now, initial, cap)
    exposure = t.expose("r", BLOCKS, consumers, deadline, limit=limit)
    read: dict[str, Fraction] = {}
    abandoned: dict[str, Fraction] = {}
    outcome: Released | None = None
    renewals = 0
    for op, x, y in steps:
        if op in ("renew", "tick"):
            now += x
            if outcome is None and deadline <= now:
                outcome = Released.EXPIRED
            t.expire(now)
        if op == "renew":
            assert t.renew("r", now, y) is (outcome is None)
            if outcome is None:
                renewals += 1
                deadline = min(now + y, limit)  # (may shorten the first lease)
        elif op in ("notify", "abandon"):
            notice = t.notify("r", x, y) if op == "notify" else t.abandon("r", x, y)
            if outcome is not None:
                assert notice is Notice.LATE
            elif x in read or x in abandoned:
                assert notice is Notice.DUPLICATE
            else:
                (read if op == "notify" else abandoned)[x] = Fraction(1, y)
                if sum(read.values()) + sum(abandoned.values()) >= consumers:
                    outcome = Released.ABANDONED if abandoned else Released.READ
                    assert notice is Notice.RELEASED
                else:
                    assert notice is Notice.COUNTED
        assert exposure.deadline == deadline <= limit <= cap
        assert t.outcome("r") is outcome
    assert t.renewed == renewals
    if outcome is None:
        assert t.next_deadline() == deadline


def test_a_second_read_whose_notification_came_before_its_confirmation_is_read() -> None:
    # The same agent reads a pending exposure twice (a retried pull); the
    # second READ's notification (UCX) overtakes its confirmation (ZeroMQ).
    # It was counted while the exposure was pending: that READ read the
    # request's bytes, whether the exposure resolved since or not -- and it
    # must not leave a pin that nothing will end.
    t = table()
    digest = blocks_digest(BLOCKS)
    t.expose("r1", BLOCKS, consumers=2, deadline=10.0, limit=120.0)
    assert t.notify("r1", "decode-a", nonce=1) is Notice.COUNTED
    assert t.notify("r1", "decode-a", nonce=2) is Notice.DUPLICATE
    assert t.confirm("r1", "decode-a", digest, 1.0, 5.0, nonce=2).state is Confirmed.READ
    assert t.notify("r1", "decode-b", nonce=1) is Notice.RELEASED  # (no pin left behind)
    assert t.confirm("r1", "decode-a", digest, 2.0, 5.0, nonce=2).state is Confirmed.READ
    assert t.confirm("r1", "decode-a", digest, 2.0, 5.0, nonce=3).state is (
        Confirmed.READ_BY_OTHERS
    )


def test_the_reads_remembered_per_exposure_are_bounded() -> None:
    # (a peer notifying with ever new nonces cannot grow an exposure)
    t = table()
    t.expose("r1", BLOCKS, consumers=2, deadline=10.0, limit=120.0)
    for nonce in range(1, 10_000):
        t.notify("r1", "decode-a", nonce=nonce)
    exposure = t.pending_exposure("r1")
    assert exposure is not None
    assert len(exposure.read_nonces) <= MAX_PINS


def test_a_request_exposed_again_is_a_new_generation_and_confirmations_name_theirs() -> None:
    t = table()
    digest = blocks_digest(BLOCKS)
    assert t.generation("r1") == 1
    t.expose("r1", BLOCKS, consumers=1, deadline=10.0, limit=120.0)
    t.expire(10.0)
    assert t.generation("r1") == 2
    again = t.expose("r1", BLOCKS, consumers=1, deadline=20.0, limit=120.0)
    assert again.generation == 2
    # a READ of the first exposure is not confirmed by the second, on the same blocks
    assert t.confirm("r1", "d", digest, 11.0, 5.0, nonce=1, generation=1).state is (
        Confirmed.UNKNOWN
    )
    assert t.confirm("r1", "d", digest, 11.0, 5.0, nonce=2, generation=2).state is Confirmed.HELD
    assert t.confirm("r1", "d", digest, 11.0, 5.0, nonce=3).state is Confirmed.HELD  # (0: any)
