"""A prefill engine in its own process, driven over pipes (demo and tests).

The child (``main()`` of this module, in a new process) opens a real connector
on its own KV cache and serves JSON-line commands on stdin, one reply line per
command on stdout (logs go to stderr)::

    {"id": 1, "op": "expose", "request_id": "r1", "block_ids": [3, 7],
     "seed": 42, "consumers": 1}  -> {"id": 1, "kv_transfer_params": {...}}
    {"id": 2, "op": "wait_released", "request_id": "r1"}
                                   -> {"id": 2, "outcome": "read"}
    {"id": 3, "op": "statistics"}  -> {"id": 3, "statistics": {...}}

``expose`` first fills the blocks with the contents ``seed`` stands for (see
``_payload``), so the consumer can verify what it pulled. A failed command
replies ``{"id": N, "error": "...", "type": "ValueError"}``. End of input
closes the connector and exits 0.

The parent side is :func:`open_prefill_worker`. ``trio-pd demo`` runs its
prefill engines with it; :mod:`trio_pd.testing` re-exports its public names.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ._auth import CurveAuth
from ._child import open_child, read_lines
from ._config import ConnectorConfig
from ._connector import Connector
from ._exposures import Released
from ._groups import unwrapped_errors
from ._open_connector import open_connector
from ._payload import (
    fill_blocks,
    fill_heads,
    mismatched_blocks,
    mismatched_heads,
)
from ._records import RemoteBlocks

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


def _shape(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class WorkerSpec:
    """What the child process builds: its engines and their KV cache shape.

    Each engine has ``regions`` tensors of shape ``(blocks, *block_shape)``
    and ``dtype``, and its own connector (NIXL agent, side channel). With
    ``engines == 1`` the engine is called ``engine_id``; with more, they are
    ``engine_id-0``, ``engine_id-1``, ... (one process can host many cheap
    engines for benchmarks). ``port`` applies to a single engine only.

    ``tp_rank``/``tp_size`` make the (single) engine one rank of a
    tensor-parallel engine (``port`` is then its base port, and must be
    given); ``payload`` says how ``expose`` fills blocks: ``"blocks"``
    (:func:`fill_blocks`) or ``"heads"`` (:func:`fill_heads`, for TP).
    ``advertise_host`` is passed to :func:`~trio_pd.open_connector`.

    ``netns`` runs the process in that network namespace (a test host, see
    :func:`open_test_hosts`); ``env`` adds environment variables (for
    example ``{"UCX_TLS": "tcp"}``).
    """

    engine_id: str
    engines: int = 1
    regions: int = 4
    blocks: int = 64
    block_shape: tuple[int, ...] = attrs.field(default=(16, 128), converter=_shape)
    dtype: str = "float16"
    host: str = "127.0.0.1"
    port: int = 0
    config: Mapping[str, Any] = attrs.field(factory=dict)
    tp_rank: int = 0
    tp_size: int = 1
    payload: str = attrs.field(
        default="blocks", validator=attrs.validators.in_(("blocks", "heads"))
    )
    advertise_host: str | None = None
    netns: str = ""
    env: Mapping[str, str] = attrs.field(factory=dict)

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @property
    def engine_ids(self) -> list[str]:
        if self.engines == 1:
            return [self.engine_id]
        return [f"{self.engine_id}-{i}" for i in range(self.engines)]


def _jsonable(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, frozenset | set | tuple):
        return sorted(value) if isinstance(value, frozenset | set) else list(value)
    if isinstance(value, CurveAuth):
        return attrs.asdict(value, recurse=False)
    if isinstance(value, bytes):  # exposure_secret: hex (see _config_from_overrides)
        return value.hex()
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def config_overrides(config: ConnectorConfig) -> dict[str, Any]:
    """``config`` as JSON-able keyword arguments of :class:`ConnectorConfig`.

    An ``exposure_secret`` travels as hex (in the worker's command line: a
    test tool's secret, not a deployment's).
    """
    loaded: dict[str, Any] = json.loads(
        json.dumps(attrs.asdict(config, recurse=False), default=_jsonable)
    )
    return loaded


def _config_from_overrides(overrides: Mapping[str, Any]) -> ConnectorConfig:
    values = dict(overrides)
    if values.get("auth") is not None:
        values["auth"] = CurveAuth(**values["auth"])
    if isinstance(values.get("exposure_secret"), str):
        values["exposure_secret"] = bytes.fromhex(values["exposure_secret"])
    return ConnectorConfig(**values)


# ---- child side -----------------------------------------------------------


async def _child_main(spec: WorkerSpec, protocol_fd: int) -> None:
    import torch

    dtype = getattr(torch, spec.dtype)
    config = _config_from_overrides(spec.config)
    stdin = trio.lowlevel.FdStream(os.dup(0))
    stdout = trio.lowlevel.FdStream(protocol_fd)
    write_lock = trio.Lock()
    engines: list[tuple[Connector, list[Any]]] = []
    unsettled: dict[str, list[int]] = {}  # the local block ids of each pull, by request

    async def reply(message: dict[str, Any]) -> None:
        async with write_lock:
            await stdout.send_all(json.dumps(message, default=_jsonable).encode() + b"\n")

    async def handle(command: dict[str, Any]) -> None:
        cid = command.get("id")
        try:
            conn, kv_caches = engines[int(command.get("engine", 0))]
            result = await _run_command(conn, kv_caches, command, spec, unsettled)
        except Exception as exc:
            await reply({"id": cid, "error": str(exc), "type": type(exc).__name__})
        else:
            await reply({"id": cid, **result})

    async def run_engine(engine_id: str, *, task_status: trio.TaskStatus[None]) -> None:
        kv_caches = [
            torch.zeros((spec.blocks, *spec.block_shape), dtype=dtype) for _ in range(spec.regions)
        ]
        port = spec.port if spec.engines == 1 else 0
        async with open_connector(
            engine_id,
            kv_caches,
            host=spec.host,
            port=port,
            config=config,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            advertise_host=spec.advertise_host,
        ) as conn:
            engines.append((conn, kv_caches))
            task_status.started()
            await trio.sleep_forever()

    async with stdin, stdout, trio.open_nursery() as nursery:
        for engine_id in spec.engine_ids:  # one at a time: keeps the order
            await nursery.start(run_engine, engine_id)
        addresses = [[c.engine_id, *c.address] for c, _ in engines]
        host, port = engines[0][0].address
        await reply(
            {
                "id": 0,
                "ready": True,
                "host": host,
                "port": port,
                "pid": os.getpid(),
                "engines": addresses,
            }
        )
        async with trio.open_nursery() as commands:
            async for line in read_lines(stdin):
                commands.start_soon(handle, json.loads(line))
            commands.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


def _fill(spec: WorkerSpec, kv_caches: Sequence[Any], block_ids: Sequence[int], seed: int) -> None:
    if spec.payload == "heads":
        fill_heads(kv_caches, spec.tp_rank, block_ids, seed)
    else:
        fill_blocks(kv_caches, block_ids, seed)


async def _run_command(
    conn: Connector,
    kv_caches: Sequence[Any],
    command: dict[str, Any],
    spec: WorkerSpec,
    unsettled: dict[str, list[int]],
) -> dict[str, Any]:
    op = command.get("op")
    if op == "expose":
        _fill(spec, kv_caches, command["block_ids"], int(command["seed"]))
        remote = conn.expose(
            command["request_id"], command["block_ids"], int(command.get("consumers", 1))
        )
        return {"kv_transfer_params": remote.to_kv_transfer_params()}
    if op == "expose_many":  # [[request_id, block_ids, seed], ...], consumers 1
        params = []
        for request_id, block_ids, seed in command["requests"]:
            _fill(spec, kv_caches, block_ids, int(seed))
            params.append(conn.expose(request_id, block_ids).to_kv_transfer_params())
        return {"kv_transfer_params": params}
    if op == "wait_released":
        outcome = await conn.wait_released(command["request_id"])
        return {"outcome": outcome.value}
    if op == "statistics":
        return {"statistics": attrs.asdict(conn.statistics())}
    if op == "pull":  # this engine as a consumer: pull, then check the bytes
        remote = RemoteBlocks.from_kv_transfer_params(command["kv_transfer_params"])
        local_ids = command["local_block_ids"]
        unsettled[command["request_id"]] = local_ids  # (whichever way the pull ends)
        result = await conn.pull(command["request_id"], local_ids, remote)
        seed = int(command["seed"])
        if spec.payload == "heads":
            bad = mismatched_heads(kv_caches, spec.tp_rank, local_ids, remote.block_ids, seed)
        else:
            bad = mismatched_blocks(kv_caches, local_ids, seed)
        return {"bytes": result.bytes, "seconds": result.seconds, "mismatched": bad}
    if op == "wait_settled":  # a pull's transfer that could not be stopped
        local_ids = unsettled.pop(command["request_id"])
        await conn.wait_settled(local_ids)
        return {"mismatched": mismatched_blocks(kv_caches, local_ids, command["seed"])}

    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    # Replies own the real stdout; anything else printing (NIXL's C++ logs,
    # say) goes to stderr instead.
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = WorkerSpec(**json.loads(sys.argv[1]))
    trio.run(_child_main, spec, protocol_fd)


# ---- parent side ----------------------------------------------------------


@attrs.define(eq=False)
class _Pending:
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: dict[str, Any] | None = None


class PrefillWorker:
    """The parent's handle on a prefill worker process (see :func:`open_prefill_worker`)."""

    def __init__(self, spec: WorkerSpec, process: trio.Process) -> None:
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
    reaped (see ``trio_pd._child.open_child``).

    Raises:
        WorkerError: the worker exited before it was ready.
        trio.TooSlowError: it was not ready within ``startup_timeout`` seconds
            (each engine takes about 0.25 s to start here).
    """
    if config is not None:
        spec = attrs.evolve(spec, config=config_overrides(config))
    async with open_child(
        "trio_pd._prefill_worker", spec.to_json(), netns=spec.netns, env=spec.env
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
