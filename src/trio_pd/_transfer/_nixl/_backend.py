"""The NIXL transfer backend (thin I/O shell around one NIXL agent).

NIXL calls can block for milliseconds to seconds (on one host a
``transfer()`` *is* the copy; preparing a large descriptor list takes tens of
ms), so none of them runs on the trio thread but one bounded exception:

* the data plane -- every READ, its polling and release, and notifications
  sent -- belongs to one thread, the :class:`~trio_pd._transfer._nixl._driver.TransferDriver`
  (see that module): pulls hand it jobs and wait on trio Events; the
  exception: a small READ posted while the driver, the loads and the loop
  are all idle runs on the trio thread itself, for at most one small copy
  and ``inline_read_spin`` (see ``_inline``);
* every mutation of the agent's view of remote engines -- ``add_remote_agent``,
  preparing descriptor lists, ``make_connection``, ``remove_remote_agent`` --
  runs in a worker thread behind one limiter (one at a time; the loads
  queued together in one thread), in
  :class:`~trio_pd._transfer._nixl._remotes.NixlRemotes`; a load past its deadline is
  abandoned, not waited for;
* the producer's notification polls run behind their own limiter (one
  thread), in :class:`~trio_pd._transfer._nixl._notifications.NotificationPoller`; they
  also advance the agent (NIXL's own progress thread is off by default: it
  keeps a core busy per agent).

The agent is created with an explicit thread-sync mode (reader/writer lock by
default) because these threads call it concurrently.

What threads touch: NIXL, the arguments they are given, a
:class:`threading.Event` that says the backend is closing, (the driver) its
jobs, and (a load) its ``LoadProgress``. Every other piece of Python state
(the loaded remote agents, their leases) changes on the trio thread only.

Ownership: a :class:`NixlBackend` owns the agent, its memory registration, the
local descriptor lists, every :class:`RemoteAgent` it loaded, and its transfer
driver (which owns every transfer handle). :meth:`NixlBackend.aclose` stops the
driver and releases all of them -- unless a transfer NIXL could not stop
still runs: then it keeps them all, for the life of the process.
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

from trio_pd._config import ConnectorConfig
from trio_pd._core._layout import KVLayout
from trio_pd._transfer._backend import (
    NO_UNSETTLED,
    BackendClosing,
    BackendError,
    Loaded,
    LoadRequest,
    RemoteAgent,
    TransferTimeout,
    UnsettledHook,
)
from trio_pd._transfer._nixl._agent import create_agent, release_agent
from trio_pd._transfer._nixl._driver import TransferDriver
from trio_pd._transfer._nixl._errors import nixl_call
from trio_pd._transfer._nixl._inline import NOT_TAKEN, InlineReads
from trio_pd._transfer._nixl._jobs import Job, job_for
from trio_pd._transfer._nixl._notifications import NotificationPoller
from trio_pd._transfer._nixl._remotes import NixlRemotes

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    import torch

logger = logging.getLogger("trio_pd.nixl")

_T = TypeVar("_T")


_KEPT_FOR_LIFE: list[NixlBackend] = []
"""Backends closed while a transfer NIXL could not stop still ran, or while a
load was stuck in NIXL: kept alive (agent, registrations, the KV tensors) so
that nothing writes freed memory and close never waits on the stuck call."""


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
        self._closing = threading.Event()
        self._closing_since: float | None = None  # (trio.current_time() of begin_close)
        self._remotes = NixlRemotes(
            self._live_agent, layout, local_dlist, config, self.run_blocking
        )
        self._poller = NotificationPoller(
            self._live_agent, config, self._closing, self.run_blocking
        )
        self._driver = TransferDriver(agent, agent.name, config)
        self._driver.start()
        self._inline = InlineReads(
            self._live_agent, self._driver, config, lambda: self._remotes.idle, self._poller.calls
        )
        self._unsettled = 0
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
                create_agent, agent_name, kv_caches, layout, config
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
        """READs posted (several small pulls may share one), inline reads included."""
        return self._driver.transfers_posted + self._inline.posted

    @property
    def reads_inline(self) -> int:
        """READs the trio thread posted itself (see ``_inline``); those it handed
        to the driver still running are in :attr:`reads_adopted` too."""
        return self._inline.posted

    @property
    def reads_adopted(self) -> int:
        return self._inline.adopted

    @property
    def transfers_unsettled(self) -> int:
        """Failed reads whose transfer could not be stopped and still runs."""
        return self._unsettled

    @property
    def stuck_call(self) -> str:
        """The NIXL call an abandoned load is still in (``""`` once it returned)."""
        return self._remotes.stuck_call

    def agent_metadata(self) -> bytes:
        data: bytes = nixl_call("get_agent_metadata", self._live_agent().get_agent_metadata)
        return data

    def begin_close(self) -> None:
        """Tell in-flight transfers to stop; the driver notices within a turn.

        From now on a load in NIXL has ``close_timeout`` to return before
        :meth:`aclose` gives up waiting for it.
        """
        if self._closing_since is None:
            self._closing_since = trio.current_time()
        self._closing.set()
        self._driver.begin_close()

    async def aclose(self) -> None:
        """Stop the driver, wait for the load thread, then release remote
        agents, descriptor lists and memory.

        Idempotent. Stopping the driver waits (at most ``close_timeout``) for
        its running transfers to stop. A remote-agent load still in NIXL
        (its caller was cancelled by the close, or gave up at its deadline)
        gets until ``close_timeout`` after ``begin_close`` to return;
        its thread then releases what it loaded itself. If a transfer or
        that load still runs after those bounds (NIXL cannot stop either),
        nothing is released: the agent, its registrations and the KV tensors
        are kept for the life of the process (logged as an error, with the
        reason), since a transfer may still write that memory and a release
        would queue behind the stuck call. The releases run in a worker
        thread that is not abandoned (freeing registrations under a running
        NIXL call would crash); each takes milliseconds. The bookkeeping is
        dropped here, on the trio thread.
        """
        self.begin_close()
        agent = self._agent
        if agent is None or self in _KEPT_FOR_LIFE:
            await trio.lowlevel.checkpoint()
            return
        await self._driver.stop()
        if self._driver.transfers_kept:
            # Deregistering (or letting the caller free the tensors) under a
            # running transfer lets it write into freed memory: keep it all.
            _KEPT_FOR_LIFE.append(self)
            logger.error(
                "agent %s closed with %d transfers still running: its agent, remote agents "
                "and KV-cache memory stay registered (and the tensors referenced) for the "
                "life of the process",
                self._agent_name,
                self._driver.transfers_kept,
            )
            return
        assert self._closing_since is not None
        with trio.move_on_at(self._closing_since + self._config.close_timeout):
            await self._remotes.wait_idle()  # (a load's thread returns, and cleans up)
        stuck = self._remotes.stuck_call
        if stuck:
            # Every release would wait behind the stuck call (it holds NIXL's
            # writer lock: up to 135 s towards a vanished peer), past close's
            # deadline, and destroying the agent under it would crash: keep it.
            _KEPT_FOR_LIFE.append(self)
            logger.error(
                "agent %s closed while a load is still in %s, %g s (close_timeout) after "
                "close began: its agent, remote agents and KV-cache memory stay registered "
                "(and the tensors referenced) for the life of the process",
                self._agent_name,
                stuck,
                self._config.close_timeout,
            )
            return
        handles, views = self._remotes.take_all()
        views.extend(self._inline.take_stuck())  # (transfer handles: released the same way)
        owned = (self._local_dlist, self._registration)
        # Handle wrappers keep the agent alive: drop every reference to them.
        self._local_dlist = self._registration = self._agent = None
        self._kv_caches = []
        await trio.to_thread.run_sync(
            release_agent, self._agent_name, agent, handles, views, *owned
        )

    # ---- remote agents (load: the consumer's handshake task only) -------

    async def load_remotes(self, requests: Sequence[LoadRequest], loaded: Loaded) -> None:
        """Load remote agents, prepare their descriptor lists and connect: one
        worker thread runs them one after the other (see
        :meth:`TransferBackend.load_remotes` for what is reported and when).

        A local view other than the whole local layout (a head slice) gets
        its own local descriptor list, prepared once and kept until close.
        An agent of that name still loaded (retired, but held by pulls or by
        a transfer that could not be stopped) is used again if it is the
        same (see :meth:`RemoteAgents.revive`). A load in a NIXL call at its
        deadline (or when the caller is cancelled) is abandoned: the thread
        is reported in :attr:`stuck_call` until it returns, and later loads
        fail fast (see ``_nixl._remotes``).
        """
        await self._remotes.load_many(requests, loaded)

    def lease(self, remote: RemoteAgent) -> AbstractAsyncContextManager[RemoteAgent]:
        return self._remotes.lease(remote)

    async def retire(self, remote: RemoteAgent) -> None:
        await self._remotes.retire(remote)

    # ---- data plane -----------------------------------------------------

    async def read(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        unsettled: UnsettledHook = NO_UNSETTLED,
        *,
        schedule: bool = True,
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

        ``schedule=False``: the caller passes a schedule point right after
        (see :meth:`TransferBackend.read`); an inline read that ended here
        then returns without one (it was a cancel point).

        Raises:
            BackendError: NIXL reported ERR or raised; or a transfer could
                not be stopped (``peer_lost`` and ``settled`` set: the local
                blocks may be written until ``settled`` is set).
            TransferTimeout: ``config.transfer_timeout`` passed.
            BackendClosing: the connector began closing.
            trio.Cancelled: the calling task was cancelled.
        """
        job = self._job(remote, local_indices, remote_indices, notification)
        inline, remote.posted = remote.posted, True
        try:
            await self._run_job(job, schedule, inline=inline)
        finally:
            if job.still_running:  # give the agent up, but keep it loaded until then
                self._hold_until_settled(remote, job, unsettled)
                with trio.move_on_after(self._config.close_timeout, shield=True):
                    await self.retire(remote)
        if job.error is not None:  # (the driver's, made for this job: see _jobs)
            raise job.error

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
        if job.error is not None:
            raise job.error

    def _job(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
    ) -> Job:
        self._live_agent()
        return job_for(remote, local_indices, remote_indices, notification, self._config)

    @trio.lowlevel.enable_ki_protection
    async def _run_job(self, job: Job, schedule: bool = True, *, inline: bool = True) -> None:
        """Run ``job`` inline (see ``_inline``) or submit it, and wait until it
        finished, even when cancelled.

        A cancelled wait asks the driver to stop the job and waits, shielded,
        for it to say so: within ``close_timeout`` plus a turn. (An inline
        read has no cancel point in it: it ends, or the driver adopts it,
        before cancellation can be delivered.) An inline read's schedule
        point comes while its READ runs, between posting it and checking
        it (the other tasks' turn costs the pull nothing then: it would
        wait for the READ anyway), or after it if it ended at once; none
        if ``schedule`` is false (see :meth:`read`). ``inline=False``: the
        driver posts it (the first READ from a remote: see
        :attr:`RemoteAgent.posted`). Protected from
        KeyboardInterrupt: between posting and checking, it would leave a
        running transfer's handle neither released nor adopted.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        handle = self._inline.start(job) if inline else NOT_TAKEN
        if handle is NOT_TAKEN:
            self._driver.submit(job)
        else:
            if schedule:
                await trio.lowlevel.cancel_shielded_checkpoint()
            if handle is None or self._inline.finish(job, handle):  # (it ended here)
                if self.job_observer is not None:
                    self._observe(job)
                return
        try:
            await job.finished.wait()
        finally:
            if not job.finished.is_set():
                job.cancel_requested = True
                with trio.CancelScope(shield=True):
                    await job.finished.wait()
            self._observe(job)

    def _observe(self, job: Job) -> None:
        job.woken_at = time.monotonic()
        if self.job_observer is not None:
            self.job_observer(job)

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
        remote.users -= 1  # (unloaded by the next load_remotes or by aclose)
        self._unsettled -= 1
        settle()

    def expect_reads(self) -> None:
        """See :meth:`NotificationPoller.expect_reads`."""
        self._poller.expect_reads()

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        """See :meth:`NotificationPoller.notifications`."""
        return await self._poller.notifications(wait)

    async def run_blocking(
        self,
        limiter: trio.CapacityLimiter,
        fn: Callable[..., _T],
        *args: Any,
        abandon_on_cancel: bool = False,
    ) -> _T:
        """Run the blocking NIXL call ``fn(*args)``: in a worker thread behind ``limiter``.

        Every NIXL call of this backend but the transfer driver's goes
        through here. The thread is not abandoned on cancellation unless
        asked (a load at its deadline): the call always finishes (NIXL calls
        cannot be interrupted), and cancellation reaches it through
        :func:`trio.from_thread.check_cancelled` where it polls. (Benchmarks
        override this to measure NIXL on the trio thread.)
        """
        try:
            return await trio.to_thread.run_sync(
                fn, *args, limiter=limiter, abandon_on_cancel=abandon_on_cancel
            )
        except (BackendError, TransferTimeout, BackendClosing) as exc:
            _drop_locals(exc)
            raise

    def _live_agent(self) -> Any:
        agent = self._agent
        if agent is None:
            raise BackendClosing
        return agent
