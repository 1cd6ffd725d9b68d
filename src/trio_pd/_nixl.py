"""The NIXL transfer backend (thin I/O shell around one NIXL agent).

NIXL calls can block for milliseconds to seconds (on one host a
``transfer()`` *is* the copy; preparing a large descriptor list takes tens of
ms), so none of them runs on the trio thread:

* the data plane -- every READ, its polling and release, and notifications
  sent -- belongs to one thread, the :class:`~trio_pd._driver.TransferDriver`
  (see that module): pulls hand it jobs and wait on trio Events;
* every mutation of the agent's view of remote engines -- ``add_remote_agent``,
  preparing descriptor lists, ``make_connection``, ``remove_remote_agent`` --
  runs in a worker thread behind the ``handshake`` limiter (one at a time);
* the producer's notification polls run behind the ``notifications``
  limiter (one thread); they also advance the agent (NIXL's own progress
  thread is off by default: it keeps a core busy per agent).

The agent is created with an explicit thread-sync mode (reader/writer lock by
default) because these threads call it concurrently.

What threads touch: NIXL, the arguments they are given, a
:class:`threading.Event` that says the backend is closing, and (the driver)
its jobs. Every other piece of Python state (the loaded remote agents, their
leases) changes on the trio thread only.

Ownership: a :class:`NixlBackend` owns the agent, its memory registration, the
local descriptor lists, every :class:`RemoteAgent` it loaded, and its transfer
driver (which owns every transfer handle). :meth:`NixlBackend.aclose` stops the
driver and releases all of them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt
import trio

from ._backend import (
    NO_UNSETTLED,
    BackendClosing,
    BackendError,
    RemoteAgent,
    RemoteAgents,
    TransferTimeout,
    UnsettledHook,
)
from ._config import ConnectorConfig
from ._driver import Job, Outcome, TransferDriver
from ._layout import KVLayout
from ._nixl_errors import describe as _describe
from ._nixl_errors import nixl_errors as _nixl_errors

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    import torch

logger = logging.getLogger("trio_pd.nixl")

_T = TypeVar("_T")


_KEPT_FOR_RUNNING_TRANSFERS: list[NixlBackend] = []
"""Backends closed while a transfer NIXL could not stop still ran: kept alive
(agent, registrations, the KV tensors) so that it never writes freed memory."""

READS_EXPECTED_FOR = 0.5
"""How long after blocks are exposed, or a notification arrives, the producer
drives its agent at full rate (``poll_interval``) before it backs off."""


def _drop_locals(exc: BaseException) -> None:
    """Clear the locals of the finished worker frames in ``exc``'s tracebacks.

    Those frames hold NIXL handles, and every handle holds the agent: an error
    kept by a caller would otherwise keep the agent (and its sockets) alive
    after the connector closed.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


class NixlBackend:
    """The real transfer backend: one NIXL agent and everything on it.

    Create it with :meth:`create` (the default ``backend`` of
    :func:`~trio_pd.open_connector`); the connector calls :meth:`aclose` once,
    when no other call is in flight.

    :attr:`agent` and :attr:`local_descriptors` are public for measurements
    that compare trio_pd with raw NIXL calls on the very same agent (see
    ``benchmarks/``); calling NIXL on them while the connector runs is at
    your own risk.
    """

    def __init__(
        self,
        agent: Any,
        registration: Any,
        local_dlist: Any,
        layout: KVLayout,
        config: ConnectorConfig,
        kv_caches: Sequence[torch.Tensor] = (),
    ) -> None:
        self.layout = layout
        self._kv_caches = list(kv_caches)  # (referenced: kept alive while registered)
        self._agent_name: str = agent.name
        self._agent = agent
        self._registration = registration
        self._local_dlist = local_dlist
        self._config = config
        self._trio_thread = threading.current_thread()
        self._remotes = RemoteAgents(self._unload, config.close_timeout)
        self._closing = threading.Event()
        self._driver = TransferDriver(agent, agent.name, config)
        self._driver.start()
        self._handshake_limiter = trio.CapacityLimiter(1)
        self._local_views: dict[KVLayout, Any] = {}
        self._notification_limiter = trio.CapacityLimiter(1)
        # The notification thread's pacing (see notifications()):
        self._poll_pause = config.poll_interval
        self._expecting_until = 0.0
        self._reads_expected = threading.Event()
        self._unsettled = 0
        self._stuck_load: _LoadProgress | None = None
        self.job_observer: Callable[[Job], None] | None = None
        """Called on the trio thread with every finished job (measurements:
        the benchmarks break a pull's time down with the job's timestamps)."""

    # ---- life cycle -----------------------------------------------------

    @classmethod
    async def create(
        cls,
        agent_name: str,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        config: ConnectorConfig,
    ) -> NixlBackend:
        """Create the agent, register ``kv_caches`` and prepare the local list.

        Runs in a worker thread: the first agent of a process starts UCX
        (0.4-1.6 s measured here), later ones take about 0.03 s.
        On failure everything already created is released.

        Raises:
            BackendError: NIXL could not create the agent or its backends
                (an unknown name in ``config.nixl_backends``, say), register
                the memory or prepare the descriptors.
        """
        try:
            parts = await trio.to_thread.run_sync(
                _create_blocking, agent_name, kv_caches, layout, config
            )
        except BackendError as exc:
            _drop_locals(exc)
            raise
        return cls(*parts, layout, config, kv_caches)

    @property
    def agent_name(self) -> str:
        return self._agent_name

    @property
    def agent(self) -> Any:
        """The ``nixl_agent`` (``None`` once closed)."""
        return self._agent

    @property
    def local_descriptors(self) -> Any:
        """The prepared local descriptor list (one descriptor per region x block)."""
        return self._local_dlist

    def remote_agents(self) -> list[RemoteAgent]:
        """The remote agents loaded now (for measurements, like :attr:`agent`)."""
        return self._remotes.all()

    @property
    def remote_agents_loaded(self) -> int:
        """Remote agents loaded now (retired ones count until unloaded)."""
        return len(self._remotes)

    @property
    def transfers_posted(self) -> int:
        """READs the transfer driver posted (several small pulls may share one)."""
        return self._driver.transfers_posted

    @property
    def transfers_unsettled(self) -> int:
        """Failed reads whose transfer could not be stopped and still runs."""
        return self._unsettled

    @property
    def stuck_call(self) -> str:
        """The NIXL call an abandoned load is still in (``""`` once it returned)."""
        stuck = self._stuck_load
        if stuck is None or stuck.finished:
            return ""
        age = time.monotonic() - stuck.started
        return f"{stuck.call} for agent {stuck.agent_name!r} ({age:.1f} s)"

    def agent_metadata(self) -> bytes:
        data: bytes = self._live_agent().get_agent_metadata()
        return data

    def begin_close(self) -> None:
        """Tell in-flight transfers to stop; the driver notices within a turn."""
        self._closing.set()
        self._driver.begin_close()

    async def aclose(self) -> None:
        """Stop the driver, then release remote agents, descriptor lists and memory.

        Idempotent. Stopping the driver waits (at most ``close_timeout``) for
        its running transfers to stop. If one still runs then (NIXL cannot
        stop it), nothing is released: the agent, its registrations and the
        KV tensors are kept for the life of the process (logged as an
        error), since a transfer may still write that memory. The releases run in a
        worker thread that is not abandoned (freeing registrations under a
        running NIXL call would crash); each takes
        milliseconds. The bookkeeping is dropped here, on the trio thread.
        """
        self._closing.set()
        agent = self._agent
        if agent is None:
            await trio.lowlevel.checkpoint()
            return
        await self._driver.stop()
        if self._driver.transfers_kept:
            # Deregistering (or letting the caller free the tensors) under a
            # running transfer lets it write into freed memory: keep it all.
            _KEPT_FOR_RUNNING_TRANSFERS.append(self)
            logger.error(
                "agent %s closed with %d transfers still running: its agent, remote agents "
                "and KV-cache memory stay registered (and the tensors referenced) for the "
                "life of the process",
                self._agent_name,
                self._driver.transfers_kept,
            )
            return
        remotes = self._remotes.all()
        for remote in remotes:
            self._remotes.discard(remote)
        handles = [(remote.agent_name, remote.handle) for remote in remotes]
        for remote in remotes:
            remote.handle = remote.local_handle = None
        views = list(self._local_views.values())
        owned = (self._local_dlist, self._registration)
        # Handle wrappers keep the agent alive: drop every reference to them.
        self._local_views.clear()
        self._local_dlist = self._registration = self._agent = None
        self._kv_caches = []
        await trio.to_thread.run_sync(self._close_blocking, agent, handles, views, *owned)

    def _close_blocking(
        self,
        agent: Any,
        remotes: list[tuple[str, Any]],
        views: list[Any],
        local_dlist: Any,
        registration: Any,
    ) -> None:
        errors: list[str] = []

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:  # best effort: release the rest regardless
                errors.append(f"{what}: {_describe(exc)}")

        for name, dlist in remotes:
            attempt(f"unload {name}", functools.partial(_release_remote, agent, name, dlist))
        for view_dlist in views:
            attempt("release a local view's descriptor list", view_dlist.release)
        attempt("release local descriptor list", local_dlist.release)
        attempt("deregister memory", lambda: agent.deregister_memory(registration))
        if errors:
            logger.warning("agent %s closed with errors: %s", self._agent_name, "; ".join(errors))

    # ---- remote agents (load: the consumer's handshake task only) -------

    async def load_remote(
        self,
        engine_id: str,
        incarnation: str,
        agent_name: str,
        agent_metadata: bytes,
        layout: KVLayout,
        local_layout: KVLayout,
    ) -> RemoteAgent:
        """Load a remote agent, prepare its descriptor list and connect (handshake thread).

        A local view other than the whole local layout (a head slice) gets
        its own local descriptor list, prepared once and kept until close.
        An agent of that name still loaded (retired, but held by pulls or by
        a transfer that could not be stopped) is used again if it is the
        same (see :meth:`RemoteAgents.revive`).

        Raises:
            BackendError: NIXL rejected the metadata or the descriptors, or
                could not connect; nothing of this engine stays loaded. An
                agent of that name is still loaded with other views.
        """
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
        progress = _LoadProgress(agent_name)
        try:
            dlist = await trio.to_thread.run_sync(
                self._load_blocking,
                agent_name,
                agent_metadata,
                layout,
                progress,
                limiter=self._handshake_limiter,
                abandon_on_cancel=True,
            )
        except trio.Cancelled:
            if progress.abandon():
                self._stuck_load = progress
                logger.error(
                    "loading agent %s: abandoned at its handshake's deadline, still in %s; "
                    "loads fail fast until it returns",
                    agent_name,
                    progress.call,
                )
            elif progress.result is not None:  # it loaded just as it was abandoned
                with trio.move_on_after(self._config.close_timeout, shield=True):
                    await self.run_blocking(
                        self._handshake_limiter,
                        _release_remote,
                        self._agent,
                        agent_name,
                        progress.result,
                    )
            raise
        except (BackendError, BackendClosing) as exc:
            _drop_locals(exc)
            raise
        remote = RemoteAgent(
            engine_id, incarnation, agent_name, layout, local_layout, dlist, local_dlist
        )
        self._remotes.add(remote)  # from here on, aclose() releases it
        return remote

    async def _local_view(self, view: KVLayout) -> Any:
        """The local descriptor list of ``view`` (prepared on first use)."""
        if view == self.layout:
            await trio.lowlevel.checkpoint()
            return self._local_dlist
        dlist = self._local_views.get(view)
        if dlist is None:
            dlist = await self.run_blocking(self._handshake_limiter, self._prep_local, view)
            self._local_views[view] = dlist
        else:
            await trio.lowlevel.checkpoint()
        return dlist

    def _prep_local(self, view: KVLayout) -> Any:
        with _nixl_errors("prep_xfer_dlist (local view)"):
            return self._live_agent().prep_xfer_dlist(
                "NIXL_INIT_AGENT", view.strided_descriptors(), view.mem_type
            )

    def lease(self, remote: RemoteAgent) -> AbstractAsyncContextManager[RemoteAgent]:
        return self._remotes.lease(remote)

    async def retire(self, remote: RemoteAgent) -> None:
        await self._remotes.retire(remote)

    async def _unload(self, remote: RemoteAgent) -> None:
        """Unload a retired remote nobody uses (called by :class:`RemoteAgents`)."""
        if not self._remotes.discard(remote) or self._agent is None:
            return
        dlist, remote.handle, remote.local_handle = remote.handle, None, None
        try:
            await self.run_blocking(
                self._handshake_limiter, _release_remote, self._agent, remote.agent_name, dlist
            )
        except Exception as exc:  # the agent is dead anyway; keep serving others
            logger.warning(
                "engine %s: removing agent %s failed: %s", remote.engine_id, remote.agent_name, exc
            )
        else:
            logger.info("engine %s: removed stale agent %s", remote.engine_id, remote.agent_name)

    def _load_blocking(
        self, agent_name: str, agent_metadata: bytes, layout: KVLayout, progress: _LoadProgress
    ) -> Any:
        """Load, prepare and connect (a worker thread); if the trio side
        abandoned it meanwhile, release what it loaded instead of returning it."""
        agent = self._live_agent()
        progress.call = "add_remote_agent"
        with _nixl_errors("add_remote_agent"):
            loaded = agent.add_remote_agent(agent_metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            if loaded_name != agent_name:
                raise BackendError(
                    f"metadata names agent {loaded_name!r}, reply said {agent_name!r}"
                )
            progress.call = "prep_xfer_dlist"
            with _nixl_errors("prep_xfer_dlist"):
                dlist = agent.prep_xfer_dlist(
                    loaded_name, layout.strided_descriptors(), layout.mem_type
                )
            try:
                # Connect now (UCX wire-up) rather than in the first pull.
                progress.call = "make_connection"
                with _nixl_errors("make_connection"):
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

    # ---- data plane -----------------------------------------------------

    async def read(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        unsettled: UnsettledHook = NO_UNSETTLED,
    ) -> None:
        """READ the remote descriptors into the local ones, with a notification.

        Hands the read to the transfer driver and waits for it;
        ``config.transfer_timeout`` counts from then. When this returns or
        raises, the driver has released every transfer of the read, or --
        the one exception -- the error says that one still runs: on
        cancellation, timeout, close or an error the driver stops posting
        and waits (up to ``close_timeout``) for what runs to end. A transfer
        still running then (its peer unreachable: NIXL cannot cancel it) is
        kept and polled until it really ends; ``unsettled`` is told (see
        :meth:`TransferBackend.read`), whichever way this exits; unless the
        caller was cancelled, the read raises :class:`BackendError` with
        ``peer_lost`` and ``settled``; the remote agent is retired, and it
        stays loaded (held) until then.

        Raises:
            BackendError: NIXL reported ERR or raised; or a transfer could
                not be stopped (``peer_lost`` and ``settled`` set: the local
                blocks may be written until ``settled`` is set).
            TransferTimeout: ``config.transfer_timeout`` passed.
            BackendClosing: the connector began closing.
            trio.Cancelled: the calling task was cancelled.
        """
        job = self._job(remote, local_indices, remote_indices, notification)
        try:
            await self._run_job(job)
        finally:
            if job.still_running:  # give the agent up, but keep it loaded until then
                self._hold_until_settled(remote, job, unsettled)
                with trio.move_on_after(self._config.close_timeout, shield=True):
                    await self.retire(remote)
        if job.still_running:
            why = job.outcome.value if job.outcome else "?"
            raise BackendError(
                f"a transfer from {remote.agent_name!r} did not stop within "
                f"{self._config.close_timeout:g} s of being told to ({why}; "
                "its peer is unreachable?); the agent was given up, but NIXL cannot "
                "cancel the transfer: its blocks may still be written until it ends "
                "(see TransferError.settled)",
                peer_lost=True,
                settled=job.settled,
            )
        self._raise_for(job)

    async def notify(self, remote: RemoteAgent, message: bytes) -> None:
        """Post a notification without a transfer (a notify-only pull), via the driver.

        Fire and forget: NIXL reports no delivery, so a notification posted
        to a peer that just died is lost silently (the producer's exposure
        then expires).

        Raises:
            BackendError: NIXL could not post it.
            BackendClosing: the connector began closing first.
        """
        empty = np.empty(0, dtype=np.int32)
        job = self._job(remote, empty, empty, message)
        await self._run_job(job)
        self._raise_for(job)

    def _job(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
    ) -> Job:
        self._live_agent()
        config = self._config
        descriptor_bytes = max(remote.local_layout.block_lens)
        chunk = max(
            1,
            min(
                config.max_descriptors_per_transfer,
                config.max_bytes_per_transfer // descriptor_bytes,
            ),
        )
        return Job(
            remote.local_handle,
            remote.handle,
            local_indices,
            remote_indices,
            remote.agent_name,
            notification,
            time.monotonic() + config.transfer_timeout,
            chunk,
            descriptor_bytes,
        )

    async def _run_job(self, job: Job) -> None:
        """Submit ``job`` and wait until it finished, even when cancelled.

        A cancelled wait asks the driver to stop the job and waits, shielded,
        for it to say so: within ``close_timeout`` plus a turn.
        """
        self._driver.submit(job)
        try:
            await job.finished.wait()
        finally:
            if not job.finished.is_set():
                job.cancel_requested = True
                with trio.CancelScope(shield=True):
                    await job.finished.wait()
            job.woken_at = time.monotonic()
            if self.job_observer is not None:
                self.job_observer(job)

    @staticmethod
    def _raise_for(job: Job) -> None:
        if job.outcome is Outcome.DONE:
            return
        if job.outcome is Outcome.FAILED and job.error is not None:
            raise job.error
        if job.outcome is Outcome.TIMED_OUT:
            raise TransferTimeout
        if job.outcome is Outcome.CLOSING:
            raise BackendClosing
        raise BackendError(f"transfer ended {job.outcome}")  # (CANCELLED: cancel re-raised)

    def _hold_until_settled(self, remote: RemoteAgent, job: Job, unsettled: UnsettledHook) -> None:
        """Keep ``remote`` loaded, and the caller told, until ``job``'s last transfer ended.

        Its descriptor lists are in use by that transfer: it is unloaded
        after it settles (at the next load or at close), not before.
        """
        if not job.settled.is_set():
            remote.users += 1
            self._unsettled += 1
            job.on_settled = functools.partial(self._drop_hold, remote, unsettled())

    def _drop_hold(self, remote: RemoteAgent, settle: Callable[[], None]) -> None:
        remote.users -= 1  # (unloaded by the next load_remote or by aclose)
        self._unsettled -= 1
        settle()

    def expect_reads(self) -> None:
        """Poll at full rate for the next ``READS_EXPECTED_FOR`` (0.5) s (see
        :meth:`notifications`); the notification thread notices within a check."""
        self._reads_expected.set()

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        """Collect new notifications (by sending agent name), waiting up to ``wait`` s.

        The notification thread checks until some arrive or ``wait`` has
        passed. Each check also advances this agent's UCX worker: trio_pd
        runs NIXL without its progress thread (which spins a whole core per
        agent), and consumers' READs wait for our worker's progress
        (measured: a READ whose previous notification the producer has not
        processed yet waits for it, so the producer's pause between checks
        adds to a consumer's pull latency). So while exposures are pending,
        the producer keeps this going:

        * every ``poll_interval`` while reads are expected: within
          :data:`READS_EXPECTED_FOR` s of blocks being exposed
          (:meth:`expect_reads`) or of a notification arriving;
        * otherwise -- exposures nobody reads -- at pauses that double up to
          ``notification_poll_interval``, so stale exposures cost about one
          check per that interval, not one per ``poll_interval``. The first
          READ of such an exposure may wait up to that long, once.

        Raises:
            BackendError: NIXL raised.
        """
        notifs, self._poll_pause, self._expecting_until = await self.run_blocking(
            self._notification_limiter,
            self._notifications_blocking,
            wait,
            self._poll_pause,
            self._expecting_until,
        )
        return notifs

    def _notifications_blocking(
        self, wait: float, pause: float, expecting_until: float
    ) -> tuple[dict[str, list[bytes]], float, float]:
        """Check until notifications arrive or ``wait`` passed.

        Returns them, the next pause and until when reads are expected.
        """
        agent = self._live_agent()
        config = self._config
        now = time.monotonic()
        give_up = now + wait
        while True:
            if self._reads_expected.is_set():
                self._reads_expected.clear()
                expecting_until = now + READS_EXPECTED_FOR
            with _nixl_errors("get_new_notifs"):
                notifs: dict[str, list[bytes]] = agent.get_new_notifs()
            now = time.monotonic()
            if notifs:
                return notifs, config.poll_interval, now + READS_EXPECTED_FOR
            if self._closing.is_set() or now >= give_up:
                return notifs, pause, expecting_until
            self._check_cancelled()
            if now < expecting_until:
                pause = config.poll_interval
            else:
                pause = min(2 * pause, config.notification_poll_interval)
            time.sleep(min(pause, give_up - now))
            now = time.monotonic()

    async def run_blocking(
        self, limiter: trio.CapacityLimiter, fn: Callable[..., _T], *args: Any
    ) -> _T:
        """Run the blocking NIXL call ``fn(*args)``: in a worker thread behind ``limiter``.

        Every NIXL call of this backend goes through here. The thread is not
        abandoned on cancellation: the call always finishes (NIXL calls
        cannot be interrupted), and cancellation reaches it through
        :func:`trio.from_thread.check_cancelled` where it polls. (Benchmarks
        override this to measure NIXL on the trio thread.)
        """
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
        except (BackendError, TransferTimeout, BackendClosing) as exc:
            _drop_locals(exc)
            raise

    def _check_cancelled(self) -> None:
        """In a worker thread: raise ``trio.Cancelled`` if the caller was cancelled."""
        if threading.current_thread() is not self._trio_thread:
            trio.from_thread.check_cancelled()

    def _live_agent(self) -> Any:
        agent = self._agent
        if agent is None:
            raise BackendClosing
        return agent


class _LoadProgress:
    """Where a load's worker thread is, shared by that thread and the trio thread.

    The thread names the NIXL call it is in (``call``). ``finish`` (thread)
    and ``abandon`` (trio) race under a lock: exactly one wins, so a load
    that returns just as it is abandoned is either taken or released, never
    both or neither.
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


def _release_remote(agent: Any, agent_name: str, dlist: Any) -> None:
    """Release a remote agent's descriptor list, then remove the agent (a worker thread)."""
    try:
        if dlist is not None:
            dlist.release()
    finally:
        agent.remove_remote_agent(agent_name)


def _create_blocking(
    agent_name: str,
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    config: ConnectorConfig,
) -> tuple[Any, Any, Any]:
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = {
        "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    }[config.nixl_sync_mode]
    with _nixl_errors(f"creating NIXL agent {agent_name!r}"):
        agent = nixl_agent(
            agent_name,
            nixl_agent_config(
                enable_prog_thread=config.nixl_progress_thread, backends=[], sync_mode=sync
            ),
        )
    for backend in config.nixl_backends:
        params = dict(config.nixl_backend_params.get(backend, {}))
        if config.nixl_num_threads and "num_threads" not in params:
            params["num_threads"] = str(config.nixl_num_threads)
        with _nixl_errors(f"creating NIXL backend {backend!r} of agent {agent_name!r}"):
            agent.create_backend(backend, params)
    registration = None
    # A tensor passed for several regions (layers that share a KV cache) is
    # registered once: registering it twice crashes NIXL on deregistration.
    unique = list({int(t.data_ptr()): t for t in kv_caches}.values())
    try:
        registration = agent.register_memory(unique)
        local_dlist = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", layout.strided_descriptors(), layout.mem_type
        )
    except Exception as exc:
        if registration is not None:
            try:
                agent.deregister_memory(registration)
            except Exception:
                logger.exception("deregistering after a failed open")
        raise BackendError(f"registering KV caches: {_describe(exc)}") from exc
    return agent, registration, local_dlist
