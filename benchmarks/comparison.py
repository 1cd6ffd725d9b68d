"""The designs trio_pd is compared with, built from its public parts (benchmarks only).

* :class:`InlineHandshakes`: vLLM before PR #19836 -- a pull whose engine is
  not ready holds one connector-wide lock until its handshake (and its small
  pull) is done, so every other pull waits behind every handshake.
* :class:`NixlOnEventLoop`: the NIXL backend with every NIXL call made on the
  trio thread, as a naive integration would (the loop stalls for each call).
* :class:`OneLoadPerCall`: the NIXL backend loading one remote agent per
  worker-thread call, as before the loads queued together went to one thread
  (benchmark 6, scale).
* :class:`RecordingNixlBackend` and :func:`raw_replay_loads`: the remote-agent
  loads of a trio_pd handshake storm, recorded and replayed with NIXL directly
  from a plain thread, so head-of-line blocking has a raw NIXL anchor.

The raw NIXL reads that trio_pd is measured against are
``trio_pd.testing.CapturedBackends`` and ``raw_nixl_read`` (the demo measures
one too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import trio

import trio_pd
from trio_pd.testing import raw_nixl_read

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

    async def load_remotes(self, requests: Sequence[Any], loaded: Any) -> None:
        for index, request in enumerate(requests):  # one load per call, as a naive loop would

            def report(_: int, outcome: Any, index: int = index) -> None:
                loaded(index, outcome)

            await super().load_remotes([request], report)


class OneLoadPerCall(trio_pd.NixlBackend):
    """The NIXL backend as it was before loads were batched: one worker-thread
    call (and one trip through the trio loop) per remote-agent load."""

    async def load_remotes(self, requests: Sequence[Any], loaded: Any) -> None:
        for index, request in enumerate(requests):

            def report(_: int, outcome: Any, index: int = index) -> None:
                loaded(index, outcome)

            await super().load_remotes([request], report)


@attrs.frozen
class RecordedLoad:
    """One remote-agent load of a connector: when it began and what it loaded."""

    began: float  # trio.current_time()
    agent_name: str
    agent_metadata: bytes
    layout: trio_pd.KVLayout


class RecordingNixlBackend(trio_pd.NixlBackend):
    """The NIXL backend, recording every remote agent it loads (in :attr:`loads`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[RecordedLoad] = []

    async def load_remotes(self, requests: Sequence[Any], loaded: Any) -> None:
        began = trio.current_time()
        self.loads += [
            RecordedLoad(began, r.agent_name, r.agent_metadata, r.layout) for r in requests
        ]
        await super().load_remotes(requests, loaded)


def raw_replay_loads(
    agent: Any, loads: Sequence[tuple[float, RecordedLoad]], done: threading.Event
) -> None:
    """Load each remote agent at its offset (seconds after this call), one after
    the other, as trio_pd's handshake thread does: ``add_remote_agent``,
    ``prep_xfer_dlist`` and ``make_connection`` with NIXL directly; then set
    ``done`` and unload them all. Blocks its caller (a plain thread)."""
    started = time.perf_counter()
    loaded = []
    try:
        for offset, load in loads:
            time.sleep(max(0.0, started + offset - time.perf_counter()))
            name = agent.add_remote_agent(load.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            dlist = agent.prep_xfer_dlist(
                name, load.layout.strided_descriptors(), load.layout.mem_type
            )
            loaded.append((name, dlist))
            agent.make_connection(name)
    finally:
        done.set()
        for name, dlist in loaded:
            dlist.release()
            agent.remove_remote_agent(name)


def raw_paced_reads(
    backend: trio_pd.NixlBackend,
    engine_id: str,
    reads: Sequence[tuple[np.ndarray, bytes]],
    gap: float,
    until: threading.Event | None = None,
) -> list[float]:
    """:func:`raw_nixl_read` of each ``(block ids, notification)``, ``gap`` seconds
    apart, until ``until`` is set (if given); returns each read's seconds."""
    seconds = []
    for block_ids, notification in reads:
        if until is not None and until.is_set():
            break
        seconds.append(raw_nixl_read(backend, engine_id, block_ids, notification))
        time.sleep(gap)
    return seconds
