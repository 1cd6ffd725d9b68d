"""Exercise: a network partition between a prefill host and its decoder (docs/exercises.md).

Needs root: the prefill engine runs on a *test host*, a network namespace
joined to this one by a veth link (``trio_pd.testing.open_test_hosts``), and
the decoder in a process of its own here; UCX is forced to TCP so that the
data plane crosses the link. The link is cut before the first handshake, then
restored. Real NIXL, real processes: it takes several seconds.

Run it (as root) with ``python docs/exercises/partition.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import trio

from trio_pd.testing import WorkerError, WorkerSpec, open_prefill_worker, open_test_hosts

CONFIG = {"handshake_timeout": 2.0, "backoff_initial": 0.2, "backoff_max": 0.4}
TCP = {"UCX_TLS": "tcp"}
SPEC = {"regions": 4, "blocks": 64, "block_shape": (16384,), "dtype": "float16"}


async def main() -> None:
    async with open_test_hosts(1) as [host]:
        far = WorkerSpec("far", host=host.address, netns=host.netns, env=TCP, config=CONFIG, **SPEC)
        near = WorkerSpec("decoder", env=TCP, config=CONFIG, **SPEC)
        async with open_prefill_worker(far) as prefill, open_prefill_worker(near) as decoder:
            first = await prefill.expose("first", [1, 2], seed=5)
            await host.cut()  # the partition: nothing crosses the link
            started = trio.current_time()
            try:
                await decoder.pull("first", [1, 2], first, seed=5)
            except WorkerError as exc:  # the decoder's error, reported from its process
                within = trio.current_time() - started < CONFIG["handshake_timeout"] + 1.0
                print(f"during the partition: {exc.error_type}, within the deadline: {within}")
                print(f"  reason mentions no reply: {'no reply' in str(exc)}")
            await host.restore()
            await trio.sleep(CONFIG["backoff_max"])  # the backoff after the failed handshake
            again = await prefill.expose("again", [3, 4], seed=6)
            result = await decoder.pull("again", [3, 4], again, seed=6)
            print(f"after the link is back: every byte verified: {result['mismatched'] == []}")


if __name__ == "__main__":
    trio.run(main)
