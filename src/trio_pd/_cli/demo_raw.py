"""The demo's comparison with raw NIXL, measured in the same run (after it).

The decoder's connector was opened with a :class:`~trio_pd.testing.CapturedBackends`
factory, so its NIXL agent and prepared descriptor lists are at hand: the
same pull is made through trio_pd and as one READ with NIXL directly, on the
same agent, between the same two processes, of the same blocks.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import trio

from trio_pd._connector import Connector
from trio_pd._core._protocol import encode_notification
from trio_pd._transfer._nixl import NixlBackend

if TYPE_CHECKING:
    from trio_pd._harness._prefill_worker import PrefillWorker

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
