"""trio_pd benchmarks: every number is a ratio measured side by side in one run.

    python benchmarks/pd_bench.py                 # all, writes docs/performance.md
    python benchmarks/pd_bench.py --only throughput --json out.json

The machine is shared and noisy, so each benchmark compares trio_pd with its
reference (no handshakes, vLLM's serialized or inline handshakes, raw NIXL,
memcpy) in the same run, interleaving repetitions. Benchmarks assert
correctness (pulled bytes verified, every pull succeeded), never speed.

Producers run in child processes (``trio_pd.testing.open_prefill_worker``),
slow links are a latency-injecting TCP relay in its own process
(``trio_pd.testing.open_delay_relays``); the decoder is this process. The
designs trio_pd is compared with are in ``comparison.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import platform
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio
from comparison import (
    InlineHandshakes,
    NixlOnEventLoop,
    RecordedLoad,
    RecordingNixlBackend,
    raw_paced_reads,
    raw_replay_loads,
)
from stall_floor import StallFloor, open_stall_floor
from zmq_echo import open_zmq_echo

import trio_pd
from trio_pd._config import tuned
from trio_pd._core._protocol import decode_notification
from trio_pd._transfer._nixl._jobs import Job
from trio_pd.testing import (
    CapturedBackends,
    LoopStallMonitor,
    PrefillWorker,
    WorkerSpec,
    encode_notification,
    free_port_range,
    mismatched_blocks,
    mismatched_heads,
    open_delay_relays,
    open_prefill_worker,
    open_prefill_workers,
    open_test_hosts,
    raw_nixl_read,
    raw_nixl_read_at_once,
)

Result = dict[str, Any]


def kv(regions: int, blocks: int, block_bytes: int) -> list[torch.Tensor]:
    return [torch.zeros((blocks, block_bytes // 2), dtype=torch.float16) for _ in range(regions)]


def spec(
    engine_id: str, regions: int, blocks: int, block_bytes: int, engines: int = 1
) -> WorkerSpec:
    return WorkerSpec(
        engine_id,
        engines=engines,
        regions=regions,
        blocks=blocks,
        block_shape=(block_bytes // 2,),
        dtype="float16",
    )


def via(remote: trio_pd.RemoteBlocks, port: int) -> trio_pd.RemoteBlocks:
    """The same blocks, reached through a relay port."""
    return trio_pd.RemoteBlocks(
        remote.engine_id, "127.0.0.1", port, remote.block_ids, remote.request_id, remote.incarnation
    )


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


# ---- 1. head-of-line blocking ------------------------------------------------


async def bench_head_of_line(quick: bool) -> Result:
    """Warm-pull latency while K engines handshake behind a slow link.

    Three modes, each on a fresh decoder, against the same producers: trio_pd;
    raw NIXL under the same loads (the remote agents trio_pd loaded, replayed
    from a plain thread at the same offsets while another plain thread posts
    the warm READs: NIXL's own head-of-line blocking, the anchor); and the
    inline handshakes of vLLM before PR #19836.
    """
    k, delay, rounds = (4, 0.1, 1) if quick else (16, 0.1, 3)
    regions, blocks, block_bytes = 4, 2048, 4096
    # (pulls 1 ms apart: enough of them in each storm for a p99 that is not one outlier)
    baseline_pulls, storm_cap, gap = 500, 1500, 0.001
    out: Result = {
        "cold_engines": k,
        "link_delay_s": delay,
        "rounds": rounds,
        "gap_s": gap,
        "modes": {},
    }
    worker_spec = spec("hol", regions, blocks, block_bytes, engines=k + 1)
    storm_loads: list[tuple[float, RecordedLoad]] = []  # (offset in the storm, load)
    all_pulls: list[tuple[float, float, str]] = []  # trio_pd's storm pulls, every round
    all_jobs: dict[str, Job] = {}
    samples: dict[str, tuple[list[float], list[float], list[float]]] = {}  # base, storm, s
    modes = ["trio_pd", "raw NIXL, same loads"] * rounds + ["inline (pre-#19836)"]
    # (more warm exposures are made than a storm pulls: a lease that outlasts the
    # benchmark keeps the rest from expiring into the log; SIM117: the relays need w)
    long_leases = trio_pd.ConnectorConfig(lease_initial=900.0, abort_timeout=900.0)
    async with open_prefill_worker(worker_spec, config=long_leases) as w:  # noqa: SIM117
        async with open_delay_relays([(h, p) for _, h, p in w.addresses[1:]], delay) as ports:
            for n, mode in enumerate(modes):
                config = trio_pd.ConnectorConfig(handshake_timeout=60.0)
                warm = await w.expose_many(
                    [(f"{n}-w{i}", [i], i) for i in range(baseline_pulls + storm_cap + 1)]
                )
                cold = []
                for e in range(1, k + 1):
                    [remote] = await w.expose_many([(f"{n}-c", [0], e)], engine=e)
                    cold.append(via(remote, ports[e - 1]))
                local = kv(regions, blocks, block_bytes)
                captured = CapturedBackends(RecordingNixlBackend)
                jobs: dict[str, Job] = {}
                base, storm, seconds = samples.setdefault(mode, ([], [], []))
                async with trio_pd.open_connector(
                    f"dec-{n}", local, config=config, backend=captured
                ) as connector:
                    backend = captured.backends[0]
                    assert isinstance(backend, RecordingNixlBackend)
                    backend.job_observer = functools.partial(_keep_job, jobs)
                    await connector.pull("warm-up", [0], warm[0])
                    if mode.startswith("raw"):
                        await _raw_storm(
                            backend,
                            warm,
                            baseline_pulls,
                            storm_cap,
                            gap,
                            storm_loads,
                            samples[mode],
                        )
                        continue
                    d = connector if mode == "trio_pd" else InlineHandshakes(connector)
                    for i in range(1, baseline_pulls + 1):
                        base.append((await d.pull(f"b{i}", [i], warm[i])).seconds)
                        await trio.sleep(gap)
                    storm_pulls: list[tuple[float, float, str]] = []  # (start, end, request)
                    storm_done = trio.Event()
                    started = trio.current_time()

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_pull_all_then_set, d, cold, storm_done)
                        await trio.sleep(0.01)  # let the handshakes start
                        i = baseline_pulls + 1
                        while not storm_done.is_set() and i <= baseline_pulls + storm_cap:
                            began = time.monotonic()
                            storm.append((await d.pull(f"s{i}", [i], warm[i])).seconds)
                            storm_pulls.append((began, time.monotonic(), warm[i].request_id))
                            i += 1
                            await trio.sleep(gap)
                    seconds.append(trio.current_time() - started)
                    stats = d.statistics()
                    assert stats.pulls_failed == 0
                    assert stats.handshakes_succeeded == k + 1
                if mode == "trio_pd":
                    all_pulls.extend(storm_pulls)
                    all_jobs.update(jobs)
                    storm_loads[:] = [(x.began - started, x) for x in backend.loads[1:]]
    out["storm_breakdown_ms"] = _breakdown(all_pulls, all_jobs)
    for mode, (base, storm, seconds) in samples.items():
        out["modes"][mode] = _hol_row(base, storm, statistics.median(seconds))
    trio_ratio = out["modes"]["trio_pd"]["ratio_p99"]
    raw_ratio = out["modes"]["raw NIXL, same loads"]["ratio_p99"]
    out["p99_ratio_over_raw"] = round(trio_ratio / raw_ratio, 2)
    return out


def _hol_row(base: list[float], storm: list[float], storm_seconds: float) -> Result:
    return {
        "baseline_p50_ms": ms(pct(base, 50)),
        "baseline_p99_ms": ms(pct(base, 99)),
        "during_handshakes_p50_ms": ms(pct(storm, 50)),
        "during_handshakes_p99_ms": ms(pct(storm, 99)),
        "pulls_during_handshakes": len(storm),
        "handshake_storm_s": round(storm_seconds, 3),
        "ratio_p50": round(pct(storm, 50) / pct(base, 50), 2),
        "ratio_p99": round(pct(storm, 99) / pct(base, 99), 2),
    }


async def _raw_storm(
    backend: trio_pd.NixlBackend,
    warm: list[trio_pd.RemoteBlocks],
    baseline_pulls: int,
    storm_cap: int,
    gap: float,
    loads: list[tuple[float, RecordedLoad]],
    samples: tuple[list[float], list[float], list[float]],
) -> None:
    """Raw NIXL's head-of-line anchor: warm READs posted from a plain thread,
    idle and then while another plain thread loads ``loads`` at their offsets.
    The connector is idle meanwhile (its agent and descriptor lists are used).
    Appends to ``samples``: (idle seconds, storm seconds, storm duration)."""
    assert loads, "the trio_pd mode records the loads first"

    def reads(first: int, n: int) -> list[tuple[np.ndarray, bytes]]:
        return [
            (np.asarray([i]), encode_notification(warm[i].request_id))
            for i in range(first, first + n)
        ]

    engine = warm[0].engine_id
    base, storm, seconds = samples
    base += await trio.to_thread.run_sync(
        raw_paced_reads, backend, engine, reads(1, baseline_pulls), gap
    )
    done = threading.Event()
    started = time.perf_counter()

    async def warm_reads() -> None:
        await trio.sleep(0.01)  # as in the trio_pd mode: let the loads start
        storm.extend(
            await trio.to_thread.run_sync(
                raw_paced_reads, backend, engine, reads(baseline_pulls + 1, storm_cap), gap, done
            )
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(warm_reads)
        await trio.to_thread.run_sync(raw_replay_loads, backend.agent, loads, done)
    seconds.append(time.perf_counter() - started)


def _keep_job(jobs: dict[str, Job], job: Job) -> None:
    for request_id, _, _ in decode_notification(job.notification) or []:
        jobs[request_id] = job


def _breakdown(pulls: list[tuple[float, float, str]], jobs: dict[str, Job]) -> Result:
    """Where the time of the median pull and of the slowest 1% goes, in ms.

    Phases: trio_pd's Python before the read is handed to the transfer
    driver; waiting for the driver to post it; the NIXL transfer; the
    hand-back to the waiting task; trio_pd's Python after it.
    """

    def phases(start: float, end: float, job: Job) -> list[float]:
        return [
            job.submitted_at - start,
            job.posted_at - job.submitted_at,
            job.finished_at - job.posted_at,
            job.woken_at - job.finished_at,
            end - job.woken_at,
        ]

    names = ["before_driver", "driver_queue", "transfer", "wake_up", "after"]
    rows = sorted(
        (end - start, phases(start, end, jobs[rid])) for start, end, rid in pulls if rid in jobs
    )
    tail = rows[int(len(rows) * 0.99) :] or rows[-1:]
    median = rows[len(rows) // 2]
    return {
        "median": {"total": ms(median[0]), **dict(zip(names, map(ms, median[1]), strict=True))},
        "slowest_1pct": {
            "total": ms(statistics.mean(r[0] for r in tail)),
            **{name: ms(statistics.mean(r[1][i] for r in tail)) for i, name in enumerate(names)},
        },
    }


async def _pull_all_then_set(
    d: trio_pd.Connector | InlineHandshakes, remotes: list[trio_pd.RemoteBlocks], done: trio.Event
) -> None:
    async with trio.open_nursery() as nursery:
        for n, remote in enumerate(remotes):
            nursery.start_soon(d.pull, f"cold{n}", [1 + n], remote)
    done.set()


# ---- 2. cold fan-out -----------------------------------------------------------


async def bench_cold_fan_out(quick: bool) -> Result:
    """Time until the first pull to each of N cold engines (slow link) completes."""
    n, delay = (8, 0.05) if quick else (32, 0.05)
    out: Result = {"engines": n, "link_delay_s": delay, "runs": {}}
    async with open_prefill_worker(spec("fan", 2, 16, 4096, engines=n)) as w:  # noqa: SIM117
        async with open_delay_relays([(h, p) for _, h, p in w.addresses], delay) as ports:
            for fetches in (1, 8, n):
                remotes = []
                for e in range(n):
                    [remote] = await w.expose_many([(f"f{fetches}", [fetches % 16], e)], engine=e)
                    remotes.append(via(remote, ports[e]))
                config = trio_pd.ConnectorConfig(
                    handshake_timeout=120.0, max_concurrent_fetches=fetches
                )
                done: list[float] = []
                async with trio_pd.open_connector(
                    f"dec{fetches}", kv(2, 16, 4096), config=config
                ) as d:
                    started = trio.current_time()

                    async with trio.open_nursery() as nursery:
                        for e, remote in enumerate(remotes):
                            nursery.start_soon(_timed_pull, d, e, remote, started, done)
                    assert d.statistics().handshakes_succeeded == n
                label = "serialized (vLLM)" if fetches == 1 else f"{fetches} concurrent fetches"
                out["runs"][label] = {
                    "all_ready_s": round(max(done), 3),
                    "mean_ready_s": round(statistics.fmean(done), 3),
                }
    serial = out["runs"]["serialized (vLLM)"]["all_ready_s"]
    for run in out["runs"].values():
        run["speedup_vs_serialized"] = round(serial / run["all_ready_s"], 2)
    return out


async def _timed_pull(
    d: trio_pd.Connector, e: int, remote: trio_pd.RemoteBlocks, started: float, done: list[float]
) -> None:
    await d.pull(f"r{e}", [e % 16], remote)
    done.append(trio.current_time() - started)


# ---- 3. loop responsiveness ------------------------------------------------------


async def bench_loop_stall(quick: bool) -> Result:
    """Longest loop stall during a storm of handshakes with large descriptor lists.

    Each round opens a fresh decoder, so all engines are cold again; rounds
    alternate the modes, after a warm-up round that pays the process's
    one-time costs (imports, first UCX endpoints). Beside every storm, in a
    process of its own, a bare trio loop is watched at the same moments
    (``stall_floor``): the stall the machine itself imposes then (the floor).
    """
    engines, regions, blocks = (2, 64, 1024) if quick else (8, 64, 4096)
    # (rounds are short -- a storm takes about 50 ms -- and the machine's own
    # stalls move a round's by milliseconds: the medians need many)
    block_bytes, rounds = 16, 3 if quick else 11
    modes = (
        "trio_pd (worker threads)",
        "NIXL calls on the trio thread",
        "trio_pd, garbage collector not frozen",
    )
    stalls: dict[str, list[float]] = {mode: [] for mode in modes}
    stall_cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    stall_waiting: dict[str, list[float]] = {mode: [] for mode in modes}
    storms: dict[str, list[float]] = {mode: [] for mode in modes}
    floors: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    async with (
        open_prefill_worker(spec("big", regions, blocks, block_bytes, engines=engines)) as w,
        open_stall_floor() as floor,
    ):
        for round_ in range(rounds + 1):
            for mode in modes if round_ else modes[:1]:
                stall, cpu, waiting, storm, bare = await _handshake_storm(
                    w, mode, round_, engines, regions, blocks, floor
                )
                if round_:  # round 0 is the warm-up
                    stalls[mode].append(stall)
                    stall_cpu[mode].append(cpu)
                    stall_waiting[mode].append(waiting)
                    storms[mode].append(storm)
                    floors[mode].append(bare)
    out: Result = {
        "engines": engines,
        "descriptors_per_engine": regions * blocks,
        "rounds": rounds,
        "modes": {},
    }
    for mode in modes:
        above = [s - f["floor"] for s, f in zip(stalls[mode], floors[mode], strict=True)]
        out["modes"][mode] = {
            "longest_stall_ms": ms(statistics.median(stalls[mode])),
            "trio_thread_cpu_in_it_ms": ms(statistics.median(stall_cpu[mode])),
            "waiting_for_a_core_in_it_ms": ms(statistics.median(stall_waiting[mode])),
            "worst_round_ms": ms(max(stalls[mode])),
            "storm_s": round(statistics.median(storms[mode]), 3),
            "floor_ms": ms(statistics.median(f["floor"] for f in floors[mode])),
            "floor_batch_ms": ms(statistics.median(f["longest_batch"] for f in floors[mode])),
            "floor_late_ms": ms(statistics.median(f["longest_late"] for f in floors[mode])),
            "floor_batch_waiting_ms": ms(
                statistics.median(f["longest_batch_waiting"] for f in floors[mode])
            ),
            "above_floor_ms": ms(statistics.median(above)),
            "rounds_ms": [ms(s) for s in stalls[mode]],
            "round_floors_ms": [ms(f["floor"]) for f in floors[mode]],
            "rounds_cpu_ms": [ms(c) for c in stall_cpu[mode]],
            "rounds_waiting_ms": [ms(w) for w in stall_waiting[mode]],
        }
    threads, loop = (out["modes"][m]["longest_stall_ms"] for m in modes[:2])
    out["stall_ratio_loop_vs_threads"] = round(loop / max(threads, 1e-3), 1)
    return out


async def _handshake_storm(
    w: PrefillWorker,
    mode: str,
    round_: int,
    engines: int,
    regions: int,
    blocks: int,
    floor: StallFloor,
) -> tuple[float, float, float, float, dict[str, float]]:
    """One cold decoder, ``engines`` first pulls at once.

    Returns the longest stall, the trio thread's CPU time in it and its wait
    for a core in it (the kernel's run queue), the storm's seconds, and what
    the bare loop (``floor``) measured over the same storm.
    """
    config = trio_pd.ConnectorConfig(handshake_timeout=60.0)
    backend = NixlOnEventLoop.create if mode.startswith("NIXL") else None
    tag = f"{round_}-{mode[:5]}"
    remotes = []
    for e in range(engines):
        remotes += await w.expose_many([(tag, [e], e)], engine=e)
    local = kv(regions, blocks, 16)
    async with trio_pd.open_connector(f"dec-{tag}", local, config=config, backend=backend) as d:
        if mode.endswith("not frozen"):
            gc.unfreeze()
        monitor = LoopStallMonitor(run_queue=True)
        await floor.start()
        trio.lowlevel.add_instrument(monitor)
        started = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                for e, remote in enumerate(remotes):
                    nursery.start_soon(d.pull, f"p{e}", [e], remote)
        finally:
            trio.lowlevel.remove_instrument(monitor)
            monitor.close()
            gc.freeze()
        elapsed = trio.current_time() - started
        bare = await floor.stop()
        assert d.statistics().handshakes_succeeded == engines
        for e in range(engines):
            assert mismatched_blocks(local, [e], e) == []
    return monitor.longest, monitor.longest_cpu, monitor.longest_waiting, elapsed, bare


# ---- 4. throughput ------------------------------------------------------------------


async def bench_throughput(quick: bool) -> Result:
    """One large pull: trio_pd, raw NIXL on the same agent, memcpy; interleaved.

    With 64 KiB blocks a second connector on the same KV caches runs NIXL's
    UCX thread pool (``nixl_num_threads=2``, see ``ConnectorConfig``): its
    own trio_pd pull and raw NIXL READ are measured in the same repetitions.
    """
    total = (256 if quick else 1024) << 20
    regions, reps = 16, 5
    out: Result = {"bytes": total, "sizes": {}}
    for block_bytes in (16384, 65536):
        blocks = total // (regions * block_bytes)
        variants = {f"{block_bytes // 1024} KiB blocks": trio_pd.ConnectorConfig()}
        if block_bytes == 65536:
            variants[f"{block_bytes // 1024} KiB blocks, 2 NIXL threads"] = trio_pd.ConnectorConfig(
                nixl_num_threads=2
            )
        async with (
            open_prefill_worker(spec(f"tp{block_bytes}", regions, blocks, block_bytes)) as w,
            AsyncExitStack() as stack,
        ):
            local = kv(regions, blocks, block_bytes)
            ids = list(range(blocks))
            connectors = []
            for i, (name, config) in enumerate(variants.items()):
                captured = CapturedBackends()
                d = await stack.enter_async_context(
                    trio_pd.open_connector(
                        f"dec{block_bytes}-{i}", local, backend=captured, config=config
                    )
                )
                await d.pull(f"warm{i}", [0], await w.expose(f"warm{i}", [0], seed=0))
                connectors.append((name, d, captured.backends[0]))
            src = torch.empty(total, dtype=torch.uint8)
            dst = torch.empty_like(src)
            dst.copy_(src)  # fault the pages in
            rates = {name: {"trio_pd": [], "raw NIXL": []} for name in variants}
            memcpy: list[float] = []
            for rep in range(reps):
                for i, (name, d, backend) in enumerate(connectors):
                    rid = f"r{rep}-{i}"
                    remote = await w.expose(rid, ids, seed=rep)
                    result = await d.pull(rid, ids, remote)
                    rates[name]["trio_pd"].append(result.bytes / result.seconds / 1e9)
                    if rep == 0:
                        assert mismatched_blocks(local, ids, rep) == []
                    # the same READ, also of exposed blocks with their notification,
                    # so the producer side is in the same state for both
                    await w.expose(f"raw{rid}", ids, seed=rep)
                    seconds = raw_nixl_read(
                        backend,
                        w.engine_id,
                        np.arange(blocks, dtype=np.int64),
                        encode_notification(f"raw{rid}"),
                    )
                    rates[name]["raw NIXL"].append(total / seconds / 1e9)
                started = time.perf_counter()
                dst.copy_(src)
                memcpy.append(total / (time.perf_counter() - started) / 1e9)
            del src, dst
        for name, measured in rates.items():
            measured["memcpy"] = memcpy
            medians = {k: round(statistics.median(v), 2) for k, v in measured.items()}
            out["sizes"][name] = {
                "GB_per_s": medians,
                "all_GB_per_s": {k: [round(x, 2) for x in v] for k, v in measured.items()},
                "trio_pd_vs_raw": round(medians["trio_pd"] / medians["raw NIXL"], 3),
                "trio_pd_vs_memcpy": round(medians["trio_pd"] / medians["memcpy"], 3),
            }
        gc.collect()
    return out


# ---- 5. per-request overhead ------------------------------------------------------------


SEQUENTIAL_ROUNDS = 5
"""Benchmark 5's sequential loops take turns this many times (medians reported)."""

SEQUENTIAL_TURNS = 10
"""Each round of benchmark 5 is this many turns: every loop runs a tenth of
its round's pulls per turn (which goes first rotates), so that a second of
the machine's other load falls on all of them, not on one loop's round."""


async def bench_small_pulls(quick: bool) -> Result:
    """Tiny pulls one after another and many in flight, against raw NIXL's loop.

    Sequential pulls go inline (the trio thread posts each READ itself: the
    driver and the loop are idle). Side by side, in the same rounds: the
    library's path (every READ confirmed with its producer), the same with
    the confirmation switched off (``Consumer.confirm_reads``, benchmark 13's
    switch, for measurements only: what the rest of the pull path costs
    against raw NIXL), the confirmed path with inline reads off
    (``inline_read_bytes=0``: what they save), and raw NIXL's loop; the trio
    thread's CPU time per pull of each (raw NIXL's loop included: the READ's
    own NIXL calls). Lone pulls, spaced apart, are timed one by one,
    interleaved with raw NIXL READs.
    """
    regions, blocks, block_bytes = 4, 8192, 4096
    sequential, in_flight, lone = (400, 200, 60) if quick else (5000, 1000, 200)
    out: Result = {"block_bytes": block_bytes, "regions": regions}
    rng = np.random.default_rng(0)
    async with open_prefill_worker(spec("tiny", regions, blocks, block_bytes)) as w:
        local = kv(regions, blocks, block_bytes)
        captured = CapturedBackends()
        off = trio_pd.ConnectorConfig(inline_read_bytes=0)
        async with (
            trio_pd.open_connector("dec", local, backend=captured) as d,
            trio_pd.open_connector("dec-unconfirmed", local, backend=captured) as d_unc,
            trio_pd.open_connector("dec-driver", local, config=off) as d_off,
        ):
            d_unc._consumer.confirm_reads = False  # (benchmark only: see bench_confirm)
            for name, conn in (("", d), ("-unc", d_unc), ("-off", d_off)):
                await conn.pull(f"warm{name}", [0], await w.expose(f"warm{name}", [0], seed=0))
            backend, backend_unc = captured.backends

            def plan(prefix: str, n: int) -> list[tuple[str, list[int], int]]:
                sizes = rng.integers(1, 5, n)
                starts = np.cumsum(np.concatenate([[8], sizes[:-1]]))
                return [
                    (
                        f"{prefix}{i}",
                        list(range(int(s) % (blocks - 8), int(s) % (blocks - 8) + int(k))),
                        i,
                    )
                    for i, (s, k) in enumerate(zip(starts, sizes, strict=True))
                ]

            # Sequential: in rounds of turns, the loops taking turns (which goes
            # first rotates), so that the machine's noise falls on all of them;
            # raw NIXL reads blocks that are exposed (pending) too, with the same
            # notification, so the producer side behaves the same. Each loop's
            # time and trio-thread CPU time are summed over its turns.
            seconds: dict[str, float] = {}
            cpu: dict[str, float] = {}

            async def pulls(
                name: str, requests: list[tuple[str, list[int], int]], conn: trio_pd.Connector
            ) -> None:
                remotes = await w.expose_many(requests)
                started, cpu_started = time.perf_counter(), time.thread_time()
                for (rid, ids, _), remote in zip(requests, remotes, strict=True):
                    await conn.pull(rid, ids, remote)
                cpu[name] += time.thread_time() - cpu_started
                seconds[name] += time.perf_counter() - started

            async def raw_loop(name: str, requests: list[tuple[str, list[int], int]]) -> None:
                await w.expose_many(requests)
                started, cpu_started = time.perf_counter(), time.thread_time()
                for rid, ids, _ in requests:
                    notification = encode_notification(rid)
                    raw_nixl_read(backend, "tiny", np.asarray(ids, dtype=np.int64), notification)
                cpu[name] += time.thread_time() - cpu_started
                seconds[name] += time.perf_counter() - started

            loops: dict[str, Callable[[str, list[tuple[str, list[int], int]]], Awaitable[None]]]
            loops = {
                "trio_pd": functools.partial(pulls, conn=d),
                "unconfirmed": functools.partial(pulls, conn=d_unc),
                "raw NIXL": raw_loop,
                "inline off": functools.partial(pulls, conn=d_off),
            }
            rates: dict[str, list[float]] = {name: [] for name in loops}
            cpu_total = dict.fromkeys(loops, 0.0)
            inline_before = [(b.reads_inline, b.reads_adopted) for b in (backend, backend_unc)]
            per_round = sequential // SEQUENTIAL_ROUNDS
            per_turn = per_round // SEQUENTIAL_TURNS
            turn = 0
            for _ in range(SEQUENTIAL_ROUNDS):
                seconds.update(dict.fromkeys(loops, 0.0))
                cpu.update(dict.fromkeys(loops, 0.0))
                for _ in range(SEQUENTIAL_TURNS):
                    names = list(loops)
                    order = names[turn % len(names) :] + names[: turn % len(names)]
                    turn += 1
                    for name in order:
                        await loops[name](name, plan(f"seq-{name[:3]}-{turn}-", per_turn))
                for name in loops:
                    rates[name].append(per_turn * SEQUENTIAL_TURNS / seconds[name])
                    cpu_total[name] += cpu[name]
            pulls_each = per_turn * SEQUENTIAL_TURNS * SEQUENTIAL_ROUNDS
            went_inline, adopted, unc_inline, unc_adopted = (
                now - before
                for b, was in zip((backend, backend_unc), inline_before, strict=True)
                for now, before in zip((b.reads_inline, b.reads_adopted), was, strict=True)
            )
            trio_seq, unc_seq, raw_seq, driver_seq = (statistics.median(rates[n]) for n in loops)

            def round_ratios(name: str) -> list[float]:
                return [
                    round(a / b, 3) for a, b in zip(rates[name], rates["raw NIXL"], strict=True)
                ]

            def cpu_us(name: str) -> int:
                return round(cpu_total[name] / pulls_each * 1e6)

            # Lone pulls: spaced 2 ms apart, trio_pd (confirmed and not) and raw
            # NIXL interleaved.
            requests = plan("lone", lone)
            remotes = await w.expose_many(requests)
            unc_requests = plan("lone-unc", lone)
            unc_remotes = await w.expose_many(unc_requests)
            raw_requests = plan("lone-raw", lone)
            await w.expose_many(raw_requests)
            lone_trio, lone_unc, lone_raw = [], [], []
            for (rid, ids, _), remote, (unc_rid, unc_ids, _), unc_remote, (
                raw_rid,
                raw_ids,
                _,
            ) in zip(requests, remotes, unc_requests, unc_remotes, raw_requests, strict=True):
                await trio.sleep(0.002)
                started = time.perf_counter()
                await d.pull(rid, ids, remote)
                lone_trio.append(time.perf_counter() - started)
                await trio.sleep(0.002)
                started = time.perf_counter()
                await d_unc.pull(unc_rid, unc_ids, unc_remote)
                lone_unc.append(time.perf_counter() - started)
                await trio.sleep(0.002)
                started = time.perf_counter()
                raw_nixl_read(
                    backend,
                    "tiny",
                    np.asarray(raw_ids, dtype=np.int64),
                    encode_notification(raw_rid),
                )
                lone_raw.append(time.perf_counter() - started)

            requests = plan("par", in_flight)
            remotes = await w.expose_many(requests)
            posted_before = d.statistics().transfers_posted
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for (rid, ids, _), remote in zip(requests, remotes, strict=True):
                    nursery.start_soon(d.pull, rid, ids, remote)
            trio_par = in_flight / (time.perf_counter() - started)
            assert d.statistics().pulls_failed == 0
            posted = d.statistics().transfers_posted - posted_before
    out["sequential"] = {
        "trio_pd_pulls_per_s": round(trio_seq),
        "raw_nixl_pulls_per_s": round(raw_seq),
        "ratio": round(trio_seq / raw_seq, 3),
        "pulls": pulls_each,
        "rounds": SEQUENTIAL_ROUNDS,
        "turns_per_round": SEQUENTIAL_TURNS,
        "round_ratios": round_ratios("trio_pd"),
        "trio_thread_cpu_us_per_pull": cpu_us("trio_pd"),
        "unconfirmed_pulls_per_s": round(unc_seq),
        "unconfirmed_ratio": round(unc_seq / raw_seq, 3),
        "unconfirmed_round_ratios": round_ratios("unconfirmed"),
        "unconfirmed_trio_thread_cpu_us_per_pull": cpu_us("unconfirmed"),
        "raw_nixl_thread_cpu_us_per_pull": cpu_us("raw NIXL"),
        "inline": went_inline,
        "adopted": adopted,
        "unconfirmed_inline": unc_inline,
        "unconfirmed_adopted": unc_adopted,
        "inline_off_pulls_per_s": round(driver_seq),
        "inline_off_ratio": round(driver_seq / raw_seq, 3),
    }
    out["lone"] = {
        "pulls": lone,
        "trio_pd_ms_p50": round(statistics.median(lone_trio) * 1e3, 3),
        "raw_nixl_ms_p50": round(statistics.median(lone_raw) * 1e3, 3),
        "ratio": round(statistics.median(lone_raw) / statistics.median(lone_trio), 3),
        "unconfirmed_ms_p50": round(statistics.median(lone_unc) * 1e3, 3),
        "unconfirmed_ratio": round(statistics.median(lone_raw) / statistics.median(lone_unc), 3),
    }
    out["in_flight"] = {
        "pulls": in_flight,
        "trio_pd_pulls_per_s": round(trio_par),
        "ratio_to_raw_sequential": round(trio_par / raw_seq, 3),
        "transfers_posted": posted,
    }
    return out


# ---- 6. scale ------------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def process_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


SCALE_PRODUCER_CONFIG = tuned(
    trio_pd.ConnectorConfig(
        notification_poll_interval=2.0,
        idle_notification_poll_interval=2.0,
        lease_initial=900.0,  # (every storm's exposures are made up front: none expires before
        abort_timeout=900.0,  # its storm, which would only flood the log with expiry warnings)
    ),
    poll_interval=0.05,  # (an internal knob: trio_pd._config.Tuning)
)
"""The scale benchmark's producer engines poll lazily: each stands for an engine
on a host of its own, and 1024 of them share this machine's cores with the
decoder (at the default pace, 256 idle engines with an exposure pending kept
both cores busy). Their pace decides only how soon a first READ completes
(UCX finishes its wire-up when the producer's worker progresses). Their leases
outlast the benchmark: all storms' exposures are made before the first storm."""

SCALE_MODES = [
    "trio_pd",
    "one load per thread call",
    "raw NIXL",
    "one load per thread call",
    "trio_pd",
    "trio_pd, default handshake_timeout",
]


async def run_scale_decoder(job: Result) -> Result:
    """One decoder of :func:`bench_scale` in a fresh process (``scale_decoder.py``)."""
    script = Path(__file__).with_name("scale_decoder.py")
    done = await trio.run_process(
        [sys.executable, str(script)],
        stdin=json.dumps(job).encode(),
        capture_stdout=True,
        cwd=script.parent,
    )
    result: Result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


async def bench_scale(quick: bool) -> Result:
    """One decoder handshakes with every engine of a cold fleet at once.

    The engines are NIXL agents of their own, many per producer process (UCX
    over TCP and CMA: no shared-memory segments, which take 4 MiB per agent),
    polling lazily (``SCALE_PRODUCER_CONFIG``). Each decoder is a fresh
    process (``scale_decoder.py``), so its memory growth is its own. A storm
    is one notify-only pull per engine, all started at once (the handshake --
    fetch, checks, load, connect -- then one notification): trio_pd; trio_pd
    with one load per thread call (its design before loads were batched); the
    anchor, NIXL loading the same agents from one plain thread and notifying
    each; the first two again, in the other order; and trio_pd with the default
    ``handshake_timeout``
    (how many handshakes of the storm fail while queued). The first trio_pd
    decoder then pulls 1 block from every (ready) engine at once, bytes checked.
    """
    per_process, processes = (16, 2) if quick else (128, 8)
    engines = per_process * processes
    env = {"UCX_TLS": "tcp,cma,self"}
    specs = [
        WorkerSpec(f"s{i}", engines=per_process, regions=2, blocks=4, block_shape=(512,), env=env)
        for i in range(processes)
    ]
    out: Result = {"engines": engines, "processes": processes, "modes": {}}
    started = time.perf_counter()
    async with open_prefill_workers(
        specs, config=SCALE_PRODUCER_CONFIG, startup_timeout=900
    ) as workers:
        out["producers_start_s"] = round(time.perf_counter() - started, 1)
        out["producers_rss_MiB"] = round(
            sum(process_rss_bytes(w.process.pid) for w in workers) / 2**20
        )
        storms: list[list[Result]] = [[] for _ in SCALE_MODES]
        reads: list[Result] = []
        for w in workers:
            for e in range(per_process):
                exposed = [(f"h{m}", [], 0) for m in range(len(SCALE_MODES))]
                *handshakes, read = await w.expose_many(
                    [*exposed, ("r", [1], len(reads))], engine=e
                )
                for m, remote in enumerate(handshakes):
                    storms[m].append(remote.to_kv_transfer_params())
                reads.append(read.to_kv_transfer_params())
        for m, mode in enumerate(SCALE_MODES):
            await trio.sleep(1.0)  # (the producers settle after the last decoder closed)
            pids = [w.process.pid for w in workers]
            job: Result = {"mode": mode, "storm": storms[m], "producer_pids": pids}
            if m == 0:
                job["reads"] = reads
            if mode == "trio_pd, default handshake_timeout":
                job.update(mode="trio_pd", default_handshake_timeout=True)
            done = await run_scale_decoder(job)
            producers_cpu = done["producers_cpu_seconds"]
            result = {
                "seconds": round(done["seconds"], 3),
                "per_engine_ms": round(done["seconds"] / engines * 1e3, 3),
                "rss_per_engine_KiB": round(done["rss_bytes"] / engines / 1024, 1),
                "decoder_cpu_per_engine_ms": round(done["cpu_seconds"] / engines * 1e3, 2),
                "producers_cpu_per_engine_ms": round(producers_cpu / engines * 1e3, 2),
            }
            if "reads_seconds" in done:
                out["first_reads_s"] = round(done["reads_seconds"], 3)
            if job.get("default_handshake_timeout"):
                out["default_timeout_failed"] = done["failed"]
                out["default_timeout_s"] = round(done["seconds"], 3)
                continue
            out["modes"].setdefault(mode, []).append(result)
    runs = out["modes"]
    trio_s = statistics.median(r["seconds"] for r in runs["trio_pd"])
    raw = runs["raw NIXL"][0]
    out.update(
        all_handshaked_s=round(trio_s, 3),
        per_engine_ms=round(trio_s / engines * 1e3, 3),
        decoder_rss_per_engine_KiB=max(r["rss_per_engine_KiB"] for r in runs["trio_pd"]),
        raw_nixl_s=raw["seconds"],
        raw_nixl_rss_per_engine_KiB=raw["rss_per_engine_KiB"],
        raw_nixl_share=round(raw["seconds"] / trio_s, 3),
        one_load_per_call_ratio=round(
            statistics.median(r["seconds"] for r in runs["one load per thread call"]) / trio_s, 3
        ),
    )
    return out


# ---- 7. tensor parallelism ------------------------------------------------------------


async def bench_tp_throughput(quick: bool) -> Result:
    """The same request bytes moved between engines of various TP sizes.

    Every decode rank pulls the request at once (each its heads); the rate is
    the engine's bytes over the time until the last decode rank is done.
    Compared with TP 1 -> 1 and 2 -> 2 on the same bytes, interleaved.
    """
    total = (64 if quick else 256) << 20
    regions, heads, head_bytes, reps = 16, 8, 8192, 5
    blocks = total // (regions * heads * head_bytes)
    pairs = [(1, 1), (2, 2), (2, 1), (1, 2)]  # (prefill TP, decode TP)
    ids = list(range(blocks))
    rates: dict[str, list[float]] = {f"{p} -> {d}": [] for p, d in pairs}
    async with AsyncExitStack() as stack:
        setups = []
        for n, (ptp, dtp) in enumerate(pairs):
            base = free_port_range(ptp) if ptp > 1 else 0
            specs = [
                WorkerSpec(
                    f"tp{n}",
                    regions=regions,
                    blocks=blocks,
                    block_shape=(heads // ptp, head_bytes // 2),
                    port=base,
                    tp_rank=rank,
                    tp_size=ptp,
                    payload="heads",
                )
                for rank in range(ptp)
            ]
            workers = await stack.enter_async_context(
                open_prefill_workers(specs, startup_timeout=300)
            )
            decoders = []
            dbase = free_port_range(dtp) if dtp > 1 else 0
            for rank in range(dtp):
                local = [
                    torch.zeros((blocks, heads // dtp, head_bytes // 2), dtype=torch.float16)
                    for _ in range(regions)
                ]
                conn = await stack.enter_async_context(
                    trio_pd.open_connector(f"tpd{n}", local, port=dbase, tp_rank=rank, tp_size=dtp)
                )
                decoders.append((conn, local))
            setups.append((f"{ptp} -> {dtp}", workers, decoders))
        for rep in range(-1, reps):  # rep -1: warm-up (handshakes, first touch)
            for name, workers, decoders in setups:
                rid = f"r{rep}"
                remotes = [await w.expose(rid, ids, seed=rep + 2) for w in workers]
                started = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for conn, _ in decoders:
                        nursery.start_soon(conn.pull, rid, ids, remotes[0])
                seconds = time.perf_counter() - started
                if rep >= 0:
                    rates[name].append(total / seconds / 1e9)
                if rep == 0:
                    for rank, (_, local) in enumerate(decoders):
                        assert mismatched_heads(local, rank, ids, ids, rep + 2) == []
                for worker in workers:
                    await worker.wait_released(rid)
    medians = {k: round(statistics.median(v), 2) for k, v in rates.items()}
    return {
        "bytes": total,
        "GB_per_s": medians,
        "all_GB_per_s": {k: [round(x, 2) for x in v] for k, v in rates.items()},
        "ratio_to_1_1": {k: round(v / medians["1 -> 1"], 3) for k, v in medians.items()},
        "ratio_to_2_2": {k: round(v / medians["2 -> 2"], 3) for k, v in medians.items()},
    }


# ---- 8. a slow far engine -----------------------------------------------------------


async def bench_far_link(quick: bool) -> Result:
    """Near-engine pull latency while a large pull crosses a slow link to a far engine.

    The far engine runs on a test host behind a rate-limited veth link, the
    near one on this host; the decoder is a process of its own (UCX over
    TCP for both, so that the far pull really crosses the link). Root only.
    """
    rate, far_mib = "200mbit", 16 if quick else 48
    near_pulls, gap = 40 if quick else 100, 0.005
    tcp = {"UCX_TLS": "tcp"}
    block_bytes, regions = 65536, 4
    far_blocks = (far_mib << 20) // (regions * block_bytes)
    base = {"regions": regions, "block_shape": (block_bytes // 2,), "env": tcp}
    async with open_test_hosts(1) as [host]:
        await host.limit_rate(rate)
        specs = [
            WorkerSpec("far", blocks=far_blocks, host=host.address, netns=host.netns, **base),
            WorkerSpec("near", blocks=far_blocks, **base),
            WorkerSpec("decoder", blocks=far_blocks + 16, **base),
        ]
        async with open_prefill_workers(specs, startup_timeout=300) as (far, near, decoder):
            ids = list(range(far_blocks))
            for w in (far, near):  # handshakes and wire-up, out of the measurement
                await decoder.pull(f"warm-{w.engine_id}", [0], await w.expose("w", [0], 0), 0)

            async def near_latencies(tag: str) -> list[float]:
                out = []
                for i in range(near_pulls):
                    remote = await near.expose(f"{tag}{i}", [1 + i % 8], seed=i)
                    local = [far_blocks + i % 8]  # not among the far pull's blocks
                    result = await decoder.pull(f"{tag}{i}", local, remote, seed=i)
                    assert result["mismatched"] == []
                    out.append(result["seconds"])
                    await trio.sleep(gap)
                return out

            idle = await near_latencies("idle")
            far_remote = await far.expose("big", ids, seed=9)
            busy: list[float] = []
            far_seconds: list[float] = []

            async def big_pull() -> None:
                result = await decoder.pull("big", ids, far_remote, seed=9)
                assert result["mismatched"] == []
                far_seconds.append(result["seconds"])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(big_pull)
                await trio.sleep(0.05)
                busy = await near_latencies("busy")
    return {
        "link_rate": rate,
        "far_pull_MiB": far_mib,
        "far_pull_s": round(far_seconds[0], 3),
        "near_pulls": near_pulls,
        "idle_p50_ms": ms(pct(idle, 50)),
        "idle_p99_ms": ms(pct(idle, 99)),
        "during_far_pull_p50_ms": ms(pct(busy, 50)),
        "during_far_pull_p99_ms": ms(pct(busy, 99)),
        "ratio_p50": round(pct(busy, 50) / pct(idle, 50), 2),
        "ratio_p99": round(pct(busy, 99) / pct(idle, 99), 2),
    }


# ---- 9. concurrent large pulls ------------------------------------------------------


CONCURRENT_COUNTS = (1, 4, 16)
"""Benchmark 9's pulls at once (16 and 1 are compared with each other too)."""


async def bench_concurrent_pulls(quick: bool) -> Result:
    """The same bytes as 1, 4 or 16 pulls at once, against raw NIXL posting them at once.

    Raw NIXL: the connector's own agent and descriptor lists, every transfer
    posted from one thread, then all polled together until done. Measured in
    ``rounds`` rounds (each count once per round, trio_pd and raw NIXL
    taking turns, which goes first alternating by round), so that the page
    can show every round's ratios, not only their medians: the issue's goal
    is 16 pulls at once as fast as one pull in *every* run.
    """
    total = (256 if quick else 1024) << 20
    regions, block_bytes, rounds = 16, 65536, 2 if quick else 5
    blocks = total // (regions * block_bytes)
    counts = CONCURRENT_COUNTS
    rates: dict[int, dict[str, list[float]]] = {n: {"trio_pd": [], "raw NIXL": []} for n in counts}
    async with open_prefill_worker(spec("conc", regions, blocks, block_bytes)) as w:
        local = kv(regions, blocks, block_bytes)
        captured = CapturedBackends()
        async with trio_pd.open_connector("dec-conc", local, backend=captured) as d:
            await d.pull("warm", [0], await w.expose("warm", [0], seed=0))
            backend = captured.backends[0]

            async def trio_pd_at_once(names: list[str], chunks: list[Any], seed: int) -> float:
                remotes = await w.expose_many(
                    [(n, c.tolist(), seed) for n, c in zip(names, chunks, strict=True)]
                )
                started = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for n, c, r in zip(names, chunks, remotes, strict=True):
                        nursery.start_soon(d.pull, n, c.tolist(), r)
                return total / (time.perf_counter() - started) / 1e9

            async def raw_at_once(names: list[str], chunks: list[Any], seed: int) -> float:
                await w.expose_many(
                    [(n, c.tolist(), seed) for n, c in zip(names, chunks, strict=True)]
                )
                notifications = [encode_notification(n) for n in names]
                seconds = raw_nixl_read_at_once(backend, w.engine_id, chunks, notifications)
                return total / seconds / 1e9

            for round_ in range(rounds):
                for count in counts:
                    chunks = np.array_split(np.arange(blocks), count)
                    names = [f"c{count}-{round_}-{i}" for i in range(count)]
                    turns = [("trio_pd", trio_pd_at_once), ("raw NIXL", raw_at_once)]
                    for name, at_once in turns[:: 1 if round_ % 2 == 0 else -1]:
                        prefix = "" if name == "trio_pd" else "raw"
                        rate = await at_once([prefix + n for n in names], chunks, round_)
                        rates[count][name].append(rate)
                        if os.environ.get("PD_BENCH_VERBOSE"):
                            print(f"round {round_} x{count} {name}: {rate:.2f} GB/s", flush=True)
    out: Result = {"bytes": total, "rounds": rounds, "counts": {}}
    for count in counts:
        medians = {k: round(statistics.median(v), 2) for k, v in rates[count].items()}
        out["counts"][str(count)] = {
            "GB_per_s": medians,
            "ratio": round(medians["trio_pd"] / medians["raw NIXL"], 3),
            "rounds_GB_per_s": {k: [round(x, 2) for x in v] for k, v in rates[count].items()},
            "round_ratios": [
                round(a / b, 3)
                for a, b in zip(rates[count]["trio_pd"], rates[count]["raw NIXL"], strict=True)
            ],
        }
    out["sixteen_vs_one"] = (
        {}
        if not {1, 16} <= set(counts)
        else {
            name: [round(a / b, 3) for a, b in zip(rates[16][name], rates[1][name], strict=True)]
            for name in ("trio_pd", "raw NIXL")
        }
    )
    return out


# ---- 10. producer CPU while exposures wait -------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds so far of ``root`` and its live descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # (it ended meanwhile)
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    total = 0.0
    for pid in tree:
        with contextlib.suppress(OSError):
            total += _cpu_seconds(pid)
    return total


def _machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / tick, sum(values) / tick


async def bench_producer_cpu(quick: bool) -> Result:
    """CPU of a producer process: idle; with 1000 exposures pending that nobody
    reads, just after exposing them (reads expected) and once they are stale."""
    window = 1.0 if quick else 3.0
    async with open_prefill_worker(spec("cpu", 2, 2048, 4096)) as w:
        pid = w.process.pid

        async def cores(seconds: float) -> float:
            before, started = _cpu_seconds(pid), time.perf_counter()
            await trio.sleep(seconds)
            return (_cpu_seconds(pid) - before) / (time.perf_counter() - started)

        idle = await cores(window)
        await w.expose_many([(f"p{i}", [i], i) for i in range(1000)])
        fresh = await cores(0.4)  # (reads are expected for 0.5 s after exposing)
        await trio.sleep(0.5)
        stale = await cores(window)
    return {
        "window_s": window,
        "idle_cores": round(idle, 3),
        "pending_1000_fresh_cores": round(fresh, 3),
        "pending_1000_cores": round(stale, 3),
    }


# ---- 11. serving through the P/D proxy ------------------------------------------


async def bench_serve(quick: bool) -> Result:
    """``trio-pd serve``: time to first token and tokens/s disaggregated
    against one engine serving the whole request, the same prompts, at 1, 8
    and 32 clients. Four disaggregated targets: a decode-first engine
    (a second deployment, ``trio-pd serve --dispatch decode-first``), the
    same with its prefill requests over HTTP (a third, with
    ``--no-prefill-channel``), and two proxies in front of ``serve``'s
    engines: ``serve``'s own, with ``--dispatch concurrent``, and a
    ``trio-pd proxy --dispatch sequential`` process (the default path). At
    1 client the five targets take turns
    request by request (every prompt three times, the order rotating by
    prompt), and
    each answer's ``Server-Timing`` splits its time to first token
    (:func:`_ttft_breakdown`); at 8 and 32 the targets take turns by client
    count."""
    import tempfile
    from contextlib import aclosing

    import httpx2

    from trio_pd._serve.timing import parse as parse_server_timing

    prompts = [f"request {i}: " + "tell me about trio nurseries " * (1 + i % 9) for i in range(32)]
    max_tokens = 16 if quick else 32
    client_counts = (1, 8) if quick else (1, 8, 32)
    passes = 1 if quick else 3  # (over the prompts, at 1 client)
    rounds = 2 if quick else 5  # (at 8 and 32 clients)
    if quick:
        prompts = prompts[:12]
    with tempfile.TemporaryDirectory() as scratch:
        ready = Path(scratch) / "ready.json"
        command = [
            sys.executable,
            "-m",
            "trio_pd",
            "serve",
            "--port",
            "0",
            "--dispatch",
            "concurrent",
        ]
        # (the engine is called directly too: it needs the deployment's internal key)
        internal_key = secrets.token_urlsafe(32)
        process = await trio.lowlevel.open_process(
            [*command, "--ready-file", str(ready)],
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "TRIO_PD_INTERNAL_KEY": internal_key},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        sequential: trio.Process | None = None
        decode_first: trio.Process | None = None
        decode_first_http: trio.Process | None = None
        one_engine: trio.Process | None = None
        try:
            with trio.fail_after(120):
                while not ready.exists():  # (another process writes it)
                    assert process.poll() is None, "trio-pd serve exited early"
                    await trio.sleep(0.05)
            urls = json.loads(ready.read_text())
            # The old path beside it: a proxy that dispatches sequentially.
            ready_sequential = Path(scratch) / "ready-sequential.json"
            sequential = await trio.lowlevel.open_process(
                [
                    *[sys.executable, "-m", "trio_pd", "proxy", "--port", "0"],
                    *["--dispatch", "sequential", "--ready-file", str(ready_sequential)],
                    *["--prefill", *urls["prefill"], "--decode", *urls["decode"]],
                ],
                env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "TRIO_PD_INTERNAL_KEY": internal_key},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            # And the decode-first path: a second deployment, `trio-pd serve
            # --dispatch decode-first` (its own prefill and decode engines; the
            # client calls its decode engine).
            ready_first = Path(scratch) / "ready-decode-first.json"
            decode_first = await trio.lowlevel.open_process(
                [*command[:-1], "decode-first", "--ready-file", str(ready_first)],
                env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "TRIO_PD_INTERNAL_KEY": internal_key},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            # The decode-first path before its prefill channel, beside it: a
            # third deployment whose engines send and take prefill requests
            # over HTTP only (--no-prefill-channel).
            ready_http = Path(scratch) / "ready-decode-first-http.json"
            decode_first_http = await trio.lowlevel.open_process(
                [
                    *command[:-1],
                    *["decode-first", "--no-prefill-channel", "--ready-file", str(ready_http)],
                ],
                env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "TRIO_PD_INTERNAL_KEY": internal_key},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            # And one engine of its own, serving whole requests: a fourth
            # deployment's decode engine (the same flags as every other), idle
            # while the others run, as the decode-first deployments' are (the
            # first deployment's decode engine also serves both proxies).
            ready_one = Path(scratch) / "ready-one-engine.json"
            one_engine = await trio.lowlevel.open_process(
                [*command[:-2], "--ready-file", str(ready_one)],
                env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "TRIO_PD_INTERNAL_KEY": internal_key},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            with trio.fail_after(60):
                while not (
                    ready_sequential.exists()
                    and ready_first.exists()
                    and ready_http.exists()
                    and ready_one.exists()
                ):
                    assert sequential.poll() is None, "trio-pd proxy exited early"
                    assert decode_first.poll() is None, "trio-pd serve (decode-first) exited early"
                    assert decode_first_http.poll() is None, (
                        "trio-pd serve (decode-first, --no-prefill-channel) exited early"
                    )
                    assert one_engine.poll() is None, "trio-pd serve (one engine) exited early"
                    await trio.sleep(0.05)
            targets = {
                DECODE_FIRST: json.loads(ready_first.read_text())["clients"][0],
                DECODE_FIRST_HTTP: json.loads(ready_http.read_text())["clients"][0],
                PROXY: urls["proxy"],
                SEQUENTIAL: json.loads(ready_sequential.read_text())["url"],
                ONE_ENGINE: json.loads(ready_one.read_text())["decode"][0],
            }

            def served_cpu_seconds() -> float:
                assert sequential is not None
                assert decode_first is not None
                assert decode_first_http is not None
                assert one_engine is not None
                return (
                    _tree_cpu_seconds(process.pid)
                    + _cpu_seconds(sequential.pid)
                    + _tree_cpu_seconds(decode_first.pid)
                    + _tree_cpu_seconds(decode_first_http.pid)
                    + _tree_cpu_seconds(one_engine.pid)
                )

            # (idle connections closed within 2 s, before the servers' own
            # 5 s keep-alive timeout does: a target waits while the others run,
            # and a connection the server is closing made "Server disconnected")
            limits = httpx2.Limits(max_connections=None, keepalive_expiry=2.0)
            auth = {"Authorization": f"Bearer {internal_key}"}
            async with httpx2.AsyncClient(timeout=60, limits=limits, headers=auth) as client:

                async def one(url: str, prompt: str) -> Result:
                    """One streamed request: seconds to its headers, to its first
                    token and to its end; its tokens; its Server-Timing (ms)."""
                    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
                    started, first, tokens = time.perf_counter(), 0.0, 0
                    async with (
                        client.stream("POST", f"{url}/v1/completions", json=body) as response,
                        aclosing(response.aiter_lines()) as lines,
                    ):
                        headers = time.perf_counter() - started
                        if response.status_code != 200:
                            text = (await response.aread())[:500]
                            raise RuntimeError(f"{url}: {response.status_code} {text!r}")
                        async for line in lines:
                            if line.startswith("data: {"):
                                if '"error"' in line:  # (measure answers, not failures)
                                    raise RuntimeError(f"{url}: {line}")
                                tokens += 1
                                first = first or time.perf_counter() - started
                    if tokens != max_tokens:
                        raise RuntimeError(f"{url}: {tokens} of {max_tokens} tokens")
                    timing = parse_server_timing(response.headers.get("server-timing", ""))
                    return {
                        "headers": headers,
                        "first": first,
                        "seconds": time.perf_counter() - started,
                        "tokens": tokens,
                        "timing": timing,
                    }

                async def many(url: str, clients: int) -> Result:
                    """Every prompt once, ``clients`` at a time: tokens/s, time to
                    first token, and what a token cost in CPU."""
                    limiter = trio.CapacityLimiter(clients)
                    answers: list[Result] = []

                    async def client_request(prompt: str) -> None:
                        async with limiter:
                            answers.append(await one(url, prompt))

                    started = time.perf_counter()
                    served_cpu = served_cpu_seconds()
                    client_cpu = time.process_time()
                    busy, total = _machine_busy_seconds()
                    async with trio.open_nursery() as nursery:
                        for prompt in prompts:
                            nursery.start_soon(client_request, prompt)
                    elapsed = time.perf_counter() - started
                    served_cpu = served_cpu_seconds() - served_cpu
                    client_cpu = time.process_time() - client_cpu
                    busy_after, total_after = _machine_busy_seconds()
                    tokens = sum(a["tokens"] for a in answers)
                    return {
                        "ttft_p50_ms": ms(statistics.median(a["first"] for a in answers)),
                        "tokens_per_s": tokens / elapsed,
                        # what a token costs the serving processes, and this client
                        "server_cpu_ms_per_token": served_cpu / tokens * 1e3,
                        "client_cpu_ms_per_token": client_cpu / tokens * 1e3,
                        "machine_busy": (busy_after - busy) / max(total_after - total, 1e-9),
                    }

                for url in targets.values():  # warm-up: handshakes, first allocations
                    for prompt in prompts[:4]:
                        await one(url, prompt)
                rows: dict[int, dict[str, Result]] = {}
                answers: dict[str, list[Result]] = {name: [] for name in targets}
                # 1 client: the targets take turns, request by request, in an
                # order that rotates by prompt (a target that always followed
                # the same one would always find the same processes warm)
                names = list(targets)
                for pass_ in range(passes):
                    for i, prompt in enumerate(prompts):
                        turn = (pass_ * len(prompts) + i) % len(names)
                        for name in names[turn:] + names[:turn]:
                            answers[name].append(await one(targets[name], prompt))
                rows[1] = {
                    name: {
                        "ttft_p50_ms": ms(statistics.median(a["first"] for a in done)),
                        "tokens_per_s": round(
                            sum(a["tokens"] for a in done) / sum(a["seconds"] for a in done)
                        ),
                    }
                    for name, done in answers.items()
                }
                # 8 and 32 clients: ROUNDS rounds, the targets taking turns in
                # an order that rotates by round; each round's own ratios too.
                for clients in client_counts[1:]:
                    runs: dict[str, list[Result]] = {name: [] for name in targets}
                    for round_ in range(rounds):
                        order = list(targets)[round_ % len(targets) :]
                        order += list(targets)[: round_ % len(targets)]
                        for name in order:
                            runs[name].append(await many(targets[name], clients))
                    rows[clients] = {
                        name: _serve_rounds(done, runs[ONE_ENGINE]) for name, done in runs.items()
                    }
        finally:
            for server in (one_engine, decode_first_http, decode_first, sequential, process):
                if server is not None:
                    server.send_signal(signal.SIGTERM)
                    with trio.move_on_after(30, shield=True):
                        await server.wait()
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "passes_at_1_client": passes,
        "rounds": rounds,
        "by_clients": {str(c): r for c, r in rows.items()},
        "targets": [name for name in targets if name != ONE_ENGINE],
        "ratios": {name: _serve_ratios(rows, name) for name in targets if name != ONE_ENGINE},
        "ttft_breakdown_ms": _ttft_breakdown(answers),
    }


DECODE_FIRST = "decode-first engine (P/D)"
DECODE_FIRST_HTTP = "decode-first engine, prefill over HTTP (P/D)"
PROXY, SEQUENTIAL, ONE_ENGINE = "proxy (P/D)", "proxy (P/D), sequential", "one engine"
"""Benchmark 11's targets: a decode-first engine (``--prefill-url``: clients
call it, it runs the prefill on a prefill engine of its deployment, over
that engine's prefill channel), the same with its prefill requests over HTTP
(``--no-prefill-channel``: a deployment of its own), ``serve``'s proxy
(``--dispatch concurrent``), a proxy dispatching sequentially (the default),
and one engine (a fourth deployment's decode engine, serving whole requests:
idle while the others run, as the decode-first deployments' engines are)."""


def _serve_rounds(runs: list[Result], one_engine: list[Result]) -> Result:
    """A target's rounds at one client count: medians over the rounds, CPU per
    token over all of them, and each round's tokens/s over one engine's in the
    same round (``round_ratios``)."""
    return {
        "ttft_p50_ms": ms(statistics.median(r["ttft_p50_ms"] for r in runs) / 1e3),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs)),
        "server_cpu_ms_per_token": round(
            statistics.fmean(r["server_cpu_ms_per_token"] for r in runs), 3
        ),
        "client_cpu_ms_per_token": round(
            statistics.fmean(r["client_cpu_ms_per_token"] for r in runs), 3
        ),
        "machine_busy": round(statistics.fmean(r["machine_busy"] for r in runs), 2),
        "round_ratios": [
            round(r["tokens_per_s"] / o["tokens_per_s"], 2)
            for r, o in zip(runs, one_engine, strict=True)
        ],
    }


def _serve_ratios(rows: dict[int, dict[str, Result]], proxy: str) -> Result:
    """``proxy``'s time to first token and tokens/s against one engine's, by client count."""
    ttft = {c: (r[proxy]["ttft_p50_ms"], r[ONE_ENGINE]["ttft_p50_ms"]) for c, r in rows.items()}
    return {
        "ttft_ratio": {str(c): round(p / o, 2) for c, (p, o) in ttft.items()},
        "ttft_added_ms": {str(c): ms((p - o) / 1e3) for c, (p, o) in ttft.items()},
        # (by client count: with rounds, the median of the rounds' own ratios)
        "tokens_per_s_ratio": {
            str(c): round(
                statistics.median(r[proxy]["round_ratios"])
                if "round_ratios" in r[proxy]
                else r[proxy]["tokens_per_s"] / r[ONE_ENGINE]["tokens_per_s"],
                2,
            )
            for c, r in rows.items()
        },
        # A token's CPU (serving processes and this client) through the proxy over
        # one engine's: on a saturated machine, tokens/s can reach at most its inverse.
        "cpu_per_token_ratio": {
            str(c): round(
                (r[proxy]["server_cpu_ms_per_token"] + r[proxy]["client_cpu_ms_per_token"])
                / (
                    r[ONE_ENGINE]["server_cpu_ms_per_token"]
                    + r[ONE_ENGINE]["client_cpu_ms_per_token"]
                ),
                2,
            )
            for c, r in rows.items()
            if c > 1
        },
    }


def _ttft_breakdown(answers: dict[str, list[Result]]) -> Result:
    """Where each target's time to first token goes at 1 client, in ms: each
    phase's mean over the middle 80% of the requests by time to first token
    (the slowest and fastest tenth left out), so that the rows add up to
    that mean, shown as ``ttft``.

    From each answer's ``Server-Timing`` (see ``trio_pd._serve.timing``) and
    the client's own clock: when the answer's headers arrived and when its
    first token did. The proxy's headers leave once the decode engine's
    answer started, so ``front`` -- the client's request to the proxy and
    the proxy's own work -- is what is left of the headers' time once its
    ``prefill`` and ``decode`` requests are taken out.
    """

    def phases(answer: Result, name: str) -> dict[str, float]:
        t = answer["timing"]
        headers, first = answer["headers"] * 1e3, answer["first"] * 1e3
        if name == ONE_ENGINE:
            forward = t.get("admission", 0.0) + t.get("forward", 0.0)
            return {"front": headers - forward, "forward": forward, "first_step": first - headers}
        if name in (DECODE_FIRST, DECODE_FIRST_HTTP):  # (headers with the first token, once held)
            forward = t.get("prefill.admission", 0.0) + t.get("prefill.forward", 0.0)
            expose = t.get("prefill.expose", 0.0)
            hold = t.get("hold", 0.0)
            return {
                "front": headers - t["prefill"] - hold,
                "prefill_http": t["prefill"] - forward - expose,
                "forward": forward,
                "expose": expose,
                "hold": hold,
                "first_step": first - headers,
            }
        forward = t.get("prefill.admission", 0.0) + t.get("prefill.forward", 0.0)
        expose = t.get("prefill.expose", 0.0)
        hold = t.get("decode.hold", 0.0) + t.get("decode.admission", 0.0)
        pull = t.get("decode.pull", 0.0)
        return {
            "front": headers - t["prefill"] - t["decode"],
            "prefill_http": t["prefill"] - forward - expose,
            "forward": forward,
            "expose": expose,
            "decode_http": t["decode"] - hold - pull,
            "hold": hold,
            "pull": pull,
            "first_step": first - headers,
        }

    out: Result = {}
    for name, done in answers.items():
        ranked = sorted(done, key=lambda a: float(a["first"]))
        cut = len(ranked) // 10
        middle = ranked[cut : len(ranked) - cut]
        split = [phases(a, name) for a in middle]
        out[name] = {key: round(statistics.fmean(s[key] for s in split), 3) for key in split[0]}
        out[name]["ttft"] = round(statistics.fmean(a["first"] for a in middle) * 1e3, 3)
    return out


# ---- 12. the proxy's own cost ---------------------------------------------------


async def bench_proxy_overhead(quick: bool) -> Result:
    """What the P/D proxy adds by itself: requests to a do-nothing upstream (it
    answers prefill and decode at once), through the proxy and straight to the
    upstream's decode route, interleaved; the proxy does two upstream requests
    (prefill, then decode) where the direct client does one. Two proxies take
    turns with the direct client: one dispatching concurrently (the decode
    request goes with the prefill, its parameters a second line), one
    sequentially (the default)."""
    import httpx2
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from trio_pd._serve.asgi import read_json, send_json
    from trio_pd._serve.dispatch import SecondLine, params_within
    from trio_pd._serve.proxy import Proxy, open_client

    async def do_nothing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        within = params_within(scope["headers"])
        if within is not None:  # (a decode request whose parameters follow)
            second = SecondLine(receive, within)
            await second.first()
            await second.params()
            await send_json(send, 200, {"choices": [{"text": "ok", "index": 0}]})
            return
        body = await read_json(receive)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            await send_json(send, 200, {"kv_transfer_params": {"do_remote_prefill": True}})
        else:
            await send_json(send, 200, {"choices": [{"text": "ok", "index": 0}]})

    async def start(nursery: trio.Nursery, app: Any) -> str:
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        config.errorlog = None
        return str((await nursery.start(functools.partial(serve, app, config)))[0])

    requests = 200 if quick else 1000
    body = {"prompt": "hello", "max_tokens": 4}
    async with open_client() as upstream_client, trio.open_nursery() as nursery:
        engine = await start(nursery, do_nothing)
        targets = {"direct": engine}
        for dispatch in ("concurrent", "sequential"):
            proxy = Proxy([engine], [engine], upstream_client, dispatch=dispatch)
            targets[dispatch] = await start(nursery, proxy.app())
        async with httpx2.AsyncClient(timeout=30) as client:
            times: dict[str, list[float]] = {name: [] for name in targets}
            for _ in range(20):  # warm-up: connections
                for url in targets.values():
                    await client.post(f"{url}/v1/completions", json=body)
            for _ in range(requests):
                for name, url in targets.items():
                    started = time.perf_counter()
                    response = await client.post(f"{url}/v1/completions", json=body)
                    times[name].append(time.perf_counter() - started)
                    assert response.status_code == 200, response.text
        nursery.cancel_scope.cancel()
    direct, via, sequential = (
        sorted(times[name]) for name in ("direct", "concurrent", "sequential")
    )
    return {
        "requests": requests,
        "direct_p50_ms": ms(pct(direct, 50)),
        "direct_p99_ms": ms(pct(direct, 99)),
        "proxy_p50_ms": ms(pct(via, 50)),
        "proxy_p99_ms": ms(pct(via, 99)),
        "added_p50_ms": ms(pct(via, 50) - pct(direct, 50)),
        "added_p99_ms": ms(pct(via, 99) - pct(direct, 99)),
        "sequential_p50_ms": ms(pct(sequential, 50)),
        "sequential_p99_ms": ms(pct(sequential, 99)),
        "sequential_added_p50_ms": ms(pct(sequential, 50) - pct(direct, 50)),
        "sequential_added_p99_ms": ms(pct(sequential, 99) - pct(direct, 99)),
    }


# ---- 13. the confirmation's cost -------------------------------------------------


CONFIRM_ROUNDS = 5
"""Benchmark 13's loops take turns this many times (medians reported)."""


async def bench_confirm(quick: bool) -> Result:
    """What confirming each READ with its producer costs (issue 28), side by side.

    Two decode connectors pull from one prefill engine (its own process): one
    confirms every READ (the library's only mode), the other has the
    confirmation turned off (``Consumer.confirm_reads``, a switch for this
    benchmark only: without it a pull may return another request's bytes).
    In rounds, taking turns: tiny pulls one after another; 1 MiB pulls one
    after another; and waves of many tiny pulls at once (each pull timed, as
    a request waiting for its KV would see it). One side-channel round trip
    (a lease request naming nothing, on a kept DEALER) is timed in the same
    rounds: the issue allows a tiny pull at most that much more. Beside each,
    the same request to a trio process that only echoes it (``zmq_echo``):
    the floor of a round trip between two trio processes over ZeroMQ here.
    """
    import zmq

    from trio_pd._core import _protocol as protocol
    from trio_pd._side_channel._zmq import TrioZmqSocket

    regions, blocks, block_bytes = 4, 8192, 4096
    big_blocks = (1 << 20) // (regions * block_bytes)  # 1 MiB per pull
    tiny, big, wave, waves = (200, 20, 64, 2) if quick else (2000, 200, 256, 4)
    out: Result = {"block_bytes": block_bytes, "regions": regions, "rounds": CONFIRM_ROUNDS}
    async with (
        open_prefill_worker(spec("confirm", regions, blocks, block_bytes)) as w,
        open_zmq_echo() as echo_endpoint,
    ):
        local = kv(regions, blocks, block_bytes)
        async with (
            trio_pd.open_connector("dec-on", local) as on,
            trio_pd.open_connector("dec-off", kv(regions, blocks, block_bytes)) as off,
        ):
            off._consumer.confirm_reads = False
            for name, conn in (("on", on), ("off", off)):
                await conn.pull(f"warm-{name}", [0], await w.expose(f"warm-{name}", [0], seed=0))
            remote = await w.expose("addr2", [1], seed=0)
            host, port = remote.host, remote.port
            counter = iter(range(1 << 30))

            def requests(n: int, size: int) -> list[tuple[str, list[int], int]]:
                out_ = []
                for _ in range(n):
                    i = next(counter)
                    start = 8 + (i * size) % (blocks - 8 - size)
                    out_.append((f"c{i}", list(range(start, start + size)), i))
                return out_

            async def sequential(conn: trio_pd.Connector, n: int, size: int) -> list[float]:
                reqs = requests(n, size)
                remotes = await w.expose_many(reqs)
                times = []
                for (rid, ids, _), remote_ in zip(reqs, remotes, strict=True):
                    started = time.perf_counter()
                    await conn.pull(rid, ids, remote_)
                    times.append(time.perf_counter() - started)
                return times

            async def waves_of(conn: trio_pd.Connector) -> list[float]:
                times: list[float] = []

                async def one(rid: str, ids: list[int], remote_: trio_pd.RemoteBlocks) -> None:
                    started = time.perf_counter()
                    await conn.pull(rid, ids, remote_)
                    times.append(time.perf_counter() - started)

                for _ in range(waves):
                    reqs = requests(wave, 2)
                    remotes = await w.expose_many(reqs)
                    async with trio.open_nursery() as nursery:
                        for (rid, ids, _), remote_ in zip(reqs, remotes, strict=True):
                            nursery.start_soon(one, rid, ids, remote_)
                return times

            lease = protocol.encode_lease_request("confirm", "bench", "bench#0", [])
            rtts: list[float] = []
            echo_rtts: list[float] = []
            tiny_on: list[float] = []
            tiny_off: list[float] = []
            big_on: list[float] = []
            big_off: list[float] = []
            wave_on: list[float] = []
            wave_off: list[float] = []
            with zmq.Context() as context:
                dealer = TrioZmqSocket(context.socket(zmq.DEALER))
                echo = TrioZmqSocket(context.socket(zmq.DEALER))
                async with dealer, echo:
                    dealer.zmq_socket.setsockopt(zmq.LINGER, 0)
                    dealer.zmq_socket.connect(protocol.endpoint(host, port))
                    echo.zmq_socket.setsockopt(zmq.LINGER, 0)
                    echo.zmq_socket.connect(echo_endpoint)
                    for round_ in range(CONFIRM_ROUNDS):
                        first, second = (on, off) if round_ % 2 == 0 else (off, on)
                        for conn in (first, second):
                            on_ = conn is on
                            (tiny_on if on_ else tiny_off).extend(
                                await sequential(conn, tiny // CONFIRM_ROUNDS, 2)
                            )
                            (big_on if on_ else big_off).extend(
                                await sequential(conn, big // CONFIRM_ROUNDS, big_blocks)
                            )
                            (wave_on if on_ else wave_off).extend(await waves_of(conn))
                        for _ in range(tiny // CONFIRM_ROUNDS // 4):
                            for socket, times in ((dealer, rtts), (echo, echo_rtts)):
                                started = time.perf_counter()
                                await socket.send_multipart([b"", lease])
                                await socket.receive_multipart()
                                times.append(time.perf_counter() - started)
            for conn in (on, off):
                assert conn.statistics().pulls_failed == 0
            assert off.statistics().pulls_exposure_ended == 0

    def p(values: list[float], q: float) -> float:
        return round(pct(values, q) * 1e3, 4)

    rtt = statistics.median(rtts)
    out["side_channel_rtt_ms_p50"] = round(rtt * 1e3, 4)
    out["echo_rtt_ms_p50"] = round(statistics.median(echo_rtts) * 1e3, 4)
    out["tiny"] = {
        "pulls": len(tiny_on),
        "confirmed_ms_p50": p(tiny_on, 50),
        "unconfirmed_ms_p50": p(tiny_off, 50),
        "extra_ms_p50": round((statistics.median(tiny_on) - statistics.median(tiny_off)) * 1e3, 4),
        "extra_in_rtts": round((statistics.median(tiny_on) - statistics.median(tiny_off)) / rtt, 2),
        "ratio": round(statistics.median(tiny_off) / statistics.median(tiny_on), 3),
    }
    out["mib"] = {
        "pulls": len(big_on),
        "confirmed_ms_p50": p(big_on, 50),
        "unconfirmed_ms_p50": p(big_off, 50),
        "ratio": round(statistics.median(big_off) / statistics.median(big_on), 3),
    }
    out["many_at_once"] = {
        "pulls": len(wave_on),
        "in_flight": wave,
        "confirmed_ms_p50": p(wave_on, 50),
        "confirmed_ms_p99": p(wave_on, 99),
        "unconfirmed_ms_p50": p(wave_off, 50),
        "unconfirmed_ms_p99": p(wave_off, 99),
        "p50_ratio": round(pct(wave_on, 50) / pct(wave_off, 50), 3),
        "p99_ratio": round(pct(wave_on, 99) / pct(wave_off, 99), 3),
    }
    return out


BENCHMARKS: dict[str, Callable[[bool], Awaitable[Result]]] = {
    "head_of_line": bench_head_of_line,
    "cold_fan_out": bench_cold_fan_out,
    "loop_stall": bench_loop_stall,
    "throughput": bench_throughput,
    "small_pulls": bench_small_pulls,
    "tp_throughput": bench_tp_throughput,
    "far_link": bench_far_link,
    "concurrent_pulls": bench_concurrent_pulls,
    "producer_cpu": bench_producer_cpu,
    "serve": bench_serve,
    "proxy_overhead": bench_proxy_overhead,
    "scale": bench_scale,
    "confirm": bench_confirm,
}


def machine() -> Result:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line),
        platform.processor(),
    )
    from importlib.metadata import version

    import nixl  # noqa: F401

    return {
        "date": datetime.date.today().isoformat(),
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("trio", "nixl", "pyzmq", "torch", "trio_pd")},
    }


async def run_all(names: list[str], quick: bool) -> Result:
    """Run ``names`` in order; a failing benchmark is recorded and the rest go on.

    Like a serving process after start-up, the benchmark process first moves
    its long-lived objects (torch, numpy, ...) out of the garbage collector's
    way (``gc.freeze()``): otherwise a full collection, about 20 ms here,
    lands in the middle of the measurements (benchmark 3 shows it).
    """
    gc.collect()
    gc.freeze()
    results: Result = {"machine": machine(), "quick": quick, "results": {}, "failed": {}}
    for name in names:
        started = time.perf_counter()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            result = await BENCHMARKS[name](quick)
        except Exception as exc:  # keep the other results; exit non-zero at the end
            results["failed"][name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} FAILED: {exc!r}", file=sys.stderr, flush=True)
            continue
        result["bench_seconds"] = round(time.perf_counter() - started, 1)
        results["results"][name] = result
        print(json.dumps(result, indent=1), file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--markdown", type=Path, help="write docs/performance.md here")
    args = parser.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    names = args.only or list(BENCHMARKS)
    results = trio.run(run_all, names, args.quick)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        from render_performance import render, replace_soak_section

        page = render(results)
        soak = args.markdown.parent / "soak.json"  # the soak's last result (nox -s soak)
        if soak.exists():
            page = replace_soak_section(page, json.loads(soak.read_text()))
        args.markdown.write_text(page)
    print(json.dumps(results["results"], indent=2))
    if results["failed"]:
        sys.exit(f"benchmarks failed: {', '.join(results['failed'])}")


if __name__ == "__main__":
    main()
