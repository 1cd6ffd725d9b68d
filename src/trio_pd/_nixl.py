"""The NIXL transfer backend (thin I/O shell around one NIXL agent).

NIXL calls can block for milliseconds to seconds (a ``transfer()`` of a large
READ does much of the copy before it returns; ``check_xfer_state`` can take
4 ms), so none of them runs on the trio thread. Three dedicated
:class:`trio.CapacityLimiter` s route them to worker threads:

* ``handshake`` (1 thread): every mutation of the agent's view of remote
  engines -- ``add_remote_agent``, preparing the remote descriptor list,
  ``make_connection``, ``remove_remote_agent`` -- one at a time;
* ``transfers`` (16 threads, at most 4 per remote engine): one pull each,
  from posting the READ to its completion, then releasing its handle;
* ``notifications`` (1 thread): the producer's notification polls, which
  also advance the agent (NIXL's own progress thread is off by default: it
  keeps a core busy per agent).

The agent is created with an explicit thread-sync mode (reader/writer lock by
default) because these threads call it concurrently.

What threads touch: NIXL, the arguments they are given, a
:class:`threading.Event` that says the backend is closing, and a thread-safe
queue of transfer handles that could not be released. Every other piece of
Python state (the loaded remote agents, their leases) changes on the trio
thread only.

Ownership: a :class:`NixlBackend` owns the agent, its memory registration, the
local descriptor list, every :class:`RemoteAgent` it loaded, and every transfer
handle it creates. :meth:`NixlBackend.aclose` releases all of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt
import trio

from ._backend import (
    BackendClosing,
    BackendError,
    RemoteAgent,
    RemoteAgents,
    TransferTimeout,
)
from ._config import ConnectorConfig
from ._layout import KVLayout

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    import torch

logger = logging.getLogger("trio_pd.nixl")

_T = TypeVar("_T")

TRANSFER_THREADS = 16
"""Worker threads for pulls in all. A pull holds one from posting to completion,
mostly sleeping between polls, so they are cheap; a pull waiting for a slow
peer must not keep pulls to other engines from starting."""

TRANSFERS_PER_ENGINE = 4
"""Of those, at most this many for one remote engine: a slow or stuck engine
cannot take every transfer thread (head-of-line blocking across engines)."""

PEER_LOST_ERRORS = frozenset({"nixlRemoteDisconnectError"})
"""NIXL exception types that mean the remote agent is gone (by class name:
the classes live in a CUDA-specific binding module)."""


@contextlib.contextmanager
def _nixl_errors(call: str) -> Iterator[None]:
    """The one mapping of NIXL's exceptions: every one becomes :class:`BackendError`.

    The message names ``call`` and NIXL's error; ``peer_lost`` is set for
    the types in :data:`PEER_LOST_ERRORS`. trio_pd's own control-flow
    exceptions pass through.
    """
    try:
        yield
    except (BackendError, TransferTimeout, BackendClosing, trio.Cancelled):
        raise
    except Exception as exc:
        peer_lost = type(exc).__name__ in PEER_LOST_ERRORS
        raise BackendError(f"{call}: {_describe(exc)}", peer_lost=peer_lost) from exc


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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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
    ) -> None:
        self.layout = layout
        self._agent_name: str = agent.name
        self._agent = agent
        self._registration = registration
        self._local_dlist = local_dlist
        self._config = config
        self._trio_thread = threading.current_thread()
        self._remotes = RemoteAgents(self._unload, config.close_timeout)
        self._closing = threading.Event()
        self._stuck_handles: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._handshake_limiter = trio.CapacityLimiter(1)
        self._transfer_limiter = trio.CapacityLimiter(TRANSFER_THREADS)
        self._slots: dict[str, trio.CapacityLimiter] = {}
        self._local_views: dict[KVLayout, Any] = {}
        self._notification_limiter = trio.CapacityLimiter(1)

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
        return cls(*parts, layout, config)

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

    def agent_metadata(self) -> bytes:
        data: bytes = self._live_agent().get_agent_metadata()
        return data

    def begin_close(self) -> None:
        """Tell in-flight transfers to stop; they notice within a poll."""
        self._closing.set()

    async def aclose(self) -> None:
        """Release remote agents, descriptor lists, handles and memory. Idempotent.

        The releases run in a worker thread that is not abandoned (freeing
        registrations under a running NIXL call would crash); each takes
        milliseconds. The bookkeeping is dropped here, on the trio thread.
        """
        self._closing.set()
        agent = self._agent
        if agent is None:
            await trio.lowlevel.checkpoint()
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
        self._slots.clear()
        self._local_dlist = self._registration = self._agent = None
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
        while not self._stuck_handles.empty():
            attempt("release stuck transfer", self._stuck_handles.get_nowait().release)
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

        Raises:
            BackendError: NIXL rejected the metadata or the descriptors, or
                could not connect; nothing of this engine stays loaded.
        """
        if agent_name in self._remotes:
            await trio.lowlevel.checkpoint()
            raise BackendError(
                f"agent {agent_name!r} is still loaded (in use by earlier pulls); retry later"
            )
        local_dlist = await self._local_view(local_layout)
        dlist = await self.run_blocking(
            self._handshake_limiter, self._load_blocking, agent_name, agent_metadata, layout
        )
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
        self._slots.pop(remote.agent_name, None)
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

    def _load_blocking(self, agent_name: str, agent_metadata: bytes, layout: KVLayout) -> Any:
        agent = self._live_agent()
        with _nixl_errors("add_remote_agent"):
            loaded = agent.add_remote_agent(agent_metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            if loaded_name != agent_name:
                raise BackendError(
                    f"metadata names agent {loaded_name!r}, reply said {agent_name!r}"
                )
            with _nixl_errors("prep_xfer_dlist"):
                dlist = agent.prep_xfer_dlist(
                    loaded_name, layout.strided_descriptors(), layout.mem_type
                )
            try:
                # Connect now (UCX wire-up) rather than in the first pull.
                with _nixl_errors("make_connection"):
                    agent.make_connection(loaded_name)
            except BaseException:
                dlist.release()
                raise
        except BaseException:
            try:
                agent.remove_remote_agent(loaded_name)
            except Exception:
                logger.exception("could not remove half-loaded agent %s", loaded_name)
            raise
        return dlist

    # ---- data plane -----------------------------------------------------

    async def read(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
    ) -> None:
        """READ the remote descriptors into the local ones, with a notification.

        Runs in a transfer thread, from posting to completion;
        ``config.transfer_timeout`` counts from when that thread starts
        (waiting for a free thread does not count). The handle is always
        released before this returns or raises: on cancellation, timeout or
        close, the running transfer is first waited for until it ends (up to
        ``close_timeout``; NIXL's abort-on-release was seen to let data land
        later) and only then released, so no transfer writes into local
        blocks after the caller regains control.

        A transfer that does not stop within ``close_timeout`` (its peer
        unreachable, say) is released anyway, and its remote agent is
        retired (the next pull handshakes again). NIXL cannot cancel it:
        measured on a partitioned TCP link, its bytes still landed once the
        link came back, even after the agent was removed. The error says so.

        Raises:
            BackendError: NIXL reported ERR or raised; or a transfer could
                not be stopped (``peer_lost``: the agent was retired; its
                blocks may still be written later).
            TransferTimeout: ``config.transfer_timeout`` passed.
            BackendClosing: the connector began closing.
            trio.Cancelled: the calling task was cancelled.
        """
        aborted = [False]  # set by the thread if a transfer had to be released running
        try:
            async with self._engine_slots(remote):
                await self.run_blocking(
                    self._transfer_limiter,
                    self._read_blocking,
                    remote,
                    local_indices,
                    remote_indices,
                    notification,
                    aborted,
                )
        except (TransferTimeout, BackendError) as exc:
            if aborted[0]:
                raise BackendError(
                    f"a transfer from {remote.agent_name!r} did not stop within "
                    f"{self._config.close_timeout:g} s of being told to (its peer is "
                    "unreachable?); it was released and the agent given up, but NIXL "
                    "cannot cancel it: its blocks may still be written if the peer comes back",
                    peer_lost=True,
                ) from exc
            raise
        finally:
            if aborted[0]:  # whatever ended the read (cancellation too): give the agent up
                with trio.move_on_after(self._config.close_timeout, shield=True):
                    await self.retire(remote)

    def _engine_slots(self, remote: RemoteAgent) -> trio.CapacityLimiter:
        """The per-engine cap on transfer threads (see TRANSFERS_PER_ENGINE)."""
        slots = self._slots.get(remote.agent_name)
        if slots is None:
            slots = self._slots[remote.agent_name] = trio.CapacityLimiter(TRANSFERS_PER_ENGINE)
        return slots

    def _read_blocking(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        aborted: list[bool],
    ) -> None:
        # (``remote``, not its descriptor list, is passed in: an error's
        # traceback keeps this frame's arguments, and a list handle would
        # keep the agent alive after close; unloading sets the handles to None.)
        # Large pulls go as a sequence of transfers of at most
        # max_descriptors_per_transfer descriptors (NIXL's transfer() does much
        # of the copy before it returns); cancellation and closing are noticed
        # between them. Only the last one carries the notification, so the
        # producer hears of the pull once all of it is done.
        deadline = time.monotonic() + self._config.transfer_timeout
        step = self._config.max_descriptors_per_transfer
        count = len(local_indices)
        for start in range(0, count, step):
            stop = min(count, start + step)
            self._transfer_blocking(
                remote.local_handle,
                remote.handle,
                local_indices[start:stop],
                remote_indices[start:stop],
                notification if stop == count else b"",
                deadline,
                aborted,
            )

    def _transfer_blocking(
        self,
        local_dlist: Any,
        remote_dlist: Any,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        deadline: float,
        aborted: list[bool],
    ) -> None:
        agent = self._live_agent()
        self._check_stop(deadline)
        with _nixl_errors("make_prepped_xfer"):
            handle = agent.make_prepped_xfer(
                "READ",
                local_dlist,
                local_indices,
                remote_dlist,
                remote_indices,
                notification,
            )
        status = "PROC"
        try:
            with _nixl_errors("transfer"):
                status = agent.transfer(handle)
                spin_until = time.monotonic() + self._config.poll_spin
                while status == "PROC":
                    self._check_stop(deadline)
                    if time.monotonic() >= spin_until:
                        time.sleep(self._config.poll_interval)
                    status = agent.check_xfer_state(handle)
            if status != "DONE":
                raise BackendError(f"transfer state {status}")
        finally:
            if self._release_handle(handle, finished=status != "PROC"):
                aborted[0] = True

    def _check_stop(self, deadline: float) -> None:
        """Raise if this transfer must stop: cancelled, backend closing, or late."""
        self._check_cancelled()
        if self._closing.is_set():
            raise BackendClosing
        if time.monotonic() >= deadline:
            raise TransferTimeout

    def _release_handle(self, handle: Any, *, finished: bool) -> bool:
        """Release a transfer handle, first letting an unfinished one stop.

        NIXL's release of a running transfer "tries to abort" it, but UCX may
        still be writing into the local blocks after that returns (measured:
        bytes kept arriving). So an unfinished transfer is polled until it
        ends (DONE or ERR), at most ``close_timeout``; only a transfer still
        running then is released while running (aborted) -- and logged.

        Returns whether it had to release a running transfer.
        """
        agent = self._live_agent()
        aborted = False
        if not finished:
            give_up = time.monotonic() + self._config.close_timeout
            while True:
                try:
                    if agent.check_xfer_state(handle) != "PROC":
                        break
                except Exception:
                    break
                if time.monotonic() >= give_up:
                    logger.error(
                        "a cancelled transfer still runs after %g s; aborting it and "
                        "closing the connection to its peer",
                        self._config.close_timeout,
                    )
                    aborted = True
                    break
                time.sleep(self._config.poll_interval)
        try:
            handle.release()
        except Exception as exc:
            logger.error(
                "transfer handle could not be released (%s); kept until close", _describe(exc)
            )
            self._stuck_handles.put(handle)
        return aborted

    async def notify(self, remote: RemoteAgent, message: bytes) -> None:
        """Post a notification without a transfer (a notify-only pull).

        Fire and forget: NIXL reports no delivery, so a notification posted
        to a peer that just died is lost silently (the producer's exposure
        then expires).

        Raises:
            BackendError: NIXL could not post it.
        """
        async with self._engine_slots(remote):
            await self.run_blocking(
                self._transfer_limiter, self._notify_blocking, remote.agent_name, message
            )

    def _notify_blocking(self, agent_name: str, message: bytes) -> None:
        with _nixl_errors("send_notif"):
            self._live_agent().send_notif(agent_name, message)

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        """Collect new notifications (by sending agent name), waiting up to ``wait`` s.

        The notification thread checks every ``poll_interval`` until some
        arrive or ``wait`` has passed. Each check also advances this agent's
        UCX worker: trio_pd runs NIXL without its progress thread (which
        spins a whole core per agent), and a consumer's READ of our blocks
        completes only when our worker makes progress. So while exposures
        are pending, the producer keeps this going.

        Raises:
            BackendError: NIXL raised.
        """
        return await self.run_blocking(
            self._notification_limiter, self._notifications_blocking, wait
        )

    def _notifications_blocking(self, wait: float) -> dict[str, list[bytes]]:
        agent = self._live_agent()
        give_up = time.monotonic() + wait
        while True:
            with _nixl_errors("get_new_notifs"):
                notifs: dict[str, list[bytes]] = agent.get_new_notifs()
            if notifs or self._closing.is_set() or time.monotonic() >= give_up:
                return notifs
            self._check_cancelled()
            time.sleep(self._config.poll_interval)

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
