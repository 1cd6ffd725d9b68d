"""The NIXL agent, wrapped for trio (thin I/O shell).

NIXL calls can block for milliseconds to seconds (a ``transfer()`` of a large
READ does much of the copy before it returns; ``check_xfer_state`` can take
4 ms), so none of them runs on the trio thread. Three dedicated
:class:`trio.CapacityLimiter` s route them to worker threads:

* ``handshake`` (1 thread): every mutation of the agent's view of remote
  engines -- ``add_remote_agent``, preparing the remote descriptor list,
  ``make_connection``, ``remove_remote_agent`` -- one engine at a time;
* ``transfers`` (16 threads, at most 4 per remote engine): one pull each,
  from posting the READ to its completion, then releasing its handle;
* ``notifications`` (1 thread): the producer's notification polls, which
  also advance the agent (NIXL's own progress thread is off by default: it
  keeps a core busy per agent).

The agent is created with an explicit thread-sync mode (reader/writer lock by
default) because these threads call it concurrently.

Ownership: a :class:`NixlEngine` owns the agent, its memory registration, the
local descriptor list, every :class:`RemoteAgent` it loaded, and every transfer
handle it creates. :meth:`NixlEngine.close` releases all of them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import trio

from ._config import ConnectorConfig
from ._layout import KVLayout

if TYPE_CHECKING:
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


class NixlCallError(Exception):
    """A NIXL call failed; the message names the call and NIXL's error.

    Attributes:
        peer_lost: NIXL said the remote agent disconnected (the peer died or
            restarted): its metadata is stale.
    """

    def __init__(self, message: str, *, peer_lost: bool = False) -> None:
        super().__init__(message)
        self.peer_lost = peer_lost


class TransferTimeout(Exception):
    """A transfer did not complete before its deadline."""


class EngineClosing(Exception):
    """The connector closed while a transfer was in flight."""


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


def _is_peer_lost(exc: BaseException) -> bool:
    """NIXL raises ``nixlRemoteDisconnectError`` when the remote agent is gone."""
    return type(exc).__name__ == "nixlRemoteDisconnectError"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


@attrs.define(eq=False)
class RemoteAgent:
    """A remote engine loaded into the local agent: its name and prepared descriptors.

    Attributes:
        users: pulls using it right now; it is unloaded only at zero.
        retired: replaced or dead; unload it once ``users`` drops to zero.
    """

    engine_id: str
    incarnation: str
    agent_name: str
    layout: KVLayout
    dlist: Any  # nixl_prepped_dlist_handle
    users: int = 0
    retired: bool = False


class NixlEngine:
    """Owns one NIXL agent and everything registered with or prepared on it.

    Create with :meth:`create`; :meth:`close` must be called exactly once, when
    no call is in flight (the connector guarantees this).
    """

    def __init__(
        self,
        agent: Any,
        registration: Any,
        local_dlist: Any,
        layout: KVLayout,
        config: ConnectorConfig,
    ) -> None:
        self.agent_name: str = agent.name
        self.layout = layout
        self._agent = agent
        self._registration = registration
        self._local_dlist = local_dlist
        self._config = config
        self._remotes: dict[str, RemoteAgent] = {}
        self._closing = threading.Event()
        self._stuck_handles: list[Any] = []
        self.handshake_limiter = trio.CapacityLimiter(1)
        self.transfer_limiter = trio.CapacityLimiter(TRANSFER_THREADS)
        self._slots: dict[str, trio.CapacityLimiter] = {}
        self.notification_limiter = trio.CapacityLimiter(1)

    # ---- life cycle -----------------------------------------------------

    @classmethod
    async def create(
        cls,
        agent_name: str,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        config: ConnectorConfig,
    ) -> NixlEngine:
        """Create the agent, register ``kv_caches`` and prepare the local list.

        Runs in a worker thread (agent creation starts UCX: 0.02-1.6 s).
        On failure everything already created is released.

        Raises:
            NixlCallError: NIXL could not create, register or prepare.
        """
        try:
            parts = await trio.to_thread.run_sync(
                _create_blocking, agent_name, kv_caches, layout, config
            )
        except NixlCallError as exc:
            _drop_locals(exc)
            raise
        return cls(*parts, layout, config)

    def begin_close(self) -> None:
        """Tell in-flight transfers to abort; they notice within a poll."""
        self._closing.set()

    def close(self) -> None:
        """Release remote agents, descriptor lists, handles and memory. Idempotent."""
        self._closing.set()
        agent = self._agent
        if agent is None:
            return
        errors: list[str] = []

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:  # best effort: release the rest regardless
                errors.append(f"{what}: {_describe(exc)}")

        for remote in list(self._remotes.values()):
            attempt(f"unload {remote.engine_id}", functools.partial(self._unload_blocking, remote))
        for handle in self._stuck_handles:
            attempt("release stuck transfer", handle.release)
        self._stuck_handles.clear()
        attempt("release local descriptor list", self._local_dlist.release)
        attempt("deregister memory", lambda: agent.deregister_memory(self._registration))
        # Handle wrappers keep the agent alive: drop every reference to them.
        for remote in self._remotes.values():
            remote.dlist = None
        self._remotes.clear()
        self._slots.clear()
        self._local_dlist = self._registration = self._agent = None
        if errors:
            logger.warning("agent %s closed with errors: %s", self.agent_name, "; ".join(errors))

    # ---- handshake side (called only by the handshake task) -------------

    async def load_remote(
        self,
        engine_id: str,
        incarnation: str,
        agent_name: str,
        agent_metadata: bytes,
        layout: KVLayout,
    ) -> RemoteAgent:
        """Load a remote agent and prepare its descriptor list (handshake thread).

        Raises:
            NixlCallError: NIXL rejected the metadata or the descriptors; nothing
                of this engine stays loaded.
        """
        return await self._in_thread(
            self.handshake_limiter,
            self._load_blocking,
            engine_id,
            incarnation,
            agent_name,
            agent_metadata,
            layout,
        )

    async def unload_remote(self, remote: RemoteAgent) -> None:
        """Release a remote's descriptor list and remove its agent (handshake thread)."""
        self._slots.pop(remote.agent_name, None)
        await self._in_thread(self.handshake_limiter, self._unload_blocking, remote)

    def _load_blocking(
        self,
        engine_id: str,
        incarnation: str,
        agent_name: str,
        agent_metadata: bytes,
        layout: KVLayout,
    ) -> RemoteAgent:
        agent = self._live_agent()
        if agent_name in self._remotes:
            raise NixlCallError(
                f"agent {agent_name!r} is still loaded (in use by earlier pulls); retry later"
            )
        try:
            loaded = agent.add_remote_agent(agent_metadata)
        except Exception as exc:
            raise NixlCallError(f"add_remote_agent: {_describe(exc)}") from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        try:
            if loaded_name != agent_name:
                raise NixlCallError(
                    f"metadata names agent {loaded_name!r}, reply said {agent_name!r}"
                )
            try:
                dlist = agent.prep_xfer_dlist(
                    loaded_name, layout.strided_descriptors(), layout.mem_type
                )
            except Exception as exc:
                raise NixlCallError(f"prep_xfer_dlist: {_describe(exc)}") from exc
            try:
                # Connect now (UCX wire-up) rather than in the first pull.
                agent.make_connection(loaded_name)
            except Exception as exc:
                dlist.release()
                raise NixlCallError(
                    f"make_connection: {_describe(exc)}", peer_lost=_is_peer_lost(exc)
                ) from exc
        except BaseException:
            try:
                agent.remove_remote_agent(loaded_name)
            except Exception:
                logger.exception("could not remove half-loaded agent %s", loaded_name)
            raise
        remote = RemoteAgent(engine_id, incarnation, loaded_name, layout, dlist)
        self._remotes[loaded_name] = remote  # from here on, close() releases it
        return remote

    def _unload_blocking(self, remote: RemoteAgent) -> None:
        agent = self._live_agent()
        if self._remotes.pop(remote.agent_name, None) is None:
            return  # already unloaded
        try:
            remote.dlist.release()
        finally:
            remote.dlist = None
            agent.remove_remote_agent(remote.agent_name)

    # ---- data plane -----------------------------------------------------

    async def read(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        deadline: float,
    ) -> None:
        """READ the remote descriptors into the local ones, with a notification.

        Runs in a transfer thread, from posting to completion. The handle is
        always released before this returns or raises: on cancellation,
        timeout or close, the running transfer is first waited for until it
        ends (up to ``close_timeout``; NIXL's abort-on-release was seen to let
        data land later) and only then released, so no transfer writes into
        local blocks after the caller regains control.

        Args:
            deadline: :func:`time.monotonic` value after which the transfer is
                abandoned with :class:`TransferTimeout`.

        Raises:
            NixlCallError: NIXL reported ERR or raised.
            TransferTimeout: ``deadline`` passed.
            EngineClosing: the connector began closing.
            trio.Cancelled: the calling task was cancelled.
        """
        async with self._engine_slots(remote):
            await self._in_thread(
                self.transfer_limiter,
                self._read_blocking,
                remote,
                local_indices,
                remote_indices,
                notification,
                deadline,
            )

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
        deadline: float,
    ) -> None:
        # Large pulls go as a sequence of transfers of at most
        # max_descriptors_per_transfer descriptors (NIXL's transfer() does much
        # of the copy before it returns); cancellation and closing are noticed
        # between them. Only the last one carries the notification, so the
        # producer hears of the pull once all of it is done.
        step = self._config.max_descriptors_per_transfer
        count = len(local_indices)
        for start in range(0, count, step):
            stop = min(count, start + step)
            self._transfer_blocking(
                remote,
                local_indices[start:stop],
                remote_indices[start:stop],
                notification if stop == count else b"",
                deadline,
            )

    def _transfer_blocking(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        deadline: float,
    ) -> None:
        agent = self._live_agent()
        self._check_stop(deadline)
        try:
            handle = agent.make_prepped_xfer(
                "READ",
                self._local_dlist,
                local_indices,
                remote.dlist,
                remote_indices,
                notification,
            )
        except Exception as exc:
            raise NixlCallError(
                f"make_prepped_xfer: {_describe(exc)}", peer_lost=_is_peer_lost(exc)
            ) from exc
        status = "PROC"
        try:
            try:
                status = agent.transfer(handle)
                spin_until = time.monotonic() + self._config.poll_spin
                while status == "PROC":
                    self._check_stop(deadline)
                    if time.monotonic() >= spin_until:
                        time.sleep(self._config.poll_interval)
                    status = agent.check_xfer_state(handle)
            except (TransferTimeout, EngineClosing, trio.Cancelled):
                raise
            except Exception as exc:
                raise NixlCallError(
                    f"transfer: {_describe(exc)}", peer_lost=_is_peer_lost(exc)
                ) from exc
            if status != "DONE":
                raise NixlCallError(f"transfer state {status}")
        finally:
            self._release_handle(handle, finished=status != "PROC")

    def _check_stop(self, deadline: float) -> None:
        """Raise if this transfer must stop: cancelled, connector closing, or late."""
        self._check_cancelled()
        if self._closing.is_set():
            raise EngineClosing
        if time.monotonic() >= deadline:
            raise TransferTimeout

    def _release_handle(self, handle: Any, *, finished: bool) -> None:
        """Release a transfer handle, first letting an unfinished one stop.

        NIXL's release of a running transfer "tries to abort" it, but UCX may
        still be writing into the local blocks after that returns (measured:
        bytes kept arriving). So an unfinished transfer is polled until it
        ends (DONE or ERR), at most ``close_timeout``; only a transfer still
        running then is released while running (aborted) -- and logged.
        """
        agent = self._live_agent()
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
                        "a cancelled transfer still runs after %g s; aborting it",
                        self._config.close_timeout,
                    )
                    break
                time.sleep(self._config.poll_interval)
        try:
            handle.release()
        except Exception as exc:
            logger.error(
                "transfer handle could not be released (%s); kept until close", _describe(exc)
            )
            self._stuck_handles.append(handle)

    async def notify(self, remote: RemoteAgent, message: bytes) -> None:
        """Send a notification without a transfer (a notify-only pull).

        Raises:
            NixlCallError: NIXL could not send it.
        """
        async with self._engine_slots(remote):
            await self._in_thread(self.transfer_limiter, self._notify_blocking, remote, message)

    def _notify_blocking(self, remote: RemoteAgent, message: bytes) -> None:
        try:
            self._live_agent().send_notif(remote.agent_name, message)
        except Exception as exc:
            raise NixlCallError(
                f"send_notif: {_describe(exc)}", peer_lost=_is_peer_lost(exc)
            ) from exc

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        """Collect new notifications (by sending agent name), waiting up to ``wait`` s.

        The notification thread checks every ``poll_interval`` until some
        arrive or ``wait`` has passed. Each check also advances this agent's
        UCX worker: trio_pd runs NIXL without its progress thread (which
        spins a whole core per agent), and a consumer's READ of our blocks
        completes only when our worker makes progress. So while exposures
        are pending, the connector keeps this going.

        Raises:
            NixlCallError: NIXL raised.
        """
        if self._config.nixl_on_event_loop:
            wait = 0.0  # comparison mode: do not sleep on the trio thread
        return await self._in_thread(self.notification_limiter, self._notifications_blocking, wait)

    def _notifications_blocking(self, wait: float) -> dict[str, list[bytes]]:
        agent = self._live_agent()
        give_up = time.monotonic() + wait
        while True:
            try:
                notifs: dict[str, list[bytes]] = agent.get_new_notifs()
            except Exception as exc:
                raise NixlCallError(f"get_new_notifs: {_describe(exc)}") from exc
            if notifs or self._closing.is_set() or time.monotonic() >= give_up:
                return notifs
            self._check_cancelled()
            time.sleep(self._config.poll_interval)

    async def _in_thread(
        self, limiter: trio.CapacityLimiter, fn: Callable[..., _T], *args: Any
    ) -> _T:
        """Run ``fn(*args)`` in a worker thread behind ``limiter``.

        Not abandoned on cancellation: the call always finishes (NIXL calls
        cannot be interrupted), and cancellation reaches it through
        ``trio.from_thread.check_cancelled`` where it polls.
        """
        try:
            if self._config.nixl_on_event_loop:  # comparison mode: block the loop
                await trio.lowlevel.checkpoint()
                return fn(*args)
            return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
        except (NixlCallError, TransferTimeout, EngineClosing) as exc:
            _drop_locals(exc)
            raise

    def _check_cancelled(self) -> None:
        """In a worker thread: raise ``trio.Cancelled`` if the caller was cancelled."""
        if not self._config.nixl_on_event_loop:
            trio.from_thread.check_cancelled()

    def agent_metadata(self) -> bytes:
        data: bytes = self._live_agent().get_agent_metadata()
        return data

    def _live_agent(self) -> Any:
        agent = self._agent
        if agent is None:
            raise EngineClosing
        return agent


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
    try:
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
            agent.create_backend(backend, params)
    except Exception as exc:
        raise NixlCallError(f"creating agent {agent_name!r}: {_describe(exc)}") from exc
    registration = None
    try:
        registration = agent.register_memory(list(kv_caches))
        local_dlist = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", layout.strided_descriptors(), layout.mem_type
        )
    except Exception as exc:
        if registration is not None:
            try:
                agent.deregister_memory(registration)
            except Exception:
                logger.exception("deregistering after a failed open")
        raise NixlCallError(f"registering KV caches: {_describe(exc)}") from exc
    return agent, registration, local_dlist
