"""A trio serving frontend with a prefill engine, a decode engine and a P/D proxy.

The program of the tutorial (docs/tutorial.md). Both engines live in this
process, each with its own connector, KV cache and NIXL agent; the proxy
passes ``kv_transfer_params`` between them as JSON, as it would over HTTP.

Run it with ``python docs/examples/tutorial_frontend.py``.
"""

from __future__ import annotations

import json
import os

# NIXL logs every agent it creates at INFO level; keep the output short.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch
import trio

import trio_pd

REGIONS = 4  # KV tensors per engine, e.g. K and V of two layers
BLOCKS = 64  # blocks per tensor
BLOCK_SHAPE = (16, 64)  # 16 tokens x 64 values per block: 2 KiB of float16
TOKENS_PER_BLOCK = 16
REQUEST_DEADLINE = 10.0  # seconds, for one whole request (prefill + transfer)


def new_kv_cache() -> list[torch.Tensor]:
    """One engine's KV cache: ``REGIONS`` tensors, dimension 0 indexes blocks."""
    return [torch.zeros((BLOCKS, *BLOCK_SHAPE), dtype=torch.float16) for _ in range(REGIONS)]


def fake_kv_value(prompt: str, k: int, region: int) -> float:
    """What a model would compute for block ``k`` of ``prompt`` (a small exact number)."""
    return float((sum(map(ord, prompt)) + 7 * k + region) % 2048)


class BlockPool:
    """The engine's free KV blocks (a real engine's block manager does this)."""

    def __init__(self) -> None:
        self._free = list(range(BLOCKS))

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError("out of KV blocks")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class PrefillEngine:
    """Computes a prompt's KV cache and exposes it for one decoder to read."""

    def __init__(
        self, conn: trio_pd.Connector, kv: list[torch.Tensor], nursery: trio.Nursery
    ) -> None:
        self.conn = conn
        self.kv = kv
        self.pool = BlockPool()
        self.nursery = nursery  # where the "free when released" tasks run
        self.outcomes: dict[str, trio_pd.Released] = {}

    async def prefill(self, request_id: str, prompt: str) -> dict[str, object]:
        blocks = self.pool.allocate(1 + len(prompt) // TOKENS_PER_BLOCK)
        await trio.sleep(0.01)  # stands in for the forward pass
        for k, block in enumerate(blocks):
            for region, tensor in enumerate(self.kv):
                tensor[block].fill_(fake_kv_value(prompt, k, region))
        remote = self.conn.expose(request_id, blocks)
        self.nursery.start_soon(self._free_when_released, request_id, blocks)
        return remote.to_kv_transfer_params()

    async def _free_when_released(self, request_id: str, blocks: list[int]) -> None:
        # READ: the decoder has the data. ABANDONED: the decoder said it will
        # not read them. EXPIRED: the lease ran out (config.lease_initial, 30 s,
        # if no decoder held it; never later than config.abort_timeout).
        # Whichever it is, the blocks may now be reused.
        self.outcomes[request_id] = await self.conn.wait_released(request_id)
        self.pool.free(blocks)


class DecodeEngine:
    """Pulls a request's KV blocks from the prefill engine named in its params."""

    def __init__(
        self, conn: trio_pd.Connector, kv: list[torch.Tensor], nursery: trio.Nursery
    ) -> None:
        self.conn = conn
        self.kv = kv
        self.pool = BlockPool()
        self.nursery = nursery  # where the "free when settled" tasks run

    async def decode(self, request_id: str, prompt: str, params: dict[str, object]) -> str:
        remote = trio_pd.RemoteBlocks.from_kv_transfer_params(params)
        blocks = self.pool.allocate(len(remote.block_ids))
        try:
            # hold: if the request ends without its pull (cancelled, failed),
            # an abandon tells the prefill engine to free its blocks (sent by
            # the connector's abandon task, milliseconds later).
            async with self.conn.hold(remote):
                result = await self.conn.pull(request_id, blocks, remote)
            for k, block in enumerate(blocks):
                for region, tensor in enumerate(self.kv):
                    assert torch.all(tensor[block] == fake_kv_value(prompt, k, region))
            return f"{len(blocks)} blocks, {result.bytes} bytes, verified"
        finally:
            # A pull that was cancelled or failed may leave a transfer NIXL
            # could not stop, still writing these blocks: back to the pool
            # only once it ended (at once, almost always).
            self.nursery.start_soon(self._free_when_settled, blocks)

    async def _free_when_settled(self, blocks: list[int]) -> None:
        await self.conn.wait_settled(blocks)
        self.pool.free(blocks)


async def handle_request(
    request_id: str, prompt: str, prefill: PrefillEngine, decode: DecodeEngine
) -> str:
    """What a P/D proxy does for one request: its errors become its answer."""
    try:
        with trio.fail_after(REQUEST_DEADLINE):  # the caller owns the deadline
            params = await prefill.prefill(request_id, prompt)
            wire = json.dumps(params)  # in production: the prefill server's HTTP response
            return await decode.decode(request_id, prompt, json.loads(wire))
    except trio.TooSlowError:  # caught here, in this request's task: see the tutorial
        return f"failed: not done within {REQUEST_DEADLINE} s"
    except trio_pd.HandshakeError as exc:
        return f"failed: cannot reach {exc.engine_id}: {exc.reason}"
    except trio_pd.TransferError as exc:
        return f"failed: blocks {exc.failed_block_ids} hold no data: {exc.reason}"


PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about structured concurrency.",
    "Explain KV caches to a five-year-old, in three short sentences please.",
    "What is 2 + 2?",
    "Summarise the plot of Hamlet in one paragraph, without spoilers.",
    "Translate 'nursery' into French.",
    "List three uses of a cancel scope.",
    "Name a prime number larger than one hundred.",
]


async def main() -> None:
    prefill_kv, decode_kv = new_kv_cache(), new_kv_cache()
    async with (
        trio_pd.open_connector("prefill-0", prefill_kv) as prefill_conn,
        trio.open_nursery() as prefill_tasks,
        trio_pd.open_connector("decode-0", decode_kv) as decode_conn,
        trio.open_nursery() as decode_tasks,
    ):
        prefill = PrefillEngine(prefill_conn, prefill_kv, prefill_tasks)
        decode = DecodeEngine(decode_conn, decode_kv, decode_tasks)
        results: dict[str, str] = {}

        async def serve(request_id: str, prompt: str) -> None:
            results[request_id] = await handle_request(request_id, prompt, prefill, decode)

        async with trio.open_nursery() as requests:
            for n, prompt in enumerate(PROMPTS):
                requests.start_soon(serve, f"req-{n}", prompt)

        for request_id in sorted(results):
            print(f"{request_id}: {results[request_id]}")
        stats = decode_conn.statistics()
        print(
            f"decode: {stats.handshakes_started} handshake, {stats.pulls_succeeded} pulls, "
            f"{stats.bytes_pulled} bytes"
        )
    # Both connectors are closed here; the prefill tasks finished before that.
    released = sum(o is trio_pd.Released.READ for o in prefill.outcomes.values())
    print(f"prefill: {released} of {len(PROMPTS)} exposures released after the read")


if __name__ == "__main__":
    trio.run(main)
