"""Engines with several ranks: equal and heterogeneous tensor parallelism.

Every head slice is checked byte for byte against what its prefill rank holds
(``fill_heads`` / ``mismatched_heads``). The data plane is real NIXL with the
prefill ranks in their own processes, and also the in-memory backend (fast,
for the combinations and the fault cases).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch
import trio
import trio.testing

import trio_pd
from trio_pd.testing import (
    MemoryFabric,
    WorkerSpec,
    fill_heads,
    free_port_range,
    mismatched_heads,
    open_prefill_workers,
)

pytest_plugins = ["trio_pd.testing.fixtures"]

TOTAL_HEADS = 4
HEAD_SHAPE = (8,)  # 8 float16 per head: 16 bytes
REGIONS, BLOCKS = 2, 16
SRC, DST = [3, 9, 0, 14], [5, 1, 12, 2]
COMBINATIONS = [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2)]  # (prefill TP, decode TP)
CONFIG = trio_pd.ConnectorConfig(handshake_timeout=5.0, transfer_timeout=10.0, abort_timeout=30.0)


def kv(tp_size: int, heads: int = TOTAL_HEADS) -> list[torch.Tensor]:
    """One rank's KV cache: (blocks, heads on this rank, *HEAD_SHAPE) per region."""
    return [
        torch.zeros((BLOCKS, heads // tp_size, *HEAD_SHAPE), dtype=torch.float16)
        for _ in range(REGIONS)
    ]


@asynccontextmanager
async def ranks(
    engine_id: str,
    tp_size: int,
    *,
    fabric: MemoryFabric | None = None,
    config: trio_pd.ConnectorConfig = CONFIG,
    heads: int = TOTAL_HEADS,
) -> AsyncIterator[list[tuple[trio_pd.Connector, list[torch.Tensor]]]]:
    """``tp_size`` connectors of one engine in this process, ranks 0 .. tp_size-1
    (on ``fabric``'s backend and side channel if given, else NIXL and ZeroMQ)."""
    base = free_port_range(tp_size)
    async with AsyncExitStack() as stack:
        out = []
        for rank in range(tp_size):
            caches = kv(tp_size, heads)
            conn = await stack.enter_async_context(
                trio_pd.open_connector(
                    engine_id,
                    caches,
                    port=base if tp_size > 1 else 0,
                    config=config,
                    tp_rank=rank,
                    tp_size=tp_size,
                    backend=None if fabric is None else fabric.backend,
                    side_channel=None if fabric is None else fabric.side_channel,
                )
            )
            out.append((conn, caches))
        yield out


async def pull_everywhere(
    decoders: list[tuple[trio_pd.Connector, list[torch.Tensor]]],
    remote: trio_pd.RemoteBlocks,
    request_id: str,
    seed: int,
) -> None:
    """Every decode rank pulls the request at once; each checks its heads."""
    async with trio.open_nursery() as nursery:
        for conn, _ in decoders:
            nursery.start_soon(conn.pull, request_id, DST, remote)
    for rank, (_, caches) in enumerate(decoders):
        assert mismatched_heads(caches, rank, DST, SRC, seed) == [], f"decode rank {rank}"


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), COMBINATIONS)
async def test_every_head_lands_in_its_decode_rank_in_memory(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    with trio.fail_after(20):
        async with (
            ranks("p", prefill_tp, fabric=memory_fabric) as prefill,
            ranks("d", decode_tp, fabric=memory_fabric) as decode,
        ):
            exposed = []
            for rank, (conn, caches) in enumerate(prefill):
                fill_heads(caches, rank, SRC, seed=5)
                exposed.append(conn.expose("r", SRC))
            # every rank reports the base port and the TP size: rank 0's will do
            assert {(e.port, e.tp_size) for e in exposed} == {(exposed[0].port, prefill_tp)}
            await pull_everywhere(decode, exposed[0], "r", seed=5)
            for conn, _ in prefill:  # each prefill rank heard from all its readers
                assert await conn.wait_released("r") is trio_pd.Released.READ
            stats = [conn.statistics() for conn, _ in decode]
            assert sum(s.handshakes_succeeded for s in stats) == max(prefill_tp, decode_tp)


async def test_a_prefill_rank_is_released_only_when_all_its_readers_notified(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Decode TP 2 reads prefill TP 1: both decode ranks read the one prefill
    # rank; one notification is half of the decode engine.
    config = trio_pd.ConnectorConfig(abort_timeout=0.5)
    with trio.fail_after(20):
        async with (
            ranks("p", 1, fabric=memory_fabric, config=config) as prefill,
            ranks("d", 2, fabric=memory_fabric) as decode,
        ):
            [(producer, _)] = prefill
            first = producer.expose("full", [1])
            async with trio.open_nursery() as nursery:
                for conn, _ in decode:
                    nursery.start_soon(conn.pull, "full", [], first)  # notify-only
            assert await producer.wait_released("full") is trio_pd.Released.READ
            half = producer.expose("half", [2])
            await decode[0][0].pull("half", [], half)  # only one of the two ranks
            assert await producer.wait_released("half") is trio_pd.Released.EXPIRED


@pytest.mark.parametrize(
    ("decode_tp", "decode_heads", "match"),
    [
        (3, 3 * 2, "tensor-parallel sizes 2 .remote. and 3 .local.: one must divide the other"),
        (1, 2 * TOTAL_HEADS, "total KV heads differ: remote 2 x TP 2, local 8 x TP 1"),
    ],
)
async def test_engines_that_do_not_pair_fail_before_any_transfer(
    memory_fabric: MemoryFabric,
    autojump_clock: trio.testing.MockClock,
    decode_tp: int,
    decode_heads: int,
    match: str,
) -> None:
    with trio.fail_after(20):
        async with (
            ranks("p", 2, fabric=memory_fabric) as prefill,
            ranks("d", decode_tp, fabric=memory_fabric, heads=decode_heads) as decode,
        ):
            remote = prefill[0][0].expose("r", SRC)
            conn, caches = decode[0]
            with pytest.raises(trio_pd.IncompatibleEngineError, match=match):
                await conn.pull("r", DST, remote)
            assert memory_fabric.reads == 0
            assert not any(t.any() for t in caches)


# ---- real NIXL, prefill ranks in their own processes ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), COMBINATIONS)
async def test_every_head_lands_in_its_decode_rank_across_processes(
    prefill_tp: int, decode_tp: int
) -> None:
    base = free_port_range(prefill_tp)
    specs = [
        WorkerSpec(
            "prefill",
            regions=REGIONS,
            blocks=BLOCKS,
            block_shape=(TOTAL_HEADS // prefill_tp, *HEAD_SHAPE),
            port=base,
            tp_rank=rank,
            tp_size=prefill_tp,
            payload="heads",
        )
        for rank in range(prefill_tp)
    ]
    with trio.fail_after(120):
        async with open_prefill_workers(specs) as workers, ranks("decode", decode_tp) as decode:
            exposed = [await w.expose("r", SRC, seed=9) for w in workers]
            await pull_everywhere(decode, exposed[0], "r", seed=9)
            for worker in workers:
                assert await worker.wait_released("r") is trio_pd.Released.READ


@pytest.mark.slow
async def test_a_killed_prefill_rank_fails_only_the_pulls_that_read_it() -> None:
    base = free_port_range(2)
    specs = [
        WorkerSpec(
            "prefill",
            regions=REGIONS,
            blocks=BLOCKS,
            block_shape=(TOTAL_HEADS // 2, *HEAD_SHAPE),
            port=base,
            tp_rank=rank,
            tp_size=2,
            payload="heads",
        )
        for rank in range(2)
    ]
    with trio.fail_after(120):
        async with (
            open_prefill_workers(specs) as workers,
            ranks("decode", 2) as decode,
            ranks("single", 1) as single,
        ):
            exposed = [await w.expose("warm", SRC, seed=1) for w in workers]
            await pull_everywhere(decode, exposed[0], "warm", seed=1)
            exposed = [await w.expose("next", SRC, seed=2) for w in workers]
            workers[1].kill()
            await workers[1].process.wait()
            # decode rank 0 reads prefill rank 0 only: unaffected
            await decode[0][0].pull("next", DST, exposed[0])
            assert mismatched_heads(decode[0][1], 0, DST, SRC, 2) == []
            # decode rank 1 reads prefill rank 1: one TransferError naming it
            with pytest.raises(trio_pd.TransferError) as info:
                await decode[1][0].pull("next", DST, exposed[0])
            assert "remote rank 1" in info.value.reason
            assert info.value.failed_block_ids == tuple(DST)
            # a TP-1 decoder reads both ranks: it fails too, naming rank 1
            with pytest.raises((trio_pd.TransferError, trio_pd.HandshakeError)) as both:
                await single[0][0].pull("next", DST, exposed[0])
            assert "rank 1" in str(both.value)
