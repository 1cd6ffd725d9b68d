"""``trio-pd`` / ``python -m trio_pd``: the command line.

``trio-pd keygen`` prints a new CURVE key pair for side-channel authentication.

``trio-pd demo`` runs a small real P/D deployment on this machine: prefill
engines in their own processes, a decode engine in this one, and a driver that
plays the P/D proxy. Every pulled byte is verified; the exit status is
non-zero if any request failed or any byte differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ._auth import generate_keypair
from ._connector import open_connector
from ._payload import mismatched_blocks
from ._prefill_worker import PrefillWorker, WorkerSpec, open_prefill_workers


@attrs.define
class _Outcome:
    ok: int = 0
    failed: int = 0
    corrupt: int = 0
    latencies: list[float] = attrs.field(factory=list)
    bytes: int = 0


async def _demo(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    block_shape = (args.block_bytes // 2,)
    specs = [
        WorkerSpec(
            f"prefill-{i}",
            regions=args.regions,
            blocks=args.blocks,
            block_shape=block_shape,
            dtype="float16",
        )
        for i in range(args.prefill_engines)
    ]
    rng = random.Random(args.seed)
    local = [
        torch.zeros((args.blocks, *block_shape), dtype=torch.float16) for _ in range(args.regions)
    ]
    outcome = _Outcome()
    free_local = list(range(args.blocks))
    rng.shuffle(free_local)
    capacity = trio.Semaphore(args.blocks)  # local blocks in use by in-flight requests
    started = time.perf_counter()

    async def one_request(n: int, worker: PrefillWorker) -> None:
        prompt_blocks = rng.randint(1, args.max_prompt_blocks)
        for _ in range(prompt_blocks):
            await capacity.acquire()
        local_ids = [free_local.pop() for _ in range(prompt_blocks)]
        try:
            # The prefill engine picks its own blocks; here, a fresh random range.
            first = rng.randrange(0, args.blocks - prompt_blocks + 1)
            remote_ids = list(range(first, first + prompt_blocks))
            seed = rng.getrandbits(32)
            try:
                remote = await worker.expose(f"req-{n}", remote_ids, seed)
                params = remote.to_kv_transfer_params()  # what the proxy forwards
                result = await decoder.pull(
                    f"req-{n}", local_ids, type(remote).from_kv_transfer_params(params)
                )
            except Exception as exc:
                outcome.failed += 1
                print(f"request req-{n} failed: {exc}", file=sys.stderr)
                return
            if mismatched_blocks(local, local_ids, seed):
                outcome.corrupt += 1
            outcome.ok += 1
            outcome.bytes += result.bytes
            outcome.latencies.append(result.seconds)
            await worker.wait_released(f"req-{n}")
        finally:
            free_local.extend(local_ids)
            for _ in local_ids:
                capacity.release()

    async with (
        open_prefill_workers(specs) as workers,
        open_connector("decode-0", local) as decoder,
    ):
        ready_at = time.perf_counter()
        # One request per prefill engine at a time: exposures on one engine
        # must not overwrite each other's blocks.
        async with trio.open_nursery() as nursery:
            for index, worker in enumerate(workers):
                numbers = range(index, args.requests, len(workers))

                async def drive(worker: PrefillWorker = worker, numbers: range = numbers) -> None:
                    for n in numbers:
                        await one_request(n, worker)

                nursery.start_soon(drive)
        stats = decoder.statistics()
    elapsed = time.perf_counter() - ready_at
    latencies = sorted(outcome.latencies) or [0.0]
    return {
        "requests_ok": outcome.ok,
        "requests_failed": outcome.failed,
        "requests_corrupt": outcome.corrupt,
        "handshakes": stats.handshakes_succeeded,
        "bytes_pulled": outcome.bytes,
        "pull_p50_ms": 1e3 * latencies[len(latencies) // 2],
        "pull_max_ms": 1e3 * latencies[-1],
        "gb_per_s": outcome.bytes / elapsed / 1e9 if elapsed else 0.0,
        "startup_s": ready_at - started,
        "run_s": elapsed,
        "verified": outcome.corrupt == 0 and outcome.failed == 0,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio-pd")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a small verified P/D deployment")
    demo.add_argument("--prefill-engines", type=int, default=2)
    demo.add_argument("--requests", type=int, default=32)
    demo.add_argument("--regions", type=int, default=8)
    demo.add_argument("--blocks", type=int, default=256)
    demo.add_argument("--block-bytes", type=int, default=16384)
    demo.add_argument("--max-prompt-blocks", type=int, default=32)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    commands.add_parser(
        "keygen",
        help="print a new CURVE key pair (JSON) for ConnectorConfig(auth=CurveAuth(...))",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "keygen":
        public, secret = generate_keypair()
        print(json.dumps({"public_key": public, "secret_key": secret}))
        return
    # NIXL logs every agent creation at INFO on stdout; keep the summary readable
    # (prefill workers inherit this).
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    summary = trio.run(_demo, args)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(len(k) for k in summary)
        for key, value in summary.items():
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            print(f"{key:<{width}}  {shown}")
    sys.exit(0 if summary["verified"] else 1)


if __name__ == "__main__":
    main()
