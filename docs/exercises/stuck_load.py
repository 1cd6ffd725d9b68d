"""Exercise: a remote-agent load that never returns (docs/exercises.md).

Three prefill engines: loading engine A's agent hangs
(``MemoryFaults.hang_loads``); B is healthy but new to the decoder; C is
healthy and already handshaked. A pull from A starts; 0.1 s later, pulls
from B and C. In-memory data plane (``trio_pd.testing.MemoryFabric``).

Run it with ``python docs/exercises/stuck_load.py``.
"""

from __future__ import annotations

import torch
import trio

import trio_pd
from trio_pd.testing import MemoryFabric

CONFIG = trio_pd.ConnectorConfig(handshake_timeout=0.5)  # default 5 s


def kv_cache() -> list[torch.Tensor]:
    return [torch.zeros((16, 256), dtype=torch.uint8) for _ in range(2)]


async def main() -> None:
    fabric = MemoryFabric()
    outcomes: dict[str, str] = {}

    async with (
        trio_pd.open_connector("A", kv_cache(), backend=fabric.backend) as a,
        trio_pd.open_connector("B", kv_cache(), backend=fabric.backend) as b,
        trio_pd.open_connector("C", kv_cache(), backend=fabric.backend) as c,
        trio_pd.open_connector("decode", kv_cache(), config=CONFIG, backend=fabric.backend) as d,
    ):
        await d.pull("warm-up", [0], c.expose("warm-up", [0]))  # C's handshake, done
        fabric.faults("A").hang_loads = True
        a_started = trio.current_time()
        a_deadline = a_started + CONFIG.handshake_timeout

        async def pull(name: str, producer: trio_pd.Connector, block: int) -> None:
            started = trio.current_time()
            try:
                await d.pull(name, [block], producer.expose(name, [block]))
            except trio_pd.HandshakeError as exc:
                outcome = f"HandshakeError: {exc.reason}"
            else:
                outcome = "pulled"
            ended = trio.current_time()
            if ended - started < 0.1:
                when = "at once"
            else:
                when = "after A's deadline" if ended >= a_deadline else "before A's deadline"
            outcomes[name] = f"{outcome}, {when}"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull, "from-A", a, 1)
            await trio.sleep(0.1)
            nursery.start_soon(pull, "from-B", b, 2)
            nursery.start_soon(pull, "from-C", c, 3)

        for name, outcome in sorted(outcomes.items()):
            print(f"{name}: {outcome}")
        for engine in "ABC":
            print(f"engine {engine}: {d.engine_state(engine).name}")
        stats = d.statistics()
        print(f"handshake failures by cause: {dict(stats.handshake_failures_by_cause)}")


if __name__ == "__main__":
    trio.run(main)
