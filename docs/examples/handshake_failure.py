"""What pulls see when a prefill engine cannot be reached.

Three pulls for the same dead engine share one handshake attempt and get the
same error; the engine then goes into backoff, and the next pull fails at once
without touching the network. A pull that the caller cancels while it waits
does not cancel the handshake for the others.

Run it with ``python docs/examples/handshake_failure.py``.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch
import trio

import trio_pd
from trio_pd.testing import free_port_range


def closed_port() -> int:
    """A local TCP port with nothing listening on it: drawn below the kernel's
    ephemeral range (not one that a socket bound to port 0, here or in any
    other process, could be given next)."""
    return free_port_range(1)


async def main() -> None:
    # trio_pd logs to the "trio_pd" logger: failed handshakes are warnings.
    logging.basicConfig(level=logging.WARNING, format="log: %(name)s: %(message)s")
    config = trio_pd.ConnectorConfig(handshake_timeout=0.5, backoff_initial=5.0)
    kv = [torch.zeros((8, 1024), dtype=torch.uint8)]
    # kv_transfer_params as a proxy would pass them, naming a dead engine.
    remote = trio_pd.RemoteBlocks("prefill-9", "127.0.0.1", closed_port(), [0, 1], "r")

    async with trio_pd.open_connector("decode-0", kv, config=config) as conn:
        errors: dict[str, trio_pd.HandshakeError] = {}

        async def pull(request_id: str) -> None:
            try:
                await conn.pull(request_id, [2, 3], remote)
            except trio_pd.HandshakeError as exc:
                errors[request_id] = exc

        async def impatient_pull() -> None:
            with trio.move_on_after(0.1) as scope:  # the caller's own deadline
                await conn.pull("impatient", [4, 5], remote)
            print(f"impatient: gave up after 0.1 s (cancelled: {scope.cancelled_caught})")

        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(pull, f"waiter-{n}")
            nursery.start_soon(impatient_pull)

        for request_id, error in sorted(errors.items()):
            print(f"{request_id}: {type(error).__name__}: {error.reason}")
        print("engine state:", conn.engine_state("prefill-9").name)

        # In backoff: the same error again, at once, with no network traffic.
        with trio.fail_after(0.05):
            try:
                await conn.pull("late", [6, 7], remote)
            except trio_pd.HandshakeError as exc:
                same = exc.reason == errors["waiter-0"].reason
                print(f"late: failed at once, same reason: {same}")

        stats = conn.statistics()
        print(
            f"handshakes started {stats.handshakes_started}, failed {stats.handshakes_failed} "
            f"{dict(stats.handshake_failures_by_cause)}, "
            f"rejected in backoff {stats.pulls_rejected_in_backoff}"
        )


if __name__ == "__main__":
    trio.run(main)
