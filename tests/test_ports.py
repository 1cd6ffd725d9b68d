"""free_port_range: consecutive free ports, away from the kernel's own picks."""

from __future__ import annotations

import socket

import pytest

from trio_pd._ports import LOWEST, _ephemeral_low, free_port_range


def test_a_range_is_free_and_below_the_ephemeral_ports() -> None:
    base = free_port_range(4)
    assert base >= LOWEST
    assert base + 4 <= _ephemeral_low()
    sockets = [socket.socket() for _ in range(4)]
    try:
        for offset, sock in enumerate(sockets):
            sock.bind(("127.0.0.1", base + offset))  # (raises if it was not free)
    finally:
        for sock in sockets:
            sock.close()


def test_a_range_with_a_taken_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port - 1, 25000])  # the first range holds the taken port
        monkeypatch.setattr("trio_pd._ports._pick_base", lambda low, high: next(picks))
        assert free_port_range(2) == 25000
