"""Shared helpers: small KV caches and a bound on every test.

Real-path tests use real NIXL agents (UCX, DRAM), real ZeroMQ sockets on
loopback and real prefill processes; nothing here fakes them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import trio

import trio_pd


def kv_cache(
    regions: int = 4,
    blocks: int = 32,
    block_shape: tuple[int, ...] = (16, 128),
    dtype: torch.dtype = torch.float16,
) -> list[torch.Tensor]:
    """``regions`` zeroed CPU tensors of shape ``(blocks, *block_shape)``."""
    return [torch.zeros((blocks, *block_shape), dtype=dtype) for _ in range(regions)]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_threads() -> int:
    return len(os.listdir("/proc/self/task"))


FAST = trio_pd.ConnectorConfig(handshake_timeout=2.0, transfer_timeout=10.0, close_timeout=5.0)


@pytest.fixture
def fast_config() -> trio_pd.ConnectorConfig:
    return FAST


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is a broken set-up here: every test runs on the real path."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped and os.environ.get("TRIO_PD_ALLOW_SKIPS") != "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.write_line(
                f"{skipped} test(s) skipped: every test must run on the real path "
                "(set TRIO_PD_ALLOW_SKIPS=1 to allow)",
                red=True,
            )


async def wait_until(condition: Callable[[], object], interval: float = 0.001) -> None:
    """Poll ``condition`` (state owned by another task or process) until true.

    Bound the wait with ``trio.fail_after`` / ``move_on_after`` around it.
    """
    while not condition():  # noqa: ASYNC110 -- nothing to wait on: foreign state
        await trio.sleep(interval)
