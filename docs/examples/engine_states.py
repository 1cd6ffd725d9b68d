"""Watch a remote engine's state machine through the public API.

A decode connector keeps one record per prefill engine; ``engine_state``
says where it stands. The prefill engines here run on the in-memory
backend of ``trio_pd.testing`` (a real side channel, no UCX), so a failing
agent load and a restart are a line each.

Run it with ``python docs/examples/engine_states.py``.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric, free_port_range

CONFIG = trio_pd.ConnectorConfig(
    handshake_timeout=1.0, backoff_initial=0.5, backoff_max=1.0, backoff_jitter=0.0
)


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


async def main() -> None:
    fabric = MemoryFabric()
    port = free_port_range(1)

    def prefill() -> AbstractAsyncContextManager[trio_pd.Connector]:  # the engine
        return trio_pd.open_connector(
            "prefill-0", kv_cache(), port=port, config=CONFIG, backend=fabric.backend
        )

    async with trio_pd.open_connector(
        "decode-0", kv_cache(), config=CONFIG, backend=fabric.backend
    ) as decode:

        def show(what: str) -> None:
            print(f"{what:<44} -> {decode.engine_state('prefill-0').name}")

        async def pull(request_id: str, remote: trio_pd.RemoteBlocks) -> str:
            try:
                await decode.pull(request_id, [0, 1], remote)
            except (trio_pd.HandshakeError, trio_pd.TransferError) as exc:
                return type(exc).__name__
            return "pulled"

        async with prefill() as first:
            show("never pulled from")
            fabric.faults("prefill-0").load_error = "bad metadata"
            show(f"a pull, the agent load fails: {await pull('r1', first.expose('r1', [3, 4]))}")
            show(f"a pull during the backoff: {await pull('r2', first.expose('r2', [3, 4]))}")
            fabric.faults("prefill-0").load_error = None
            await trio.sleep(CONFIG.backoff_initial)
            show(f"a pull after the backoff: {await pull('r3', first.expose('r3', [3, 4]))}")
            stale = first.expose("r4", [5, 6])  # exposed, never read: the engine restarts

        async with prefill() as second:  # the same engine, a new incarnation
            fresh = second.expose("r5", [3, 4])
            show(f"a pull of the new incarnation: {await pull('r5', fresh)}")
            show(f"a pull of the old incarnation: {await pull('r4', stale)}")
        show(f"its engine gone, a pull: {await pull('r6', fresh)}")
        stats = decode.statistics()
        print(
            f"handshakes started {stats.handshakes_started}, failed {stats.handshakes_failed}, "
            f"rejected in backoff {stats.pulls_rejected_in_backoff}, "
            f"pulls succeeded {stats.pulls_succeeded}"
        )
    print(f"{'after close':<44} -> {decode.engine_state('prefill-0').name}")


if __name__ == "__main__":
    trio.run(main)
