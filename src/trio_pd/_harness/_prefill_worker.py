"""A prefill engine in its own process, driven over pipes: the parent's side (demo and tests).

:func:`open_prefill_worker` starts the process (``_prefill_child``, which
builds what a ``_prefill_spec.WorkerSpec`` says) and yields a
:class:`PrefillWorker`, whose methods send one JSON-line command each and
wait for its reply; a reply task matches replies to commands. ``trio-pd
demo`` runs its prefill engines with it; :mod:`trio_pd.testing` re-exports
its public names (and ``WorkerSpec``).
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._core._exposures import Released
from trio_pd._core._public_values import RemoteBlocks
from trio_pd._exception_groups import unwrapped_errors
from trio_pd._harness._child_process import ChildProcess, open_child, read_lines
from trio_pd._harness._prefill_spec import WorkerSpec, config_overrides

_STARTUP_TIMEOUT = 60.0


class WorkerError(Exception):
    """A command failed in the worker, or the worker died.

    Attributes:
        error_type: the name of the exception the worker raised (``""`` if
            the worker died).
    """

    def __init__(self, message: str, error_type: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type


@attrs.define(eq=False)
class _Pending:
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: dict[str, Any] | None = None


class PrefillWorker:
    """The parent's handle on a prefill worker process (see :func:`open_prefill_worker`)."""

    def __init__(self, spec: WorkerSpec, process: ChildProcess) -> None:
        self.spec = spec
        self.process = process
        self.host = ""
        self.port = 0
        self.addresses: list[tuple[str, str, int]] = []
        """``(engine_id, host, port)`` of every engine, in order."""
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        self._dead: str | None = None
        self._send_lock = trio.Lock()

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    async def expose(
        self,
        request_id: str,
        block_ids: Sequence[int],
        seed: int,
        consumers: int = 1,
        *,
        engine: int = 0,
    ) -> RemoteBlocks:
        """Fill ``block_ids`` from ``seed`` in the worker's ``engine`` and expose them."""
        reply = await self._call(
            op="expose",
            engine=engine,
            request_id=request_id,
            block_ids=[int(b) for b in block_ids],
            seed=seed,
            consumers=consumers,
        )
        return RemoteBlocks.from_kv_transfer_params(reply["kv_transfer_params"])

    async def expose_many(
        self, requests: Sequence[tuple[str, Sequence[int], int]], *, engine: int = 0
    ) -> list[RemoteBlocks]:
        """:meth:`expose` for many ``(request_id, block_ids, seed)`` in one round trip."""
        reply = await self._call(
            op="expose_many",
            engine=engine,
            requests=[[r, [int(b) for b in ids], s] for r, ids, s in requests],
        )
        return [RemoteBlocks.from_kv_transfer_params(p) for p in reply["kv_transfer_params"]]

    async def wait_released(self, request_id: str, *, engine: int = 0) -> Released:
        reply = await self._call(op="wait_released", engine=engine, request_id=request_id)
        return Released(reply["outcome"])

    async def statistics(self, *, engine: int = 0) -> dict[str, Any]:
        reply = await self._call(op="statistics", engine=engine)
        stats: dict[str, Any] = reply["statistics"]
        return stats

    async def pull(
        self,
        request_id: str,
        local_block_ids: Sequence[int],
        remote: RemoteBlocks,
        seed: int,
        *,
        engine: int = 0,
    ) -> dict[str, Any]:
        """Pull ``remote`` into this worker's ``engine`` (a consumer in its own process).

        Returns ``{"bytes", "seconds", "mismatched"}``: the local block ids
        whose bytes differ from what ``seed`` stands for (``[]`` when all
        arrived intact).

        Raises:
            WorkerError: the pull failed; ``error_type`` names the exception
                (``"TransferError"``, ``"HandshakeError"``, ...).
        """
        return await self._call(
            op="pull",
            engine=engine,
            request_id=request_id,
            local_block_ids=[int(b) for b in local_block_ids],
            kv_transfer_params=remote.to_kv_transfer_params(),
            seed=seed,
        )

    async def wait_settled(self, request_id: str, seed: int) -> list[int]:
        """Wait until no transfer of this worker's pull ``request_id`` can
        write its local blocks (``Connector.wait_settled``: at once unless
        a transfer could not be stopped); return the local block ids whose
        bytes differ from what ``seed`` stands for.

        Raises:
            WorkerError: this worker never pulled ``request_id`` (``KeyError``).
        """
        reply = await self._call(op="wait_settled", request_id=request_id, seed=seed)
        mismatched: list[int] = reply["mismatched"]
        return mismatched

    def kill(self) -> None:
        """SIGKILL the worker (fault injection)."""
        self.process.send_signal(signal.SIGKILL)

    async def _call(self, **command: Any) -> dict[str, Any]:
        if self._dead is not None:
            raise WorkerError(f"worker {self.engine_id!r} is gone: {self._dead}")
        cid, self._next_id = self._next_id, self._next_id + 1
        pending = self._pending[cid] = _Pending()
        assert self.process.stdin is not None
        try:
            async with self._send_lock:
                line = json.dumps({"id": cid, **command}).encode() + b"\n"
                await self.process.stdin.send_all(line)
        except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            # It went away while this command waited to be sent (found by the soak).
            self._pending.pop(cid, None)
            raise WorkerError(f"worker {self.engine_id!r} is gone: {self._dead or exc}") from None
        try:
            await pending.done.wait()
        finally:
            self._pending.pop(cid, None)
        reply = pending.reply
        if reply is None:
            raise WorkerError(f"worker {self.engine_id!r} is gone: {self._dead}")
        if "error" in reply:
            if reply.get("type") == "ValueError":
                raise ValueError(reply["error"])
            raise WorkerError(
                f"worker {self.engine_id!r}: {reply['type']}: {reply['error']}", reply["type"]
            )
        return reply

    async def _read_replies(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self.process.stdout is not None
        started = False
        try:
            async for line in read_lines(self.process.stdout):
                reply = json.loads(line)
                if reply.get("ready") and not started:
                    self.host, self.port = reply["host"], int(reply["port"])
                    self.addresses = [(e, h, int(p)) for e, h, p in reply["engines"]]
                    started = True
                    task_status.started()
                    continue
                pending = self._pending.get(reply.get("id"))
                if pending is not None:
                    pending.reply = reply
                    pending.done.set()
        finally:
            self._dead = "its output ended (exited or killed)"
            for pending in self._pending.values():
                pending.done.set()
        if not started:
            raise WorkerError(f"worker {self.engine_id!r} exited before it was ready")


@asynccontextmanager
async def open_prefill_worker(
    spec: WorkerSpec,
    *,
    config: ConnectorConfig | None = None,
    startup_timeout: float = _STARTUP_TIMEOUT,
) -> AsyncIterator[PrefillWorker]:
    """Start a prefill worker process and wait until its connectors listen.

    On exit the worker's stdin is closed (it closes its connectors and exits);
    if it has not exited within 10 s it is killed. The process is always
    reaped (see ``trio_pd._harness._child_process.open_child``).

    Raises:
        WorkerError: the worker exited before it was ready.
        trio.TooSlowError: it was not ready within ``startup_timeout`` seconds
            (each engine takes about 0.25 s to start here).
    """
    if config is not None:
        spec = attrs.evolve(spec, config=config_overrides(config))
    async with open_child(
        "trio_pd._harness._prefill_child", spec.to_json(), netns=spec.netns, env=spec.env
    ) as process:
        worker = PrefillWorker(spec, process)
        async with unwrapped_errors(), trio.open_nursery() as nursery:
            with trio.fail_after(startup_timeout):
                await nursery.start(worker._read_replies)
            try:
                yield worker
            finally:
                nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_prefill_workers(
    specs: Sequence[WorkerSpec],
    *,
    config: ConnectorConfig | None = None,
    startup_timeout: float = _STARTUP_TIMEOUT,
) -> AsyncIterator[list[PrefillWorker]]:
    """Start several prefill workers in parallel; stop them all on exit.

    Each worker lives in its own task of an internal nursery, so they start
    (and stop) concurrently. Yields the workers in the order of ``specs``.
    """
    workers: list[PrefillWorker | None] = [None] * len(specs)
    stop = trio.Event()

    async def run_one(index: int, *, task_status: trio.TaskStatus[None]) -> None:
        async with open_prefill_worker(
            specs[index], config=config, startup_timeout=startup_timeout
        ) as worker:
            workers[index] = worker
            task_status.started()
            await stop.wait()

    async with unwrapped_errors(), trio.open_nursery() as nursery:
        async with trio.open_nursery() as starting:
            for index in range(len(specs)):
                starting.start_soon(nursery.start, run_one, index)
        try:
            yield [w for w in workers if w is not None]
        finally:
            stop.set()
