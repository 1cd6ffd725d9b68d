"""Producer-side exposure bookkeeping: consumers, deadlines, history (no I/O)."""

from __future__ import annotations

import numpy as np
import pytest

from trio_pd._exposures import ExposureTable, Notice, Released

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
