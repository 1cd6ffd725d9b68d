"""Render benchmark results (pd_bench.py JSON) as docs/performance.md."""

from __future__ import annotations

import json
import sys
from typing import Any

GOALS = {
    "warm-pull latency under cold handshakes (p50, p99)": "<= 1.2, <= 1.5",
    "warm-pull p99 ratio under cold handshakes vs raw NIXL's": "<= 1.2",
    "cold fan-out vs serialized": ">= 10x faster",
    "longest loop stall in a handshake storm": "<= 2 ms, or <= a bare loop's floor + 0.5 ms",
    "throughput vs raw NIXL": ">= 0.95",
    "sequential tiny pulls vs raw NIXL loop, confirmation off": ">= 0.9, every round >= 0.7",
    "sequential tiny pulls vs raw NIXL loop, confirmed": ">= 0.9, every round >= 0.7",
    "tiny pulls in flight vs raw NIXL sequential loop": ">= 1.5",
    "concurrent large pulls vs raw NIXL posted at once": ">= 0.95 each",
    "16 concurrent large pulls vs one pull, every round": ">= 0.95 in each of 5",
    "producer CPU, 1000 stale exposures": "<= 0.05 core",
    "time to first token, disaggregated, 1 client (p50)": "<= one engine's + 2 ms",
    "tokens/s disaggregated vs one engine, 8 clients": ">= 0.95",
    "tokens/s disaggregated vs one engine, 32 clients": ">= 0.95",
    "1024 engines handshaked from one decoder": "< 10 s",
    "decoder memory per engine, 1024-engine storm": "< 16 KiB",
    "a confirmed tiny pull's extra time": "<= one side-channel round trip",
    "confirmed 1 MiB pulls vs unconfirmed": ">= 0.97",
}

TTFT_PHASES = {
    "front": "HTTP to the server the client calls, and that server's own work",
    "prefill_http": (
        "prefill request: its exchange (over the prefill channel; over HTTP in the column "
        "so named), the prefill engine's request handling"
    ),
    "forward": (
        "admission (free KV blocks) and the prompt's forward (a prefill engine's: "
        "with the prompt's last token, which gives the first token)"
    ),
    "expose": "expose",
    "decode_http": (
        "decode request until its answer starts (concurrent: from its second line): "
        "HTTP, request handling"
    ),
    "hold": "hold (behind a proxy: and admission), decode engine",
    "pull": "pull: NIXL READ and notification",
    "first_step": "from the headers until the first token reaches the client",
}
"""The rows of benchmark 11's breakdown (``ttft_breakdown_ms`` in pd_bench.py)."""


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _goal(name: str, measured: str, ok: bool) -> list[str]:
    """A row of the goals table: the goal (a key of GOALS), what was measured,
    the target, and whether it was met."""
    return [name, measured, GOALS[name], "met" if ok else "**not met**"]


def _throughput_notes(sizes: dict[str, Any]) -> list[str]:
    """What bounds one large pull, and what NIXL's thread pool changes (section 4)."""
    single, pooled = sizes.get("64 KiB blocks"), sizes.get("64 KiB blocks, 2 NIXL threads")
    out = [
        "On one host UCX serves NIXL's READ with `cma` (zero-copy, one "
        "`process_vm_readv` per merged descriptor) in the thread that posts it: "
        "`transfer()` *is* the copy, on one core, and a notification is an active "
        "message over `tcp/lo` (with `ucx_error_handling_mode=peer`, UCX picks no "
        "shared-memory transport for those). So one pull is bound by one core "
        "copying through `process_vm_readv`: measured outside this benchmark with "
        "the thread's CPU time, 160-240 ms per GiB, where memcpy on one core takes "
        "about 100 ms. UCX's transport and rendezvous settings change nothing or "
        "make it worse (raw NIXL, two "
        "processes, medians of interleaved runs, against the defaults): without "
        "`cma` in `UCX_TLS` x0.12; `RNDV_THRESH=0` with `RNDV_SCHEME=get_zcopy` "
        "x0.11 (rendezvous settings are for tagged and active messages, not RMA "
        "reads); `MAX_RMA_LANES`/`MAX_RMA_RAILS` 2, `num_workers=2` and NIXL's "
        "progress thread no gain. What moves it is a second copying thread: NIXL's "
        "UCX thread pool (`nixl_num_threads`). trio_pd then sets "
        "`split_batch_size=1`, because NIXL merges a contiguous 8 MiB chunk into "
        "one descriptor and sends only transfers of at least `split_batch_size` "
        "descriptors to the pool; the pool's threads copy the transfer driver's "
        "chunks (4 of a pull in flight) while the driver polls.",
        "",
    ]
    if single and pooled:
        gain = round(pooled["GB_per_s"]["trio_pd"] / single["GB_per_s"]["trio_pd"], 2)
        out += [
            f"In this run the pool took one pull from x{single['trio_pd_vs_memcpy']} "
            f"to x{pooled['trio_pd_vs_memcpy']} of memcpy (x{gain} the rate without "
            "it). That row's raw NIXL READ polls without a pause, like the others, "
            "and on 2 cores the polling thread takes a core from the pool's two "
            "copying threads (in separate raw NIXL runs the pool's READ was x0.78 "
            "of the single-threaded one when polled without a pause, x1.17 with "
            "100 us pauses). It is not the "
            "default: after a peer failed, UCX left the failed READ's request "
            "unreturned (20 of 28 runs of `tests/test_failures.py`'s restart tests "
            "with the pool) and twice aborted the consumer process with an assertion "
            "(`arbiter.c`, `ucs_arbiter_group_is_empty`) when the agent was released; "
            "none of that in 22 runs without it. Measured outside this benchmark, "
            "15 interleaved repetitions of one pull gave the pool x1.3 (median; "
            "x0.9 to x2.3 between runs on this shared machine), and sequential "
            "1-4 block pulls x1.5.",
            "",
        ]
    out += [
        "trio_pd's own cost in one pull is its chunks. Measured outside this "
        "benchmark (thread CPU time, one run): its transfer driver's thread takes "
        "the same CPU time per GiB as raw NIXL posting the same 8 MiB chunks one "
        "after another (239 vs 238 ms), about 14% more than one "
        "unchunked READ (208 ms); with 64 MiB chunks it would be 7% more, at the "
        "price of a small pull waiting up to 8x longer behind a chunk's copy. The "
        "rest of "
        "the gap between trio_pd and raw NIXL in a run is which of them the "
        "scheduler gave the two cores to: with other processes busy, the same "
        "pull's time moves by x2 between repetitions.",
        "",
    ]
    return out


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    r = results["results"]
    out = [
        "# Performance",
        "",
        "Every number below is a ratio measured side by side in one run of "
        "`nox -s bench` (`benchmarks/pd_bench.py`): trio_pd against its reference "
        "on the same machine, the same minute, the same descriptors. Absolute "
        "numbers move with the machine's load; the ratios are the result. "
        "Producers are separate processes; slow links are a latency-injecting TCP "
        "relay in its own process; the decoder is the benchmark process (in "
        "benchmarks 6 and 8, a process of its own). Tail "
        "numbers (p99, the longest stall) move most between runs on this 2-core "
        "machine: read them as ranges.",
        "",
        "To reproduce: `nox -s bench` (12 to 15 minutes on this 2-core machine, and 3 GB "
        "of memory, as root for benchmark 8; "
        "rewrites this page and `docs/performance.json`).",
        "",
        "## Machine",
        "",
        f"{m['date']}: {m['cpu']}, {m['cores']} cores, {m['memory_GiB']} GiB, "
        f"Python {m['python']}, "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + ". Same-host transfers (UCX shared memory / CMA), no GPU.",
        "",
    ]
    if results.get("quick"):
        out += ["**Quick run (smaller sizes): a smoke test, not the reference numbers.**", ""]
    checks: list[list[str]] = []
    if "head_of_line" in r:
        h = r["head_of_line"]
        rows = [
            [
                mode,
                v["baseline_p50_ms"],
                v["baseline_p99_ms"],
                v["during_handshakes_p50_ms"],
                v["during_handshakes_p99_ms"],
                v["ratio_p50"],
                v["ratio_p99"],
                v["pulls_during_handshakes"],
            ]
            for mode, v in h["modes"].items()
        ]
        out += [
            "## 1. Head-of-line blocking",
            "",
            f"Latency of 1-block pulls to an engine that is already ready, issued every "
            f"{h.get('gap_s', 0.005) * 1e3:g} ms, while {h['cold_engines']} other engines "
            "handshake behind a "
            f"{h['link_delay_s'] * 1e3:.0f} ms (one-way) link, divided by the same "
            f"with no handshake going on; {h.get('rounds', 1)} rounds, each on a fresh "
            "decoder, samples pooled. The raw NIXL mode is the anchor: the "
            "remote agents trio_pd loaded in its storm, loaded again at the same "
            "offsets from a plain thread (`add_remote_agent`, `prep_xfer_dlist`, "
            "`make_connection`) while another plain thread posts the same warm "
            "READs, so its ratio is what NIXL itself does to a READ while agents "
            "load. The inline mode (`benchmarks/comparison.py`) "
            "makes a pull to an engine that is not ready hold one lock across its "
            "handshake, and every pull take that lock, as vLLM's engine step did "
            "before PR #19836.",
            "",
            _table(
                [
                    "mode",
                    "idle p50 ms",
                    "idle p99 ms",
                    "storm p50 ms",
                    "storm p99 ms",
                    "ratio p50",
                    "ratio p99",
                    "pulls in storm",
                ],
                rows,
            ),
            "",
        ]
        if "raw NIXL, same loads" in h["modes"]:
            t, raw = h["modes"]["trio_pd"], h["modes"]["raw NIXL, same loads"]
            out += [
                "Read the raw anchor's ratios with care: its idle READs are its "
                "own baseline, and a few slow ones among them (the machine's other "
                "load) move its idle p99, hence its ratio, more than the storm does. "
                "Side by side during the same loads, trio_pd's warm pulls took "
                f"x{t['during_handshakes_p50_ms'] / raw['during_handshakes_p50_ms']:.2f} "
                "raw NIXL's time at p50 and "
                f"x{t['during_handshakes_p99_ms'] / raw['during_handshakes_p99_ms']:.2f} "
                "at p99: the p50 is a pull's fixed cost (benchmark 5), the p99 what "
                "the storm adds on top of NIXL's own.",
                "",
            ]
        if "storm_breakdown_ms" in h:
            b = h["storm_breakdown_ms"]
            phases = ["before_driver", "driver_queue", "transfer", "wake_up", "after"]
            out += [
                "Where a warm pull's time goes during the storm (ms; the slowest 1% "
                "averaged): trio_pd's Python before the read reaches the transfer "
                "driver, the wait for the driver to post it, the NIXL transfer (post to "
                "end, which includes the producer's progress), the hand-back to the "
                "task, and trio_pd's Python after it.",
                "",
                _table(
                    ["pulls", "total", *phases],
                    [[k, v["total"], *(v[p] for p in phases)] for k, v in b.items()],
                ),
                "",
            ]
        t = h["modes"]["trio_pd"]
        checks.append(
            _goal(
                "warm-pull latency under cold handshakes (p50, p99)",
                f"p50 x{t['ratio_p50']}, p99 x{t['ratio_p99']}",
                t["ratio_p50"] <= 1.2 and t["ratio_p99"] <= 1.5,
            )
        )
        if "p99_ratio_over_raw" in h:
            raw = h["modes"]["raw NIXL, same loads"]
            checks.append(
                _goal(
                    "warm-pull p99 ratio under cold handshakes vs raw NIXL's",
                    f"x{h['p99_ratio_over_raw']} (raw NIXL's own: x{raw['ratio_p99']})",
                    h["p99_ratio_over_raw"] <= 1.2,
                )
            )
    if "cold_fan_out" in r:
        c = r["cold_fan_out"]
        rows = [
            [k, v["all_ready_s"], v["mean_ready_s"], v["speedup_vs_serialized"]]
            for k, v in c["runs"].items()
        ]
        out += [
            "## 2. Cold fan-out",
            "",
            f"First pull to each of {c['engines']} cold engines behind a "
            f"{c['link_delay_s'] * 1e3:.0f} ms link, all at once: time until every one "
            "completed. `max_concurrent_fetches=1` is vLLM's behaviour (one handshake "
            "thread); NIXL calls are serialized in every run.",
            "",
            _table(["metadata fetches", "all ready s", "mean ready s", "speed-up"], rows),
            "",
        ]
        best = max(v["speedup_vs_serialized"] for v in c["runs"].values())
        checks.append(_goal("cold fan-out vs serialized", f"x{best}", best >= 10))
    if "loop_stall" in r:
        out += _loop_stall_section(r["loop_stall"], checks)
    if "throughput" in r:
        tp = r["throughput"]
        rows = [
            [
                k,
                v["GB_per_s"]["trio_pd"],
                v["GB_per_s"]["raw NIXL"],
                v["GB_per_s"]["memcpy"],
                v["trio_pd_vs_raw"],
                v["trio_pd_vs_memcpy"],
            ]
            for k, v in tp["sizes"].items()
        ]
        out += [
            "## 4. Throughput",
            "",
            f"One {tp['bytes'] >> 20} MiB pull across processes (16 regions, "
            "identity block mapping) through trio_pd, the same READ on the same "
            "prepared descriptor lists with NIXL directly, and a memcpy of the same "
            "bytes in one process (the ceiling); medians of 5 interleaved repetitions. "
            "The row with 2 NIXL threads is a second connector on the same KV caches "
            "with `nixl_num_threads=2`, measured in the same repetitions (its raw "
            "NIXL READ runs on that connector's agent).",
            "",
            _table(
                [
                    "blocks",
                    "trio_pd GB/s",
                    "raw NIXL GB/s",
                    "memcpy GB/s",
                    "trio_pd / raw",
                    "trio_pd / memcpy",
                ],
                rows,
            ),
            "",
        ]
        out += _throughput_notes(tp["sizes"])
        worst = min(v["trio_pd_vs_raw"] for v in tp["sizes"].values())
        checks.append(_goal("throughput vs raw NIXL", f"x{worst} (worst size)", worst >= 0.95))
    if "small_pulls" in r:
        out += _small_pulls_section(r["small_pulls"], checks)
    if "scale" in r:
        out += _scale_section(r["scale"], checks)
    if "tp_throughput" in r:
        t = r["tp_throughput"]
        out += [
            "## 7. Tensor parallelism",
            "",
            f"One request of {t['bytes'] >> 20} MiB (16 regions, 8 KV heads of 8 KiB per "
            "block) moved between engines of the tensor-parallel sizes shown; every "
            "decode rank pulls its heads at once, from every prefill rank that holds "
            "them (each prefill rank its own process). Rate: the request's bytes over "
            "the time until the last decode rank is done; median of 5, interleaved.",
            "",
            _table(
                ["prefill TP -> decode TP", "GB/s", "ratio to 1 -> 1", "ratio to 2 -> 2"],
                [
                    [k, v, t["ratio_to_1_1"][k], t["ratio_to_2_2"][k]]
                    for k, v in t["GB_per_s"].items()
                ],
            ),
            "",
            "With a smaller decode TP (2 -> 1) each descriptor is a head slice of a "
            "local block, half a block here, and the two parts run as separate "
            "transfers; with a larger one (1 -> 2) two decode ranks read halves of "
            "one prefill rank's blocks. Equal TP moves whole blocks rank to rank, "
            "in parallel.",
            "",
        ]
    if "far_link" in r:
        f = r["far_link"]
        out += [
            "## 8. A slow far engine",
            "",
            f"A pull of {f['far_pull_MiB']} MiB from an engine on a test host behind a "
            f"{f['link_rate']} veth link (it took {f['far_pull_s']} s), and meanwhile "
            f"{f['near_pulls']} one-block pulls from an engine on this host, one every "
            "5 ms; the decoder is a process of its own, UCX over TCP for both engines. "
            "Latency of the near pulls, divided by the same with no far pull.",
            "",
            _table(
                ["near pulls", "p50 ms", "p99 ms"],
                [
                    ["idle", f["idle_p50_ms"], f["idle_p99_ms"]],
                    [
                        "during the far pull",
                        f["during_far_pull_p50_ms"],
                        f["during_far_pull_p99_ms"],
                    ],
                    ["ratio", f["ratio_p50"], f["ratio_p99"]],
                ],
            ),
            "",
            "One transfer-driver thread per connector posts and polls every pull's "
            "READs (up to 4 chunks of a pull at once): the far pull's slow transfer is "
            "polled with the others, never waited on, so it holds up no near pull's "
            f"turn. In this run the near pulls' p50 moved by x{f['ratio_p50']} "
            f"and their p99 by x{f['ratio_p99']}: on 2 cores, three processes and the "
            "TCP transport copying the far bytes compete with them for CPU; where the "
            "tail goes is not broken down yet.",
            "",
        ]
    if "concurrent_pulls" in r:
        c = r["concurrent_pulls"]
        rounds = c.get("rounds", 3)
        out += [
            "## 9. Concurrent large pulls",
            "",
            f"The same {c['bytes'] >> 20} MiB (16 regions, 64 KiB blocks, one engine) as "
            "1, 4 or 16 pulls at once, against raw NIXL with the same transfers posted "
            f"at once from one thread and polled together; {rounds} rounds, each count "
            "once per round, trio_pd and raw NIXL taking turns (which goes first "
            "alternates by round). GB/s: the median over the rounds; the last column "
            "gives each round's own ratio.",
            "",
            _table(
                ["pulls at once", "trio_pd GB/s", "raw NIXL GB/s", "ratio", "each round"],
                [
                    [
                        n,
                        v["GB_per_s"]["trio_pd"],
                        v["GB_per_s"]["raw NIXL"],
                        v["ratio"],
                        " ".join(str(x) for x in v.get("round_ratios", [])),
                    ]
                    for n, v in c["counts"].items()
                ],
            ),
            "",
            "The transfer driver posts every pull's chunks from one thread and polls "
            "them together, as raw NIXL does here. (With a thread per pull, before "
            "the driver, 4 and 16 pulls at once reached 0.48 of this.)",
            "",
        ]
        worst_c = min(v["ratio"] for v in c["counts"].values())
        checks.append(
            _goal(
                "concurrent large pulls vs raw NIXL posted at once",
                f"x{worst_c} (worst count, median of the rounds)",
                worst_c >= 0.95,
            )
        )
        if "sixteen_vs_one" in c:
            own, raw = c["sixteen_vs_one"]["trio_pd"], c["sixteen_vs_one"]["raw NIXL"]
            every = [
                x
                for v in c["counts"].values()
                for xs in v.get("rounds_GB_per_s", {}).values()
                for x in xs
            ]
            spread = (
                f" Each figure is one transfer of {c['bytes'] >> 20} MiB; in this run "
                f"single transfers moved between {min(every)} and {max(every)} GB/s, raw "
                "NIXL's as much as trio_pd's (this machine is shared), so one round's "
                "ratio is mostly that noise: raw NIXL's own ratio, measured in the same "
                "rounds, is the anchor."
                if every
                else ""
            )
            out += [
                "16 pulls at once against one pull of the same bytes, round by round: "
                f"trio_pd {' '.join(str(x) for x in own)}; raw NIXL "
                f"{' '.join(str(x) for x in raw)}.{spread}",
                "",
            ]
            checks.append(
                _goal(
                    "16 concurrent large pulls vs one pull, every round",
                    f"x{min(own)} (worst of {len(own)} rounds; raw NIXL's worst x{min(raw)})",
                    min(own) >= 0.95,
                )
            )
    if "producer_cpu" in r:
        p = r["producer_cpu"]
        rows = [["idle", p["idle_cores"]]]
        if "pending_1000_fresh_cores" in p:
            rows.append(
                ["1000 exposures, in the 0.5 s after exposing", p["pending_1000_fresh_cores"]]
            )
        rows.append(["1000 exposures pending, stale (nobody reads)", p["pending_1000_cores"]])
        out += [
            "## 10. Producer CPU while exposures wait",
            "",
            f"CPU of a producer process over {p['window_s']:g} s: idle; then with 1000 "
            "exposures pending that no consumer reads: just after exposing them, and "
            "once they are stale.",
            "",
            _table(["producer", "cores"], rows),
            "",
            "While reads are expected (0.5 s after exposing or a notification) the "
            "notification thread checks every `poll_interval` (100 us): a consumer's "
            "READ waits for the producer's progress, so this is what keeps pull "
            "latency low. Past that, its pauses double up to "
            "`notification_poll_interval` (2 ms).",
            "",
        ]
        checks.append(
            _goal(
                "producer CPU, 1000 stale exposures",
                f"{p['pending_1000_cores']} core",
                p["pending_1000_cores"] <= 0.05,
            )
        )
    if "serve" in r:
        out += _serve_section(r["serve"], r.get("proxy_overhead"), checks)
    if "proxy_overhead" in r:
        po = r["proxy_overhead"]
        out += [
            "## 12. The proxy's own cost",
            "",
            f"{po['requests']} requests to a do-nothing upstream (it answers prefill and "
            "decode at once), through the proxy and straight to the upstream, "
            "interleaved. The proxy makes two upstream requests (prefill, then decode) "
            "where the direct client makes one, so this is all of what the proxy hop "
            "costs a request.",
            "",
            _table(["", "p50, ms", "p99, ms"], _overhead_rows(po)),
            "",
        ]
    if "confirm" in r:
        out += _confirm_section(r["confirm"], checks)
    out += ["## Goals", "", _table(["goal", "measured", "target", ""], checks), ""]
    missed = [row[0] for row in checks if row[3] != "met"]
    bounds = [f"* **{name}:** {MISSED_BOUNDS[name](r)}" for name in missed if name in MISSED_BOUNDS]
    if bounds:
        out += ["What bounds each goal this run missed, from its measurements:", "", *bounds, ""]
    for name, error in results.get("failed", {}).items():
        out += [f"**Benchmark `{name}` failed in this run:** {error}", ""]
    out += [FINDINGS]
    return "\n".join(out)


def _spread(r: dict[str, Any]) -> str:
    """Benchmark 9's spread of single 1 GiB transfers, as words (or nothing)."""
    counts = r.get("concurrent_pulls", {}).get("counts", {})
    every = [x for v in counts.values() for xs in v.get("rounds_GB_per_s", {}).values() for x in xs]
    if not every:
        return ""
    return (
        f" One 1 GiB transfer ran at {min(every)} to {max(every)} GB/s in benchmark 9's "
        "rounds, raw NIXL's as much as trio_pd's: that spread is larger than the margin."
    )


def _bound_hol_vs_raw(r: dict[str, Any]) -> str:
    raw = r["head_of_line"]["modes"]["raw NIXL, same loads"]
    return (
        f"raw NIXL's own p99 ratio was x{raw['ratio_p99']} (idle p99 "
        f"{raw['baseline_p99_ms']} ms, during the loads {raw['during_handshakes_p99_ms']} "
        "ms): a few slow idle READs (the machine's other load) move it more than the "
        "loads do, so this quotient mostly measures that; trio_pd's own ratio is the "
        "row above."
    )


def _loop_stall_section(s: dict[str, Any], checks: list[list[str]]) -> list[str]:
    """Section 3 (benchmark 3's results) and its goal row."""
    first = next(iter(s["modes"].values()))
    floor = "floor_ms" in first
    waits = "waiting_for_a_core_in_it_ms" in first
    rows = [
        [
            k,
            v["longest_stall_ms"],
            v.get("trio_thread_cpu_in_it_ms", "-"),
            *([v["waiting_for_a_core_in_it_ms"]] if waits else []),
            v["worst_round_ms"],
            v["storm_s"],
            *([v["floor_ms"], v["above_floor_ms"]] if floor else []),
        ]
        for k, v in s["modes"].items()
    ]
    out = [
        "## 3. Loop responsiveness",
        "",
        f"The longest time the trio loop ran without polling for I/O "
        f"(`trio_pd.testing.LoopStallMonitor`) while {s['engines']} engines with "
        f"{s['descriptors_per_engine']} descriptors each handshake at once "
        f"(a fresh decoder per round; median of {s.get('rounds', 3)} rounds, after a "
        "warm-up round)."
        + (
            " Beside every storm, in a process of its own and over the same moments, "
            "a bare trio loop whose one task wakes every 100 us is watched too "
            "(`benchmarks/stall_floor.py`): its *floor* is the longer of its own "
            "longest batch (the same monitor) and the longest its task woke late "
            "(less the median lateness): how long the machine kept a loop doing "
            "nothing off a core at that moment. The last column is each round's stall "
            "less that round's floor (median)."
            if floor
            else ""
        ),
        "",
        _table(
            [
                "NIXL calls",
                "longest stall ms (median)",
                "trio thread CPU in it, ms",
                *(["waiting for a core in it, ms"] if waits else []),
                "worst round ms",
                "storm s",
                *(["bare loop's floor ms", "above the floor ms"] if floor else []),
            ],
            rows,
        ),
        "",
    ]
    if floor and waits:
        out += [
            "Each round of the first row, in ms: the stall = the trio thread's CPU + its "
            "wait for a core + the rest (the GIL, a lock), then the round's floor: "
            + "; ".join(
                f"{a} = {c} + {w} + {max(0.0, round(a - c - w, 3))} ({f})"
                for a, c, w, f in zip(
                    first["rounds_ms"],
                    first["rounds_cpu_ms"],
                    first["rounds_waiting_ms"],
                    first["round_floors_ms"],
                    strict=True,
                )
            )
            + f". The bare loop's floor was its longest batch {first['floor_batch_ms']} ms "
            f"(of which it waited for a core {first['floor_batch_waiting_ms']} ms) and its "
            f"longest late wake-up {first['floor_late_ms']} ms (medians). (The wait for a "
            "core is the kernel's run-queue time of the trio thread, from "
            "`/proc/<pid>/task/<tid>/schedstat`, read at both ends of each batch: "
            "`LoopStallMonitor(run_queue=True)`. The rest is what neither accounts for: "
            "the thread slept, or the two counters' granularity; shown as 0 when negative.)",
            "",
        ]
    elif floor:
        out += [
            "Each round of the first row, stall (floor) in ms: "
            + " ".join(
                f"{a} ({b})"
                for a, b in zip(first["rounds_ms"], first["round_floors_ms"], strict=True)
            )
            + f"; the bare loop's floor was its longest batch {first['floor_batch_ms']} ms "
            f"and its longest late wake-up {first['floor_late_ms']} ms (medians).",
            "",
        ]
    out += [
        f"Running the NIXL calls on the trio thread stalls the loop "
        f"x{s['stall_ratio_loop_vs_threads']} longer. Since descriptor lists are "
        "prepared from one strided row per region, a handshake's NIXL calls are "
        "short. The benchmark, like the demo after start-up, calls "
        "`gc.freeze()` first; the last row is without it. The longest batches "
        "were the storm's ZeroMQ sockets: timing every task step of the loop "
        "(an instrument, outside this benchmark) found batches of 8 metadata "
        "fetches each making its socket and monitor and connecting, and of pulls "
        "each opening its confirmation channel, 0.3-0.6 ms of the trio thread's "
        "CPU apiece, all in one pass of trio's scheduler. A connector now makes "
        "its sockets in turns, one per pass (`SocketSetups`, "
        "[internals](internals.md#zeromq-under-trio)): in two runs of this "
        "benchmark before and after, the median stall went from 3.4 and 2.9 ms to "
        "2.5 and 2.3 ms, the trio thread's CPU in it from 1.9 and 1.8 ms to 1.4 "
        "and 0.5 ms. What bounds the rest is the third column: of the longest "
        "batch, the trio thread itself ran only that long; the rest of the time "
        "it was not running -- on 2 cores the producer process (8 engines "
        "answering), UCX's and ZeroMQ's threads and the handshake thread take "
        "turns with it (a shorter GIL switch interval, 0.5 ms instead of 5, did "
        "not shorten the stalls)."
        + (
            f" The fourth column measures it: {first['waiting_for_a_core_in_it_ms']} ms of "
            f"the {first['longest_stall_ms']} ms (medians) the trio thread was ready to "
            "run and the kernel kept it waiting for a core, against "
            f"{first['trio_thread_cpu_in_it_ms']} ms of its own work. So the stall is "
            "mostly how the kernel shares two cores among the storm's threads and "
            "processes (trio_pd's handshake thread, UCX's and ZeroMQ's, the producer's "
            "8 engines, the bare loop), not the trio thread's code; the bare loop waits "
            "for a core in its own longest batch too. With the NIXL calls on the trio "
            "thread, the second row, it is the other way round: the thread's own CPU is "
            "the stall."
            if waits
            else ""
        ),
        "",
    ]
    stall = first["longest_stall_ms"]
    if floor:
        measured = (
            f"{stall} ms (bare loop's floor {first['floor_ms']} ms; "
            f"{first['above_floor_ms']:+g} ms above it)"
        )
        ok = stall <= 2 or first["above_floor_ms"] <= 0.5
    else:
        measured, ok = f"{stall} ms", stall <= 2
    checks.append(_goal("longest loop stall in a handshake storm", measured, ok))
    return out


def _rounds(values: list[float]) -> str:
    return " ".join(str(x) for x in values)


def _small_pulls_section(sp: dict[str, Any], checks: list[list[str]]) -> list[str]:
    """Section 5 (benchmark 5's results) and its goal rows."""
    q, f = sp["sequential"], sp["in_flight"]
    unconfirmed = "unconfirmed_ratio" in q
    out = [
        "## 5. Per-request overhead",
        "",
        f"Pulls of 1-4 blocks ({sp['regions']} regions x {sp['block_bytes']} B), "
        "one after another, through trio_pd and with NIXL directly (post, poll, "
        "release, with the same notification; no trio); then many in flight at "
        "once through trio_pd."
        + (
            " trio_pd runs its own path (every READ confirmed with its producer, "
            "[protocol](protocol.md#confirmations-a-pull-keeps-only-its-own-bytes)), "
            "the same with the confirmation switched off (benchmark 13's switch, for "
            "measurements only: what the rest of the pull path costs against raw NIXL) "
            "and with inline reads off."
            if unconfirmed
            else ""
        )
        + (
            f" The sequential loops take turns in {q['rounds']} rounds"
            + (
                f" of {q['turns_per_round']} turns (each loop runs a tenth of its "
                "round's pulls per turn; which goes first rotates)"
                if "turns_per_round" in q
                else " (which goes first rotates)"
            )
            + "; pulls/s are the medians of the rounds, each round's ratio its own."
            if "round_ratios" in q
            else ""
        ),
        "",
    ]
    cpu_column = "unconfirmed_trio_thread_cpu_us_per_pull" in q
    rows = [
        [
            f"trio_pd, sequential ({q['pulls']})",
            q["trio_pd_pulls_per_s"],
            q["ratio"],
            _rounds(q.get("round_ratios", [])),
            q.get("trio_thread_cpu_us_per_pull", ""),
        ]
    ]
    if unconfirmed:
        rows.append(
            [
                "trio_pd, sequential, confirmation off",
                q["unconfirmed_pulls_per_s"],
                q["unconfirmed_ratio"],
                _rounds(q["unconfirmed_round_ratios"]),
                q.get("unconfirmed_trio_thread_cpu_us_per_pull", ""),
            ]
        )
    if "inline_off_ratio" in q:
        rows.append(
            [
                "trio_pd, sequential, inline reads off",
                q["inline_off_pulls_per_s"],
                q["inline_off_ratio"],
                "",
                "",
            ]
        )
    rows.append(
        [
            f"raw NIXL, sequential ({q['pulls']})",
            q["raw_nixl_pulls_per_s"],
            1.0,
            "",
            q.get("raw_nixl_thread_cpu_us_per_pull", ""),
        ]
    )
    rows.append(
        [
            f"trio_pd, {f['pulls']} in flight",
            f["trio_pd_pulls_per_s"],
            f.get(
                "ratio_to_raw_sequential",
                round(f["trio_pd_pulls_per_s"] / q["raw_nixl_pulls_per_s"], 3),
            ),
            "",
            "",
        ]
    )
    header = ["", "pulls/s", "ratio to raw sequential", "each round"]
    if cpu_column:
        header.append("trio thread CPU per pull, us")
    else:
        rows = [row[:4] for row in rows]
    out += [_table(header, rows), ""]
    if "inline" in q:
        out += [
            f"Of the {q['pulls']} sequential pulls, {q['inline']} were inline reads (the "
            "trio thread posted the READ itself: the driver, the loads and the loop were "
            f"idle), {q['adopted']} of them handed to the driver still running after "
            "`inline_read_spin`"
            + (
                f"; with the confirmation off, {q['unconfirmed_adopted']} of "
                f"{q['unconfirmed_inline']}"
                if "unconfirmed_adopted" in q
                else ""
            )
            + ". With inline reads off, every pull goes through the driver's two thread "
            "hand-offs.",
            "",
        ]
    if "lone" in sp:
        lo = sp["lone"]
        lone_rows = [["trio_pd", lo["trio_pd_ms_p50"], lo["ratio"]]]
        if "unconfirmed_ms_p50" in lo:
            lone_rows.append(
                ["trio_pd, confirmation off", lo["unconfirmed_ms_p50"], lo["unconfirmed_ratio"]]
            )
        lone_rows.append(["raw NIXL", lo["raw_nixl_ms_p50"], 1.0])
        out += [
            f"Lone pulls ({lo['pulls']}, spaced 2 ms apart, trio_pd and raw NIXL "
            "interleaved), median time per pull:",
            "",
            _table(["", "ms", "raw NIXL's ÷ trio_pd's"], lone_rows),
            "",
        ]
    if "transfers_posted" in f:
        out += [
            f"The transfer driver posted the {f['pulls']} pulls in flight as "
            f"{f['transfers_posted']} READs (pulls that wait together share one).",
            "",
        ]
    if cpu_column:
        out += [
            "The CPU column is the trio thread's CPU clock over each loop's turns, per "
            "pull (in a virtual machine it also counts time the host took the core). With "
            "inline reads it includes the READ itself: posting it and checking it until "
            "done, the same NIXL calls as raw NIXL's loop, whose row is those calls alone "
            "-- on this machine mostly the check loop waiting for the producer's progress. "
            "The rows do not subtract: raw NIXL checks until the READ is done, trio_pd for "
            "at most `inline_read_spin` before its driver takes over. Where trio_pd's own "
            "microseconds go, step by step, is in What we found below.",
            "",
        ]
    elif "trio_thread_cpu_us_per_pull" in q:
        out += [
            f"A sequential pull cost the trio thread {q['trio_thread_cpu_us_per_pull']} us "
            "of CPU (its thread CPU clock), the READ's own NIXL calls included.",
            "",
        ]
    if unconfirmed:
        worst_off = min(q["unconfirmed_round_ratios"])
        checks.append(
            _goal(
                "sequential tiny pulls vs raw NIXL loop, confirmation off",
                f"x{q['unconfirmed_ratio']} (worst round x{worst_off})",
                q["unconfirmed_ratio"] >= 0.9 and worst_off >= 0.7,
            )
        )
    worst = min(q.get("round_ratios", [q["ratio"]]))
    checks.append(
        _goal(
            "sequential tiny pulls vs raw NIXL loop, confirmed",
            f"x{q['ratio']} (worst round x{worst})",
            q["ratio"] >= 0.9 and worst >= 0.7,
        )
    )
    if "ratio_to_raw_sequential" in f:
        checks.append(
            _goal(
                "tiny pulls in flight vs raw NIXL sequential loop",
                f"x{f['ratio_to_raw_sequential']}",
                f["ratio_to_raw_sequential"] >= 1.5,
            )
        )
    return out


def _bound_stall(r: dict[str, Any]) -> str:
    mode = r["loop_stall"]["modes"]["trio_pd (worker threads)"]
    text = (
        f"{mode['trio_thread_cpu_in_it_ms']} ms of the {mode['longest_stall_ms']} ms counted "
        "as the trio thread's CPU time (in a virtual machine, time the host takes the core "
        "is counted as the thread's too); the rest of the time the thread was not running"
        + (
            f": {mode['waiting_for_a_core_in_it_ms']} ms of it the thread was ready to run "
            "and waited for a core (the kernel's run queue)."
            if "waiting_for_a_core_in_it_ms" in mode
            else "."
        )
    )
    if "floor_ms" in mode:
        text += (
            f" A bare trio loop in another process, at the same moments, had a floor of "
            f"{mode['floor_ms']} ms (section 3): the storm's stall was "
            f"{mode['above_floor_ms']} ms above it."
        )
    return text


def _echo_floor(c: dict[str, Any]) -> str:
    """The round trip's floor, measured beside it (``benchmarks/zmq_echo.py``)."""
    if "echo_rtt_ms_p50" not in c:
        return ""
    return (
        f", and the same request to a trio process that only echoes it "
        f"(`benchmarks/zmq_echo.py`, the floor of any round trip between two trio "
        f"processes over ZeroMQ on this machine) {c['echo_rtt_ms_p50']} ms"
    )


def _bound_sequential(r: dict[str, Any]) -> str:
    q = r["small_pulls"]["sequential"]
    rounds = _rounds(q.get("round_ratios", []))
    text = f"the rounds' own ratios were {rounds}. "
    if "unconfirmed_ratio" in q:
        text += (
            f"With the confirmation off the same path reached x{q['unconfirmed_ratio']} in "
            "the same rounds: the rest is the confirmation, which raw NIXL does not do "
            "-- the price of never returning another request's bytes. "
        )
    if "confirm" in r:
        c = r["confirm"]
        text += (
            f"A tiny pull waits for its producer's answer, about one side-channel round "
            f"trip ({c['side_channel_rtt_ms_p50']} ms here; section 13: "
            f"{c['tiny']['extra_ms_p50']} ms per pull) against a READ of about 0.1 ms."
        )
        if "echo_rtt_ms_p50" in c:
            above = round(c["side_channel_rtt_ms_p50"] - c["echo_rtt_ms_p50"], 4)
            text += (
                " That round trip is close to its floor: a trio process that only echoes "
                f"the request answered in {c['echo_rtt_ms_p50']} ms (section 13; the "
                f"producer {above:+g} ms), so no producer could answer much sooner over "
                "ZeroMQ here, and a confirmed tiny pull cannot reach x0.9 of a loop that "
                "waits for no answer."
            )
    return text


def _bound_sequential_off(r: dict[str, Any]) -> str:
    q = r["small_pulls"]["sequential"]
    return (
        f"the rounds' own ratios were {_rounds(q['unconfirmed_round_ratios'])}; trio_pd's "
        "own CPU per pull is section 5's, its steps in What we found; a round's ratio "
        "moves with which of the loops the machine's other load fell on."
    )


def _bound_in_flight(r: dict[str, Any]) -> str:
    f = r["small_pulls"]["in_flight"]
    extra = ""
    if "confirm" in r:
        w = r["confirm"]["many_at_once"]
        extra = (
            f"; with many pulls at once, confirming them cost x{w['p50_ratio']} at p50 "
            "(section 13): their confirmations travel in a few batched messages, but the "
            "producer still answers each"
        )
    return (
        f"{f['pulls']} pulls in flight went out in {f.get('transfers_posted', '?')} READs"
        + extra
        + "."
    )


def _bound_concurrent(r: dict[str, Any]) -> str:
    counts = r["concurrent_pulls"]["counts"]
    worst = min(counts, key=lambda n: counts[n]["ratio"])
    rounds = " ".join(str(x) for x in counts[worst].get("round_ratios", []))
    return f"the {worst}-pull rounds' own ratios were {rounds}.{_spread(r)}"


def _bound_sixteen(r: dict[str, Any]) -> str:
    raw = r["concurrent_pulls"]["sixteen_vs_one"]["raw NIXL"]
    return f"raw NIXL's own 16-vs-1 ratios in the same rounds: {' '.join(map(str, raw))}."


def _bound_ttft(r: dict[str, Any]) -> str:
    split = r["serve"]["ttft_breakdown_ms"]
    first = split.get("decode-first engine (P/D)", {})
    http = split.get("decode-first engine, prefill over HTTP (P/D)", {})
    one = split["one engine"]
    return (
        f"the decode-first engine's prefill request -- its exchange with the prefill "
        f"engine over the prefill channel, and the prefill engine's request handling -- "
        f"took {first.get('prefill_http', '?')} ms (over HTTP, in the same run: "
        f"{http.get('prefill_http', '?')} ms), expose and hold "
        f"{_plus(first.get('expose'), first.get('hold'))} ms, and the client's request to "
        f"it {first.get('front', '?')} ms against one engine's {one.get('front', '?')} ms "
        "(section 11's breakdown). What is left of the prefill request is not Python but "
        "waiting: for each process to be woken (the prefill engine, its forward's worker "
        "thread and back, the decode-first engine) on 2 cores that five busy processes "
        "share; see What we found, the prefill channel."
    )


def _plus(*values: Any) -> str:
    """The sum of ``values`` (rounded), or ``?`` if one is missing."""
    if any(not isinstance(v, int | float) for v in values):
        return "?"
    return str(round(sum(values), 3))


def _bound_tokens(r: dict[str, Any], clients: str = "8") -> str:
    ratios = r["serve"]["ratios"]
    first = ratios.get("decode-first engine (P/D)", {}).get("cpu_per_token_ratio", {})
    proxy = ratios.get("proxy (P/D)", {}).get("cpu_per_token_ratio", {})
    return (
        f"a token served decode-first cost x{first.get(clients, '?')} the CPU of one on one "
        f"engine (through the proxy x{proxy.get(clients, '?')}; section 11): on a saturated "
        "machine tokens/s can reach at most the inverse. What remains is each request's "
        "prefill exchange and pull, and the two engine processes taking turns on 2 cores."
    )


def _bound_tokens_32(r: dict[str, Any]) -> str:
    return _bound_tokens(r, "32")


def _bound_producer_cpu(r: dict[str, Any]) -> str:
    return (
        "each check's wake-up: about 50 us of CPU here, against about 1 us for NIXL's "
        "check itself (section 10)."
    )


def _bound_confirm_mib(r: dict[str, Any]) -> str:
    c = r["confirm"]
    read, rtt = c["mib"]["unconfirmed_ms_p50"], c["side_channel_rtt_ms_p50"]
    extra = round(c["mib"]["confirmed_ms_p50"] - read, 3)
    if read < 2 * rtt:
        return (
            f"a 1 MiB READ here ({read} ms at p50) takes about one side-channel round trip "
            f"({rtt} ms), so its answer is often not back when the READ ends; the pull paid "
            f"{extra} ms more, which includes the producer's work to answer running on the "
            "same 2 cores as the READ's copy. The goal assumed a READ much longer than the "
            "round trip"
        )
    return (
        f"the 1 MiB READ ({read} ms) is longer than the round trip ({rtt} ms), yet the "
        f"pull paid {extra} ms more: the producer's work to answer and the consumer's to "
        "send and collect run on the same 2 cores as the READ's copy"
    )


def _bound_confirm_tiny(r: dict[str, Any]) -> str:
    t = r["confirm"]["tiny"]
    return f"the tiny pull waited {t['extra_in_rtts']} round trips for its answer"


def _bound_throughput(r: dict[str, Any]) -> str:
    return f"section 4 shows what bounds one pull.{_spread(r)}"


MISSED_BOUNDS = {
    "warm-pull p99 ratio under cold handshakes vs raw NIXL's": _bound_hol_vs_raw,
    "longest loop stall in a handshake storm": _bound_stall,
    "sequential tiny pulls vs raw NIXL loop, confirmation off": _bound_sequential_off,
    "sequential tiny pulls vs raw NIXL loop, confirmed": _bound_sequential,
    "tiny pulls in flight vs raw NIXL sequential loop": _bound_in_flight,
    "concurrent large pulls vs raw NIXL posted at once": _bound_concurrent,
    "16 concurrent large pulls vs one pull, every round": _bound_sixteen,
    "time to first token, disaggregated, 1 client (p50)": _bound_ttft,
    "tokens/s disaggregated vs one engine, 8 clients": _bound_tokens,
    "tokens/s disaggregated vs one engine, 32 clients": _bound_tokens_32,
    "producer CPU, 1000 stale exposures": _bound_producer_cpu,
    "throughput vs raw NIXL": _bound_throughput,
    "confirmed 1 MiB pulls vs unconfirmed": _bound_confirm_mib,
    "a confirmed tiny pull's extra time": _bound_confirm_tiny,
}
"""For a goal a run misses: what bounds it, in words made from that run's results."""


def _confirm_section(c: dict[str, Any], checks: list[list[str]]) -> list[str]:
    """Section 13 (benchmark ``confirm``), and its goal rows."""
    t, m, w = c["tiny"], c["mib"], c["many_at_once"]
    out = [
        "## 13. What confirming each READ costs",
        "",
        "Every pull confirms with its producer that the blocks are still its "
        "request's for the whole READ ([protocol]"
        "(protocol.md#confirmations-a-pull-keeps-only-its-own-bytes)). "
        "Two decode connectors pull from one prefill engine (its own process): one "
        "confirms, the other has the confirmation switched off (a switch for this "
        "benchmark only: without it a pull may return another request's bytes). "
        f"They take turns in {c['rounds']} rounds: tiny pulls (2 blocks of "
        f"{c['regions']} x {c['block_bytes']} B) one after another, 1 MiB pulls one "
        f"after another, and waves of {w['in_flight']} tiny pulls at once. One "
        "side-channel round trip (a lease request naming nothing, on a kept socket) "
        f"took {c['side_channel_rtt_ms_p50']} ms at p50 in the same rounds" + _echo_floor(c) + ".",
        "",
        _table(
            ["", "confirmed, ms", "unconfirmed, ms", "unconfirmed ÷ confirmed"],
            [
                [
                    f"tiny, one after another ({t['pulls']}), p50",
                    t["confirmed_ms_p50"],
                    t["unconfirmed_ms_p50"],
                    t["ratio"],
                ],
                [
                    f"1 MiB, one after another ({m['pulls']}), p50",
                    m["confirmed_ms_p50"],
                    m["unconfirmed_ms_p50"],
                    m["ratio"],
                ],
                [
                    f"{w['in_flight']} at once ({w['pulls']}), p50",
                    w["confirmed_ms_p50"],
                    w["unconfirmed_ms_p50"],
                    round(1 / w["p50_ratio"], 3),
                ],
                [
                    f"{w['in_flight']} at once ({w['pulls']}), p99",
                    w["confirmed_ms_p99"],
                    w["unconfirmed_ms_p99"],
                    round(1 / w["p99_ratio"], 3),
                ],
            ],
        ),
        "",
        f"A tiny pull pays {t['extra_ms_p50']} ms more at p50, {t['extra_in_rtts']} of a "
        "round trip: its READ (about 0.1 ms) ends before the answer is back, so it "
        "waits for the rest of the round trip. A READ longer than the round trip "
        "finds the answer there when it ends.",
        "",
    ]
    checks.append(
        _goal(
            "a confirmed tiny pull's extra time",
            f"{t['extra_ms_p50']} ms ({t['extra_in_rtts']} round trips)",
            t["extra_in_rtts"] <= 1.0,
        )
    )
    checks.append(
        _goal("confirmed 1 MiB pulls vs unconfirmed", f"x{m['ratio']}", m["ratio"] >= 0.97)
    )
    return out


SEQUENTIAL = "proxy (P/D), sequential"
"""Benchmark 11's proxy that dispatches sequentially (the default); ``proxy
(P/D)`` is ``serve``'s own, with ``--dispatch concurrent``."""


def _overhead_rows(po: dict[str, Any]) -> list[list[Any]]:
    """Benchmark 12's rows (a run before concurrent dispatch has one proxy)."""
    if "sequential_p50_ms" not in po:
        return [
            ["straight to the upstream", po["direct_p50_ms"], po["direct_p99_ms"]],
            ["through the proxy", po["proxy_p50_ms"], po["proxy_p99_ms"]],
            ["added by the proxy", po["added_p50_ms"], po["added_p99_ms"]],
        ]
    return [
        ["straight to the upstream", po["direct_p50_ms"], po["direct_p99_ms"]],
        ["through the proxy, concurrent dispatch", po["proxy_p50_ms"], po["proxy_p99_ms"]],
        [
            "through the proxy, sequential dispatch",
            po["sequential_p50_ms"],
            po["sequential_p99_ms"],
        ],
        ["added by the proxy, concurrent", po["added_p50_ms"], po["added_p99_ms"]],
        [
            "added by the proxy, sequential",
            po["sequential_added_p50_ms"],
            po["sequential_added_p99_ms"],
        ],
    ]


SERVE_TARGETS = {
    "decode-first engine (P/D)": "decode-first",
    "decode-first engine, prefill over HTTP (P/D)": "decode-first, HTTP",
    "proxy (P/D)": "proxy, concurrent",
    SEQUENTIAL: "proxy, sequential",
}
"""Benchmark 11's disaggregated targets (pd_bench.py's names) and their
columns' names, in the order the tables show them."""


def _serve_section(
    sv: dict[str, Any], overhead: dict[str, Any] | None, checks: list[list[str]]
) -> list[str]:
    """Section 11 (benchmark ``serve``), and its goal rows."""
    one_engine = "one engine"
    names = [name for name in SERVE_TARGETS if name in sv["targets"]]
    short = [SERVE_TARGETS[name] for name in names]
    rows = []
    for clients, by_target in sv["by_clients"].items():
        rows.append(
            [clients]
            + [by_target[name]["ttft_p50_ms"] for name in names]
            + [by_target[one_engine]["ttft_p50_ms"]]
            + [sv["ratios"][name]["ttft_added_ms"][clients] for name in names]
            + [by_target[name]["tokens_per_s"] for name in names]
            + [by_target[one_engine]["tokens_per_s"]]
            + [sv["ratios"][name]["tokens_per_s_ratio"][clients] for name in names]
        )
    header = (
        ["clients"]
        + [f"TTFT, {n}, ms" for n in short]
        + ["TTFT, one engine, ms"]
        + [f"added, {n}, ms" for n in short]
        + [f"tokens/s, {n}" for n in short]
        + ["tokens/s, one engine"]
        + [f"ratio, {n}" for n in short]
    )
    out = [
        "## 11. Serving disaggregated: a decode-first engine and the P/D proxy",
        "",
        f"{sv['prompts']} prompts, {sv['max_tokens']} tokens each, streamed, served "
        "disaggregated -- prefill on one engine, the KV cache pulled over NIXL, decode "
        "on another -- four ways, and by one engine serving the whole request: a "
        "*decode-first* engine (`trio-pd engine --role decode --prefill-url`: the client "
        "calls it, it runs the prefill on a prefill engine itself, over that engine's "
        "prefill channel, and streams the first token, the prefill engine's, once it "
        "holds the blocks: a second deployment, `trio-pd serve --dispatch decode-first`); "
        "the same with its prefill requests over HTTP (a third deployment, with "
        "`--no-prefill-channel`: the path before the channel); `trio-pd serve --prefill 1 "
        "--decode 1`'s proxy with `--dispatch concurrent` (the decode request goes with the "
        "prefill, its `kv_transfer_params` a second line of its body); and a `trio-pd proxy "
        "--dispatch sequential` process (the default: the decode request once the prefill "
        "answered) in front of the same engines. The decode-first deployments have engines "
        "of their own (the same code; they idle while the others run), and so does one "
        "engine: a fourth deployment's decode engine, serving whole requests (not the "
        "first deployment's, which the proxies' requests keep busy). At 1, 8 and 32 "
        "clients at "
        "once (at 1 client the targets take turns request by request, in an order that "
        "rotates by prompt, each prompt "
        f"{sv.get('passes_at_1_client', 1)} times; at 8 and 32 clients every prompt once "
        f"per target in each of {sv.get('rounds', 1)} rounds, the targets taking turns in "
        "an order that rotates by round). Time to first token: median (at 8 and 32 "
        "clients, the median of the rounds' medians); tokens/s: the median over the "
        "rounds, and its ratio the median of the rounds' own ratios (each round's below); "
        "added: over one engine's.",
        "",
        _table(header, rows),
        "",
        "On one 2-core machine with a model this small, disaggregation can only "
        "cost: every request adds an exchange with the prefill engine and the pull "
        "(and, through a proxy, one more exchange and a relay of every token), and "
        "the engines share the same cores. What it buys -- decode steps that never "
        "wait behind another request's long prefill -- needs engines on separate "
        "hardware and a model whose prefill takes time.",
        "",
    ]
    out += [
        "Each round's tokens/s over one engine's in the same round:",
        "",
        _table(
            ["clients", *short],
            [
                [clients]
                + [" ".join(map(str, by_target[name].get("round_ratios", []))) for name in names]
                for clients, by_target in sv["by_clients"].items()
                if clients != "1"
            ],
        ),
        "",
    ]
    cpu_rows = []
    for clients in sv["by_clients"]:
        if clients == "1":
            continue
        by_target = sv["by_clients"][clients]
        for name in names:
            ratios = sv["ratios"][name]
            ratio = ratios["cpu_per_token_ratio"][clients]
            cpu_rows.append(
                [
                    clients,
                    SERVE_TARGETS[name],
                    by_target[name]["server_cpu_ms_per_token"],
                    by_target[one_engine]["server_cpu_ms_per_token"],
                    by_target[name]["client_cpu_ms_per_token"],
                    ratio,
                    round(1 / ratio, 2),
                    ratios["tokens_per_s_ratio"][clients],
                    by_target[name]["machine_busy"],
                ]
            )
    out += [
        "What bounds tokens/s with many clients: the machine's CPU. Each row "
        "gives a token's CPU time (the mean over the rounds) in the serving processes "
        "(`trio-pd serve`'s "
        "process tree -- proxy and engines --, the second proxy, and the two decode-first "
        "deployments' process trees; the idle ones cost next to nothing) and in this "
        "benchmark's client, "
        "disaggregated and on one engine, and how busy the whole machine was. When the "
        "machine is saturated, tokens/s can reach at most one engine's divided by the "
        "CPU ratio (its inverse, next to the measured ratio).",
        "",
        _table(
            [
                "clients",
                "path",
                "server CPU/token, ms",
                "one engine, ms",
                "client CPU/token, ms",
                "CPU ratio",
                "tokens/s bound",
                "tokens/s ratio",
                "machine busy",
            ],
            cpu_rows,
        ),
        "",
    ]
    out += _ttft_breakdown(sv, names, overhead)
    best = names[0]  # (the decode-first engine: the path built for these goals)
    one_client = sv["by_clients"]["1"]
    others = ", ".join(
        f"{SERVE_TARGETS[n]} +{sv['ratios'][n]['ttft_added_ms']['1']:.1f} ms" for n in names[1:]
    )
    added = sv["ratios"][best]["ttft_added_ms"]["1"]
    ratio = one_client[best]["ttft_p50_ms"] / one_client[one_engine]["ttft_p50_ms"]
    checks.append(
        _goal(
            "time to first token, disaggregated, 1 client (p50)",
            f"{SERVE_TARGETS[best]} +{added:.1f} ms (x{ratio:.2f}; {others})",
            added <= 2.0,
        )
    )
    for clients in ("8", "32"):
        if clients in sv["by_clients"]:
            got = sv["ratios"][best]["tokens_per_s_ratio"][clients]
            others = ", ".join(
                f"{SERVE_TARGETS[n]} {sv['ratios'][n]['tokens_per_s_ratio'][clients]}"
                for n in names[1:]
            )
            checks.append(
                _goal(
                    f"tokens/s disaggregated vs one engine, {clients} clients",
                    f"{SERVE_TARGETS[best]} {got} ({others})",
                    got >= 0.95,
                )
            )
    return out


def _ttft_breakdown(
    sv: dict[str, Any], names: list[str], overhead: dict[str, Any] | None
) -> list[str]:
    """Benchmark 11's time to first token at 1 client, phase by phase."""
    split = sv["ttft_breakdown_ms"]
    one = split["one engine"]
    rows = []
    for key, label in TTFT_PHASES.items():
        values = [split[name].get(key) for name in names]
        o = one.get(key)
        rows.append(
            [label]
            + ["" if v is None else v for v in values]
            + ["" if o is None else o]
            + ["" if v is None else round(v - (o or 0.0), 3) for v in values]
        )
    rows.append(
        ["**time to first token** (mean of the middle 80%)"]
        + [split[name]["ttft"] for name in names]
        + [one["ttft"]]
        + [round(split[name]["ttft"] - one["ttft"], 3) for name in names]
    )
    short = [SERVE_TARGETS[name] for name in names]
    header = ["phase", *short, "one engine"] + [f"added, {n}" for n in short]
    lines = [
        "Where the time to first token goes at 1 client "
        f"({sv.get('passes_at_1_client', 1) * sv['prompts']} requests to each target, "
        "taking turns), in ms: each phase's mean over the middle 80% of the requests "
        "by time to first token, so the rows add up to the last one. From each "
        "answer's `Server-Timing` (the engines' phases, the prefill and decode "
        "requests of the proxy or the decode-first engine) and the client's clock "
        "(when the headers and the first token arrived). A proxy sends its headers "
        "once the decode engine's answer started, so its first row is the client's "
        "request to it and the proxy's own work; for one engine it is the whole HTTP "
        "exchange and the engine's request handling; a decode-first engine sends its "
        "headers with the first token once it holds the blocks (its first row: the "
        "client's request and the engine's own work; it has no decode request, "
        "and admission and the pull come after its first token). With concurrent "
        "dispatch the decode request went out during the prefill: its row counts "
        "from its second line (the parameters) to its answer. The prefill engine "
        "computes the first token (the prompt's last position), so a decode engine "
        "behind a proxy sends it as soon as it pulled, without a decode step (and "
        "one engine's last row holds the step that computes it).",
        "",
        _table(header, rows),
        "",
    ]
    if overhead is not None:
        lines += [
            f"For scale: the proxy's own cost, measured with a do-nothing upstream "
            f"below (benchmark 12), is {overhead['added_p50_ms']} ms at p50 in this run.",
            "",
        ]
    return lines


def _scale_section(sc: dict[str, Any], checks: list[list[str]]) -> list[str]:
    """Section 6 (benchmark ``scale``), and its goal rows."""
    n = sc["engines"]
    rows = [
        [
            mode,
            run["seconds"],
            run["per_engine_ms"],
            run["rss_per_engine_KiB"],
            run["decoder_cpu_per_engine_ms"],
            run["producers_cpu_per_engine_ms"],
        ]
        for mode, runs in sc["modes"].items()
        for run in runs
    ]
    checks.append(
        _goal(
            "1024 engines handshaked from one decoder",
            f"{sc['all_handshaked_s']} s ({n} engines)",
            n >= 1024 and sc["all_handshaked_s"] < 10,
        )
    )
    checks.append(
        _goal(
            "decoder memory per engine, 1024-engine storm",
            f"{sc['decoder_rss_per_engine_KiB']} KiB (NIXL alone: "
            f"{sc['raw_nixl_rss_per_engine_KiB']} KiB)",
            n >= 1024 and sc["decoder_rss_per_engine_KiB"] < 16,
        )
    )
    return [
        "## 6. Scale",
        "",
        f"One decoder and {n} prefill engines, each a NIXL agent of its own, "
        f"{n // sc['processes']} to each of {sc['processes']} producer processes "
        f"(started in {sc['producers_start_s']} s, {sc['producers_rss_MiB']} MiB in all; "
        "UCX over TCP and CMA: the shared-memory transports take 4 MiB per agent). "
        "They poll lazily (every 2 s): each stands for an engine on a host of its "
        "own, and at the default pace 256 of them with an exposure pending already "
        "kept both cores busy. A storm: one notify-only pull per engine, all "
        "started at once on a fresh decoder (a process of its own, so that its "
        "memory growth is its own): each pull handshakes (fetch, checks, load, "
        "connect), then sends one notification; the storm ends when every engine "
        "is `READY`. trio_pd; trio_pd with one load per thread call (the design "
        "before loads queued together went to one thread); NIXL loading the same "
        "agents from one plain thread and notifying each (the anchor); the first "
        "two again, in the other order. Memory: the decoder's RSS growth over the "
        "storm, per engine. CPU: "
        "per engine, the decoder's and the producers' during the storm.",
        "",
        _table(
            [
                "decoder",
                "all handshaked s",
                "per engine ms",
                "memory per engine KiB",
                "decoder CPU per engine ms",
                "producers CPU per engine ms",
            ],
            rows,
        ),
        "",
        f"NIXL's own loads are {sc['raw_nixl_share']} of trio_pd's time per engine "
        f"(medians); one load per thread call took x{sc['one_load_per_call_ratio']} "
        "as long (x1.0-1.34 in the runs made for issue 18: the storm is bound by "
        "the decoder's CPU, and a batch saves the trio loop's turnaround between "
        "two loads, not their CPU). These decoders give a handshake "
        "120 s, because its deadline covers its wait in the load queue (loads run "
        "one at a time); a decoder with the default `handshake_timeout` (5 s) saw "
        f"{sc['default_timeout_failed']} of its {n} handshakes fail "
        f"(storm {sc['default_timeout_s']} s).",
        "",
        "What bounds it: the decoder is CPU-bound, about one core for its "
        "threads together (decoder CPU per engine is about its time per engine). "
        "A profile of the trio thread in a 512-engine storm put 45% of its time "
        "in the metadata fetch (a fresh DEALER socket and its monitor per fetch), "
        "12% in the pulls, 10% in handing loads to the backend, the rest in "
        "trio's scheduling. In the handshake thread the loads are NIXL's "
        "`add_remote_agent` (`make_connection` returns in 0.01 ms: it only starts "
        "UCX's wire-up). Fetching 32 at once instead of 8 gained 5-10% within "
        "this machine's noise (it cost 4 KiB more per engine when each attempt "
        "was a task). Memory: NIXL keeps the anchor's KiB per agent (half of it "
        "from the first notification's UCX buffers). Above it is the storm's "
        "high-water mark, every pull waiting at once (tracemalloc at the peak, "
        "and the allocators' counts, for issue 18): about 4 KiB of Python heap per "
        "engine -- 1.3 of them the benchmark's own pull tasks, 1.6 the frames of "
        "a waiting pull, 0.7 the engine's record and attempt --, about 1 KiB of C "
        "heap because the loads and the notifications run in two threads (two "
        "malloc arenas; the anchor uses one), and 1 MiB once, which UCX allocates "
        "when the decoder's worker is first progressed with a thousand endpoints "
        "(the notification poll). A handshake attempt waits as an entry in a "
        "queue, not as a task: `max_concurrent_fetches` fetch workers serve it; "
        "what waits for the one load thread is each load's request (the agent's "
        "metadata blob and layout), not the whole reply.",
        "",
        f"Then every engine's first 1-block pull, all at once from the first "
        f"decoder, bytes checked: {sc['first_reads_s']} s. A first READ waits for "
        "its producer's worker to progress (UCX finishes the wire-up then), and "
        "these producers poll every 2 s; at the default pace a first READ right "
        "after the handshake took 1 ms.",
        "",
    ]


FINDINGS = """## What we found

* **NIXL's progress thread kept a core busy per agent.** An idle connector
  used 1.0 core (NIXL starts it with no pause between polls). On 2 cores that
  starved everything: before the fix this page showed 32 ms idle pull
  latency, 0.64x raw-NIXL throughput and 19 ms loop stalls. Agents now run
  without it: the transfer driver advances the agent while it polls, and a
  producer with pending exposures checks for notifications in its
  notification thread. Idle cost: 0.02 core.
* **A consumer's READ waits for the producer's progress.** Tiny READs took
  2.7 ms when nothing drove the producer's agent, 0.5 ms with the
  notification thread. Measured further: a READ without a notification
  takes 20-25 us here, with one 80-130 us, and a READ whose previous
  notification the producer has not processed yet waits for the producer's
  next check, so the producer's pause adds directly to pull latency (a
  1 ms pause: p50 1.1 ms instead of 0.27 ms for pulls 5 ms apart). Hence the
  producer's pacing: every 100 us while reads are expected (0.5 s after
  exposing or a notification), backing off to 2 ms only for stale
  exposures (about 0.05 core instead of 0.17; with a 1 ms cap, 0.05-0.08 in
  session 8's runs: a wake-up costs more than NIXL's check).
* **One transfer driver instead of a thread per pull.** With a thread per
  pull, 4 or 16 concurrent 1 GiB pulls reached 0.48 of raw NIXL with the
  same transfers posted at once: the threads contended for 2 cores and
  NIXL's lock, each sleeping and polling alone. One thread posting every
  chunk and polling all transfers together reaches raw NIXL's rate
  (benchmark 9). On one host `transfer()` *is* the copy (8 MiB take about
  2 ms), so the driver posts at most `max_bytes_per_transfer` (8 MiB) per
  turn and takes new pulls first: a small pull waits for at most one chunk
  of a large one.
* **Batching.** A tiny READ costs NIXL about 80-130 us with its notification,
  whatever its size. Pulls that wait for the driver together go out as one
  READ with one notification naming each: 1000 tiny pulls in flight became
  a handful of READs, and trio_pd's own Python (about 45 us per pull on the
  trio thread: block-id checks, the pull's phases, the hand-off) is now
  what bounds their rate. A sequential tiny pull is an inline read (no
  hand-off); its Python around the READ is what keeps it below raw NIXL
  on the calling thread (which blocks its caller for the whole READ).
* **The garbage collector.** A full collection with torch loaded takes
  20-80 ms on the trio thread and stalls the driver's wake-ups too (it
  showed up as a bimodal in-flight rate: 15k or 6k pulls/s), so the demo
  and these benchmarks call `gc.freeze()` after start-up, as an embedding
  server should, and so do `trio-pd engine` and the proxy (a full
  collection of an engine process's heap took 79-95 ms; after the freeze,
  under 0.1 ms).
* **Descriptor lists from strided rows.** Handing `prep_xfer_dlist` one row
  per region (base, length, stride, count) instead of one per block made a
  64 x 4096-block handshake's NIXL work 0.1 ms instead of 10 ms, and removed
  the GIL hold that stalled the loop. Every NIXL call of a handshake now
  releases the GIL or takes under 0.1 ms (measured with a spinning thread).
* **Releasing a running transfer's handle does not stop it:** NIXL "tries to
  abort", but bytes kept landing afterwards (a test caught it). trio_pd waits
  for the transfer to end before releasing the handle. A transfer that does
  not end (a partitioned peer) is not released at all: the pull fails with
  `TransferError.settled`, and the driver polls the transfer until it really
  ends (its bytes land once the link is back: the across-hosts test shows it).
* **Throughput** is within this machine's noise of raw NIXL: a breakdown run
  of the 1 GiB, 16 KiB-block pull took 163-207 ms through trio_pd and
  178-196 ms raw, interleaved. trio_pd's own cost outside the transfer is
  about 4 ms per such pull (block-id validation and index math in numpy).
* **Head-of-line p99.** The breakdown under benchmark 1 shows where the
  slowest warm pulls go: NIXL's transfer itself (the producer process hosts
  17 engines on 2 cores, and a READ waits for its producer's progress) and
  the wait for the driver thread to run, not trio_pd's Python. With a thread
  per pull, the worst warm pulls had waited for a transfer thread held by
  the cold engines' first pulls; the driver has no such slots. Raw NIXL
  under the same loads (benchmark 1's anchor) has a tail of its own: during
  the storm trio_pd's p99 was x1.14 of raw NIXL's, while its p50 was several
  times raw's -- the fixed cost of a pull, next.
* **A lone small pull's fixed cost, and inline reads.** Spaced 5 ms apart
  (measured outside this benchmark, medians of 200), a pull through the
  driver took 0.64-0.83 ms against 0.24 ms raw: the READ itself as raw, plus
  0.07 ms for the driver thread to wake, 0.11 ms for the task to wake, and
  0.2 ms of Python before the hand-off. That Python took 70 us when pulls
  ran back to back and 260 us after a 5 ms pause (timestamps around each
  step): a CPU coming back from idle runs the same code 3-4 times slower
  (caches, and the idle vCPU), and raw NIXL's loop has far less code to
  bring back. The hand-offs are now gone when nothing else runs: the trio
  thread posts such a READ itself and checks it until done (*inline reads*,
  see [internals](internals.md#inline-reads-when-the-trio-thread-posts-a-read-itself)),
  which benchmark 5 measures side by side with inline reads off. A READ
  with its notification waits for the producer's progress (its
  notification thread checks every 100 us): without a notification a tiny
  READ is done when `transfer()` returns (30 us), with one it takes
  110-170 us, raw or not.
* **Where a sequential tiny pull's microseconds go (issue 33).** Stamps
  (thread CPU clock) at every step of 2000 pulls of 1-4 blocks, confirmed and
  not, raw NIXL's loop beside them, the code before and after the changes
  below run back to back twice (`time.thread_time_ns`; medians of 4 rounds;
  on this VM a thread's CPU clock also counts time the host took the core,
  so each step is 2-5x its cost on a quiet core, where the Python of a pull
  is 50-60 us). Per pull, before -> after, us: entering the pull (local ids,
  token, TP plan, the engine's record) 13-18 -> 14-20; the ready check 4;
  the part's plan (remote ids, descriptor indices, notification) 22-33 ->
  25-35; the lease and bookkeeping before the read 11-12 -> 7-8; the job
  and the inline read's checks 21-23 -> 21-24; NIXL's calls -- prepare 8-10,
  `transfer` 48-57, checking until done 50-110 (the producer's progress),
  release 5 -- as in raw NIXL's loop; the schedule point after an
  unconfirmed read 20-27; leaving the lease 9-10 -> 5; the result 8-12.
  A confirmed pull adds: sending the confirmation 31-44 (64-85 wall: a
  ZeroMQ send wakes its I/O thread), the wait for the answer 94-137 (119
  before, in the quieter run: registering the descriptor, sleeping in
  epoll, the wake-up, receiving and decoding), and before the changes a
  schedule point between the READ and that wait (29-31 -> 14-16: now the
  wait is the pull's only one). What changed: one schedule point per
  confirmed pull instead of two or three (the inline read skips its own
  when the confirmation's wait follows; that wait, and a ZeroMQ receive
  that waited -- the producer's answer too -- pass no second one), the
  lease is a plain class entered without an `AsyncExitStack`. That is
  about 20 us of CPU per confirmed pull, 5-10 per unconfirmed one: within
  the noise of a run, and far from halving the trio thread's CPU, because
  most of that CPU is not trio_pd's Python: on a quiet core its Python is a
  third of an unconfirmed pull's CPU, the rest NIXL's calls (the same as
  raw NIXL's loop), and with the confirmation the answer's wait is the
  largest single step. The confirmation is what keeps a confirmed tiny
  pull far from raw NIXL (benchmark 5 shows both side by side): its answer
  takes a side-channel round trip (benchmark 13), 2-3 times a tiny READ,
  and a sequential pull cannot overlap it with anything but its own READ.
  That round trip is close to its floor: benchmark 13 sends the same
  request to a trio process that only echoes it (`benchmarks/zmq_echo.py`),
  and a producer answers within a few hundredths of a millisecond of it
  (section 13 has both); measured outside the benchmarks (medians of 3000, 0.2 ms
  apart), a ZeroMQ round trip between two processes took 0.12 ms with
  blocking sockets on both sides, 0.17 ms with a trio loop on one side and
  0.28-0.30 ms with trio on both, as trio_pd's are: each trio side adds a
  wake-up from `epoll` and a pass of its scheduler. And the unconfirmed
  path, measured alone against raw NIXL's loop (three turns of 2000 pulls,
  nothing else interleaved), ran at x0.90-0.98, its trio thread's CPU per
  pull 129-145 us against raw NIXL's 120-137 us: with four loops taking
  turns of 100 pulls on a busy machine (benchmark 5), the rounds move with
  which loop the other work falls on. Measured again later (benchmark 5's
  sequential part alone, each in a fresh process, 5000 pulls per loop, only
  the turn's size changed), that long-turn figure did not hold as a
  measure: with turns of 1000 pulls the unconfirmed path's median was x1.05
  of raw NIXL's but its rounds went from x0.55 to x1.68 (whichever loop a
  burst of the machine's other load fell on), its CPU per pull 161 us
  against raw NIXL's 157; with turns of 100 (the benchmark's) x0.65 and
  x0.78 in two runs (rounds x0.62-0.89), and with turns of 10 x0.79, x0.74
  and x0.70 in three (each run's rounds within 0.06-0.11 of each other),
  its CPU per pull 1.23-1.33 times raw NIXL's in all five. Interleaved
  finely, the unconfirmed path is about three
  quarters of raw NIXL's loop on this machine: what separates them is the
  pull's own Python and its one schedule point (20-27 us), which raw NIXL's
  loop, a plain loop of NIXL calls, does not have.
  Not done, and measured as the next steps: under load a third of the
  inline reads outlasted `inline_read_spin` (0.5 ms) and went to the
  driver through two thread hand-offs (benchmark 5 counts them); the
  descriptor indices and block-id checks could be cached per request
  shape.
* **A tiny pull's Python, moved beside its READ and cut (issue 33).**
  Stamps (`time.monotonic`, wall) around an unconfirmed pull's steps, raw
  NIXL's loop interleaved with it (turns of 10, 4000 pulls each, medians):
  trio_pd's Python before it posts took 85 us, raw NIXL's about 10 us (its
  two descriptor-index arrays: its 50-60 us up to `transfer()`'s return,
  less NIXL's prepare and `transfer` calls), and trio_pd's schedule point
  after the READ 22 us; from posting until the READ was released, both
  took the same time. (Raw NIXL's loop computes its indices with the same
  `KVLayout.descriptor_indices`, so it gained from the change below too.)
  Where Python runs matters, measured on raw NIXL's loop itself (3000
  READs each, interleaved): 60 us of busy work after
  `transfer()` returned cost the loop nothing per READ (120 us: +18 us),
  the same 60 us before posting +37 us (120 us: +134 us). So an
  unconfirmed inline read now passes its schedule point *while its READ
  runs*, between posting and checking it (the inline reads' `start` and
  `finish`; the driver adopts the READ if the other tasks gave it work
  meanwhile, see [internals](internals.md#inline-reads-when-the-trio-thread-posts-a-read-itself)),
  and the Python before posting lost what it could: the run-queue check
  reads trio's queue length (`current_statistics()` also walks every
  registered file descriptor: per pull, in a server with many
  connections), a nonce costs one system call per 64 pulls, a few
  descriptor indices are computed in Python and made one array (each
  numpy call's fixed cost is several times that arithmetic on a core that
  has just run NIXL's), the remote ids are checked without an array, and
  the pulls in flight are a plain count (trio_util's `AsyncValue` walked
  its waiters on every change). After: 57-62 us before posting, 2 us
  after the READ, the median ratio x0.83 and x0.91 against raw NIXL in
  that harness (before: x0.62 and x0.65, run beside them). Benchmark 5
  (section 5) had given x0.63-0.70 with its four loops; alone, it gave
  x0.81, x0.85 and x0.87 three times in a row after the changes, the
  trio thread's CPU per pull 1.11-1.14 times raw NIXL's (1.23-1.33
  before); in two full runs x0.835 and x0.769 (rounds from x0.66 to
  x0.92: which loop the machine's other load falls on still moves a
  round more than this did). What still separates them is that Python before posting,
  45-50 us more than raw NIXL's own. A confirmed pull gains from the cut
  but not from the overlap (its schedule point is its answer's wait,
  after the READ), and the issue's "trio-thread CPU per pull halved" is
  out of reach this way: most of that CPU is NIXL's calls and the check
  until done, which raw NIXL's loop spends too.
* **A tiny pull's time comes in whole producer checks (issue 33).** Stamps
  (`time.perf_counter_ns`, wall) at a pull's entry, its posting, `transfer()`'s
  return, DONE and its return, raw NIXL's loop interleaved (turns of 200, 4000
  pulls each), on a slower day of this VM (raw NIXL's loop about 300 us a
  pull): the time from one pull to the next is not spread around a mean but
  falls in modes about 175 us apart -- raw NIXL's loop mostly 250-350 us,
  trio_pd's a quarter at 225-325 and the rest at 400-525 us. A READ ends at
  one of the producer's checks (its notification thread's `get_new_notifs`
  every `poll_interval`, 100 us, plus the check itself and the sleep's
  lateness on this VM): a pull whose own work -- Python before posting, NIXL's
  prepare and `transfer`, Python after DONE -- ends after the check it could
  have made waits for the next. Measured on raw NIXL's loop itself (one run,
  turns of 200 pulls), busy work before posting did not cost in proportion:
  +20 us of it cost +38 us a pull, +40 +23, +60 +2, +80 -38, +100 +111, +120
  +106. trio_pd's own work was about 90 us a pull more than raw NIXL's (before
  posting 83-85 us against 28-30, after DONE 28-29 against 7), on that step.
  Cut since, each measured by the same stamps: one remote rank's transfer
  runs in the pull's own frame (no list of parts, no group to wait in, no
  wrapper), the lease table is not looked up (hashing the parameters) while
  nothing is held, the TP-size and token checks are skipped when they cannot
  fail, a job's two events are made only when the driver takes it (an inline
  read that ends on the trio thread never waits on them), leaving a lease
  makes no second coroutine, and the block-id error messages are put
  together only for an error. After: 67-71 us before posting, 20-21 after
  DONE; the median time between pulls went from 434-465 to 320-333 us (raw
  NIXL's 293-309 beside them), and benchmark 5 alone from x0.73 and x0.76
  (that morning) to x0.89 and x0.92, the trio thread's CPU per pull from
  410-419 us to 303-314 (raw NIXL's calls: 291-308). In two full runs
  (`nox -s bench`, 877 and 815 s), x0.931 with rounds from x0.893 to x1.152
  (8ad7c98), then x0.877 with rounds from x0.875 to x0.935 (59a8d17, the same
  data path), the trio thread's CPU per pull 352 and 346 us against raw
  NIXL's 323 and 320, and the next day x0.891 with rounds from x0.848 to
  x1.051 (2a06bb5, the same data path; the page's run until e4a9dd9): at the goal,
  not clear of it. So
  the ratio measures whether trio_pd's Python fits in the producer's check
  cycle on the day's machine, not trio_pd's CPU against raw NIXL's: a producer that answered
  at once would leave that Python uncovered (about 1.8 times raw NIXL's own
  work between READs here). Not kept: both sides' descriptor indices made
  as one array (no change measurable).
* **A handshake storm's loop stall is the kernel's run queue (issue 33).**
  Benchmark 3's monitor now reads the trio thread's scheduler statistics
  (`/proc/<pid>/task/<tid>/schedstat`) at both ends of every batch
  (`LoopStallMonitor(run_queue=True)`), so each longest batch splits into
  the thread's own CPU, its wait for a core and what is left (the GIL, a
  lock). In the page's run of 2a06bb5, the median stall was
  3.436 ms: 0.934 ms of the trio thread's CPU and 3.09 ms ready to run but
  waiting for a core; in the row with the NIXL calls on the trio thread,
  11.6 ms of 14.5 were its own CPU. Timing every task step the same way
  (outside the benchmark) put the long steps in a metadata fetch's socket
  set-up or a pull's step: 1.5-5 ms of wall each, 0.3-0.7 ms of CPU, the
  rest in the run queue. In one storm (about 70 ms) the trio thread ran
  25-32 ms and waited as long; trio's worker thread that loads the agents
  ran 18-22 ms, ZeroMQ's I/O thread 4-5, the transfer driver 4-7, with the
  producer's 8 engines on the same 2 cores. The GIL is not it: the rest is
  about 0. Tried and not kept: the loading thread at nice 19 (one
  interleaved run of 14 rounds each: median stall 3.96 -> 3.10 ms, but the
  bare loop's floor fell with it, 3.07 -> 1.87 ms, and above the floor
  stayed 0.99 -> 0.93 ms; a thread of trio's cache stays niced for whatever
  runs on it next, and a busy loop could starve the loads), and a GIL switch
  interval of 0.5 ms (longer stalls). So what is left of this goal is the
  share-out of two cores among the storm's threads and processes: on a
  machine with a core to spare for the loads the same code stalls for its
  own CPU, under 1 ms here.
* **A storm's longest batches, step by step (issue 33).** Every task step
  of the trio thread timed over storms of benchmark 3 (its CPU clock, and
  the frame where the step suspended): the batches with the most CPU
  (1.3-2.3 ms) hold 7-10 steps of 0.03-0.5 ms each, not one long step --
  the turn of one metadata fetch's socket set-up (0.4-0.5 ms, the largest
  single step), fetch workers woken together by their replies (0.1-0.25 ms
  each: taking the reply and ending their monitor's watch), the monitors'
  events, and the storm's 8 pulls entering together (0.06-0.28 ms each:
  the benchmark starts them in one batch, as requests that arrive together
  would be). ZeroMQ's own calls are about a fifth of the trio thread's CPU
  in a storm (about 30 ms): making sockets 1.8 ms, receiving 1.5, monitors
  1.2, connecting 1.0, sending 0.7, closing 0.6. The largest pull step had
  been the first READ from a newly loaded agent: its `transfer()` finished
  UCX's connection set-up on the trio thread, 0.24-0.64 ms of CPU against
  about 0.05 ms for a later small READ's. That READ now goes to the
  driver's thread (`RemoteAgent.posted`; the next ones go inline as
  before). In one process, 20 rounds of each taking turns: the longest
  batch's CPU 0.97 -> 0.65 ms (medians), the stall 3.74 -> 3.34 ms; above
  the floor 1.01 -> 1.71 ms, because the floors' medians in the same
  rounds were 2.44 and 1.93 ms (the bare loop runs in a process of its
  own, the same for both: 20 maxima do not pin a difference of tenths of a
  millisecond). Tried and not kept: the loading thread as `SCHED_BATCH` (a
  woken batch thread does not preempt the one running; 15 rounds each:
  stall 3.19 -> 4.15 ms, the storm 60 -> 63 ms), and a thread of its own
  for the loads, `SCHED_BATCH` or not (which of two variants ran first in a
  round moved the result by more than the variant did: 1.6 ms above the
  floor when first, 0.3 ms when second), and a short time slice for the
  trio thread (`sched_setattr`, 0.1 ms instead of the kernel's 1.4; 20
  rounds each: stall 3.70 -> 3.47 ms, above the floor 1.33 -> 1.44 ms).
  The first full run with the change (e4a9dd9, the next day) had a stall
  of 4.416 ms, floor 2.403, +1.224 ms above it, against 3.436, 2.03 and
  +0.563 in the run of 2a06bb5; that run put the sequential tiny pulls
  without confirmation at x0.914 (x0.891 then) and one large pull at
  x0.918 of raw NIXL (x1.092 then). The run on this page (32c729b, with
  the turns below, an hour later): 2.547 ms, floor 2.482 ms, 0.074 ms
  under it (the goal met), the tiny pulls x0.911, the large pull x0.955.
  Runs hours apart moved these rows more than either change could. Timing only the steps of over
  0.3 ms of CPU (10 storms) then found three kinds, 0.37-0.42 ms each: a
  fetch's socket set-up, a fetch's close and the reply's decoding after
  it, and a pull's step that made its confirmation channel and went on to
  send and post. The set-ups take turns, one per scheduler pass
  (`SocketSetups`), but what a task did right after its turn shared the
  next turn's pass. A turn now ends with a schedule point of its own
  before the next task's turn begins: in one process, 24 rounds of each
  taking turns, the longest batch's CPU 0.77 -> 0.63 ms (medians), the
  stall 3.30 -> 3.25 ms, the storm 59.8 -> 60.1 ms (one pass more per
  turn); above the floor 0.77 -> 1.50 ms, the floors again apart (2.59
  and 2.12 ms). So the stall of a storm is now mostly the wait for a core
  (2.6-2.7 ms of it in those rounds, against 0.6-0.8 ms of the trio
  thread's CPU), and within 0.5 ms of the floor would need a batch's CPU
  under about 0.3 ms: less than one socket's set-up takes on this VM
  (`zmq_socket`, its monitor and `connect`, 0.4 ms). Not kept either: a
  fetch's set-up split into two turns (the socket and its monitor, then
  `connect`; 24 rounds each: the longest batch's CPU 0.74 and 0.75 ms).
* **An inline read's check is not where its CPU goes (issue 33).** An
  inline read checks its READ (`check_xfer_state`) in a loop until it ends,
  as raw NIXL's loop does. Sleeping 20 us between checks instead (timer
  slack 1 ns on the trio thread; benchmark 5 alone, two runs each way,
  taking turns): the trio thread's CPU per unconfirmed pull 319 -> 302 and
  322 -> 301 us, the ratio to raw NIXL's loop x0.945 -> x0.703 and x0.898
  -> x0.795. So the loop costs little CPU on this VM (a sleep's wake-up
  costs about what the checks it replaces did), and every microsecond of
  sleep past the READ's end is latency. Not kept. The trio thread's CPU
  per unconfirmed pull is now 1.02-1.05 times raw NIXL's own calls (293
  against 279 us in the run on this page): halving it would mean halving
  NIXL's.
* **Sleeps that end on time.** The transfer driver and the producer's
  notification thread sleep `poll_interval` (100 us) between checks; with
  Linux's default 50 us timer slack each sleep took about 170 us. Both
  threads now set their own slack to 1 ns (118 us). Raw NIXL's sequential
  loop gained the most from it (its producer answers sooner): benchmark 5's
  raw rate rose from about 3500 to about 5400 pulls/s, trio_pd's from about
  2700 to about 3100.
* **P/D latency: no fixed waits, but three processes per request.** Looked
  for on the way to a disaggregated request's first token: the proxy reuses
  one connection per engine (checked with `ss` after 30 requests), every
  socket has `TCP_NODELAY` (trio's default, on both sides), a decode
  engine's hold sends nothing (lease heartbeats go at most once a second,
  not per request), the step loop has no pause, and whole JSON answers now
  carry `Content-Length` (hypercorn chunked them: one write more, and one
  read more for the proxy). What P/D adds is benchmark 11's breakdown: two
  HTTP exchanges more, the prefill engine's request handling, expose and
  hold (about 0.2 ms each) and the pull (the READ; an inline read when the
  decode engine has nothing else to run, else two thread hand-offs around
  it). The proxy's two exchanges alone cost benchmark 12's
  2.2-2.9 ms in one process, more than the goal's 2 ms; across processes on
  these 2 shared cores each hop also waits for a core, which is most of the
  prefill and decode rows. The prefill engine's notification thread polls
  every 100 us from expose until the read (each `time.sleep(100 us)` took
  about 165 us and 20 us of CPU: the kernel's 50 us timer slack, now set to
  1 ns for these threads, see above).
* **What one HTTP exchange costs, and what would take one off the path.**
  A do-nothing hypercorn app in another process answered httpx2 in 1.24 ms
  at p50, and a raw-socket client in 0.57 ms: httpx2's side of an exchange
  is about 0.7 ms of Python, hypercorn's about 0.5 ms. A cProfile of
  benchmark 12 puts almost all of the proxy's time in httpx2, httpcore,
  h11, hypercorn and trio's scheduler; the proxy's own functions are a
  small share. Through `trio-pd serve` the decode request's READ was an
  inline read every time, but it waited 0.2-0.85 ms for the prefill
  engine's notification thread (four processes on 2 cores), so 10 of 25
  sampled outlasted the 0.5 ms spin and went to the driver. Two
  designs would take work off the path. The first is built: with
  concurrent dispatch (`--dispatch concurrent`; not the default) the proxy
  sends the decode request at the same time as the prefill (as SGLang's
  P/D router does), once the prefill request is written, its
  `kv_transfer_params` following as a second line of the same request
  body ([serving](serving.md#the-proxy)). It hides the decode request's
  sending and parsing behind the prefill, but not its answer: measured
  with hypercorn and httpx2 in one process, the answer came 1.13 ms after
  the second line against 1.54 ms for the whole request sent then, so
  about 0.4 ms per request. On this machine it was no faster: in two runs
  of benchmarks 11 and 12 alone while other work kept the load average at
  2-5, the time to first token at 1 client was 24.7 and 40.4 ms concurrent
  against 24.9 and 43.4 ms sequential (one engine: 10.1 and 11.9 ms), and
  in two full runs +19.5 and +11.4 ms over one engine against +17.2 and
  +11.2 ms sequential; at 8 and 32 clients the two swapped places between
  runs. On a shared 2-core machine overlapping two processes' work only
  moves CPU time. So sequential dispatch stays the default (the simpler
  path, and one whose decode engine that dies is passed over before the
  prefill's exposure waits on it), and concurrent is there to measure on
  engines with their own hardware. The decode engine takes no KV blocks before its parameters
  come: admitting it early deadlocked both pools under overload (decode
  blocks waiting for prefills that waited for prefill blocks held by
  exposures whose decodes waited for those decode blocks). With concurrent
  dispatch a decode engine that dies while the prefill runs leaves the
  prefill's exposure to its lease, as a sequential decode engine that dies
  after taking its request does.
* **Decode-first engines and the prefill's first token (issue 33).** The
  second design is built: a decode engine started with `--prefill-url`
  calls a prefill engine itself (as NVIDIA Dynamo's decode workers do), so
  a request makes one exchange between engines instead of the proxy's two,
  and its tokens go to the client without the proxy's relay (one HTTP
  chunk more per token through one more process). And the prefill engine
  now runs the prompt's last token too: its answer carries the first
  token, which a decode-first engine streams as soon as it holds the
  blocks -- before its admission, the pull and any decode step -- while a
  decode engine behind a proxy sends it once it pulled, without a decode
  step (behind a proxy the answer still starts after the pull, so that an
  exposure that ended stays a 409 the proxy answers by prefilling again).
  Section 11 measures the paths side by side. A decode-first engine faces
  clients, so it refuses `kv_transfer_params` from them (a replay must
  not end another request's exposure: the refusal abandons nothing); it
  takes client keys, sends the internal key to its prefill engines, and
  gives an exposure back at once if its request ends before it held it
  ([serving](serving.md#decode-first-engines)).
* **The prefill channel (issue 33).** Over HTTP, a decode-first engine's
  prefill request was most of what its first token waited for beyond one
  engine's: timestamps (`time.perf_counter`, one clock for every process)
  at each step of 400 requests put 3.2-3.6 ms of the prefill request
  outside the prefill engine's forward, admission and expose, where a
  do-nothing answer from hypercorn took 1.7 ms to a plain client; a
  profile of the prefill engine put a fifth of its trio thread in
  hypercorn's h11 writes alone. Now the engine takes the same request over
  a kept TCP connection, one frame each way, answered by its own ASGI
  application in process ([serving](serving.md#the-prefill-channel));
  the proxy sends its prefills there too (section 11's proxy rows).
  ZeroMQ was built first and measured: a round trip between two trio
  processes took 0.57-0.66 ms over ZeroMQ against 0.23-0.25 ms over a
  plain trio stream (2000 of each, interleaved: ZeroMQ's I/O threads add
  two wake-ups to each direction), and the prefill request's transit was
  0.52 ms out and 0.42 ms back against 0.22 and 0.16. The rest of what the
  request waited for, step by step (p50 of 330 requests, wall clock, ms):
  from its arrival to the application 0.24, then 0.12 once the task that
  read a request runs it at once (reading goes on in a fresh task); the
  application before the forward 0.33-0.39 and after it 0.39-0.64 (expose,
  the answer); the answer's write 0.38, then 0.10 once a frame goes to the
  socket at once when no other is being written (a lock taken and
  `send_all` were two schedule points, each a wait on a busy loop); the
  hand-off to the forward's worker thread and back 0.46-0.75 -- once per
  request now: the prompt's two steps (all but its last token, then that
  token) run in one trip to the thread instead of two, and a request from
  the channel is cancelled by the channel itself rather than by a task
  watching for its disconnect (a nursery and a task per request, about
  0.3 ms of the trio thread). In all, the prefill request's time outside
  the forward went from 3.1 ms (ZeroMQ, before these) to 2.0 ms. Side by
  side at 1 client, outside the benchmarks (300 requests to each of three
  deployments, taking turns, twice, the machine busy with other work): the
  decode-first engine over its channel +1.8 and +2.3 ms over one engine,
  over HTTP +4.2 and +4.5 ms. What is
  left is waiting, not Python: on 2 cores shared by five busy processes,
  each step that needs another process or thread to run waits for a core.
* **Where a decode-first first token still waits (issue 33).** Timestamps
  (`time.perf_counter`, one clock for every process) at each step of 300
  streamed requests to a decode-first deployment, beside a second one and
  one engine taking turns (a synchronous httpx2 client; medians, ms): the
  client's request until the decode-first engine's application has it
  1.39, the request's parsing and checks 0.41 (as on one engine), building
  the prefill request 0.07, the prefill request 6.06 (the prefill engine's
  admission, forward and expose 4.58 of it), reading its answer 0.14, from
  there to the hold and through it 0.25 (the hold 0.11), the headers'
  write 0.41 (hypercorn's `send` of them: it wakes the client), the first
  token's 0.21, and 0.85 from that write until the client had parsed the
  token. One engine's headers leave before the step that computes its first
  token, so its client handles them while that step runs; a decode-first
  engine's leave with the first token, so the client's own handling of the
  headers is on the path. Two changes were measured in this setting and
  not kept: the headers and the first token in one write (hypercorn patched
  for the experiment) left the time from the hold to the client's first
  token where it was (1.44 against 1.46 ms): the client's handling of what
  it gets bounds it, not the writes; and the headers sent as soon as the
  request was accepted, before its prefill, saved 0.13 ms but answers 200
  before a prefill that can still fail (its 502s and 503s would become
  errors inside the stream) and without the prefill's `Server-Timing`. In
  the same setting decode-first measured +1.84 to +2.08 ms over one engine
  in seven runs; a cProfile of the prefill engine puts its expose at about
  75 us of the trio thread's CPU (the token's HMAC, the block ids, the
  records), each in the tens of microseconds.
* **Section 11's anchor was a busy engine (issue 33).** One engine, the
  anchor of every disaggregated row, was the first deployment's decode
  engine, which both proxies' requests also ran on, and at 1 client its
  request always came right after the sequential proxy's: its process was
  warm, the decode-first deployments' engines had idled while four other
  requests ran. Now one engine is a fourth deployment's decode engine,
  idle while the others run as theirs are, and the 1-client turns rotate.
  In a full run with the old anchor (only the turns' rotation in), one
  engine's time to first token was 7.97 ms at 1 client and decode-first
  added 2.51 ms; in a section-11 run with its own engine, 10.94 ms and
  1.58 ms: the anchor had been about 1 ms ahead for being busy.
"""


SOAK_HEADING = "## Soak across hosts"

MUST_BE_ZERO_NAMES = {
    "wrong_bytes": "wrong bytes (pulled bytes that differ from what the producer wrote)",
    "late_writes": "late writes (a decode block written after its pull ended and settled)",
    "hangs": "hangs (an operation past its documented bound)",
    "stranded_exposures": "stranded exposures (pending on a producer after the drain period)",
    "stranded_decode_blocks": (
        "stranded decode blocks (unsettled or not returned after the settle period)"
    ),
    "valid_failed_by_forged": "valid requests failed by forged ones",
    "unexplained_failures": "valid requests failed with no fault to explain it",
    "unreachable_after_start_in_cut": (
        "valid requests failed because their producer started while its link was cut "
        "(unreachable for its life: the bug this soak found, fixed since)"
    ),
    "forged_accepted": "forged requests that succeeded",
    "unexpected_errors": "unexpected errors (exceptions no operation documents)",
}


def render_soak(r: dict[str, Any]) -> str:
    """The soak's section of docs/performance.md (``benchmarks/soak.py``'s result)."""
    m, p, f, c = r["machine"], r["pulls"], r["faults"], r["config"]
    cancel = "-".join(f"{s * 1e3:g}" for s in c["cancel_after"])
    cut = "-".join(f"{s:g}" for s in c["cut_for"])
    zero = r["must_be_zero"]
    verdict = "every must-be-zero count is 0" if r["ok"] else "**FAILED: see the counts**"
    out = [
        SOAK_HEADING,
        "",
        f"{r['date']}, {r['run_seconds']:g} s, seed {r['seed']}: {verdict}. Machine: "
        f"{m['cpu']}, {m['cores']} cores, {m['memory_GiB']} GiB, Python {m['python']}, "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + f". Command: `{r['command']}` (`nox -s soak`; `nox -s soak -- --seconds N` for a "
        "shorter run, `--seed S` to repeat one).",
        "",
        f"{c['hosts']} prefill engines, each a process of its own in a test host "
        "(a network namespace behind a veth link; the last link limited to "
        f"{c['slow_link']}), and a decoder in the root namespace; UCX over TCP "
        f"(link traffic {', '.join(f'{mb:g} MB' for mb in r['link_MB'])}), real ZeroMQ "
        f"side channels, signed exposures. {c['clients']} clients pull at once "
        f"(held or not, cancelled after {cancel} ms or not, or abandoned), verifying every "
        f"byte, while producers are killed and restarted ({f['producer kills']} kills) and "
        f"links cut for {cut} s ({f['link cuts']} cuts, {f['seconds cut']:g} s in all), and "
        f"{c['forgers']} forgers send forged requests. Each operation runs under "
        "its documented bound (`benchmarks/soak_ledger.py`: pull "
        f"{r['bounds_s']['pull']:g} s, abandon {r['bounds_s']['abandon, hold exit']:g} s, "
        f"wait_settled {r['bounds_s']['wait_settled']:g} s after the pull); a valid request "
        "that fails is classified by the fault timeline (its producer killed, or its link "
        f"cut, within its run or {r['bounds_s']['fault aftermath']:g} s before it), never "
        "by its error.",
        "",
        _table(["must be 0", "count"], [[MUST_BE_ZERO_NAMES[k], v] for k, v in zero.items()]),
        "",
        _table(
            ["pulls", ""],
            [
                ["succeeded (bytes verified)", p["succeeded"]],
                ["per second", p["per_second"]],
                ["MB/s", p["MB_per_second"]],
                ["latency p50 / p99 / max, ms", f"{p['p50_ms']} / {p['p99_ms']} / {p['max_ms']}"],
                ["cancelled mid-way", p["cancelled"]],
                ["ended with a transfer still running (settled later)", p["ended_unsettled"]],
                [
                    "read, but the exposure expired in a fault (notification lost)",
                    p["read_but_expired_in_a_fault"],
                ],
                [
                    "read after its lease ran out (not held, pulled late)",
                    p["read_after_its_lease_ran_out"],
                ],
            ],
        ),
        "",
        "Valid requests that failed because of a fault (expected):",
        "",
        _table(
            ["cause: operation: error", "count"],
            [[k, v] for k, v in r["expected_failures"].items()] or [["(none)", 0]],
        ),
        "",
        "Forged requests (kind -> how they failed):",
        "",
        _table(["forgery -> result", "count"], [[k, v] for k, v in r["forged"].items()]),
        "",
        "Exposures: "
        + ", ".join(f"{k} {v}" for k, v in r["exposures"].items())
        + ". Requests by how they were consumed: "
        + ", ".join(f"{k} {v}" for k, v in r["modes"].items())
        + ".",
        "",
    ]
    if zero.get("unreachable_after_start_in_cut"):
        out += [
            f"**A bug this run found:** {f['producer starts during a cut']} producer(s) "
            "started while their link was cut. A NIXL agent whose UCX context starts "
            "while the host's interface is down advertises loopback only; once the link "
            "is back, its side channel answers but every consumer's `add_remote_agent` "
            "fails (`NIXL_ERR_BACKEND`, UCX: destination unreachable), for the life of "
            "the producer process: its requests fail until it is restarted. (Fixed "
            "since: the connector waits for the interface of its advertised address "
            "before creating the agent, `interface_timeout`; the next soak run "
            "replaces this section.)",
            "",
        ]
    if r.get("findings"):
        out += [
            "Bugs found outside the connector, in `trio_pd.testing` (reported, not counted "
            "above: the soak treats them as what they should have been):",
            "",
            _table(["finding", "count"], [[k, v] for k, v in r["findings"].items()]),
            "",
        ]
    if r["notes"]:
        out += ["Notes from this run (the first of each kind):", ""]
        out += [f"* `{n[:300]}`" for n in _first_of_each_kind(r["notes"], 3)[:20]] + [""]
    return "\n".join(out)


def _first_of_each_kind(notes: list[str], keep: int) -> list[str]:
    """``notes``, at most ``keep`` of each ``"cause: operation: error"``."""
    seen: dict[str, int] = {}
    kept = []
    for note in notes:
        parts = note.split(": ")
        kind = ": ".join(parts[:3]) if len(parts) > 3 else note
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= keep:
            kept.append(note)
    return kept


def replace_soak_section(page: str, soak: dict[str, Any]) -> str:
    """``page`` with its soak section (the last one) replaced by, or ended with, ``soak``'s."""
    head = page.split("\n" + SOAK_HEADING + "\n", 1)[0].rstrip("\n")
    return head + "\n\n" + render_soak(soak)


if __name__ == "__main__":
    with open(sys.argv[1]) as results_file:
        print(render(json.load(results_file)))
