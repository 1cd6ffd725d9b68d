"""``trio-pd demo``: a small but real P/D deployment on one machine.

* ``prefill_engines`` prefill engines, each its own process with its own KV
  cache (``regions`` x ``blocks`` x ``block_bytes``) and connector -- or, with
  ``prefill_tp`` > 1, that many processes per engine, one per rank, each with
  its share of the KV heads;
* one decode engine: this process, with a connector on a KV cache of the same
  layout (``decode_tp`` connectors, one per rank, with ``decode_tp`` > 1);
* a stand-in for the P/D proxy (also this process): for each request it
  picks a prefill engine, allocates blocks there, has the engine fill them with
  request-specific content and ``expose`` them, forwards the
  ``kv_transfer_params`` to the decoder, which allocates local blocks, pulls
  and verifies every byte; the prefill blocks are freed when the engine says
  they were read (or expired).

With ``hosts`` > 0 the prefill engines run in that many test hosts (network
namespaces joined to this one by veth links; root only), and UCX is forced to
TCP, so every block crosses a real network stack.

Faults can be injected to watch the failure handling: a slow link in front of
one engine's side channel (its handshake is slow; other engines are not
held up), or an engine killed in the middle of the run (its requests fail
with clear errors; the others go on).

The module holds the run (:func:`run_demo`), then, measured in the same run
after it, the comparison with raw NIXL (:func:`compare_with_raw_nixl`: the
decoder's connector was opened with a :class:`~trio_pd.testing.CapturedBackends`
factory, so its NIXL agent and prepared descriptor lists are at hand, and the
same pull is made through trio_pd and as one READ with NIXL directly, on
the same agent, between the same two processes, of the same blocks), and
last the summary in words (:func:`format_summary`: what each figure
measures, per run and per prefill engine; no I/O).
"""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import numpy as np
import trio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from trio_pd._config import ConnectorConfig
from trio_pd._connector import Connector, open_connector
from trio_pd._core._errors import TrioPdError
from trio_pd._core._protocol import encode_notification
from trio_pd._core._public_values import RemoteBlocks
from trio_pd._exception_groups import unwrapped_errors
from trio_pd._harness._netns import TestHost, open_test_hosts
from trio_pd._serve.ports import free_port_range
from trio_pd._transfer._nixl._backend import NixlBackend

if TYPE_CHECKING:
    from trio_pd._harness._prefill_worker import PrefillWorker


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
    """Kill the last prefill engine (all its ranks) after this many requests (0: never)."""
    prefill_tp: int = 1
    decode_tp: int = 1
    hosts: int = 0
    """Run the prefill engines in this many test hosts, over TCP (0: on this host)."""
    progress: bool = True

    @property
    def tensor_parallel(self) -> bool:
        return self.prefill_tp > 1 or self.decode_tp > 1

    @property
    def total_heads(self) -> int:
        """KV heads per block of a whole engine (with tensor parallelism)."""
        return 2 * max(self.prefill_tp, self.decode_tp)

    def rank_block_shape(self, tp_size: int) -> tuple[int, ...]:
        """The block shape of one rank's region tensors (float16)."""
        if not self.tensor_parallel:
            return (self.block_bytes // 2,)
        return (self.total_heads // tp_size, self.block_bytes // self.total_heads // 2)

    def check(self) -> None:
        """Raise ``ValueError`` for options that cannot run."""
        if self.max_prompt_blocks > self.blocks:
            raise ValueError("max_prompt_blocks cannot exceed blocks")
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise ValueError(f"{name} must be 1, 2, 4 or 8")
        if self.tensor_parallel and self.block_bytes % (2 * self.total_heads):
            raise ValueError(f"block_bytes must split into {self.total_heads} KV heads of float16")
        if self.slow_engine_delay and self.prefill_tp > 1:
            raise ValueError("--slow-engine-delay works with --prefill-tp 1 only")
        if self.slow_engine_delay and self.hosts:
            raise ValueError("--slow-engine-delay works without --hosts only")
        if not 0 <= self.hosts <= 16:
            raise ValueError("hosts must be between 0 and 16")


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


@attrs.frozen
class _Pull:
    """One request's pull, every decode rank together."""

    started: float  # (time.perf_counter())
    ended: float
    bytes: int
    transfer_seconds: float  # the slowest rank's pull, its handshake wait left out


@attrs.define
class _EngineTally:
    """One prefill engine's requests: a reader sees whether the others were held up."""

    ok: int = 0
    failed: int = 0
    latencies: list[float] = attrs.field(factory=list)

    def summary(self) -> dict[str, Any]:
        """Its requests ok and failed; its pulls' latency (``None`` without a pull)."""
        latencies = np.asarray(self.latencies) * 1e3
        ok = latencies.size > 0
        return {
            "requests_ok": self.ok,
            "requests_failed": self.failed,
            "pull_p50_ms": round(float(np.percentile(latencies, 50)), 2) if ok else None,
            "pull_p99_ms": round(float(np.percentile(latencies, 99)), 2) if ok else None,
        }


@attrs.define
class _Tally:
    ok: int = 0
    failed: int = 0
    corrupt: int = 0
    done: int = 0
    bytes: int = 0
    latencies: list[float] = attrs.field(factory=list)
    pulls: list[_Pull] = attrs.field(factory=list)
    handshake_waits: dict[str, float] = attrs.field(factory=dict)
    errors: list[str] = attrs.field(factory=list)
    """trio_pd's own errors (``TrioPdError``: the pulls'), then the demo's."""
    demo_errors: list[str] = attrs.field(factory=list)
    """The demo's own (its prefill step failed: ``WorkerError``, the engine is dead)."""
    errors_by_type: Counter[str] = attrs.field(factory=Counter)
    per_engine: dict[str, _EngineTally] = attrs.field(factory=dict)
    on_done: Callable[[], None] = lambda: None  # (the progress bar)


async def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the deployment; return the summary (see :func:`format_summary`)."""
    import torch

    from trio_pd._harness._delay_relay import open_delay_relays

    # (the harness, loaded here: the serving commands import this module)
    from trio_pd._harness._prefill_spec import WorkerSpec
    from trio_pd._harness._prefill_worker import open_prefill_workers
    from trio_pd._harness._raw_nixl import CapturedBackends
    from trio_pd._harness._stall_monitor import LoopStallMonitor

    o = options
    o.check()
    rng = random.Random(o.seed)
    tally = _Tally()
    monitor = LoopStallMonitor()
    started = time.perf_counter()
    async with AsyncExitStack() as stack:
        hosts: list[TestHost] = []
        if o.hosts:
            hosts = await stack.enter_async_context(open_test_hosts(o.hosts))
            # UCX reads this when the process's first agent is created (below)
            os.environ["UCX_TLS"] = "tcp"
        specs = []
        for i in range(o.prefill_engines):
            base = free_port_range(o.prefill_tp) if o.prefill_tp > 1 else 0
            host = hosts[i % len(hosts)] if hosts else None
            specs += [
                WorkerSpec(
                    f"prefill-{i}",
                    regions=o.regions,
                    blocks=o.blocks,
                    block_shape=o.rank_block_shape(o.prefill_tp),
                    port=base,
                    tp_rank=rank,
                    tp_size=o.prefill_tp,
                    payload="heads" if o.tensor_parallel else "blocks",
                    host=host.address if host else "127.0.0.1",
                    netns=host.netns if host else "",
                    env={"UCX_TLS": "tcp"} if host else {},
                )
                for rank in range(o.prefill_tp)
            ]
        workers = await stack.enter_async_context(open_prefill_workers(specs))
        startup = time.perf_counter() - started
        engines = [workers[i : i + o.prefill_tp] for i in range(0, len(workers), o.prefill_tp)]
        delay = o.slow_engine_delay
        targets = [(e[0].host, e[0].port) for e in engines[:1]]
        relays = open_delay_relays(targets, delay) if delay else _no_relays()
        relay_ports = await stack.enter_async_context(relays)
        config = ConnectorConfig(handshake_timeout=max(5.0, 20 * delay))
        # (the decoder's NIXL agent, kept for the comparison with raw NIXL)
        captured = None if o.tensor_parallel else CapturedBackends()
        base = free_port_range(o.decode_tp) if o.decode_tp > 1 else 0
        decoders: list[tuple[Connector, list[Any]]] = []
        for rank in range(o.decode_tp):
            shape = (o.blocks, *o.rank_block_shape(o.decode_tp))
            local = [torch.zeros(shape, dtype=torch.float16) for _ in range(o.regions)]
            conn = await stack.enter_async_context(
                open_connector(
                    "decode-0",
                    local,
                    port=base,
                    config=config,
                    tp_rank=rank,
                    tp_size=o.decode_tp,
                    backend=captured,
                )
            )
            decoders.append((conn, local))
        # What a serving process does after start-up: move the long-lived
        # objects (torch, numpy, ...) out of the collector's way, so a full
        # collection does not stall the loop for tens of ms.
        gc.collect()
        gc.freeze()
        trio.lowlevel.add_instrument(monitor)
        try:
            run_started = time.perf_counter()
            with _progress_bar(o, tally):
                await _drive(o, rng, engines, relay_ports, decoders, tally)
            elapsed = time.perf_counter() - run_started
        finally:
            trio.lowlevel.remove_instrument(monitor)
            gc.unfreeze()
        stats = [conn.statistics() for conn, _ in decoders]
        vs_raw = NOT_MEASURED
        first = tally.per_engine.get(engines[0][0].engine_id, _EngineTally())
        if captured is not None and first.ok:
            # after the run, so that its figures are not disturbed
            relay = relay_ports[0] if relay_ports else None
            vs_raw = await compare_with_raw_nixl(
                engines[0][0], decoders[0][0], captured.backends[0], o.max_prompt_blocks, relay
            )
    latencies = np.asarray(tally.latencies or [0.0]) * 1e3
    waits = list(tally.handshake_waits.values()) or [0.0]
    faults = bool(o.kill_engine_after or o.slow_engine_delay)
    in_pulls = _time_in_pulls(tally.pulls)
    sizes = [p.bytes for p in tally.pulls] or [0]
    rates = [p.bytes / p.transfer_seconds for p in tally.pulls if p.transfer_seconds > 0] or [0.0]
    return {
        "requests": o.requests,
        "requests_ok": tally.ok,
        "requests_failed": tally.failed,
        "requests_corrupt": tally.corrupt,
        "prefill_engines": o.prefill_engines,
        "prefill_tp": o.prefill_tp,
        "decode_tp": o.decode_tp,
        "hosts": o.hosts,
        "handshakes": sum(s.handshakes_succeeded for s in stats),
        "handshakes_failed": sum(s.handshakes_failed for s in stats),
        "handshake_ms_max": round(max(waits) * 1e3, 1),
        "handshake_ms_mean": round(sum(waits) / len(waits) * 1e3, 1),
        # each request's pull, handshake wait included, up to `concurrency` at once
        "pull_p50_ms": round(float(np.percentile(latencies, 50)), 2),
        "pull_p99_ms": round(float(np.percentile(latencies, 99)), 2),
        "concurrency": o.concurrency,
        "pull_bytes_min": min(sizes),
        "pull_bytes_mean": round(sum(sizes) / len(sizes)),
        "pull_bytes_max": max(sizes),
        "bytes_pulled": tally.bytes,
        # bytes over the time with at least one pull in flight (all pulls together)
        "pull_seconds_in_flight": round(in_pulls, 3),
        "pull_gb_per_s": round(tally.bytes / in_pulls / 1e9, 3) if in_pulls else 0.0,
        # one pull: its bytes over its own time, handshake wait left out
        "per_pull_gb_per_s_p50": round(float(np.percentile(rates, 50)) / 1e9, 3),
        # bytes over the whole run: filling the prefill blocks and checking
        # every pulled byte included
        "gb_per_s": round(tally.bytes / elapsed / 1e9, 3) if elapsed else 0.0,
        # after the run: one pull of the largest size at a time, through trio_pd
        # and as one READ with NIXL directly on the decoder's agent (medians)
        **vs_raw,
        # the longest the trio loop of this (decode) process went without I/O,
        # and how much of that its thread itself ran; what shared the cores:
        "largest_loop_stall_ms": round(monitor.longest * 1e3, 2),
        "largest_loop_stall_cpu_ms": round(monitor.longest_cpu * 1e3, 2),
        "processes": 1 + o.prefill_engines * o.prefill_tp,
        "cpu_cores": os.cpu_count() or 0,
        "startup_s": round(startup, 2),
        "run_s": round(elapsed, 2),
        "faults_injected": faults,
        # trio_pd's own errors first (HandshakeError, TransferError: engine and
        # cause named), then the demo's (its prefill step failed: WorkerError)
        "errors": (tally.errors + tally.demo_errors)[:10],
        "errors_by_type": dict(tally.errors_by_type),
        "handshake_failures_by_cause": dict(
            sum((Counter(s.handshake_failures_by_cause) for s in stats), Counter[str]())
        ),
        # per prefill engine: was the healthy one held up by the faulty one?
        "per_engine": {name: t.summary() for name, t in sorted(tally.per_engine.items())},
        "verified": tally.corrupt == 0 and (tally.failed == 0 or faults),
    }


async def _drive(
    o: DemoOptions,
    rng: random.Random,
    engines: list[list[PrefillWorker]],
    relay_ports: list[int],
    decoders: list[tuple[Connector, list[Any]]],
    tally: _Tally,
) -> None:
    from trio_pd._harness._prefill_worker import WorkerError

    local_pool = BlockPool(o.blocks, rng)
    remote_pools = [BlockPool(o.blocks, rng) for _ in engines]
    slots = trio.Semaphore(o.concurrency)

    async def one_request(n: int, engine: int, prompt_blocks: int, seed: int) -> None:
        ranks = engines[engine]
        rid = f"req-{n}"
        mine = tally.per_engine.setdefault(ranks[0].engine_id, _EngineTally())
        remote_ids = await remote_pools[engine].take(prompt_blocks)
        local_ids = await local_pool.take(prompt_blocks)
        try:
            # prefill: every rank computes (here: fills) its share of the blocks
            # and exposes them; the proxy forwards rank 0's kv_transfer_params
            remote = (await _each_rank(lambda w: w.expose(rid, remote_ids, seed), ranks))[0]
            if doomed(n, engine):  # it dies after its prefill, before the decode pulls
                for worker in ranks:
                    worker.kill()
            if engine == 0 and relay_ports:
                remote = attrs.evolve(remote, host="127.0.0.1", port=relay_ports[0])
            params = remote.to_kv_transfer_params()
            # decode: every decode rank pulls the heads it needs
            pull_started = time.perf_counter()
            results = await _each_rank(
                lambda d: d[0].pull(rid, local_ids, RemoteBlocks.from_kv_transfer_params(params)),
                decoders,
            )
            pull = _Pull(
                pull_started,
                time.perf_counter(),
                sum(r.bytes for r in results),
                max(r.seconds - r.handshake_wait for r in results),
            )
            wait = max(r.handshake_wait for r in results)
            if wait > 0.001 and ranks[0].engine_id not in tally.handshake_waits:
                tally.handshake_waits[ranks[0].engine_id] = wait
            # verify off the loop: it is the demo's work, not the connector's
            if await trio.to_thread.run_sync(_corrupt, o, decoders, local_ids, remote_ids, seed):
                tally.corrupt += 1
            tally.ok += 1
            tally.bytes += pull.bytes
            tally.latencies.append(max(r.seconds for r in results))
            tally.pulls.append(pull)
            mine.ok += 1
            mine.latencies.append(max(r.seconds for r in results))
        except Exception as exc:  # a failed request is reported, the rest go on
            tally.failed += 1
            mine.failed += 1
            tally.errors_by_type[type(exc).__name__] += 1
            line = f"{rid} ({ranks[0].engine_id}): {type(exc).__name__}: {exc}"
            (tally.errors if isinstance(exc, TrioPdError) else tally.demo_errors).append(line)
            remote_pools[engine].give_back(remote_ids)
        else:
            # the prefill engine frees its blocks once they were read; if it
            # died meanwhile, they are gone with it
            released = True
            for worker in ranks:
                try:
                    await worker.wait_released(rid)
                except WorkerError:
                    released = False
            if released:
                remote_pools[engine].give_back(remote_ids)
        finally:
            local_pool.give_back(local_ids)
            tally.done += 1
            tally.on_done()
            slots.release()

    killed = False

    def doomed(n: int, engine: int) -> bool:
        """Whether the last engine dies now: at its first request from the N-th on."""
        nonlocal killed
        last = len(engines) - 1
        if killed or not o.kill_engine_after or last == 0 or engine != last:
            return False
        killed = n >= o.kill_engine_after
        return killed

    async with trio.open_nursery() as nursery:
        for n in range(o.requests):
            engine = n % len(engines)
            prompt_blocks = rng.randint(1, o.max_prompt_blocks)
            seed = rng.getrandbits(32)
            await slots.acquire()
            nursery.start_soon(one_request, n, engine, prompt_blocks, seed)


_R = TypeVar("_R")
_A = TypeVar("_A")


async def _each_rank(call: Callable[[_A], Awaitable[_R]], ranks: Sequence[_A]) -> list[_R]:
    """``call`` for every rank concurrently; results in rank order.

    If one fails, the others are cancelled and that error propagates (a
    group only if several fail at once, which the caller reports as one).
    """
    results: dict[int, _R] = {}

    async def run(index: int, rank: _A) -> None:
        results[index] = await call(rank)

    async with unwrapped_errors(), trio.open_nursery() as nursery:
        for index, rank in enumerate(ranks):
            nursery.start_soon(run, index, rank)
    return [results[i] for i in range(len(ranks))]


def _corrupt(
    o: DemoOptions,
    decoders: list[tuple[Connector, list[Any]]],
    local_ids: list[int],
    remote_ids: list[int],
    seed: int,
) -> bool:
    """Whether any decode rank holds a byte other than the prefill ranks wrote."""
    from trio_pd._harness._seeded_blocks import mismatched_blocks, mismatched_heads

    if not o.tensor_parallel:
        return bool(mismatched_blocks(decoders[0][1], local_ids, seed))
    return any(
        mismatched_heads(local, rank, local_ids, remote_ids, seed)
        for rank, (_, local) in enumerate(decoders)
    )


def _time_in_pulls(pulls: Sequence[_Pull]) -> float:
    """Seconds during which at least one of ``pulls`` was in flight."""
    total, end = 0.0, -math.inf
    for pull in sorted(pulls, key=lambda p: p.started):
        if pull.ended > end:
            total += pull.ended - max(pull.started, end)
            end = pull.ended
    return total


@asynccontextmanager
async def _no_relays() -> AsyncIterator[list[int]]:
    yield []


@contextmanager
def _progress_bar(o: DemoOptions, tally: _Tally) -> Iterator[None]:
    """A progress bar of the requests on stderr (rich), while the block runs."""
    progress = Progress(
        TextColumn("requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"),
        console=Console(stderr=True),
        refresh_per_second=4,
        disable=not o.progress,
    )
    with progress:
        task = progress.add_task("requests", total=o.requests, failed=0)
        tally.on_done = lambda: progress.update(task, completed=tally.done, failed=tally.failed)
        yield


# ---- the comparison with raw NIXL ----------------------------------------

REPETITIONS = 5


async def compare_with_raw_nixl(
    worker: PrefillWorker,
    connector: Connector,
    backend: NixlBackend,
    blocks: int,
    relay_port: int | None = None,
) -> dict[str, Any]:
    """Pull ``blocks`` blocks from ``worker`` one pull at a time, each way in
    turn, :data:`REPETITIONS` times: through ``connector`` (its handshake with
    ``worker`` long done) and as one READ posted and polled with NIXL directly
    on ``backend`` (the connector's own) in a worker thread. Both read exposed
    blocks and post the notification, so the producer does the same work.

    ``relay_port``: the decoder reaches the producer's side channel through
    the slow-link relay on this loopback port. Returns the bytes of one pull and
    the medians, in GB/s, with their ratio.

    Raises:
        TrioPdError: a pull failed; WorkerError: the prefill worker died.
    """
    from trio_pd._harness._raw_nixl import raw_nixl_read

    ids = list(range(blocks))
    size = 0
    rates: dict[str, list[float]] = {"trio_pd": [], "raw": []}
    for rep in range(REPETITIONS):
        rid = f"vs-raw-trio_pd-{rep}"
        remote = await worker.expose(rid, ids, rep)
        if relay_port is not None:
            remote = attrs.evolve(remote, host="127.0.0.1", port=relay_port)
        result = await connector.pull(rid, ids, remote)
        size = result.bytes
        rates["trio_pd"].append(size / (result.seconds - result.handshake_wait))
        await worker.wait_released(rid)
        rid = f"vs-raw-nixl-{rep}"
        await worker.expose(rid, ids, rep)
        seconds = await trio.to_thread.run_sync(
            raw_nixl_read,
            backend,
            worker.engine_id,
            np.arange(blocks, dtype=np.int64),
            encode_notification(rid),
        )
        rates["raw"].append(size / seconds)
        await worker.wait_released(rid)
    trio_pd, raw = (statistics.median(rates[k]) for k in ("trio_pd", "raw"))
    return {
        "vs_raw_bytes": size,
        "vs_raw_engine": worker.engine_id,
        "vs_raw_trio_pd_gb_per_s": round(trio_pd / 1e9, 3),
        "vs_raw_nixl_gb_per_s": round(raw / 1e9, 3),
        "trio_pd_vs_raw": round(trio_pd / raw, 3),
        "vs_raw_repetitions": REPETITIONS,
    }


NOT_MEASURED: dict[str, Any] = {
    "vs_raw_bytes": 0,
    "vs_raw_engine": None,
    "vs_raw_trio_pd_gb_per_s": None,
    "vs_raw_nixl_gb_per_s": None,
    "trio_pd_vs_raw": None,
    "vs_raw_repetitions": 0,
}
"""The summary's keys when the comparison was not made (tensor parallelism:
a rank's heads are several strided READs, not one)."""


# ---- the summary in words ------------------------------------------------


def format_summary(summary: dict[str, Any]) -> str:
    """The summary for a reader: under each figure, what it measures."""
    s = summary
    where = f"on {s['hosts']} test hosts, UCX over TCP" if s["hosts"] else "on this host"
    rows = [
        (
            "deployment",
            f"{s['prefill_engines']} prefill engines x TP {s['prefill_tp']} {where}; "
            f"decode TP {s['decode_tp']}",
            "",
        ),
        ("requests ok / failed", f"{s['requests_ok']} / {s['requests_failed']}", ""),
        ("every byte verified", "yes" if s["requests_corrupt"] == 0 else "NO", ""),
        (
            "handshakes (max / mean)",
            f"{s['handshakes']} ({s['handshake_ms_max']} / {s['handshake_ms_mean']} ms)",
            "",
        ),
        (
            "pull latency p50 / p99",
            f"{s['pull_p50_ms']} / {s['pull_p99_ms']} ms",
            f"up to {s['concurrency']} pulls at once, {_size(s['pull_bytes_min'])} to "
            f"{_size(s['pull_bytes_max'])} each, mean {_size(s['pull_bytes_mean'])}; "
            "handshake waits included",
        ),
        (
            "pull throughput",
            f"{s['pull_gb_per_s']} GB/s",
            f"all pulls together: bytes over the {s['pull_seconds_in_flight']} s "
            "with a pull in flight",
        ),
        (
            "  one pull (p50)",
            f"{s['per_pull_gb_per_s_p50']} GB/s",
            "a pull's bytes over its own time, handshake wait left out",
        ),
        _vs_raw(s),
        (
            "run throughput",
            f"{s['gb_per_s']} GB/s",
            "bytes over the whole run: filling the prefill blocks and checking every "
            "pulled byte included",
        ),
        ("bytes pulled", f"{s['bytes_pulled']:,}", ""),
        (
            "largest trio loop stall",
            f"{s['largest_loop_stall_ms']} ms",
            f"the trio thread ran {s['largest_loop_stall_cpu_ms']} ms of it; "
            f"{s['processes']} processes, their NIXL threads and the byte checks "
            f"share {s['cpu_cores']} cores",
        ),
        ("start-up / run", f"{s['startup_s']} s / {s['run_s']} s", ""),
    ]
    if s["faults_injected"]:
        # per prefill engine: the healthy one must not be held up by the faulty one
        for name, e in s["per_engine"].items():
            rows.append(
                (
                    f"  {name}",
                    f"{e['requests_ok']} ok / {e['requests_failed']} failed, "
                    + (
                        f"pull p50 / p99 {e['pull_p50_ms']} / {e['pull_p99_ms']} ms"
                        if e["pull_p50_ms"] is not None
                        else "no pull succeeded"
                    ),
                    "",
                )
            )
        if s["errors_by_type"]:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_type"].items()))
            causes = ", ".join(
                f"{k} {v}" for k, v in sorted(s["handshake_failures_by_cause"].items())
            )
            rows.append(
                (
                    "errors by type",
                    kinds,
                    "HandshakeError, TransferError: trio_pd's own, naming the engine and "
                    "cause; WorkerError: the demo's prefill step found its engine dead"
                    + (f"; handshake failures by cause: {causes}" if causes else ""),
                )
            )
    width = max(len(k) for k, _, _ in rows)
    lines = []
    for key, value, what in rows:
        lines.append(f"{key:<{width}}  {value}")
        if what:
            lines.append(f"{'':<{width}}    ({what})")
    if s["errors"]:
        lines.append("first errors:")
        lines += [f"  {e}" for e in s["errors"]]
    return "\n".join(lines)


def _vs_raw(s: dict[str, Any]) -> tuple[str, str, str]:
    """The line that compares a pull with raw NIXL (measured after the run)."""
    if s["trio_pd_vs_raw"] is None:
        return (
            "  vs raw NIXL",
            "not measured in this run",
            "with tensor parallelism a rank reads strided heads, not one READ; "
            "see docs/performance.md, 'throughput vs raw NIXL'",
        )
    return (
        "  vs raw NIXL",
        f"x{s['trio_pd_vs_raw']}: {s['vs_raw_trio_pd_gb_per_s']} GB/s trio_pd, "
        f"{s['vs_raw_nixl_gb_per_s']} GB/s raw NIXL",
        f"after the run, one pull of {_size(s['vs_raw_bytes'])} from {s['vs_raw_engine']} "
        f"at a time, median of {s['vs_raw_repetitions']} each, interleaved: through trio_pd, "
        "and as one READ "
        "with NIXL directly on the decoder's own agent and descriptors",
    )


def _size(count: int) -> str:
    """A byte count in KiB or MiB, for a reader."""
    if count < 1 << 20:
        return f"{count / 1024:.0f} KiB"
    return f"{count / (1 << 20):.1f} MiB"
