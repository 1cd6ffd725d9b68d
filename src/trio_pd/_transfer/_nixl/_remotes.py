"""The remote agents loaded into one NIXL agent: load, prepare, connect, unload.

Every mutation of the agent's view of remote engines -- ``add_remote_agent``,
preparing descriptor lists, ``make_connection``, ``remove_remote_agent`` --
runs here, in a worker thread behind one limiter (one at a time; the
consumer's handshake task is the only caller of :meth:`NixlRemotes.load_many`).

Loads come in batches (the loads queued together): one worker thread runs a
batch's loads one after the other, and reports each to the trio thread as it
ends (``TrioToken.run_sync_soon``), so a batch costs one thread hop, not one
per load, and no load waits for the trio loop to start the next.

A load has a deadline (its handshake's) but NIXL calls cannot be
interrupted: at the deadline, or when the caller is cancelled (the
connector closing), a load the thread has not begun is skipped, and one it
is in is *abandoned*. The thread goes on; if that call ever returns, it
releases what it loaded itself (nobody takes it) and skips the rest of the
batch. While it runs, :attr:`NixlRemotes.stuck_call` names the NIXL call it
is in, and why it was abandoned, and further loads fail fast: in NIXL's
``rw`` sync mode a load holds the agent's writer lock, so they would only
queue behind it (see the design page for the measurements). The backend's
close waits for that thread (:meth:`NixlRemotes.wait_idle`, bounded by
``close_timeout``) before it releases the agent.

Trio thread only, except the worker threads, which touch NIXL, their
arguments and their :class:`LoadProgress`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._core._layout import KVLayout
from trio_pd._transfer._backend import (
    BackendClosing,
    BackendError,
    Loaded,
    LoadRequest,
    RemoteAgent,
    RemoteAgents,
)
from trio_pd._transfer._nixl._errors import nixl_call

logger = logging.getLogger("trio_pd.nixl")

RunBlocking = Callable[..., Awaitable[Any]]
"""``run_blocking(limiter, fn, *args)``: the backend's way to run a NIXL call."""

AT_DEADLINE = "abandoned at its handshake's deadline"
"""Why a load was abandoned, when its deadline passed (the other: cancelled)."""


def _abandoned_because(exc: BaseException) -> str:
    """Why a batch's caller gave up on its loads, for the logs."""
    if isinstance(exc, trio.Cancelled) or (
        isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None
    ):
        return "abandoned when its caller was cancelled"
    return f"abandoned after {type(exc).__name__}"


class LoadProgress:
    """Where one load of a batch is, shared by the batch's thread and the trio thread.

    The thread names the NIXL call it is in (``call``). :meth:`begin` and
    :meth:`finish` (thread) race :meth:`abandon` (trio) under a lock (one per
    batch): a load abandoned before it began is never begun, and one that
    returns just as it is abandoned is either taken or released, never both
    or neither.
    """

    def __init__(self, agent_name: str, lock: threading.Lock | None = None) -> None:
        self.agent_name = agent_name
        self.call = "waiting for the handshake limiter"
        self.started = time.monotonic()
        self.running = False
        self.finished = False
        self.result: Any = None
        self.why = ""
        """Why the trio side abandoned it: at its deadline, or cancelled."""
        self._abandoned = False
        self._lock = lock or threading.Lock()

    def begin(self) -> bool:
        """(Thread) start the load; False if it was abandoned first (then skip it)."""
        with self._lock:
            if self._abandoned:
                self.finished = True
                return False
            self.running, self.started = True, time.monotonic()
            return True

    def finish(self, result: Any = None) -> bool:
        """(Thread) the load ended (with ``result``, the descriptor list, if it
        loaded); False if the trio side had abandoned it first."""
        with self._lock:
            if not self.finished:  # (abandoned: the thread releases it; not kept here)
                self.finished = True
                self.result = None if self._abandoned else result
            return not self._abandoned

    def abandon(self, why: str = "") -> bool:
        """(Trio) give up on the load (``why``: for the logs); True if the thread
        is in it now (stuck)."""
        with self._lock:
            self._abandoned = True
            self.why = self.why or why
            return self.running and not self.finished


@attrs.define(eq=False)
class _Load:
    """One load of a batch: the request, its progress, and its end as the trio side sees it."""

    index: int
    request: LoadRequest
    progress: LoadProgress
    local_dlist: Any
    deadline: float  # (time.monotonic(): the thread skips a load not begun by then)
    done: trio.Event = attrs.field(factory=trio.Event)
    error: BaseException | None = None


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
    def idle(self) -> bool:
        """Whether no load or unload runs (or is stuck) in a worker thread: none
        holds NIXL's writer lock. (trio releases the limiter of an abandoned
        thread only once the thread returns.)"""
        return self._limiter.borrowed_tokens == 0 and not self.stuck_call

    @property
    def stuck_call(self) -> str:
        """The NIXL call an abandoned load is still in, and why it was
        abandoned (``""`` once it returned)."""
        stuck = self._stuck
        if stuck is None or stuck.finished:
            return ""
        age = time.monotonic() - stuck.started
        why = f"; {stuck.why}" if stuck.why else ""
        return f"{stuck.call} for agent {stuck.agent_name!r} ({age:.1f} s{why})"

    async def wait_idle(self) -> None:
        """Until no load or unload runs in a worker thread, an abandoned one
        included (bound it with a cancel scope).

        trio gives the limiter back for an abandoned thread only when the
        thread returns; once this holds the limiter, the thread has released
        what it loaded and nobody took. The backend's close waits here.
        """
        async with self._limiter:
            pass

    async def load_many(self, requests: Sequence[LoadRequest], loaded: Loaded) -> None:
        """See :meth:`trio_pd.NixlBackend.load_remotes`."""
        for idle in self._remotes.idle_retired():  # held by a transfer that has ended since
            with trio.move_on_after(self._config.close_timeout, shield=True):
                await self._unload(idle)
        start = 0
        while start < len(requests):  # (an agent loads once: a name seen again waits a batch)
            names: set[str] = set()
            end = start
            while end < len(requests) and requests[end].agent_name not in names:
                names.add(requests[end].agent_name)
                end += 1
            await self._load_batch(list(enumerate(requests))[start:end], loaded)
            start = end

    async def _load_batch(self, requests: list[tuple[int, LoadRequest]], loaded: Loaded) -> None:
        """Load ``requests`` (distinct agents) in one worker thread, reporting each."""
        lock = threading.Lock()
        loads: list[_Load] = []
        for index, request in requests:
            try:
                revived = self._remotes.revive(
                    request.engine_id,
                    request.incarnation,
                    request.agent_name,
                    request.layout,
                    request.local_layout,
                )
                if revived is None:
                    stuck = self.stuck_call
                    if stuck:
                        raise self._stuck_error(request.agent_name, stuck)
                    local_dlist = await self._local_view(request.local_layout)
            except BackendError as exc:  # (in use with other views; stuck; a view failed)
                loaded(index, exc)
                continue
            if revived is not None:
                logger.info(
                    "engine %s: agent %s still loaded; used again",
                    request.engine_id,
                    request.agent_name,
                )
                loaded(index, revived)
                continue
            timeout = request.deadline - trio.current_time()
            progress = LoadProgress(request.agent_name, lock)
            loads.append(_Load(index, request, progress, local_dlist, time.monotonic() + timeout))
        await trio.lowlevel.checkpoint()
        if not loads:
            return
        token = trio.lowlevel.current_trio_token()
        keep = {remote.agent_name for remote in self._remotes.all()}  # (the thread's from here)
        late: list[_Load] = []  # loaded, but not taken: released below
        failure: BaseException | None = None  # (BackendClosing, or a bug in the thread)
        taken = 0
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_thread, loads, token, keep)
                for load in loads:
                    with trio.move_on_at(load.request.deadline):
                        await load.done.wait()
                    if load.done.is_set():
                        if load.error is not None and not isinstance(load.error, BackendError):
                            failure = load.error
                            break
                        taken += 1
                        loaded(load.index, self._take(load))
                        continue
                    taken += 1
                    stuck = self._give_up(load, late, AT_DEADLINE)
                    loaded(load.index, None)
                    if stuck:  # the rest would queue behind NIXL's writer lock: fail fast
                        for rest in loads[taken:]:
                            self._give_up(rest, late, AT_DEADLINE)
                            loaded(rest.index, self._stuck_error(rest.request.agent_name, stuck))
                        taken = len(loads)
                        break
                nursery.cancel_scope.cancel()  # (a thread still in a stuck call is abandoned)
            if failure is not None:
                raise failure
        except BaseException as exc:  # cancelled or closing: give up on every load left
            why = _abandoned_because(exc)
            for load in loads[taken:]:
                self._give_up(load, late, why)
            raise
        finally:
            for load in late:  # (each shielded, with its deadline, inside)
                await self._release_late(load)  # noqa: ASYNC102

    async def _release_late(self, load: _Load) -> None:
        """Release a load that ended but was not taken. While a load is stuck
        (its thread holds the limiter) it is kept as a retired agent instead,
        unloaded at the next chance (:meth:`_unload`) or at close."""
        if self.stuck_call:
            self._remote_of(load).retired = True
            await trio.lowlevel.checkpoint()
            return
        try:
            agent = self._agent()
        except BackendClosing:
            await trio.lowlevel.checkpoint()
            return  # (closed: the agent is destroyed with every remote agent in it)
        name, dlist = load.request.agent_name, load.progress.result
        with trio.move_on_after(self._config.close_timeout, shield=True):
            try:
                await self._run_blocking(self._limiter, release_remote, agent, name, dlist)
            except BackendError as exc:  # (as in _unload: the agent is no use to anyone)
                logger.warning("removing agent %s, loaded too late, failed: %s", name, exc)

    def _give_up(self, load: _Load, late: list[_Load], why: str) -> str:
        """Abandon ``load`` (``why``: its deadline passed, an earlier one is
        stuck, or the caller was cancelled); if the thread is in it, it is
        stuck: return the call it is in. One that loaded but was not taken
        goes to ``late``.

        Stuck at its deadline is an error (NIXL hangs); cancelled in a call
        is what closing during any load does: the close waits for the
        thread (see :meth:`wait_idle`), and says so only if it waits in vain.
        """
        if load.progress.abandon(why):
            self._stuck = load.progress
            logger.log(
                logging.ERROR if why == AT_DEADLINE else logging.INFO,
                "loading agent %s: %s, still in %s; loads fail fast until it returns",
                load.request.agent_name,
                why,
                load.progress.call,
            )
            return self.stuck_call
        if load.progress.result is not None:
            late.append(load)  # (it loaded just as it was abandoned)
        return ""

    def _take(self, load: _Load) -> RemoteAgent | BackendError | None:
        """The outcome of a load the thread finished (or skipped, past its deadline)."""
        if isinstance(load.error, BackendError):
            return load.error
        if load.progress.result is None:
            return None  # (skipped: its deadline passed before the thread began it)
        return self._remote_of(load)

    def _remote_of(self, load: _Load) -> RemoteAgent:
        """The agent ``load`` loaded, recorded (from here on, take_all() hands it to close)."""
        request = load.request
        remote = RemoteAgent(
            request.engine_id,
            request.incarnation,
            request.agent_name,
            request.layout,
            request.local_layout,
            load.progress.result,
            load.local_dlist,
        )
        self._remotes.add(remote)
        return remote

    async def _run_thread(
        self, loads: list[_Load], token: trio.lowlevel.TrioToken, keep: set[str]
    ) -> None:
        with contextlib.suppress(BackendError, BackendClosing):  # (reported per load)
            await self._run_blocking(
                self._limiter, self._load_all_blocking, loads, token, keep, abandon_on_cancel=True
            )

    @staticmethod
    def _stuck_error(agent_name: str, stuck: str) -> BackendError:
        return BackendError(
            f"not loading agent {agent_name!r}: an earlier load is stuck in {stuck}, "
            "and NIXL would queue this one behind it"
        )

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
        agent = self._agent()
        return nixl_call(
            "prep_xfer_dlist (local view)",
            agent.prep_xfer_dlist,
            "NIXL_INIT_AGENT",
            view.strided_descriptors(),
            view.mem_type,
        )

    def lease(self, remote: RemoteAgent) -> AbstractAsyncContextManager[RemoteAgent]:
        return self._remotes.lease(remote)

    async def retire(self, remote: RemoteAgent) -> None:
        await self._remotes.retire(remote)

    async def _unload(self, remote: RemoteAgent) -> None:
        """Unload a retired remote nobody uses (called by :class:`RemoteAgents`).

        While a load is stuck, its thread holds the limiter the unload needs:
        the remote stays loaded (retired, idle) and is unloaded at the next
        load once it returned, or at close.
        """
        if self.stuck_call:
            await trio.lowlevel.checkpoint()
            return
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

    def _load_all_blocking(
        self, loads: list[_Load], token: trio.lowlevel.TrioToken, keep: set[str]
    ) -> None:
        """Run a batch's loads one after the other (a worker thread), telling the
        trio thread as each ends; skip those abandoned or past their deadline.
        ``keep``: the agents loaded before (and by this batch), which a failed
        load never removes."""
        for load in loads:
            progress = load.progress
            if time.monotonic() >= load.deadline:
                progress.abandon()  # (its deadline passed before its turn)
            if progress.begin():
                try:
                    self._load_blocking(load.request, progress, keep)
                # (a plain thread: reported to the trio side, which re-raises bugs)
                except BaseException as exc:  # noqa: ASYNC103
                    # Its finished frames hold NIXL handles, which hold the
                    # agent: an abandoned load's error would keep it alive.
                    traceback.clear_frames(exc.__traceback__)
                    load.error = exc
                else:
                    keep.add(load.request.agent_name)
                finally:
                    progress.finish()  # (ended, whichever way: no longer stuck)
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(load.done.set)

    def _load_blocking(self, request: LoadRequest, progress: LoadProgress, keep: set[str]) -> None:
        """Load, prepare and connect (a worker thread); if the trio side
        abandoned it meanwhile, release what it loaded instead of handing it
        over (``progress.result`` is the descriptor list to take).

        What NIXL loaded is removed on failure, unless it is in ``keep``:
        metadata of an agent loaded already (another engine's, under a name
        of its own: a forged reply) loads nothing, and that agent stays.
        """
        agent = self._agent()
        progress.call = "add_remote_agent"
        loaded = nixl_call("add_remote_agent", agent.add_remote_agent, request.agent_metadata)
        raw = loaded if isinstance(loaded, bytes) else str(loaded).encode()
        try:
            loaded_name: str | bytes = raw.decode()
        except UnicodeDecodeError:  # (forged: NIXL takes the name as bytes too)
            loaded_name = raw
        agent_name = request.agent_name
        try:
            if loaded_name != agent_name:
                named = raw.decode(errors="backslashreplace")
                raise BackendError(f"metadata names agent {named!r}, reply said {agent_name!r}")
            progress.call = "prep_xfer_dlist"
            layout = request.layout
            dlist = nixl_call(
                "prep_xfer_dlist",
                agent.prep_xfer_dlist,
                agent_name,
                layout.strided_descriptors(),
                layout.mem_type,
            )
            try:
                # Connect now (UCX wire-up) rather than in the first pull.
                progress.call = "make_connection"
                nixl_call("make_connection", agent.make_connection, agent_name)
                if not progress.finish(dlist):  # abandoned by the trio side: nobody takes it
                    raise BackendError("abandoned")
            except BaseException:
                try:  # (best effort: the load's own error is what is raised)
                    nixl_call("release", dlist.release)
                except BackendError as exc:
                    logger.error("could not release a half-loaded agent's descriptors: %s", exc)
                raise
        except BaseException:
            if loaded_name not in keep:
                try:
                    nixl_call("remove_remote_agent", agent.remove_remote_agent, loaded_name)
                except BackendError as exc:
                    logger.error("could not remove half-loaded agent %r: %s", loaded_name, exc)
            raise

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
    """Release a remote agent's descriptor list, then remove the agent (a worker thread).

    Raises:
        BackendError: NIXL refused either (``_errors``' mapping).
    """
    try:
        if dlist is not None:
            nixl_call("release", dlist.release)
    finally:
        nixl_call("remove_remote_agent", agent.remove_remote_agent, agent_name)
