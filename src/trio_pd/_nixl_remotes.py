"""The remote agents loaded into one NIXL agent: load, prepare, connect, unload.

Every mutation of the agent's view of remote engines -- ``add_remote_agent``,
preparing descriptor lists, ``make_connection``, ``remove_remote_agent`` --
runs here, in a worker thread behind one limiter (one at a time; the
consumer's handshake task is the only caller of :meth:`NixlRemotes.load`).

A load has a deadline (its handshake's) but NIXL calls cannot be
interrupted: at the deadline the worker thread is *abandoned*. It goes on;
if it ever returns, it releases what it loaded itself (nobody takes it).
While it runs, :attr:`NixlRemotes.stuck_call` names the NIXL call it is in
and further loads fail fast: in NIXL's ``rw`` sync mode a load holds the
agent's writer lock, so they would only queue behind it (see the design
page for the measurements).

Trio thread only, except the worker threads, which touch NIXL, their
arguments and their :class:`LoadProgress`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from ._backend import BackendClosing, BackendError, RemoteAgent, RemoteAgents
from ._config import ConnectorConfig
from ._layout import KVLayout
from ._nixl_errors import nixl_errors

logger = logging.getLogger("trio_pd.nixl")

RunBlocking = Callable[..., Awaitable[Any]]
"""``run_blocking(limiter, fn, *args)``: the backend's way to run a NIXL call."""


class LoadProgress:
    """Where a load's worker thread is, shared by that thread and the trio thread.

    The thread names the NIXL call it is in (``call``). :meth:`finish`
    (thread) and :meth:`abandon` (trio) race under a lock: exactly one wins,
    so a load that returns just as it is abandoned is either taken or
    released, never both or neither.
    """

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.call = "waiting for the handshake limiter"
        self.started = time.monotonic()
        self.finished = False
        self.result: Any = None
        self._abandoned = False
        self._lock = threading.Lock()

    def finish(self, result: Any = None) -> bool:
        """(Thread) the load ended (with ``result``, the descriptor list, if it
        loaded); False if the trio side had abandoned it first."""
        with self._lock:
            if not self.finished:
                self.finished, self.result = True, result
            return not self._abandoned

    def abandon(self) -> bool:
        """(Trio) give up on the load; False if it had already finished."""
        with self._lock:
            self._abandoned = True
            return not self.finished


class NixlRemotes:
    """The remote agents of one NIXL agent, and the local descriptor views they use.

    Owns the :class:`RemoteAgents` (leases, retirement), the handshake
    limiter, the local descriptor lists of head-slice views, and the record
    of a stuck load. :meth:`take_all` hands everything to the backend's
    close.

    Args:
        agent: returns the live ``nixl_agent`` (raises ``BackendClosing`` once closed).
        layout: the local layout (its descriptor list is ``local_dlist``).
        local_dlist: the prepared local descriptor list of the whole layout.
        config: ``close_timeout`` bounds unloads.
        run_blocking: how the backend runs a NIXL call in a thread.
    """

    def __init__(
        self,
        agent: Callable[[], Any],
        layout: KVLayout,
        local_dlist: Any,
        config: ConnectorConfig,
        run_blocking: RunBlocking,
    ) -> None:
        self._agent = agent
        self._layout = layout
        self._local_dlist = local_dlist
        self._config = config
        self._run_blocking = run_blocking
        self._remotes = RemoteAgents(self._unload, config.close_timeout)
        self._limiter = trio.CapacityLimiter(1)
        self._views: dict[KVLayout, Any] = {}
        self._stuck: LoadProgress | None = None

    def __len__(self) -> int:
        return len(self._remotes)

    def all(self) -> list[RemoteAgent]:
        return self._remotes.all()

    @property
    def stuck_call(self) -> str:
        """The NIXL call an abandoned load is still in (``""`` once it returned)."""
        stuck = self._stuck
        if stuck is None or stuck.finished:
            return ""
        age = time.monotonic() - stuck.started
        return f"{stuck.call} for agent {stuck.agent_name!r} ({age:.1f} s)"

    async def load(
        self,
        engine_id: str,
        incarnation: str,
        agent_name: str,
        agent_metadata: bytes,
        layout: KVLayout,
        local_layout: KVLayout,
    ) -> RemoteAgent:
        """See :meth:`trio_pd.NixlBackend.load_remote`."""
        for idle in self._remotes.idle_retired():  # held by a transfer that has ended since
            with trio.move_on_after(self._config.close_timeout, shield=True):
                await self._unload(idle)
        revived = self._remotes.revive(engine_id, incarnation, agent_name, layout, local_layout)
        if revived is not None:
            await trio.lowlevel.checkpoint()
            logger.info("engine %s: agent %s still loaded; used again", engine_id, agent_name)
            return revived
        stuck = self.stuck_call
        if stuck:
            await trio.lowlevel.checkpoint()
            raise BackendError(
                f"not loading agent {agent_name!r}: an earlier load is stuck in {stuck}, "
                "and NIXL would queue this one behind it"
            )
        local_dlist = await self._local_view(local_layout)
        progress = LoadProgress(agent_name)
        try:
            dlist = await self._run_blocking(
                self._limiter,
                self._load_blocking,
                agent_name,
                agent_metadata,
                layout,
                progress,
                abandon_on_cancel=True,
            )
        except trio.Cancelled:
            if progress.abandon():
                self._stuck = progress
                logger.error(
                    "loading agent %s: abandoned at its handshake's deadline, still in %s; "
                    "loads fail fast until it returns",
                    agent_name,
                    progress.call,
                )
            elif progress.result is not None:  # it loaded just as it was abandoned
                with trio.move_on_after(self._config.close_timeout, shield=True):
                    await self._run_blocking(
                        self._limiter, release_remote, self._agent(), agent_name, progress.result
                    )
            raise
        remote = RemoteAgent(
            engine_id, incarnation, agent_name, layout, local_layout, dlist, local_dlist
        )
        self._remotes.add(remote)  # from here on, take_all() hands it to close
        return remote

    async def _local_view(self, view: KVLayout) -> Any:
        """The local descriptor list of ``view`` (prepared on first use, kept until close)."""
        if view == self._layout:
            await trio.lowlevel.checkpoint()
            return self._local_dlist
        dlist = self._views.get(view)
        if dlist is None:
            dlist = await self._run_blocking(self._limiter, self._prep_local, view)
            self._views[view] = dlist
        else:
            await trio.lowlevel.checkpoint()
        return dlist

    def _prep_local(self, view: KVLayout) -> Any:
        with nixl_errors("prep_xfer_dlist (local view)"):
            return self._agent().prep_xfer_dlist(
                "NIXL_INIT_AGENT", view.strided_descriptors(), view.mem_type
            )

    def lease(self, remote: RemoteAgent) -> AbstractAsyncContextManager[RemoteAgent]:
        return self._remotes.lease(remote)

    async def retire(self, remote: RemoteAgent) -> None:
        await self._remotes.retire(remote)

    async def _unload(self, remote: RemoteAgent) -> None:
        """Unload a retired remote nobody uses (called by :class:`RemoteAgents`)."""
        if not self._remotes.discard(remote):
            return
        try:
            agent = self._agent()
        except BackendClosing:
            return  # (closed: close released it)
        dlist, remote.handle, remote.local_handle = remote.handle, None, None
        try:
            await self._run_blocking(self._limiter, release_remote, agent, remote.agent_name, dlist)
        except Exception as exc:  # the agent is dead anyway; keep serving others
            logger.warning(
                "engine %s: removing agent %s failed: %s", remote.engine_id, remote.agent_name, exc
            )
        else:
            logger.info("engine %s: removed stale agent %s", remote.engine_id, remote.agent_name)

    def _load_blocking(
        self, agent_name: str, agent_metadata: bytes, layout: KVLayout, progress: LoadProgress
    ) -> Any:
        """Load, prepare and connect (a worker thread); if the trio side
        abandoned it meanwhile, release what it loaded instead of returning it."""
        agent = self._agent()
        progress.call = "add_remote_agent"
        with nixl_errors("add_remote_agent"):
            loaded = agent.add_remote_agent(agent_metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            if loaded_name != agent_name:
                raise BackendError(
                    f"metadata names agent {loaded_name!r}, reply said {agent_name!r}"
                )
            progress.call = "prep_xfer_dlist"
            with nixl_errors("prep_xfer_dlist"):
                dlist = agent.prep_xfer_dlist(
                    loaded_name, layout.strided_descriptors(), layout.mem_type
                )
            try:
                # Connect now (UCX wire-up) rather than in the first pull.
                progress.call = "make_connection"
                with nixl_errors("make_connection"):
                    agent.make_connection(loaded_name)
                if not progress.finish(dlist):  # abandoned by the trio side: nobody takes it
                    raise BackendError("abandoned")
            except BaseException:
                dlist.release()
                raise
        except BaseException:
            try:
                agent.remove_remote_agent(loaded_name)
            except Exception:
                logger.exception("could not remove half-loaded agent %s", loaded_name)
            raise
        finally:
            progress.finish()
        return dlist

    def take_all(self) -> tuple[list[tuple[str, Any]], list[Any]]:
        """At close: forget every remote agent and view; return ``(remote agents as
        (name, descriptor list), view descriptor lists)`` for the caller to release."""
        remotes = self._remotes.all()
        for remote in remotes:
            self._remotes.discard(remote)
        handles = [(remote.agent_name, remote.handle) for remote in remotes]
        for remote in remotes:
            remote.handle = remote.local_handle = None
        views = list(self._views.values())
        self._views.clear()
        self._local_dlist = None
        return handles, views


def release_remote(agent: Any, agent_name: str, dlist: Any) -> None:
    """Release a remote agent's descriptor list, then remove the agent (a worker thread)."""
    try:
        if dlist is not None:
            dlist.release()
    finally:
        agent.remove_remote_agent(agent_name)
