"""The designs trio_pd is compared with, built from its public parts (benchmarks only).

* :class:`InlineHandshakes`: vLLM before PR #19836 -- a pull whose engine is
  not ready holds one connector-wide lock until its handshake (and its small
  pull) is done, so every other pull waits behind every handshake.
* :class:`NixlOnEventLoop`: the NIXL backend with every NIXL call made on the
  trio thread, as a naive integration would (the loop stalls for each call).

The raw NIXL reads that trio_pd is measured against are
``trio_pd.testing.CapturedBackends`` and ``raw_nixl_read`` (the demo measures
one too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import trio

import trio_pd

_T = TypeVar("_T")


class InlineHandshakes:
    """A connector whose handshakes block every pull (pre-#19836 behaviour)."""

    def __init__(self, connector: trio_pd.Connector) -> None:
        self.connector = connector
        self._lock = trio.Lock()

    async def pull(
        self, request_id: str, local_block_ids: Sequence[int], remote: trio_pd.RemoteBlocks
    ) -> trio_pd.PullResult:
        """Like :meth:`trio_pd.Connector.pull`; ``seconds`` includes the wait for the lock."""
        started = trio.current_time()
        async with self._lock:
            if self.connector.engine_state(remote.engine_id) is not trio_pd.EngineState.READY:
                result = await self.connector.pull(request_id, local_block_ids, remote)
                return self._timed(result, started)
        result = await self.connector.pull(request_id, local_block_ids, remote)
        return self._timed(result, started)

    @staticmethod
    def _timed(result: trio_pd.PullResult, started: float) -> trio_pd.PullResult:
        return attrs.evolve(result, seconds=trio.current_time() - started)

    def statistics(self) -> trio_pd.ConnectorStatistics:
        return self.connector.statistics()


class NixlOnEventLoop(trio_pd.NixlBackend):
    """NIXL calls on the trio thread: what the worker threads spare the loop."""

    async def run_blocking(
        self,
        limiter: trio.CapacityLimiter,
        fn: Callable[..., _T],
        *args: Any,
        abandon_on_cancel: bool = False,
    ) -> _T:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        return await super().notifications(0.0)  # never sleep on the trio thread
