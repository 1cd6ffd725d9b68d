"""trio_pd.testing: tools for testing code that uses trio_pd (like ``trio.testing``).

* :class:`MemoryFabric`, :class:`MemoryBackend`, :class:`MemoryFaults`: an
  in-memory data plane and control plane for ``open_connector(...,
  backend=fabric.backend, side_channel=fabric.side_channel)``, with
  injectable faults: slow, failing or endless reads and agent loads, a cut
  data plane; side-channel requests (metadata, heartbeats, abandons,
  confirmations) that are slow, never answered, refused or cannot reach
  their producer (a partition); a producer restarted at the same address
  is a new connector on the same port. The connector logic is the real one
  (the producer's listener answers every request, the consumer's checks,
  deadlines and diagnoses are its own); only the transports are replaced.
  No UCX, no sockets, no threads: nothing waits but on trio's clock, so
  tests run under ``autojump_clock`` (``trio.testing.MockClock``) in
  milliseconds, timeouts, backoff and leases included. With
  ``backend=fabric.backend`` alone the side channel is real ZeroMQ (then
  give a mock clock an autojump threshold, so that its sockets get time to
  answer). CURVE is ZeroMQ's alone: test it on the real side channel.
* :func:`open_prefill_worker`, :func:`open_prefill_workers`,
  :class:`PrefillWorker`, :class:`WorkerSpec`: a real prefill engine (real
  NIXL agent, real side channel) in its own process, driven over pipes;
  :meth:`PrefillWorker.kill` injects a crash.
* :func:`open_delay_relays`, :func:`serve_delay_relay`: a TCP relay that adds
  latency in front of a side channel (a slow link).
* :func:`open_test_hosts`, :class:`TestHost`: network namespaces joined by
  veth links (root only), with rate limits and partitions; run a worker
  inside one with ``WorkerSpec(netns=host.netns)``.
* :func:`open_etcd`, :class:`EtcdServer`, :class:`EtcdUnavailable`: a real
  etcd server on free loopback ports in a temporary directory, which a test
  can kill, stop and start again (same ports, same data) to make outages.
* :class:`LoopStallMonitor`: a trio instrument measuring the longest loop stall.
* :func:`fill_blocks`, :func:`expected_blocks`, :func:`mismatched_blocks`:
  seeded block contents, verified byte for byte across processes;
  :func:`fill_heads`, :func:`expected_heads`, :func:`mismatched_heads`: the
  same per KV head, for tensor-parallel engines (a head in the wrong rank,
  block or slot is caught).
* :func:`free_port_range`: a base port with free ports after it (TP ranks).
* :func:`encode_notification`: the notification a consumer posts after
  reading a request's blocks (for raw NIXL comparisons and foreign consumers).
* :class:`CapturedBackends`, :func:`raw_nixl_read`,
  :func:`raw_nixl_read_at_once`: READs with NIXL directly, on a connector's
  own agent and descriptors, to compare trio_pd with (the benchmarks, the
  demo).
* ``trio_pd.testing.fixtures``: pytest fixtures built on these; enable them
  with ``pytest_plugins = ["trio_pd.testing.fixtures"]`` in a ``conftest.py``.
"""

from trio_pd._core._protocol import encode_notification
from trio_pd._harness._delay_relay import open_delay_relays, serve_delay_relay
from trio_pd._harness._etcd_server import EtcdServer, EtcdUnavailable, open_etcd
from trio_pd._harness._netns import TestHost, TestHostsUnavailable, open_test_hosts
from trio_pd._harness._prefill_spec import WorkerSpec
from trio_pd._harness._prefill_worker import (
    PrefillWorker,
    WorkerError,
    open_prefill_worker,
    open_prefill_workers,
)
from trio_pd._harness._raw_nixl import CapturedBackends, raw_nixl_read, raw_nixl_read_at_once
from trio_pd._harness._seeded_blocks import (
    expected_blocks,
    expected_heads,
    fill_blocks,
    fill_heads,
    mismatched_blocks,
    mismatched_heads,
)
from trio_pd._harness._stall_monitor import LoopStallMonitor
from trio_pd._serve.ports import free_port_range
from trio_pd.testing._memory import MemoryBackend, MemoryFabric, MemoryFaults

__all__ = [
    "CapturedBackends",
    "EtcdServer",
    "EtcdUnavailable",
    "LoopStallMonitor",
    "MemoryBackend",
    "MemoryFabric",
    "MemoryFaults",
    "PrefillWorker",
    "TestHost",
    "TestHostsUnavailable",
    "WorkerError",
    "WorkerSpec",
    "encode_notification",
    "expected_blocks",
    "expected_heads",
    "fill_blocks",
    "fill_heads",
    "free_port_range",
    "mismatched_blocks",
    "mismatched_heads",
    "open_delay_relays",
    "open_etcd",
    "open_prefill_worker",
    "open_prefill_workers",
    "open_test_hosts",
    "raw_nixl_read",
    "raw_nixl_read_at_once",
    "serve_delay_relay",
]
