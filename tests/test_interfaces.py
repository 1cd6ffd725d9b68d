"""The wait for the advertised address's interface, before a NIXL agent is created.

The real path (an engine started while its test host's link is down) is in
``tests/test_across_hosts.py``; here the kernel's answer is scripted.
"""

from __future__ import annotations

import pytest
import trio

import trio_pd
from trio_pd._transfer._nixl._interfaces import interface_state, wait_for_interface

QUICK = trio_pd.ConnectorConfig(interface_timeout=0.3)


def test_loopback_ipv6_and_names_are_not_checked() -> None:
    for address in ("127.0.0.1", "::1", "fd00::2", "prefill-0.example"):
        assert interface_state(address) is None


async def test_a_down_interface_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([("veth-h1", False), ("veth-h1", False), ("veth-h1", True)])
    monkeypatch.setattr(
        "trio_pd._transfer._nixl._interfaces.interface_state", lambda address: next(answers)
    )
    with trio.fail_after(5):
        await wait_for_interface("prefill", "198.18.0.2", trio_pd.ConnectorConfig())


async def test_one_that_stays_down_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "trio_pd._transfer._nixl._interfaces.interface_state", lambda address: ("veth-h1", False)
    )
    with trio.fail_after(5), pytest.raises(OSError, match="interface veth-h1, which holds") as info:
        await wait_for_interface("prefill", "198.18.0.2", QUICK)
    assert "'prefill'" in str(info.value)
    assert "198.18.0.2" in str(info.value)
    assert "stayed down for 0.3 s" in str(info.value)
