"""One decoder of the scale benchmark, in a fresh process (``pd_bench.py`` starts it).

    python scale_decoder.py < job.json > result.json

The job: ``mode`` (``trio_pd``, ``one load per thread call`` or ``raw NIXL``),
``storm`` (the kv_transfer_params of one notify-only exposure per engine),
``producer_pids`` (their CPU is measured around the storm) and, optionally,
``reads`` (one 1-block exposure per engine, seeded with its index) and
``default_handshake_timeout`` (count the handshakes that fail with the
default ``handshake_timeout`` instead of giving them 120 s).

A fresh process per decoder, so that its memory growth is its own: in the
benchmark process, a decoder reuses the heap that earlier ones freed, and its
growth says more about what ran before than about it.

* ``trio_pd`` / ``one load per thread call``: a connector pulls every ``storm``
  exposure at once (notify-only pulls: the handshake, then one notification);
  the time until all are done is the time until every engine is ``READY``.
  Then, with ``reads``, a 1-block pull from every engine at once, bytes checked.
* ``raw NIXL``: the same engines' metadata fetched first (not timed), then one
  plain thread loads every agent with NIXL directly -- ``add_remote_agent``,
  ``prep_xfer_dlist``, ``make_connection``, as trio_pd's handshake thread does
  -- and sends each the notification the storm's pull would.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from typing import Any

import torch
import trio
from comparison import OneLoadPerCall

import trio_pd
from trio_pd._core import _protocol as protocol
from trio_pd._side_channel._fetch import fetch_engine_metadata
from trio_pd._side_channel._zmq_channel import ZmqSideChannel
from trio_pd.testing import CapturedBackends, mismatched_blocks


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def producers_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of the producer processes so far."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def trio_pd_storm(job: dict[str, Any]) -> dict[str, Any]:
    storm = [trio_pd.RemoteBlocks.from_kv_transfer_params(p) for p in job["storm"]]
    reads = [trio_pd.RemoteBlocks.from_kv_transfer_params(p) for p in job.get("reads", [])]
    engines = len(storm)
    local = [torch.zeros((max(engines, 1), 512), dtype=torch.float16) for _ in range(2)]
    backend = CapturedBackends(OneLoadPerCall) if job["mode"] != "trio_pd" else None
    # A handshake's deadline covers its wait in the load queue (loads are
    # serialized): 1024 cold engines at once queue for seconds, so this
    # measurement gives them a deadline that fits the queue.
    config = trio_pd.ConnectorConfig(handshake_timeout=120.0)
    if job.get("default_handshake_timeout"):  # (how many make it with the default)
        config = trio_pd.ConnectorConfig()
    out: dict[str, Any] = {"failed": 0}

    async def pull(n: int, remote: trio_pd.RemoteBlocks) -> None:
        try:
            await d.pull(f"h{n}", [], remote)
        except trio_pd.HandshakeError:
            if not job.get("default_handshake_timeout"):
                raise
            out["failed"] += 1

    async with trio_pd.open_connector("dec", local, config=config, backend=backend) as d:
        gc.collect()
        before, cpu = rss_bytes(), cpu_seconds()
        producers = producers_cpu_seconds(job["producer_pids"])
        started = trio.current_time()
        async with trio.open_nursery() as pulls:
            for n, remote in enumerate(storm):
                pulls.start_soon(pull, n, remote)
        out["seconds"] = trio.current_time() - started
        out["rss_bytes"] = rss_bytes() - before
        out["cpu_seconds"] = cpu_seconds() - cpu
        out["producers_cpu_seconds"] = producers_cpu_seconds(job["producer_pids"]) - producers
        assert d.statistics().engines_ready == engines - out["failed"], d.statistics()
        if reads:
            started = trio.current_time()
            async with trio.open_nursery() as pulls:
                for n, remote in enumerate(reads):
                    pulls.start_soon(d.pull, f"r{n}", [n], remote)
            out["reads_seconds"] = trio.current_time() - started
            for n in range(len(reads)):
                assert mismatched_blocks(local, [n], n) == [], n
    return out


async def raw_nixl(job: dict[str, Any]) -> dict[str, Any]:
    storm = [trio_pd.RemoteBlocks.from_kv_transfer_params(p) for p in job["storm"]]
    local = [torch.zeros((16, 512), dtype=torch.float16) for _ in range(2)]
    captured = CapturedBackends()
    async with trio_pd.open_connector("raw", local, backend=captured) as conn:
        config = trio_pd.ConnectorConfig()
        compat = protocol.compatibility_hash(config.compatibility_key)
        fetched: list[Any] = []
        side_channel = ZmqSideChannel(config)
        try:
            for remote in storm:
                metadata, layout = await fetch_engine_metadata(
                    side_channel,
                    remote.engine_id,
                    remote.host,
                    remote.port,
                    tp_rank=0,
                    tp_size=1,
                    consumer_engine_id="raw",
                    local_layout=conn.layout,
                    local_tp=1,
                    compat_hash=compat,
                    config=config,
                    deadline=trio.current_time() + 60,
                )
                notification = protocol.encode_notification(remote.request_id)
                fetched.append((metadata, layout, notification))
        finally:
            side_channel.close()
        gc.collect()
        before, cpu = rss_bytes(), cpu_seconds()
        producers = producers_cpu_seconds(job["producer_pids"])
        seconds = await trio.to_thread.run_sync(load_all, captured.backends[0].agent, fetched)
        return {
            "seconds": seconds,
            "rss_bytes": rss_bytes() - before,
            "cpu_seconds": cpu_seconds() - cpu,
            "producers_cpu_seconds": producers_cpu_seconds(job["producer_pids"]) - producers,
        }


def load_all(agent: Any, fetched: list[Any]) -> float:
    """Load every agent with NIXL directly and notify it once, one after the
    other in this plain thread; return the seconds taken (then unload them)."""
    loaded = []
    started = time.perf_counter()
    for metadata, layout, notification in fetched:
        name = agent.add_remote_agent(metadata.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        dlist = agent.prep_xfer_dlist(name, layout.strided_descriptors(), layout.mem_type)
        loaded.append((name, dlist))
        agent.make_connection(name)
        agent.send_notif(name, notification)
    seconds = time.perf_counter() - started
    for name, dlist in loaded:
        dlist.release()
        agent.remove_remote_agent(name)
    return seconds


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    run = raw_nixl if job["mode"] == "raw NIXL" else trio_pd_storm
    print(json.dumps(trio.run(run, job)))


if __name__ == "__main__":
    main()
