"""What the demo, the benchmarks and ``trio_pd.testing`` run around the library.

Prefill engines in their own processes (``_prefill_worker``,
``_prefill_child``, ``_prefill_spec``), child processes (``_child_process``), test
hosts on network namespaces (``_netns``), the delay relay (``_delay_relay``), a real
etcd server (``_etcd_server``), seeded payloads (``_seeded_blocks``), the loop-stall
monitor (``_stall_monitor``) and raw NIXL reads (``_raw_nixl``). The library's own
packages never import it; ``_cli`` (the demo) and ``trio_pd.testing`` do.
"""
