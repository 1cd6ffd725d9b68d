"""The transfer-backend seam: what a connector needs from NIXL, and nothing more.

A *transfer backend* owns one local agent: the registered KV caches, the remote
agents loaded into it, and every transfer in flight. The connector's roles
talk to it through :class:`TransferBackend` only, so the same consumer and
producer logic runs on NIXL (:class:`~trio_pd.NixlBackend`, the real path) and
on the in-memory backend of :mod:`trio_pd.testing` (fault injection without
UCX). httpcore's ``_backends/base.py`` is the model: a narrow interface, and
errors mapped at the boundary into the few exceptions below.

Remote agents' lifetimes belong to the backend: a pull *leases* a
:class:`RemoteAgent` (``async with backend.lease(remote)``); a retired agent is
unloaded by the backend once its last lease ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import trio

from trio_pd._core._errors import TrioPdError

if TYPE_CHECKING:
    import torch

    from trio_pd._config import ConnectorConfig
    from trio_pd._core._layout import KVLayout

__all__ = [
    "NO_UNSETTLED",
    "BackendClosing",
    "BackendError",
    "BackendFactory",
    "LoadRequest",
    "Loaded",
    "RemoteAgent",
    "RemoteAgents",
    "RemoteRetired",
    "TransferBackend",
    "TransferTimeout",
]


class BackendError(TrioPdError):
    """The transfer backend (NIXL) failed; the message names the call and its error.

    Raised by :func:`~trio_pd.open_connector` when the local agent cannot be
    created or the KV caches cannot be registered; inside the connector it
    becomes a :class:`~trio_pd.HandshakeError` or
    :class:`~trio_pd.TransferError` that names the engine or request.

    Chaining: the connector's error chains this one as its ``__cause__``
    (``raise TransferError(...) from error``), so ``peer_lost``,
    ``nixl_error`` and ``settled`` stay at hand. This one chains nothing:
    NIXL's exception is never its ``__cause__`` or ``__context__`` (its
    traceback holds the NIXL handles of the thread that made the call, and
    they hold the agent); what NIXL said is in the message and in
    ``nixl_error`` (see ``trio_pd._transfer._nixl._errors``).

    Attributes:
        peer_lost: the backend said the remote agent disconnected (the peer
            died, restarted or became unreachable).
        settled: ``None``, or -- for a transfer the backend could not stop --
            an event set once it really ended (see ``settled`` of
            :class:`~trio_pd.TransferError`).
        nixl_error: NIXL's exception as text, ``"<type>: <message>"`` (``""``
            when the error is not NIXL's own: a transfer that ended in an
            error state, a transfer that could not be stopped, a backend
            other than NIXL).
    """

    def __init__(
        self,
        message: str,
        *,
        peer_lost: bool = False,
        settled: trio.Event | None = None,
        nixl_error: str = "",
    ) -> None:
        super().__init__(message)
        self.peer_lost = peer_lost
        self.settled = settled
        self.nixl_error = nixl_error

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_backend_error, (str(self), self.peer_lost, self.nixl_error))


def _rebuild_backend_error(message: str, peer_lost: bool, nixl_error: str = "") -> BackendError:
    return BackendError(message, peer_lost=peer_lost, nixl_error=nixl_error)


UnsettledHook = Callable[[], Callable[[], None]]
"""``read(..., unsettled=hook)``: the backend calls ``hook()`` (on the trio
thread, before ``read`` returns or raises) when the read leaves a transfer
running that it could not stop, and calls the function ``hook`` returned
(on the trio thread) once that transfer really ended."""


def _no_unsettled() -> Callable[[], None]:
    return lambda: None


NO_UNSETTLED: UnsettledHook = _no_unsettled
"""An :data:`UnsettledHook` for callers that track nothing."""


class TransferTimeout(Exception):
    """A read did not complete within its timeout (internal: becomes TransferError)."""


class BackendClosing(Exception):
    """The backend began closing while a call was in flight (internal)."""


class RemoteRetired(Exception):
    """A lease was asked for a retired remote agent (internal: handshake again)."""


@attrs.define(eq=False)
class RemoteAgent:
    """A remote engine's agent, loaded into a backend, with its prepared descriptors.

    Created by :meth:`TransferBackend.load_remotes`; lent to pulls by
    :meth:`TransferBackend.lease`. Only its backend changes it.

    Attributes:
        engine_id: the remote engine.
        incarnation: the remote connector's incarnation.
        agent_name: the remote agent's name.
        layout: the remote KV layout, or the view of it that is read (a
            head slice, when the engines' TP sizes differ).
        local_layout: the local layout, or the view of it that is written.
        handle: the backend's own data (NIXL: the remote descriptor list).
        local_handle: the backend's own data for ``local_layout`` (NIXL: the
            local descriptor list of that view).
        users: leases held right now.
        retired: replaced or lost; the backend unloads it once ``users`` is 0.
        posted: a READ from it was handed to the backend (NIXL: the first
            READ from a newly loaded agent finishes UCX's connection set-up,
            several times a small READ's CPU, so the driver's thread posts
            it, never an inline read on the trio thread).
    """

    engine_id: str
    incarnation: str
    agent_name: str
    layout: KVLayout
    local_layout: KVLayout
    handle: Any = None
    local_handle: Any = None
    users: int = 0
    retired: bool = False
    posted: bool = False


@attrs.frozen
class LoadRequest:
    """One remote agent to load (see :meth:`TransferBackend.load_remotes`).

    ``layout`` is the remote layout (or the head-slice view of it) that
    reads come from, ``local_layout`` the local one (or view) they go to;
    both have the same regions and bytes per block. ``deadline`` (trio's
    clock) is the handshake's: the load is given up then.
    """

    engine_id: str
    incarnation: str
    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    local_layout: KVLayout
    deadline: float


Loaded = Callable[[int, "RemoteAgent | BackendError | None"], None]
"""``loaded(index, outcome)``: how :meth:`TransferBackend.load_remotes` reports
the load of ``requests[index]`` (the agent, the error, or ``None``: its
deadline passed first)."""


async def load_one_by_one(
    load: Callable[[LoadRequest], Awaitable[RemoteAgent]],
    requests: Sequence[LoadRequest],
    loaded: Loaded,
) -> None:
    """:meth:`TransferBackend.load_remotes` for a backend that loads one agent per
    ``await load(request)``, each cancelled at its deadline (a test double's)."""
    for index, request in enumerate(requests):
        outcome: RemoteAgent | BackendError | None = None
        with trio.move_on_at(request.deadline):
            try:
                outcome = await load(request)
            except BackendError as exc:
                outcome = exc
        loaded(index, outcome)


class TransferBackend(Protocol):
    """What a connector needs from its data plane (NIXL, or a test double).

    Implementations in this package: :class:`~trio_pd.NixlBackend` and
    :class:`trio_pd.testing.MemoryBackend`. The exceptions a backend raises to
    the connector besides :class:`~trio_pd.BackendError` (``TransferTimeout``,
    ``BackendClosing``, ``RemoteRetired``) live in the internal module
    ``trio_pd._transfer._backend``: third-party backends are possible but that part of
    the seam is not a stable API yet.

    Every ``async`` method may block for a while and runs off the trio thread
    where the backend needs it; none is abandoned on cancellation. The
    connector guarantees: :meth:`load_remotes` is called by one task at a time;
    :meth:`aclose` is called once, after :meth:`begin_close`, when no other
    call is in flight.
    """

    @property
    def agent_name(self) -> str:
        """The local agent's name (consumers' notifications carry it)."""
        ...

    @property
    def remote_agents_loaded(self) -> int:
        """Remote agents loaded now (retired ones count until unloaded)."""
        ...

    @property
    def transfers_posted(self) -> int:
        """Transfers (READs) posted so far; batched pulls share one."""
        ...

    @property
    def transfers_unsettled(self) -> int:
        """Failed reads whose transfer could not be stopped and still runs."""
        ...

    @property
    def stuck_call(self) -> str:
        """The call a remote-agent load is stuck in (abandoned past its
        deadline, still running), with the agent and for how long; ``""``
        when none. While it is set, :meth:`load_remotes` may fail fast."""
        ...

    def agent_metadata(self) -> bytes:
        """What a consumer needs to load this agent (sent over the side channel)."""
        ...

    async def load_remotes(self, requests: Sequence[LoadRequest], loaded: Loaded) -> None:
        """Load remote agents, prepare their descriptors and connect to them:
        one at a time, in the order of ``requests``.

        Each load's outcome goes to ``loaded(index, outcome)`` (on the trio
        thread, in order) as soon as that load has ended, not at the end:
        the :class:`RemoteAgent`; the :class:`BackendError` that failed it
        (the metadata or descriptors were rejected, the connection failed --
        nothing of that agent stays loaded -- or an earlier load is stuck in
        a call that holds the backend, NIXL's writer lock, so this one could
        not run either); or ``None`` if its ``deadline`` came first (a load
        not begun by then is skipped).

        Cancellation: a backend whose calls cannot be interrupted abandons
        the call it is in at that load's deadline, or when the caller is
        cancelled (it releases whatever the call loads once it returns), and
        reports it in :attr:`stuck_call` until it does; the loads after it
        in ``requests`` then fail fast. A load that ends after its outcome
        could be reported is released, never leaked.

        Raises:
            BackendClosing: the backend began closing (the loads not
                reported by then never will be).
        """
        ...

    def lease(self, remote: RemoteAgent) -> AbstractAsyncContextManager[RemoteAgent]:
        """``async with backend.lease(remote):`` holds ``remote`` for one pull.

        Raises:
            RemoteRetired: on entry, if ``remote`` was retired meanwhile.
        """
        ...

    async def retire(self, remote: RemoteAgent) -> None:
        """Mark ``remote`` replaced or lost; unload it now or at its last lease's end."""
        ...

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
        """READ remote descriptors into local ones, then deliver ``notification``.

        Indices are descriptor indices (``region * num_blocks + block``) of
        ``remote.local_layout`` and ``remote.layout``.

        The backend's ``config.transfer_timeout`` counts from when the read
        is handed to the backend's data plane. When this returns or raises,
        nothing writes into the local blocks any more -- except when a
        transfer could not be stopped: then, whichever way this exits
        (an error, a timeout, cancellation, closing), ``unsettled()`` was
        called before, and the function it returned is called once that
        transfer really ended. (A :class:`BackendError` raised then also
        carries ``settled``, an event set at the same time.)

        A checkpoint; with ``schedule=False`` (the caller passes a schedule
        point right after: its confirmation's wait) a read that ended
        without waiting may return without letting other tasks run first --
        it is still a cancel point.

        Raises:
            BackendError: the backend reported an error (``peer_lost`` set
                when the remote is gone; ``settled`` set when a transfer
                could not be stopped).
            TransferTimeout: ``transfer_timeout`` passed.
            BackendClosing: the backend began closing.
            trio.Cancelled: the calling task was cancelled.
        """
        ...

    async def notify(self, remote: RemoteAgent, message: bytes) -> None:
        """Post ``message`` to ``remote`` without a transfer (fire and forget).

        Raises:
            BackendError: it could not be posted.
        """
        ...

    def expect_reads(self) -> None:
        """Blocks were just exposed: consumers will read them soon (a hint for
        how eagerly :meth:`notifications` drives the local agent)."""
        ...

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        """New notifications by sending agent name, waiting up to ``wait`` s for some.

        Also drives the local agent's progress where the backend needs it
        (consumers' READs of our memory complete only then).

        Raises:
            BackendError: the backend raised.
        """
        ...

    def begin_close(self) -> None:
        """Make in-flight calls stop at their next poll (with BackendClosing)."""
        ...

    async def aclose(self) -> None:
        """Unload every remote agent and release everything the backend owns."""
        ...


class BackendFactory(Protocol):
    """``open_connector(..., backend=factory)``: creates a connector's backend.

    :meth:`trio_pd.NixlBackend.create` is the default;
    :meth:`trio_pd.testing.MemoryFabric.backend` makes in-memory ones.
    """

    def __call__(
        self,
        agent_name: str,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        config: ConnectorConfig,
    ) -> Awaitable[TransferBackend]: ...


class RemoteAgents:
    """A backend's loaded remote agents, their leases, and their unloading.

    Both backends keep their remotes in one of these, so the rule "a retired
    agent is unloaded when its last lease ends" has one implementation.

    Args:
        unload: releases one remote agent (the backend's own call).
        unload_timeout: how long an unload may take before it is given up on
            (it runs shielded, possibly in a cancelled task).
    """

    def __init__(
        self, unload: Callable[[RemoteAgent], Awaitable[None]], unload_timeout: float
    ) -> None:
        self._unload = unload
        self._unload_timeout = unload_timeout
        self._loaded: dict[str, RemoteAgent] = {}

    def __len__(self) -> int:
        return len(self._loaded)

    def __contains__(self, agent_name: str) -> bool:
        return agent_name in self._loaded

    def add(self, remote: RemoteAgent) -> None:
        self._loaded[remote.agent_name] = remote

    def discard(self, remote: RemoteAgent) -> bool:
        """Forget ``remote``; return whether it was loaded."""
        return self._loaded.pop(remote.agent_name, None) is not None

    def all(self) -> list[RemoteAgent]:
        return list(self._loaded.values())

    def revive(
        self,
        engine_id: str,
        incarnation: str,
        agent_name: str,
        layout: KVLayout,
        local_layout: KVLayout,
    ) -> RemoteAgent | None:
        """The loaded agent ``agent_name`` put back in service, if it is the one asked for.

        A retired agent stays loaded while pulls or an unstoppable transfer
        still hold it. If a new handshake finds the very same agent (same
        engine, incarnation and views: it was retired as *suspect* and has
        answered again), it is used again rather than loaded twice.

        Returns ``None`` if no agent of that name is loaded.

        Raises:
            BackendError: an agent of that name is loaded but differs (it is
                still in use by earlier pulls: retry later).
        """
        loaded = self._loaded.get(agent_name)
        if loaded is None:
            return None
        same = (loaded.engine_id, loaded.incarnation, loaded.layout, loaded.local_layout) == (
            engine_id,
            incarnation,
            layout,
            local_layout,
        )
        if not same:
            raise BackendError(
                f"agent {agent_name!r} is still loaded with other views (in use by "
                "earlier pulls); retry later"
            )
        loaded.retired = False
        return loaded

    def idle_retired(self) -> list[RemoteAgent]:
        """Retired agents nobody holds, still loaded (a backend's hold ended
        outside a lease); the backend unloads them at its next chance."""
        return [r for r in self._loaded.values() if r.retired and r.users == 0]

    def lease(self, remote: RemoteAgent) -> _Lease:
        """Hold ``remote`` for one pull; unload it at the end if it was retired.

        (A class, not a generator: every pull enters one, and a generator's
        context manager costs a pull a few microseconds more.)
        """
        return _Lease(self, remote)

    def _end_lease(self, remote: RemoteAgent) -> bool:
        """A lease on ``remote`` ended: whether to unload it now (it was
        retired, and this was its last lease; see :meth:`_unload_shielded`)."""
        remote.users -= 1
        return remote.retired and remote.users == 0

    async def _unload_shielded(self, remote: RemoteAgent) -> None:
        """Unload ``remote`` (retired, held by nobody): shielded, within ``unload_timeout``."""
        with trio.move_on_after(self._unload_timeout, shield=True):
            await self._unload(remote)

    async def retire(self, remote: RemoteAgent) -> None:
        if remote.retired:
            await trio.lowlevel.checkpoint()
            return
        remote.retired = True
        if remote.users == 0:
            await self._unload_shielded(remote)
        else:
            await trio.lowlevel.checkpoint()


class _Lease:
    """``async with remotes.lease(remote):`` (see :meth:`RemoteAgents.lease`).

    Raises:
        RemoteRetired: on entry, if ``remote`` was retired meanwhile.
    """

    __slots__ = ("_remote", "_remotes")

    def __init__(self, remotes: RemoteAgents, remote: RemoteAgent) -> None:
        self._remotes = remotes
        self._remote = remote

    async def __aenter__(self) -> RemoteAgent:
        remote = self._remote
        if remote.retired:
            raise RemoteRetired(remote.agent_name)
        remote.users += 1
        return remote

    async def __aexit__(self, *exc_info: object) -> None:
        # (no await unless the agent is to be unloaded: a pull's lease ends
        # without a second coroutine)
        if self._remotes._end_lease(self._remote):
            # (bounded and shielded inside: a retired agent's unload, within unload_timeout)
            await self._remotes._unload_shielded(self._remote)  # noqa: ASYNC102
