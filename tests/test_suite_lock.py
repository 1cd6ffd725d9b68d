"""The suite's rule for its pytest-xdist workers (tests/conftest.py): a test
marked ``test_hosts`` holds the test-hosts lock alone, with UCX on every
interface; every other test runs beside it, UCX on loopback only."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from .conftest import ROOT_NAMESPACE_UCX, TEST_HOSTS_LOCK


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
def test_a_test_host_test_holds_the_lock_alone_with_ucx_on_every_interface() -> None:
    assert not could_take(fcntl.LOCK_SH)
    assert not any(name in os.environ for name in ROOT_NAMESPACE_UCX)


def locks_held_here() -> list[str]:
    """This process's flocks on the test-hosts lock (``/proc/locks``)."""
    inode = os.stat(TEST_HOSTS_LOCK).st_ino
    return [
        line
        for line in Path("/proc/locks").read_text().splitlines()
        if "FLOCK" in line
        and "->" not in line  # (waiters)
        and line.split()[4] == str(os.getpid())
        and line.split()[5].rsplit(":", 1)[-1] == str(inode)
    ]


@pytest.mark.test_hosts
def test_the_lock_check_sees_a_lock_held_here() -> None:
    assert len(locks_held_here()) == 1


def test_any_other_test_takes_no_lock_and_keeps_ucx_on_loopback() -> None:
    assert locks_held_here() == []
    assert os.environ["UCX_NET_DEVICES"] == "lo"
