"""``trio-pd demo``: a small but real P/D deployment on one machine.

* ``prefill_engines`` prefill engines, each its own process with its own KV
  cache (``regions`` x ``blocks`` x ``block_bytes``) and connector;
* one decode engine: this process, with a connector on a KV cache of the same
  layout;
* a driver (also this process) that plays the P/D proxy: for each request it
  picks a prefill engine, allocates blocks there, has the engine fill them with
  request-specific content and ``expose`` them, forwards the
  ``kv_transfer_params`` to the decoder, which allocates local blocks, pulls
  and verifies every byte; the prefill blocks are freed when the engine says
  they were read (or expired).

Faults can be injected to watch the failure handling: a slow link in front of
one engine's side channel (its handshake is slow; other engines are not
held up), or an engine killed in the middle of the run (its requests fail
with clear errors; the others go on).
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import trio

from .._config import ConnectorConfig
from .._connector import Connector, open_connector
from .._records import RemoteBlocks
from ..testing._payload import mismatched_blocks
from ..testing._prefill_worker import PrefillWorker, WorkerError, WorkerSpec, open_prefill_workers
from ..testing._relay import open_delay_relays
from ..testing._stall import LoopStallMonitor


@attrs.frozen(kw_only=True)
class DemoOptions:
    prefill_engines: int = 2
    requests: int = 64
    regions: int = 32
    blocks: int = 256
    block_bytes: int = 16384
    max_prompt_blocks: int = 32
    concurrency: int = 8
    seed: int = 0
    slow_engine_delay: float = 0.0
    """One-way latency added in front of engine 0's side channel (0: none)."""
    kill_engine_after: int = 0
    """Kill the last prefill engine after this many requests (0: never)."""
    progress: bool = True


class BlockPool:
    """Free block ids of one KV cache; waiting for blocks applies back-pressure."""

    def __init__(self, count: int, rng: random.Random) -> None:
        self._free = list(range(count))
        rng.shuffle(self._free)
        self._waiters = trio.lowlevel.ParkingLot()

    async def take(self, count: int) -> list[int]:
        await trio.lowlevel.checkpoint()
        while len(self._free) < count:
            await self._waiters.park()
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def give_back(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)
        self._waiters.unpark_all()


@attrs.define
class _Tally:
    ok: int = 0
    failed: int = 0
    corrupt: int = 0
    done: int = 0
    bytes: int = 0
    latencies: list[float] = attrs.field(factory=list)
    handshake_waits: dict[str, float] = attrs.field(factory=dict)
    errors: list[str] = attrs.field(factory=list)


async def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the deployment; return the summary (see :func:`format_summary`)."""
    import torch

    o = options
    if o.max_prompt_blocks > o.blocks:
        raise ValueError("max_prompt_blocks cannot exceed blocks")
    rng = random.Random(o.seed)
    block_shape = (o.block_bytes // 2,)
    specs = [
        WorkerSpec(f"prefill-{i}", regions=o.regions, blocks=o.blocks, block_shape=block_shape)
        for i in range(o.prefill_engines)
    ]
    local = [torch.zeros((o.blocks, *block_shape), dtype=torch.float16) for _ in range(o.regions)]
    tally = _Tally()
    monitor = LoopStallMonitor()
    started = time.perf_counter()
    async with open_prefill_workers(specs) as workers:
        startup = time.perf_counter() - started
        targets = [(w.host, w.port) for w in workers]
        delay = o.slow_engine_delay
        relays = open_delay_relays(targets[:1], delay) if delay else _no_relays()
        async with relays as relay_ports:
            config = ConnectorConfig(handshake_timeout=max(5.0, 20 * delay))
            async with open_connector("decode-0", local, config=config) as decoder:
                # What a serving process does after start-up: move the long-lived
                # objects (torch, numpy, ...) out of the collector's way, so a
                # full collection does not stall the loop for tens of ms.
                gc.collect()
                gc.freeze()
                trio.lowlevel.add_instrument(monitor)
                try:
                    run_started = time.perf_counter()
                    await _drive(o, rng, workers, relay_ports, decoder, local, tally)
                    elapsed = time.perf_counter() - run_started
                finally:
                    trio.lowlevel.remove_instrument(monitor)
                    gc.unfreeze()
                stats = decoder.statistics()
    if o.progress and sys.stderr.isatty():
        print(file=sys.stderr)
    latencies = np.asarray(tally.latencies or [0.0]) * 1e3
    waits = list(tally.handshake_waits.values()) or [0.0]
    faults = bool(o.kill_engine_after or o.slow_engine_delay)
    return {
        "requests": o.requests,
        "requests_ok": tally.ok,
        "requests_failed": tally.failed,
        "requests_corrupt": tally.corrupt,
        "prefill_engines": o.prefill_engines,
        "handshakes": stats.handshakes_succeeded,
        "handshakes_failed": stats.handshakes_failed,
        "handshake_ms_max": round(max(waits) * 1e3, 1),
        "handshake_ms_mean": round(sum(waits) / len(waits) * 1e3, 1),
        "pull_p50_ms": round(float(np.percentile(latencies, 50)), 2),
        "pull_p99_ms": round(float(np.percentile(latencies, 99)), 2),
        "bytes_pulled": tally.bytes,
        "gb_per_s": round(tally.bytes / elapsed / 1e9, 3) if elapsed else 0.0,
        "largest_loop_stall_ms": round(monitor.longest * 1e3, 2),
        "startup_s": round(startup, 2),
        "run_s": round(elapsed, 2),
        "faults_injected": faults,
        "errors": tally.errors[:10],
        "verified": tally.corrupt == 0 and (tally.failed == 0 or faults),
    }


async def _drive(
    o: DemoOptions,
    rng: random.Random,
    workers: list[PrefillWorker],
    relay_ports: list[int],
    decoder: Connector,
    local: list[Any],
    tally: _Tally,
) -> None:
    local_pool = BlockPool(o.blocks, rng)
    remote_pools = [BlockPool(o.blocks, rng) for _ in workers]
    slots = trio.Semaphore(o.concurrency)

    async def one_request(n: int, engine: int, prompt_blocks: int, seed: int) -> None:
        worker = workers[engine]
        rid = f"req-{n}"
        remote_ids = await remote_pools[engine].take(prompt_blocks)
        local_ids = await local_pool.take(prompt_blocks)
        try:
            # prefill: the engine computes (here: fills) the blocks and exposes them
            remote = await worker.expose(rid, remote_ids, seed)
            if engine == 0 and relay_ports:
                remote = attrs.evolve(remote, host="127.0.0.1", port=relay_ports[0])
            # the proxy forwards kv_transfer_params; the decoder pulls
            params = remote.to_kv_transfer_params()
            result = await decoder.pull(
                rid, local_ids, RemoteBlocks.from_kv_transfer_params(params)
            )
            if result.handshake_wait > 0.001 and worker.engine_id not in tally.handshake_waits:
                tally.handshake_waits[worker.engine_id] = result.handshake_wait
            # verify off the loop: it is the demo's work, not the connector's
            if await trio.to_thread.run_sync(mismatched_blocks, local, local_ids, seed):
                tally.corrupt += 1
            tally.ok += 1
            tally.bytes += result.bytes
            tally.latencies.append(result.seconds)
        except Exception as exc:  # a failed request is reported, the rest go on
            tally.failed += 1
            tally.errors.append(f"{rid} ({worker.engine_id}): {type(exc).__name__}: {exc}")
            remote_pools[engine].give_back(remote_ids)
        else:
            # the prefill engine frees its blocks once they were read; if it
            # died meanwhile, they are gone with it
            with contextlib.suppress(WorkerError):
                await worker.wait_released(rid)
                remote_pools[engine].give_back(remote_ids)
        finally:
            local_pool.give_back(local_ids)
            tally.done += 1
            if o.progress:
                _progress(tally, o.requests)
            slots.release()

    async with trio.open_nursery() as nursery:
        for n in range(o.requests):
            if o.kill_engine_after and n == o.kill_engine_after and len(workers) > 1:
                workers[-1].kill()
            engine = n % len(workers)
            prompt_blocks = rng.randint(1, o.max_prompt_blocks)
            seed = rng.getrandbits(32)
            await slots.acquire()
            nursery.start_soon(one_request, n, engine, prompt_blocks, seed)


@asynccontextmanager
async def _no_relays() -> AsyncIterator[list[int]]:
    yield []


def _progress(tally: _Tally, total: int) -> None:
    """A one-line progress bar on a terminal; a line per tenth otherwise."""
    interactive = sys.stderr.isatty()
    if not interactive and tally.done % max(1, total // 10) and tally.done != total:
        return
    width = 40
    filled = width * tally.done // max(total, 1)
    bar = "#" * filled + "." * (width - filled)
    start = "\r" if interactive else ""
    print(
        f"{start}[{bar}] {tally.done}/{total} requests, {tally.failed} failed",
        end="" if interactive else "\n",
        file=sys.stderr,
        flush=True,
    )


def format_summary(summary: dict[str, Any]) -> str:
    rows = [
        ("requests ok / failed", f"{summary['requests_ok']} / {summary['requests_failed']}"),
        ("every byte verified", "yes" if summary["requests_corrupt"] == 0 else "NO"),
        (
            "handshakes (max / mean)",
            f"{summary['handshakes']} ({summary['handshake_ms_max']} / "
            f"{summary['handshake_ms_mean']} ms)",
        ),
        ("pull latency p50 / p99", f"{summary['pull_p50_ms']} / {summary['pull_p99_ms']} ms"),
        ("throughput", f"{summary['gb_per_s']} GB/s"),
        ("bytes pulled", f"{summary['bytes_pulled']:,}"),
        ("largest trio loop stall", f"{summary['largest_loop_stall_ms']} ms"),
        ("start-up / run", f"{summary['startup_s']} s / {summary['run_s']} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if summary["errors"]:
        lines.append("first errors:")
        lines += [f"  {e}" for e in summary["errors"]]
    return "\n".join(lines)
