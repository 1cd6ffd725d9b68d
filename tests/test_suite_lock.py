"""The suite's rule for its pytest-xdist workers (tests/conftest.py): a test
marked ``test_hosts`` holds the test-hosts lock alone, every other test holds
it shared."""

from __future__ import annotations

import fcntl

import pytest

from .conftest import TEST_HOSTS_LOCK


def could_take(mode: int) -> bool:
    """Whether another holder (another open file, as another worker has) could
    take the lock in ``mode`` now; if so it lets go at once."""
    with TEST_HOSTS_LOCK.open("a") as other:
        try:
            fcntl.flock(other, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


@pytest.mark.test_hosts  # (it makes no test hosts: it checks what the marker gets)
def test_a_test_host_test_holds_the_lock_alone() -> None:
    assert not could_take(fcntl.LOCK_SH)


def test_any_other_test_shares_the_lock() -> None:
    assert could_take(fcntl.LOCK_SH)
    assert not could_take(fcntl.LOCK_EX)
