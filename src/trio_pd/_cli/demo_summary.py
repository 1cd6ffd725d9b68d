"""The demo's summary in words: what each figure of ``run_demo``'s result
measures, per run and per prefill engine (no I/O)."""

from __future__ import annotations

from typing import Any


def format_summary(summary: dict[str, Any]) -> str:
    """The summary for a reader: under each figure, what it measures."""
    s = summary
    where = f"on {s['hosts']} test hosts, UCX over TCP" if s["hosts"] else "on this host"
    rows = [
        (
            "deployment",
            f"{s['prefill_engines']} prefill engines x TP {s['prefill_tp']} {where}; "
            f"decode TP {s['decode_tp']}",
            "",
        ),
        ("requests ok / failed", f"{s['requests_ok']} / {s['requests_failed']}", ""),
        ("every byte verified", "yes" if s["requests_corrupt"] == 0 else "NO", ""),
        (
            "handshakes (max / mean)",
            f"{s['handshakes']} ({s['handshake_ms_max']} / {s['handshake_ms_mean']} ms)",
            "",
        ),
        (
            "pull latency p50 / p99",
            f"{s['pull_p50_ms']} / {s['pull_p99_ms']} ms",
            f"up to {s['concurrency']} pulls at once, {_size(s['pull_bytes_min'])} to "
            f"{_size(s['pull_bytes_max'])} each, mean {_size(s['pull_bytes_mean'])}; "
            "handshake waits included",
        ),
        (
            "pull throughput",
            f"{s['pull_gb_per_s']} GB/s",
            f"all pulls together: bytes over the {s['pull_seconds_in_flight']} s "
            "with a pull in flight",
        ),
        (
            "  one pull (p50)",
            f"{s['per_pull_gb_per_s_p50']} GB/s",
            "a pull's bytes over its own time, handshake wait left out",
        ),
        _vs_raw(s),
        (
            "run throughput",
            f"{s['gb_per_s']} GB/s",
            "bytes over the whole run: filling the prefill blocks and checking every "
            "pulled byte included",
        ),
        ("bytes pulled", f"{s['bytes_pulled']:,}", ""),
        (
            "largest trio loop stall",
            f"{s['largest_loop_stall_ms']} ms",
            f"the trio thread ran {s['largest_loop_stall_cpu_ms']} ms of it; "
            f"{s['processes']} processes, their NIXL threads and the byte checks "
            f"share {s['cpu_cores']} cores",
        ),
        ("start-up / run", f"{s['startup_s']} s / {s['run_s']} s", ""),
    ]
    if s["faults_injected"]:
        # per prefill engine: the healthy one must not be held up by the faulty one
        for name, e in s["per_engine"].items():
            rows.append(
                (
                    f"  {name}",
                    f"{e['requests_ok']} ok / {e['requests_failed']} failed, "
                    + (
                        f"pull p50 / p99 {e['pull_p50_ms']} / {e['pull_p99_ms']} ms"
                        if e["pull_p50_ms"] is not None
                        else "no pull succeeded"
                    ),
                    "",
                )
            )
        if s["errors_by_type"]:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_type"].items()))
            causes = ", ".join(
                f"{k} {v}" for k, v in sorted(s["handshake_failures_by_cause"].items())
            )
            rows.append(
                (
                    "errors by type",
                    kinds,
                    "HandshakeError, TransferError: trio_pd's own, naming the engine and "
                    "cause; WorkerError: the demo's prefill step found its engine dead"
                    + (f"; handshake failures by cause: {causes}" if causes else ""),
                )
            )
    width = max(len(k) for k, _, _ in rows)
    lines = []
    for key, value, what in rows:
        lines.append(f"{key:<{width}}  {value}")
        if what:
            lines.append(f"{'':<{width}}    ({what})")
    if s["errors"]:
        lines.append("first errors:")
        lines += [f"  {e}" for e in s["errors"]]
    return "\n".join(lines)


def _vs_raw(s: dict[str, Any]) -> tuple[str, str, str]:
    """The line that compares a pull with raw NIXL (measured after the run)."""
    if s["trio_pd_vs_raw"] is None:
        return (
            "  vs raw NIXL",
            "not measured in this run",
            "with tensor parallelism a rank reads strided heads, not one READ; "
            "see docs/performance.md, 'throughput vs raw NIXL'",
        )
    return (
        "  vs raw NIXL",
        f"x{s['trio_pd_vs_raw']}: {s['vs_raw_trio_pd_gb_per_s']} GB/s trio_pd, "
        f"{s['vs_raw_nixl_gb_per_s']} GB/s raw NIXL",
        f"after the run, one pull of {_size(s['vs_raw_bytes'])} from {s['vs_raw_engine']} "
        f"at a time, median of {s['vs_raw_repetitions']} each, interleaved: through trio_pd, "
        "and as one READ "
        "with NIXL directly on the decoder's own agent and descriptors",
    )


def _size(count: int) -> str:
    """A byte count in KiB or MiB, for a reader."""
    if count < 1 << 20:
        return f"{count / 1024:.0f} KiB"
    return f"{count / (1 << 20):.1f} MiB"
