"""The designs trio_pd is compared with, built from its public parts (benchmarks only).

* :class:`InlineHandshakes`: vLLM before PR #19836 -- a pull whose engine is
  not ready holds one connector-wide lock until its handshake (and its small
  pull) is done, so every other pull waits behind every handshake.
* :class:`NixlOnEventLoop`: the NIXL backend with every NIXL call made on the
  trio thread, as a naive integration would (the loop stalls for each call).
* :class:`CapturedBackends` and :func:`raw_nixl_read`: the connector's own
  NIXL agent and prepared descriptor lists, to time raw NIXL READs of exactly
  the descriptors trio_pd reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import torch
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


class CapturedBackends:
    """A backend factory that keeps the NIXL backends it creates."""

    def __init__(self) -> None:
        self.backends: list[trio_pd.NixlBackend] = []

    async def __call__(
        self,
        agent_name: str,
        kv_caches: Sequence[torch.Tensor],
        layout: trio_pd.KVLayout,
        config: trio_pd.ConnectorConfig,
    ) -> trio_pd.NixlBackend:
        backend = await trio_pd.NixlBackend.create(agent_name, kv_caches, layout, config)
        self.backends.append(backend)
        return backend


def raw_nixl_read(
    backend: trio_pd.NixlBackend, engine_id: str, block_ids: np.ndarray, notification: bytes = b""
) -> float:
    """One READ of ``block_ids`` (same ids on both sides) with NIXL directly.

    It uses the connector's own agent and prepared descriptor lists, so trio_pd
    and this read move exactly the same descriptors; it blocks its caller (no
    trio, no threads) and returns the seconds from posting to DONE.
    """
    [remote] = [r for r in backend.remote_agents() if r.engine_id == engine_id and not r.retired]
    agent = backend.agent
    local_idx = backend.layout.descriptor_indices(block_ids)
    remote_idx = remote.layout.descriptor_indices(block_ids)
    started = time.perf_counter()
    handle = agent.make_prepped_xfer(
        "READ", backend.local_descriptors, local_idx, remote.handle, remote_idx, notification
    )
    status = agent.transfer(handle)
    while status == "PROC":
        status = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - started
    assert status == "DONE", status
    handle.release()
    return elapsed


def raw_nixl_read_at_once(
    backend: trio_pd.NixlBackend,
    engine_id: str,
    chunks: Sequence[np.ndarray],
    notifications: Sequence[bytes],
) -> float:
    """One READ per chunk of block ids, all posted at once from this thread, then
    polled together until every one is done; returns the seconds taken."""
    [remote] = [r for r in backend.remote_agents() if r.engine_id == engine_id and not r.retired]
    agent = backend.agent
    started = time.perf_counter()
    handles = []
    for ids, notification in zip(chunks, notifications, strict=True):
        handle = agent.make_prepped_xfer(
            "READ",
            backend.local_descriptors,
            backend.layout.descriptor_indices(ids),
            remote.handle,
            remote.layout.descriptor_indices(ids),
            notification,
        )
        status = agent.transfer(handle)
        assert status in ("DONE", "PROC"), status
        handles.append(handle)
    pending = list(handles)
    while pending:
        pending = [h for h in pending if agent.check_xfer_state(h) == "PROC"]
    elapsed = time.perf_counter() - started
    for handle in handles:
        assert agent.check_xfer_state(handle) == "DONE"
        handle.release()
    return elapsed
