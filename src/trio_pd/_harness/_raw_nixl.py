"""Raw NIXL READs on a connector's own agent: what trio_pd is measured against.

A connector opened with ``backend=CapturedBackends()`` keeps its
:class:`~trio_pd.NixlBackend`; :func:`raw_nixl_read` then posts a READ of the
very descriptors trio_pd would read, with NIXL directly (no trio, no
threads), on the same agent and prepared lists. The benchmarks and
``trio-pd demo`` compare the two side by side.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from trio_pd._config import ConnectorConfig
from trio_pd._core._layout import BlockIds, KVLayout
from trio_pd._transfer._nixl._backend import NixlBackend


class CapturedBackends:
    """A backend factory (``open_connector(..., backend=captured)``) that keeps
    the NIXL backends it creates, in ``backends``; ``cls``: a subclass of
    :class:`~trio_pd.NixlBackend` to create instead (one that records, say)."""

    def __init__(self, cls: type[NixlBackend] = NixlBackend) -> None:
        self.backends: list[NixlBackend] = []
        self._cls = cls

    async def __call__(
        self,
        agent_name: str,
        kv_caches: Sequence[Any],
        layout: KVLayout,
        config: ConnectorConfig,
    ) -> NixlBackend:
        backend = await self._cls.create(agent_name, kv_caches, layout, config)
        self.backends.append(backend)
        return backend


def raw_nixl_read(
    backend: NixlBackend, engine_id: str, block_ids: BlockIds, notification: bytes = b""
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
    backend: NixlBackend,
    engine_id: str,
    chunks: Sequence[BlockIds],
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
