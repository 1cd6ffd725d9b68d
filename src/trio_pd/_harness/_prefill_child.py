"""The prefill worker process: its engines' connectors, and the commands it serves.

The child (``main()`` of this module, in a new process started by
``_prefill_worker.open_prefill_worker``) builds what its
``_prefill_spec.WorkerSpec`` says: it opens a real connector on its own KV
cache per engine and serves JSON-line commands on stdin, one reply line per
command on stdout (logs go to stderr)::

    {"id": 1, "op": "expose", "request_id": "r1", "block_ids": [3, 7],
     "seed": 42, "consumers": 1}  -> {"id": 1, "kv_transfer_params": {...}}
    {"id": 2, "op": "wait_released", "request_id": "r1"}
                                   -> {"id": 2, "outcome": "read"}
    {"id": 3, "op": "statistics"}  -> {"id": 3, "statistics": {...}}

``expose`` first fills the blocks with the contents ``seed`` stands for (see
``_seeded_blocks``), so the consumer can verify what it pulled. A failed command
replies ``{"id": N, "error": "...", "type": "ValueError"}``. End of input
closes the connectors and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from trio_pd._connector import Connector, open_connector
from trio_pd._core._public_values import RemoteBlocks
from trio_pd._harness._child_process import read_lines
from trio_pd._harness._prefill_spec import WorkerSpec, config_from_overrides, jsonable
from trio_pd._harness._seeded_blocks import (
    fill_blocks,
    fill_heads,
    mismatched_blocks,
    mismatched_heads,
)


async def _child_main(spec: WorkerSpec, protocol_fd: int) -> None:
    import torch

    dtype = getattr(torch, spec.dtype)
    config = config_from_overrides(spec.config)
    stdin = trio.lowlevel.FdStream(os.dup(0))
    stdout = trio.lowlevel.FdStream(protocol_fd)
    write_lock = trio.Lock()
    engines: list[tuple[Connector, list[Any]]] = []
    unsettled: dict[str, list[int]] = {}  # the local block ids of each pull, by request

    async def reply(message: dict[str, Any]) -> None:
        async with write_lock:
            await stdout.send_all(json.dumps(message, default=jsonable).encode() + b"\n")

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
