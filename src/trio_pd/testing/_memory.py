"""An in-memory transfer backend with injectable faults (no UCX, no threads).

Connectors in one process that share a :class:`MemoryFabric` move bytes
between their CPU tensors directly: a READ copies the remote blocks into the
local ones, a notification lands in the producer's inbox. Everything runs on
the trio thread and waits with trio's clock, so tests of handshake, backoff,
restart, cancellation and close logic are fast. With the fabric's side
channel too (``_memory_side_channel``: ``side_channel=fabric.side_channel``)
nothing is real but trio's clock, and ``autojump_clock`` works; with the
real ZeroMQ side channel, give the autojump clock a threshold so that its
sockets get time to answer.

Faults are set per producer engine (:meth:`MemoryFabric.faults`) and apply to
every consumer's calls that target that engine: slow or failing reads, reads
that never end, slow or failing agent loads; on the fabric's side channel,
slow, unanswered, refused or unreachable requests. :meth:`MemoryFabric.cut`
cuts an engine's data plane (loads fail, reads fail with a lost peer) until
:meth:`MemoryFabric.restore`; a producer whose connector closed is gone the
same way, for good.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._core._layout import KVLayout
from trio_pd._harness._seeded_blocks import block_bytes
from trio_pd._transfer._backend import (
    NO_UNSETTLED,
    BackendClosing,
    BackendError,
    Loaded,
    LoadRequest,
    RemoteAgent,
    RemoteAgents,
    TransferTimeout,
    UnsettledHook,
    load_one_by_one,
)
from trio_pd.testing._memory_side_channel import Addresses, BoundListener, MemorySideChannel

if TYPE_CHECKING:
    import torch

_PREFIX = b"trio_pd.memory:"


@attrs.define
class MemoryFaults:
    """Faults injected into calls that target one producer engine.

    Change the fields at any time; each call reads them when it starts (a
    side-channel request, each time it tries).

    Attributes:
        read_delay: a READ waits this long (trio's clock) before copying.
        read_error: if set, READs fail with :class:`~trio_pd.BackendError`
            carrying this message, and copy nothing.
        hang_reads: READs never complete (until their timeout, cancellation
            or close); nothing is copied.
        load_delay: loading the engine's agent takes this long.
        load_error: if set, loading the engine's agent fails with this message.
        hang_loads: loading the engine's agent never completes.
        unstoppable_reads: READs never complete *and cannot be stopped*, like
            a NIXL transfer to a partitioned peer: told to stop (cancel,
            timeout, close), one keeps running past ``close_timeout``, its
            local blocks reported unsettled; when
            :meth:`MemoryFabric.finish_unstoppable_reads` is called, each
            copies the producer's blocks as they are *then* (a late write)
            and delivers its notification; only then is it settled.
        unload_delay: removing the engine's agent (after a restart, a lost
            peer) takes this long, as a NIXL ``remove_remote_agent`` thread
            call does.
        notification_error: if set, the engine's *own* polls for
            notifications fail with :class:`~trio_pd.BackendError` carrying
            this message (a producer whose agent misbehaves).

    On the fabric's side channel (:meth:`MemoryFabric.side_channel`; metadata
    fetches, heartbeats, abandons, confirmations):

    Attributes:
        reply_delay: each request to the engine is answered this long after
            it was sent (a slow link, a busy producer), by whichever listener
            is at its address then.
        mute: the engine's listener takes requests and never answers ("connected,
            but the peer never replied").
        refuse: connections to the engine's side channel are refused, as by a
            closed port (retried, as ZeroMQ does, until the caller's deadline).
        unreachable: the engine's side channel cannot be reached at all (a
            partition): nothing connects, nothing is refused, requests wait
            until their deadline, or until this is cleared.
    """

    read_delay: float = 0.0
    read_error: str | None = None
    hang_reads: bool = False
    load_delay: float = 0.0
    load_error: str | None = None
    hang_loads: bool = False
    unstoppable_reads: bool = False
    notification_error: str | None = None
    unload_delay: float = 0.0
    reply_delay: float = 0.0
    mute: bool = False
    refuse: bool = False
    unreachable: bool = False


@attrs.define(eq=False)
class _UnstoppableRead:
    """A READ under ``unstoppable_reads``: copies when finished, whenever that is."""

    copy: Callable[[], None]
    done: trio.Event = attrs.field(factory=trio.Event)
    on_done: list[Callable[[], None]] = attrs.field(factory=list)


_NO_FAULTS = MemoryFaults()


class MemoryFabric:
    """The shared "network" of in-memory backends and side channels, and the
    fault switchboard.

    Use :meth:`backend` as ``open_connector(..., backend=fabric.backend)`` for
    every connector that should reach the others, and :meth:`side_channel`
    (``side_channel=fabric.side_channel``) to replace ZeroMQ as well.
    """

    def __init__(self) -> None:
        self._agents: dict[str, MemoryBackend] = {}
        self._cut: set[str] = set()
        self._faults: dict[str, MemoryFaults] = defaultdict(MemoryFaults)
        self.reads = 0
        """READs that copied bytes, over the fabric's life."""
        self.backends: list[MemoryBackend] = []
        """Every backend this fabric made, in order (closed ones included)."""
        self._unstoppable: dict[str, list[_UnstoppableRead]] = defaultdict(list)
        self._addresses = Addresses()
        self.side_channel_requests = 0
        """Requests sent on the fabric's side channel, over its life (a
        confirmation counts one; each request once, however often it is tried)."""

    def side_channel(self, agent_name: str, config: ConnectorConfig) -> MemorySideChannel:
        """A side-channel factory (``open_connector(..., side_channel=fabric.side_channel)``):
        a new in-memory side channel on this fabric, for the connector whose
        agent is ``agent_name``. Listeners bound with ``port=0`` get ports of
        the fabric's own (from 61000, clear of
        :func:`~trio_pd.testing.free_port_range`'s); an address in use raises
        :class:`OSError`, as a real bind does. No CURVE: a ``config.auth``
        raises :class:`ValueError`.
        """
        return MemorySideChannel(self, agent_name, config)

    def _side_channel_faults(self, bound: BoundListener | None, engine_id: str) -> MemoryFaults:
        """The faults of the listener at an address (its agent's, else its
        engine's), or of ``engine_id`` when nobody listens there."""
        keys = [engine_id] if bound is None else [bound.agent_name, bound.engine_id]
        for key in keys:
            faults = self._faults.get(key)
            if faults is not None:
                return faults
        return _NO_FAULTS

    async def backend(
        self,
        agent_name: str,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        config: ConnectorConfig,
    ) -> MemoryBackend:
        """A :class:`~trio_pd.BackendFactory`: a new in-memory backend on this fabric."""
        await trio.lowlevel.checkpoint()
        if layout.mem_type != "DRAM":
            raise BackendError("the in-memory backend needs CPU tensors")
        backend = MemoryBackend(self, agent_name, list(kv_caches), layout, config)
        self._agents[agent_name] = backend
        self.backends.append(backend)
        return backend

    def faults(self, engine_id: str) -> MemoryFaults:
        """The faults for calls that target ``engine_id`` (created on first use).

        ``engine_id`` may also be one agent's name (``"{engine_id}#{incarnation}"``,
        e.g. one rank of a tensor-parallel engine): its faults then apply to
        that agent instead of the engine's.
        """
        return self._faults[engine_id]

    def _faults_for(self, remote: RemoteAgent) -> MemoryFaults:
        by_agent = self._faults.get(remote.agent_name)
        return by_agent if by_agent is not None else self._faults[remote.engine_id]

    def cut(self, engine_id: str) -> None:
        """Cut ``engine_id``'s data plane: its agents cannot be loaded or read."""
        self._cut.add(engine_id)

    def restore(self, engine_id: str) -> None:
        """Undo :meth:`cut`."""
        self._cut.discard(engine_id)

    def unstoppable_reads_running(self, engine_id: str) -> int:
        """READs from ``engine_id`` held by ``unstoppable_reads`` now."""
        return len(self._unstoppable[engine_id])

    def finish_unstoppable_reads(self, engine_id: str) -> int:
        """Let every READ held by ``unstoppable_reads`` of ``engine_id`` end now:
        each copies (late, if its pull already ended) and settles. Returns how many."""
        reads, self._unstoppable[engine_id] = self._unstoppable[engine_id], []
        for read in reads:
            read.copy()
            read.done.set()
            for callback in read.on_done:
                callback()
        return len(reads)

    def _reach(self, agent_name: str) -> MemoryBackend | None:
        agent = self._agents.get(agent_name)
        return None if agent is None or agent.engine_id in self._cut else agent

    def _leave(self, backend: MemoryBackend) -> None:
        if self._agents.get(backend.agent_name) is backend:
            del self._agents[backend.agent_name]


class MemoryBackend:
    """A :class:`~trio_pd.TransferBackend` that copies between tensors in memory.

    Agent names are ``{engine_id}#{incarnation}`` (as :func:`~trio_pd.open_connector`
    makes them). CPU tensors only.
    """

    def __init__(
        self,
        fabric: MemoryFabric,
        agent_name: str,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: ConnectorConfig,
    ) -> None:
        self._fabric = fabric
        self._agent_name = agent_name
        self.engine_id = agent_name.rsplit("#", 1)[0]
        self._layout = layout
        self._blocks = [block_bytes(t) for t in kv_caches]
        self._remotes = RemoteAgents(self._unload, config.close_timeout)
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self._notified = trio.Event()
        self._closing = trio.Event()
        self._transfer_timeout = config.transfer_timeout
        self._close_timeout = config.close_timeout
        self._reads = 0
        self._unsettled = 0
        self.notification_polls = 0
        """Calls of :meth:`notifications` so far (tests of the producer's pacing)."""

    @property
    def agent_name(self) -> str:
        return self._agent_name

    @property
    def remote_agents_loaded(self) -> int:
        return len(self._remotes)

    @property
    def transfers_posted(self) -> int:
        return self._reads

    @property
    def transfers_unsettled(self) -> int:
        return self._unsettled

    @property
    def stuck_call(self) -> str:
        return ""  # (a hung in-memory load is cancelled; it holds no lock)

    def remote_agents(self) -> list[RemoteAgent]:
        """The remote agents loaded now (for tests that act on them)."""
        return self._remotes.all()

    def agent_metadata(self) -> bytes:
        return _PREFIX + self._agent_name.encode()

    async def load_remotes(self, requests: Sequence[LoadRequest], loaded: Loaded) -> None:
        await load_one_by_one(self.load_remote, requests, loaded)

    async def load_remote(self, request: LoadRequest) -> RemoteAgent:
        """Load one agent (faults apply); cancelled at its deadline by ``load_remotes``."""
        faults = self._fabric.faults(request.engine_id)
        await self._wait(math.inf if faults.hang_loads else faults.load_delay)
        if faults.load_error is not None:
            raise BackendError(f"add_remote_agent: {faults.load_error}")
        if not request.agent_metadata.startswith(_PREFIX):
            raise BackendError("add_remote_agent: not in-memory agent metadata")
        named = request.agent_metadata[len(_PREFIX) :].decode()
        name = request.agent_name
        if named != name:
            raise BackendError(f"metadata names agent {named!r}, reply said {name!r}")
        engine_id, incarnation = request.engine_id, request.incarnation
        layout, local_layout = request.layout, request.local_layout
        revived = self._remotes.revive(engine_id, incarnation, name, layout, local_layout)
        if revived is not None:
            return revived
        if self._fabric._reach(name) is None:
            raise BackendError(f"make_connection: agent {name!r} is gone", peer_lost=True)
        remote = RemoteAgent(engine_id, incarnation, name, layout, local_layout)
        self._remotes.add(remote)
        return remote

    def lease(self, remote: RemoteAgent) -> AbstractAsyncContextManager[RemoteAgent]:
        return self._remotes.lease(remote)

    async def retire(self, remote: RemoteAgent) -> None:
        await self._remotes.retire(remote)

    async def _unload(self, remote: RemoteAgent) -> None:
        self._remotes.discard(remote)
        delay = self._fabric._faults_for(remote).unload_delay
        if delay:
            await trio.sleep(delay)  # (callers shield and bound it)
        else:
            await trio.lowlevel.checkpoint()

    async def read(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        unsettled: UnsettledHook = NO_UNSETTLED,
        *,
        schedule: bool = True,  # (always a full checkpoint here)
    ) -> None:
        faults = self._fabric._faults_for(remote)
        if faults.unstoppable_reads:
            await self._unstoppable_read(
                remote, local_indices, remote_indices, notification, unsettled
            )
            return
        with trio.move_on_after(self._transfer_timeout) as deadline:
            await self._wait(math.inf if faults.hang_reads else faults.read_delay)
        if deadline.cancelled_caught:
            raise TransferTimeout
        peer = self._peer(remote)
        if faults.read_error is not None:
            raise BackendError(f"transfer: {faults.read_error}")
        self._copy(peer, remote, local_indices, remote_indices)
        peer._deliver(self._agent_name, notification)

    def _copy(
        self,
        peer: MemoryBackend,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
    ) -> None:
        _copy_blocks(
            _view_bytes(self._blocks, self._layout, remote.local_layout),
            local_indices,
            _view_bytes(peer._blocks, peer._layout, remote.layout),
            remote_indices,
        )
        self._fabric.reads += 1
        self._reads += 1

    async def _unstoppable_read(
        self,
        remote: RemoteAgent,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes,
        unsettled: UnsettledHook,
    ) -> None:
        """A READ that ends only when the fabric says so; stopping it does not
        stop it (see ``MemoryFaults.unstoppable_reads``)."""
        peer = self._peer(remote)

        def copy() -> None:
            self._copy(peer, remote, local_indices, remote_indices)
            peer._deliver(self._agent_name, notification)

        read = _UnstoppableRead(copy)
        self._fabric._unstoppable[remote.engine_id].append(read)
        closing = False
        try:
            with trio.move_on_after(self._transfer_timeout):
                async with trio.open_nursery() as nursery:

                    async def until_closing() -> None:
                        nonlocal closing
                        await self._closing.wait()
                        closing = True
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(until_closing)
                    await read.done.wait()
                    nursery.cancel_scope.cancel()
            if read.done.is_set():
                return
        finally:
            if not read.done.is_set():  # told to stop: it goes on, as NIXL's would
                with trio.move_on_after(self._close_timeout, shield=True):
                    await read.done.wait()
            if not read.done.is_set():
                self._unsettled += 1
                read.on_done += [self._one_settled, unsettled()]
        if read.done.is_set():
            return  # (it finished while being stopped)
        settled = trio.Event()
        read.on_done.append(settled.set)
        why = "closing" if closing else "timed out"
        raise BackendError(
            f"a transfer from {remote.agent_name!r} did not stop ({why}); its blocks may "
            "still be written until it ends",
            peer_lost=True,
            settled=settled,
        )

    def _one_settled(self) -> None:
        self._unsettled -= 1

    async def notify(self, remote: RemoteAgent, message: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self._peer(remote)._deliver(self._agent_name, message)

    def expect_reads(self) -> None:
        pass  # (nothing to drive in memory)

    async def notifications(self, wait: float) -> dict[str, list[bytes]]:
        self.notification_polls += 1
        error = self._fabric.faults(self.engine_id).notification_error
        if error is not None:
            await trio.lowlevel.checkpoint()
            raise BackendError(f"get_new_notifs: {error}")
        if not self._inbox:
            with trio.move_on_after(wait):
                await self._notified.wait()
        else:
            await trio.lowlevel.checkpoint()
        out, self._inbox = dict(self._inbox), defaultdict(list)
        self._notified = trio.Event()
        return out

    def begin_close(self) -> None:
        self._closing.set()

    async def aclose(self) -> None:
        for remote in self._remotes.all():
            self._remotes.discard(remote)
        self._fabric._leave(self)
        await trio.lowlevel.checkpoint()

    def _peer(self, remote: RemoteAgent) -> MemoryBackend:
        peer = self._fabric._reach(remote.agent_name)
        if peer is None:
            raise BackendError(
                f"transfer: agent {remote.agent_name!r} disconnected", peer_lost=True
            )
        return peer

    def _deliver(self, sender: str, message: bytes) -> None:
        if message:
            self._inbox[sender].append(message)
            self._notified.set()

    async def _wait(self, seconds: float) -> None:
        """Sleep ``seconds`` (0: just a checkpoint); raise BackendClosing if closing first."""
        if self._closing.is_set():
            await trio.lowlevel.checkpoint()
            raise BackendClosing
        with trio.move_on_after(seconds):
            await self._closing.wait()
            raise BackendClosing


def _view_bytes(
    blocks: list[npt.NDArray[np.uint8]], layout: KVLayout, view: KVLayout
) -> list[npt.NDArray[np.uint8]]:
    """The byte ranges of ``view`` (a head slice of ``layout``) in each region's blocks."""
    offsets = [v - b for v, b in zip(view.base_addrs, layout.base_addrs, strict=True)]
    return [
        region[:, offset : offset + length]
        for region, offset, length in zip(blocks, offsets, view.block_lens, strict=True)
    ]


def _copy_blocks(
    local: list[npt.NDArray[np.uint8]],
    local_indices: npt.NDArray[np.int32],
    remote: list[npt.NDArray[np.uint8]],
    remote_indices: npt.NDArray[np.int32],
) -> None:
    """Copy descriptor ``remote_indices[k]`` into ``local_indices[k]``, a region at a time."""
    local_n, remote_n = local[0].shape[0], remote[0].shape[0]
    for region in range(len(local)):
        mask = (local_indices // local_n) == region
        if mask.any():
            dst = local_indices[mask] % local_n
            wanted = remote_indices[mask]
            local[region][dst] = remote[int(wanted[0] // remote_n)][wanted % remote_n]
